"""Failure classification: is a failed attempt a preemption or an application error?

Why it matters: preemptions (a drain notice, a SIGTERM notice, a hard node loss) must never
consume the application-error budget (``failure.max_failures``); a bug in user code must. Ray
2.60 charges a hard node kill to ``max_failures`` like a bug (it surfaces as gloo "connection
closed" on the survivors), so syncpoint decides from plain facts gathered by the controller:
Ray's own preemption flag, the nodes the attempt ran on that are now dead, and whether the
attempt logged a preemption notice.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    """What a failed attempt was (``classify_failure``); the journal's ``Failure.classified`` text.

    ===========  =====================================================  ==========================================
    kind         counts against                                         retried
    ===========  =====================================================  ==========================================
    preemption   ``failure.max_preemptions`` (Ray's                     yes, until that budget is spent
                 ``max_preemption_failures``), never ``max_failures``
    application  ``failure.max_failures``                               yes, until that budget is spent; never
                                                                        when it repeats the previous attempt's
    refusal      nothing                                                never: the same spec, task and states
                                                                        refuse again
    placement    Ray's controller budget (each worker-group start)      yes, until ``failure.placement_timeout_s``
                                                                        of waiting in a row
    ===========  =====================================================  ==========================================
    """

    PREEMPTION = "preemption"  # a drain notice, a SIGTERM notice, a node lost
    APPLICATION = "application"  # the user's code or a library failed
    REFUSAL = "refusal"  # syncpoint refused the job's configuration or state: the same on every retry
    PLACEMENT = "placement"  # the workers found no room on the cluster (a worker-group start timed out)


PREEMPTION = FailureKind.PREEMPTION
APPLICATION = FailureKind.APPLICATION
REFUSAL = FailureKind.REFUSAL
PLACEMENT = FailureKind.PLACEMENT


@dataclass(frozen=True)
class FailureFacts:
    """What the driver knows about one failed attempt (plain data, gathered from Ray and the run's
    journal): the only input ``classify_failure`` reads."""

    ray_says_preempted: bool  # Ray's own PreemptionError / preempted actor flag
    dead_attempt_nodes: tuple[str, ...]  # nodes that hosted a rank of the attempt and are dead now
    notice_logged: bool  # the attempt logged a preemption notice (drain or SIGTERM)
    messages: tuple[str, ...] = ()
    refusal: str | None = None  # a rank's syncpoint refusal (spec, task, selection, lease lost), its reason
    signature: str | None = None  # the failing rank's exception (``failure_signature``)
    micro_step: int | None = None  # the global micro-step the failing rank was at (None: setting up)
    repeats: bool = False  # the same failure as the previous attempt's (``repeats_previous``)


@dataclass(frozen=True)
class FailureVerdict:
    """An attempt's failure kind (which budget it spends) and the reason the run's log shows."""

    kind: FailureKind
    reason: str


def classify_failure(f: FailureFacts) -> FailureVerdict:
    """Classify a failed attempt, most specific evidence first.

    Why this order: a lost node or a notice makes any error that followed it a consequence of the
    preemption (a peer's collective times out when its partner's node vanishes), so the evidence of
    a preemption wins over the messages; a syncpoint refusal is deterministic and fails the run at
    once; anything else is the application's and spends ``failure.max_failures``.
    """
    if f.ray_says_preempted:
        return FailureVerdict(PREEMPTION, "Ray reported a preemption (drain)")
    if f.dead_attempt_nodes:
        return FailureVerdict(PREEMPTION, f"node(s) lost: {', '.join(n[:12] for n in f.dead_attempt_nodes)}")
    if f.notice_logged:
        return FailureVerdict(PREEMPTION, "the attempt received a preemption notice before failing")
    if f.refusal:
        # Deterministic: the same spec, task and states refuse again. Retrying would only spend
        # failure.max_failures and delay the one line the user needs.
        return FailureVerdict(REFUSAL, f.refusal)
    first = next((m for m in f.messages if m), "unknown error")
    if looks_like_node_fault(first):
        # The node's store broke or was flooded (no node died: that was decided above): retried on a
        # new worker group, with a new store, and never charged to the user's code.
        return FailureVerdict(PREEMPTION, f"a fault of the node: {first}")
    return FailureVerdict(APPLICATION, first)


# What a rank says when the supervisors' store failed under it
# (``syncpoint.workers.supervision.store_agent.StoreFault``).
NODE_FAULT = "the supervisors' store failed on this node"


def looks_like_node_fault(message: str) -> bool:
    """A failure of the node's supervisors' store (its agent gone, a flood that stops new clients):
    the node's, never the user's code's."""
    return NODE_FAULT in message


