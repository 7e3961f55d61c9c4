"""The state format as a type: a field the models refuse makes a state corrupt with that field named,
older states still read (the one legacy conversion), and what the writer emits is unchanged."""

from __future__ import annotations

import json

import pytest

from syncpoint.policies.contracts.state_format import (
    MANIFEST_FORMAT,
    Manifest,
    TrainState,
    json_bytes,
    required_files,
    rng_file,
    state_name,
)
from syncpoint.policies.decisions.candidates import Candidate, Verdict, classify
from syncpoint.workers.state.discovery import discover
from syncpoint.workers.storage import RunStorage
from tests.meta import candidate_for, changed, commit_candidate, live, trainer_for

EXP = live("j", 2, 4, 4, 10, 2, "f", 1, precision="fp32", optimizer_type="adamw")


def _corrupt_reason(c: Candidate) -> str:
    classify(c, EXP)
    assert c.verdict is Verdict.CORRUPT, (c.verdict, c.reason)
    return c.reason


@pytest.mark.parametrize(
    "override,field",
    [
        ({"world_size": "two"}, "trainer.json field world_size"),
        ({"epoch": 1.0}, "trainer.json field epoch"),
        ({"elastic": "no"}, "trainer.json field elastic"),
        ({"data_global_batch": None}, "trainer.json field data.global_batch"),
        ({"metrics": [1.0]}, "trainer.json field metrics"),
        (
            {"scheduler": {"type": "constant", "phases": ["constant"], "unit": "optimizer_steps", "position": -1}},
            "trainer.json field scheduler.position",
        ),
        ({"optimizer": {"type": 3}}, "trainer.json field optimizer.type"),
    ],
)
def test_a_trainer_field_of_the_wrong_type_is_corrupt_naming_it(override, field):
    assert field in _corrupt_reason(candidate_for(8, EXP, **override))


@pytest.mark.parametrize("missing", ["seed", "job_identity", "optimizer_step", "data"])
def test_a_missing_trainer_field_is_corrupt_naming_it(missing):
    c = candidate_for(8, EXP)
    del c.trainer[missing]
    reason = _corrupt_reason(c)
    assert f"trainer.json field {missing}" in reason and "missing" in reason


