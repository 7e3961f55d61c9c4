"""The real shutdown path of a Kubernetes spot reclaim, on this machine: SIGTERM to the `ray start
--block` process of a worker node hosting a rank (what the kubelet sends a KubeRay worker pod's main
process). Ray's handler asks the GCS to drain the node (reason PREEMPTION, deadline
``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S``) and stops the node's processes at the deadline.

Asserted for a job sent by `ray job submit` (its driver, `syncpoint run` on the head, finds the
cluster by the address the Job API gives it: the path of `syncpoint run --address` too): the notice
reaches the loop through ``ray.train.get_preemption_info()``; a state is committed at the next
boundary, before the node is gone; the failure is charged to the preemption budget (the run has
``failure.max_failures: 0``); the run resumes with 0 optimizer steps lost and ends at the digest
of the uninterrupted run; the job's ``scaling.env`` reached every rank on a node that `ray start`
began (it inherits nothing from the driver), and its secret-named value was never printed or written.

The cluster: a head with no CPUs (`ray start --head`) and one `ray start --block` process per worker
node, started and stopped by the test's own process ids (tests/ray_processes.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from syncpoint.orchestrator.timeline import restarts
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import LM_SHRUNK, ROOT, digest, lm_spec, state_names
from tests.ray_processes import BIN, DRAIN_S, add_worker_node, drain_env
from tests.ray_processes import events as _events
from tests.ray_processes import wait_for_driver as _wait_for

# ~400 micro-steps paced at 50 ms: ~20 s of wall time and little CPU after the notice; the first
# micro-batch is held (``hold_until``) until the notice is sent, so it lands mid-run however long the
# replacement node takes to join (on a loaded machine the unheld run once ended before it did)
LENGTH = ["task.config.num_samples=1600", "train.epochs=1"]


# the run: paced (numerics unchanged), no application-error retries, saves only when a notice asks
RUN = [
    *LENGTH,
    "failure.max_failures=0",
    "checkpoint.save_every={value: 0, unit: micro_steps}",
    "task.path=tests.tasks:paced_lm",
    "task.config.pace_s=0.05",
]
# what tests.helpers.lm_spec sets on the example, for the job `ray job submit` runs from examples/tiny_lm.yaml
LM_SPEC = ["scaling.num_workers=2", *LM_SHRUNK]


# scaling.env: a worker node started by `ray start` does not inherit the driver's environment, so what its
# ranks see came through the job; the secret-named one's value must reach them and nothing syncpoint writes
ENV = {"SYNCPOINT_PROBE_DIR": "/data/owt", "SYNCPOINT_PROBE_TOKEN": "tok-3f9a-never-printed"}


def _overrides(probe: Path, hold: Path) -> list[str]:
    """The job's ENV, each rank writing what it sees of it to ``probe``; its first micro-batch held
    until ``hold`` exists."""
    env = [f"scaling.env={json.dumps(ENV)}", f"task.config.record_env={{to: {probe}, names: {list(ENV)}}}"]
    return [*env, f"task.config.hold_until={hold}"]


def _assert_the_env_reached_every_rank_unprinted(spec, probe, out: str) -> None:
    seen = [json.loads(p.read_text()) for p in probe.iterdir()]
    assert len(seen) >= 3 and all(s == ENV for s in seen), seen  # two ranks, then the resumed attempt's
    secret = ENV["SYNCPOINT_PROBE_TOKEN"].encode()
    # Ray's job supervisor opens the job's log with the entrypoint as typed ("Running entrypoint for job
    # ...: python -m syncpoint run ... --set scaling.env=..."), which `ray job submit` streams back: the
    # user's own command line, which anyone with the Job API reads anyway (docs/security.md: credentials
    # do not travel in a job's entrypoint). Every other line is the driver's and the ranks': never the value.
    printed = "\n".join(ln for ln in out.splitlines() if "Running entrypoint for job" not in ln)
    assert secret.decode() not in printed
    run_dir = Path(spec.run_url.removeprefix("file://"))
    leaked = [p for p in run_dir.rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert not leaked, leaked  # the event log, the states, Ray Train's run directory


def _reclaim_rank_1_node(spec, head, nodes, proc, hold: Path) -> None:
    """Once the attempt started (its ranks held at their first micro-batch), SIGTERM the `ray start
    --block` process of rank 1's node after a replacement node has joined (the autoscaler's part), then
    let the ranks train; assert the node went away within its grace."""
    _wait_for(lambda: bool(_events(spec, "attempt_started")), proc, "a started attempt")
    rank_nodes = _events(spec, "attempt_started")[-1]["nodes"]
    victim = next(n for n in nodes if n.node_id == rank_nodes[1])
    nodes.append(add_worker_node(head, drain_env()))
    victim.proc.send_signal(signal.SIGTERM)
    hold.touch()  # the ranks train on: the notice reaches them at a boundary, ~20 s of paced steps before the end
    victim.proc.wait(timeout=DRAIN_S + 60)  # Ray's handler drains, then stops the node and exits
    nodes.remove(victim)


def _assert_exact_and_cheap(tmp_path, spec) -> None:
    notice = _events(spec, "preemption_notice")[0]
    assert notice["source"] == "ray-drain" and notice["ranks"] == [1]  # from ray.train.get_preemption_info()
    saved = next(e for e in _events(spec, "state_committed") if "preemption" in e["reasons"])
    assert saved["optimizer_step"] - notice["optimizer_step"] <= 1  # committed at the very next boundary
    (failure,) = _events(spec, "failure")
    assert failure["classified"] == "preemption" and failure["decision"] == "RETRY"  # max_failures is 0
    second = _events(spec, "attempt_started")[1]
    assert second["optimizer_step"] >= notice["optimizer_step"]  # 0 optimizer steps lost
    (restart,) = restarts(EventLog(RunStorage(spec.run_url)).journal())
    assert restart.cause == "preemption"
    final = state_names(spec)[-1]
    ref = lm_spec(tmp_path / "ref", *LENGTH, workers=2)  # the example's task, unpaced: the same numerics
    assert run_spawned(ref) == [0, 0]
    assert digest(spec, final) == digest(ref, final)


# make test: a drain through Ray's API on a shared cluster, its notice, the commit at the next boundary and
# the exact resume (tests/ray/test_preemption.py); scaling.env in every worker's runtime env and every spawned
# rank (tests/unit/policies/contracts/spec/test_scaling_job_env.py); `ray job submit` resuming what an
# earlier submission committed (tests/ray/test_job_submit.py)
def test_sigterm_to_ray_start_drains_commits_and_resumes_exactly_through_ray_job_submit(tmp_path, ray_start_cluster):
    head, nodes = ray_start_cluster
    probe = tmp_path / "env-probe"
    probe.mkdir()
    hold = tmp_path / "go"
    overrides = _overrides(probe, hold)
    spec = lm_spec(tmp_path / "run", *RUN, *overrides, workers=2)
    assert spec == lm_spec(tmp_path / "run", *LM_SPEC, *RUN, *overrides, workers=2)  # the submitted job is this spec
    cmd = [f"{BIN}/ray", "job", "submit", "--address", head.address, "--working-dir", str(ROOT), "--"]
    cmd += ["python", "-m", "syncpoint", "run", "examples/tiny_lm.yaml"]
    for s in [*LM_SPEC, *RUN, *overrides, f"storage={tmp_path / 'run'}"]:
        cmd += ["--set", s]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=drain_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _reclaim_rank_1_node(spec, head, nodes, proc, hold)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert "syncpoint: job 'tiny-lm' finished" in out
    _assert_exact_and_cheap(tmp_path, spec)
    _assert_the_env_reached_every_rank_unprinted(spec, probe, out)
