"""`syncpoint drill` on the 10^9-sample virtual corpus, interrupted deep in its epoch: bitwise."""

from __future__ import annotations

import pytest

from tests.integration.workers.data.test_sampler_virtual_corpus import MICRO_BATCH


@pytest.mark.parametrize("how", ["crash", "sigterm", "node"])
def test_drill_on_the_1e9_sample_corpus_deep_in_its_epoch_is_bitwise(tmp_path, how):
    """``syncpoint drill`` (one Ray Train worker) interrupting after micro-step 98 of 120, 10^8
    samples into the epoch: a crash and a lost node resume from the state at 96 (the node goes down
    once the flushed progress passes 98, a few micro-steps later), a preemption notice saves at 100;
    the interrupted run is the uninterrupted one, loss for loss and digest for digest."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    sets = [
        f"storage={tmp_path}",
        "scaling.num_workers=1",
        "task.path=tests.virtual_tasks:build",
        "task.config={dropout: 0.1}",
        f"train.micro_batch_size={MICRO_BATCH}",
        "train.grad_accum=4",
        "train.max_steps=30",
        "train.eval_every=0",
        "checkpoint.save_every={value: 6, unit: optimizer_steps}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--preempt-at",
        "98",
        "--how",
        how,
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match (30 optimizer steps)" in out and "final digest: match" in out, (
        out[-3000:]
    )
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and how in ln]
    assert len(rows) == 1 and rows[0][4] == f"{100 if how == 'sigterm' else 96:012d}", out[-3000:]
    assert out.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one", out[-3000:]
