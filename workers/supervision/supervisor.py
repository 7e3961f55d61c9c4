"""In-place recovery: each rank's launcher process supervises the training, which runs in a child
process; a failed generation of children is replaced by a new one inside the same worker group.

Why this mechanism (torchelastic's agent, not NVRx's in-process restart): a rank that crashes
(``os._exit``, a segfault, an OOM kill) cannot restart itself, and a process that raised still
holds whatever the failed step left behind (a half-applied step in the engine, broken communicators,
DataLoader workers and threads mid-batch), which an exact resume cannot vouch for. A child forked
from a fork server that already imported torch and DeepSpeed starts in a fraction of a second.
Every rank starts a new child, not only the failed one: exact resume restores every rank from the
same committed state, so a survivor's engine (mid-step, its collectives broken) is of no use; the
new generation restores from the node's memory copy (``syncpoint.workers.state.memory_copy``) or
storage, selected exactly as any restart.

The supervisors agree through a ``TCPStore`` that rank 0's supervisor serves on the node's address
alone, every key under a secret namespace (``syncpoint.workers.supervision.store_agent``: its address and
namespace are broadcast once over the launcher's own channel); the children of generation ``g``
form their own process group on it under the prefix ``g<g>/``. A supervisor whose child fails marks the
generation failed; every supervisor then stops its own child (SIGKILL: a committed state never
depends on a process finishing), publishes how it ended (``RankEnd``, JSON), and rank 0 decides
(``Hooks.decide``: classified and budgeted exactly as Ray Train's failure policy does,
``syncpoint.policies.decisions.failures.in_place_action``). RECOVER starts generation ``g+1``; ESCALATE makes
the failed ranks' supervisors raise their child's exception, so Ray Train's failure policy decides
it as it always has. A supervisor that dies (its node lost) never publishes: Ray Train notices its
actor's death and restarts the group.

Ray's calls a child needs are proxied over a pipe: the preemption notice (read from the worker's
local preemption context, not Ray's barrier: the loop already agrees on notices at every
boundary), heartbeats (forwarded to the board), and metrics (``ray.train.report``, called in order
by a thread of the supervisor). That report is a barrier across the worker group: a generation that
fails leaves the ranks with different numbers of reports sent, so before the next generation each
supervisor pads its own up to the largest count (repeating its last metrics), and every later
report pairs with the same report of every other rank again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions import seeds
from syncpoint.policies.decisions.failures import (
    DIED,
    ESCALATE,
    FINISHED,
    RAISED,
    RECOVER,
    STOPPED,
    GenerationState,
    InPlaceAction,
    RankEnd,
    after_generation,
    move,
)
from syncpoint.policies.decisions.grace_window import Notice

if TYPE_CHECKING:
    pass
from syncpoint.workers.supervision.coordination import POLL_S, Coordinator, CoordinatorPlan, parse_end
from syncpoint.workers.supervision.training_child import ChildPlan, child_main, reported

ESCALATED_WAIT_S = 120.0  # a surviving supervisor waits this long for Ray Train to end the group


class TrainingProcessDied(RuntimeError):
    """A rank's training process ended without an exception (a crash, a signal), handed to Ray Train."""


class PeerEscalated(RuntimeError):
    """Another rank's failure was handed to Ray Train, which did not end this worker in time."""


@dataclass
class Hooks:
    """What the launcher gives its supervisor: Ray's calls (or nothing, outside Ray) and the decision."""

    # rank 0: RECOVER or ESCALATE for a failed generation (it records the failure, as Ray's policy does)
    decide: Callable[[list[RankEnd]], InPlaceAction]
    notice: Callable[[], Notice | None] | None = None  # a local, non-blocking read
    beat: Callable[[int, int, int, float], None] | None = None  # a heartbeat, forwarded
    report: Callable[[dict[str, float]], None] | None = None  # Ray Train's report (a barrier), called in order
    # run in each training process before the loop (a module-level function: it is pickled by name)
    child_setup: Callable[[JobSpec], None] | None = None
    node_id: str = ""
    worker_id: str = ""
    submission_id: str = ""
    print_progress: bool = True
    launched_at: float = field(default_factory=time.time)
    # this submission's key for the node's warm server (syncpoint.workers.supervision.zygote), or None: fork from
    # a server of this supervisor's own, which ends with it
    warm_key: str | None = None


