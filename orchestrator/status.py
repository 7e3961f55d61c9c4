"""``syncpoint status RUN_DIR``: where a run stands, read from its directory alone.

Why from the directory: a run lives on storage (local, ``s3://``, any fsspec URL) and outlives its
driver; a platform engineer asks about it from anywhere, with nothing running. Everything comes
from what every other reader already reads, with their bounds: the lease (``lease.json``: held now,
by which submission), the event log (``syncpoint events``' reader: bounded files, no link
followed, a record no model accepts kept as "not read"), and the states' metadata (``syncpoint
states``' selection: manifests only, never a tensor). The goodput and badput are the one accounting
of ``syncpoint.policies.decisions.goodput``, so ``status``, ``events``, the plot and the run's last line agree.

What storage holds may be hostile: whatever is refused (a linked ``events/`` or ``lease.json``, an
oversized or garbage record, a linked ``states/``) is named in ``problems`` with why, and the
status is what the rest says; nothing here raises for what a file holds.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NotRequired, TypedDict, cast

from syncpoint.orchestrator.timeline import badput_lines, goodput_headline, restarts
from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.journal import AttemptStarted, Journal
from syncpoint.policies.decisions.goodput import Goodput, current_run, goodput
from syncpoint.policies.decisions.redact import redact_url

if TYPE_CHECKING:
    from syncpoint.policies.decisions.candidates import Candidate, LiveJob
    from syncpoint.workers.storage import RunStorage

RUNNING, STOPPED, FINISHED, FAILED = "running", "stopped", "finished", "failed"
_SHOWN_PROBLEMS = 5


class LeaseView(TypedDict):
    """``lease.json`` as read: submission, generation, held now, and why not (age and TTL when well formed)."""

    submission: str | None
    generation: int | None
    held: bool
    why: str
    age_s: NotRequired[float]
    ttl_s: NotRequired[float]


class NewestState(TypedDict):
    """The state a resume would choose now (metadata only)."""

    state: str
    micro_step: int | None
    optimizer_step: int | None
    reason: str


class Interruption(TypedDict):
    """The last interruption and its cost: the work a resume computes again, or a restart's whole cost."""

    attempt: int
    cause: str
    reason: str
    at: NotRequired[float]  # stopped or failed: when it was last seen computing
    micro_step: int
    measured: bool
    lost_micro_steps: int
    resumed: bool
    resumed_from: NotRequired[str | None]  # the rest: a restart's
    wasted_progress_s: NotRequired[float]
    recovery_s: NotRequired[float]
    startup_s: NotRequired[float]
    cost_s: NotRequired[float]


@dataclass
class RunStatus:
    """A run's state now and what it amounts to (``--json`` prints it as is, goodput expanded)."""

    run: str
    state: str  # running, stopped, finished, failed
    detail: str  # one sentence: why this state (the attempt, the failure, the notice, the dead holder)
    attempt: int | None  # running: the attempt training now; else the newest logged attempt
    lease: LeaseView | None
    newest_resumable: NewestState | None
    goodput: Goodput | None
    last_interruption: Interruption | None
    as_of: float | None  # the newest event's time: the goodput is "so far" up to it
    problems: list[str] = field(default_factory=list)  # what was refused or not read, with why


def read_status(storage: RunStorage, signing_key: bytes | None = None) -> RunStatus:
    """The run's status; ``NotARun`` when the directory holds no events, no states and no lease."""
    from syncpoint.workers.observation.events import EventLog, skipped_line

    problems: list[str] = []
    lease = _lease(storage, problems)
    if storage.is_link("events"):
        problems.append("events/ is a symbolic link: not followed, so no event was read")
    stored = EventLog(storage).read_stored()
    journal = Journal.parse(stored.records, skipped=[str(u) for u in stored.skipped])
    if journal.skipped:
        problems.append(skipped_line(journal.skipped))
    unknown = journal.unknown
    if unknown:
        problems.append(f"{len(unknown)} event record(s) not read, e.g. {unknown[0].kind!r}: {unknown[0].problem}")
    newest, has_states = _newest_resumable(storage, signing_key, problems)
    if not journal.events and not journal.skipped and not has_states and lease is None and not problems:
        raise NotARun(storage)
    state, detail, attempt = _state(journal, lease, newest)
    g = goodput(journal)
    return RunStatus(
        run=redact_url(storage.url),
        state=state,
        detail=detail,
        attempt=attempt,
        lease=lease,
        newest_resumable=newest,
        goodput=g,
        last_interruption=_last_interruption(journal, state, newest, g),
        as_of=journal.events[-1].time if journal.events else None,
        problems=problems,
    )


