"""The registry of per-rank parts: every part the layout declares has one behaviour, in the layout's
order; a state's required files are exactly its carried parts' files; and each part's file goes
round from capture through the reader's parse and the check against the live job back into it."""

from __future__ import annotations

import random

import pytest
import torch

from syncpoint.policies.contracts.errors import StateMismatch
from syncpoint.policies.contracts.state_format import RANK_PARTS, TrainState
from syncpoint.workers.state import rank_parts
from syncpoint.workers.state.rank_parts import PARTS, LiveRank, behaviour, capture_all, sources
from tests.meta import live, trainer_for

EXP = live("j", 2, 4, 4, 10, 2, "f", 1, precision="fp32", optimizer_type="adamw")


def _state(**overrides: object) -> TrainState:
    return TrainState.model_validate(trainer_for(8, EXP, **overrides))


class Counter:
    """A Task.stateful object: anything with state_dict()/load_state_dict()."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.n = sd["n"]


def test_every_part_the_layout_declares_has_one_behaviour_in_its_order():
    assert [p.layout for p in PARTS] == list(RANK_PARTS)
    assert len({p.layout.name for p in PARTS}) == len(PARTS)
    assert {behaviour(p.layout.name) for p in PARTS} == set(PARTS)


def test_a_states_required_files_are_its_carried_parts_files_for_every_rank():
    plain = _state()
    assert [p.name for p in plain.rank_parts()] == ["rng"]
    both = _state(per_rank_buffers=True, user_state=["ema"])
    assert [p.name for p in both.rank_parts()] == ["rng", "buffers", "user"]
    extra = set(both.required_files()) - set(plain.required_files())
    assert extra == {f"{d}/rank_{r:05d}.safetensors" for d in ("buffers", "user") for r in range(2)}


def test_which_saved_rank_each_rank_reads():
    state = _state(per_rank_buffers=True, user_state=["ema"])
    assert sources(1, state) == {"rng": 1, "buffers": 1, "user": 1}
    # a rank an elastic resume added takes the buffers of saved rank r mod the saved world size
    assert sources(3, state)["buffers"] == 1
    assert sources(0, _state()) == {"rng": 0}


def test_each_part_goes_round_from_capture_to_the_live_job():
    module = torch.nn.BatchNorm1d(3)
    module.running_mean.fill_(0.5)
    counter = Counter(7)
    live = LiveRank(1, module, {"ema": counter}, lambda: b"unused: no stream in this state")
    state = _state(per_rank_buffers=True, user_state=["ema"])
    random.seed(3)
    files = capture_all(live, state)
    assert sorted(files) == [
        "buffers/rank_00001.safetensors",
        "rng/rank_00001.safetensors",
        "user/rank_00001.safetensors",
    ]
    expected_draw = random.random()

    module.running_mean.zero_()
    counter.n = 0
    for part in PARTS:
        rel = part.layout.file(1)
        if rel not in files:
            assert part.apply(None, live, "000000000008") is None
            continue
        parsed = part.parse(files[rel], rel)
        part.apply(part.prepare(parsed, rel, state, live), live, "000000000008")
    assert torch.equal(module.running_mean, torch.full((3,), 0.5)) and counter.n == 7
    rng_part = behaviour("rng")
    saved = rng_part.parse(files["rng/rank_00001.safetensors"], "rng/rank_00001.safetensors")
    rank_parts.rng.restore(saved)  # the loop restores the RNG itself, after the data skip
    assert random.random() == expected_draw


def test_buffers_of_another_model_are_a_mismatch_before_the_engine_is_touched():
    live = LiveRank(0, torch.nn.BatchNorm1d(3))
    data = capture_all(live, _state(per_rank_buffers=True))["buffers/rank_00000.safetensors"]
    other = LiveRank(0, torch.nn.BatchNorm1d(4))
    part = behaviour("buffers")
    with pytest.raises(StateMismatch, match="buffer"):
        part.prepare(
            part.parse(data, "buffers/rank_00000.safetensors"), "buffers/rank_00000.safetensors", _state(), other
        )


def test_a_task_with_user_state_resuming_a_state_without_says_what_starts_fresh():
    live = LiveRank(0, None, {"ema": Counter(2)})
    warning = behaviour("user").apply(None, live, "000000000008")
    assert warning is not None and "['ema']" in warning and "000000000008" in warning
    assert live.stateful["ema"].n == 2
