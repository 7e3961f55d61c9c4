"""Our failure policy inside Ray Train's controller.

Ray 2.60's failure policy is not public. ``DataParallelTrainer`` builds it on the driver with
``create_failure_policy(failure_config)`` and ships it to the controller actor, so syncpoint swaps
that factory around ``fit()``. The private names it needs come from ``ray_internals``, whose test
resolves each against the installed Ray, and ``tests/integration/orchestrator/test_failure_policy.py``
checks the factory swap, so a Ray upgrade that moves them fails loudly instead of silently charging
node losses to ``max_failures``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from ray.train.v2.api import data_parallel_trainer as _dpt
from ray.train.v2.api.config import FailureConfig
from ray.train.v2.api.exceptions import ControllerError, TrainingFailedError, WorkerGroupError

from syncpoint.orchestrator.failure_report import failure_report, own_exception
from syncpoint.orchestrator.ray_internals import (
    DEFAULT_WORKER_GROUP_START_TIMEOUT_S,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    DefaultFailurePolicy,
    FailureDecision,
    WorkerGroupStartupTimeoutError,
    is_preemption_failure,
)
from syncpoint.policies.contracts.journal import Journal
from syncpoint.policies.decisions.failures import (
    APPLICATION,
    PLACEMENT,
    PREEMPTION,
    RAISED,
    REFUSAL,
    REPORTED_ATTR,
    TRACEBACK_ATTR,
    TRACEBACK_LIMIT,
    FailureFacts,
    FailureVerdict,
    RankEnd,
    classify_failure,
    failure_lines,
    failure_reason,
    failure_signature,
    is_ours,
    looks_like_lost_peer,
    placement_exhausted,
    placement_waited_s,
    repeats_previous,
    should_await_node_death,
)


class SyncpointFailurePolicy(DefaultFailurePolicy):
    """Ray's default policy, except that node loss and noticed preemptions use the preemption budget."""

    def __init__(
        self,
        failure_config: FailureConfig,
        run_url: str,
        heartbeat: Any | None = None,
        placement_timeout_s: float = float("inf"),
        submission: str = "",
    ) -> None:
        super().__init__(failure_config)
        self.run_url, self.heartbeat, self.placement_timeout_s = run_url, heartbeat, placement_timeout_s
        self.submission = submission
        self._placement_since: float | None = None  # the first of the current run of placement timeouts
        self._preempted: str | None = None  # the decision's verdict, when it is a preemption (its line says so)
        # Nodes already dead when the policy was built (on the driver) or at its last decision: a
        # worker group that fails before logging its start has no nodes on record, and only a node
        # that died since then can be its own (see gather_facts).
        self._known_dead: frozenset[str] = frozenset(_dead_nodes())

    def make_decision(self, training_failed_error: TrainingFailedError) -> FailureDecision:
        if is_placement_timeout(training_failed_error):
            return self.decide_placement(time.monotonic(), training_failed_error)
        self._placement_since = None  # a worker group started: the wait for room is over
        journal = read_journal(self.run_url)  # once: on object storage the log is many files
        record_interruption(self.run_url, self.heartbeat, time.time(), journal, self.submission)  # before the next
        facts = gather_facts(training_failed_error, journal, self.submission, self._known_dead)
        if journal is not None:  # application failures recovered in place spent the same budget
            retried = journal.retried(self.submission, APPLICATION)
            self._worker_group_failures = max(self._worker_group_failures, retried)
        self._known_dead = frozenset(_dead_nodes())
        return self.decide(facts, training_failed_error)

    def _log_decision(
        self, decision: FailureDecision, training_failed_error: TrainingFailedError, error_count: int, retry_limit: int
    ) -> None:
        """One line per decision. Ray's own logs the whole worker-group error with its traceback
        (every rank's snippet), twice over, at every retry; the failing rank's traceback is printed
        once (``print_failure``), and the run's last line names it. A preemption's line says what was
        lost (a node), not the error Ray saw on the ranks it left behind (a failed health check)."""
        limit = "unlimited" if retry_limit in (-1, float("inf")) else f"{retry_limit:g}"
        preempted = f"a preemption: {self._preempted}" if self._preempted else None
        reason = (preempted or failure_report(training_failed_error)[0])[:300]
        print(
            f"[syncpoint] attempt failed ({reason}): {decision.value.lower()} ({error_count} of {limit} allowed)",
            file=sys.stderr,
            flush=True,
        )

    def decide_placement(self, now: float, training_failed_error: TrainingFailedError) -> FailureDecision:
        """A worker-group start timed out waiting for room: retry (Ray's controller budget) until the
        run has waited ``failure.placement_timeout_s`` in a row, then fail instead of waiting forever."""
        if self._placement_since is None:
            self._placement_since = now
        waited = placement_waited_s(self._placement_since, now, start_timeout_s())
        if placement_exhausted(waited, self.placement_timeout_s):
            decision = FailureDecision.RAISE
            reason = (
                f"no room for the workers after {waited:.0f} s "
                f"(failure.placement_timeout_s {self.placement_timeout_s:g})"
            )
        else:
            decision = super().make_decision(training_failed_error)
            reason = f"waiting for room for the workers: {waited:.0f} s of {self.placement_timeout_s:g}"
        facts = FailureFacts(
            ray_says_preempted=False,
            dead_attempt_nodes=(),
            notice_logged=False,
            messages=(failure_report(training_failed_error)[0],),
        )
        _record(
            self.run_url, FailureVerdict(PLACEMENT, reason), facts, decision, training_failed_error, self.submission
        )
        return decision

    def decide(self, facts: FailureFacts, training_failed_error: TrainingFailedError) -> FailureDecision:
        """The decision from gathered facts (apart from gathering, which asks the running cluster)."""
        verdict = classify_failure(facts)
        self._preempted = verdict.reason if verdict.kind == PREEMPTION else None
        if verdict.kind == APPLICATION:  # a preemption's or a refusal's own line says why
            print_failure(training_failed_error, facts.repeats)
        ray_counts_as_preemption = facts.ray_says_preempted
        if (
            verdict.kind == PREEMPTION
            and not ray_counts_as_preemption
            and isinstance(training_failed_error, WorkerGroupError)
        ):
            self._preemption_failures += 1
            limit = self.failure_config.max_preemption_failures
            within = limit == -1 or self._preemption_failures <= limit
            decision = FailureDecision.RETRY if within else FailureDecision.RAISE
            # inf for "no limit", as Ray's own policy logs it (its annotation says int)
            self._log_decision(
                decision,
                training_failed_error,
                self._preemption_failures,
                float("inf") if limit == -1 else limit,  # type: ignore[arg-type]
            )
        elif verdict.kind == REFUSAL:
            decision = FailureDecision.RAISE
        elif verdict.kind == APPLICATION and facts.repeats:  # a bug that repeats: retries would only repeat it
            decision = FailureDecision.RAISE
        else:
            decision = super().make_decision(training_failed_error)
        _record(self.run_url, verdict, facts, decision, training_failed_error, self.submission)
        return decision