class NotARun(Exception):
    """The directory holds nothing of a run (the CLI's exit 2)."""

    def __init__(self, storage: RunStorage) -> None:
        super().__init__(
            f"{redact_url(storage.url)}: no events, no states and no lease here, so not a run directory; pass "
            "the run's directory, <storage>/<name> (the spec's storage and name, e.g. runs/tiny-lm)"
        )


# ---------------------------------------------------------------------------- the parts


def _lease(storage: RunStorage, problems: list[str]) -> LeaseView | None:
    """``lease.json`` as read (bounded, never through a link), and whether its holder holds it now:
    not released, not provably dead, and renewed within its TTL by the storage's clock (by its own
    heartbeat field where the store cannot tell an age)."""
    from syncpoint.policies.contracts.errors import UnsafeEntry
    from syncpoint.workers.storage import holder_process
    from syncpoint.workers.storage.lease import read_lease

    try:
        held = read_lease(storage)
    except UnsafeEntry as e:
        problems.append(f"lease.json refused, not read: {_short(str(e))}")
        return None
    except OSError as e:
        problems.append(f"lease.json unreadable ({type(e).__name__}: {_short(str(e))})")
        return None
    if held is None:
        return None
    if held.record is None:
        problems.append(f"lease.json is malformed ({held.problem})")
        return {"submission": None, "generation": held.generation, "held": False, "why": "malformed"}
    rec = held.record
    age = held.age_s if held.age_s is not None else max(0.0, time.time() - float(rec.get("heartbeat", 0.0)))
    why = (
        "released"
        if held.released
        else "its holder's process is gone"
        if holder_process.provably_dead(rec)
        else f"not renewed for {age:.0f} s (TTL {float(rec['ttl_s']):g} s)"
        if age >= float(rec["ttl_s"])
        else None
    )
    return {
        "submission": rec["submission"],
        "generation": held.generation,
        "held": why is None,
        "why": why or f"renewed {age:.1f} s ago",
        "age_s": round(age, 3),
        "ttl_s": float(rec["ttl_s"]),
    }


def _newest_resumable(
    storage: RunStorage, signing_key: bytes | None, problems: list[str]
) -> tuple[NewestState | None, bool]:
    """What ``syncpoint states``' default policy would resume now, from the manifests alone; and
    whether the run has states at all."""
    from syncpoint.policies.contracts.errors import NoResumableState, RunDirectoryRefused
    from syncpoint.policies.decisions.candidates import classify
    from syncpoint.policies.decisions.resume import enforce_safe, make_policy
    from syncpoint.workers.state.discovery import discover, states_entries

    try:
        if not states_entries(storage):
            return None, False
        cands = discover(storage, signing_key=signing_key)
    except RunDirectoryRefused as e:
        problems.append(_short(str(e)))
        return None, True
    live = run_identity(cands)
    for c in cands:
        classify(c, live)
    try:
        decision = enforce_safe(make_policy("newest-resumable", {}).choose(cands, {}), cands)
    except NoResumableState as e:
        problems.append(_short(str(e).splitlines()[0]))
        return None, True
    chosen: Candidate | None = next((c for c in cands if c.name == decision.state), None)
    if chosen is None:
        return None, True
    state = chosen.parse().state
    newest: NewestState = {
        "state": chosen.name,
        "micro_step": chosen.micro_step,
        "optimizer_step": state.optimizer_step if state is not None else None,
        "reason": decision.reason,
    }
    return newest, True


