"""Read a run's event log back into a timeline: attempts, restarts and the work each one lost.

Lost work of a restart = what the failed attempt had computed beyond the state the next attempt
resumed from: micro-steps recomputed, and the seconds between that state's snapshot and the
moment the attempt was last seen computing. Both come from the measured interruption point (the
ranks' heartbeat, recorded as ``interrupted`` by the controller) when the log has one; older logs
and runs outside Ray fall back to the last flushed progress (every few seconds and at every commit)
bounded by the failure's time (``Journal.reached``).
"""

from __future__ import annotations

from dataclasses import dataclass

from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Evaluated,
    Event,
    Failure,
    FaultFired,
    Finished,
    Interrupted,
    Journal,
    PreemptionNotice,
    ResumeDecision,
    StateCommitted,
    Submitted,
    UnknownEvent,
)
from syncpoint.policies.decisions.goodput import Goodput, goodput, submission_start


@dataclass
class Restart:
    """One restart as the timeline shows it: which attempt, from which state, and the work it lost."""

    attempt: int  # the attempt that resumed
    resumed_from: str | None
    resumed_micro_step: int
    previous_max_micro_step: int
    lost_micro_steps: int
    lost_seconds: float
    cause: str  # failure classification, or "restart"
    reason: str
    measured: bool = False  # the interruption point came from the heartbeat (``interrupted``), not progress


def restarts(journal: Journal) -> list[Restart]:
    """One per attempt after the first, with the work the attempt before it lost."""
    starts = journal.attempts
    return [_restart(journal, prev, cur) for prev, cur in zip(starts, starts[1:], strict=False)]


def _restart(journal: Journal, prev: AttemptStarted, cur: AttemptStarted) -> Restart:
    max_step, last_time, measured = journal.reached(prev, until=cur.time)
    # the state captured training at its snapshot: the commit time minus the save's duration
    # (an async commit lands steps later)
    commit = journal.commit_of(cur.resumed_from)
    # never before the failed attempt began training: when it had itself resumed the same state (a
    # second interruption before the next commit), the time since that commit holds a restart too
    since = max(commit.time - commit.seconds, prev.time) if commit else prev.time
    failure = journal.failure_between(prev.time, cur.time)
    return Restart(
        attempt=cur.attempt,
        resumed_from=cur.resumed_from,
        resumed_micro_step=cur.global_micro_step,
        previous_max_micro_step=max_step,
        lost_micro_steps=max(0, max_step - cur.global_micro_step),
        lost_seconds=max(0.0, last_time - since) if max_step > cur.global_micro_step else 0.0,
        cause=failure.classified if failure else "restart",
        reason=failure.reason if failure else "",
        measured=measured,
    )


def format_timeline(journal: Journal) -> str:
    """The run's timeline as text (``syncpoint events``): attempts, failures, saves, restarts, goodput."""
    if not journal.events:
        return "(no events)"
    t0 = journal.events[0].time
    lines = [line for e in journal.events if (line := _line(e, t0))]
    rs = restarts(journal)
    if rs:
        lines.append("")
        lines.append("restart  cause        resumed from   lost micro-steps  lost seconds  interruption point")
        for r in rs:
            lines.append(
                f"{r.attempt:>7}  {r.cause:<11}  {r.resumed_from or 'scratch':<13}  {r.lost_micro_steps:>16}  "
                f"{r.lost_seconds:>12.2f}  {'measured' if r.measured else 'from progress'}"
            )
    g = goodput(journal)
    if g is not None:
        lines.append("")
        lines.append(format_goodput(g))
    return "\n".join(lines)


def goodput_headline(g: Goodput) -> str:
    """``goodput N%``: the one rounding the summary line, ``syncpoint events``, ``status`` and the plot share."""
    return f"goodput {100 * g.ratio:.1f}%"


def badput_lines(g: Goodput) -> list[str]:
    """Every badput cause (``syncpoint.policies.decisions.goodput.BADPUT``) with its seconds and share of the
    wall time, then the uncommitted tail of a run still going; the same rows everywhere they show."""

    def share(x: float) -> str:
        return f"{100 * x / g.total_s:5.1f}%" if g.total_s > 0 else "    -"

    return [
        f"  {name:<28} {seconds:9.2f} s  {share(seconds)}"
        for name, seconds in g.losses.items()
        if seconds > 0 or name != "uncommitted"
    ]


def format_goodput(g: Goodput) -> str:
    """The goodput block: the ratio, then badput by cause with its share of the wall time, then each restart."""
    state = "" if g.finished else " (run not finished: so far)"
    lines = [
        f"{goodput_headline(g)}: productive {g.productive_s:.2f} s of {g.total_s:.2f} s wall time{state}; "
        f"badput {g.badput_s:.2f} s by cause:"
    ]
    lines += badput_lines(g)
    lines += [
        f"  after attempt {c.attempt}: {c.lost_micro_steps} micro-step{'s' if c.lost_micro_steps != 1 else ''} "
        f"recomputed ({c.recomputed_s:.2f} s, {'measured' if c.measured else 'from flushed progress'}), "
        f"restart gap {c.restart_gap_s:.2f} s, start-up {c.startup_s:.2f} s"
        for c in g.restarts
    ]
    return "\n".join(lines)


def _line(e: Event | UnknownEvent, t0: float) -> str | None:
    """One event's timeline line; None for the kinds the timeline leaves out (progress)."""
    what = _what_of_attempt(e)
    if what is None:
        what = _what_in_attempt(e, t0)
    return None if what is None else f"+{e.time - t0:8.2f}s  {e.kind:<17} {what}"


