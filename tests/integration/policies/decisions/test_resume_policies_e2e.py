"""Retention cases, custom policies/triggers, fine-tune gating and the fresh policy, end to end
through the real writer and a second resume."""

from __future__ import annotations

import json
import shutil

import pytest

from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TRAINER_MAX_BYTES
from syncpoint.workers.integrity.checksum import checksum_bytes
from syncpoint.workers.storage import RunStorage
from tests.helpers import (
    committed_steps,
    digest,
    lm_spec,
    run,
    run_until_crash,
    state_names,
    trainer_json,
    with_overrides,
)


def _spec(tmp, *extra):
    return lm_spec(tmp, "task.config.num_samples=20", "train.grad_accum=4", "train.epochs=2", *extra)


def _reference(tmp):
    ref = _spec(tmp / "ref")
    run(ref)
    return ref


def test_a_keep_last_1_interrupted_after_12_still_resumes(tmp_path):
    spec = _spec(
        tmp_path / "a",
        "checkpoint.save_every={value: 4, unit: micro_steps}",
        "checkpoint.keep_last=1",
        "faults=[{at_micro_step: 12, mode: raise}]",
    )
    assert run_until_crash(spec)
    assert committed_steps(spec) == [8]  # 4 was pruned after 8 committed; 12's request was still pending
    result = run(spec)
    assert result.resumed_from == f"{8:012d}"
    assert committed_steps(spec) == [20]
    assert digest(spec, f"{20:012d}") == digest(_reference(tmp_path), f"{20:012d}")


def _plant_mid_cycle(store: RunStorage, src: str, step: int) -> None:
    name = f"{step:012d}"
    shutil.copytree(store.path("states", src), store.path("states", name))
    t = json.loads(store.read_bytes("states", name, "trainer.json", limit=TRAINER_MAX_BYTES))
    epoch, pos = divmod(step, t["micro_batches_per_epoch"])
    t.update(global_micro_step=step, epoch=epoch, position_in_epoch=pos)
    data = store.write_json(t, "states", name, "trainer.json")
    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES))
    manifest["files"]["trainer.json"] = {"size": len(data), "sha256": checksum_bytes(data, "sha256")}
    manifest["state"] = name
    store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")


def test_b_legacy_mid_cycle_state_never_displaces_resumable_ones(tmp_path):
    # an older writer left 4 (boundary), 8 (boundary) and 12 (mid-cycle)
    spec = _spec(
        tmp_path / "b",
        "checkpoint.save_every={value: 4, unit: micro_steps}",
        "faults=[{at_micro_step: 9, mode: raise}]",
    )
    assert run_until_crash(spec)
    store = RunStorage(spec.run_url)
    _plant_mid_cycle(store, f"{8:012d}", 12)
    assert state_names(spec) == [f"{s:012d}" for s in (4, 8, 12)]
    resumed = with_overrides(spec, "checkpoint.keep_last=1", "faults=[{at_micro_step: 15, mode: raise}]")
    assert run_until_crash(resumed)  # falls back to 8, trains, saves at 14 (request 12 -> boundary 14), prunes
    names = state_names(spec)
    assert f"{14:012d}" in names and f"{8:012d}" not in names and f"{4:012d}" not in names
    assert f"{12:012d}" in names  # reported, kept out of the count, never displacing 14
    result = run(with_overrides(resumed, "faults=[]"))  # the second resume still finds a resumable state
    assert result.resumed_from == f"{14:012d}"
    assert digest(spec, f"{20:012d}") == digest(_reference(tmp_path), f"{20:012d}")
    pruned = with_overrides(resumed, "faults=[]", "checkpoint.prune_unsafe=true", "train.epochs=3")
    run(pruned)
    assert f"{12:012d}" not in state_names(spec)


def test_c_keep_last_0_keeps_everything(tmp_path):
    spec = _spec(tmp_path, "checkpoint.save_every={value: 1, unit: optimizer_steps}", "checkpoint.keep_last=0")
    run(spec)
    assert committed_steps(spec) == [4, 8, 10, 14, 18, 20]
    keep2 = _spec(tmp_path / "k2", "checkpoint.save_every={value: 1, unit: optimizer_steps}", "checkpoint.keep_last=2")
    run(keep2)
    assert committed_steps(keep2) == [18, 20]


def test_custom_policy_and_trigger_by_import_path(tmp_path):
    spec = _spec(
        tmp_path, "checkpoint.save_trigger=tests.tasks:EveryFifthMicroStep", "faults=[{at_micro_step: 16, mode: raise}]"
    )
    assert run_until_crash(spec)
    assert committed_steps(spec) == [8, 10, 18][:2]  # 5 -> 8, 10 -> 10, 15 -> 18 (crashed at 16)
    pinned_old = with_overrides(
        spec, "faults=[]", "resume.policy=tests.tasks:LastStateOnly", f"resume.policy_args={{name: '{8:012d}'}}"
    )
    assert run(pinned_old).resumed_from == f"{8:012d}"
    store = RunStorage(spec.run_url)
    _plant_mid_cycle(store, f"{8:012d}", 13)
    unsafe = with_overrides(pinned_old, f"resume.policy_args={{name: '{13:012d}'}}")
    with pytest.raises(ResumeRefused, match="mid-cycle"):
        run(unsafe)


