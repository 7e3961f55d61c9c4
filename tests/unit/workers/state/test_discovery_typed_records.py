"""The typed boundaries: discovery hands on parsed records, the resume broadcast is one typed
object, and the string kinds are enums that read exactly as the strings they replaced."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from syncpoint.orchestrator.interruptions import DRILL_KINDS, NODE_KINDS, InterruptionKind
from syncpoint.policies.contracts.journal import Failure, UnknownEvent, read_event
from syncpoint.policies.contracts.state_format import Manifest, TrainState
from syncpoint.policies.decisions.candidates import Verdict, classify
from syncpoint.policies.decisions.failures import APPLICATION, PREEMPTION, FailureKind, FailureVerdict
from syncpoint.workers.state.discovery import discover, read_candidate
from syncpoint.workers.state.reader import manifest_files
from syncpoint.workers.state.resume_choice import ResumeChoice
from syncpoint.workers.storage import RunStorage
from tests.meta import candidate_for, commit_candidate, live

EXP = live("j", 2, 4, 4, 10, 2, "f", 3, precision="fp32")


@pytest.fixture
def store(tmp_path):
    s = RunStorage(str(tmp_path / "run"))
    commit_candidate(s, candidate_for(8, EXP))
    return s


def test_discovery_yields_the_typed_records(store):
    c = read_candidate(store, "000000000008")
    assert isinstance(c.state, TrainState) and isinstance(c.record, Manifest)
    assert (c.state.global_micro_step, c.record.files["trainer.json"].size) == (8, c.listing["trainer.json"])
    assert c.manifest is not None and c.manifest["state"] == c.name  # the object as read stays for the signature
    [found] = discover(store, EXP)
    assert found.verdict is Verdict.RESUMABLE and found.state == c.state


def test_a_record_that_does_not_parse_carries_its_problem():
    c = candidate_for(8, EXP)
    del c.trainer["seed"]
    c.parse()
    assert c.state is None and c.state_problem == "trainer.json field seed: missing"
    assert classify(c, EXP).reason == c.state_problem
    c = candidate_for(8, EXP, schema_version=99)
    assert classify(c, EXP).verdict is Verdict.INCOMPATIBLE and c.reason == c.parse().schema_newer


def test_the_resume_choice_round_trips_through_the_broadcast(store):
    c = classify(read_candidate(store, "000000000008"), EXP)
    choice = ResumeChoice.of(c.name, c, "newest resumable state")
    back = pickle.loads(pickle.dumps(choice))  # what dist.broadcast_object_list does between ranks
    assert back == choice and isinstance(back.train_state, TrainState) and isinstance(back.record, Manifest)
    assert not back.legacy_signature and back.error is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.state = "000000000004"  # type: ignore[misc]
    fetched = back.candidate()
    assert fetched.name == c.name and fetched.state == c.state and manifest_files(fetched) == c.record.files
    assert ResumeChoice.of(None, None, "no states yet: fresh start") == ResumeChoice(
        reason="no states yet: fresh start"
    )


def test_failure_kinds_are_written_and_read_as_their_text():
    assert [k.value for k in FailureKind] == ["preemption", "application", "refusal", "placement"]
    assert PREEMPTION == "preemption" and APPLICATION is FailureKind.APPLICATION
    assert json.dumps({"classified": FailureVerdict(PREEMPTION, "r").kind}) == '{"classified": "preemption"}'
    event = Failure(
        time=1.0,
        source="controller",
        classified=APPLICATION,
        reason="r",
        decision="RETRY",
        ranks=[],
        messages=[],
        dead_nodes=[],
    )
    assert '"classified":"application"' in event.model_dump_json() and event.classified is FailureKind.APPLICATION
    read = read_event(json.loads(event.model_dump_json()))
    assert isinstance(read, Failure) and read.classified is FailureKind.APPLICATION
    assert isinstance(read_event({**json.loads(event.model_dump_json()), "classified": "cosmic-ray"}), UnknownEvent)


def test_interruption_kinds_are_their_text():
    assert [k.value for k in InterruptionKind] == [
        "crash",
        "sigterm",
        "save-crash",
        "node",
        "node-gone",
        "two-nodes",
        "crash+node",
    ]
    assert f"{InterruptionKind.CRASH:<10}|" == "crash     |" and str(InterruptionKind.CRASH_THEN_NODE) == "crash+node"
    assert ", ".join(DRILL_KINDS) == "crash, sigterm, node" and "sigterm" in DRILL_KINDS
    assert InterruptionKind.SIGTERM not in NODE_KINDS and "two-nodes" in NODE_KINDS
