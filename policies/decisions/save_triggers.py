"""Save triggers: *when* to ask for a state, never *where* one is written.

A trigger only raises requests. The loop keeps a request pending until the next sync boundary
and services it there, so a request that falls mid-cycle is carried forward, never dropped and
never written mid-cycle. Users plug their own trigger in by import path
(``checkpoint.save_trigger: "pkg.mod:Class"``); it receives the same plain counters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from syncpoint.policies.decisions.save_interval import AutoDecision, PreemptionHistory, decide


@dataclass(frozen=True)
class Tick:
    """What the loop tells a trigger after every micro-step (plain data, no engine)."""

    global_micro_step: int
    optimizer_step: int
    stepped: bool  # an optimizer step fired on this micro-step
    seconds_since_last_save: float


class SaveTrigger(Protocol):
    """When to request a save (``checkpoint.save_every``, ``checkpoint.save_every_seconds``, or a
    class of your own). A request that falls mid-cycle is carried to the next sync boundary by the
    loop, never dropped: a trigger only says *that* a save is wanted, never where it lands."""

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


class AutoInterval:
    """``checkpoint.save_every: auto``: a wall-clock interval from the Young-Daly optimum
    (``syncpoint.policies.decisions.save_interval``), re-decided after every committed save with the run's measured
    save cost and preemption history. Before any save was measured it asks at the first boundary
    (the probe: the cost is measured, not guessed). A request is still only a request: the loop
    carries it to the next boundary like any other.

    ``history`` is what this run's event log held when the attempt started (earlier attempts'
    preemptions, running time and save costs); ``observe_save`` adds each of this attempt's saves
    with the attempt's elapsed time. ``on_decision`` receives every decision with its inputs (the
    worker logs it); it is called only when the interval changes by more than 10%, and at the first.
    """

    wall_clock = True

    def __init__(
        self,
        prior_per_hour: float,
        history: PreemptionHistory | None = None,
        on_decision: Callable[[AutoDecision], None] | None = None,
    ) -> None:
        self.prior_per_hour = prior_per_hour
        self.history = history or PreemptionHistory(0, 0.0, ())
        self.costs: list[float] = list(self.history.costs)
        self.on_decision = on_decision
        self.decision: AutoDecision | None = None
        self._probe_asked = False
        self._decide(0.0)

    @property
    def interval_s(self) -> float | None:
        return self.decision.interval_s if self.decision else None

    def observe_save(self, cost_seconds: float, attempt_elapsed_s: float) -> AutoDecision:
        """A save committed: its cost (``save_interval.cost_of``: blocked and contended seconds) joins
        the measurements; decide again."""
        self.costs.append(cost_seconds)
        return self._decide(attempt_elapsed_s)

    def _decide(self, attempt_elapsed_s: float) -> AutoDecision:
        new = decide(
            self.costs,
            self.history.preemptions,
            self.history.exposure_s + attempt_elapsed_s,
            self.prior_per_hour,
            self.history.announced,
        )
        old = self.decision
        changed = (
            old is None
            or (old.interval_s is None) != (new.interval_s is None)
            or (
                new.interval_s is not None
                and old.interval_s is not None
                and abs(new.interval_s - old.interval_s) > 0.1 * old.interval_s
            )
        )
        self.decision = new
        if changed and self.on_decision is not None:
            self.on_decision(new)
        return new

    def wants_save(self, tick: Tick) -> bool:
        interval = self.interval_s
        if interval is None:  # the probe: asked once, carried to a boundary and never dropped
            asked, self._probe_asked = self._probe_asked, True
            return not asked
        return tick.seconds_since_last_save >= interval


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
