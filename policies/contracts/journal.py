"""The run's event log as typed events, and the one reader of it: ``Journal``.

Why typed: the log is read by the loop (attempt number, restart of a submission), the failure
policy (the attempt's nodes and notice), the timeline, drill and plot; with bare strings and dicts
each re-scanned it its own way, and a misspelt field was written silently and read as missing.
Every kind is one pydantic model below, discriminated on ``kind``; ``syncpoint.workers.observation.events`` validates
each event against them before writing it (an unknown kind or field fails loudly there).

Why reading is lenient where writing is strict: logs outlive the code that wrote them. A field
that older writers did not record yet is declared with ``older_logs_lack(default)``: writing
requires it, reading an old log fills in the default. Fields that no model declares are kept
when reading (an older writer's ``node``, a newer writer's addition) and refused when writing.
A record no model accepts (a kind this version does not know, a foreign or damaged file) is kept
as an ``UnknownEvent`` that says why, never dropped and never fatal: the queries skip it, the
timeline shows it. A file that is no record at all (not a JSON object within the reader's bounds,
or a ``time`` that is no usable number of seconds) cannot be placed on the timeline: the reader
(``syncpoint.workers.observation.events``) skips it and the journal names it in ``skipped``.

Why times are bounded (finite, within ``MAX_TIME`` of the epoch): every reader subtracts, sorts and
plots them; a NaN breaks the order and a 400-digit integer raises ``OverflowError`` in ``float()``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.decisions.failures import FailureKind

_OLDER_LOGS_LACK = "older_logs_lack"
_EMITTING = "emitting"  # validation context key: the record is about to be written
MAX_TIME = 1e12  # seconds: any time or duration a log holds is within this of 0 (year 33,700)
_SHOWN_CHARS = 100  # a damaged record's kind, source or problem, as the timeline quotes it

# A time since the epoch, or a duration: finite and bounded, so every difference and sum stays finite.
Seconds = Annotated[float, Field(allow_inf_nan=False, ge=-MAX_TIME, le=MAX_TIME)]


def older_logs_lack(default: Any) -> Any:
    """A field current writers always record and older logs may lack (read back as ``default``)."""
    return Field(default, json_schema_extra={_OLDER_LOGS_LACK: True})


class _Record(BaseModel):
    """Lenient on reading (unknown fields kept); exact when emitting (see ``_exact_when_emitting``)."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _exact_when_emitting(cls, data: Any, info: ValidationInfo) -> Any:
        if not (info.context or {}).get(_EMITTING) or not isinstance(data, Mapping):
            return data
        unknown = sorted(set(data) - set(cls.model_fields))
        missing = sorted(
            name
            for name, f in cls.model_fields.items()
            if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get(_OLDER_LOGS_LACK) and name not in data
        )
        if unknown or missing:
            raise ValueError(
                f"{cls.__name__}: "
                + "; ".join(
                    part
                    for part in (
                        f"unknown field(s) {', '.join(unknown)}" if unknown else "",
                        f"missing field(s) {', '.join(missing)}" if missing else "",
                    )
                    if part
                )
            )
        return data


class _Event(_Record):
    # Both are stamped by the writer (``syncpoint.workers.observation.events.EventLog.emit``): a typed event is built
    # without them.
    time: Seconds = 0.0  # seconds since the epoch; a foreign record without one sorts first
    source: str = ""  # who wrote it: worker, driver, controller, rank<N> (a notice: where it came from)


# ---------------------------------------------------------------- the kinds


class Submitted(_Event):
    """The driver starts a submission (``syncpoint run``)."""

    kind: Literal["submitted"] = "submitted"
    name: str
    address: str  # where it ran: a Ray Job and its cluster, a cluster address (redacted), or "embedded"