def test_init_from_is_ignored_once_the_run_has_its_own_state(tmp_path, capsys):
    parent = _spec(tmp_path / "parent")
    run(parent)
    child = with_overrides(
        _spec(tmp_path / "child"),
        "name=child",
        f"resume.init_from={parent.run_url}",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 9, mode: raise}]",
    )
    assert run_until_crash(child)
    assert "init_from" in capsys.readouterr().out
    result = run(child)
    assert result.resumed_from == f"{8:012d}"
    assert "own resumable state wins" in capsys.readouterr().out


def _init_from_events(spec) -> list[dict]:
    from syncpoint.workers.observation.events import EventLog

    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "init_from_resolved"]


def test_init_from_a_run_directory_is_resolved_once_per_run(tmp_path, capsys):
    """A fine-tune that fails before its first commit and is re-submitted while the source run kept
    training takes the source state it took the first time (recorded in its journal), not the source's
    newer one: the two attempts never mix two fine-tunes. Its result is the fine-tune of that state."""
    parent = _spec(tmp_path / "parent", "train.epochs=1", "checkpoint.save_every={value: 1, unit: optimizer_steps}")
    run(parent)
    first_source = f"{10:012d}"  # the parent's newest state when the fine-tune starts
    child = with_overrides(
        _spec(tmp_path / "child"),
        "name=child",
        f"resume.init_from={parent.run_url}",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        "faults=[{at_micro_step: 2, mode: raise}]",
    )  # before the child's first commit
    assert run_until_crash(child) and not committed_steps(child)
    assert [e["source_state"] for e in _init_from_events(child)] == [first_source]
    run(with_overrides(parent, "train.epochs=2"))  # the source run trains on: a newer state
    assert max(committed_steps(parent)) == 20
    capsys.readouterr()
    resumed = run(with_overrides(child, "faults=[]"))
    assert f"the source state this run took at attempt 1 ({first_source}), unchanged" in capsys.readouterr().out
    assert len(_init_from_events(child)) == 1
    pinned = with_overrides(
        _spec(tmp_path / "pinned"), "name=child", f"resume.init_from={parent.run_url}/states/{first_source}"
    )
    assert digest(child, resumed.final_state) == digest(pinned, run(pinned).final_state)


def test_init_from_refuses_a_recorded_source_state_that_changed_or_went_away(tmp_path):
    parent = _spec(tmp_path / "parent", "train.epochs=1")
    run(parent)
    child = with_overrides(
        _spec(tmp_path / "child"),
        "name=child",
        f"resume.init_from={parent.run_url}",
        "faults=[{at_micro_step: 2, mode: raise}]",
    )
    assert run_until_crash(child)
    source = _init_from_events(child)[0]["source_state"]
    store = RunStorage(parent.run_url)
    manifest = json.loads(store.read_bytes("states", source, "manifest.json", limit=1 << 30))
    manifest["created_at"] = 0.0  # re-committed by someone: another manifest, even with the same files
    store.commit_bytes(json.dumps(manifest).encode(), "states", source, "manifest.json")
    again = with_overrides(child, "faults=[]")
    with pytest.raises(ResumeRefused, match="the source state this run took at attempt 1, changed since"):
        run(again)
    store.remove("states", source, "manifest.json")
    with pytest.raises(ResumeRefused, match="the source state this run took at attempt 1, is gone"):
        run(again)
    assert not committed_steps(child)


def test_fresh_policy_refuses_archives_or_overwrites(tmp_path):
    spec = _spec(
        tmp_path, "faults=[{at_micro_step: 12, mode: raise}]", "checkpoint.save_every={value: 1, unit: optimizer_steps}"
    )
    assert run_until_crash(spec)
    fresh = with_overrides(spec, "faults=[]", "resume.policy=fresh")
    with pytest.raises(ResumeRefused, match="on_existing"):
        run(fresh)
    assert committed_steps(spec) == [4, 8, 10]  # nothing committed was lost
    result = run(with_overrides(fresh, "resume.on_existing=archive"))
    assert result.resumed_from is None and committed_steps(spec) == [4, 8, 10, 14, 18, 20]
    store = RunStorage(spec.run_url)
    archived = store.list_dirs("archive")
    assert len(archived) == 1 and store.list_dirs("archive", archived[0]) == [f"{s:012d}" for s in (4, 8, 10)]
    assert trainer_json(spec, f"{20:012d}")["attempt"] == 2  # the refused start never began an attempt


