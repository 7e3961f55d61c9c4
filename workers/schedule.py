"""The LR schedule: the live spec decides values; a state contributes only its position.

Why position-only: a user who edits the learning rate or the horizon and restarts expects the
edit to take effect. What cannot be continued meaningfully (another schedule type, or its phases
in another order) is refused with the opt-out named, ``resume.reset_schedule: true``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from policies.errors import ScheduleMismatch
from policies.spec import SchedulerSpec


def phases(s: SchedulerSpec) -> list[str]:
    return (["linear_warmup"] if s.warmup else []) + [s.type]


def lr_at(position: int, base_lr: float, s: SchedulerSpec, total: int) -> float:
    """Learning rate for the step taken at ``position`` (steps or epochs already completed)."""
    if s.warmup and position < s.warmup:
        return base_lr * (position + 1) / s.warmup
    if s.type == "constant":
        return base_lr
    span = max(1, total - s.warmup)
    progress = min(1.0, max(0.0, (position - s.warmup) / span))
    if s.type == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return base_lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * factor)


def schedule_record(s: SchedulerSpec, position: int) -> dict[str, Any]:
    """What ``trainer.json`` stores: identity of the schedule's shape plus position and unit."""
    return {"type": s.type, "phases": phases(s), "unit": s.unit, "position": position}


def resume_position(saved: dict[str, Any] | None, live: SchedulerSpec, *, optimizer_step: int, epoch_done: int,
                    reset: bool, warn: Callable[[str], None]) -> int:
    """Where the live schedule continues from, given what a state recorded.

    - no record: warn, start at 0;  - reset opt-out: 0;
    - other type/phase order: ``ScheduleMismatch`` naming ``resume.reset_schedule``;
    - other unit: warn loudly and recompute the position in the live unit from the state's counters.
    """
    if reset:
        return 0
    if not saved or "position" not in saved:
        warn("the resumed state records no LR-schedule position; the schedule starts from the beginning")
        return 0
    if saved.get("type") != live.type or saved.get("phases") != phases(live):
        raise ScheduleMismatch(
            f"train.scheduler changed from {saved.get('type')} {saved.get('phases')} to {live.type} {phases(live)}; "
            "a schedule of another type or phase order cannot be continued. Set resume.reset_schedule: true "
            "to restart the schedule from step 0 on these weights, or restore the previous scheduler.")
    if saved.get("unit") != live.unit:
        new = optimizer_step if live.unit == "optimizer_steps" else epoch_done
        warn(f"!!! train.scheduler.unit changed from {saved.get('unit')} to {live.unit}: the schedule position is "
             f"recomputed as {new} {live.unit} from the state's counters")
        return new
    return int(saved["position"])
