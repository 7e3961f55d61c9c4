"""Failure classification on plain facts, the timeline's lost-work arithmetic, and a guard that
fails loudly when Ray moves the internals ``orchestrator/failure_policy.py`` relies on."""

from __future__ import annotations

import inspect

import pytest

from syncpoint.orchestrator.failure_report import failure_report
from syncpoint.orchestrator.timeline import format_timeline, restarts
from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Failure,
    FaultFired,
    Journal,
    Progress,
    ProgressRecord,
    StateCommitted,
)
from syncpoint.policies.decisions.failures import (
    APPLICATION,
    PREEMPTION,
    FailureFacts,
    classify_failure,
    looks_like_lost_peer,
)


def facts(**kw):
    base = dict(ray_says_preempted=False, dead_attempt_nodes=(), notice_logged=False, messages=("ValueError: x",))
    base.update(kw)
    return FailureFacts(**base)


def test_classification():
    assert classify_failure(facts()).kind == APPLICATION
    assert classify_failure(facts()).reason == "ValueError: x"
    assert classify_failure(facts(ray_says_preempted=True)).kind == PREEMPTION
    v = classify_failure(facts(dead_attempt_nodes=("abcdef0123456789",)))
    assert v.kind == PREEMPTION and "abcdef012345" in v.reason
    assert classify_failure(facts(notice_logged=True)).kind == PREEMPTION


def test_a_collective_that_lost_its_peer_is_told_from_a_bug():
    """The survivors of a silent node fail with these (gloo's, captured from torch 2.13 with a peer that
    stopped answering; NCCL's watchdog): the controller then waits for Ray's verdict on the node."""
    gloo = (
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
        "Timed out waiting 3000ms for recv operation to complete"
    )
    nccl = "DistBackendError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, ...)"
    closed = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:4"
    assert looks_like_lost_peer(gloo) and looks_like_lost_peer(nccl) and looks_like_lost_peer(closed)
    # a supervisor whose store went with rank 0's node (torch 2.13's TCPStore client)
    store = (
        "the supervisors' store: DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
        "closed. Did the remote server shutdown or crash?"
    )
    assert looks_like_lost_peer(store)
    assert not looks_like_lost_peer("ValueError: bad batch at call 5")
    assert not looks_like_lost_peer("TimeoutError: the dataset server timed out")  # the user's own timeout


def _worker_failures(**by_rank: BaseException) -> BaseException:
    """A worker group's failure exactly as Ray Train v2 hands it over: each rank's exception wrapped
    with its traceback text."""
    from ray.train.v2._internal.exceptions import UserExceptionWithTraceback
    from ray.train.v2.api.exceptions import WorkerGroupError

    failures = {
        int(rank[4:]): UserExceptionWithTraceback(
            e, f'Traceback (most recent call last):\n  File "x.py", line 3\n{type(e).__name__}: {e}\n'
        )
        for rank, e in by_rank.items()
    }
    return WorkerGroupError("snippet", failures)


def test_failure_report_names_the_failing_codes_own_exception():
    """One rule for the run's last line and for the failure policy's message of each rank."""
    assert failure_report(_worker_failures(rank0=ValueError("bad batch at call 5"))) == (
        "ValueError: bad batch at call 5",
        "",
    )
    # a syncpoint refusal on rank 1 surfaces as a broken collective on rank 0: the refusal says why
    refusal = ResumeRefused("no resumable state\n000000000010  incompatible")
    reason, details = failure_report(_worker_failures(rank0=RuntimeError("gloo: connection closed"), rank1=refusal))
    assert (reason, details) == ("no resumable state", "000000000010  incompatible")
    # the policy's message of one rank's failure is that rank's own exception
    (wrapped,) = _worker_failures(rank2=KeyError("x")).worker_failures.values()
    assert failure_report(wrapped)[0] == "KeyError: 'x'"
    # the controller's failure: the exception it wraps
    from ray.train.v2.api.exceptions import ControllerError

    assert failure_report(ControllerError(OSError("disk full")))[0] == "OSError: disk full"
    assert failure_report(RuntimeError("plain"))[0] == "RuntimeError: plain"


