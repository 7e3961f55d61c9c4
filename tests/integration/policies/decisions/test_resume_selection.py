"""Planted candidates and LR rules, end to end through the real writer and loader."""

from __future__ import annotations

import json
import shutil

import pytest

from syncpoint.policies.contracts.errors import ResumeRefused
from syncpoint.policies.contracts.state_format import MANIFEST_MAX_BYTES, TRAINER_MAX_BYTES
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.storage import RunStorage
from tests.helpers import committed_steps, digest, lm_spec, run, run_until_crash, step_history


def _spec(tmp, *extra):
    # 10 micro-batches per epoch, accumulation 4, a state at every optimizer step
    return lm_spec(
        tmp,
        "task.config.num_samples=20",
        "train.grad_accum=4",
        "train.epochs=2",
        "checkpoint.save_every={value: 1, unit: optimizer_steps}",
        *extra,
    )


def _decision(spec):
    return [e for e in EventLog(RunStorage(spec.run_url)).read_all() if e["kind"] == "resume_decision"][-1]


def _crashed_at_10(tmp):
    spec = _spec(tmp, "faults=[{at_micro_step: 10, mode: raise}]")
    assert run_until_crash(spec)
    assert committed_steps(spec) == [4, 8, 10]
    return spec


def test_mid_cycle_torn_and_bad_checksum_are_rejected_and_older_state_wins(tmp_path):
    spec = _crashed_at_10(tmp_path / "a")
    store = RunStorage(spec.run_url)
    # bad checksum (same size) in the newest state: only detectable while fetching
    shard = "engine/mp_rank_00_model_states.pt"
    data = bytearray(store.read_bytes("states", "000000000010", shard, limit=1 << 30))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(bytes(data), "states", "000000000010", shard)
    # a mid-cycle state left by an older writer at 12 (position 2 of epoch 2), fully committed
    shutil.copytree(store.path("states", "000000000008"), store.path("states", "000000000012"))
    t = json.loads(store.read_bytes("states", "000000000012", "trainer.json", limit=TRAINER_MAX_BYTES))
    t.update(global_micro_step=12, epoch=1, position_in_epoch=2)
    _rewrite_trainer(store, "000000000012", t)
    # a torn directory at 13 (no manifest)
    store.write_bytes(b"{}", "states", "000000000013", "trainer.json")

    result = run(spec)
    assert result.resumed_from == "000000000008"
    verdicts = {c["state"]: (c["verdict"], c["reason"]) for c in _decision(spec)["candidates"]}
    assert verdicts["000000000013"][0] == "torn"
    assert verdicts["000000000012"][0] == "mid-cycle"
    events = EventLog(store).read_all()
    decisions = [e for e in events if e["kind"] == "resume_decision"]
    assert any(
        "xxh3_128 does not match" in (c["reason"] or "")
        for c in decisions[-1]["candidates"]
        if c["state"] == "000000000010"
    )
    ref = _spec(tmp_path / "ref")
    run(ref)
    assert digest(spec, result.final_state) == digest(ref, result.final_state)


def test_only_unsafe_candidates_fail_before_training_a_batch(tmp_path):
    spec = _crashed_at_10(tmp_path)
    store = RunStorage(spec.run_url)
    for name in ("000000000004", "000000000008"):
        store.remove("states", name, "manifest.json")  # torn
    store.write_bytes(b"not json{", "states", "000000000010", "manifest.json")  # corrupt
    before = step_history(spec)
    attempts = len([e for e in EventLog(store).read_all() if e["kind"] == "attempt_started"])
    with pytest.raises(ResumeRefused) as err:
        run(spec)
    text = str(err.value)
    assert "000000000004" in text and "torn" in text and "corrupt" in text
    assert step_history(spec) == before  # no batch was trained
    assert len([e for e in EventLog(store).read_all() if e["kind"] == "attempt_started"]) == attempts


def test_edited_learning_rate_takes_effect_on_resume(tmp_path):
    spec = _crashed_at_10(tmp_path)
    from tests.helpers import with_overrides

    edited = with_overrides(spec, "train.lr=0.001", "faults=[]")
    run(edited)
    hist = step_history(edited)
    ref = _spec(tmp_path / "ref", "train.lr=0.001")
    run(ref)
    ref_hist = step_history(ref)
    for step in (4, 5, 6):  # after the resume at optimizer step 3: the new base lr, same position
        assert hist[step].lr == pytest.approx(ref_hist[step].lr)
    assert hist[2].lr != ref_hist[2].lr  # before the edit the old lr applied


def test_changed_scheduler_type_fails_naming_the_opt_out(tmp_path):
    spec = _crashed_at_10(tmp_path)
    from tests.helpers import with_overrides

    changed = with_overrides(spec, "train.scheduler.type=linear", "faults=[]")
    with pytest.raises(ResumeRefused, match="resume.reset_schedule"):  # refused at selection, before any load
        run(changed)
    reset = with_overrides(changed, "resume.reset_schedule=true")
    result = run(reset)
    assert result.resumed_from == "000000000010"
    assert step_history(reset)[4].lr == pytest.approx(spec.train.lr * 1 / 4)  # warmup restarted at position 0


def test_state_without_schedule_position_warns_and_starts_fresh(tmp_path, capsys):
    spec = _crashed_at_10(tmp_path)
    store = RunStorage(spec.run_url)
    t = json.loads(store.read_bytes("states", "000000000010", "trainer.json", limit=TRAINER_MAX_BYTES))
    del t["scheduler"]
    _rewrite_trainer(store, "000000000010", t)
    from tests.helpers import with_overrides

    run(with_overrides(spec, "faults=[]"))
    assert "no LR-schedule position" in capsys.readouterr().err
    assert step_history(spec)[4].lr == pytest.approx(spec.train.lr / 4)


def test_init_from_imports_weights_but_never_position(tmp_path):
    parent = _spec(tmp_path / "parent")
    run(parent)
    from tests.helpers import with_overrides

    child = with_overrides(
        _spec(tmp_path / "child"), "name=child", f"resume.init_from={parent.run_url}/states/000000000020"
    )
    result = run(child)
    assert result.resumed_from is None
    hist = step_history(child)
    assert hist[1].lr == pytest.approx(child.train.lr / 4)  # schedule starts at 0
    assert min(hist) == 1 and max(hist) == 6  # full data pass from position 0
    assert hist[1].loss < step_history(parent)[1].loss  # it starts from trained weights


def _rewrite_trainer(store: RunStorage, name: str, trainer: dict) -> None:
    """Rewrite trainer.json and re-commit the manifest, as a (buggy) older writer would have."""
    from syncpoint.workers.integrity.checksum import checksum_bytes

    data = store.write_json(trainer, "states", name, "trainer.json")
    manifest = json.loads(store.read_bytes("states", name, "manifest.json", limit=MANIFEST_MAX_BYTES))
    manifest["files"]["trainer.json"] = {"size": len(data), "sha256": checksum_bytes(data, "sha256")}
    manifest["state"] = name
    store.commit_bytes(json.dumps(manifest).encode(), "states", name, "manifest.json")