def _what_of_attempt(e: Event | UnknownEvent) -> str | None:
    """What starts, chooses, saves or ends an attempt."""
    match e:
        case Submitted():
            return f"{e.name} to {e.address}"
        case AttemptStarted():
            return (
                f"attempt {e.attempt} on {e.world_size} worker(s), "
                f"from {e.resumed_from or 'scratch'} (micro-step {e.global_micro_step})"
            )
        case ResumeDecision():
            rejected = [f"{c.state} {c.verdict}" for c in e.candidates if c.verdict != "resumable"]
            return f"chose {e.chosen or 'fresh start'}: {e.reason}" + (
                f"; rejected: {', '.join(rejected)}" if rejected else ""
            )
        case StateCommitted():
            return (
                f"{e.state} (optimizer step {e.optimizer_step}, {e.bytes / 1e6:.2f} MB, {e.seconds:.3f}s, "
                f"loop blocked {e.blocked_seconds:.3f}s{_contended(e.contended_seconds)}) [{', '.join(e.reasons)}]"
            )
        case Failure():
            return f"{e.classified} -> {e.decision}: {e.reason}" + (
                " (the previous attempt's failure again, no state in between: not retried)" if e.repeated else ""
            )
        case Finished():
            return f"finished at micro-step {e.global_micro_step} ({e.state})"
    return None


def _what_in_attempt(e: Event | UnknownEvent, t0: float) -> str | None:
    """What happens during an attempt: notices, evaluations, interruptions, injected faults."""
    match e:
        case PreemptionNotice():
            return f"{e.source} at micro-step {e.global_micro_step}" + (
                f", deadline in {(e.deadline_ms / 1000 - e.time):.1f}s" if e.deadline_ms else ""
            )
        case Evaluated():
            shown = ", ".join(f"{k} {v:.6g}" for k, v in e.metrics.items())
            return f"optimizer step {e.optimizer_step} (micro-step {e.global_micro_step}): {shown} ({e.seconds:.2f}s)"
        case Interrupted():
            ranks = ", ".join(f"rank {r.rank} {r.global_micro_step} at +{r.time - t0:.2f}s" for r in e.ranks)
            return (
                f"attempt {e.attempt} stopped at micro-step {e.global_micro_step} ({ranks}); "
                f"detected {e.detected_at - e.reached_at:.2f}s after the last heartbeat"
            )
        case FaultFired():
            return f"rank {e.rank} {e.mode} at {e.where}"
        case UnknownEvent():
            return f"not read: {e.problem}"
    return None


@dataclass
class RunSummary:
    """What the submission that ended at the log's last ``finished`` event amounts to: its own
    attempts, from its ``submitted`` event (or, without one, since the run's first event or an
    earlier finish). Earlier submissions' failed attempts are history (``syncpoint events``), not
    restarts of this run: a good run after a fixed bug reports no restarts."""

    state: str | None  # the state the run finished with (its last committed state)
    optimizer_step: int
    micro_step: int
    wall_seconds: float  # its first event (first submission) to its finish
    restarts: int
    lost_micro_steps: int
    lost_seconds: float
    goodput: Goodput | None = None  # the same accounting as ``syncpoint events`` and the plot


def summarize(journal: Journal) -> RunSummary | None:
    """The run's summary, or None when it has not finished."""
    last = journal.last_finish
    if last is None:
        return None
    upto = journal.until(last.time)
    earlier = [f.time for f in journal.finishes[:-1] if f.time < last.time]
    begin = max(earlier) if earlier else float("-inf")
    start = submission_start(upto, last.time, begin)

    def mine(t: float) -> bool:  # after an earlier finish, and from this submission on
        return t > begin and (start is None or t >= start)

    first = next(e for e in upto.events if mine(e.time))  # `last` itself at the latest
    starts = upto.attempts
    # restarts() pairs consecutive attempts; a pair whose first attempt is not this submission's is not its restart
    rs = [r for prev, r in zip(starts, restarts(upto), strict=False) if mine(prev.time)]
    return RunSummary(
        state=last.state,
        optimizer_step=last.optimizer_step,
        micro_step=last.global_micro_step,
        wall_seconds=max(0.0, last.time - first.time),
        restarts=len(rs),
        lost_micro_steps=sum(r.lost_micro_steps for r in rs),
        lost_seconds=sum(r.lost_seconds for r in rs),
        goodput=goodput(upto),
    )


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m{s:02d}s"


def format_summary(name: str, s: RunSummary, model: str | None, plot: str | None) -> str:
    """One line: final state, optimizer steps, wall time, restarts and lost work, where the model and plot are."""
    restarts_text = (
        "no restarts"
        if s.restarts == 0
        else f"{s.restarts} restart{'s' if s.restarts != 1 else ''} (lost {s.lost_micro_steps} micro-step"
        f"{'s' if s.lost_micro_steps != 1 else ''}, {_duration(s.lost_seconds)})"
    )
    where = "; ".join(
        x
        for x in (
            f"model {model}" if model else "no final model (checkpoint.export_final: false)",
            f"plot {plot}" if plot else None,
        )
        if x
    )
    ratio = f", {goodput_headline(s.goodput)}" if s.goodput is not None else ""
    return (
        f"syncpoint: job {name!r} finished: state {s.state or '(none)'}, {s.optimizer_step} optimizer steps "
        f"({s.micro_step} micro-steps) in {_duration(s.wall_seconds)}{ratio}, {restarts_text}; {where}"
    )


def _contended(seconds: float | None) -> str:
    """An async save's upload CPU that busy cores gave up, when there was any."""
    return f", upload took {seconds:.3f}s of busy cores" if seconds else ""