# What a rank says when a peer went silent (its node vanished without closing a connection): gloo's
# "Timed out waiting 30000ms for recv operation to complete", NCCL's watchdog "Watchdog caught collective
# operation timeout", torch's store "Socket Timeout"/"wait timeout after"; and what it says when a peer's
# process did close: gloo "Connection closed by peer", "Connection reset by peer", and a TCPStore client
# whose server went with its node (the supervisors' store on rank 0's): "Failed to recv, got 0 bytes.
# Connection was likely closed".
LOST_PEER = re.compile(
    r"Timed out waiting \d+ ?ms for (recv|send)|collective operation timeout|Socket Timeout"
    r"|wait timeout after|Connection (closed|reset) by peer|Connection was likely closed",
    re.IGNORECASE,
)


def should_await_node_death(
    vanished: bool, attempt_nodes: set[str], own_node: str, dead: set[str], notice_logged: bool
) -> bool:
    """Whether the controller should wait (bounded) for Ray to declare one of the attempt's nodes dead
    before classifying: a worker vanished (no Python exception, or a collective lost its peer), the
    attempt ran on a node other than the controller's, none of its nodes is dead yet, and nothing
    else already makes it a preemption. A logged notice does (``classify_failure``): waiting out Ray's
    health check then only delays the restart, by up to ``SYNCPOINT_NODE_DEATH_WAIT_S``."""
    return vanished and bool(attempt_nodes - {own_node}) and not (attempt_nodes & dead) and not notice_logged


def looks_like_lost_peer(message: str) -> bool:
    """A rank's failure reads as a collective that lost its peer, not as a bug of its own: the controller
    then waits (bounded) for Ray to declare a node dead before calling it an application error."""
    return bool(LOST_PEER.search(message))


def is_ours(error: BaseException) -> bool:
    """Raised by syncpoint itself (a refusal written for the user), not by the user's code or a library."""
    return type(error).__module__.startswith("syncpoint.")


def failure_reason(error: BaseException) -> tuple[str, str]:
    """(reason, details) for a failed run's last line: the reason itself, never a source line.

    syncpoint's own refusals carry messages written for the user: the first line is the reason
    and the rest (a candidates table) is detail printed above it. Anything else (the user's own
    exception) is named by its type, as Python would print it.
    """
    exc_type = type(error).__name__
    lines = str(error).strip().splitlines() or [exc_type]
    head, details = lines[0].strip(), "\n".join(lines[1:]).strip()
    if not is_ours(error):
        head = f"{exc_type}: {head}" if head != exc_type else head
    return head + site_text(getattr(error, "syncpoint_site", None)), details


def site_text(site: object) -> str:
    """`` at FILE:LINE in FUNCTION (rank R, micro-step M)``: where the failing rank was
    (``syncpoint.workers.supervision.failure_site`` attaches it); the parts it knows, nothing for a failure while
    setting up in
    syncpoint's own code."""
    if not isinstance(site, dict):
        return ""
    where, rank, micro_step = site.get("where"), site.get("rank"), site.get("micro_step")
    inside = ", ".join(
        p
        for p in (
            f"rank {rank}" if isinstance(rank, int) else "",
            f"micro-step {micro_step}" if isinstance(micro_step, int) else "",
        )
        if p
    )
    if not where and micro_step is None:
        return ""
    return (f" at {str(where)[:300]}" if where else "") + (f" ({inside})" if inside else "")


_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")


def failure_signature(error: BaseException) -> str:
    """What makes two failures "the same": the exception's type and its message, memory addresses
    masked and whitespace collapsed, bounded."""
    text = " ".join(_ADDRESS.sub("0x?", str(error)).split())
    return f"{type(error).__module__}.{type(error).__qualname__}: {text}"[:500]


def repeats_previous(
    signature: str, micro_step: int | None, previous: tuple[str | None, int | None] | None, committed_since: bool
) -> bool:
    """Whether a failed attempt repeats the previous failed attempt of its submission: the same
    exception at the same global micro-step, with no state committed in between. Resumed exactly
    from the same state, it computes the same micro-steps bit for bit, so it fails there again: a
    bug, not bad luck, and a retry only spends ``failure.max_failures``. A failure while setting up
    (no micro-step) is retried: it may be the storage or the cluster."""
    return micro_step is not None and not committed_since and previous == (signature, micro_step)


