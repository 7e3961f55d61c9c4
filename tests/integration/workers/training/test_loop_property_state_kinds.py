"""Property: whatever kinds of state a task carries, a run interrupted at any micro-step (the first,
the last, mid-cycle, at a boundary) and resumed is the uninterrupted run.

Hypothesis draws the kinds of state (``tests.state_kinds``: task-owned generators in the loss and
the dataset, a buffer the forward reads, running state in the optimizer's param groups, DeepSpeed's
counters read by the loss, a hash-ordered dataset), the layout, the ZeRO stage, DataLoader workers
and one or two crash points; the resumed run must match the uninterrupted one in every optimizer
step's loss and learning rate and in the final digest. This is the grid the last review walked by
hand; a small number of examples runs in ``make test``, ``SYNCPOINT_SLOW=1`` raises it.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from tests.helpers import digest, run, run_until_crash, step_history, with_overrides
from tests.state_kinds import KINDS

EXAMPLES = 200 if os.environ.get("SYNCPOINT_SLOW") == "1" else 25

TEXT = """
name: kinds
task: {path: tests.state_kinds:kinds_of_state, config: {num_samples: 8}}
train: {micro_batch_size: 1, grad_accum: 3, epochs: 2, seed: 5, lr: 0.01, log_every: 100000,
        scheduler: {type: cosine, warmup: 1, min_lr_ratio: 0.1}}
deepspeed: {zero_stage: 0}
checkpoint: {keep_last: 0, export_final: false, save_every: {value: 1, unit: optimizer_steps}}
"""


@st.composite
def scenarios(draw):
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True))
    if "hash" in kinds and "generators" in kinds:  # one dataset each: the hash-ordered one has no generator
        kinds.remove("hash")
    mbpe, accum, epochs = draw(st.integers(2, 7)), draw(st.integers(1, 4)), draw(st.integers(1, 2))
    zero = draw(st.sampled_from([0, 2]))
    workers = draw(st.sampled_from([0, 0, 2]))
    total = mbpe * epochs
    first = draw(st.sampled_from([1, total, draw(st.integers(1, total))]))  # the first, the last, anywhere
    crashes = [first]
    if first < total and draw(st.booleans()):
        crashes.append(draw(st.integers(first + 1, total)))
    return tuple(sorted(kinds)), mbpe, accum, epochs, zero, workers, tuple(crashes)


def _spec(storage: str, kinds, mbpe, accum, epochs, zero, workers, *extra):
    from syncpoint.orchestrator.spec_file import parse_spec, resolve_storage

    return resolve_storage(
        parse_spec(
            TEXT,
            "kinds",
            [
                f"storage={storage}",
                f"task.config.kinds={','.join(kinds)}",
                f"task.config.num_samples={mbpe}",
                f"train.grad_accum={accum}",
                f"train.epochs={epochs}",
                f"deepspeed.zero_stage={zero}",
                f"train.dataloader_workers={workers}",
                *extra,
            ],
        )
    )


def _steps(spec) -> dict[int, tuple]:
    return {step: (r.global_micro_step, r.loss, r.lr) for step, r in step_history(spec).items()}


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(scenarios())
def test_every_kind_of_state_resumes_exactly_from_any_interruption(scenario):
    kinds, mbpe, accum, epochs, zero, workers, crashes = scenario
    note(
        f"kinds {kinds}, {mbpe} micro-batches/epoch, accumulation {accum}, {epochs} epoch(s), ZeRO {zero}, "
        f"{workers} loader workers, crashes at {crashes}"
    )
    for k in kinds:
        event(k)
    root = tempfile.mkdtemp(prefix="syncpoint-kinds-")
    try:
        ref = _spec(os.path.join(root, "ref"), kinds, mbpe, accum, epochs, zero, workers)
        ref_final = run(ref).final_state
        faults = ", ".join(f"{{at_micro_step: {k}, mode: raise}}" for k in crashes)
        spec = with_overrides(
            _spec(os.path.join(root, "run"), kinds, mbpe, accum, epochs, zero, workers), f"faults=[{faults}]"
        )
        for k in crashes:
            assert run_until_crash(spec), f"no crash at micro-step {k}"
        result = run(spec)
        assert result.final_state == ref_final
        assert _steps(spec) == _steps(ref)
        assert digest(spec, ref_final) == digest(ref, ref_final)
    finally:
        shutil.rmtree(root, ignore_errors=True)
