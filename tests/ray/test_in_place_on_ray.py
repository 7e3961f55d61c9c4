"""In-place recovery through the real path: ``syncpoint run`` on an embedded Ray, two workers, rank 1's
training process dies mid-run. Its Ray Train worker (the supervisor) starts a new training process,
rank 0's does too, and the run resumes in the same worker group: the same Ray actors (their ids in
``attempt_started``), one failure recorded as recovered in place, and the run ends bitwise where the
uninterrupted run ends. Ray Train's reports (a barrier per logged step) keep pairing across the
recovery: the run reaches its last report on both ranks. The Ray Train workers never import torch
(checked at every report, from their processes' memory maps).

The crash case keeps the run in S3 (moto's server on loopback) with a memory copy on the node: the new
training processes restore from that copy (no state file read from S3), and the job's end removes it
(a raised error, with the copy: tests/ray/test_memory_copy_on_ray.py, in make test-all).
"""

from __future__ import annotations

import json
import os

import pytest

from syncpoint.policies.contracts.journal import Failure
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.state.memory_copy import MEMORY_DIR_ENV
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import committed_steps, digest, lm_spec, syncpoint_run
from tests.s3_server import BUCKET

COMMON = ["task.config.num_samples=96", "train.epochs=1", "checkpoint.save_every={value: 4, unit: micro_steps}"]


@pytest.mark.parametrize(
    "fault,extra,reason",
    [
        ("{rank: 1, at_micro_step: 10, mode: exit}", [], "exited with code 17"),  # the process dies
        # an exception (make test: the crash above on Ray, and a raised error in place in the spawned
        # supervisor's tests: tests/integration/workers/supervision/test_supervisor_in_place_recovery.py)
        pytest.param("{rank: 0, at_micro_step: 11, mode: raise}", [], "micro-step 11", marks=pytest.mark.long),
        # rank 1 stops answering, its process alive: rank 0's collective times out
        # (make test: tests/integration/workers/supervision/test_supervisor_in_place_recovery.py's collective timeout,
        # spawned)
        pytest.param(
            "{rank: 1, at_micro_step: 10, mode: hold}", ["scaling.collective_timeout_s=5"], "", marks=pytest.mark.long
        ),
    ],
    ids=["crash", "exception", "collective-timeout"],
)
def test_a_failed_rank_recovers_in_the_same_worker_group_bitwise(request, tmp_path, fault, extra, reason):
    ref = lm_spec(tmp_path / "ref", *COMMON, workers=2)
    assert run_spawned(ref) == [0, 0]
    final = f"{max(committed_steps(ref)):012d}"

    in_s3 = request.node.callspec.id == "crash"  # with the node's memory copy
    if in_s3:
        request.getfixturevalue("s3")
    storage = f"s3://{BUCKET}/in-place-on-ray" if in_s3 else tmp_path / "run"
    spec = lm_spec(storage, *COMMON, *extra, "train.log_every=1", f"faults=[{fault}]", workers=2)
    reports, shm = tmp_path / "ray-reports.jsonl", tmp_path / "shm"
    shm.mkdir()
    proc = syncpoint_run(
        spec,
        tmp_path / "job.yaml",
        SYNCPOINT_FAULT_HOLD_S="600",  # a held rank would wait this long: only the timeout ends it
        RAY_TRAIN_CALLBACKS="tests.ray_report_probe.RecordReports",
        SYNCPOINT_TEST_REPORTS=str(reports),
        **({MEMORY_DIR_ENV: str(shm)} if in_s3 else {}),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "recovering in place" in out, out[-4000:]
    if in_s3:  # both ranks' new processes restored from the node's copy, not from S3; the job's end removed it
        assert "from this node's memory copy (verified against its manifest)" in out, out[-4000:]
        assert "restoring from storage" not in out
        assert all(files == [] for _, _, files in os.walk(shm)), list(os.walk(shm))
    journal = EventLog(RunStorage(spec.run_url)).journal()
    first, second = journal.attempts
    # where each rank read its state, in the log too (syncpoint_restored_ranks{source})
    assert second.restored_from == (["memory", "memory"] if in_s3 else ["storage", "storage"]), second
    assert first.workers and first.workers == second.workers  # the same Ray Train worker actors
    assert first.nodes == second.nodes
    [failure] = journal.of_kind(Failure)
    assert (failure.classified, failure.decision, failure.in_place) == ("application", "RETRY", True)
    assert reason in failure.reason
    assert f"{max(committed_steps(spec)):012d}" == final and digest(spec, final) == digest(ref, final)
    # Ray's reports: the rank that crashed sent fewer in the first generation; padded, every later
    # report pairs the same step of both ranks, up to the run's last step
    delivered = [json.loads(ln) for ln in reports.read_text().splitlines()]
    last_step = journal.last_finish.optimizer_step if journal.last_finish else None
    assert [m["optimizer_step"] for m in delivered[-1]["per_rank"]] == [last_step, last_step]
    # a supervisor never imports torch (its training processes do): no Ray Train worker mapped it
    assert all(len(line["worker_pids"]) == 2 and line["workers_with_torch"] == [] for line in delivered)
    restart_s = second.time - failure.time
    print(f"in-place restart: {restart_s:.2f} s from the decision to the new attempt's start")
