"""`syncpoint drill` on a task whose loss reads and updates its own state every micro-step
(``Task.stateful``: a loss scale that differs per rank, and an EMA of the weights), on 2 Ray Train
workers: a crash and a SIGTERM, and the interrupted run is the uninterrupted one."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import ROOT

JOB = """
name: user-state
task: {path: tests.tasks:linear_user_state, config: {num_samples: 32}}
train: {micro_batch_size: 2, grad_accum: 2, epochs: 3, seed: 3, lr: 0.01, log_every: 100000}
deepspeed: {zero_stage: 1}
scaling: {num_workers: 2}
checkpoint: {keep_last: 0, export_final: false, save_every: {value: 3, unit: micro_steps}}
"""


def test_drill_with_user_state_reports_equality(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB)
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        str(job),
        "--preempt-at",
        "7,15",
        "--how",
        "crash,sigterm",
        "--set",
        f"storage={tmp_path / 'runs'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per-step losses and learning rates: match" in proc.stdout and "final digest: match" in proc.stdout