class AttemptStarted(_Event):
    """Rank 0 of a worker group agreed on its start (after the resume negotiation)."""

    kind: Literal["attempt_started"] = "attempt_started"
    attempt: int
    world_size: int
    nodes: list[str] = older_logs_lack([])  # the Ray node of each rank (older logs: one `node`)
    # the Ray Train worker (actor id) of each rank: an in-place recovery keeps them; empty outside Ray
    workers: list[str] = []
    submission: str = older_logs_lack("")  # the `syncpoint run` it belongs to ("" outside Ray)
    resumed_from: str | None  # the state it resumed, None from scratch
    global_micro_step: int
    optimizer_step: int
    total_steps: int | None = None  # the run's optimizer steps (the driver's progress bar); older logs lack it
    # when rank 0's process began setting up (before DeepSpeed and the state load): goodput splits a
    # restart into the gap (failure to this) and start-up (this to the attempt's start); older logs lack it
    launched_at: Seconds | None = None
    # rank 0's start-up, (phase, seconds) in order, from launched_at to the attempt's start; empty where
    # not measured (older logs, attempts outside the loop)
    setup: list[tuple[str, Seconds]] = []
    # rank 0's training process was forked from its node's warm server, already running when its
    # worker started (a restart or a pre-warmed node skipped importing torch and DeepSpeed); None:
    # not forked from one (older logs, GPU, in-place recovery off)
    warm_start: bool | None = None
    # where each rank read the state it resumed: "memory" (its node's memory copy) or "storage"; empty
    # from scratch and in older logs
    restored_from: list[Literal["memory", "storage"]] = []


class CandidateSeen(_Record):
    """One candidate as a resume decision saw it (``syncpoint events`` and the timeline show them)."""

    state: str
    verdict: str | None
    reason: str | None


class ResumeDecision(_Event):
    """What the resume policy chose, and every candidate it looked at."""

    kind: Literal["resume_decision"] = "resume_decision"
    attempt: int
    chosen: str | None  # None: a fresh start, or a refusal (its reason)
    reason: str | None
    total_candidates: int = older_logs_lack(0)
    candidates: list[CandidateSeen]


class ProgressRecord(_Record):
    """One optimizer step as the loop saw it."""

    optimizer_step: int
    global_micro_step: int
    epoch: int
    loss: float
    lr: float  # the first param group's
    time: Seconds = older_logs_lack(0.0)
    lrs: list[float] | None = None  # every param group's rate, when there are several
    samples: list[int] | None = None  # only with train.record_samples: the step's sample ids, global order


class Progress(_Event):
    """Steps since the last flush (every few seconds and before every commit)."""

    kind: Literal["progress"] = "progress"
    attempt: int | None = older_logs_lack(None)
    records: list[ProgressRecord]


class StateCommitted(_Event):
    """A state's manifest is written: the state is resumable."""

    kind: Literal["state_committed"] = "state_committed"
    attempt: int | None = older_logs_lack(None)
    state: str
    global_micro_step: int
    optimizer_step: int
    bytes: int
    seconds: Seconds  # the whole save, snapshot to commit
    blocked_seconds: Seconds  # how long the training loop waited for it
    # an async save's upload-thread CPU time that busy cores gave up (thread CPU x the share of the
    # node's cores training keeps busy); 0 for a synchronous save, whose work is all blocked
    contended_seconds: Seconds | None = older_logs_lack(None)
    committed_at_micro_step: int | None = older_logs_lack(None)  # later than the state's own step when async
    reasons: list[str]  # interval, preemption, final


class Evaluated(_Event):
    """An evaluation at a sync boundary (``train.eval_every``): each metric's exact average over the
    whole eval set, by the names ``Task.metrics`` gave (``trainer.json`` records them as ``eval_<name>``)."""

    kind: Literal["evaluated"] = "evaluated"
    attempt: int
    optimizer_step: int
    global_micro_step: int
    metrics: dict[str, float]
    seconds: Seconds  # the evaluation's wall time (training waited for it)


class PreemptionNotice(_Event):
    """The attempt learnt of an imminent preemption; ``source`` says from where (ray-drain,
    sigterm, another rank, driver); Ray's drain notice adds its deadline and the nodes and ranks it
    hits; the driver's (``syncpoint run`` itself was signalled: the job saves and stops) its ``signal``."""

    kind: Literal["preemption_notice"] = "preemption_notice"
    attempt: int
    global_micro_step: int
    optimizer_step: int
    deadline_ms: int | None = None
    nodes: list[str] | None = None
    ranks: list[int] | None = None
    signal: str | None = None  # the driver's notice: SIGINT, SIGTERM or SIGHUP


class FaultFired(_Event):
    """An injected fault (``faults:`` in the spec, or a drill) fired on a rank."""

    kind: Literal["fault_fired"] = "fault_fired"
    fault: str
    mode: str
    where: str
    rank: int
    global_micro_step: int | None  # None at a save phase
    attempt: int


