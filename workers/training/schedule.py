"""The LR schedule: the live spec decides values; a state contributes only its position.

A schedule is a factor on each param group's own base learning rate (``syncpoint.workers.training.param_groups``):
constant, linear, cosine, wsd (warmup-stable-decay), inverse_sqrt, polynomial, step, or a custom
function named by import path.

Why position-only: a user who edits the learning rate or the horizon and restarts expects the
edit to take effect. What cannot be continued meaningfully (another schedule type, or its phases
in another order) is refused with the opt-out named, ``resume.reset_schedule: true``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import JobConfigError, ScheduleMismatch
from syncpoint.policies.contracts.import_path import load_function
from syncpoint.policies.contracts.spec import SchedulerSpec
from syncpoint.policies.contracts.state_format import SchedulerRecord
from syncpoint.policies.contracts.state_format import scheduler_phases as phases


def factor_at(position: int, s: SchedulerSpec, total: int) -> float:
    """The factor on each param group's base rate for the step taken at ``position`` (steps or
    epochs already completed), for every built-in type (``custom``: ``Schedule``)."""
    if s.warmup and position < s.warmup:
        return (position + 1) / s.warmup
    if s.type == "constant":
        return 1.0
    after = position - s.warmup  # units since the warmup ended
    if s.type == "inverse_sqrt":
        shape = math.sqrt(max(1, s.warmup) / (position + 1))  # 1 where the warmup ends, then 1/sqrt
    elif s.type == "step":
        shape = (s.gamma if s.gamma is not None else 0.1) ** (after // (s.step_size or 1))
    elif s.type == "wsd":
        length = s.decay if s.decay is not None else max(1, round((s.decay_fraction or 0.0) * total))
        start = max(s.warmup, total - length)  # the stable phase runs from the warmup to here
        if position < start:
            return 1.0
        shape = _decay(min(1.0, (position - start) / max(1, total - start)), s.decay_shape or "linear")
    else:
        progress = min(1.0, max(0.0, after / max(1, total - s.warmup)))
        shape = (
            (1.0 - progress) ** (s.power if s.power is not None else 1.0)
            if s.type == "polynomial"
            else _decay(progress, s.type)
        )
    return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * shape


def _decay(progress: float, shape: str) -> float:
    return 1.0 - progress if shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(position: int, base_lr: float, s: SchedulerSpec, total: int) -> float:
    """Learning rate of a group with base rate ``base_lr`` at ``position`` (built-in types)."""
    return base_lr * factor_at(position, s, total)


class Schedule:
    """The live schedule: a built-in type, or ``custom``'s function loaded by import path.

    Built at the attempt's start, so a ``train.scheduler.path`` that does not resolve fails before
    anything is loaded or trained; every factor a custom function returns is checked (finite, >= 0)."""

    def __init__(self, s: SchedulerSpec) -> None:
        self.spec = s
        self.custom: Callable[[int, int], Any] | None = None
        if s.type == "custom":
            assert s.path is not None  # the spec requires it
            try:
                self.custom = load_function(s.path)
            except ValueError as e:
                raise JobConfigError(
                    f"train.scheduler.path: {e}. It must name a function fn(position: int, "
                    "total: int) -> float importable on every worker"
                ) from None

    def factor(self, position: int, total: int) -> float:
        if self.custom is None:
            return factor_at(position, self.spec, total)
        value = self.custom(position, total)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
            raise JobConfigError(
                f"train.scheduler.path: {self.spec.path} returned {value!r} at position {position} "
                f"(total {total}); it must return a finite factor >= 0 on each param group's base "
                "learning rate"
            )
        return float(value)


def schedule_record(s: SchedulerSpec, position: int) -> JSONObject:
    """What ``trainer.json`` stores: identity of the schedule's shape plus position and unit."""
    return SchedulerRecord.of(s, position).model_dump()


def resume_position(
    saved: SchedulerRecord | None,
    live: SchedulerSpec,
    *,
    optimizer_step: int,
    epoch_done: int,
    reset: bool,
    warn: Callable[[str], None],
) -> int:
    """Where the live schedule continues from, given what a state recorded.

    - no record: warn, start at 0;  - reset opt-out: 0;
    - other type/phase order: ``ScheduleMismatch`` naming ``resume.reset_schedule``;
    - other unit: warn loudly and recompute the position in the live unit from the state's counters.
    """
    if reset:
        return 0
    if saved is None or saved.position is None:  # a record may say null: selection does not compare it
        warn("the resumed state records no LR-schedule position; the schedule starts from the beginning")
        return 0
    if saved.type != live.type or saved.phases != phases(live):
        raise ScheduleMismatch(
            f"train.scheduler changed from {saved.type} {saved.phases} to {live.type} {phases(live)}; "
            "a schedule of another type or phase order cannot be continued. Set resume.reset_schedule: true "
            "to restart the schedule from step 0 on these weights, or restore the previous scheduler."
        )
    if saved.unit != live.unit:
        new = optimizer_step if live.unit == "optimizer_steps" else epoch_done
        warn(
            f"!!! train.scheduler.unit changed from {saved.unit} to {live.unit}: the schedule position is "
            f"recomputed as {new} {live.unit} from the state's counters"
        )
        return new
    return saved.position


def horizon_changed(saved: int | None, live: int, s: SchedulerSpec, position: int) -> str | None:
    """One line when a resume continues the schedule to another horizon than the state's (a raised
    ``train.max_steps``, more epochs, another ``scheduler.total``): the position carries on, but a
    decaying schedule's learning rate from here follows the new horizon. None when it is the same, not
    recorded (older states), or cannot change the rate (constant, or a custom function: it is told)."""
    if saved is None or saved == live or s.type == "constant":
        return None
    if s.type == "custom":
        return (
            f"the LR schedule's horizon changed from {saved} to {live} {s.unit} since the resumed state: "
            f"train.scheduler.path is called with total={live} from position {position} on"
        )
    before, after = factor_at(position, s, saved), factor_at(position, s, live)
    return (
        f"the LR schedule's horizon changed from {saved} to {live} {s.unit} since the resumed state "
        f"(train.max_steps, train.epochs or train.scheduler.total): from position {position} on the learning rate "
        f"follows the new horizon (factor {before:.4g} -> {after:.4g} here)"
    )
