"""`syncpoint drill` on a sharded corpus on moto's S3 server: bitwise for every kind of
interruption, and an elastic drill that keeps the samples of every step."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers import (
    ROOT,
)
from tests.integration.workers.data.test_corpus_runs import WINDOW
from tests.s3_server import BUCKET


def test_drill_on_a_corpus_on_s3_is_bitwise(s3, tmp_path):
    """A crash, a SIGTERM and a lost node in one drill (each resumed from what the one before left)."""
    url = f"s3://{BUCKET}/corpus-drill"
    from examples.sharded_lm import write_corpus  # datasets: imported by the test that runs, not at collection

    write_corpus(url, 8, 100, 8)  # ~816 rows: 51 global micro-batches of 16 per epoch
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--preempt-at",
        "20,50,80",
        "--how",
        "crash,sigterm,node",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.path=examples.sharded_lm:build",
        "--set",
        f"task.config={{shards: '{url}/*.npy', seq_len: 8, d_model: 16}}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.epochs=2",
        "--set",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
        "--set",
        f"corpus.window_shards={WINDOW}",
        "--set",
        f"corpus.cache_dir={tmp_path / 'cache'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match" in out and "final digest: match" in out, out[-3000:]
    kinds = ("crash", "sigterm", "node")
    rows = [r for r in (ln.split() for ln in out.splitlines()) if len(r) > 4 and r[0].isdigit() and r[1] in kinds]
    assert [r[1] for r in rows] == list(kinds) and all(r[4] != "scratch" for r in rows), out[-3000:]
    assert out.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one", out[-3000:]


def test_elastic_drill_on_a_corpus_on_s3_keeps_the_samples_of_every_step(s3, tmp_path):
    """``syncpoint drill --how node --no-replacement`` on the corpus with ``scaling.num_workers: {min: 1,
    max: 2}``: a node is lost and none replaces it, the run continues on one worker (accumulation
    doubled) and every optimizer step trains the samples the uninterrupted two-worker run trained
    (the drill records them: ``train.record_samples``), at the same learning rate, bit for bit up to
    the change and within the elastic bound after it (dropout re-seeded for the new world size)."""
    url = f"s3://{BUCKET}/corpus-drill-elastic"
    from examples.sharded_lm import write_corpus  # datasets: imported by the test that runs, not at collection

    write_corpus(url, 8, 100, 8)
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--preempt-at",
        "30",
        "--how",
        "node",
        "--no-replacement",
        "--set",
        f"storage={tmp_path}",
        "--set",
        "task.path=examples.sharded_lm:build",
        "--set",
        f"task.config={{shards: '{url}/*.npy', seq_len: 8, d_model: 16}}",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.epochs=2",
        "--set",
        "checkpoint.save_every={value: 2, unit: optimizer_steps}",
        "--set",
        "scaling.num_workers={min: 1, max: 2}",
        "--set",
        f"corpus.window_shards={WINDOW}",
        "--set",
        f"corpus.cache_dir={tmp_path / 'cache'}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates before the world-size change (steps 1-" in out, out[-3000:]
    assert "]: samples and learning rate of every optimizer step: match" in out, out[-3000:]
    assert "final parameters: within the elastic bound" in out, out[-3000:]
    # the losses after the change are explained, not judged (dropout on: re-seeded for the new world size)
    assert "per-step losses after the change: differ" not in out or "dropout" in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("RESULT: the interrupted run matched bit for bit until"), out[-3000:]