# ---------------------------------------------------------------- the supervisor's side
class _Service(threading.Thread):
    """Answers one child's proxied calls until its pipe closes."""

    def __init__(self, conn: Any, hooks: Hooks, reporter: _Reporter | None) -> None:
        super().__init__(name="syncpoint-supervisor-link", daemon=True)
        self.conn, self.hooks, self.reporter = conn, hooks, reporter
        self.end: RankEnd | None = None
        self.error: bytes | None = None
        self.metrics: dict[str, float] = {}
        self.reports = 0

    def run(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return
            with contextlib.suppress(Exception):  # a failed proxy call costs that call, never the supervisor
                self._handle(message)

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "notice":
            notice = None
            with contextlib.suppress(Exception):
                notice = self.hooks.notice() if self.hooks.notice else None
            self.conn.send(notice)
        elif kind == "beat" and self.hooks.beat is not None:
            self.hooks.beat(*message[1])
        elif kind == "report" and self.reporter is not None:
            self.metrics = dict(message[1])
            self.reports += 1
            self.reporter.put(self.metrics)
        elif kind == "end":
            self.end = parse_end(json.dumps(message[1]).encode(), int(message[1]["rank"]))
            self.error = message[2]


class _Reporter(threading.Thread):
    """Calls the launcher's report in order, off the supervisor's thread (a report waits for every
    rank's, and the supervisor must keep watching its child meanwhile)."""

    def __init__(self, report: Callable[[dict[str, float]], None]) -> None:
        super().__init__(name="syncpoint-supervisor-reports", daemon=True)
        self.report = report
        self.queue: queue.Queue[dict[str, float]] = queue.Queue()

    def put(self, metrics: dict[str, float]) -> None:
        self.queue.put(metrics)

    def run(self) -> None:
        while True:
            metrics = self.queue.get()
            with contextlib.suppress(Exception):  # a failed report costs that report, never the run
                self.report(metrics)
            self.queue.task_done()

    def drain(self, bound_s: float) -> None:
        """Wait (bounded) until every queued report returned: the run's last reach Ray before it ends."""
        deadline = time.monotonic() + bound_s
        while self.queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(POLL_S)


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """Start a process without multiprocessing re-running this process's ``__main__`` in it.

    Why: a process started by a fork server or by spawn runs the parent's main script again (as
    ``__mp_main__``) before its target; in a Ray worker that is Ray's worker script, whose imports
    cost 1.2 s of every in-place restart here (measured), and the training process needs nothing
    from it (its target lives in this module). multiprocessing finds the script through
    ``sys.modules["__main__"]``; an empty module stands in while the process starts."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _unpickled(payload: bytes | None) -> BaseException | None:
    """The child's exception, as it raised it (pickled by this supervisor's own child, over its pipe:
    never bytes from storage or the network)."""
    if payload is None:
        return None
    import pickle

    try:
        error = pickle.loads(payload)  # from this supervisor's own child (see the docstring)
    except Exception:  # noqa: BLE001 - an exception that does not unpickle goes by its description
        return None
    return error if isinstance(error, BaseException) else None


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ProcessArgs(TypedDict):
    """The arguments a rank's process is made with, from the warm server or a context."""

    target: Callable[..., None]
    args: tuple[Any, ...]
    name: str