def print_failure(error: BaseException, repeats: bool) -> None:
    """A worker group's failure, once: the failing rank's traceback and one line for each other rank
    (``failure_lines``). Why here: Ray Train's workers would each log their own traceback (the job's
    worker processes drop them: ``quiet.quiet_worker``); the controller sees every rank's. Nothing
    when an in-place decision printed it already (``REPORTED_ATTR``)."""
    lines = failure_lines(failure_ends(error), repeats)
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def failure_ends(error: BaseException) -> list[RankEnd]:
    """Each failed rank of a worker group's failure (``WorkerGroupError.worker_failures``) as a
    ``RankEnd`` with its traceback text (the rank attached it: ``failure_site.attach_traceback``;
    else Ray Train's wrapper's, where it kept one); [] when printed already."""
    failures = getattr(error, "worker_failures", None) or {}
    ends = []
    for rank in sorted(failures):
        own = own_exception(failures[rank])
        if getattr(own, REPORTED_ATTR, False):
            return []
        ends.append(
            RankEnd(
                rank=rank,
                status=RAISED,
                message=failure_reason(own)[0],
                ours=is_ours(own),
                traceback=str(getattr(own, TRACEBACK_ATTR, "") or getattr(failures[rank], "_traceback_str", ""))[
                    -TRACEBACK_LIMIT:
                ],
            )
        )
    return ends


def is_placement_timeout(error: BaseException) -> bool:
    """Ray Train's controller gave up one worker-group start for lack of room (and would retry forever)."""
    return isinstance(error, ControllerError) and isinstance(error.controller_failure, WorkerGroupStartupTimeoutError)


def start_timeout_s() -> float:
    """Ray Train's per-try worker-group start timeout, as the controller (this process) reads it."""
    return float(os.environ.get(WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, DEFAULT_WORKER_GROUP_START_TIMEOUT_S))


def read_journal(run_url: str) -> Journal | None:
    """The run's journal, or None when the log cannot be read (the decision must still be made)."""
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        return EventLog(RunStorage(run_url)).journal()
    except Exception:  # noqa: BLE001 - an unreadable log leaves the facts Ray gave
        return None


