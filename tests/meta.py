"""Consistent state metadata for classification tests: a trainer.json and a complete manifest
exactly as the writer would produce them, so a test changes one field and sees that one refusal."""

from __future__ import annotations

from typing import Any

from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    STATES_DIR,
    TRAINER_FILE,
    TRAINER_SCHEMA_VERSION,
    DataRecord,
    SchedulerRecord,
    TrainState,
    json_bytes,
    state_name,
)
from syncpoint.policies.decisions.boundaries import position_after
from syncpoint.policies.decisions.candidates import Candidate, Expectation, identity_record


def trainer_for(step: int, exp: Expectation, **overrides: Any) -> dict[str, Any]:
    """The trainer.json object of a boundary state at ``step``; ``data_<key>`` overrides a key of
    ``data``, any other keyword a top-level key (any value: tests plant wrong ones)."""
    p = position_after(step, exp.grad_accum, exp.micro_batches_per_epoch)
    per_micro = exp.micro_batch_size * exp.world_size
    samples_per_epoch = exp.samples_per_epoch or exp.micro_batches_per_epoch * per_micro
    scheduler = None
    if exp.scheduler_type is not None:
        scheduler = SchedulerRecord(
            type=exp.scheduler_type,
            phases=list(exp.scheduler_phases or ()),
            unit="optimizer_steps",
            position=p.optimizer_step,
        )
    state = TrainState(
        schema_version=TRAINER_SCHEMA_VERSION,
        job_name="j",
        **identity_record(exp),
        epoch=p.epoch,
        position_in_epoch=p.position_in_epoch,
        global_micro_step=step,
        optimizer_step=p.optimizer_step,
        scheduler=scheduler,
        data=DataRecord(
            sampler=exp.sampler,
            num_samples=exp.num_samples if exp.num_samples is not None else samples_per_epoch,
            global_samples=p.epoch * samples_per_epoch + p.position_in_epoch * per_micro,
            samples_in_epoch=p.position_in_epoch * per_micro,
            samples_per_epoch=samples_per_epoch,
            global_batch=exp.global_batch or exp.grad_accum * per_micro,
        ),
        elastic_optimizer=exp.zero_stage == 0 or exp.elastic,
        metrics={"loss": 1.0},
        save_reasons=["interval"],
        attempt=1,
        submission="",
    )
    t = state.record()
    if scheduler is None:
        del t["scheduler"]
    del t["created_at"]
    for key, value in overrides.items():
        if key.startswith("data_"):
            t["data"][key[5:]] = value
        else:
            t[key] = value
    return t


def candidate_for(
    step: int, exp: Expectation, *, manifest: bool = True, files: dict | None = None, **overrides: Any
) -> Candidate:
    t = trainer_for(step, exp, **overrides)
    try:  # the layout of the state as edited (a wrong world_size brings its RNG files), else as written
        state = TrainState.model_validate(t)
    except ValueError:
        state = TrainState.model_validate(trainer_for(step, exp))
    entries = files if files is not None else {n: {"size": 10, "xxh3_128": "ab" * 16} for n in state.required_files()}
    listing = {n: e["size"] for n, e in entries.items() if isinstance(e, dict) and "size" in e}
    m = {"format": MANIFEST_FORMAT, "state": state_name(step), "world_size": state.world_size, "files": entries}
    return Candidate(name=state_name(step), trainer=t, manifest=m if manifest else None, listing=listing)


def commit_candidate(store, c: Candidate, *, algo: str = "xxh3_128") -> None:
    """Write a candidate's files for real (placeholder bytes for shards) and commit its manifest."""
    from syncpoint.workers.integrity.checksum import checksum_bytes

    files: dict[str, Any] = {}
    for rel in (c.manifest or {}).get("files", {}):
        data = json_bytes(c.trainer or {}) if rel == TRAINER_FILE else b"x" * 10
        store.write_bytes(data, STATES_DIR, c.name, rel)
        files[rel] = {"size": len(data), algo: checksum_bytes(data, algo)}
    manifest = dict(c.manifest or {}, files=files)
    store.commit_bytes(json_bytes(manifest), STATES_DIR, c.name, MANIFEST_FILE)
