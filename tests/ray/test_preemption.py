"""Preemption on real Ray: notices, node loss, application errors, failure classification.

Multi-node tests use ``ray.cluster_utils.Cluster``: a head with no CPUs (driver and Ray Train
controller), two worker nodes with one worker each. The driver is ``syncpoint run --address`` in
a subprocess; the test plays the cloud (drains, kills and replaces nodes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from ray._raylet import GcsClient
from ray.core.generated import autoscaler_pb2

from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import ROOT, digest, lm_spec, state_names

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


# The run the node test interrupts twice, long enough in wall time for both (paced, it costs no more CPU)
LONGER = "task.config.num_samples=320"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run the node test ends equal to (its paced task trains the same numerics)."""
    ref = _spec(tmp_path_factory.mktemp("ref"), LONGER)
    assert run_spawned(ref) == [0, 0]
    return ref


def _node_of_rank(spec, cluster, rank):
    """The live worker node of this rank in the latest attempt."""
    nodes = _events(spec, "attempt_started")[-1]["nodes"]
    return next(n for n in cluster.worker_nodes if n.node_id == nodes[rank])


BOARD_PLACEMENTS = """
import sys, ray
from syncpoint.orchestrator.ray_runner import heartbeat_board
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
head = {n["NodeID"] for n in ray.nodes() if n["Alive"] and "node:__internal_head__" in n["Resources"]}
for _ in range(8):
    board = heartbeat_board()
    node = ray.get(board.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)
    print("BOARD_ON_HEAD", node in head, flush=True)
    ray.kill(board)
"""