def test_ray_internals_used_by_the_failure_policy_still_exist():
    """If this fails after a Ray upgrade, orchestrator/failure_policy.py must be revisited."""
    from ray.train.v2._internal.execution.failure_handling import default
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api import data_parallel_trainer

    import syncpoint.orchestrator.failure_policy as fp

    assert callable(data_parallel_trainer.create_failure_policy)
    assert "create_failure_policy(self.run_config.failure_config)" in inspect.getsource(data_parallel_trainer)
    assert callable(default._is_preemption_failure)
    policy = default.DefaultFailurePolicy.__new__(default.DefaultFailurePolicy)
    default.DefaultFailurePolicy.__init__(policy, __import__("ray.train", fromlist=["FailureConfig"]).FailureConfig())
    assert hasattr(policy, "_preemption_failures") and hasattr(policy, "_log_decision")
    assert hasattr(policy, "_worker_group_failures")  # in-place recoveries are added to it
    # in-place recovery reads each worker's local preemption info (syncpoint.orchestrator.in_place)
    from ray.train.v2._internal.execution import context

    assert callable(context.get_train_context)
    assert "preemption_context.preemption_info" in inspect.getsource(
        __import__("ray.train.v2._internal.execution.train_fn_utils", fromlist=["x"])
    )
    assert {d.name for d in FailureDecision} >= {"RETRY", "RAISE"}
    with fp.installed("memory://x"):
        made = data_parallel_trainer.create_failure_policy(policy.failure_config)
        assert isinstance(made, fp.SyncpointFailurePolicy)
    assert not isinstance(data_parallel_trainer.create_failure_policy(policy.failure_config), fp.SyncpointFailurePolicy)


def _step(t: float, attempt: int, optimizer_step: int, global_micro_step: int, loss: float) -> Progress:
    return Progress(
        time=t,
        attempt=attempt,
        records=[
            ProgressRecord(
                optimizer_step=optimizer_step, global_micro_step=global_micro_step, epoch=0, loss=loss, lr=1.0, time=t
            )
        ],
    )


def test_timeline_lost_work():
    journal = Journal(
        [
            AttemptStarted(time=0, attempt=1, world_size=2, resumed_from=None, global_micro_step=0, optimizer_step=0),
            _step(1, 1, 1, 4, 2.0),
            StateCommitted(
                time=1.1,
                attempt=1,
                state="000000000004",
                global_micro_step=4,
                optimizer_step=1,
                bytes=10,
                seconds=0.1,
                blocked_seconds=0.1,
                committed_at_micro_step=4,
                reasons=["interval"],
            ),
            _step(3, 1, 2, 8, 1.5),
            FaultFired(
                time=3.5, attempt=1, global_micro_step=10, rank=1, mode="exit", fault="f", where="micro-step 10"
            ),
            Failure(
                time=4,
                classified="preemption",
                decision="RETRY",
                reason="node(s) lost: x",
                ranks=[1],
                messages=[],
                dead_nodes=["x"],
            ),
            AttemptStarted(
                time=5, attempt=2, world_size=2, resumed_from="000000000004", global_micro_step=4, optimizer_step=1
            ),
            _step(6, 2, 2, 8, 1.5),
        ]
    )
    (r,) = restarts(journal)
    assert (r.resumed_micro_step, r.previous_max_micro_step, r.lost_micro_steps) == (4, 10, 6)
    # from the state's snapshot (commit 1.1 minus its 0.1 s save) to the failure (4.0): the crash lost its
    # unflushed tail
    assert r.lost_seconds == pytest.approx(4.0 - 1.0) and r.cause == "preemption"
    text = format_timeline(journal)
    assert "lost micro-steps" in text and "000000000004" in text
    # attempt 2 is interrupted too before the next commit and attempt 3 resumes the same state: what
    # attempt 2 lost began at its own start (5.0), not at the commit (1.0) before the first restart
    journal = Journal(
        [
            *journal.events,
            Failure(
                time=7, classified="application", decision="RETRY", reason="x", ranks=[0], messages=[], dead_nodes=[]
            ),
            AttemptStarted(
                time=9, attempt=3, world_size=2, resumed_from="000000000004", global_micro_step=4, optimizer_step=1
            ),
        ]
    )
    _, second = restarts(journal)
    assert second.lost_micro_steps == 4 and 0 < second.lost_seconds <= 7.0 - 5.0


