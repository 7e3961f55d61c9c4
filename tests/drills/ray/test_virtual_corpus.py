"""`syncpoint drill` on the 10^9-sample virtual corpus, interrupted deep in its epoch: bitwise."""

from __future__ import annotations

from tests.integration.workers.data.test_sampler_virtual_corpus import MICRO_BATCH


def test_drill_on_the_1e9_sample_corpus_deep_in_its_epoch_is_bitwise(tmp_path):
    """``syncpoint drill`` (one Ray Train worker) interrupted three times deep in its 10^8-sample-in
    epoch (states every 24 micro-steps): a crash after micro-step 50 resumes from 48, a preemption
    notice after 74 saves at 76, and a lost node after 98 resumes from 96 (the node goes down once the
    flushed progress passes 98, a few micro-steps later); the interrupted run is the uninterrupted
    one, loss for loss and digest for digest."""
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
        "50,74,98",
        "--how",
        "crash,sigterm,node",
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match (30 optimizer steps)" in out and "final digest: match" in out, (
        out[-3000:]
    )
    kinds = ("crash", "sigterm", "node")
    rows = [r for r in (ln.split() for ln in out.splitlines()) if len(r) > 4 and r[0].isdigit() and r[1] in kinds]
    assert [(r[1], r[4]) for r in rows] == [(k, f"{s:012d}") for k, s in zip(kinds, (48, 76, 96), strict=True)], out[
        -3000:
    ]
    assert out.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one", out[-3000:]
