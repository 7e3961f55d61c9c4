"""The storm drills on Ray: 20 interruptions of every kind, and an elastic storm (the storm's plan
and fault schema: tests/integration/orchestrator/test_storm.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT
from tests.integration.orchestrator.test_storm import SHRUNK

pytestmark = pytest.mark.storm  # and `make test-storm` runs them alone


def _storm(tmp_path, n: int, seed: int, *sets: str, timeout_s: int) -> subprocess.CompletedProcess:
    """`syncpoint drill examples/tiny_lm.yaml --storm N --seed S`, shrunk, as a user runs it."""
    cmd = [
        sys.executable,
        "-m",
        "syncpoint",
        "drill",
        "examples/tiny_lm.yaml",
        "--storm",
        str(n),
        "--seed",
        str(seed),
        "--set",
        f"storage={tmp_path}",
    ]
    for s in (*SHRUNK, *sets):
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.timeout(3700)  # pytest's 900 s default would end it first: the drill's own bound is the hour below
def test_a_storm_of_twenty_interruptions_ends_bitwise_equal(tmp_path):
    """The example job, shrunk (tiny model, 2 workers, accumulation 4, 2 epochs of 128 micro-steps: 256),
    through 20 interruptions of every kind on a local cluster of two one-CPU nodes."""
    proc = _storm(tmp_path, 20, 19, "task.config.num_samples=2048", "train.epochs=2", timeout_s=3600)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-4000:]
    assert "storm plan: 20 interruptions, seed 19" in out
    assert "per-step losses and learning rates: match" in out and "final digest: match" in out
    assert "restarts: " in out and "(planned " in out and "interrupted run's goodput " in out
    assert "RESULT: 20 interruptions survived; the interrupted run is bitwise the uninterrupted one" in out
    print(out)  # the storm's report (`pytest -rP` shows it): what bench/results/drills.md quotes


@pytest.mark.timeout(1900)
def test_an_elastic_storm_ends_on_fewer_workers_judged_by_the_elastic_rules(tmp_path):
    """The example job, elastic (``num_workers: {min: 1, max: 2}``), through a short storm whose plan
    (seed 9) ends with a node lost for good: the earlier node losses get their replacement before the
    loss (an elastic job keeps its world size), the last continues on one worker, and the verdict is
    the documented elastic one, stated as such, not a bitwise MISMATCH."""
    proc = _storm(
        tmp_path,
        4,
        9,
        "scaling.num_workers={min: 1, max: 2}",
        "task.config.num_samples=1280",
        "train.epochs=1",
        timeout_s=1800,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-4000:]
    plan = out[out.index("storm plan: 4 interruptions, seed 9") :]
    assert "a replacement joins first" in plan  # an elastic job's replaced node loss keeps its world size
    assert "no replacement (elastic: fewer workers from here)" in plan
    assert "world sizes [1, 2]: samples and learning rate of every optimizer step: match" in out
    assert "final parameters: within the elastic bound" in out
    assert (
        "RESULT: 4 interruptions survived; the interrupted run matched bit for bit until the world-size change"
    ) in out
    print(out)