def record_interruption(
    run_url: str, heartbeat: Any | None, detected_at: float, journal: Journal | None, submission: str = ""
) -> str | None:
    """Write the failed attempt's measured interruption point (``interrupted``): each rank's last
    heartbeat. Nothing without a board (older drivers), for a worker group that died before it
    logged its start, or for an attempt that already has one. When the reading cannot be taken (no
    beat, the board unreachable, a failed write) the controller's log says why, in one line that is
    also returned: the timeline then falls back to the flushed progress, and the line is what tells
    a person (and the node-loss test) which of those it was."""
    if heartbeat is None:
        return None
    import ray

    from syncpoint.policies.contracts.journal import Interrupted, RankReached
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    attempt: int | None = None
    try:
        if journal is None:
            raise RuntimeError("the run's event log could not be read")
        failing = journal.failing_attempt(submission)
        if failing is None or journal.interrupted(failing.attempt) is not None:
            return None
        attempt = failing.attempt
        beats = [RankReached.model_validate(b) for b in ray.get(heartbeat.read.remote(attempt), timeout=30)]
        if not beats:
            note = f"attempt {attempt}: no rank's heartbeat reached the board"
        else:
            newest = max(beats, key=lambda b: (b.global_micro_step, b.time))
            EventLog(RunStorage(run_url), source="controller").emit(
                Interrupted(
                    attempt=attempt,
                    ranks=beats,
                    global_micro_step=newest.global_micro_step,
                    reached_at=max(b.time for b in beats),
                    detected_at=detected_at,
                )
            )
            return None
    except Exception as e:  # noqa: BLE001 - the measurement is for people; it must not change Ray's decision
        why = " ".join(str(e).split())  # Ray's actor errors put the cause (owner, node) after their first line
        note = f"attempt {attempt or '?'}: the heartbeat reading failed ({type(e).__name__}: {why[:600]})"
    line = f"[syncpoint] no interruption point measured for {note}; lost work falls back to the flushed progress"
    print(line, file=sys.stderr, flush=True)
    return line


def gather_facts(
    error: TrainingFailedError, journal: Journal | None, submission: str = "", known_dead: frozenset[str] = frozenset()
) -> FailureFacts:
    """What the classification needs, from Ray's error, the run's journal and Ray's node table.

    The failing attempt's nodes and notice come from its ``attempt_started`` and notice events
    (``Journal.failing_attempt``). A worker group that died while setting up logged neither: then
    no earlier attempt's nodes or notice count, only a node that died since the last decision
    (``known_dead`` is the dead set then)."""
    import ray

    failures = getattr(error, "worker_failures", {}) or {}
    messages = tuple(failure_report(e)[0] for _, e in sorted(failures.items()))
    attempt_nodes: list[str] = []
    notice = False
    logged = True  # an unreadable log: no nodes, no notice (the facts Ray gave decide)
    if journal is not None:
        failing = journal.failing_attempt(submission)
        logged = failing is not None
        if failing is not None:
            attempt_nodes = list(failing.nodes)
            notice = journal.notice_in(failing.attempt) is not None
    dead = _dead_nodes()
    system_death = any(_is_system_death(e) for e in failures.values())
    # A node that went silent (no RST, no exit) shows first as a survivor's collective timeout when
    # scaling.collective_timeout_s is shorter than Ray's health check: the same wait applies.
    lost_peer = any(looks_like_lost_peer(m) for m in messages)
    own_node = ray.get_runtime_context().get_node_id()
    if logged:
        if should_await_node_death(system_death or lost_peer, set(attempt_nodes), own_node, dead, notice):
            # A worker vanished without a Python exception: Ray marks its node dead only after the GCS
            # health check gives up, so wait (bounded) before calling it an application failure.
            dead, note = await_node_death(attempt_nodes, node_death_wait_s(), _dead_nodes)
            messages = (*messages, note) if note else messages
        lost = set(attempt_nodes) & dead
    else:
        lost = dead - known_dead
        if system_death and not lost:
            dead, note = await_new_node_death(known_dead, node_death_wait_s(), _dead_nodes)
            messages = (*messages, note) if note else messages
            lost = dead - known_dead
    signature, micro_step, repeats = _repetition(error, journal, submission)
    return FailureFacts(
        ray_says_preempted=is_preemption_failure(error),
        dead_attempt_nodes=tuple(sorted(lost)),
        notice_logged=notice,
        messages=messages,
        refusal=_refusal(failures),
        signature=signature,
        micro_step=micro_step,
        repeats=repeats,
    )


def _repetition(error: BaseException, journal: Journal | None, submission: str) -> tuple[str, int | None, bool]:
    """(signature, micro-step, repeats the previous failed attempt) of the failing rank's exception
    (``failing_cause``, the one the last line names), from the site its rank attached
    (``syncpoint.workers.supervision.failure_site``) and the journal's previous application failure of this
    submission."""
    from syncpoint.orchestrator.failure_report import failing_cause

    cause = failing_cause(error)
    site = getattr(cause, "syncpoint_site", None)
    micro_step = site.get("micro_step") if isinstance(site, dict) else None
    micro_step = micro_step if isinstance(micro_step, int) else None
    signature = failure_signature(cause)
    if journal is None or not submission:
        return signature, micro_step, False
    previous = journal.last_failure(submission, APPLICATION)
    repeats = previous is not None and repeats_previous(
        signature, micro_step, (previous.signature, previous.micro_step), journal.committed_since(previous.time)
    )
    return signature, micro_step, repeats


