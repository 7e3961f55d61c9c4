"""In-place recovery through the real path: ``syncpoint run`` on an embedded Ray, two workers, rank 1's
training process dies mid-run. Its Ray Train worker (the supervisor) starts a new training process,
rank 0's does too, and the run resumes in the same worker group: the same Ray actors (their ids in
``attempt_started``), one failure recorded as recovered in place, and the run ends bitwise where the
uninterrupted run ends.
"""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from syncpoint.policies.journal import Failure
from syncpoint.workers.events import EventLog
from syncpoint.workers.launch import run_spawned
from syncpoint.workers.storage import RunStorage
from tests.helpers import ROOT, committed_steps, digest, lm_spec

COMMON = ["task.config.num_samples=96", "train.epochs=1", "checkpoint.save_every={value: 4, unit: micro_steps}"]


def test_a_crashed_rank_recovers_in_the_same_worker_group_bitwise(tmp_path):
    ref = lm_spec(tmp_path / "ref", *COMMON, workers=2)
    assert run_spawned(ref) == [0, 0]
    final = f"{max(committed_steps(ref)):012d}"

    spec = lm_spec(tmp_path / "run", *COMMON, "faults=[{rank: 1, at_micro_step: 10, mode: exit}]", workers=2)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, "-m", "syncpoint", "run", str(job)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
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
    assert "exited with code 17" in failure.reason
    assert f"{max(committed_steps(spec)):012d}" == final and digest(spec, final) == digest(ref, final)
    restart_s = second.time - failure.time
    print(f"in-place restart: {restart_s:.2f} s from the decision to the new attempt's start")
