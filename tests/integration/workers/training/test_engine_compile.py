"""``train.compile``: the model compiled through DeepSpeed's ``engine.compile`` (inductor on CPU), two
ranks, the example's LM with dropout: a crash recovered in place ends bitwise the uninterrupted
compiled run, and the compiled graphs are kept in the job's compile cache, where the recovered
process reads them back (the cache's own rules: tests/unit/workers/training/test_compile_cache.py)."""

from __future__ import annotations

import pytest

from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import digest, lm_spec, state_names

pytestmark = pytest.mark.slow

COMPILED = [
    "train.compile=true",
    "task.config.num_samples=96",
    "checkpoint.save_every={value: 2, unit: optimizer_steps}",
]


def test_a_compiled_run_recovered_in_place_from_a_crash_is_bitwise_the_uninterrupted_one(tmp_path):
    cache = tmp_path / "inductor"
    env = f'scaling.env={{"TORCHINDUCTOR_CACHE_DIR": "{cache}"}}'
    ref = lm_spec(tmp_path / "ref", *COMPILED, env, workers=2)
    assert run_spawned(ref) == [0, 0]
    assert any(cache.rglob("*.py")), "the compiled graphs' code is kept in the job's compile cache"
    run = lm_spec(
        tmp_path / "run",
        *COMPILED,
        env,
        "failure.max_failures=1",
        "faults=[{rank: 1, at_micro_step: 11, mode: exit}]",
        workers=2,
    )
    assert run_spawned(run, in_place=True) == [0, 0]
    final = state_names(ref)[-1]
    assert state_names(run)[-1] == final and digest(run, final) == digest(ref, final)
