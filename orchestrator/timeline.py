"""Read a run's event log back into a timeline: attempts, restarts and the work each one lost.

Lost work of a restart = what the failed attempt had computed beyond the state the next attempt
resumed from: micro-steps recomputed, and the seconds between that state's commit and the
attempt's last recorded progress (progress is flushed at least every few seconds and at every
commit, so the figure is exact to that granularity).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Restart:
    attempt: int  # the attempt that resumed
    resumed_from: str | None
    resumed_micro_step: int
    previous_max_micro_step: int
    lost_micro_steps: int
    lost_seconds: float
    cause: str  # failure classification, or "restart"
    reason: str


def merged_steps(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per optimizer step records; a later attempt's record of a recomputed step wins."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "progress":
            for r in e["records"]:
                out[r["optimizer_step"]] = {**r, "attempt": e.get("attempt")}
    return out


def records_after(records: list[dict[str, Any]], t: float) -> bool:
    return any(r.get("time", 0) > t for r in records)


def restarts(events: list[dict[str, Any]]) -> list[Restart]:
    starts = [e for e in events if e["kind"] == "attempt_started"]
    commits = {e["state"]: e for e in events if e["kind"] == "state_committed"}
    failures = [e for e in events if e["kind"] == "failure"]
    out = []
    for prev, cur in zip(starts, starts[1:]):
        a = prev.get("attempt")
        records = [r for e in events if e["kind"] == "progress" and e.get("attempt") == a for r in e["records"]]
        fired = [e["global_micro_step"] for e in events if e["kind"] == "fault_fired" and e.get("attempt") == a
                 and e.get("global_micro_step") is not None]
        max_step = max([r["global_micro_step"] for r in records] + fired + [prev.get("global_micro_step", 0)])
        last_time = max([r.get("time", 0) for r in records]
                        + [e["time"] for e in events if e["kind"] == "fault_fired" and e.get("attempt") == a]
                        + [prev["time"]])
        resumed_step = cur.get("global_micro_step", 0)
        state = cur.get("resumed_from")
        # the state captured training at its snapshot: the commit time minus the save's duration
        # (an async commit lands steps later)
        since = commits[state]["time"] - commits[state].get("seconds", 0.0) if state in commits else prev["time"]
        failure = next((f for f in failures if prev["time"] <= f["time"] <= cur["time"]), None)
        if failure and failure["time"] > last_time and not records_after(records, failure["time"]):
            # progress is flushed every few seconds: a hard crash loses the tail, the failure time bounds it
            last_time = failure["time"]
        out.append(Restart(
            attempt=cur.get("attempt", 0), resumed_from=state, resumed_micro_step=resumed_step,
            previous_max_micro_step=max_step, lost_micro_steps=max(0, max_step - resumed_step),
            lost_seconds=max(0.0, last_time - since) if max_step > resumed_step else 0.0,
            cause=failure["classified"] if failure else "restart", reason=failure["reason"] if failure else ""))
    return out


def format_timeline(events: list[dict[str, Any]]) -> str:
    if not events:
        return "(no events)"
    t0 = events[0]["time"]
    lines = []
    for e in events:
        k = e["kind"]
        at = f"+{e['time'] - t0:8.2f}s  {k:<17}"
        if k == "attempt_started":
            lines.append(f"{at} attempt {e.get('attempt')} on {e.get('world_size')} worker(s), "
                         f"from {e.get('resumed_from') or 'scratch'} (micro-step {e.get('global_micro_step')})")
        elif k == "resume_decision":
            rejected = [f"{c['state']} {c['verdict']}" for c in e.get("candidates", []) if c["verdict"] != "resumable"]
            lines.append(f"{at} chose {e.get('chosen') or 'fresh start'}: {e.get('reason')}"
                         + (f"; rejected: {', '.join(rejected)}" if rejected else ""))
        elif k == "state_committed":
            lines.append(f"{at} {e['state']} (optimizer step {e['optimizer_step']}, {e['bytes'] / 1e6:.2f} MB, "
                         f"{e['seconds']:.3f}s, loop blocked {e['blocked_seconds']:.3f}s) [{', '.join(e['reasons'])}]")
        elif k == "preemption_notice":
            lines.append(f"{at} {e.get('source')} at micro-step {e.get('global_micro_step')}"
                         + (f", deadline in {(e['deadline_ms'] / 1000 - e['time']):.1f}s" if e.get("deadline_ms") else ""))
        elif k == "failure":
            lines.append(f"{at} {e['classified']} -> {e['decision']}: {e['reason']}")
        elif k == "fault_fired":
            lines.append(f"{at} rank {e.get('rank')} {e.get('mode')} at {e.get('where')}")
        elif k == "finished":
            lines.append(f"{at} finished at micro-step {e['global_micro_step']} ({e['state']})")
    rs = restarts(events)
    if rs:
        lines.append("")
        lines.append("restart  cause        resumed from   lost micro-steps  lost seconds")
        for r in rs:
            lines.append(f"{r.attempt:>7}  {r.cause:<11}  {r.resumed_from or 'scratch':<13}  {r.lost_micro_steps:>16}  "
                         f"{r.lost_seconds:>12.2f}")
    return "\n".join(lines)


@dataclass
class RunSummary:
    """What the run that ended at its last ``finished`` event amounts to: every attempt and
    submission since the run's first event, or since an earlier finish (a finished run run again)."""

    state: str | None  # the state the run finished with (its last committed state)
    optimizer_step: int
    micro_step: int
    wall_seconds: float  # its first event (first submission) to its finish
    restarts: int
    lost_micro_steps: int
    lost_seconds: float