class Supervisor:
    """One rank's supervisor: runs generations of its training process until the run finishes or a
    failure goes to Ray Train."""

    coordinator: Coordinator  # connected by run(), once it holds the node's warm server

    def __init__(self, spec: JobSpec, plan: CoordinatorPlan, local_rank: int, hooks: Hooks) -> None:
        self.spec, self.plan, self.local_rank, self.hooks = spec, plan, local_rank, hooks
        self.rank, self.world = plan.rank, plan.world
        self.bound_s = max(60.0, 2 * spec.scaling.collective_timeout_s)  # a live peer publishes well within it
        self.warm: Any = None  # a zygote.Holder while run() holds the node's warm server

    def run(self) -> None:
        """Until the run finishes (return) or a failure is handed to Ray Train (raise)."""
        from syncpoint.workers.state import memory_reaper

        reaper = memory_reaper.start(self.spec.run_url) if self.spec.checkpoint.memory_copy is not False else None
        self.warm = self._hold_warm_server()
        coordinator = None
        try:
            hash_seed = str(seeds.hash_seed(self.spec.train.seed))
            if self.warm is None:  # every rank's own fork server starts its imports now, side by side
                from syncpoint.workers.supervision import fork_context

                fork_context.context(fork_context.start_method(self.spec), hash_seed)
            # its store agent comes from where the training processes come from
            self.coordinator = coordinator = self.plan.connect(functools.partial(self._start, hash_seed=hash_seed))
            self._generations()
        except BaseException:
            if reaper is not None:
                reaper.keep()  # a new worker group on this node may restore from the copy
            raise
        finally:
            if coordinator is not None:
                coordinator.close()
            if self.warm is not None:
                self.warm.close()  # the server stays for the next worker group here (bounded: zygote.IDLE_S)
        if reaper is not None:
            reaper.close()

    def _hold_warm_server(self) -> Any:
        """This node's warm server for the submission, or None (not asked for, not a CPU fork, or
        unavailable: then this supervisor forks from a server of its own, as without one)."""
        from syncpoint.workers.supervision import fork_context, zygote

        if self.hooks.warm_key is None or fork_context.start_method(self.spec) != "forkserver":
            return None
        try:
            seed = str(seeds.hash_seed(self.spec.train.seed))
            return zygote.hold(self.hooks.warm_key, seed, zygote.server_env(self.spec))
        except (OSError, ValueError, KeyError, subprocess.SubprocessError, zygote.Unavailable) as e:
            print(f"[syncpoint] rank {self.rank}: no warm server on this node ({e}); forking from this worker's own")
            return None

    def _generations(self) -> None:
        generation, launched_at = 0, self.hooks.launched_at
        reporter = _Reporter(self.hooks.report) if self.hooks.report is not None else None
        if reporter is not None:
            reporter.start()
        state = GenerationState.RUNNING  # its moves: syncpoint.policies.decisions.failures.GENERATION_MOVES
        while True:
            end, error, service = self._run_child(generation, launched_at, reporter)
            self.coordinator.publish(generation, end, service.reports)
            ends = self.coordinator.ends(generation, self.bound_s)
            state = move(state, GenerationState.ENDED)
            if reporter is not None:  # every rank's reports paired again (see the module docstring)
                for _ in range(self.coordinator.most_reports(generation) - service.reports):
                    reporter.put(dict(service.metrics))
            decide = functools.partial(self.hooks.decide, ends)  # rank 0's; the others read it
            action = functools.partial(self.coordinator.action, generation, decide, self.bound_s)
            state = move(state, after_generation(ends, action))
            if state == GenerationState.RECOVERING:
                generation, launched_at = generation + 1, time.time()
                if self.rank == 0:
                    print(f"[syncpoint] recovering in place: training generation {generation}", flush=True)
                state = move(state, GenerationState.RUNNING)
                continue
            self.coordinator.leave(generation, self.bound_s)
            if state == GenerationState.FINISHED:
                if reporter is not None:
                    reporter.drain(self.bound_s)
                return
            self._escalate(end, error)

    def _escalate(self, end: RankEnd, error: bytes | None) -> None:
        """Hand the failure to Ray Train: the failed ranks raise their child's exception; the others
        wait for Ray Train to end the worker group (bounded)."""
        raised = _unpickled(error) if end.status == RAISED else None
        if raised is not None:
            raise reported(raised)
        if end.status in (RAISED, DIED):
            raise reported(TrainingProcessDied(end.message))
        time.sleep(ESCALATED_WAIT_S)
        raise reported(PeerEscalated("another rank's failure was handed to Ray Train"))

    def _start(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        name: str,
        hash_seed: str,
        cold_args: tuple[Any, ...] | None = None,
    ) -> Any:
        """Start one of this rank's processes (a generation's training process, the store's agent):
        forked from the node's warm server, or from this supervisor's own (also when the warm server
        went away: it is a shortcut, never a dependency; then with ``cold_args`` when given)."""
        from syncpoint.workers.supervision import fork_context

        how: ProcessArgs = {"target": target, "args": args, "name": name}
        with fork_context.environ(PYTHONHASHSEED=hash_seed), _without_main_module():
            if self.warm is not None:
                try:
                    proc = self.warm.process(**how)
                    proc.start()
                    return proc
                except OSError as e:
                    print(
                        f"[syncpoint] rank {self.rank}: the node's warm server is gone ({e}); forking from this "
                        "worker's own",
                        flush=True,
                    )
                    self.warm.close()
                    self.warm = None
                    how["args"] = cold_args or args
            ctx = fork_context.context(fork_context.start_method(self.spec), hash_seed)
            proc = ctx.Process(**how)
            proc.start()
            return proc

    def _run_child(
        self, generation: int, launched_at: float, reporter: _Reporter | None
    ) -> tuple[RankEnd, bytes | None, _Service]:
        """One generation's child, watched until it ends; how it ended."""
        hash_seed = str(seeds.hash_seed(self.spec.train.seed))
        parent_end, child_end = mp.Pipe(duplex=True)
        plan = ChildPlan(
            spec_json=self.spec.model_dump_json(),
            rank=self.rank,
            world=self.world,
            local_rank=self.local_rank,
            store=self.coordinator.address,
            generation=generation,
            environ={**os.environ, "PYTHONHASHSEED": hash_seed},
            notice=self.hooks.notice is not None,
            beat=self.hooks.beat is not None,
            report=self.hooks.report is not None,
            node_id=self.hooks.node_id,
            worker_id=self.hooks.worker_id,
            submission_id=self.hooks.submission_id,
            print_progress=self.hooks.print_progress,
            launched_at=launched_at,
            setup=self.hooks.child_setup,
            warm_start=None if self.warm is None else generation > 0 or not self.warm.server.started_here,
        )
        cold = dataclasses.replace(plan, warm_start=None)
        proc = self._start(
            child_main, (plan, child_end), f"syncpoint-rank{self.rank}-g{generation}", hash_seed, (cold, child_end)
        )
        child_end.close()
        service = _Service(parent_end, self.hooks, reporter)
        service.start()
        stopped = False
        try:
            while proc.is_alive():
                if not stopped and self.coordinator.failed(generation):
                    stopped = True
                    proc.kill()
                proc.join(POLL_S)
        finally:
            if proc.is_alive():  # the supervisor itself is failing: its child must not outlive it
                proc.kill()
                proc.join()
        service.join(timeout=5)
        parent_end.close()
        end = service.end
        if proc.exitcode == 0 and end is not None and end.status == FINISHED:
            return end, None, service
        if end is not None and end.status == RAISED:
            result = end
        elif stopped:
            result = RankEnd(rank=self.rank, status=STOPPED)
        else:
            text = f"rank {self.rank}'s training process {_exit_text(proc.exitcode)}"
            result = RankEnd(rank=self.rank, status=DIED, message=text, signature=text)
        if result.status != STOPPED:
            self.coordinator.mark_failed(generation)
        return result, service.error, service


