"""Property: a run interrupted once or twice and resumed is the uninterrupted run.

Hypothesis draws the layout (micro-batches per epoch, accumulation, 1-2 epochs), the save interval
and its unit (or no periodic saves), the ZeRO stage and one or two crash points inside the run
(``mode: raise`` faults on the fast single-rank in-process path, ``tests.tasks:linear`` with
``micro_batch_size: 1`` so ``num_samples`` is the number of micro-batches per epoch). The resumed
run must match the uninterrupted one in every optimizer step's loss and learning rate, in the set
of committed states, and in the final state's canonical digest.

The fast test runs ~15 examples; ``SYNCPOINT_SLOW=1`` raises it to 200, and the ``slow``-marked
variant always runs 200.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from tests.helpers import committed_steps, digest, linear_spec, run, run_until_crash, step_history

FAST_EXAMPLES = 200 if os.environ.get("SYNCPOINT_SLOW") == "1" else 15

COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@dataclass(frozen=True)
class Scenario:
    micro_batches_per_epoch: int
    grad_accum: int
    epochs: int
    save_value: int  # 0: no periodic saves (only the final state)
    save_unit: str
    zero_stage: int
    crashes: tuple[int, ...]  # global micro-steps, increasing, within the run

    @property
    def layout(self) -> tuple:
        return (
            self.micro_batches_per_epoch,
            self.grad_accum,
            self.epochs,
            self.save_value,
            self.save_unit,
            self.zero_stage,
        )


@st.composite
def scenarios(draw) -> Scenario:
    mbpe = draw(st.integers(1, 10))
    accum = draw(st.integers(1, 5))
    epochs = draw(st.integers(1, 2))
    save_value = draw(st.integers(0, 5))
    save_unit = draw(st.sampled_from(["micro_steps", "optimizer_steps"]))
    zero = draw(st.sampled_from([0, 1, 2]))
    total = mbpe * epochs  # the run's micro-steps
    first = draw(st.integers(1, total))
    crashes = [first]
    if first < total and draw(st.booleans()):
        crashes.append(draw(st.integers(first + 1, total)))
    return Scenario(mbpe, accum, epochs, save_value, save_unit, zero, tuple(crashes))


# ------------------------------------------------------------------ runs

_WORKDIR: list[str] = []
_REFERENCES: dict[tuple, tuple] = {}  # layout -> (spec, final state, history, committed steps, digest)


@pytest.fixture(scope="module", autouse=True)
def _workdir():
    _WORKDIR.append(tempfile.mkdtemp(prefix="syncpoint-property-"))
    yield
    shutil.rmtree(_WORKDIR.pop(), ignore_errors=True)
    _REFERENCES.clear()


def _spec(storage: str, s: Scenario, *extra: str):
    return linear_spec(
        storage,
        f"task.config.num_samples={s.micro_batches_per_epoch}",
        "train.micro_batch_size=1",
        f"train.grad_accum={s.grad_accum}",
        f"train.epochs={s.epochs}",
        # a non-constant schedule, so equal learning rates mean the schedule position resumed exactly
        "train.scheduler={type: cosine, warmup: 2, min_lr_ratio: 0.1}",
        f"checkpoint.save_every={{value: {s.save_value}, unit: {s.save_unit}}}",
        f"deepspeed.zero_stage={s.zero_stage}",
        *extra,
    )


def _steps(spec) -> dict[int, tuple]:
    return {step: (r.global_micro_step, r.epoch, r.loss, r.lr) for step, r in step_history(spec).items()}


def _reference(s: Scenario) -> tuple:
    """The uninterrupted run for this layout, run once per module."""
    if s.layout not in _REFERENCES:
        spec = _spec(tempfile.mkdtemp(dir=_WORKDIR[0], prefix="ref-"), s)
        final = run(spec).final_state
        _REFERENCES[s.layout] = (spec, final, _steps(spec), committed_steps(spec), digest(spec, final))
    return _REFERENCES[s.layout]


def check_resume_equals_uninterrupted(s: Scenario) -> None:
    note(f"scenario: {s}")
    event(f"{len(s.crashes)} crash(es)")
    event(f"ZeRO {s.zero_stage}")
    event("no periodic saves" if s.save_value == 0 else f"save every {s.save_unit}")
    ref_spec, ref_final, ref_steps, ref_committed, ref_digest = _reference(s)
    assert int(ref_final) == s.micro_batches_per_epoch * s.epochs  # the last micro-step is always committed

    storage = tempfile.mkdtemp(dir=_WORKDIR[0], prefix="run-")
    try:
        faults = ", ".join(f"{{at_micro_step: {k}, mode: raise}}" for k in s.crashes)
        spec = _spec(storage, s, f"faults=[{faults}]")
        for k in s.crashes:
            assert run_until_crash(spec), f"no crash at micro-step {k}"
            note(f"after crash at {k}: committed {committed_steps(spec)}")
        result = run(spec)

        assert result.final_state == ref_final
        steps = _steps(spec)
        assert sorted(steps) == sorted(ref_steps)
        for step, (gms, epoch, loss, lr) in ref_steps.items():
            assert steps[step][:2] == (gms, epoch), f"optimizer step {step} at another position"
            assert steps[step][2] == loss, f"loss differs at optimizer step {step}"
            assert steps[step][3] == lr, f"lr differs at optimizer step {step}"
        assert committed_steps(spec) == ref_committed
        assert digest(spec, result.final_state) == ref_digest
    finally:
        shutil.rmtree(storage, ignore_errors=True)


@settings(max_examples=FAST_EXAMPLES, **COMMON)
@given(scenarios())
def test_resume_equals_uninterrupted(scenario):
    check_resume_equals_uninterrupted(scenario)
