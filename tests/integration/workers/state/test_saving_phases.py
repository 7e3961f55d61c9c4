"""Crash at every phase of a save: the next attempt resumes from a resumable state and ends
bitwise equal to the uninterrupted run, and after the first commit the run directory never holds
zero resumable states (checked after every crash)."""

from __future__ import annotations

import os

import pytest

from syncpoint.policies.contracts.state_format import TrainState
from syncpoint.policies.decisions.candidates import LiveJob, Verdict
from syncpoint.workers.state.discovery import discover
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import digest, lm_spec, run, run_until_crash

PHASES = [
    "before_shards",
    "after_some_shards",
    "before_manifest",
    "during_manifest",
    "before_retention",
    "during_retention",
]
REFS: dict = {}


def _spec(tmp, zero, *extra, workers=1):
    return lm_spec(
        tmp,
        f"task.config.num_samples={20 * workers}",
        "train.grad_accum=4",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "checkpoint.keep_last=1",
        f"deepspeed.zero_stage={zero}",
        *extra,
        workers=workers,
    )


def resumable_states(spec) -> list[str]:
    cands = discover(RunStorage(spec.run_url))
    newest = next((c.trainer for c in cands if c.manifest and c.trainer), None)
    if newest is None:
        return []
    exp = LiveJob(TrainState.model_validate(newest).identity())
    return [c.name for c in discover(RunStorage(spec.run_url), exp) if c.verdict is Verdict.RESUMABLE]


def _reference(tmp_path_factory, zero):
    if zero not in REFS:
        ref = _spec(tmp_path_factory.mktemp("ref"), zero)
        run(ref)
        REFS[zero] = ref
    return REFS[zero]


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("phase", PHASES)
def test_single_rank_crash_in_each_save_phase(tmp_path, tmp_path_factory, phase, zero):
    spec = _spec(tmp_path, zero, f"faults=[{{phase: {phase}, at_save: 3, mode: raise}}]")
    assert run_until_crash(spec)
    assert resumable_states(spec), "a crash during a save stranded the run"
    result = run(spec)
    assert result.final_state == f"{20:012d}"
    assert digest(spec, result.final_state) == digest(_reference(tmp_path_factory, zero), result.final_state)


@pytest.mark.slow
@pytest.mark.parametrize(
    "phase", [p if p == "after_some_shards" else pytest.param(p, marks=pytest.mark.long) for p in PHASES]
)  # ZeRO-3's own phase (per-rank model files); all in long
def test_single_rank_zero3_crash_in_each_save_phase(tmp_path, tmp_path_factory, phase):
    """ZeRO-3: per-rank model files next to the optimizer shards, same guarantee in every phase."""
    test_single_rank_crash_in_each_save_phase(tmp_path, tmp_path_factory, phase, 3)


# The whole 2-rank matrix runs with SYNCPOINT_FULL_MATRIX=1 (27 spawned runs, ~7 min here): every phase
# x ZeRO 0-3, crashing rank 1 or rank 0 — only rank 0 writes the manifest and runs retention, so those
# phases crash rank 0. By default a spread of it (both ranks, every stage, four phases) runs.
RANK0_ONLY = {"before_manifest", "during_manifest", "during_retention"}
FULL = [(r, p, z) for p in PHASES for z in (0, 1, 2, 3) for r in ((0,) if p in RANK0_ONLY else (0, 1))]
SPREAD = [
    (1, "after_some_shards", 2),
    (0, "before_manifest", 1),
    (0, "during_retention", 0),
    (1, "before_shards", 0),
    (1, "after_some_shards", 3),
    (0, "during_manifest", 3),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "rank,phase,zero",
    FULL
    if os.environ.get("SYNCPOINT_FULL_MATRIX")
    else [
        c if c in ((1, "after_some_shards", 2), (0, "during_manifest", 3)) else pytest.param(*c, marks=pytest.mark.long)
        for c in SPREAD
    ],
)
def test_two_ranks_hard_crash_in_save_phase(tmp_path, rank, phase, zero):
    ref = _spec(tmp_path / "ref", zero, workers=2)
    assert run_spawned(ref) == [0, 0]
    spec = _spec(tmp_path / "run", zero, f"faults=[{{rank: {rank}, phase: {phase}, at_save: 3}}]", workers=2)
    assert run_spawned(spec)[rank] == 17
    assert resumable_states(spec)
    assert run_spawned(spec) == [0, 0]
    final = f"{20:012d}"
    assert digest(spec, final) == digest(ref, final)
