"""Consistent state metadata for classification tests: a trainer.json and a complete manifest
exactly as the writer would produce them, so a test changes one field and sees that one refusal."""

from __future__ import annotations

import dataclasses
from typing import Any

from syncpoint.policies.contracts.state_format import (
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    SAMPLER_VERSION,
    STATES_DIR,
    TRAINER_FILE,
    TRAINER_SCHEMA_VERSION,
    DataRecord,
    SchedulerRecord,
    StateIdentity,
    TrainState,
    json_bytes,
    state_name,
)
from syncpoint.policies.decisions.boundaries import position_after
from syncpoint.policies.decisions.candidates import Candidate, LiveJob

# A test names a live job's fields flat, as a spec does; these lie deeper in ``StateIdentity``.
_PATHS = {
    "global_batch": ("data", "global_batch"),
    "samples_per_epoch": ("data", "samples_per_epoch"),
    "num_samples": ("data", "num_samples"),
    "sampler": ("data", "sampler"),
    "window_shards": ("data", "window_shards"),
    "corpus": ("data", "corpus"),
    "stream": ("data", "stream"),
    "optimizer_type": ("optimizer", "type"),
    "param_groups": ("optimizer", "param_groups"),
    "scheduler_type": ("scheduler", "type"),
    "scheduler_phases": ("scheduler", "phases"),
}
_LIVE_ONLY = {"corpus_index", "reset_schedule", "reset_optimizer", "allow_user_state_change"}


def _record_value(key: str, value: Any) -> Any:
    """A test's short form of a field (tuples) as the identity records it."""
    if value is None:
        return None
    if key == "param_groups":
        return [{"params": n, "numel": numel, "names": names} for n, numel, names in value]
    if key == "model_buffers":
        return [{"name": n, "shape": list(shape), "dtype": dtype} for n, shape, dtype in value]
    if key == "parameter_dtypes":
        return {"common": value[0], "others": dict(value[1])}
    if key == "task_generators":
        return dict(value)
    if key == "corpus":
        return dict(vars(value))
    if key in ("user_state", "scheduler_phases"):
        return list(value)
    return value


def changed(job: LiveJob, **fields: Any) -> LiveJob:
    """``job`` with some fields changed, each named flat (``world_size``, ``optimizer_type``, ...)."""
    record = job.identity.model_dump()
    live_only = {k: fields.pop(k) for k in _LIVE_ONLY & set(fields)}
    for key, value in fields.items():
        *parents, leaf = _PATHS.get(key, (key,))
        target = record
        for part in parents:
            if target.get(part) is None:  # a scheduler where there was none
                target[part] = {"type": "", "phases": [], "unit": "optimizer_steps"}
            target = target[part]
        target[leaf] = _record_value(key, value)
    return dataclasses.replace(job, identity=StateIdentity.model_validate(record), **live_only)


def live(
    job_identity: str,
    world_size: int,
    micro_batch_size: int,
    grad_accum: int,
    micro_batches_per_epoch: int,
    zero_stage: int,
    model_fingerprint: str,
    seed: int,
    **fields: Any,
) -> LiveJob:
    """A live job from its fields, the layout's positionally (0 samples per epoch and global batch:
    not known, so a state's are not compared at the same world size)."""
    identity = StateIdentity(
        job_identity=job_identity,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        micro_batches_per_epoch=micro_batches_per_epoch,
        zero_stage=zero_stage,
        model_fingerprint=model_fingerprint,
        seed=seed,
        elastic=False,
        data={"sampler": SAMPLER_VERSION, "samples_per_epoch": 0, "global_batch": 0},
    )
    return changed(LiveJob(identity), **fields)


def trainer_for(step: int, job: LiveJob, **overrides: Any) -> dict[str, Any]:
    """The trainer.json object of a boundary state at ``step``; ``data_<key>`` overrides a key of
    ``data``, any other keyword a top-level key (any value: tests plant wrong ones)."""
    exp = job.identity
    p = position_after(step, exp.grad_accum, exp.micro_batches_per_epoch)
    per_micro = exp.micro_batch_size * exp.world_size
    samples_per_epoch = exp.data.samples_per_epoch or exp.micro_batches_per_epoch * per_micro
    scheduler = None
    if exp.scheduler is not None:
        scheduler = SchedulerRecord(**dict(exp.scheduler), position=p.optimizer_step)
    state = TrainState(
        schema_version=TRAINER_SCHEMA_VERSION,
        job_name="j",
        **{k: v for k, v in exp if k not in ("scheduler", "data")},
        epoch=p.epoch,
        position_in_epoch=p.position_in_epoch,
        global_micro_step=step,
        optimizer_step=p.optimizer_step,
        scheduler=scheduler,
        data=DataRecord(
            **{
                **dict(exp.data),
                "num_samples": exp.data.num_samples if exp.data.num_samples is not None else samples_per_epoch,
                "samples_per_epoch": samples_per_epoch,
                "global_batch": exp.data.global_batch or exp.grad_accum * per_micro,
            },
            global_samples=p.epoch * samples_per_epoch + p.position_in_epoch * per_micro,
            samples_in_epoch=p.position_in_epoch * per_micro,
        ),
        elastic_optimizer=exp.zero_stage == 0 or bool(exp.elastic),
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
    step: int, exp: LiveJob, *, manifest: bool = True, files: dict | None = None, **overrides: Any
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
