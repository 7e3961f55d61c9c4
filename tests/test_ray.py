"""Real local Ray (embedded by ``syncpoint run``), real DeepSpeed ZeRO-2 on CPU, 2 workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, digest, lm_spec, state_names, step_history
from workers.events import EventLog
from workers.launch import run_spawned
from workers.storage import RunStorage

pytestmark = pytest.mark.slow


def syncpoint_run(job: str, *sets: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "orchestrator", "run", job]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_worker_zero2_run_finishes_and_loss_goes_down(tmp_path):
    proc = syncpoint_run("examples/tiny_lm.yaml", f"storage={tmp_path}", "train.epochs=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished" in proc.stdout
    spec = lm_spec(tmp_path)  # same name/storage: read the run back
    hist = step_history(spec)
    steps = sorted(hist)
    assert steps == list(range(1, 33))
    first = sum(hist[s]["loss"] for s in steps[:4]) / 4
    last = sum(hist[s]["loss"] for s in steps[-4:]) / 4
    assert last < first - 0.3, (first, last)
    assert (tmp_path / "tiny-lm" / "final" / "model.safetensors").exists()
    assert state_names(spec)[-1] == f"{128:012d}"  # 1024 samples / (8 x 2) x 2 epochs


def test_ray_restarts_worker_group_after_hard_crash_and_resumes_exactly(tmp_path):
    common = ["task.config.num_samples=40", "task.config.seq_len=8", "task.config.d_model=16",
              "train.micro_batch_size=2", "train.epochs=2", "checkpoint.save_every={value: 3, unit: micro_steps}",
              "checkpoint.keep_last=0", "checkpoint.export_final=false"]
    proc = syncpoint_run("examples/tiny_lm.yaml", f"storage={tmp_path / 'ray'}", *common,
                         "failure.max_failures=1", "faults=[{rank: 1, at_micro_step: 13}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = lm_spec(tmp_path / "ray", *common[1:4], workers=2)
    ref = lm_spec(tmp_path / "ref", "task.config.num_samples=40", "train.epochs=2",
                  "checkpoint.save_every={value: 3, unit: micro_steps}", workers=2)
    assert run_spawned(ref) == [0, 0]
    final = state_names(ref)[-1]
    assert state_names(spec)[-1] == final
    assert digest(spec, final) == digest(ref, final)
    attempts = [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "attempt_started"]
    assert len(attempts) == 2 and attempts[1]["resumed_from"] == f"{10:012d}"
