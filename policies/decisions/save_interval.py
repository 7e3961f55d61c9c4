"""``checkpoint.save_every: auto``: the save interval from the Young-Daly optimum.

Why Young-Daly: with a save costing ``C`` seconds of blocked training and preemptions arriving
at random with mean time between them ``MTBF``, a save every ``tau`` seconds loses about
``C / tau`` of the time to saving and ``tau / (2 * MTBF)`` to recomputing the work since the last
state; the sum is smallest at ``tau = sqrt(2 * C * MTBF)`` (Young 1974, Daly 2006). The first-order
formula is within a fraction of a percent of the exact optimum while ``C`` is small against
``MTBF`` (always so here: seconds against hours), and ``bench/p8_goodput.py`` checks it against
the best fixed interval of a simulation driven by measured costs.

Why an estimate with a prior: a run sees few preemptions, so the rate observed after one
preemption five minutes in would swing the interval wildly. The rate is estimated as a
Gamma-Poisson posterior mean with one pseudo-preemption at the prior's mean time,
``MTBF = (exposure + prior_mtbf) / (preemptions + 1)``: exactly the prior
(``checkpoint.expected_preemptions_per_hour``) before anything was observed, the observed
``exposure / preemptions`` after many, and a long run without preemptions slowly lengthens it.

Why crashes count: what the interval insures against is a restart from the last committed state,
and a rank that crashes (a retried application failure: killed, out of memory, a hardware fault)
loses the work since it exactly as a preemption without notice does.

Why ``C`` is more than the blocked time: an asynchronous save blocks the loop only for its copy,
but its upload thread then serializes and writes on the node's cores; where training keeps every
core busy (CPU training, a small machine) that work comes out of training as surely as a blocked
second does. Each commit says how much of its background CPU time was such (``contended_seconds``:
the thread's CPU time times the share of the node's cores training keeps busy), and ``C`` counts it:
P13 measured auto async saves at 0.91x a plain loop's throughput on two busy cores when ``C`` was the
blocked time alone.

Why announced preemptions are taken out: a preemption whose notice's state committed before the
node went lost no work (the notice saved it), so it says nothing about how often a periodic save
is needed. The rate of the others (no notice, or a notice whose state did not commit in time) is
estimated the same way, ``MTBF = (exposure + prior_mtbf) / (preemptions - announced + 1)``: the
pseudo-preemption is an unannounced one, so a run whose notices have always come still saves
periodically, and its interval grows only as notices keep arriving (a notice may not come next
time; when one does not, the count says so at once).

Pure functions and plain data (no clock, no I/O): the worker feeds measurements in
(``syncpoint.workers.training.loop``), the trigger (``syncpoint.policies.decisions.save_triggers.AutoInterval``) asks
here.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from syncpoint.policies.contracts.journal import Failure, Journal, PreemptionNotice, StateCommitted
from syncpoint.policies.decisions.failures import APPLICATION, PREEMPTION

DEFAULT_PREEMPTIONS_PER_HOUR = 1.0  # when checkpoint.expected_preemptions_per_hour is not given
MIN_INTERVAL_S = 1.0  # a save per second at most: below that the formula's inputs are noise
MAX_INTERVAL_S = 24 * 3600.0  # at least a state a day, however rare preemptions look
COST_WINDOW = 5  # the median of the last few saves' cost: one slow save must not decide


def young_daly(save_cost_s: float, mtbf_s: float) -> float:
    """``sqrt(2 * C * MTBF)``, the interval that minimises expected lost time (both > 0, finite)."""
    if not (math.isfinite(save_cost_s) and math.isfinite(mtbf_s)) or save_cost_s <= 0 or mtbf_s <= 0:
        raise ValueError(
            f"young_daly needs a finite positive save cost and MTBF, got C={save_cost_s!r}, MTBF={mtbf_s!r}"
        )
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def mtbf_estimate(preemptions: int, exposure_s: float, prior_per_hour: float, announced: int = 0) -> float:
    """Mean time between preemptions that lose work: the posterior mean with one pseudo-preemption
    (unannounced) at the prior; ``announced`` of the ``preemptions`` committed their notice's state."""
    if prior_per_hour <= 0 or not math.isfinite(prior_per_hour):
        raise ValueError(f"prior_per_hour must be finite and > 0, got {prior_per_hour!r}")
    prior_mtbf = 3600.0 / prior_per_hour
    losing = max(0, preemptions) - min(max(0, announced), max(0, preemptions))
    return (max(0.0, exposure_s) + prior_mtbf) / (losing + 1)