def not_retried_line(micro_step: int) -> str:
    """Why a failure that repeats the previous attempt's exactly is not retried (the run's last line)."""
    return (
        f"it failed twice the same way at micro-step {micro_step} with no new state in between: not retried "
        "(a bug, not a preemption)"
    )


def placement_waited_s(first_timeout_at: float, now: float, start_timeout_s: float) -> float:
    """How long the run has been waiting for room, in a row: Ray Train reports the first failed
    placement only after one start timeout, so the wait began that much before it."""
    return max(0.0, now - first_timeout_at) + start_timeout_s


def placement_exhausted(waited_s: float, timeout_s: float) -> bool:
    """Whether the run stops waiting for room (``failure.placement_timeout_s``). Why a bound: Ray
    Train retries a worker-group start that timed out without limit, so a fixed-size job whose lost
    node never comes back would wait forever, silently."""
    return waited_s >= timeout_s


def placement_gave_up(workers: int, cpus_per_worker: float, gpus: bool, timeout_s: float) -> str:
    """The last line of a run that found no room for its workers within its bound."""
    each = f"{cpus_per_worker:g} CPU" + (" and 1 GPU" if gpus else "")
    return (
        f"gave up after waiting failure.placement_timeout_s ({timeout_s:g} s) for room for {workers} "
        f"workers of {each} each: the cluster never had it (a lost node not replaced, or a cluster "
        "smaller than scaling.num_workers needs). Add nodes, lower scaling.num_workers (or make it "
        "elastic with {min, max}), or raise failure.placement_timeout_s."
    )


# ---------------------------------------------------------------- in-place recovery
class RankStatus(StrEnum):
    """How one rank's training process of an in-place generation ended, as its supervisor saw it
    (``syncpoint.workers.supervision.supervisor``); its text is what crosses the supervisors' store."""

    FINISHED = "finished"  # the loop returned: the run is done on this rank
    RAISED = "raised"  # an exception, handed to the supervisor with its traceback
    DIED = "died"  # no exception: a crash, a signal, os._exit, an end that could not be read
    STOPPED = "stopped"  # its supervisor ended it because a peer had failed


class InPlaceAction(StrEnum):
    """Rank 0's decision for a generation that did not finish on every rank (``in_place_action``)."""

    RECOVER = "recover"  # a new generation of training processes in the same worker group
    ESCALATE = "escalate"  # to Ray Train's failure policy, which decides as it always has


FINISHED, RAISED, DIED, STOPPED = RankStatus.FINISHED, RankStatus.RAISED, RankStatus.DIED, RankStatus.STOPPED
RECOVER, ESCALATE = InPlaceAction.RECOVER, InPlaceAction.ESCALATE


class GenerationState(StrEnum):
    """Where a supervisor's current generation is (as Ray Train's ``TrainControllerState`` and
    torchelastic's ``WorkerState``); ``GENERATION_MOVES`` holds every move it may make."""

    RUNNING = "running"  # its training process trains
    ENDED = "ended"  # every rank's end is published and read
    FINISHED = "finished"  # every rank finished: the supervisor returns (final)
    RECOVERING = "recovering"  # rank 0 said RECOVER: a new generation starts
    ESCALATED = "escalated"  # rank 0 said ESCALATE: the failure goes to Ray Train (final)


GENERATION_MOVES: dict[GenerationState, tuple[GenerationState, ...]] = {
    GenerationState.RUNNING: (GenerationState.ENDED,),
    GenerationState.ENDED: (GenerationState.FINISHED, GenerationState.RECOVERING, GenerationState.ESCALATED),
    GenerationState.RECOVERING: (GenerationState.RUNNING,),
    GenerationState.FINISHED: (),
    GenerationState.ESCALATED: (),
}


def after_generation(ends: list[RankEnd], action: Callable[[], InPlaceAction]) -> GenerationState:
    """An ended generation's next state: FINISHED when every rank finished, else what rank 0 decided
    (``action``, asked only then)."""
    if all(e.status == FINISHED for e in ends):
        return GenerationState.FINISHED
    return GenerationState.RECOVERING if action() == RECOVER else GenerationState.ESCALATED


def move(current: GenerationState, to: GenerationState) -> GenerationState:
    """``to``, when ``GENERATION_MOVES`` allows it from ``current``; a move it does not list is a bug."""
    if to not in GENERATION_MOVES[current]:
        raise ValueError(f"an in-place generation cannot go from {current} to {to}")
    return to


