"""Preemption drills on real Ray: two kinds of preemption in one drill, and a drain notice that saves
at the next boundary (the node tests: tests/ray/test_preemption.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from tests.helpers import ROOT
from tests.ray.test_preemption import _events


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
