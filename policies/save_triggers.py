"""Save triggers: *when* to ask for a state, never *where* one is written.

A trigger only raises requests. The loop keeps a request pending until the next sync boundary
and services it there, so a request that falls mid-cycle is carried forward, never dropped and
never written mid-cycle. Users plug their own trigger in by import path
(``checkpoint.save_trigger: "pkg.mod:Class"``); it receives the same plain counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Tick:
    """What the loop tells a trigger after every micro-step (plain data, no engine)."""

    global_micro_step: int
    optimizer_step: int
    stepped: bool  # an optimizer step fired on this micro-step
    seconds_since_last_save: float


class SaveTrigger(Protocol):
    def wants_save(self, tick: Tick) -> bool:
        """Return True to raise a save request at this tick (serviced at the next boundary)."""


class EveryMicroSteps:
    """Request a save whenever the global micro-step reaches a multiple of ``every``."""

    def __init__(self, every: int) -> None:
        self.every = every

    def wants_save(self, tick: Tick) -> bool:
        return tick.global_micro_step % self.every == 0


class EveryOptimizerSteps:
    """Request a save after every ``every``-th optimizer step (always lands on a boundary)."""

    def __init__(self, every: int) -> None:
        self.every = every

    def wants_save(self, tick: Tick) -> bool:
        return tick.stepped and tick.optimizer_step % self.every == 0


class EverySeconds:
    """Request a save once ``every`` seconds have passed since the last committed state.

    Wall-clock time differs between ranks, so the loop makes every rank agree on the decision
    with one collective before acting on it.
    """

    wall_clock = True

    def __init__(self, every: float) -> None:
        self.every = every

    def wants_save(self, tick: Tick) -> bool:
        return tick.seconds_since_last_save >= self.every


class Never:
    """No periodic saves (the final state and preemption notices still save)."""

    def wants_save(self, tick: Tick) -> bool:
        return False


def trigger_from_interval(value: float, unit: str) -> SaveTrigger:
    """Build the built-in trigger for ``checkpoint.save_every``."""
    if value <= 0:
        return Never()
    if unit == "micro_steps":
        return EveryMicroSteps(int(value))
    if unit == "optimizer_steps":
        return EveryOptimizerSteps(int(value))
    if unit == "seconds":
        return EverySeconds(float(value))
    raise ValueError(f"unknown save_every unit {unit!r}")


class PendingSave:
    """The never-drop latch: once requested, a save stays pending until a boundary services it."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def request(self, reason: str) -> None:
        if reason not in self.reasons:
            self.reasons.append(reason)

    @property
    def pending(self) -> bool:
        return bool(self.reasons)

    def take(self) -> list[str]:
        reasons, self.reasons = self.reasons, []
        return reasons
