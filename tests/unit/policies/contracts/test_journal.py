"""The typed event log: what ``emit`` refuses, what old and foreign files read back as, and each
question ``Journal`` answers (attempts, a notice in an attempt, steps, a restart of a submission)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from syncpoint.policies.contracts.journal import (
    AttemptStarted,
    Failure,
    FaultFired,
    Finished,
    Journal,
    PreemptionNotice,
    Progress,
    ProgressRecord,
    StateCommitted,
)
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage


@pytest.fixture
def log(tmp_path) -> EventLog:
    return EventLog(RunStorage(f"file://{tmp_path}/run"))


def _stored(log: EventLog) -> list[dict]:
    return log.read_all()


# ---------------------------------------------------------------- writing


def test_emit_by_kind_and_by_model_write_the_same_record(log):
    fields = dict(
        attempt=1,
        state="000000000004",
        global_micro_step=4,
        optimizer_step=1,
        bytes=10,
        seconds=0.5,
        blocked_seconds=0.1,
        contended_seconds=0.0,
        committed_at_micro_step=4,
        reasons=["interval"],
    )
    by_kind = log.emit("state_committed", **fields)
    by_model = log.emit(StateCommitted(**fields))
    assert isinstance(by_kind, StateCommitted) and isinstance(by_model, StateCommitted)
    first, second = _stored(log)
    assert first.pop("time") <= second.pop("time")
    assert first == second == {"kind": "state_committed", "source": "worker", **fields}


def test_emit_stamps_time_and_source_unless_the_event_names_its_own(log):
    log.emit(PreemptionNotice(attempt=1, global_micro_step=8, optimizer_step=2, source="sigterm"))
    log.emit(
        "preemption_notice",
        attempt=1,
        global_micro_step=9,
        optimizer_step=2,
        source="ray-drain",
        deadline_ms=5000,
        nodes=["n1"],
        ranks=[1],
    )
    EventLog(log.storage, source="driver").emit("submitted", name="job", address="embedded")
    sigterm, drain, submitted = _stored(log)
    assert sigterm["source"] == "sigterm" and "deadline_ms" not in sigterm  # nothing defaulted is written
    assert (drain["source"], drain["deadline_ms"], drain["nodes"]) == ("ray-drain", 5000, ["n1"])
    assert submitted["source"] == "driver" and submitted["time"] > 0


@pytest.mark.parametrize(
    "kind,fields,says",
    [
        ("no_such_kind", {}, "does not match any of the expected tags"),
        (
            "finished",
            dict(attempt=1, state=None, global_micro_step=8, optimizer_step=2, stat="x"),
            "unknown field(s) stat",
        ),
        ("finished", dict(state=None, global_micro_step=8, optimizer_step=2), "missing field(s) attempt"),
        ("finished", dict(attempt=1, state=None, global_micro_step="eight", optimizer_step=2), "global_micro_step"),
        (
            "progress",
            dict(
                attempt=1,
                records=[
                    {
                        "optimizer_step": 1,
                        "global_micro_step": 4,
                        "epoch": 0,
                        "loss": 1.0,
                        "lr": 0.1,
                        "time": 1.0,
                        "los": 2.0,
                    }
                ],
            ),
            "unknown field(s) los",
        ),
    ],
)
def test_a_wrong_event_fails_to_emit_and_writes_nothing(log, kind, fields, says):
    with pytest.raises(ValidationError, match=says.replace("(", r"\(").replace(")", r"\)")):
        log.emit(kind, **fields)
    assert _stored(log) == []


def test_emit_of_a_model_takes_no_extra_fields(log):
    with pytest.raises(TypeError):
        log.emit(Finished(attempt=1, state=None, global_micro_step=0, optimizer_step=0), attempt=2)


def test_progress_records_round_trip_with_their_optional_samples(log):
    records = [
        {"optimizer_step": 1, "global_micro_step": 4, "epoch": 0, "loss": float("nan"), "lr": 0.1, "time": 1.0},
        {
            "optimizer_step": 2,
            "global_micro_step": 8,
            "epoch": 0,
            "loss": 1.0,
            "lr": 0.1,
            "time": 2.0,
            "samples": [3, 1],
        },
    ]
    log.emit("progress", attempt=1, records=records)
    (stored,) = _stored(log)
    assert "samples" not in stored["records"][0] and stored["records"][1]["samples"] == [3, 1]
    steps = log.journal().steps()
    assert steps[2].samples == [3, 1] and steps[1].samples is None and steps[2].attempt == 1


# ---------------------------------------------------------------- reading old and foreign files


def test_old_logs_read_back_with_the_fields_they_lack_defaulted(log):
    """Records as earlier versions wrote them: no attempt on progress, commits and finishes; one
    `node` rather than `nodes`; no submission; progress records without a time."""
    old = [
        {
            "kind": "attempt_started",
            "time": 1.0,
            "source": "worker",
            "attempt": 1,
            "world_size": 1,
            "node": "n1",
            "resumed_from": None,
            "global_micro_step": 0,
            "optimizer_step": 0,
        },
        {
            "kind": "progress",
            "time": 2.0,
            "source": "worker",
            "records": [{"optimizer_step": 1, "global_micro_step": 4, "epoch": 0, "loss": 1.0, "lr": 0.1}],
        },
        {
            "kind": "state_committed",
            "time": 3.0,
            "source": "worker",
            "state": "000000000004",
            "global_micro_step": 4,
            "optimizer_step": 1,
            "bytes": 10,
            "seconds": 0.1,
            "blocked_seconds": 0.1,
            "reasons": ["final"],
        },
        {
            "kind": "finished",
            "time": 4.0,
            "source": "worker",
            "state": "000000000004",
            "global_micro_step": 4,
            "optimizer_step": 1,
        },
    ]
    for i, record in enumerate(old):
        log.storage.write_json(record, "events", f"{i:020d}-{record['kind']}-000000.json")
    journal = log.journal()
    assert journal.unknown == []
    (attempt,) = journal.attempts
    assert (attempt.nodes, attempt.submission) == ([], "")
    assert journal.steps()[1].time == 0.0 and journal.steps()[1].attempt is None
    assert journal.commit_of("000000000004").committed_at_micro_step is None
    assert journal.last_finish.attempt is None and journal.next_attempt() == 2


def test_unknown_kinds_and_damaged_records_are_kept_as_unknown_events(log):
    """A reader never crashes on them: the queries skip them, the timeline shows them."""
    from syncpoint.orchestrator.timeline import format_timeline

    log.emit(
        "attempt_started",
        attempt=1,
        world_size=1,
        nodes=["n"],
        submission="s",
        resumed_from=None,
        global_micro_step=0,
        optimizer_step=0,
    )
    storage = log.storage
    storage.write_json({"kind": "checkpoint_uploaded", "time": 9e9, "source": "newer"}, "events", "9-a.json")
    storage.write_json({"kind": "finished", "time": 9e9, "source": "other"}, "events", "9-b.json")
    storage.write_json(["not", "an", "event"], "events", "9-c.json")
    storage.write_bytes(b"{torn", "events", "9-d.json")
    journal = log.journal()
    assert [(u.kind, u.problem) for u in journal.unknown] == [
        ("checkpoint_uploaded", "a kind this version does not know"),
        ("finished", "state: Field required"),
    ]
    assert journal.finishes == [] and len(journal.attempts) == 1 and journal.next_attempt() == 2
    assert "not read: a kind this version does not know" in format_timeline(journal)
    assert journal.unknown[0].record == {"kind": "checkpoint_uploaded", "time": 9e9, "source": "newer"}


def test_stored_json_is_what_read_all_returns(log):
    log.emit("submitted", name="job", address="embedded")
    (name,) = log.storage.list_files("events")
    assert "-submitted-" in name
    assert json.loads(log.storage.read_bytes("events", name, limit=1 << 30)) == _stored(log)[0]


# ---------------------------------------------------------------- the queries


def _attempt(t: float, attempt: int, submission: str, step: int = 0, world_size: int = 2) -> AttemptStarted:
    return AttemptStarted(
        time=t,
        attempt=attempt,
        world_size=world_size,
        nodes=["a", "b"][:world_size],
        submission=submission,
        resumed_from=None,
        global_micro_step=step,
        optimizer_step=step // 4,
    )


def _progress(t: float, attempt: int, *steps: tuple[int, int, float]) -> Progress:
    return Progress(
        time=t,
        attempt=attempt,
        records=[
            ProgressRecord(optimizer_step=o, global_micro_step=g, epoch=0, loss=loss, lr=0.1, time=t)
            for o, g, loss in steps
        ],
    )


def _commit(t: float, attempt: int, step: int) -> StateCommitted:
    return StateCommitted(
        time=t,
        attempt=attempt,
        state=f"{step:012d}",
        global_micro_step=step,
        optimizer_step=step // 4,
        bytes=1,
        seconds=0.5,
        blocked_seconds=0.1,
        committed_at_micro_step=step,
        reasons=["interval"],
    )


@pytest.fixture
def journal() -> Journal:
    """Submission s1: attempt 1 commits 4, is noticed, fails; attempt 2 (a Ray restart) recomputes step 2
    and commits 8 twice (the second time on another trajectory). Submission s2: attempt 3 on one worker."""
    return Journal(
        [  # given out of order: the journal orders by time
            _progress(3.0, 1, (1, 4, 2.0), (2, 8, 1.9)),
            _attempt(1.0, 1, "s1"),
            _commit(3.5, 1, 4),
            PreemptionNotice(time=4.0, attempt=1, global_micro_step=8, optimizer_step=2, source="sigterm"),
            PreemptionNotice(time=4.5, attempt=1, global_micro_step=9, optimizer_step=2, source="sigterm"),
            FaultFired(
                time=4.8, attempt=1, fault="f", mode="exit", where="micro-step 10", rank=1, global_micro_step=10
            ),
            Failure(
                time=5.0,
                classified="preemption",
                reason="notice",
                decision="retry",
                ranks=[1],
                messages=[],
                dead_nodes=[],
            ),
            _attempt(6.0, 2, "s1", step=4),
            _progress(7.0, 2, (2, 8, 1.8), (3, 12, 1.7)),
            _commit(7.5, 2, 8),
            _commit(8.0, 2, 8),
            Finished(time=9.0, attempt=2, state="000000000008", global_micro_step=12, optimizer_step=3),
            _attempt(10.0, 3, "s2", step=12, world_size=1),
        ]
    )


def test_attempts(journal):
    assert [a.attempt for a in journal.attempts] == [1, 2, 3]
    assert journal.last_attempt.attempt == 3 and journal.next_attempt() == 4
    assert journal.world_sizes == [1, 2]
    assert Journal([]).last_attempt is None and Journal([]).next_attempt() == 1


def test_restart_of_a_submission(journal):
    assert journal.is_restart_of("s1") and journal.is_restart_of("s2")
    assert not journal.is_restart_of("s3")
    assert not journal.is_restart_of("")  # outside Ray: no submission, never a restart


def test_notice_in_an_attempt(journal):
    assert journal.notice_in(1).global_micro_step == 8  # the first one
    assert journal.notice_in(2) is None and journal.notice_in(None) is None


def test_steps_progress_and_faults(journal):
    steps = journal.steps()
    assert sorted(steps) == [1, 2, 3]
    assert (steps[2].loss, steps[2].attempt) == (1.8, 2)  # the later attempt's record of a recomputed step wins
    assert [r.optimizer_step for r in journal.progress_of(1)] == [1, 2]
    assert journal.furthest_micro_step() == 12 and Journal([]).furthest_micro_step() == 0
    assert [f.global_micro_step for f in journal.faults_in(1)] == [10] and journal.faults_in(2) == []


def test_commits_failures_and_finishes(journal):
    assert [c.time for c in journal.commits] == [3.5, 7.5, 8.0]
    assert journal.commit_of("000000000008").time == 8.0  # the latest commit of that name
    assert journal.commit_of(None) is None and journal.commit_of("000000000099") is None
    assert journal.failure_between(1.0, 6.0).reason == "notice"
    assert journal.failure_between(6.0, 10.0) is None
    assert journal.last_finish.state == "000000000008" and len(journal.finishes) == 1
    assert [e.time for e in journal.until(4.0).events] == [1.0, 3.0, 3.5, 4.0]
    assert journal.of_kind(PreemptionNotice)[1].global_micro_step == 9