def test_fresh_policy_restart_within_the_same_submission_continues(tmp_path):
    from syncpoint.workers.supervision.faults import InjectedCrash
    from syncpoint.workers.supervision.launch import run_in_process

    spec = _spec(tmp_path, "checkpoint.save_every={value: 1, unit: optimizer_steps}")
    run(spec)  # an earlier run left states
    fresh = with_overrides(
        spec, "resume.policy=fresh", "resume.on_existing=archive", "faults=[{at_micro_step: 12, mode: raise}]"
    )
    with pytest.raises(InjectedCrash):
        run_in_process(fresh, print_progress=False, submission_id="sub-1")  # archives, starts over, crashes
    result = run_in_process(fresh, print_progress=False, submission_id="sub-1")  # Ray's restart of it
    assert result.resumed_from == f"{10:012d}"  # continued its own progress, did not archive it again
    assert len(RunStorage(spec.run_url).list_dirs("archive")) == 1


@pytest.mark.parametrize(
    "change,named",
    [
        ("train.optimizer.no_decay=[]", "parameter groups differ"),
        ("deepspeed.zero_stage=2", "zero_stage"),
        ("train.optimizer.type=sgd", "optimizer.type"),
    ],
)
def test_init_from_with_optimizer_refuses_what_cannot_load_before_reading_a_tensor(tmp_path, change, named):
    """init_optimizer takes the moments, which DeepSpeed stores per group, rank, stage and optimizer: a
    source that differs in any is refused from its trainer.json, naming the opt-out, and the run writes
    nothing; without init_optimizer the same source gives its weights."""
    parent = _spec(tmp_path / "parent", "deepspeed.zero_stage=1")
    run(parent)
    child = with_overrides(
        _spec(tmp_path / "child"),
        "name=child",
        "deepspeed.zero_stage=1",
        change,
        f"resume.init_from={parent.run_url}",
        "resume.init_optimizer=true",
    )
    with pytest.raises(ResumeRefused, match=rf"{named}.*resume\.init_optimizer: false") as refused:
        run(child)
    assert "cannot be taken" in str(refused.value)
    assert not RunStorage(child.run_url).list_dirs("states")
    weights_only = with_overrides(child, "resume.init_optimizer=false")
    assert run(weights_only).resumed_from is None


def test_run_fresh_starts_over_archives_the_old_states_and_counts_only_its_own_submission(tmp_path):
    """`syncpoint run --fresh` after a failed run (issue 50): the states are moved to archive/, the run
    starts from step 0, and its summary counts its own submission (no restart, though the log keeps the
    failed one's); the next `syncpoint run` without --fresh resumes it as usual. The driver's
    ``submitted`` event is written as `syncpoint run` writes it; the ranks run in this process."""
    from syncpoint.orchestrator.cli import build_parser
    from syncpoint.orchestrator.cli_jobs import rerun_command, run_spec
    from syncpoint.orchestrator.timeline import restarts, summarize
    from syncpoint.workers.observation.events import EventLog
    from tests.helpers import linear_spec, write_job

    spec = linear_spec(
        tmp_path,
        "task.path=tests.light_tasks:linear",  # the CLI's task-import check imports no torch
        "task.config.num_samples=16",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
    )
    log = EventLog(RunStorage(spec.run_url), source="driver")
    log.emit("submitted", name=spec.name, address="embedded")
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 10, mode: raise}]"))
    assert run_until_crash(with_overrides(spec, "faults=[{at_micro_step: 14, mode: raise}]"))  # its restart fails too
    assert committed_steps(spec) == [4, 8, 12]
    job = write_job(spec, tmp_path / "job.yaml")

    args = build_parser().parse_args(["run", str(job), "--fresh", "--set", "train.seed=3"])
    fresh = run_spec(args)
    assert (fresh.resume.policy, fresh.resume.on_existing, fresh.resume.policy_args) == ("fresh", "archive", {})
    assert "--fresh" not in rerun_command(args)  # a stopped fresh run is resumed, not started over again
    log.emit("submitted", name=spec.name, address="embedded")
    result = run(fresh)
    assert result.resumed_from is None and committed_steps(spec) == [4, 8, 12, 16]
    store = RunStorage(spec.run_url)
    (archived,) = store.list_dirs("archive")
    assert store.list_dirs("archive", archived) == [f"{s:012d}" for s in (4, 8, 12)]
    journal = EventLog(store).journal()
    summary = summarize(journal)
    assert summary is not None and (summary.restarts, summary.optimizer_step) == (0, 4)
    assert restarts(journal)  # the failed submission's restart is still the log's history

    again = run_spec(build_parser().parse_args(["run", str(job)]))
    assert again.resume.policy == "newest-resumable"
    assert run(again).resumed_from == f"{16:012d}" and store.list_dirs("archive") == [archived]
