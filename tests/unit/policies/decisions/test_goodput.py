"""Goodput and measured lost work, over hand-built journals (``syncpoint.policies.decisions.goodput``,
``Journal.reached``,
``syncpoint.orchestrator.timeline``), and the heartbeat's sending rule. The real path (Ray actor, a node
lost after the last progress flush) is in ``tests/ray/test_preemption.py``."""

from __future__ import annotations

import pytest

from syncpoint.orchestrator.timeline import format_timeline, restarts
from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Evaluated,
    Failure,
    Finished,
    Interrupted,
    Journal,
    Progress,
    ProgressRecord,
    RankReached,
    ResumeDecision,
    StateCommitted,
    Submitted,
)
from syncpoint.policies.decisions.goodput import goodput
from syncpoint.workers.supervision import heartbeat
from syncpoint.workers.supervision.heartbeat import BeatBoard, Heartbeat


def _attempt(t: float, n: int, step: int = 0, launched: float | None = None) -> AttemptStarted:
    return AttemptStarted(
        time=t,
        attempt=n,
        world_size=2,
        nodes=["a", "b"],
        submission="s",
        resumed_from=f"{step:012d}" if step else None,
        global_micro_step=step,
        optimizer_step=step // 4,
        launched_at=launched,
    )


def _progress(t: float, n: int, *micro_steps: int) -> Progress:
    return Progress(
        time=t,
        attempt=n,
        records=[
            ProgressRecord(optimizer_step=g // 4, global_micro_step=g, epoch=0, loss=1.0, lr=0.1, time=t)
            for g in micro_steps
        ],
    )


def _commit(t: float, n: int, step: int, seconds: float = 0.5, blocked: float = 0.5) -> StateCommitted:
    return StateCommitted(
        time=t,
        attempt=n,
        state=f"{step:012d}",
        global_micro_step=step,
        optimizer_step=step // 4,
        bytes=1,
        seconds=seconds,
        blocked_seconds=blocked,
        committed_at_micro_step=step,
        reasons=["interval"],
    )


def _failure(t: float) -> Failure:
    return Failure(
        time=t, classified="preemption", reason="node lost", decision="retry", ranks=[1], messages=[], dead_nodes=["b"]
    )


def _sums(g) -> float:
    parts = g.productive_s + g.evaluation_s + g.startup_s + g.save_blocked_s + g.recomputed_s + g.restart_gap_s
    assert parts + g.uncommitted_s == pytest.approx(g.productive_s + g.badput_s + g.uncommitted_s)
    return parts + g.uncommitted_s


def _node_lost(with_heartbeat: bool) -> Journal:
    """The issue's case: progress flushed at the commit of state 32 (snapshot 5.5 s), the run trains
    on to micro-step 40 (7.6 s), the node goes, the controller notices at 9.0 s, the replacement
    attempt launches at 11 s, starts at 14 s from state 32 and finishes at 20.2 s."""
    events = [
        Submitted(time=0.0, name="job", address="embedded"),
        _attempt(2.0, 1, launched=0.5),
        _progress(6.0, 1, 28, 32),
        _commit(6.0, 1, 32),
        _failure(9.1),
        _attempt(14.0, 2, step=32, launched=11.0),
        _progress(20.0, 2, 36, 64),
        _commit(20.0, 2, 64),
        Finished(time=20.2, attempt=2, state=f"{64:012d}", global_micro_step=64, optimizer_step=16),
    ]
    if with_heartbeat:
        events.append(
            Interrupted(
                time=9.05,
                attempt=1,
                global_micro_step=40,
                reached_at=7.6,
                detected_at=9.0,
                ranks=[
                    RankReached(rank=0, global_micro_step=40, time=7.6),
                    RankReached(rank=1, global_micro_step=38, time=7.5),
                ],
            )
        )
    return Journal(events)


def test_a_run_without_failures_has_no_restart_loss_and_its_parts_add_up():
    j = Journal(
        [
            Submitted(time=0.0, name="job", address="embedded"),
            _attempt(5.0, 1, launched=1.0),
            _progress(8.0, 1, 4, 8),
            _commit(8.0, 1, 8, seconds=0.5, blocked=0.2),
            _progress(10.0, 1, 12, 16),
            _commit(10.0, 1, 16, seconds=0.3, blocked=0.3),
            Finished(time=10.5, attempt=1, state=f"{16:012d}", global_micro_step=16, optimizer_step=4),
        ]
    )
    g = goodput(j)
    assert g.finished and g.restarts == ()
    assert g.total_s == pytest.approx(10.5) and _sums(g) == pytest.approx(g.total_s)
    assert g.restart_gap_s == 0 and g.recomputed_s == 0 and g.uncommitted_s == 0
    assert g.startup_s == pytest.approx(5.0)  # the submission to the attempt's start
    assert g.save_blocked_s == pytest.approx(0.5)
    assert g.productive_s == pytest.approx(5.0) and g.ratio == pytest.approx(5.0 / 10.5)


def test_the_lost_work_of_a_node_lost_after_the_last_flush_is_measured_from_the_heartbeat():
    j = _node_lost(with_heartbeat=True)
    (r,) = restarts(j)
    assert r.measured and r.previous_max_micro_step == 40
    assert r.lost_micro_steps == 8  # 40 reached - 32 resumed, though the last flushed progress said 32
    assert r.lost_seconds == pytest.approx(7.6 - 5.5)  # the last heartbeat - the snapshot of state 32

    g = goodput(j)
    assert g.total_s == pytest.approx(20.2) and _sums(g) == pytest.approx(g.total_s)
    (c,) = g.restarts
    assert c.measured and c.lost_micro_steps == 8
    assert c.recomputed_s == pytest.approx(7.6 - 5.5 - 0.5)  # less the save of state 32 (blocked, counted there)
    assert c.restart_gap_s == pytest.approx(11.0 - 7.6)  # last seen computing to the new workers' launch
    assert c.startup_s == pytest.approx(14.0 - 11.0)
    assert g.startup_s == pytest.approx(2.0 + 3.0) and g.save_blocked_s == pytest.approx(1.0)
    assert g.productive_s == pytest.approx((5.5 - 2.0) + (20.2 - 14.0 - 0.5))

    text = format_timeline(j)
    assert "interrupted" in text and "stopped at micro-step 40" in text and "measured" in text
    assert f"goodput {100 * g.ratio:.1f}%" in text and "after attempt 1: 8 micro-steps recomputed" in text


def test_without_a_heartbeat_the_old_inference_stays_and_the_parts_still_add_up():
    j = _node_lost(with_heartbeat=False)  # an older log, or a run outside Ray
    (r,) = restarts(j)
    assert not r.measured and r.lost_micro_steps == 0 and r.lost_seconds == 0.0
    g = goodput(j)
    assert _sums(g) == pytest.approx(g.total_s) and not g.restarts[0].measured
    assert g.recomputed_s == pytest.approx(9.1 - 5.5 - 0.5)  # bounded by the failure's time, as the timeline


def test_a_log_without_launch_times_counts_the_whole_wait_as_a_restart_gap():
    j = Journal(
        [
            _attempt(1.0, 1),
            _progress(3.0, 1, 4),
            _commit(3.0, 1, 4, seconds=0.0, blocked=0.0),
            _failure(3.5),
            _attempt(6.0, 2, step=4),
            Finished(time=8.0, attempt=2, state=f"{4:012d}", global_micro_step=4, optimizer_step=1),
        ]
    )
    g = goodput(j)
    assert g.startup_s == 0.0 and g.restart_gap_s == pytest.approx(6.0 - 3.5)
    assert g.productive_s == pytest.approx(2.0 + 2.0) and _sums(g) == pytest.approx(g.total_s)


def test_a_run_still_going_counts_its_tail_as_uncommitted():
    j = Journal(
        [_attempt(1.0, 1), _progress(5.0, 1, 4), _commit(5.0, 1, 4, seconds=1.0, blocked=0.2), _progress(6.0, 1, 8)]
    )
    g = goodput(j)
    assert not g.finished and g.total_s == pytest.approx(5.0)
    assert g.productive_s == pytest.approx(3.0) and g.uncommitted_s == pytest.approx(6.0 - 4.0 - 0.2)
    assert _sums(g) == pytest.approx(g.total_s)
    assert "run not finished" in format_timeline(j)


def test_a_finished_run_submitted_again_is_a_new_run():
    first = [
        Submitted(time=0.0, name="job", address="embedded"),
        _attempt(1.0, 1),
        _progress(2.0, 1, 4),
        _commit(2.0, 1, 4, seconds=0.0, blocked=0.0),
        Finished(time=3.0, attempt=1, state=f"{4:012d}", global_micro_step=4, optimizer_step=1),
    ]
    again = [
        Submitted(time=100.0, name="job", address="embedded"),
        _attempt(104.0, 2, step=4),
        Finished(time=104.5, attempt=2, state=f"{4:012d}", global_micro_step=4, optimizer_step=1),
    ]
    g = goodput(Journal(first + again))
    assert g.total_s == pytest.approx(4.5) and g.startup_s == pytest.approx(4.0)
    assert goodput(Journal([])) is None


def test_a_submission_after_a_failed_one_counts_only_its_own_attempts():
    """A run that failed for good, submitted again (after a fix, or with ``--fresh``): its goodput
    is the new submission's (no restarts, its wall time); the timeline still lists the old attempts."""
    failed = [
        Submitted(time=0.0, name="job", address="embedded"),
        _attempt(1.0, 1),
        _failure(2.0),
        _attempt(3.0, 2),
        _failure(4.0),
    ]
    again = [
        Submitted(time=100.0, name="job", address="embedded"),
        _attempt(102.0, 3),
        _progress(104.0, 3, 4),
        _commit(104.0, 3, 4, seconds=0.0, blocked=0.0),
        Finished(time=104.5, attempt=3, state=f"{4:012d}", global_micro_step=4, optimizer_step=1),
    ]
    j = Journal(failed + again)
    g = goodput(j)
    assert g.finished and g.restarts == () and g.restart_gap_s == 0
    assert g.total_s == pytest.approx(4.5) and g.startup_s == pytest.approx(2.0)
    assert len(restarts(j)) == 2  # the history is still the log's
    assert "attempt 1 on 2 worker(s)" in format_timeline(j)


def _interrupted_twice() -> Journal:
    """Two interruptions, every cause present: attempt 1 (launched 1 s, started 5 s, its start-up
    measured by phase) evaluates for 0.5 s, commits micro-step 8 (snapshot 8.5 s) and fails at
    10.5 s, last flushed 10 s; attempt 2 (launched 12 s, started 14 s from 8) commits 16 (snapshot
    16.5 s), is last seen computing at 18 s (its heartbeat) and fails; attempt 3 (launched 20 s, an
    older log: no phases) starts at 22 s from 16, commits 24 and finishes at 25.5 s."""
    setup_1 = [
        ("imports", 1.0),
        ("DeepSpeed engine (ops loaded)", 1.5),
        ("selection and state load", 0.5),
        ("metrics, data source", 0.5),
    ]
    setup_2 = [("selection and state load", 1.0), ("metrics, data source", 0.5)]
    return Journal(
        [
            Submitted(time=0.0, name="job", address="embedded"),
            _attempt(5.0, 1, launched=1.0).model_copy(update={"setup": setup_1}),
            _progress(8.0, 1, 4, 8),
            Evaluated(time=8.5, attempt=1, optimizer_step=2, global_micro_step=8, metrics={"loss": 1.0}, seconds=0.5),
            _commit(9.0, 1, 8),
            _progress(10.0, 1, 12),
            _failure(10.5),
            _attempt(14.0, 2, step=8, launched=12.0).model_copy(update={"setup": setup_2}),
            _progress(16.0, 2, 12, 16),
            _commit(17.0, 2, 16),
            Interrupted(
                time=18.4,
                attempt=2,
                global_micro_step=18,
                reached_at=18.0,
                detected_at=18.3,
                ranks=[RankReached(rank=0, global_micro_step=18, time=18.0)],
            ),
            _failure(18.5),
            _attempt(22.0, 3, step=16, launched=20.0),
            _progress(24.0, 3, 20, 24),
            _commit(25.0, 3, 24),
            Finished(time=25.5, attempt=3, state=f"{24:012d}", global_micro_step=24, optimizer_step=6),
        ]
    )


def test_two_interruptions_split_the_wall_time_by_cause():
    """Google's ml-goodput-measurement taxonomy over a journal with two interruptions: each cause's
    seconds computed by hand (see ``_interrupted_twice``), and the parts add up to the wall time."""
    g = goodput(_interrupted_twice())
    assert g.finished and g.total_s == pytest.approx(25.5) and g.uncommitted_s == 0
    assert g.productive_s == pytest.approx(3.0 + 2.5 + 3.0)  # kept training, less saves and the evaluation
    expected = {
        "initialization": 2.5 + 0.5 + 2.0,  # unmeasured start-up (Ray, launch, imports) and older logs' whole
        "compilation": 1.5,  # DeepSpeed's engine
        "data_loading": 0.5 + 0.5,
        "checkpoint_save": 0.5 * 3,
        "checkpoint_restore": 0.5 + 1.0,
        "evaluation": 0.5,
        "wasted_progress": (10.5 - 8.5 - 0.5) + (18.0 - 16.5 - 0.5),  # after the resumed state's snapshot
        "recovery": (12.0 - 10.5) + (20.0 - 18.0),  # failure (or last heartbeat) to the next launch
        "other": 0.0,
    }
    assert g.badput == pytest.approx(expected)
    assert list(g.badput) == list(expected)  # every cause, in the documented order
    assert g.productive_s + g.badput_s == pytest.approx(g.total_s) and _sums(g) == pytest.approx(g.total_s)
    assert [c.lost_micro_steps for c in g.restarts] == [4, 2]
    assert sum(c.recomputed_s for c in g.restarts) == pytest.approx(expected["wasted_progress"])
    text = format_timeline(_interrupted_twice())
    for label, seconds in g.losses.items():
        if label != "uncommitted":
            assert f"  {label:<28} {seconds:9.2f} s" in text


def test_a_run_that_failed_for_good_wastes_its_tail_and_a_restart_under_way_is_recovery():
    base = [Submitted(time=0.0, name="job", address="embedded"), _attempt(1.0, 1), _progress(3.0, 1, 4)]
    base += [_commit(3.0, 1, 4, seconds=0.0, blocked=0.0), _progress(4.0, 1, 8)]
    given_up = goodput(Journal([*base, _failure(5.0).model_copy(update={"decision": "RAISE"}), _progress(9.0, 1)]))
    assert given_up.badput["wasted_progress"] == pytest.approx(2.0) and given_up.uncommitted_s == 0
    assert given_up.badput["other"] == pytest.approx(4.0)  # the failure to the log's end: nobody is retrying
    retrying = goodput(Journal([*base, _failure(5.0).model_copy(update={"decision": "RETRY"}), _progress(9.0, 1)]))
    assert retrying.badput["recovery"] == pytest.approx(4.0) and retrying.badput["other"] == 0


def test_a_run_without_a_driver_counts_its_first_start_up_from_rank_0s_launch():
    """No ``submitted`` (ranks launched by hand, or in-process): the run began at rank 0's launch,
    before its first event, so its first start-up is split by phase too, not lost from the wall time."""
    setup = [("imports", 2.0), ("DeepSpeed engine (ops loaded)", 1.0), ("selection and state load", 0.5)]
    first = _attempt(4.0, 1, launched=0.0).model_copy(update={"setup": setup})
    decision = ResumeDecision(time=3.6, attempt=1, chosen=None, reason="fresh", total_candidates=0, candidates=[])
    j = Journal([decision, first, _progress(6.0, 1, 4), _commit(6.0, 1, 4, seconds=0.0, blocked=0.0)])
    j.events.append(Finished(time=6.0, attempt=1, state=f"{4:012d}", global_micro_step=4, optimizer_step=1))
    g = goodput(j)
    assert g.total_s == pytest.approx(6.0) and g.productive_s == pytest.approx(2.0)
    assert g.badput["initialization"] == pytest.approx(2.5) and g.badput["compilation"] == pytest.approx(1.0)
    assert g.badput["checkpoint_restore"] == pytest.approx(0.5) and g.badput_s == pytest.approx(4.0)


def test_the_heartbeat_beats_at_every_boundary_and_at_most_every_interval_between():
    board = BeatBoard()

    class Handle:  # the shape of a Ray actor handle's method (`board.beat.remote(...)`), run in place
        class beat:
            remote = staticmethod(board.beat)

    hb = Heartbeat(Handle(), rank=1, attempt=3)
    hb.at_micro_step(1, boundary=False)  # the first one always goes
    hb.at_micro_step(2, boundary=False)  # too soon after it
    assert board.read(3) == [{"rank": 1, "global_micro_step": 1, "time": pytest.approx(board.beats[3][1][1])}]
    hb.at_micro_step(4, boundary=True)  # a boundary always goes
    assert board.read(3)[0]["global_micro_step"] == 4
    hb.last -= heartbeat.BEAT_EVERY_S
    hb.at_micro_step(5, boundary=False)
    assert board.read(3)[0]["global_micro_step"] == 5 and board.read(2) == []
    Heartbeat(None, rank=0, attempt=1).at_micro_step(1, boundary=True)  # outside Ray: nothing to send to