# ---------------------------------------------------------------- rank 0's decision
def _print_failure(ends: list[RankEnd], repeats: bool) -> None:
    """The generation's failure, once for all its ranks (``failure_lines``), on this process's stderr."""
    from syncpoint.policies.decisions.failures import failure_lines

    lines = failure_lines(ends, repeats)
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)


def in_place_decider(
    spec: JobSpec,
    submission_id: str,
    before: Callable[[Any], None] | None = None,
    record_escalation: bool = False,
) -> Callable[[list[RankEnd]], InPlaceAction]:
    """Rank 0's ``Hooks.decide``: classify the failed generation from its ranks' ends and the run's
    journal as Ray Train's failure policy would (``classify_failure``, the repeat rule, the
    ``failure.max_failures`` budget counted from the journal), record the ``Failure`` event when it
    recovers in place, and say RECOVER or ESCALATE. ``before(journal)``: the launcher's own record
    first (Ray's: the measured interruption point from the heartbeat board). ``record_escalation``:
    also record an ESCALATE as the run's failure (``RAISE``), for a launcher with no failure policy
    of its own to do it (``syncpoint run --local``)."""

    def decide(ends: list[RankEnd]) -> InPlaceAction:
        from syncpoint.policies.contracts.journal import Failure
        from syncpoint.policies.decisions.failures import (
            APPLICATION,
            classify_failure,
            failing_end,
            in_place_action,
            in_place_facts,
            repeats_previous,
        )
        from syncpoint.workers.observation.events import EventLog
        from syncpoint.workers.storage import RunStorage

        log = EventLog(RunStorage(spec.run_url), source="supervisor")
        try:
            journal = log.journal()
        except Exception:  # noqa: BLE001 - no journal, no budget to count: Ray Train's policy decides
            _print_failure(ends, repeats=False)
            return ESCALATE
        if before is not None:
            with contextlib.suppress(Exception):
                before(journal)
        failing = journal.failing_attempt(submission_id)
        notice = failing is not None and journal.notice_in(failing.attempt) is not None
        cause = failing_end(ends)
        previous = journal.last_failure(submission_id, APPLICATION)
        repeats = (
            cause is not None
            and previous is not None
            and repeats_previous(
                cause.signature,
                cause.micro_step,
                (previous.signature, previous.micro_step),
                journal.committed_since(previous.time),
            )
        )
        _print_failure(ends, repeats)
        facts = in_place_facts(ends, notice, repeats)
        verdict = classify_failure(facts)
        retried = journal.retried(submission_id, APPLICATION)
        action = in_place_action(verdict, repeats, retried, spec.failure.max_failures)
        recovered = action == RECOVER
        if recovered:
            limit = "unlimited" if spec.failure.max_failures == -1 else str(spec.failure.max_failures)
            print(
                f"[syncpoint] attempt failed ({verdict.reason[:300]}): "
                f"retry in place ({retried + 1} of {limit} allowed)",
                file=sys.stderr,
                flush=True,
            )
        if recovered or record_escalation:
            log.emit(
                Failure(
                    classified=verdict.kind,
                    reason=verdict.reason,
                    decision="RETRY" if recovered else "RAISE",
                    ranks=sorted(e.rank for e in ends if e.status in (RAISED, DIED)),
                    messages=list(facts.messages)[:4],
                    dead_nodes=[],
                    submission=submission_id,
                    signature=facts.signature,
                    micro_step=facts.micro_step,
                    repeated=repeats and not recovered,
                    in_place=recovered,
                )
            )
        return action

    return decide
