"""`syncpoint drill` on the streaming example (crash, SIGTERM and node loss), with 0 and 2 DataLoader
workers: every resumed run reports equality."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "loader_workers,shuffle",
    [(0, "syncpoint"), (2, "syncpoint"), (0, "datasets"), (2, "datasets")],
    ids=["buffer-0-workers", "buffer-2-workers", "datasets-shuffle", "datasets-shuffle-2-workers"],
)
def test_drill_on_the_streaming_example_reports_equality(tmp_path, loader_workers, shuffle):
    """``syncpoint drill`` on the streaming example (2 Ray Train workers): a crash after micro-step 9
    and a SIGTERM after 20 (a pass is 12 micro-batches per rank), and the interrupted run is the
    uninterrupted one, loss by loss and digest for digest. Shuffled by ``train.stream_shuffle_buffer``,
    or by the stream's own ``.shuffle(seed, buffer_size)`` (its buffer run by syncpoint), with DataLoader
    workers too."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    sets = [
        f"storage={tmp_path}",
        f"task.config.corpus_dir={tmp_path / 'corpus'}",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "task.config.docs_per_shard=12",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.max_steps=14",
        f"train.dataloader_workers={loader_workers}",
        "checkpoint.save_every={value: 3, unit: optimizer_steps}",
    ]
    if shuffle == "syncpoint":
        sets.append("train.stream_shuffle_buffer=5")
    else:
        sets += ["train.stream_shuffle_buffer=0", "task.config.shard_shuffle=true", "task.config.shuffle_buffer_size=6"]
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/stream_lm.yaml",
        "--preempt-at",
        "9,20",
        "--how",
        "crash,sigterm",
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "per-step losses and learning rates: match" in proc.stdout and "final digest: match" in proc.stdout
    rows = [
        ln.split() for ln in proc.stdout.splitlines() if ln.strip()[:1].isdigit() and ("crash" in ln or "sigterm" in ln)
    ]
    assert [r[1] for r in rows] == ["crash", "sigterm"], proc.stdout
    assert rows[1][3] == "preemption" and rows[1][4] == f"{22:012d}"  # the notice saved at the next boundary


@pytest.mark.parametrize("loader_workers", [0, 2])
def test_node_drill_on_the_streaming_example_reports_equality(tmp_path, loader_workers):
    """``syncpoint drill --how node`` on the streaming example: the node of rank 0 (with its DataLoader
    workers) is taken away without notice once progress passes micro-step 9, a replacement joins, and
    the resumed run (each rank's stream file restored) is the uninterrupted one, bitwise."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    sets = [
        f"storage={tmp_path}",
        f"task.config.corpus_dir={tmp_path / 'corpus'}",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "task.config.docs_per_shard=12",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.max_steps=20",
        "train.stream_shuffle_buffer=5",
        f"train.dataloader_workers={loader_workers}",
        "checkpoint.save_every={value: 3, unit: optimizer_steps}",
    ]
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/stream_lm.yaml",
        "--preempt-at",
        "9",
        "--how",
        "node",
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match (20 optimizer steps)" in out and "final digest: match" in out
    rows = [ln.split() for ln in out.splitlines() if ln.strip()[:1].isdigit() and " node " in ln]
    assert len(rows) == 1 and rows[0][4] != "scratch", out[-3000:]  # resumed from a state, not from the start
    assert out.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one", out[-3000:]