def node_death_wait_s() -> float:
    """How long a failure waits for Ray to declare a silent node dead before classifying it."""
    return float(os.environ.get("SYNCPOINT_NODE_DEATH_WAIT_S", "30"))


def await_node_death(
    attempt_nodes: list[str], bound_s: float, dead_nodes: Callable[[], set[str]], poll_s: float = 0.5
) -> tuple[set[str], str | None]:
    """Poll Ray's node table until a node of the attempt is dead or ``bound_s`` has passed; returns the
    dead nodes and, when the bound was hit, the note saying so (kept with the failure's messages: the
    failure is then counted as a crash, and the log says why)."""
    return _await_death(
        lambda dead: bool(set(attempt_nodes) & dead),
        bound_s,
        dead_nodes,
        poll_s,
        "a worker vanished but no node of the attempt was declared dead",
    )


def await_new_node_death(
    known_dead: frozenset[str], bound_s: float, dead_nodes: Callable[[], set[str]], poll_s: float = 0.5
) -> tuple[set[str], str | None]:
    """``await_node_death`` for a worker group that died setting up, before it logged its nodes:
    poll until any node not already in ``known_dead`` is dead, or ``bound_s`` has passed."""
    return _await_death(
        lambda dead: bool(dead - known_dead),
        bound_s,
        dead_nodes,
        poll_s,
        "a worker vanished while its group was setting up and no node was declared dead",
    )


def _await_death(
    found: Callable[[set[str]], bool], bound_s: float, dead_nodes: Callable[[], set[str]], poll_s: float, what: str
) -> tuple[set[str], str | None]:
    deadline = time.monotonic() + bound_s
    dead = dead_nodes()
    while not found(dead):
        if time.monotonic() >= deadline:
            return dead, f"{what} within SYNCPOINT_NODE_DEATH_WAIT_S ({bound_s:g} s): counted as a crash"
        time.sleep(poll_s)
        dead = dead_nodes()
    return dead, None


def _refusal(failures: dict) -> str | None:
    """The reason of the first rank that failed with one of syncpoint's refusals of the job itself
    (its spec, its task, selection, a lost lease), which no retry can change; None otherwise."""
    from syncpoint.policies.contracts.errors import JOB_REFUSALS

    for _, error in sorted(failures.items()):
        if isinstance(own_exception(error), JOB_REFUSALS):
            return failure_report(error)[0]
    return None


def _dead_nodes() -> set[str]:
    import ray

    try:
        return {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
    except Exception:  # noqa: BLE001 - no node list (GCS busy): no node counts as dead
        return set()


def _is_system_death(error: BaseException) -> bool:
    """A worker process or its node disappeared (as opposed to an exception in user code)."""
    from ray.exceptions import RayActorError

    inner = getattr(error, "health_check_failure", error)
    return isinstance(inner, RayActorError) or isinstance(error, RayActorError)


def _record(
    run_url: str,
    verdict: FailureVerdict,
    facts: FailureFacts,
    decision: FailureDecision,
    error: TrainingFailedError,
    submission: str = "",
) -> None:
    from syncpoint.policies.contracts.journal import Failure
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    try:
        EventLog(RunStorage(run_url), source="controller").emit(
            Failure(
                classified=verdict.kind,
                reason=verdict.reason,
                decision=decision.value,
                ranks=sorted(getattr(error, "worker_failures", {}) or {}),
                messages=list(facts.messages)[:4],
                dead_nodes=list(facts.dead_attempt_nodes),
                submission=submission,
                signature=facts.signature,
                micro_step=facts.micro_step,
                repeated=facts.repeats and verdict.kind == APPLICATION,
            )
        )
    except Exception:  # noqa: BLE001 - the log is for people; a failed write must not change Ray's decision
        pass


@contextlib.contextmanager
def installed(
    run_url: str, heartbeat: Any | None = None, placement_timeout_s: float = float("inf"), submission: str = ""
) -> Iterator[None]:
    """Make ``DataParallelTrainer`` build ``SyncpointFailurePolicy`` while a trainer runs ``fit()``."""
    original = _dpt.create_failure_policy
    # Ray annotates the factory with `ray.train.FailureConfig`, which type checkers resolve to the V1 class;
    # at run time it is V2's (the one the policy takes)
    _dpt.create_failure_policy = lambda failure_config: SyncpointFailurePolicy(
        failure_config,  # type: ignore[arg-type]
        run_url,
        heartbeat,
        placement_timeout_s,
        submission,
    )
    try:
        yield
    finally:
        _dpt.create_failure_policy = original