def _state(journal: Journal, lease: LeaseView | None, newest: NewestState | None) -> tuple[str, str, int | None]:
    """(state, why, attempt) from the lease (held now: running) and the newest submission's journal."""
    run = current_run(journal)
    last = run.last_attempt
    if lease is not None and lease["held"]:
        mine = [a for a in journal.attempts if a.submission and a.submission == lease["submission"]]
        if mine:
            return RUNNING, f"attempt {mine[-1].attempt} is training (lease {lease['why']})", mine[-1].attempt
        n = journal.next_attempt()
        return RUNNING, f"attempt {n} is starting (lease {lease['why']}, no attempt logged yet)", n
    number = last.attempt if last else None
    finish = run.last_finish
    if finish is not None and (last is None or finish.time >= last.time):
        return FINISHED, f"finished at micro-step {finish.global_micro_step} with state {finish.state}", number
    failure = next((f for f in reversed(run.failures) if last is None or f.time >= last.time), None)
    if failure is not None and _restarting(failure.decision, failure.time, lease):
        n = journal.next_attempt()
        return (
            RUNNING,
            f"attempt {number} failed ({failure.classified}: {_short(failure.reason, 160)}) and is being retried: "
            f"attempt {n} not logged yet",
            n,
        )
    if failure is not None and failure.decision.upper() != "RETRY":
        repeated = " (the same failure as the attempt before, no state in between)" if failure.repeated else ""
        return FAILED, f"attempt {number} failed: {failure.classified}: {failure.reason}{repeated}", number
    resumable = (
        f"resumable from {newest['state']} (micro-step {newest['micro_step']})"
        if newest
        else "no resumable state: a new run starts fresh"
    )
    return STOPPED, f"{_why_stopped(run, last, lease)}; {resumable}", number


def _restarting(decision: str, failed_at: float, lease: LeaseView | None) -> bool:
    """A retried failure whose next attempt has not started yet: a restart under way while the
    lease, not released by its submission, is younger than its TTL since the failure (the new worker
    group takes it over within that); after that, nobody is retrying."""
    if decision.upper() != "RETRY" or lease is None or lease["why"] in ("released", "malformed"):
        return False
    return time.time() - failed_at < float(lease.get("ttl_s") or 0.0)


def _why_stopped(run: Journal, last: AttemptStarted | None, lease: LeaseView | None) -> str:
    if last is None:
        return "no attempt started"
    notice = run.notice_in(last.attempt)
    if notice is not None:
        what = f"{notice.signal} to its driver" if notice.signal else f"a preemption notice ({notice.source})"
        return f"attempt {last.attempt} stopped after {what} at micro-step {notice.global_micro_step}"
    failure = run.failure_between(last.time, float("inf"))
    if failure is not None:  # retried, but no next attempt came: its driver is gone
        return f"attempt {last.attempt} failed ({failure.classified}: {failure.reason}) and no retry started"
    lease_said = f"; its lease: {lease['why']}" if lease is not None else ""
    return f"attempt {last.attempt} ended without a finish or a failure on record (its driver stopped{lease_said})"


