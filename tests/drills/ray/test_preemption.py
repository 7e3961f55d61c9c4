"""Preemption drills on real Ray: two kinds of preemption in one drill, and a drain notice that saves
at the next boundary (the node tests: tests/ray/test_preemption.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

from syncpoint.workers.events import EventLog
from syncpoint.workers.launch import run_spawned
from syncpoint.workers.storage import RunStorage
from tests.helpers import ROOT, digest, state_names
from tests.ray.test_preemption import _events, _node_of_rank, _spec, _start, _wait_for


# the drill first: it starts its own Ray, before this module's shared cluster exists
def test_drill_with_two_kinds_of_preemption_reports_equality(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--preempt-at",
        "13,30",
        "--how",
        "crash,sigterm",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.config.num_samples=320",
        "--set",
        "train.epochs=2",
        "--set",
        "checkpoint.save_every={value: 4, unit: micro_steps}",
        "--set",
        "train.eval_every=3 optimizer_steps",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match" in out and "final digest: match" in out
    assert "evaluation metrics: match (4 evaluations)" in out  # steps 3, 6, 9 and the end (10)
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and ("crash" in ln or "sigterm" in ln)]
    assert [r[1] for r in rows] == ["crash", "sigterm"]
    assert rows[1][3] == "preemption" and rows[1][5] == "0"  # the noticed preemption lost nothing
    # What happened inside, read from the interrupted run's own event log. 20 micro-steps an epoch,
    # accumulation 4, a state every 4: the crash after 13 (rank 0) resumes from 12; the SIGTERM after
    # 30 (rank 1) is a notice, serviced at the very next boundary (32) and charged as a preemption.
    run = SimpleNamespace(run_url=f"file://{tmp_path}/tiny-lm-drill")
    failures = _events(run, "failure")
    assert len(failures) == 2 and failures[1]["classified"] == "preemption", failures
    assert [a["resumed_from"] for a in _events(run, "attempt_started")] == [None, f"{12:012d}", f"{32:012d}"]
    noticed = [e for e in _events(run, "state_committed") if "preemption" in e["reasons"]]
    assert noticed and noticed[0]["global_micro_step"] == 32


# In make test-all: make test (CI) walks notice -> commit at the next boundary -> exact resume through the
# real path of a drain, SIGTERM to `ray start` (tests/ray/test_ray_start_sigterm.py); this one drains by Ray's API.
def test_drain_notice_saves_at_next_boundary_and_loses_no_optimizer_step(tmp_path, cluster):
    c, nodes = cluster
    # 400 micro-steps paced at 50 ms (~20 s, little CPU): the notice arrives mid-run
    length = ["task.config.num_samples=1600", "train.epochs=1"]
    spec = _spec(
        tmp_path / "run",
        "failure.max_failures=0",
        "checkpoint.save_every={value: 0, unit: micro_steps}",
        *length,
        "task.path=tests.tasks:paced_lm",
        "task.config.pace_s=0.05",
    )
    proc = _start(spec, c.address, {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2"})
    _wait_for(lambda: bool(_events(spec, "attempt_started")), proc)
    time.sleep(1.0)
    victim = _node_of_rank(spec, nodes, 1)
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    deadline = time.time() + 6.0
    accepted, _ = GcsClient(address=c.gcs_address).drain_node(
        victim.node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim",
        int(deadline * 1000),
    )
    assert accepted
    c.add_node(num_cpus=1)  # replacement capacity
    _wait_for(lambda: any("preemption" in e["reasons"] for e in _events(spec, "state_committed")), proc)
    time.sleep(max(0.0, deadline - time.time()))
    c.remove_node(victim, allow_graceful=False)  # the cloud reclaims the node at the notice's deadline
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    notice = _events(spec, "preemption_notice")[0]
    saved = next(e for e in _events(spec, "state_committed") if "preemption" in e["reasons"])
    assert saved["global_micro_step"] >= notice["global_micro_step"]
    assert saved["optimizer_step"] - notice["optimizer_step"] <= 1  # serviced at the very next boundary
    second = _events(spec, "attempt_started")[1]
    assert second["optimizer_step"] >= notice["optimizer_step"]  # zero optimizer steps lost
    from syncpoint.orchestrator.timeline import restarts

    (restart,) = restarts(EventLog(RunStorage(spec.run_url)).journal())
    assert restart.cause == "preemption"
    # the window trained on and saved again in its last seconds: at most a step and a save are lost
    assert restart.lost_micro_steps < 2 * spec.train.grad_accum
    assert len([e for e in _events(spec, "state_committed") if "preemption" in e["reasons"]]) >= 2
    final = state_names(spec)[-1]
    ref = _spec(tmp_path / "ref", *length)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    assert digest(spec, final) == digest(ref, final)
