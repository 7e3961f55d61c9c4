"""The state writer: every rank's files first, then ``manifest.json`` last, by rank 0.

Protocol (all ranks, at a sync boundary only):
1. DeepSpeed writes its checkpoint (``engine.save_checkpoint``) into a rank-local staging directory;
   each rank uploads the files it wrote through fsspec (no shared filesystem needed) plus its RNG
   file, durably, hashing on the way.
2. A gather of every rank's file list doubles as the barrier that proves every rank's files are
   durable.
3. Rank 0 writes ``trainer.json``, then commits ``manifest.json`` (every file with size and
   sha256) atomically: temp name + rename locally, a single PUT on object stores. Anything
   without a manifest is torn and selection rejects it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from workers import rng
from workers.faults import Faults
from workers.storage import RunStorage, sha256_bytes

MANIFEST_FORMAT = "syncpoint-state/1"


def state_name(global_micro_step: int) -> str:
    return f"{global_micro_step:012d}"


@dataclass
class SaveResult:
    name: str
    bytes: int
    seconds: float
    blocked_seconds: float


def save_state(engine, storage: RunStorage, trainer: dict[str, Any], faults: Faults) -> SaveResult:
    t0 = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    name = state_name(trainer["global_micro_step"])
    faults.save_started()
    faults.at_phase("before_shards")
    staging = tempfile.mkdtemp(prefix="syncpoint-save-")
    try:
        engine.save_checkpoint(staging, tag="engine", save_latest=False)
        mine: dict[str, dict[str, Any]] = {}
        engine_dir = os.path.join(staging, "engine")
        for fname in sorted(os.listdir(engine_dir)) if os.path.isdir(engine_dir) else []:
            size, digest = storage.upload_file(os.path.join(engine_dir, fname), "states", name, "engine", fname)
            mine[f"engine/{fname}"] = {"size": size, "sha256": digest}
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    rng_bytes = rng.capture()
    rel = f"rng/rank_{rank:05d}.safetensors"
    storage.write_bytes(rng_bytes, "states", name, rel)
    mine[rel] = {"size": len(rng_bytes), "sha256": sha256_bytes(rng_bytes)}
    faults.at_phase("after_some_shards")

    gathered: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(gathered, mine)  # barrier: every rank's files are durable
    files: dict[str, dict[str, Any]] = {}
    for part in gathered:
        files.update(part or {})

    if rank == 0:
        trainer_bytes = storage.write_json(trainer, "states", name, "trainer.json")
        files["trainer.json"] = {"size": len(trainer_bytes), "sha256": sha256_bytes(trainer_bytes)}
        faults.at_phase("before_manifest")
        manifest = {"format": MANIFEST_FORMAT, "state": name, "created_at": time.time(), "world_size": world,
                    "files": dict(sorted(files.items()))}
        data = _json_bytes(manifest)
        if any(f.phase == "during_manifest" for f in faults.mine):
            # Rehearse a crash half-way through the manifest write: half the bytes under the temp name.
            storage.write_bytes(data[: len(data) // 2], "states", name, "manifest.json.tmp")
            faults.at_phase("during_manifest")
        storage.commit_bytes(data, "states", name, "manifest.json")
    dist.barrier()
    elapsed = time.perf_counter() - t0
    total = sum(f["size"] for f in files.values())
    return SaveResult(name=name, bytes=total, seconds=elapsed, blocked_seconds=elapsed)


def _json_bytes(obj: Any) -> bytes:
    import json

    return json.dumps(obj, indent=1, sort_keys=True).encode()


def delete_state(storage: RunStorage, name: str) -> None:
    """Un-commit first (manifest), then remove: a half-deleted directory is torn, never 'resumable'."""
    if storage.exists("states", name, "manifest.json"):
        storage.fs.rm(storage.path("states", name, "manifest.json"))
    storage.delete_tree("states", name)
