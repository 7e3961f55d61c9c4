"""Preemption on real Ray: notices, node loss, application errors, failure classification.

Multi-node tests use ``ray.cluster_utils.Cluster``: a head with no CPUs (driver and Ray Train
controller), two worker nodes with one worker each. The driver is ``syncpoint run --address`` in
a subprocess; the test plays the cloud (drains, kills and replaces nodes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import yaml

from syncpoint.workers.events import EventLog
from syncpoint.workers.launch import run_spawned
from syncpoint.workers.storage import RunStorage
from tests.helpers import ROOT, digest, lm_spec, state_names

pytestmark = [pytest.mark.slow, pytest.mark.ray]

COMMON = ["task.config.num_samples=240", "train.epochs=2", "checkpoint.save_every={value: 8, unit: micro_steps}"]


def _spec(tmp, *extra):
    return lm_spec(tmp, *COMMON, *extra, workers=2)


def _start(spec, address: str | None = None, env_extra: dict | None = None) -> subprocess.Popen:
    job = spec.storage[len("file://") :] + "/job.yaml"
    os.makedirs(os.path.dirname(job), exist_ok=True)
    with open(job, "w") as f:
        yaml.safe_dump(spec.model_dump(mode="json"), f)
    cmd = [sys.executable, "-m", "syncpoint", "run", job] + (["--address", address] if address else [])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(env_extra or {})
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _events(spec, kind=None):
    evs = EventLog(RunStorage(spec.run_url)).read_all()
    return [e for e in evs if kind is None or e["kind"] == kind]


def _wait_for(pred, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        if proc.poll() is not None:
            raise AssertionError("driver exited early:\n" + proc.stdout.read()[-4000:])
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out")


def _reference(tmp):
    ref = _spec(tmp / "ref")
    assert run_spawned(ref) == [0, 0]
    return ref


@pytest.fixture(scope="module")
def local_cluster():
    """One multi-node cluster for this module's node tests (starting one costs ~20 s of CPU here).
    Each test leaves it as it found it: a head and two live one-CPU worker nodes (it replaces the
    node it takes away, as the autoscaler would) and no running job (the driver has exited)."""
    from ray.cluster_utils import Cluster

    # fast GCS health checks so a killed node is declared dead within seconds
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4},
        },
    )
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture
def cluster(local_cluster):
    workers = list(local_cluster.worker_nodes)
    assert len(workers) == 2, "a previous test left the shared cluster without two worker nodes"
    yield local_cluster, workers
    local_cluster.wait_for_nodes()


def _node_of_rank(spec, cluster_nodes, rank):
    nodes = _events(spec, "attempt_started")[-1]["nodes"]
    return next(n for n in cluster_nodes if n.node_id == nodes[rank])


# the drill first: it starts its own Ray, before this module's shared cluster exists
@pytest.mark.long
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


def test_hard_node_loss_is_a_preemption_and_resumes_exactly(tmp_path, cluster):
    c, nodes = cluster
    spec = _spec(tmp_path / "run", "failure.max_failures=0")
    proc = _start(spec, c.address)
    _wait_for(lambda: any(e["global_micro_step"] >= 40 for e in _events(spec, "state_committed")), proc)
    victim = _node_of_rank(spec, nodes, 1)
    c.remove_node(victim, allow_graceful=False)  # spot node gone, no notice
    c.add_node(num_cpus=1)  # the autoscaler's replacement
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    failures = _events(spec, "failure")
    assert failures and failures[0]["classified"] == "preemption", failures
    # Lost work measured, not inferred: the node went down while the run trained past its last
    # progress flush; the controller recorded each rank's last heartbeat before the restart.
    from syncpoint.orchestrator.timeline import restarts

    journal = EventLog(RunStorage(spec.run_url)).journal()
    (restart,) = restarts(journal)
    beat = journal.interrupted(1)
    # Seen now and then until 2026-11-30: the board sat on the driver's raylet, which here can be the lost
    # worker node's (the 100-storm lost every reading after its first two-node loss). It now goes on the
    # head (ray_runner.board_node); should it recur, the xfail quotes the controller's reason.
    if beat is None:
        why = [ln for ln in out.splitlines() if "no interruption point measured" in ln]
        pytest.xfail(
            "no heartbeat reading was recorded for the failed attempt: "
            + (why[0] if why else "the controller printed no reason (it did not try)")
        )
    assert restart.measured, _events(spec, "interrupted")
    assert beat.global_micro_step == max(r.global_micro_step for r in beat.ranks)
    assert beat.detected_at >= beat.reached_at and {r.rank for r in beat.ranks} == {0, 1}
    flushed = max(r.global_micro_step for r in journal.progress_of(1))
    assert beat.global_micro_step >= flushed  # the heartbeat knows at least what the flushed progress knew
    assert restart.previous_max_micro_step == beat.global_micro_step
    # measured, so 0 when the node died right at a commit (seen under load: both ranks' last beat was
    # the committed micro-step); otherwise the micro-steps trained past it. tests/test_goodput.py
    # covers the "trained past the last flush" accounting with a hand-built journal.
    assert restart.lost_micro_steps == beat.global_micro_step - restart.resumed_micro_step >= 0
    assert (restart.lost_seconds > 0) == (restart.lost_micro_steps > 0)
    final = state_names(spec)[-1]
    assert digest(spec, final) == digest(_reference(tmp_path), final)


# In make test-all: make test (CI) walks notice -> commit at the next boundary -> exact resume through the
# real path of a drain, SIGTERM to `ray start` (tests/test_ray_start_sigterm.py); this one drains by Ray's API.
@pytest.mark.long
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

    accepted, _ = GcsClient(address=c.gcs_address).drain_node(
        victim.node_id,
        autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim",
        int(time.time() * 1000) + 6000,
    )
    assert accepted
    c.add_node(num_cpus=1)  # replacement capacity
    _wait_for(lambda: any("preemption" in e["reasons"] for e in _events(spec, "state_committed")), proc)
    c.remove_node(victim, allow_graceful=False)  # the cloud reclaims the node
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
    assert restart.lost_micro_steps < spec.train.grad_accum  # every boundary in the grace window committed
    final = state_names(spec)[-1]
    ref = _spec(tmp_path / "ref", *length)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    assert digest(spec, final) == digest(ref, final)


def test_application_error_uses_max_failures_then_fails_with_the_users_error(tmp_path, cluster):
    spec = lm_spec(
        tmp_path,
        "task.path=tests.tasks:failing_loss",
        "task.config={num_samples: 64, fail_at: 5}",
        "train.micro_batch_size=1",
        "train.epochs=1",
        "failure.max_failures=1",
        "train.eval_every=0",
        "checkpoint.save_every={value: 8, unit: micro_steps}",
        workers=2,
    )
    proc = _start(spec, cluster[0].address)  # the module's cluster: no Ray of its own to start
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "bad batch at call 5" in out.splitlines()[-1] or "bad batch at call 5" in out[-2000:]
    failures = _events(spec, "failure")
    assert [f["classified"] for f in failures] == ["application", "application"]
    assert [f["decision"] for f in failures] == ["RETRY", "RAISE"]
    assert len(_events(spec, "attempt_started")) == 2


def test_a_refusal_on_the_workers_fails_the_run_at_once(tmp_path, cluster):
    """A task without an eval set under train.eval_every is refused on the workers: the run stops on the
    first failure (classified refusal, not retried although max_failures allows 3), its last line says why."""
    spec = lm_spec(
        tmp_path,
        "task.path=tests.tasks:failing_loss",
        "task.config={num_samples: 64, fail_at: 1000}",
        "train.epochs=1",
        "failure.max_failures=3",
        "train.eval_every={value: 2, unit: optimizer_steps}",
        workers=2,
    )
    proc = _start(spec, cluster[0].address)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1
    assert "train.eval_every" in out.strip().splitlines()[-1]
    failures = _events(spec, "failure")
    assert [(f["classified"], f["decision"]) for f in failures] == [("refusal", "RAISE")]


def test_no_room_for_the_workers_fails_after_the_placement_bound(tmp_path, cluster):
    """Three workers on a cluster with room for two: Ray Train alone retries the worker-group start
    forever. The run gives up after ``failure.placement_timeout_s`` (each try here times out after 3 s)
    and its last line says why and what to change; the cluster is left as it was (two free nodes)."""
    spec = lm_spec(tmp_path, *COMMON, "failure.placement_timeout_s=8", workers=3)
    proc = _start(spec, cluster[0].address, env_extra={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3"})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "failure.placement_timeout_s (8 s)" in last and "3 workers" in last, last
    failures = _events(spec, "failure")
    assert failures and {f["classified"] for f in failures} == {"placement"}, failures
    assert failures[-1]["decision"] == "RAISE" and all(f["decision"] == "RETRY" for f in failures[:-1])
    assert not _events(spec, "attempt_started")  # no worker ever started, nothing was written but the log
