"""A drill's node loss without a replacement: the run continues on one worker."""

from __future__ import annotations


def test_drill_node_loss_without_replacement_continues_on_one_worker(tmp_path):
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

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
        "task.config.num_samples=1280",  # 160 micro-steps: the node goes down (once the progress flushed every 2 s
        # passes 30) with many steps still ahead, whose losses the line after the change explains
        "--set",
        "train.epochs=2",
        "--set",
        "scaling.num_workers={min: 1, max: 2}",
    ]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    # the shipped example, dropout on: the verdict follows the elastic rules, the losses are explained
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "per-step losses and learning rates before the world-size change (steps 1-" in out
    assert "world sizes [1, 2]: samples and learning rate of every optimizer step: match" in out
    assert "per-step losses after the change: differ" in out and "dropout" in out
    assert "final parameters: within the elastic bound" in out
    assert out.strip().splitlines()[-1].startswith("RESULT: the interrupted run matched bit for bit until")