def test_the_heartbeat_board_is_created_on_the_head_every_time(cluster):
    """The board must outlive the worker nodes a preemption takes. Ray's soft node affinity to the head
    put it on a worker node in 7 of 12 creations on this cluster (2026-12-03), so a hard node loss
    lost the interruption point whenever that worker was the one lost; 8 creations all on the head
    would happen by chance about once in 1,000 runs of the soft placement."""
    c, _ = cluster
    out = subprocess.run(
        [sys.executable, "-c", BOARD_PLACEMENTS, c.address],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    placed = [ln.split()[1] for ln in out.stdout.splitlines() if ln.startswith("BOARD_ON_HEAD")]
    assert placed == ["True"] * 8, (placed, out.stderr[-2000:])


# make test: a user's bug retried on Ray, then failed with its error (tests/ray/test_mistakes.py, buggy);
# the budget's decisions (tests/integration/orchestrator/test_failure_policy.py)
@pytest.mark.long
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


# make test: a refusal in Ray's own failure records is not retried (tests/integration/orchestrator/
# test_failure_policy.py) and the application error above walks this path through Ray Train
@pytest.mark.long
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


# make test: the wait for room bounded by failure.placement_timeout_s, then the run's reason, on Ray's own
# timeouts (tests/integration/orchestrator/test_failure_policy.py)
@pytest.mark.long
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


# One run on the shared cluster meets both ways a spot node ends, as a cloud deals them (one run's
# setup for both): a drain by Ray's API (what a cloud's autoscaler asks: notice -> commit at the next
# boundary -> exact resume), then, in the resumed attempt, the loss of a node with no notice at all.
# make test-all also drains a `ray start` node by its own SIGTERM handler, as the kubelet does
# (tests/drills/ray/test_ray_start_sigterm.py).
def test_a_drain_then_a_hard_node_loss_are_preemptions_and_the_run_resumes_exactly(tmp_path, cluster, reference):
    c, _ = cluster
    # 160 micro-steps paced at 100 ms (16 s of training, little CPU): each interruption lands mid-run; it
    # saves only when a notice asks, so the drain's window saves are the notice's
    spec = _spec(
        tmp_path / "run",
        LONGER,
        "failure.max_failures=0",
        "checkpoint.save_every={value: 0, unit: micro_steps}",
        "task.path=tests.tasks:paced_lm",
        "task.config.pace_s=0.1",
    )
    reports = tmp_path / "ray-reports.jsonl"  # what Ray Train's controller saw (tests/ray_report_probe.py)
    probe = {"RAY_TRAIN_CALLBACKS": "tests.ray_report_probe.RecordReports", "SYNCPOINT_TEST_REPORTS": str(reports)}
    proc = _start(spec, c.address, {"RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.2", **probe})

    # 1. the drain: rank 1's node is told it goes in 6 s; a replacement joins; the node goes at the deadline
    _wait_for(lambda: bool(_events(spec, "attempt_started")), proc)
    time.sleep(1.0)
    victim = _node_of_rank(spec, c, 1)
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

    # 2. the hard loss: once the resumed attempt trained past its state, rank 1's node is gone, no notice
    _wait_for(lambda: len(_events(spec, "attempt_started")) >= 2, proc)
    second = _events(spec, "attempt_started")[1]
    trained = lambda: [  # noqa: E731 - read at each poll
        r for e in _events(spec, "progress") if e["attempt"] == second["attempt"] for r in e["records"]
    ]
    _wait_for(lambda: any(r["global_micro_step"] > second["global_micro_step"] for r in trained()), proc)
    victim = _node_of_rank(spec, c, 1)
    c.remove_node(victim, allow_graceful=False)  # spot node gone, no notice
    c.add_node(num_cpus=1)  # the autoscaler's replacement
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    final = state_names(spec)[-1]  # the resume is exact whatever the measurements below saw
    assert digest(spec, final) == digest(reference, final)  # the example's task, unpaced: the same numerics
    # a cluster's Ray Train helpers, but no dataset manager in any worker group (syncpoint's trainers have no datasets)
    classes = set(json.loads(reports.read_text().splitlines()[-1])["actor_classes"])
    assert {"TrainController", "RayTrainWorker", "PreemptionWatcher"} <= classes and "DatasetManager" not in classes

    from syncpoint.orchestrator.timeline import restarts

    journal = EventLog(RunStorage(spec.run_url)).journal()
    drained, lost = restarts(journal)
    # the drain: saved at the very next boundary, zero optimizer steps lost
    notice = _events(spec, "preemption_notice")[0]
    saved = next(e for e in _events(spec, "state_committed") if "preemption" in e["reasons"])
    assert saved["global_micro_step"] >= notice["global_micro_step"]
    assert saved["optimizer_step"] - notice["optimizer_step"] <= 1  # serviced at the very next boundary
    assert second["optimizer_step"] >= notice["optimizer_step"]  # zero optimizer steps lost
    assert drained.cause == "preemption"
    # the window trained on and saved again in its last seconds: at most a step and a save are lost
    assert drained.lost_micro_steps < 2 * spec.train.grad_accum
    assert len([e for e in _events(spec, "state_committed") if "preemption" in e["reasons"]]) >= 2

    # the hard loss: a preemption (no notice), one line of its own, no raylet state in the output
    third = journal.attempts[2]
    assert journal.failure_between(second["time"], third.time).classified == "preemption"
    # the node's death in Ray's first sentences (orchestrator/quiet.py), not the raylet's own log
    # (Ray appends its last 20 lines, from each of the node's two agents), and syncpoint's line on it
    assert "Last 20 lines of the Raylet logs" not in out and "worker_pool.cc" not in out, out[-6000:]
    assert out.count("Raylet is terminated. Termination is unexpected.") <= 2, out[-6000:]
    assert "[syncpoint] attempt failed (" in out, out[-6000:]
    # Lost work measured, not inferred: the node went down while the run trained past its last
    # progress flush; the controller recorded each rank's last heartbeat before the restart.
    beat = journal.interrupted(second["attempt"])
    # the board lives on the head (test_the_heartbeat_board_is_created_on_the_head_every_time), so the
    # reading survives the lost node: the controller's line says why if it did not
    why = [ln for ln in out.splitlines() if "no interruption point measured" in ln]
    assert beat is not None, why or "the controller printed no reason (it did not try)"
    assert lost.measured, _events(spec, "interrupted")
    assert beat.global_micro_step == max(r.global_micro_step for r in beat.ranks)
    assert beat.detected_at >= beat.reached_at and {r.rank for r in beat.ranks} == {0, 1}
    flushed = max(r.global_micro_step for r in journal.progress_of(second["attempt"]))
    assert beat.global_micro_step >= flushed  # the heartbeat knows at least what the flushed progress knew
    assert lost.previous_max_micro_step == beat.global_micro_step
    # measured: the micro-steps trained past the state it resumed (tests/unit/policies/decisions/test_goodput.py
    # covers the "trained past the last flush" accounting with a hand-built journal)
    assert lost.lost_micro_steps == beat.global_micro_step - lost.resumed_micro_step > 0
    assert lost.lost_seconds > 0
