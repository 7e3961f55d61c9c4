"""Discovery: turn a run directory into classified candidates, reading metadata only.

For each ``states/<name>/`` it lists files (sizes from the listing) and reads ``manifest.json`` and
``trainer.json``; it never opens engine shards, RNG files or data. The classification itself is a
plain function in ``policies.candidates``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from policies.candidates import Candidate, Expectation, classify, newest_first
from workers.storage import RunStorage

STATES = "states"


def _json_object(storage: RunStorage, name: str, file: str) -> tuple[dict | None, str | None]:
    """A metadata file as (object, None) or (None, why it is unusable)."""
    try:
        obj = json.loads(storage.read_bytes(STATES, name, file))
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"not JSON ({e.__class__.__name__}: {e})"
    return (obj, None) if isinstance(obj, dict) else (None, "not a JSON object")


def read_candidate(storage: RunStorage, name: str) -> Candidate:
    c = Candidate(name=name, listing=storage.listing(STATES, name))
    if "manifest.json" in c.listing:
        c.manifest, c.manifest_error = _json_object(storage, name, "manifest.json")
    if "trainer.json" in c.listing:
        c.trainer, c.trainer_error = _json_object(storage, name, "trainer.json")
    return c


def discover(storage: RunStorage, expectation: Expectation | None = None) -> list[Candidate]:
    """Every candidate, newest first, all read now; classified when an expectation is given."""
    cands = [read_candidate(storage, name) for name in storage.list_names(STATES)]
    if expectation is not None:
        for c in cands:
            classify(c, expectation)
    return newest_first(cands)


def state_order(name: str) -> tuple[int, int, str]:
    """Newest-first order from the directory name alone (our names are zero-padded micro-steps)."""
    return (1, int(name), name) if name.isdigit() else (0, -1, name)


class LazyCandidates(Sequence[Candidate]):
    """Newest-first candidates whose metadata is read (and classified) only when looked at.

    Selection walks newest-first and usually stops at the first resumable state, so choosing
    among 10^4 states reads one or two manifests, not 10^4 (bench/p5_selection.py).
    """

    def __init__(self, storage: RunStorage, expectation: Expectation | None) -> None:
        self.storage, self.expectation = storage, expectation
        self.names = sorted(storage.list_names(STATES), key=state_order, reverse=True)
        self._loaded: dict[int, Candidate] = {}

    def __len__(self) -> int:
        return len(self.names)

    def _load(self, i: int) -> Candidate:
        if i not in self._loaded:
            c = read_candidate(self.storage, self.names[i])
            self._loaded[i] = classify(c, self.expectation) if self.expectation else c
        return self._loaded[i]

    def __getitem__(self, i):  # noqa: ANN001, ANN204
        if isinstance(i, slice):
            return [self._load(j) for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._load(i)

    def inspected(self) -> list[Candidate]:
        """The candidates read so far, newest first (what the event log reports)."""
        return [self._loaded[i] for i in sorted(self._loaded)]


def discover_lazy(storage: RunStorage, expectation: Expectation | None = None) -> LazyCandidates:
    return LazyCandidates(storage, expectation)


def expectation_from_trainer(trainer: dict) -> Expectation:
    """The expectation a state itself implies (used by ``syncpoint states`` without a live run)."""
    return Expectation(
        job_identity=trainer.get("job_identity", ""), world_size=trainer.get("world_size", 0),
        micro_batch_size=trainer.get("micro_batch_size", 0), grad_accum=trainer.get("grad_accum", 0),
        micro_batches_per_epoch=trainer.get("micro_batches_per_epoch", 0), zero_stage=trainer.get("zero_stage", -1),
        model_fingerprint=trainer.get("model_fingerprint", ""), seed=trainer.get("seed", -1))