def test_a_refusal_is_not_retried_and_a_preemption_still_wins():
    """A refusal of the job itself (spec, task, selection, lost lease) is the same on every retry: the
    run fails at once with it instead of spending failure.max_failures; a lost node still comes first
    (the refusal may be a symptom of the loss, and a retry on another node can succeed)."""
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.config import FailureConfig

    from syncpoint.orchestrator.failure_policy import SyncpointFailurePolicy, _refusal
    from syncpoint.policies.contracts.errors import TaskError
    from syncpoint.policies.decisions.failures import REFUSAL

    v = classify_failure(facts(refusal="train.eval_every needs Task.eval_dataset"))
    assert (v.kind, v.reason) == (REFUSAL, "train.eval_every needs Task.eval_dataset")
    assert classify_failure(facts(refusal="x", dead_attempt_nodes=("n1",))).kind == PREEMPTION
    error = _worker_failures(
        rank0=RuntimeError("gloo: connection closed"),
        rank1=TaskError("train.eval_every is 2 optimizer_steps but no eval set"),
    )
    assert _refusal(error.worker_failures) == "train.eval_every is 2 optimizer_steps but no eval set"
    assert _refusal(_worker_failures(rank0=ValueError("user bug")).worker_failures) is None
    policy = SyncpointFailurePolicy(FailureConfig(max_failures=3), "memory://refusal-test")
    assert policy.decide(facts(refusal=_refusal(error.worker_failures)), error) == FailureDecision.RAISE
    bug = _worker_failures(rank0=ValueError("user bug"))
    assert policy.decide(facts(), bug) == FailureDecision.RETRY


def test_the_last_line_survives_a_deleted_working_directory(tmp_path, monkeypatch):
    """Under `ray job submit` the job's working directory (Ray's unpacked package) was removed while
    the job ran; the finish line's paths then fall back to absolute ones instead of a traceback."""
    from syncpoint.orchestrator.run_outcome import shown
    from syncpoint.workers.storage import RunStorage

    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    storage = RunStorage(f"file://{tmp_path}/run")
    assert shown(storage, "plot.png") == f"{tmp_path}/run/plot.png"


def test_waiting_for_room_is_bounded_by_the_placement_timeout(monkeypatch):
    """Ray Train retries a worker-group start that found no room without limit (a fixed-size job whose
    lost node never comes back would wait forever). The policy retries until the run has waited
    ``failure.placement_timeout_s`` in a row, counting the first try's own timeout, then raises; a
    worker group that starts in between ends the wait; each decision is journaled as ``placement``."""
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError
    from ray.train.v2._internal.execution.failure_handling.failure_policy import FailureDecision
    from ray.train.v2.api.config import FailureConfig
    from ray.train.v2.api.exceptions import ControllerError

    from syncpoint.orchestrator.failure_policy import SyncpointFailurePolicy, is_placement_timeout
    from syncpoint.policies.decisions.failures import PLACEMENT, placement_gave_up
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    no_room = ControllerError(WorkerGroupStartupTimeoutError(num_workers=3))
    assert is_placement_timeout(no_room) and not is_placement_timeout(_worker_failures(rank0=ValueError("x")))
    url = "memory://placement-test"
    policy = SyncpointFailurePolicy(FailureConfig(), url, placement_timeout_s=150)
    assert [policy.decide_placement(t, no_room) for t in (1000.0, 1060.0, 1090.0)] == [
        FailureDecision.RETRY,
        FailureDecision.RETRY,
        FailureDecision.RAISE,
    ]  # waited 60, 120, 150 s
    failures = [e for e in EventLog(RunStorage(url)).read_all() if e["kind"] == "failure"]
    assert [(f["classified"], f["decision"]) for f in failures] == [(PLACEMENT, "RETRY")] * 2 + [(PLACEMENT, "RAISE")]
    assert "150" in failures[-1]["reason"]
    policy = SyncpointFailurePolicy(FailureConfig(), "memory://placement-test-2", placement_timeout_s=150)
    assert policy.decide_placement(1000.0, no_room) == FailureDecision.RETRY
    policy._placement_since = None  # what make_decision does when a started group fails: the wait is over
    assert policy.decide_placement(1100.0, no_room) == FailureDecision.RETRY  # waited 60 s, not 160
    line = placement_gave_up(3, 1, False, 150)
    assert "failure.placement_timeout_s (150 s)" in line and "scaling.num_workers" in line and "\n" not in line


