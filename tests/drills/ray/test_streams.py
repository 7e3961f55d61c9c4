"""`syncpoint drill` on the streaming example (crash, SIGTERM and node loss in one drill), with 2
DataLoader workers a rank: every resumed run reports equality."""

from __future__ import annotations

import pytest


# with 2 DataLoader workers, each rank's stream state is its workers' states; without them
# (the same shuffles, resumed on one and two ranks) see tests/integration/workers/data/test_streams.py
@pytest.mark.parametrize(
    "loader_workers,shuffle",
    [(2, "syncpoint"), (2, "datasets")],
    ids=["buffer-2-workers", "datasets-shuffle-2-workers"],
)
def test_drill_on_the_streaming_example_reports_equality(tmp_path, loader_workers, shuffle):
    """``syncpoint drill`` on the streaming example (2 Ray Train workers): a crash after micro-step 9
    and a SIGTERM after 20 (a pass is 12 micro-batches per rank), and with syncpoint's shuffle buffer
    the node of rank 0 (with its DataLoader workers) taken away without notice after 40 and replaced:
    the interrupted run (each rank's stream file restored) is the uninterrupted one, loss by loss and
    digest for digest. Shuffled by ``train.stream_shuffle_buffer``, or by the stream's own
    ``.shuffle(seed, buffer_size)`` (its buffer run by syncpoint), with DataLoader workers too."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    node = shuffle == "syncpoint"  # room after the node's point: it goes down a few micro-steps past it
    sets = [
        f"storage={tmp_path}",
        f"task.config.corpus_dir={tmp_path / 'corpus'}",
        "task.config.seq_len=8",
        "task.config.d_model=16",
        "task.config.docs_per_shard=12",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        f"train.max_steps={30 if node else 14}",
        f"train.dataloader_workers={loader_workers}",
        "checkpoint.save_every={value: 3, unit: optimizer_steps}",
    ]
    if shuffle == "syncpoint":
        sets.append("train.stream_shuffle_buffer=5")
    else:
        sets += ["train.stream_shuffle_buffer=0", "task.config.shard_shuffle=true", "task.config.shuffle_buffer_size=6"]
    kinds = ["crash", "sigterm", "node"] if node else ["crash", "sigterm"]
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/stream_lm.yaml",
        "--preempt-at",
        "9,20,40" if node else "9,20",
        "--how",
        ",".join(kinds),
        *[a for s in sets for a in ("--set", s)],
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates: match" in out and "final digest: match" in out, out[-3000:]
    rows = [r for r in (ln.split() for ln in out.splitlines()) if len(r) > 4 and r[0].isdigit() and r[1] in kinds]
    assert [r[1] for r in rows] == kinds, out[-3000:]
    assert rows[1][3] == "preemption" and rows[1][4] == f"{22:012d}"  # the notice saved at the next boundary
    assert all(r[4] != "scratch" for r in rows[2:])  # the lost node's run resumed from a state
    assert out.strip().splitlines()[-1] == "RESULT: the interrupted run is bitwise the uninterrupted one", out[-3000:]
