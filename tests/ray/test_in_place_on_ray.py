"""In-place recovery through the real path: ``syncpoint run`` on an embedded Ray, two workers, rank 1's
training process dies mid-run. Its Ray Train worker (the supervisor) starts a new training process,
rank 0's does too, and the run resumes in the same worker group: the same Ray actors (their ids in
``attempt_started``), one failure recorded as recovered in place, and the run ends bitwise where the
uninterrupted run ends. Ray Train's reports (a barrier per logged step) keep pairing across the
recovery: the run reaches its last report on both ranks. The Ray Train workers never import torch
(checked at every report, from their processes' memory maps).
"""

from __future__ import annotations

import json

import pytest

from syncpoint.policies.journal import Failure
from syncpoint.workers.events import EventLog
from syncpoint.workers.launch import run_spawned
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, digest, lm_spec, syncpoint_run

COMMON = ["task.config.num_samples=96", "train.epochs=1", "checkpoint.save_every={value: 4, unit: micro_steps}"]


@pytest.mark.parametrize(
    "fault,extra,reason",
    [
        ("{rank: 1, at_micro_step: 10, mode: exit}", [], "exited with code 17"),  # the process dies
        # an exception (make test: test_memory_copy_on_ray's raised error also recovers in place on Ray)
        pytest.param("{rank: 0, at_micro_step: 11, mode: raise}", [], "micro-step 11", marks=pytest.mark.long),
        # rank 1 stops answering, its process alive: rank 0's collective times out
        # (make test: tests/integration/workers/test_supervisor_in_place_recovery.py's collective timeout, spawned)
        pytest.param(
            "{rank: 1, at_micro_step: 10, mode: hold}", ["scaling.collective_timeout_s=5"], "", marks=pytest.mark.long
        ),
    ],
    ids=["crash", "exception", "collective-timeout"],
)
def test_a_failed_rank_recovers_in_the_same_worker_group_bitwise(tmp_path, fault, extra, reason):
    ref = lm_spec(tmp_path / "ref", *COMMON, workers=2)
    assert run_spawned(ref) == [0, 0]
    final = f"{max(committed_steps(ref)):012d}"

    spec = lm_spec(tmp_path / "run", *COMMON, *extra, "train.log_every=1", f"faults=[{fault}]", workers=2)
    reports = tmp_path / "ray-reports.jsonl"
    proc = syncpoint_run(
        spec,
        tmp_path / "job.yaml",
        SYNCPOINT_FAULT_HOLD_S="600",  # a held rank would wait this long: only the timeout ends it
        RAY_TRAIN_CALLBACKS="tests.ray_report_probe.RecordReports",
        SYNCPOINT_TEST_REPORTS=str(reports),
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "recovering in place" in out, out[-4000:]
    journal = EventLog(RunStorage(spec.run_url)).journal()
    first, second = journal.attempts
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
