"""Consistent state metadata for classification tests: a trainer.json and a complete manifest
exactly as the writer would produce them, so a test changes one field and sees that one refusal."""

from __future__ import annotations

from typing import Any

from policies.boundaries import position_after
from policies.candidates import Candidate, Expectation, identity_record, required_files


def trainer_for(step: int, exp: Expectation, **overrides: Any) -> dict[str, Any]:
    p = position_after(step, exp.grad_accum, exp.micro_batches_per_epoch)
    per_micro = exp.micro_batch_size * exp.world_size
    spe = exp.samples_per_epoch or exp.micro_batches_per_epoch * per_micro
    t: dict[str, Any] = {
        "schema_version": 1, "job_name": "j", **identity_record(exp),
        "epoch": p.epoch, "position_in_epoch": p.position_in_epoch, "global_micro_step": step,
        "optimizer_step": p.optimizer_step,
        "data": {"sampler": exp.sampler, "num_samples": exp.num_samples if exp.num_samples is not None else spe,
                 "global_samples": p.epoch * spe + p.position_in_epoch * per_micro,
                 "samples_in_epoch": p.position_in_epoch * per_micro, "samples_per_epoch": spe,
                 "global_batch": exp.global_batch or exp.grad_accum * per_micro},
        "elastic_optimizer": exp.zero_stage == 0 or exp.elastic,
        "metrics": {"loss": 1.0}, "save_reasons": ["interval"], "attempt": 1, "submission": "",
    }
    if exp.scheduler_type is not None:
        t["scheduler"] = {"type": exp.scheduler_type, "phases": list(exp.scheduler_phases or ()),
                          "unit": "optimizer_steps", "position": p.optimizer_step}
    for key, value in overrides.items():
        if key.startswith("data_"):
            t["data"][key[5:]] = value
        else:
            t[key] = value
    return t


def candidate_for(step: int, exp: Expectation, *, manifest: bool = True, files: dict | None = None,
                  **overrides: Any) -> Candidate:
    t = trainer_for(step, exp, **overrides)
    names = required_files(world_size=t["world_size"], zero_stage=t["zero_stage"], precision=t.get("precision"),
                           full_optimizer_state=bool(t.get("elastic")) and t["zero_stage"] in (1, 2))
    entries = files if files is not None else {n: {"size": 10, "xxh3_128": "ab" * 16} for n in names}
    listing = {n: e["size"] for n, e in entries.items() if isinstance(e, dict) and "size" in e}
    m = {"format": "syncpoint-state/1", "state": f"{step:012d}", "world_size": t["world_size"], "files": entries}
    return Candidate(name=f"{step:012d}", trainer=t, manifest=m if manifest else None, listing=listing)


def commit_candidate(store, c: Candidate, *, algo: str = "xxh3_128") -> None:
    """Write a candidate's files for real (placeholder bytes for shards) and commit its manifest."""
    import json

    from workers.checksum import checksum_bytes

    files: dict[str, Any] = {}
    for rel in (c.manifest or {}).get("files", {}):
        data = json.dumps(c.trainer).encode() if rel == "trainer.json" else b"x" * 10
        store.write_bytes(data, "states", c.name, rel)
        files[rel] = {"size": len(data), algo: checksum_bytes(data, algo)}
    manifest = dict(c.manifest or {}, files=files)
    store.commit_bytes(json.dumps(manifest).encode(), "states", c.name, "manifest.json")
