"""Retention deletes only what syncpoint wrote: state-named directories, never through a link.

A run's ``states/`` may hold other people's files (notes, a README) and, on a local disk, symbolic
links someone made; deleting "torn" debris must never touch them, and deleting through a link
would delete its target, outside the run.
"""

from __future__ import annotations

import json
import os

import pytest

from syncpoint.policies.decisions.candidates import Candidate, Verdict
from syncpoint.policies.decisions.retention import is_state_name, plan_retention
from syncpoint.workers.state.writer import delete_state, state_name
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, lm_spec, run, with_overrides


def _cand(name: str, verdict: Verdict, symlink: bool = False) -> Candidate:
    return Candidate(name=name, verdict=verdict, symlink=symlink, reason=verdict.value)


def test_state_names_are_exactly_what_the_writer_writes():
    assert all(is_state_name(state_name(n)) for n in (0, 4, 10**6, 10**12 - 1))
    for name in (
        "notes",
        "README.txt",
        "00000000004",
        "0000000000040",
        "00000000000a",
        "٠٠٠٠٠٠٠٠٠٠٠٤",
        "00000000000²",
        " 00000000004",
        "000000000004/",
    ):
        assert not is_state_name(name), name


def test_plan_never_deletes_foreign_names_links_or_files():
    cands = [
        _cand("000000000010", Verdict.RESUMABLE),
        _cand("000000000008", Verdict.RESUMABLE),
        _cand("000000000006", Verdict.RESUMABLE),
        _cand("notes", Verdict.TORN),
        _cand("README.txt", Verdict.TORN),
        _cand("٠٠٠٠٠٠٠٠٠٠٠٤", Verdict.TORN),  # digits, but not ASCII ones
        _cand("000000000002", Verdict.CORRUPT, symlink=True),
        _cand("000000000003", Verdict.TORN),  # a regular file named like a state
        _cand("000000000005", Verdict.RESUMABLE),  # a link discovery did not flag (kinds says so)
        _cand("000000000001", Verdict.TORN),  # crash debris of ours: goes
    ]
    kinds = {c.name: "dir" for c in cands} | {"000000000002": "link", "000000000003": "file", "000000000005": "link"}
    for prune in (False, True):
        plan = plan_retention(cands, keep_last=2, prune_unsafe=prune, kinds=kinds)
        assert plan.delete == ["000000000006", "000000000001"]
        assert sorted(plan.ignored) == sorted(["notes", "README.txt", "٠٠٠٠٠٠٠٠٠٠٠٤"])
        reported = "\n".join(plan.reported)
        assert "000000000002: corrupt (a symbolic link" in reported and "000000000005: corrupt" in reported
        assert "000000000003: not a directory (file)" in reported
    # an entry the listing did not see (created since) is left alone too
    assert plan_retention(cands, keep_last=1, kinds={"000000000010": "dir", "000000000008": "dir"}).delete == [
        "000000000008"
    ]


def _outside_state(tmp_path) -> str:
    target = tmp_path / "elsewhere" / "000000000002"
    target.mkdir(parents=True)
    (target / "manifest.json").write_text(json.dumps({"format": "syncpoint-state/1", "files": {}}))
    (target / "trainer.json").write_text("{}")
    return str(target)


def _plant(states, tmp_path) -> str:
    states.mkdir(parents=True, exist_ok=True)
    (states / "notes").mkdir()
    (states / "notes" / "todo.txt").write_text("mine")
    (states / "README.txt").write_text("mine too")
    (states / "000000000003").write_text("a file, not a state")
    target = _outside_state(tmp_path)
    os.symlink(target, states / "000000000002")
    return target


def test_retention_in_a_real_run_leaves_foreign_entries_and_link_targets_alone(tmp_path):
    spec = lm_spec(
        tmp_path / "runs",
        "task.config.num_samples=20",
        "train.grad_accum=4",
        "train.epochs=1",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "checkpoint.keep_last=2",
        "checkpoint.prune_unsafe=true",
    )
    assert run(spec).final_state == "000000000010"  # states 4, 8, 10: 4 already retired
    states = tmp_path / "runs" / spec.name / "states"
    target = _plant(states, tmp_path)  # someone's notes, a file and a link appear next to the states
    assert run(with_overrides(spec, "train.epochs=2")).final_state == "000000000020"  # saves 14, 18, 20
    assert committed_steps(spec) == [18, 20]  # states 8, 10, 14 were ours and went
    assert (states / "notes" / "todo.txt").read_text() == "mine"
    assert (states / "README.txt").read_text() == "mine too"
    assert (states / "000000000003").read_text() == "a file, not a state"
    assert os.path.islink(states / "000000000002")
    assert sorted(os.listdir(target)) == ["manifest.json", "trainer.json"]  # the target is untouched
    assert sorted(os.listdir(states)) == [
        "000000000002",
        "000000000003",
        "000000000018",
        "000000000020",
        "README.txt",
        "notes",
    ]


def test_delete_state_refuses_links_and_foreign_names(tmp_path, capsys):
    store = RunStorage(str(tmp_path / "run"))
    target = _plant(tmp_path / "run" / "states", tmp_path)
    assert delete_state(store, "000000000002") is False
    assert delete_state(store, "notes") is False and delete_state(store, "README.txt") is False
    assert "left states/000000000002 alone" in capsys.readouterr().err
    assert sorted(os.listdir(target)) == ["manifest.json", "trainer.json"]
    assert (tmp_path / "run" / "states" / "notes" / "todo.txt").exists()
    store.write_bytes(b"{}", "states", "000000000007", "manifest.json")
    store.write_bytes(b"x", "states", "000000000007", "engine", "shard.pt")
    assert delete_state(store, "000000000007") is True
    assert not store.exists("states", "000000000007")


def test_storage_never_deletes_through_a_link_and_lists_kinds(tmp_path):
    store = RunStorage(str(tmp_path / "run"))
    target = _plant(tmp_path / "run" / "states", tmp_path)
    assert store.entry_kinds("states") == {
        "notes": "dir",
        "README.txt": "file",
        "000000000003": "file",
        "000000000002": "link",
    }
    with pytest.raises(OSError):
        store.remove("states", "000000000002", "manifest.json")  # the parent is a link: refused
    with pytest.raises(OSError):
        store.delete_tree("states", "000000000002")
    assert sorted(os.listdir(target)) == ["manifest.json", "trainer.json"]
    store.remove("states", "notes", "missing.txt")  # a missing file is fine
    store.remove("states", "notes", "todo.txt")
    assert store.entry_kinds("states", "notes") == {}


def test_memory_store_kinds_and_remove():
    store = RunStorage(f"memory://retention-kinds-{os.getpid()}")
    store.write_bytes(b"{}", "states", "000000000001", "manifest.json")
    store.write_bytes(b"hi", "states", "README.txt")
    assert store.entry_kinds("states") == {"000000000001": "dir", "README.txt": "file"}
    store.remove("states", "000000000001", "manifest.json")
    assert not store.exists("states", "000000000001", "manifest.json")
    assert delete_state(store, "README.txt") is False and store.exists("states", "README.txt")