def _last_interruption(
    journal: Journal, state: str, newest: NewestState | None, g: Goodput | None
) -> Interruption | None:
    """The newest submission's last interruption and what it cost: an attempt stopped with no
    successor yet (stopped, failed: the work a resume computes again), else its last restart."""
    run = current_run(journal)
    last = run.last_attempt
    if last is None or g is None:
        return None
    if state in (STOPPED, FAILED):
        step, seen, measured = run.reached(last)
        failure = run.failure_between(last.time, float("inf"))
        notice = run.notice_in(last.attempt)
        resumed_at = cast(int, newest["micro_step"]) if newest else 0  # a chosen state's step is known
        return {
            "attempt": last.attempt,
            "cause": failure.classified if failure else "stop notice" if notice else "no failure recorded",
            "reason": failure.reason if failure else "",
            "at": seen,
            "micro_step": step,
            "measured": measured,
            "lost_micro_steps": max(0, step - resumed_at),
            "resumed": False,
        }
    if not g.restarts:
        return None
    r = restarts(run)[-1]
    c = g.restarts[-1]
    return {
        "attempt": c.attempt,
        "cause": r.cause,
        "reason": r.reason,
        "micro_step": r.previous_max_micro_step,
        "measured": c.measured,
        "lost_micro_steps": c.lost_micro_steps,
        "resumed": True,
        "resumed_from": r.resumed_from,
        "wasted_progress_s": c.recomputed_s,
        "recovery_s": c.restart_gap_s,
        "startup_s": c.startup_s,
        "cost_s": c.recomputed_s + c.restart_gap_s + c.startup_s,
    }


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------- output


def status_json(s: RunStatus) -> JSONObject:
    """The status as plain JSON (``syncpoint status --json``): goodput with its badput by cause."""
    out = asdict(s)
    g = s.goodput
    out["goodput"] = (
        None
        if g is None
        else {
            "ratio": g.ratio,
            "productive_s": g.productive_s,
            "total_s": g.total_s,
            "badput_s": g.badput_s,
            "badput": dict(g.badput),
            "uncommitted_s": g.uncommitted_s,
            "restarts": len(g.restarts),
            "finished": g.finished,
        }
    )
    return out


def format_status(s: RunStatus) -> str:
    """The status as a few lines for people."""
    lines = [f"run: {s.run}", f"state: {s.state}: {s.detail}"]
    if s.newest_resumable:
        n = s.newest_resumable
        lines.append(f"newest resumable state: {n['state']} (micro-step {n['micro_step']}): {n['reason']}")
    else:
        lines.append("newest resumable state: none")
    if s.last_interruption:
        lines.append(_interruption_line(s.last_interruption))
    g = s.goodput
    if g is not None:
        so_far = "" if g.finished else " so far"
        lines.append(
            f"{goodput_headline(g)}{so_far}: productive {g.productive_s:.2f} s of {g.total_s:.2f} s wall time; "
            f"badput {g.badput_s:.2f} s by cause:"
        )
        lines += badput_lines(g)
    shown = s.problems[:_SHOWN_PROBLEMS]
    lines += [f"not read: {p}" for p in shown]
    if len(s.problems) > len(shown):
        lines.append(f"not read: and {len(s.problems) - len(shown)} more")
    return "\n".join(lines)


def _interruption_line(i: Interruption) -> str:
    why = f"{i['cause']}" + (f": {_short(i['reason'], 160)}" if i["reason"] else "")
    steps = f"{i['lost_micro_steps']} micro-step{'s' if i['lost_micro_steps'] != 1 else ''}"
    if not i["resumed"]:
        return (
            f"last interruption: attempt {i['attempt']} ({why}) at micro-step {i['micro_step']}; "
            f"a resume computes {steps} again"
        )
    return (
        f"last interruption: attempt {i['attempt']} ({why}) at micro-step {i['micro_step']}, resumed from "
        f"{i['resumed_from'] or 'scratch'}: cost {i['cost_s']:.2f} s ({steps} wasted, {i['wasted_progress_s']:.2f} s; "
        f"recovery {i['recovery_s']:.2f} s; start-up {i['startup_s']:.2f} s)"
    )


def run_identity(cands: list[Candidate]) -> LiveJob | None:
    """The run itself as a live job: the identity of its newest committed, readable state, as the
    loop wrote it (elastic runs judge other world sizes by the elastic rules, as the loop does);
    None when no state is readable, so nothing can be incompatible with it."""
    from syncpoint.policies.decisions.candidates import LiveJob

    for c in cands:
        state = c.parse().state  # None: classification names what is wrong with it
        if c.manifest is not None and state is not None:
            return LiveJob(state.identity())
    return None