@dataclass(frozen=True)
class RankEnd:
    """One rank's end in an in-place generation: what the failure decision needs of it, as plain
    data (it crosses nodes as JSON through the supervisors' store)."""

    rank: int
    status: RankStatus
    message: str = ""  # the rank's one-line reason (``failure_reason``), or how its process exited
    ours: bool = False  # a syncpoint exception (``is_ours``)
    refusal: str | None = None  # a refusal of the job itself (no retry can change it), its reason
    signature: str = ""  # ``failure_signature`` of the exception, or of the exit
    micro_step: int | None = None  # where the rank was (its failure site), None: setting up or unknown
    traceback: str = ""  # the rank's traceback as Python prints it (its tail, bounded), "" when it has none


TRACEBACK_LIMIT = 8000  # the tail of a traceback a rank publishes (its innermost frames and the error)
# Set on an exception whose failure was printed already (in place: rank 0's decision printed
# ``failure_lines``), so whoever sees it next (a spawned rank, Ray Train's failure policy) does not again.
REPORTED_ATTR = "syncpoint_reported"
# A Ray Train rank's traceback text, carried on its exception (Ray hands the controller the exception
# without its traceback; Ray's own text of it is only in a truncated snippet).
TRACEBACK_ATTR = "syncpoint_traceback"


def failure_lines(ends: list[RankEnd], repeats: bool) -> list[str]:
    """What a failed generation prints, once, from the rank that decides: the traceback of the rank
    that says why (``failing_end``) and one line for each other failed rank (its reason: exception
    type, first line, place). Why not every rank's own: a bug in the task fails every rank the same
    way, and a rank whose collective broke only says that a peer died first. A failure that repeats
    the previous one (``repeats_previous``) gets one line: its traceback was printed then. Nothing for
    syncpoint's own exception (a refusal: its message is written for the user, the run's last line) nor
    for a process that died without one (a crash, a kill: the decision's line says how it ended)."""
    cause = failing_end(ends)
    if cause is None or cause.ours or not cause.traceback:
        return []
    if repeats:
        head = [f"[syncpoint] rank {cause.rank} failed again the same way: {cause.message}"]
    else:
        head = [f"[syncpoint] rank {cause.rank} failed:", cause.traceback.rstrip("\n")]
    others = sorted((e for e in ends if e.status in (RAISED, DIED) and e is not cause), key=lambda e: e.rank)
    return head + [f"[syncpoint] rank {e.rank} also failed: {e.message}" for e in others]


def failing_end(ends: list[RankEnd]) -> RankEnd | None:
    """The rank whose end says why a generation failed: ``failing_cause``'s rule over plain data
    (a syncpoint exception first, then the lowest rank's own error over a peer's lost connection,
    then the lowest failed rank)."""
    failed = sorted((e for e in ends if e.status in (RAISED, DIED)), key=lambda e: e.rank)
    return (
        next((e for e in failed if e.ours), None)
        or next((e for e in failed if not looks_like_lost_peer(e.message)), None)
        or (failed[0] if failed else None)
    )


def in_place_facts(ends: list[RankEnd], notice_logged: bool, repeats: bool) -> FailureFacts:
    """The facts of a generation that failed while every supervisor (so every node) lived: no node
    is dead by construction, and Ray reported nothing."""
    cause = failing_end(ends)
    failed = sorted((e for e in ends if e.status in (RAISED, DIED)), key=lambda e: (e is not cause, e.rank))
    return FailureFacts(
        ray_says_preempted=False,
        dead_attempt_nodes=(),
        notice_logged=notice_logged,
        messages=tuple(e.message for e in failed),
        refusal=next((e.refusal for e in failed if e.refusal), None),
        signature=cause.signature if cause else None,
        micro_step=cause.micro_step if cause else None,
        repeats=repeats,
    )


def in_place_action(verdict: FailureVerdict, repeats: bool, retried: int, max_failures: int) -> InPlaceAction:
    """RECOVER (a new generation of training processes in the same worker group) or ESCALATE (to
    Ray Train's failure policy, which decides exactly as it always has).

    Only an application failure still within ``failure.max_failures`` (``retried``: this
    submission's application failures retried so far, in place or by Ray) recovers in place: a
    preemption means a node is going away, a refusal fails the run, a repeated failure is not
    retried, and an exhausted budget fails the run; all of those Ray's policy decides, with the
    same verdicts as without in-place recovery."""
    if verdict.kind != APPLICATION or repeats:
        return ESCALATE
    return RECOVER if max_failures == -1 or retried + 1 <= max_failures else ESCALATE