def save_cost(costs: Iterable[float]) -> float | None:
    """The save cost ``C``: the median cost (blocked plus contended seconds) of the last
    ``COST_WINDOW`` saves (None before any)."""
    recent = [s for s in costs if math.isfinite(s) and s >= 0][-COST_WINDOW:]
    return statistics.median(recent) if recent else None


@dataclass(frozen=True)
class PreemptionHistory:
    """What a run's event log says about its preemptions: how many, over how much running time."""

    preemptions: int
    exposure_s: float  # seconds the run's attempts ran (start to their last event), restart gaps excluded
    costs: tuple[float, ...]  # every committed save's cost (blocked + contended seconds), oldest first
    announced: int = 0  # attempts whose preemption notice's state committed: they lost no work


def preemption_history(journal: Journal) -> PreemptionHistory:
    """The interruptions that restart from the last state: failures the failure policy classified
    as preemption, and the application failures it retried (a rank that crashed or was killed
    without notice loses the work since the last state exactly as a node lost without notice
    does; left out, a run whose ranks crash every minute computed its interval from its notices
    alone and saved every few minutes). An announced one ended
    an attempt (the last one started before it) that committed a state for its notice. A notice
    whose drain was cancelled ended no attempt, so it announces nothing. Exposure
    sums each attempt's span from its start to its last event, so the days between two
    submissions of the same run do not count as time without preemptions."""
    attempts = journal.attempts
    exposure = 0.0
    for i, a in enumerate(attempts):
        end = attempts[i + 1].time if i + 1 < len(attempts) else None
        times = [e.time for e in journal.events if a.time <= e.time and (end is None or e.time < end)]
        exposure += max(times) - a.time if times else 0.0
    failures = [
        f
        for f in journal.of_kind(Failure)
        if f.classified == PREEMPTION or (f.classified == APPLICATION and f.decision.upper() == "RETRY")
    ]
    noticed = {n.attempt for n in journal.of_kind(PreemptionNotice)}
    saved = {c.attempt for c in journal.commits if "preemption" in c.reasons and c.attempt in noticed}
    by_time = sorted(attempts, key=lambda a: a.time)
    started = [a.time for a in by_time]
    ended = [by_time[i - 1].attempt if (i := bisect.bisect_right(started, f.time)) else None for f in failures]
    # an attempt ends once, whatever its failures say (a notice's preemption and a rank's crash in it)
    interrupted = {a for a in ended if a is not None}
    count = len(interrupted) + sum(1 for a in ended if a is None)
    announced = len(interrupted & saved)
    return PreemptionHistory(count, exposure, tuple(cost_of(c) for c in journal.commits), announced)


def cost_of(commit: StateCommitted) -> float:
    """What a committed save cost training: its blocked time and its background work that took busy
    cores (a commit from before that was measured counts its blocked time alone)."""
    return commit.blocked_seconds + (commit.contended_seconds or 0.0)


@dataclass(frozen=True)
class AutoDecision:
    """One evaluation of ``save_every: auto``, with every input (logged by the worker)."""

    interval_s: float | None  # None: no save measured yet, so the next boundary saves (the probe)
    save_cost_s: float | None
    mtbf_s: float
    preemptions: int
    exposure_s: float
    prior_per_hour: float
    announced: int = 0

    def describe(self) -> str:
        saved = f" ({self.announced} saved by their notice)" if self.announced else ""
        inputs = (
            f"MTBF {self.mtbf_s:.0f} s from {self.preemptions} interruption(s){saved} in {self.exposure_s:.0f} s "
            f"run time and the prior {self.prior_per_hour:g}/hour"
        )
        if self.interval_s is None:
            return f"save_every auto: no save measured yet, the next boundary saves to measure one ({inputs})"
        return (
            f"save_every auto: a state every {self.interval_s:.1f} s = sqrt(2 x C {self.save_cost_s:.3f} s x {inputs})"
        )


def decide(
    costs: Iterable[float], preemptions: int, exposure_s: float, prior_per_hour: float, announced: int = 0
) -> AutoDecision:
    """The interval for what has been measured so far (each save's cost: ``cost_of``), clamped to
    [MIN_INTERVAL_S, MAX_INTERVAL_S]."""
    cost = save_cost(costs)
    mtbf = mtbf_estimate(preemptions, exposure_s, prior_per_hour, announced)
    interval = None
    if cost is not None:
        # a save measured at 0.000 s (a tiny state) still costs a boundary: floor C at a millisecond
        interval = min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, young_daly(max(cost, 1e-3), mtbf)))
    return AutoDecision(interval, cost, mtbf, preemptions, exposure_s, prior_per_hour, announced)