def summarize(events: list[dict[str, Any]]) -> RunSummary | None:
    """The run's summary, or None when it has not finished."""
    finished = [e for e in events if e["kind"] == "finished"]
    if not finished:
        return None
    last = finished[-1]
    upto = [e for e in events if e["time"] <= last["time"]]
    earlier = [e["time"] for e in finished[:-1] if e["time"] < last["time"]]
    begin = max(earlier) if earlier else None
    segment = [e for e in upto if begin is None or e["time"] > begin]
    starts = [e for e in upto if e["kind"] == "attempt_started"]
    # restarts() pairs consecutive attempts; a pair whose first attempt precedes `begin` is a new run
    rs = [r for (prev, _), r in zip(zip(starts, starts[1:]), restarts(upto)) if begin is None or prev["time"] > begin]
    return RunSummary(state=last.get("state"), optimizer_step=int(last.get("optimizer_step") or 0),
                      micro_step=int(last.get("global_micro_step") or 0),
                      wall_seconds=max(0.0, last["time"] - segment[0]["time"]), restarts=len(rs),
                      lost_micro_steps=sum(r.lost_micro_steps for r in rs), lost_seconds=sum(r.lost_seconds for r in rs))


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m{s:02d}s"


def format_summary(name: str, s: RunSummary, model: str | None, plot: str | None) -> str:
    """One line: final state, optimizer steps, wall time, restarts and lost work, where the model and plot are."""
    restarts_text = ("no restarts" if s.restarts == 0 else
                     f"{s.restarts} restart{'s' if s.restarts != 1 else ''} (lost {s.lost_micro_steps} micro-step"
                     f"{'s' if s.lost_micro_steps != 1 else ''}, {_duration(s.lost_seconds)})")
    where = "; ".join(x for x in (f"model {model}" if model else "no final model (checkpoint.export_final: false)",
                                  f"plot {plot}" if plot else None) if x)
    return (f"syncpoint: job {name!r} finished: state {s.state or '(none)'}, {s.optimizer_step} optimizer steps "
            f"({s.micro_step} micro-steps) in {_duration(s.wall_seconds)}, {restarts_text}; {where}")
