"""Elastic resume the other way: a run interrupted on one worker finishes on two."""

from __future__ import annotations

from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import state_names, trainer_json
from tests.integration.policies.decisions.test_elastic import _assert_same_samples_and_close, _spec


def test_one_worker_grows_back_to_two(tmp_path):
    ref = _spec(tmp_path / "ref")
    assert run_spawned(ref) == [0, 0]
    spec = _spec(tmp_path / "run", "faults=[{rank: 0, at_micro_step: 11}]")
    assert run_spawned(spec, world_size=1) == [17]  # started small (capacity was short)
    assert run_spawned(spec) == [0, 0]  # the node came back
    assert trainer_json(spec, state_names(spec)[-1])["world_size"] == 2
    _assert_same_samples_and_close(ref, spec)
