"""Property: over (spec, change between attempts, interruption), a resumed run either equals the
uninterrupted run of the *new* spec from that state, or is refused before any tensor is read,
with a reason naming the field.

Hypothesis draws a layout (micro-batches per epoch, accumulation, epochs, ZeRO stage), a first
interruption (a crash at any micro-step, the last one included, i.e. right after the final
commit; a crash inside any save phase; or none: the run finished and is re-submitted), a change
to the spec drawn from every field that matters (hyper-parameters, run length, schedule, data,
seed, layout, optimizer type, checksum, async saves, retention) and a second interruption under
the new spec. The reference is the same first attempt's directory, copied, resumed with the new
spec without interruption. Both must agree in every optimizer step's loss, learning rate and
sample ids, in the committed states and in the final state's digest (weights and optimizer
moments); or both must refuse at selection, before an attempt starts, naming the field.

The fast slice runs 10 examples; the ``slow`` variant runs 150 (``SYNCPOINT_SLOW=1`` makes the
fast one that large too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.supervision.faults import InjectedCrash
from tests.helpers import committed_steps, digest, linear_spec, run, step_history, with_overrides

FAST_EXAMPLES = 150 if os.environ.get("SYNCPOINT_SLOW") == "1" else 10
COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PHASES = [
    "before_shards",
    "after_some_shards",
    "before_manifest",
    "during_manifest",
    "before_retention",
    "during_retention",
]

# (label, overrides applied to the new spec, the field a refusal must name, or None: it resumes)
CHANGES: list[tuple[str, tuple[str, ...], str | None]] = [
    ("nothing", (), None),
    ("lr", ("train.lr=0.02",), None),
    ("weight decay", ("train.optimizer.weight_decay=0.3",), None),
    ("betas and eps", ("train.optimizer.betas=[0.8, 0.95]", "train.optimizer.eps=1e-6"), None),
    ("clipping", ("train.gradient_clipping=0.05",), None),
    ("one more epoch", ("train.epochs=+1",), None),
    ("max_steps", ("train.max_steps=3",), None),
    ("warmup length", ("train.scheduler.warmup=3",), None),
    ("checksum", ("checkpoint.checksum=sha256",), None),
    ("async saves", ("checkpoint.async_save=true",), None),
    ("retention", ("checkpoint.keep_last=1",), None),
    ("reset schedule", ("train.scheduler.type=linear", "resume.reset_schedule=true"), None),
    ("reset optimizer", ("train.optimizer.type=sgd", "resume.reset_optimizer=true"), None),
    ("schedule type", ("train.scheduler.type=linear",), "resume.reset_schedule"),
    ("dataset size", ("task.config.num_samples=+1",), "data.num_samples"),
    ("seed", ("train.seed=4",), "train.seed"),
    ("accumulation", ("train.grad_accum=+1",), "train.grad_accum"),
    ("micro-batch", ("train.micro_batch_size=2",), "train.micro_batch_size"),
    ("ZeRO stage", ("deepspeed.zero_stage=other",), "deepspeed.zero_stage"),
    ("optimizer type", ("train.optimizer.type=sgd",), "train.optimizer.type"),
]


@dataclass(frozen=True)
class Scenario:
    mbpe: int
    accum: int
    epochs: int
    zero: int
    first: tuple[str, int, int]  # ("step", k, 0) | ("phase", phase index, save n) | ("none", 0, 0)
    change: int  # index into CHANGES
    second: int  # micro-step of the second crash under the new spec (0: none)


@st.composite
def scenarios(draw) -> Scenario:
    mbpe, accum, epochs = draw(st.integers(2, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    zero = draw(st.sampled_from([0, 2]))
    total = mbpe * epochs
    kind = draw(st.sampled_from(["step", "step", "phase", "none"]))
    if kind == "step":
        first = ("step", draw(st.integers(1, total)), 0)
    elif kind == "phase":
        first = ("phase", draw(st.integers(0, len(PHASES) - 1)), draw(st.integers(1, 3)))
    else:
        first = ("none", 0, 0)
    change = draw(st.integers(0, len(CHANGES) - 1))
    second = draw(st.integers(0, total + mbpe))
    return Scenario(mbpe, accum, epochs, zero, first, change, second)


def _base(storage: str, s: Scenario, *extra: str):
    return linear_spec(
        storage,
        f"task.config.num_samples={s.mbpe}",
        "train.micro_batch_size=1",
        f"train.grad_accum={s.accum}",
        f"train.epochs={s.epochs}",
        f"deepspeed.zero_stage={s.zero}",
        "train.scheduler={type: cosine, warmup: 2, min_lr_ratio: 0.1}",
        "train.record_samples=true",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


def _changed(spec, s: Scenario, *extra: str):
    overrides = []
    for o in CHANGES[s.change][1]:
        key, _, value = o.partition("=")
        if value.startswith("+"):
            current = {"train.epochs": s.epochs, "task.config.num_samples": s.mbpe, "train.grad_accum": s.accum}[key]
            value = str(current + int(value[1:]))
        elif value == "other":
            value = "0" if s.zero else "2"
        overrides.append(f"{key}={value}")
    return with_overrides(spec, *overrides, *extra)


def _first_fault(s: Scenario) -> list[str]:
    kind, a, b = s.first
    if kind == "step":
        return [f"faults=[{{at_micro_step: {a}, mode: raise}}]"]
    if kind == "phase":
        return [f"faults=[{{phase: {PHASES[a]}, at_save: {b}, mode: raise}}]"]
    return []


def _attempt(spec) -> tuple[str, Any]:
    """('done', result) | ('crash', None) | ('refused', message)."""
    try:
        return "done", run(spec)
    except InjectedCrash:
        return "crash", None
    except ResumeRefused as e:
        return "refused", str(e)


def _attempts_started(spec) -> int:
    return sum(1 for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "attempt_started")


def _observed(spec, final: str) -> tuple:
    steps = {k: (r.global_micro_step, r.loss, r.lr, tuple(r.samples or ())) for k, r in step_history(spec).items()}
    return steps, committed_steps(spec), digest(spec, final)


def check(s: Scenario, workdir: str) -> None:
    label, _, field = CHANGES[s.change]
    note(f"scenario: {s} change: {label}")
    event(f"change: {label}")
    event(f"first interruption: {s.first[0]}")
    run_dir = tempfile.mkdtemp(dir=workdir)
    first = _base(run_dir, s, *_first_fault(s))
    outcome, _ = _attempt(first)
    had_state = bool(committed_steps(first))
    # the reference: the same directory, copied, resumed with the new spec without interruption
    ref_dir = tempfile.mkdtemp(dir=workdir)
    shutil.copytree(run_dir, ref_dir, dirs_exist_ok=True)
    ref_spec = _changed(_base(ref_dir, s), s, "faults=[]")
    second = [f"faults=[{{at_micro_step: {s.second}, mode: raise}}]"] if s.second else ["faults=[]"]
    new_spec = _changed(_base(run_dir, s), s, *second)
    note(f"first attempt: {outcome}, committed {committed_steps(first)}")

    before = _attempts_started(ref_spec)
    ref_outcome, ref_value = _attempt(ref_spec)
    if field is not None and had_state:
        assert ref_outcome == "refused", f"{label}: expected a refusal naming {field}, got {ref_outcome}"
        assert field in str(ref_value), ref_value
        assert _attempts_started(ref_spec) == before, "refused only after an attempt started"
        outcome2, value2 = _attempt(new_spec)
        assert outcome2 == "refused" and field in str(value2)
        return
    assert ref_outcome == "done", f"{label}: the reference did not finish: {ref_outcome} {ref_value}"
    outcome2, value2 = _attempt(new_spec)
    if outcome2 == "crash":
        outcome2, value2 = _attempt(new_spec)
    assert outcome2 == "done", f"{label}: {outcome2} {value2}"
    assert value2.final_state == ref_value.final_state
    got, want = _observed(new_spec, value2.final_state), _observed(ref_spec, ref_value.final_state)
    assert got[0] == want[0], "per-step loss, lr or samples differ"
    if "async" not in label:  # with one upload in flight, which interval saves happen depends on timing
        assert got[1] == want[1], "committed states differ"
    assert got[2] == want[2], "final digest differs"


@settings(max_examples=FAST_EXAMPLES, **COMMON)
@given(scenarios())
def test_changed_spec_resumes_exactly_or_is_refused(workdir, scenario):
    check(scenario, workdir)
