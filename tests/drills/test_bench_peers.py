"""Bench P9's HF Trainer harness, both sides, on a tiny size (the other peer harnesses:
tests/integration/test_bench_peers.py)."""

from __future__ import annotations

import signal

import pytest

from bench import p9_hf_trainer as p9


@pytest.mark.timeout(1800)
def test_p9_harness_runs_both_sides_on_a_tiny_size(tmp_path):
    """One epoch, one kill inside the short epoch-end cycle, no augmentation, no DataLoader worker:
    both chains run, each resumes from the step before the kill, and both are exact (HF too: nothing
    in ``__getitem__`` draws randomness)."""
    for framework in ("hf", "syncpoint"):
        runner = p9.run_hf if framework == "hf" else p9.run_syncpoint
        ref = runner(str(tmp_path / f"{framework}-ref"), False, 0, (), epochs=1)
        run = runner(str(tmp_path / f"{framework}-int"), False, 0, (21,), epochs=1)
        assert run["codes"] == [-signal.SIGKILL, 0] and run["starts"] == [0, 20], framework
        c = p9.compare(ref, run)
        assert c["micro_batches"] == 22 and c["losses_identical"] and c["bitwise"], (framework, c)
        assert c["skipped"] == c["repeated"] == c["ids_differ"] == 0, (framework, c)