def test_a_missing_data_field_of_a_current_state_is_named():
    c = candidate_for(8, EXP)
    del c.trainer["data"]["global_batch"]
    assert "trainer.json field data.global_batch: missing" in _corrupt_reason(c)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda m: m.update(world_size="2"), "manifest.json field world_size"),
        (lambda m: m.update(created_at="yesterday"), "manifest.json field created_at"),
        (lambda m: m.pop("files"), "manifest.json field files: missing"),
        (lambda m: m.update(files={}), "manifest lists no files"),
        (lambda m: m["files"][rng_file(0)].update(size=-1), f"manifest entry {rng_file(0)} has no valid size"),
        (lambda m: m["files"][rng_file(0)].update(xxh3_128="XYZ"), "xxh3_128 is not a hex digest"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_is_corrupt_naming_it(edit, field):
    c = candidate_for(8, EXP)
    edit(c.manifest)
    assert field in _corrupt_reason(c)


def test_a_planted_state_is_refused_through_discovery_and_the_cli(tmp_path, capsys):
    from syncpoint.orchestrator.cli import main

    store = RunStorage(str(tmp_path / "run"))
    commit_candidate(store, candidate_for(4, EXP))
    commit_candidate(store, candidate_for(8, EXP, micro_batch_size="4"))  # re-committed with matching checksums
    verdicts = {c.name: (c.verdict, c.reason) for c in discover(store, EXP)}
    assert verdicts[state_name(4)][0] is Verdict.RESUMABLE
    assert verdicts[state_name(8)][0] is Verdict.CORRUPT and "micro_batch_size" in verdicts[state_name(8)][1]
    assert main(["states", str(tmp_path / "run"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["verdict"] for c in out["candidates"]] == ["corrupt", "resumable"]
    assert "trainer.json field micro_batch_size" in out["candidates"][0]["reason"]
    assert out["choice"]["state"] == state_name(4)


def test_a_newer_schema_is_incompatible_before_its_fields_are_judged():
    c = classify(candidate_for(8, EXP, schema_version=2, epoch="new meaning"), EXP)
    assert c.verdict is Verdict.INCOMPATIBLE and "newer than this syncpoint reads" in c.reason


def _first_format_trainer(step: int) -> dict:
    """``trainer.json`` as the first format wrote it: no elastic fields, no optimizer or submission,
    and a data block with only sampler, num_samples and global_samples."""
    t = trainer_for(step, EXP)
    for key in ("elastic", "elastic_optimizer", "optimizer", "submission"):
        del t[key]
    t["data"] = {
        "sampler": t["data"]["sampler"],
        "num_samples": t["data"]["num_samples"],
        "global_samples": t["data"]["global_samples"],
    }
    return t


def test_states_of_the_first_format_still_resume():
    c = candidate_for(8, EXP)
    c.trainer = _first_format_trainer(8)
    assert classify(c, EXP).verdict is Verdict.RESUMABLE, c.reason
    state = TrainState.model_validate(c.trainer)
    per_micro = EXP.identity.micro_batch_size * EXP.identity.world_size
    assert (state.data.samples_in_epoch, state.data.samples_per_epoch, state.data.global_batch) == (
        8 * per_micro,
        10 * per_micro,
        4 * per_micro,
    )
    assert state.elastic is None and not state.elastic_optimizer and state.optimizer.type is None
    assert state.identity().data.samples_per_epoch == 10 * per_micro
    c = candidate_for(8, EXP)
    c.trainer = dict(_first_format_trainer(8), epoch=1)  # its counters still have to agree
    assert classify(c, EXP).verdict is Verdict.CORRUPT and "inconsistent" in c.reason


def test_states_without_the_elastic_field_judge_resizes_by_their_optimizer():
    t = trainer_for(8, EXP)
    del t["elastic"]
    state = TrainState.model_validate(t)
    assert state.elastic is None and not state.full_optimizer_state
    t.update(elastic_optimizer=True)
    assert TrainState.model_validate(t).full_optimizer_state  # an elastic ZeRO-2 state of that format


def test_what_the_writer_emits_reads_back_unchanged():
    exp = changed(EXP, scheduler_type="cosine", scheduler_phases=("linear_warmup", "cosine"))
    t = dict(trainer_for(8, exp), created_at=1.7e9)
    state = TrainState.model_validate(t)
    assert state.record() == t
    assert json_bytes(state.record()) == json.dumps(t, indent=1, sort_keys=True).encode()
    files = {n: {"size": 10, "xxh3_128": "ab" * 16} for n in state.required_files()}
    written = {
        "format": MANIFEST_FORMAT,
        "state": state_name(8),
        "created_at": 1.7e9,
        "world_size": 2,
        "checksum": "xxh3_128",
        "files": files,
        "lease_generation": 3,
    }
    assert (
        Manifest(
            state=state_name(8), created_at=1.7e9, world_size=2, checksum="xxh3_128", files=files, lease_generation=3
        ).record()
        == written
    )
    assert Manifest.model_validate(written).record() == written


def test_required_files_by_layout():
    assert required_files(world_size=2, zero_stage=3, precision="bf16", full_optimizer_state=True) == [
        "trainer.json",
        "engine/zero_pp_rank_0_mp_rank_00_model_states.pt",
        "engine/zero_pp_rank_1_mp_rank_00_model_states.pt",
        "engine/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "engine/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "optim/full.safetensors",
        "rng/rank_00000.safetensors",
        "rng/rank_00001.safetensors",
    ]
    assert required_files(world_size=1, zero_stage=0, precision=None, full_optimizer_state=True) == [
        "trainer.json",
        "engine/mp_rank_00_model_states.pt",
        "rng/rank_00000.safetensors",
    ]