class Failure(_Event):
    """The failure policy classified a failed attempt and decided (retry or raise)."""

    kind: Literal["failure"] = "failure"
    classified: FailureKind  # which budget the failure spent (or none: a refusal fails the run)
    reason: str
    decision: str
    ranks: list[int]
    messages: list[str]
    dead_nodes: list[str]
    submission: str | None = None  # the `syncpoint run` whose attempt failed (older logs lack it)
    signature: str | None = (
        None  # the failing rank's exception, type and message (syncpoint.policies.decisions.failures)
    )
    micro_step: int | None = None  # where the failing rank was (None: setting up, or not known)
    repeated: bool = False  # the same failure as the previous attempt's, no state in between: not retried
    in_place: bool = (
        False  # recovered in the same worker group (syncpoint.workers.supervision.supervisor), not by Ray Train
    )


class RankReached(_Record):
    """The last micro-step one rank reported reaching (its heartbeat), and when."""

    rank: int
    global_micro_step: int
    time: Seconds


class Interrupted(_Event):
    """Where a failed attempt really stopped, measured: the last micro-step each rank reported
    through its heartbeat (``syncpoint.workers.supervision.heartbeat``: at every sync boundary and at most ~0.2 s apart
    in between), written by the controller when it learns of the failure, before the next attempt
    starts. Why: progress is flushed only every few seconds, so a node lost without notice would
    otherwise be charged from the last flush, not from where training was."""

    kind: Literal["interrupted"] = "interrupted"
    attempt: int
    ranks: list[RankReached]
    global_micro_step: int  # the furthest any rank reached
    reached_at: Seconds  # the newest heartbeat of any rank: when the attempt was last seen computing
    detected_at: Seconds  # when the controller learnt of the failure


class InitFromResolved(_Event):
    """``resume.init_from`` resolved to one source state, once per run: every later attempt (a Ray
    restart, a re-submission) before the run's first commit takes exactly this state again, so two
    attempts never start from two different states of a source run that kept training."""

    kind: Literal["init_from_resolved"] = "init_from_resolved"
    attempt: int
    init_from: str  # the spec's value, redacted (credentials never reach the log)
    source_state: str  # the state's name in the source run
    manifest_sha256: str  # sha256 of the source manifest's canonical JSON: every file's size and checksum


class Finished(_Event):
    """The run reached its end; ``state`` is its last committed state."""

    kind: Literal["finished"] = "finished"
    attempt: int | None = older_logs_lack(None)
    state: str | None
    global_micro_step: int
    optimizer_step: int


Event = Annotated[
    Submitted
    | AttemptStarted
    | ResumeDecision
    | Progress
    | StateCommitted
    | PreemptionNotice
    | FaultFired
    | Failure
    | Finished
    | Evaluated
    | Interrupted
    | InitFromResolved,
    Field(discriminator="kind"),
]
_EVENT: TypeAdapter[Event] = TypeAdapter(Event)


class UnknownEvent(BaseModel):
    """A stored record no model accepts: kept (with why) so nothing in a log vanishes unseen."""

    kind: str
    time: float
    source: str
    problem: str
    record: dict[str, Any]


def event_to_emit(record: Mapping[str, Any]) -> Event:
    """The typed event for a record about to be written: a known kind, every field current writers
    record, no field the kind does not declare (``pydantic.ValidationError`` otherwise)."""
    return _EVENT.validate_python(record, context={_EMITTING: True})


def stored_form(event: Event) -> JSONObject:
    """What is written: the fields given, nothing defaulted (so an event reads back as it was written)."""
    return {"kind": event.kind, **event.model_dump(exclude_unset=True)}


def time_of(record: Mapping[str, Any]) -> float | None:
    """A stored record's time: 0.0 when it has none (a foreign record sorts first), None when its
    ``time`` is no usable number of seconds (not a number, not finite, beyond MAX_TIME)."""
    t = record.get("time", 0.0)
    if isinstance(t, bool) or not isinstance(t, int | float):
        return None
    try:
        seconds = float(t)
    except OverflowError:
        return None
    return seconds if math.isfinite(seconds) and abs(seconds) <= MAX_TIME else None


def read_event(record: Mapping[str, Any]) -> Event | UnknownEvent:
    """One line of ``events.jsonl`` as its typed event; a line the models refuse (another version's
    kind, a hostile or damaged record) becomes an ``UnknownEvent`` carrying why, bounded in size,
    so one bad line never hides the rest of a run's timeline."""
    try:
        return _EVENT.validate_python(record)
    except ValidationError as e:
        return UnknownEvent(
            kind=_shown(record.get("kind")),
            time=time_of(record) or 0.0,
            source=_shown(record.get("source", "")),
            problem=_shown(_problem(e)),
            record=dict(record),
        )


