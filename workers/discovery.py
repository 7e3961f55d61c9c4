"""Discovery: turn a run directory into classified candidates, reading metadata only.

For each ``states/<name>/`` it lists files (sizes from the listing) and reads ``manifest.json`` and
``trainer.json``; it never opens engine shards, RNG files or data. The classification itself is a
plain function in ``policies.candidates``.
"""

from __future__ import annotations

import json

from policies.candidates import Candidate, Expectation, classify, newest_first
from workers.storage import RunStorage

STATES = "states"


def read_candidate(storage: RunStorage, name: str) -> Candidate:
    c = Candidate(name=name, listing=storage.listing(STATES, name))
    if "manifest.json" in c.listing:
        try:
            c.manifest = json.loads(storage.read_bytes(STATES, name, "manifest.json"))
            if not isinstance(c.manifest, dict):
                c.manifest, c.manifest_error = None, "not a JSON object"
        except (ValueError, UnicodeDecodeError) as e:
            c.manifest_error = f"not JSON ({e.__class__.__name__}: {e})"
    if "trainer.json" in c.listing:
        try:
            c.trainer = json.loads(storage.read_bytes(STATES, name, "trainer.json"))
            if not isinstance(c.trainer, dict):
                c.trainer, c.trainer_error = None, "not a JSON object"
        except (ValueError, UnicodeDecodeError) as e:
            c.trainer_error = f"not JSON ({e.__class__.__name__})"
    return c


def discover(storage: RunStorage, expectation: Expectation | None = None) -> list[Candidate]:
    """Every candidate, newest first; classified when an expectation is given."""
    cands = [read_candidate(storage, name) for name in storage.list_dirs(STATES)]
    if expectation is not None:
        for c in cands:
            classify(c, expectation)
    return newest_first(cands)


def expectation_from_trainer(trainer: dict) -> Expectation:
    """The expectation a state itself implies (used by ``syncpoint states`` without a live run)."""
    return Expectation(
        job_identity=trainer.get("job_identity", ""), world_size=trainer.get("world_size", 0),
        micro_batch_size=trainer.get("micro_batch_size", 0), grad_accum=trainer.get("grad_accum", 0),
        micro_batches_per_epoch=trainer.get("micro_batches_per_epoch", 0), zero_stage=trainer.get("zero_stage", -1),
        model_fingerprint=trainer.get("model_fingerprint", ""), seed=trainer.get("seed", -1))
