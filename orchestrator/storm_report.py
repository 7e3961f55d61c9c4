"""A storm's verdict: the interrupted run against the uninterrupted one, and every interruption's fate
(the attempt it struck, the restart it caused and what that cost).

Why apart from the storm's runner (``syncpoint.orchestrator.storm``): the verdict reads only the two runs'
event logs and the plan, after the fact; the runner plays the cloud while the run trains.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from syncpoint.policies.contracts.journal import FaultFired, Journal
from syncpoint.policies.contracts.spec import JobSpec

if TYPE_CHECKING:
    from syncpoint.orchestrator.drill import DrillReport
    from syncpoint.orchestrator.storm import Removal, StormPlan


def wall_seconds(journal: Journal) -> float:
    """A finished run's wall time (its summary's; 0 when it did not finish)."""
    from syncpoint.orchestrator.timeline import summarize

    s = summarize(journal)
    return s.wall_seconds if s else 0.0


def fired_fault(journal: Journal, fault_id: str) -> FaultFired | None:
    """The event of a fault the run recorded as fired (None: not yet)."""
    return next((e for e in journal.of_kind(FaultFired) if e.fault == fault_id), None)


def storm_report(
    ref: JobSpec, run: JobSpec, plan: StormPlan, rc_ref: int, rc_run: int, problems: list[str], removals: list[Removal]
) -> DrillReport:
    """The storm's verdict: the interrupted run against the uninterrupted one, and every interruption's fate."""
    from syncpoint.orchestrator.drill import DrillReport, judge
    from syncpoint.orchestrator.timeline import restarts
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    ref_journal = EventLog(RunStorage(ref.run_url)).journal()
    journal = EventLog(RunStorage(run.run_url)).journal()
    lines, ok = attribute(plan, journal, removals)
    ok = ok and rc_ref == 0 and rc_run == 0 and not problems
    lines += [f"storm: {p}" for p in problems]
    if rc_run != 0:
        lines.append("storm: the interrupted run failed (its error is above)")
    ref_wall, run_wall = wall_seconds(ref_journal), wall_seconds(journal)
    lost = sum(r.lost_seconds for r in restarts(journal))
    # the run's own goodput (syncpoint.policies.decisions.goodput, itemised) is one of judge()'s lines below
    lines.append(
        f"wall time: reference {ref_wall:.1f} s, interrupted run {run_wall:.1f} s "
        f"({ref_wall / run_wall:.0%}); {lost:.1f} s of computed work lost"
        if run_wall > 0
        else "wall time: unknown (the interrupted run did not finish)"
    )
    judged, verdict_lines, verdict = judge(ref, run, ref_journal, journal)
    lines += verdict_lines
    ok = ok and judged
    lines.append("RESULT: " + (f"{len(plan.interruptions)} interruptions survived; {verdict}" if ok else "FAILED"))
    return DrillReport("\n".join(lines), ok)


def attribute(plan: StormPlan, journal: Journal, removals: list[Removal]) -> tuple[list[str], bool]:
    """Each interruption with the attempt(s) it struck and what each restart cost; (lines, ok): ok when
    every interruption struck and caused exactly its own restart(s), and no restart is unexplained."""
    from syncpoint.orchestrator.timeline import restarts

    starts = journal.attempts
    by_prev = {prev.attempt: r for prev, r in zip(starts, restarts(journal), strict=False)}
    lines = [
        "interruption  kind        requested  struck at       attempt  classified   resumed from  "
        "lost micro-steps  lost seconds"
    ]
    ok, explained = True, set()
    for entry in plan.interruptions:
        struck: list[tuple[int, str]] = []  # (attempt, where)
        worker = [f for f in entry.faults if f.mode != "hold"]
        for f in worker:
            fired = fired_fault(journal, f.fault_id)
            if fired is not None:
                at = re.search(r"micro-step (\d+)", fired.where)
                struck.append((fired.attempt, ("save at " if f.phase else "step ") + (at.group(1) if at else "?")))
        for rm in (r for r in removals if r.interruption == entry.index):
            hold = fired_fault(journal, entry.hold.fault_id)
            where = (
                f"step {hold.global_micro_step}" if hold is not None and hold.attempt == rm.attempt else "attempt start"
            )
            struck.append((rm.attempt, where))
        if len(struck) < entry.restarts_expected:
            ok = False
            lines.append(f"{entry.index:>12}  {entry.kind:<10}  {entry.point:>9}  did not strike (see above)")
            continue
        for attempt, where in struck:
            r = by_prev.get(attempt)
            explained.add(attempt)
            if r is None:
                ok = False
                lines.append(
                    f"{entry.index:>12}  {entry.kind:<10}  {entry.point:>9}  {where:<14}  {attempt:>7}  "
                    "no restart followed"
                )
                continue
            lines.append(
                f"{entry.index:>12}  {entry.kind:<10}  {entry.point:>9}  {where:<14}  {attempt:>7}  "
                f"{r.cause:<11}  {r.resumed_from or 'scratch':<12}  {r.lost_micro_steps:>16}  "
                f"{r.lost_seconds:>12.2f}"
            )
    unexplained = sorted(set(by_prev) - explained)
    for attempt in unexplained:
        r = by_prev[attempt]
        lines.append(f"restart after attempt {attempt} was not planned: {r.cause} ({r.reason or 'no reason'})")
    total = sum(i.restarts_expected for i in plan.interruptions)
    lines.append(f"restarts: {len(by_prev)} (planned {total})")
    return lines, ok and not unexplained and len(by_prev) == total