def _shown(value: Any) -> str:
    """A damaged record's field as the timeline quotes it: printable, one bounded line."""
    text = value if isinstance(value, str) else type(value).__name__ if isinstance(value, dict | list) else str(value)
    text = "".join(c if c.isprintable() else "?" for c in text[: _SHOWN_CHARS + 1])
    return text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "..."


def _problem(error: ValidationError) -> str:
    first = error.errors()[0]
    if first["type"] == "union_tag_invalid":
        return "a kind this version does not know"
    if first["type"] == "union_tag_not_found":
        return "no kind"
    where = ".".join(str(p) for p in first["loc"][1:])  # loc[0] is the kind
    return f"{where}: {first['msg']}" if where else first["msg"]


class Step(ProgressRecord):
    """An optimizer step's record with the attempt that recorded it."""

    attempt: int | None = None


E = TypeVar("E", bound=BaseModel)


class Journal:
    """A run's events in time order, and the questions the code asks of them.

    Attempts are numbered by the loop in the order they start (``next_attempt``), so "the
    attempt" of an event is its ``attempt`` field; events of logs older than that field (None)
    belong to no attempt. ``skipped``: the stored files that held no record, each as
    ``name (why)`` (``syncpoint.workers.observation.events``); nothing in the journal comes from them."""

    def __init__(self, events: Iterable[Event | UnknownEvent], skipped: Iterable[str] = ()) -> None:
        self.events: list[Event | UnknownEvent] = sorted(events, key=lambda e: e.time)
        self.skipped: list[str] = list(skipped)

    @classmethod
    def parse(cls, records: Iterable[Mapping[str, Any]], skipped: Iterable[str] = ()) -> Journal:
        """The journal of stored records (``syncpoint.workers.observation.events.EventLog.read_all``); a record whose
        time
        is unusable (``time_of``) is skipped and named, as the reader does."""
        events: list[Event | UnknownEvent] = []
        named = list(skipped)
        for r in records:
            if time_of(r) is None:
                named.append(f"a {_shown(r.get('kind'))} record (its time is not a usable number of seconds)")
            else:
                events.append(read_event(r))
        return cls(events, named)

    def of_kind(self, kind: type[E]) -> list[E]:
        return [e for e in self.events if isinstance(e, kind)]

    def until(self, time: float) -> Journal:
        """The events up to ``time``, inclusive."""
        return Journal(e for e in self.events if e.time <= time)

    @property
    def unknown(self) -> list[UnknownEvent]:
        return self.of_kind(UnknownEvent)

    # ---- attempts

    @property
    def attempts(self) -> list[AttemptStarted]:
        return self.of_kind(AttemptStarted)

    @property
    def last_attempt(self) -> AttemptStarted | None:
        attempts = self.attempts
        return attempts[-1] if attempts else None

    def failing_attempt(self, submission: str = "") -> AttemptStarted | None:
        """The attempt a failure being decided now belongs to: the newest logged attempt (of
        ``submission``, when given) if no failure was decided after it started; None otherwise.

        Why: a worker group that dies while setting up (DeepSpeed, selection, the state load) dies
        before rank 0 logs its ``attempt_started``, so the newest logged attempt is then the one
        before it, whose nodes and notice say nothing of this failure. A node of *that* attempt lost
        earlier would turn a start-up crash into a preemption (retried on the preemption budget,
        which may be unbounded), and a notice it got would do the same."""
        last = self.last_attempt
        if last is None or (submission and last.submission != submission):
            return None
        if any(f.time >= last.time for f in self.of_kind(Failure)):
            return None
        return last

    def next_attempt(self) -> int:
        """The number the next attempt to start takes (1 for a new run)."""
        return 1 + len(self.attempts)

    def is_restart_of(self, submission: str) -> bool:
        """Whether an attempt of this submission already started (a Ray restart, not a new ``syncpoint run``)."""
        return bool(submission) and any(a.submission == submission for a in self.attempts)

    @property
    def world_sizes(self) -> list[int]:
        return sorted({a.world_size for a in self.attempts})

    # ---- within an attempt

    def notice_in(self, attempt: int | None) -> PreemptionNotice | None:
        """The attempt's first preemption notice."""
        return next((e for e in self.of_kind(PreemptionNotice) if e.attempt == attempt), None)

    def progress_of(self, attempt: int | None) -> list[ProgressRecord]:
        return [r for e in self.of_kind(Progress) if e.attempt == attempt for r in e.records]

    def faults_in(self, attempt: int | None) -> list[FaultFired]:
        return [e for e in self.of_kind(FaultFired) if e.attempt == attempt]

    # ---- steps and states

    def steps(self) -> dict[int, Step]:
        """Per optimizer step, its record; a later attempt's record of a recomputed step wins."""
        return {
            r.optimizer_step: Step.model_validate({**r.model_dump(), "attempt": e.attempt})
            for e in self.of_kind(Progress)
            for r in e.records
        }

    def evaluations(self) -> dict[int, Evaluated]:
        """Per optimizer step, its evaluation; a later attempt's evaluation of the same step wins (a
        crash after an evaluation and before the next commit makes the resumed attempt evaluate the
        step again, and it must report the same numbers)."""
        return {e.optimizer_step: e for e in self.of_kind(Evaluated)}

    def furthest_micro_step(self) -> int:
        """The furthest global micro-step any attempt recorded progress at (0 before any)."""
        return max((r.global_micro_step for e in self.of_kind(Progress) for r in e.records), default=0)

    @property
    def commits(self) -> list[StateCommitted]:
        return self.of_kind(StateCommitted)

    def commit_of(self, state: str | None) -> StateCommitted | None:
        """The latest commit of a state by that name (a recomputed state is committed again)."""
        return next((c for c in reversed(self.commits) if c.state == state), None)

    def interrupted(self, attempt: int | None) -> Interrupted | None:
        """The measured interruption point of a failed attempt (None: not measured, e.g. outside Ray)."""
        return next((e for e in self.of_kind(Interrupted) if e.attempt == attempt), None)

    def reached(self, attempt: AttemptStarted, until: float | None = None) -> tuple[int, float, bool]:
        """How far a failed attempt got: (furthest micro-step, the time it was last seen computing,
        measured). Measured when its heartbeat was recorded (``Interrupted``); otherwise the best the
        log knows: its flushed progress and fired faults, and, when the failure came after both (a
        hard crash loses the unflushed tail), the failure's time bounds it. ``until``: the next
        attempt's start (the failure that ended this attempt lies before it)."""
        records = self.progress_of(attempt.attempt)
        fired = [f for f in self.faults_in(attempt.attempt) if f.global_micro_step is not None]
        step = max(
            [r.global_micro_step for r in records]
            + [f.global_micro_step or 0 for f in fired]
            + [attempt.global_micro_step]
        )
        last = max([r.time for r in records] + [f.time for f in self.faults_in(attempt.attempt)] + [attempt.time])
        beat = self.interrupted(attempt.attempt)
        if beat is not None:
            return max(step, beat.global_micro_step), max(last, beat.reached_at), True
        failure = self.failure_between(attempt.time, until if until is not None else float("inf"))
        if failure and failure.time > last and not any(r.time > failure.time for r in records):
            last = failure.time
        return step, last, False

    # ---- failures and ends

    @property
    def failures(self) -> list[Failure]:
        return self.of_kind(Failure)

    def last_failure(self, submission: str, classified: FailureKind) -> Failure | None:
        """The newest failure of ``submission`` classified so (the previous failed attempt's, when a
        failure is being decided)."""
        return next(
            (f for f in reversed(self.failures) if f.submission == submission and f.classified == classified), None
        )

    def retried(self, submission: str, classified: FailureKind) -> int:
        """How many of ``submission``'s failures classified so were retried (in place or by Ray
        Train): the budget ``failure.max_failures`` or ``max_preemptions`` has spent."""
        return sum(
            1
            for f in self.failures
            if f.submission == submission and f.classified == classified and f.decision == "RETRY"
        )

    def committed_since(self, time: float) -> bool:
        return any(c.time > time for c in self.commits)

    def failure_between(self, start: float, end: float) -> Failure | None:
        """The first failure recorded in [start, end] (between two attempts: what ended the first)."""
        return next((f for f in self.failures if start <= f.time <= end), None)

    def init_from(self, init_from: str) -> InitFromResolved | None:
        """The source state this run resolved ``resume.init_from`` (as the spec gives it, redacted) to."""
        return next((e for e in reversed(self.of_kind(InitFromResolved)) if e.init_from == init_from), None)

    @property
    def finishes(self) -> list[Finished]:
        return self.of_kind(Finished)

    @property
    def last_finish(self) -> Finished | None:
        finishes = self.finishes
        return finishes[-1] if finishes else None
