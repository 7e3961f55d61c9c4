"""`syncpoint drill` on the Hugging Face GPT-2 example."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.timeout(1500)
def test_drill_on_the_example(tmp_path):
    """`syncpoint drill examples/hf_gpt2.yaml` as docs/task.md shows it (the example's own size, 2 Ray
    workers, its own embedded Ray like the tiny example's drill in test_preemption): a crash and a
    preemption notice, bitwise the uninterrupted run. Two ranks at ZeRO-3 with a process crash: this
    is also the example's multi-rank exact-resume test. The generous timeout is for a loaded machine
    (measured: 15 min with a load average of 15 on 2 cores, almost all of it Ray starting workers)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "DS_ACCELERATOR")}
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/hf_gpt2.yaml",
        "--preempt-at",
        "21,42",
        "--how",
        "crash,sigterm",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "checkpoint.export_final=false",
    ]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1400)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    # 32 micro-batches an epoch, accumulation 2, a state every 16 micro-steps: the crash after 21
    # resumes from 16 and loses 5; the notice at 42 is serviced at the next boundary (44), losing nothing.
    rows = [ln.split() for ln in r.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert [(row[1], row[2], row[3], row[4], row[5]) for row in rows] == [
        ("crash", "21", "application", f"{16:012d}", "5"),
        ("sigterm", "42", "preemption", f"{44:012d}", "0"),
    ], out
    assert "per-step losses and learning rates: match (32 optimizer steps)" in r.stdout
    assert "final digest: match" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one"
