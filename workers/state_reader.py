"""The state reader: fetch a chosen state, verify every byte against the manifest, then load.

DeepSpeed's own checkpoint files are pickles, so they are only handed to DeepSpeed after their
size and checksum matched the manifest; syncpoint's own files (JSON, safetensors) never need pickle.
Every rank fetches the whole ``engine/`` directory because DeepSpeed's ZeRO loader reads every
data-parallel rank's optimizer shard.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

from policies.candidates import Candidate
from workers.checksum import algorithm_of, matches
from workers.storage import RunStorage


class ChecksumMismatch(Exception):
    pass


@dataclass
class FetchedState:
    local_dir: str  # contains engine/ as DeepSpeed wrote it
    rng_bytes: bytes | None

    def cleanup(self) -> None:
        shutil.rmtree(self.local_dir, ignore_errors=True)


def fetch_state(storage: RunStorage, cand: Candidate, rank: int, *, want_rng: bool = True) -> FetchedState:
    """Download and verify this rank's view of a state; raises ``ChecksumMismatch`` with the file."""
    files = cand.manifest["files"]  # type: ignore[index]
    local = tempfile.mkdtemp(prefix="syncpoint-load-")
    try:
        for rel, info in files.items():
            if not rel.startswith(("engine/", "optim/")):
                continue
            algo = algorithm_of(info)
            size, digest = storage.download_file(os.path.join(local, rel), "states", cand.name, rel, algo=algo)
            if digest != info[algo] or size != info["size"]:
                raise ChecksumMismatch(f"{rel}: {algo} does not match the manifest (content changed after commit)")
        rng_bytes = None
        rel = f"rng/rank_{rank:05d}.safetensors"
        if want_rng and rel in files:
            rng_bytes = storage.read_bytes("states", cand.name, rel)
            if not matches(files[rel], rng_bytes):
                raise ChecksumMismatch(f"{rel}: {algorithm_of(files[rel])} does not match the manifest")
        trainer_bytes = storage.read_bytes("states", cand.name, "trainer.json")
        if not matches(files["trainer.json"], trainer_bytes):
            raise ChecksumMismatch(f"trainer.json: {algorithm_of(files['trainer.json'])} does not match the manifest")
        return FetchedState(local, rng_bytes)
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise


def load_into_engine(engine, fetched: FetchedState, *, module_only: bool = False, optimizer: bool = True,
                     other_world_size: bool = False) -> None:
    """Load a verified state. From another world size, ZeRO-1/2 optimizer state comes from the
    gathered full state (``workers.elastic_state``); ZeRO-0's is whole in DeepSpeed's own file."""
    full = os.path.join(fetched.local_dir, "optim", "full.safetensors")
    cross = other_world_size and engine.zero_optimization_stage() in (1, 2) and optimizer and not module_only
    engine.load_checkpoint(fetched.local_dir, tag="engine", load_module_strict=True,
                           load_optimizer_states=optimizer and not module_only and not cross,
                           load_lr_scheduler_states=False, load_module_only=module_only or cross)
    if cross:
        from workers.elastic_state import load_full_optimizer_state

        with open(full, "rb") as f:
            load_full_optimizer_state(engine, f.read())