def test_the_wait_for_a_node_to_be_declared_dead_is_bounded_and_says_so():
    """A worker that vanished without an exception: the controller polls Ray's node table for its node's
    death, at most ``SYNCPOINT_NODE_DEATH_WAIT_S``; hitting the bound leaves a note with the failure."""
    from syncpoint.orchestrator.failure_policy import await_node_death

    calls = iter([set(), set(), {"n2"}])
    dead, note = await_node_death(["n1", "n2"], 5.0, lambda: next(calls), poll_s=0.01)
    assert dead == {"n2"} and note is None
    dead, note = await_node_death(["n1"], 0.05, lambda: {"other"}, poll_s=0.01)
    assert dead == {"other"}
    assert note is not None and "SYNCPOINT_NODE_DEATH_WAIT_S (0.05 s)" in note and "counted as a crash" in note


def test_a_held_rank_gives_up_after_its_bound_with_a_message():
    """``mode: hold`` (the drill's node-loss rehearsal) waits for the drill to take the node away, at
    most ``SYNCPOINT_FAULT_HOLD_S``, then exits as a crash and says why."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    r = subprocess.run(
        [sys.executable, "-c", "from syncpoint.workers.supervision.faults import _hold; _hold(1, 'micro-step 7')"],
        cwd=ROOT,
        env={**os.environ, "SYNCPOINT_FAULT_HOLD_S": "0.3"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 18
    assert "rank 1: held at micro-step 7 for 0.3 s (SYNCPOINT_FAULT_HOLD_S)" in r.stderr


def test_a_group_that_dies_setting_up_is_not_judged_by_the_attempt_before_it():
    """Rank 0 logs ``attempt_started`` only after DeepSpeed, selection and the state load; a worker group
    that dies before that has no nodes or notice on record. The attempt before it, already decided,
    must not lend it its lost node or its notice (a start-up crash would become a preemption, retried
    on a budget that may be unbounded)."""
    from syncpoint.policies.contracts.journal import PreemptionNotice

    def start(t: float, attempt: int, submission: str = "s1") -> AttemptStarted:
        return AttemptStarted(
            time=t,
            attempt=attempt,
            world_size=2,
            nodes=["n1", "n2"],
            submission=submission,
            resumed_from=None,
            global_micro_step=0,
            optimizer_step=0,
        )

    def failure(t: float) -> Failure:
        return Failure(
            time=t,
            classified="preemption",
            decision="RETRY",
            reason="node(s) lost: n2",
            ranks=[1],
            messages=[],
            dead_nodes=["n2"],
        )

    one = start(1, 1)
    assert Journal([one]).failing_attempt("s1") == one  # attempt 1 failed: its own nodes count
    assert Journal([one]).failing_attempt() == one
    decided = Journal(
        [
            one,
            PreemptionNotice(time=2, attempt=1, source="ray-drain", global_micro_step=3, optimizer_step=0),
            failure(3),
        ]
    )
    assert decided.failing_attempt("s1") is None  # the next group died before logging its start
    two = start(4, 2)
    assert Journal([*decided.events, two]).failing_attempt("s1") == two
    # a new submission's first group: the previous submission's attempt is not its own
    assert Journal([one]).failing_attempt("s2") is None
    assert Journal([]).failing_attempt("s1") is None


def test_a_set_up_death_waits_bounded_for_a_node_that_died_since_the_last_decision():
    from syncpoint.orchestrator.failure_policy import await_new_node_death

    known = frozenset({"n-old"})
    calls = iter([{"n-old"}, {"n-old"}, {"n-old", "n3"}])
    dead, note = await_new_node_death(known, 5.0, lambda: next(calls), poll_s=0.01)
    assert dead - known == {"n3"} and note is None
    dead, note = await_new_node_death(known, 0.05, lambda: {"n-old"}, poll_s=0.01)  # only the old loss
    assert dead == {"n-old"} and note is not None
    assert "while its group was setting up" in note and "(0.05 s): counted as a crash" in note


def test_a_heartbeat_reading_that_cannot_be_taken_says_why(capsys):
    """The controller's measured interruption point is a courtesy (the timeline falls back to the
    flushed progress), but when it is missing its log says why, in one line: which attempt, and what
    failed. An attempt with no start on record (a group that died setting up) is not read at all."""
    import uuid

    from syncpoint.orchestrator.failure_policy import read_journal, record_interruption
    from syncpoint.workers.observation.events import EventLog
    from syncpoint.workers.storage import RunStorage

    class UnreachableBoard:  # the shape of the actor handle: board.read.remote(attempt)
        class read:  # mirrors the actor method's name
            @staticmethod
            def remote(attempt: int) -> None:
                raise RuntimeError("the board's node is gone")

    url = f"memory://beats-{uuid.uuid4().hex}/run"
    log = EventLog(RunStorage(url), source="worker")
    log.emit(
        AttemptStarted(
            attempt=1,
            world_size=2,
            nodes=["n1", "n2"],
            submission="s1",
            resumed_from=None,
            global_micro_step=0,
            optimizer_step=0,
        )
    )
    line = record_interruption(url, UnreachableBoard(), 123.0, read_journal(url), "s1")
    assert line is not None
    assert "attempt 1: the heartbeat reading failed (RuntimeError: the board's node is gone)" in line
    assert line in capsys.readouterr().err and "\n" not in line
    unread = record_interruption(url, UnreachableBoard(), 123.0, None, "s1")  # the log could not be read
    assert unread is not None and "the run's event log could not be read" in unread
    # no board (outside Ray): nothing to say
    assert record_interruption(url, None, 123.0, read_journal(url), "s1") is None
    log.emit(Failure(classified="preemption", decision="RETRY", reason="x", ranks=[1], messages=[], dead_nodes=[]))
    # decided already: not read again
    assert record_interruption(url, UnreachableBoard(), 124.0, read_journal(url), "s1") is None


def test_the_wait_for_a_node_death_is_skipped_when_a_notice_already_decides():
    """A rank that got a preemption notice saves, then its worker vanishes: the notice already makes the
    failure a preemption, so waiting out Ray's health check (up to SYNCPOINT_NODE_DEATH_WAIT_S, 30 s)
    would only delay the restart. The 100-interruption storm spent 30 s on each such restart."""
    from syncpoint.policies.decisions.failures import should_await_node_death

    nodes = {"n1", "n2"}
    assert should_await_node_death(True, nodes, "head", set(), notice_logged=False)
    assert not should_await_node_death(True, nodes, "head", set(), notice_logged=True)
    assert not should_await_node_death(False, nodes, "head", set(), notice_logged=False)  # an exception: a bug
    assert not should_await_node_death(True, nodes, "head", {"n2"}, notice_logged=False)  # already dead
    assert not should_await_node_death(True, {"head"}, "head", set(), notice_logged=False)  # only the driver's node
