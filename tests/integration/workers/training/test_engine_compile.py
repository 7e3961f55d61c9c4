"""``train.compile``: the model compiled through DeepSpeed's ``engine.compile`` (inductor on CPU), a
model with dropout: a crash recovered in place ends bitwise the uninterrupted compiled run, and the
compiled graphs are kept in the job's compile cache, where the recovered process reads them
back (the cache's own rules: tests/unit/workers/training/test_compile_cache.py). Both ``long``:
a first compile takes 30 s (the linear task on one rank) to 70 s (the example's transformer LM on
two ranks) of CPU; make test checks the compile cache's rules (tests/unit/workers/training)."""

from __future__ import annotations

import pytest

from syncpoint.workers.supervision.launch import run_spawned
from tests.helpers import digest, linear_spec, lm_spec, state_names

pytestmark = pytest.mark.slow

COMPILED = ["train.compile=true", "checkpoint.save_every={value: 2, unit: optimizer_steps}"]
TASKS = {  # (spec, its size, ranks)
    "linear": (linear_spec, ["task.config.num_samples=24"], 1),
    "lm": (lm_spec, ["task.config.num_samples=96"], 2),
}


@pytest.mark.long
@pytest.mark.parametrize("task", ["linear", "lm"])
def test_a_compiled_run_recovered_in_place_from_a_crash_is_bitwise_the_uninterrupted_one(tmp_path, task):
    make, size, ranks = TASKS[task]
    cache = tmp_path / "inductor"
    # compiled in each training process itself (no pool of compile workers to start: CPU the suite keeps)
    env = f'scaling.env={{"TORCHINDUCTOR_CACHE_DIR": "{cache}", "TORCHINDUCTOR_COMPILE_THREADS": "1"}}'
    ref = make(tmp_path / "ref", *COMPILED, *size, env, workers=ranks)
    assert run_spawned(ref) == [0] * ranks
    assert any(cache.rglob("*.py")), "the compiled graphs' code is kept in the job's compile cache"
    run = make(
        tmp_path / "run",
        *COMPILED,
        *size,
        env,
        "failure.max_failures=1",
        f"faults=[{{rank: {ranks - 1}, at_micro_step: 9, mode: exit}}]",
        workers=ranks,
    )
    assert run_spawned(run, in_place=True) == [0] * ranks
    final = state_names(ref)[-1]
    assert state_names(run)[-1] == final and digest(run, final) == digest(ref, final)
