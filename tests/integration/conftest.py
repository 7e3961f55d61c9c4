"""Fixtures several integration modules share."""

from __future__ import annotations

import pytest

from syncpoint.policies.contracts.spec import JobSpec
from tests.helpers import committed_steps, lm_spec, run_until_crash


@pytest.fixture
def crashed(tmp_path) -> JobSpec:
    """A ZeRO-2 run with states at micro-steps 4, 8, 10, crashed after 10."""
    spec = lm_spec(
        tmp_path / "run",
        "task.config.num_samples=20",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 10, mode: raise}]",
    )
    assert run_until_crash(spec) and committed_steps(spec) == [4, 8, 10]
    return spec
