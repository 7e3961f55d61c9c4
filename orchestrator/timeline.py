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
