"""Data position: a deterministic global sampler where skipping is index arithmetic.

Why: resuming at micro-step 10^5 must not load, decode or transform 10^5 batches. The epoch's
order is a pure function of (seed, epoch); each rank's slice of each global micro-batch is
arithmetic on it, so starting at any position costs the same. The order is computed per position
(``workers.index_permutation``: a keyed bijection, O(1) memory and start-up at any dataset size);
states written before it keep the materialised ``torch.randperm`` of the epoch
(``policies.state_format.LEGACY_SAMPLER``), and a run continues with its state's sampler. Data-side randomness (random
augmentation in ``__getitem__``, random collate, DataLoader worker processes) is made a function of
(seed, epoch, sample index) by seeding every RNG around each sample fetch and each batch's collate, so a resumed run, a
run with worker processes and a run on another world size all see the same sample values.
Generators the task keeps on its dataset or collate (``np.random.default_rng``, ``random.Random``,
``torch.Generator``; found by ``workers.task_rngs``) are reseeded the same way, each from its own
path, in whichever process runs the fetch, and put back afterwards.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from policies.errors import DataLayoutError
from policies.state_format import LEGACY_SAMPLER, SAMPLER_VERSION
from workers.index_permutation import FeistelPermutation
from workers.rng import derive_seed
from workers.task import MapDataset
from workers.task_rngs import DataGenerators, get_state, reseed, set_state

# Salts: the part of each derived seed that names the stream it seeds, so two streams of the same
# (seed, epoch) never coincide. A sample's own seed, (seed, epoch, index), needs none. The values
# are part of the resume contract (old states must resume to the same samples): never change them.
EPOCH_PERMUTATION_SALT = 0x5EED  # the order of the epoch's samples
COLLATE_SALT = 0xC011A7E  # a micro-batch's collate, followed by the batch's sample indices
DATALOADER_GENERATOR_SALT = 0xDA7A  # the DataLoader's own generator (worker base seeds)


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The legacy sampler's whole epoch order (``LEGACY_SAMPLER``): num_samples int64s per rank."""
    g = torch.Generator().manual_seed(derive_seed(seed, epoch, EPOCH_PERMUTATION_SALT))
    return torch.randperm(num_samples, generator=g)


def epoch_order(sampler: str, num_samples: int, seed: int, epoch: int) -> Callable[[np.ndarray], np.ndarray]:
    """positions -> sample indices for one epoch, by the state's sampler version."""
    if sampler == SAMPLER_VERSION:
        return FeistelPermutation(num_samples, seed, epoch, EPOCH_PERMUTATION_SALT)
    if sampler == LEGACY_SAMPLER:
        permutation = epoch_permutation(num_samples, seed, epoch).numpy()
        return lambda positions: permutation[positions]
    raise ValueError(f"unknown sampler {sampler!r} (known: {SAMPLER_VERSION}, {LEGACY_SAMPLER})")


def micro_batches_per_epoch(num_samples: int, micro_batch_size: int, world_size: int) -> int:
    global_batch = micro_batch_size * world_size
    n = num_samples // global_batch
    if n < 1:
        raise DataLayoutError(
            f"the dataset has {num_samples} samples, fewer than one global micro-batch "
            f"(train.micro_batch_size {micro_batch_size} x {world_size} workers = {global_batch}); "
            "use more samples, a smaller micro_batch_size or fewer workers")
    return n


class RankMicroBatches(Sampler[list[int]]):
    """This rank's sample indices for micro-batches ``start..micro_batches_per_epoch-1`` of one epoch.

    Constructing it at any position costs the same as at 0 and touches no sample: with the default
    sampler nothing at all (each micro-batch's indices are computed when it is fetched), with the
    legacy one a whole permutation.
    """

    def __init__(self, num_samples: int, micro_batch_size: int, world_size: int, rank: int,
                 seed: int, epoch: int, start: int, samples_per_epoch: int | None = None,
                 sampler: str = SAMPLER_VERSION) -> None:
        self.micro_batch_size, self.world_size, self.rank = micro_batch_size, world_size, rank
        self.micro_batches_per_epoch = micro_batches_per_epoch(samples_per_epoch or num_samples, micro_batch_size,
                                                               world_size)
        self.start = start
        self.order = epoch_order(sampler, num_samples, seed, epoch)

    def indices(self, micro_batch: int) -> list[int]:
        global_micro_batch = self.micro_batch_size * self.world_size
        first = micro_batch * global_micro_batch + self.rank * self.micro_batch_size
        return self.order(np.arange(first, first + self.micro_batch_size)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for i in range(self.start, self.micro_batches_per_epoch):
            yield self.indices(i)

    def __len__(self) -> int:
        return self.micro_batches_per_epoch - self.start


class SeededSamples(Dataset):
    """Wraps the user's dataset so each sample's randomness depends only on (seed, epoch, index)."""

    def __init__(self, dataset: MapDataset, seed: int, epoch: int, root: str = "dataset") -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, epoch
        self.generators = DataGenerators(dataset, root)  # the dataset's own, found in each process's copy

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        seed, i = self.seed, int(index)
        with _seeded_rngs(derive_seed(seed, self.epoch, i)), _reseeded(self.generators, seed, self.epoch, i):
            return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> SeededBatch:
        """A micro-batch: each sample seeded by its index, and the batch itself by its indices, so
        the user's collate sees the same randomness wherever and whenever the batch is built."""
        batch = SeededBatch(self[i] for i in indices)
        batch.seed = derive_seed(self.seed, self.epoch, COLLATE_SALT, *(int(i) for i in indices))
        return batch


class SeededBatch(list):
    """The samples of one micro-batch, carrying the seed its collate runs under."""

    seed: int = 0


class SeededCollate:
    """Runs the task's collate (or torch's default) under the batch's own seed, in a DataLoader
    worker and in the main process alike, and leaves the caller's RNG streams untouched.

    Why: per-sample seeding covers ``__getitem__``, but collate runs once per batch, in the worker
    process with a generator that knows nothing of the resume position; random masking or mixing
    in collate would differ after a resume. The batch's seed is a function of (seed, epoch, the
    batch's sample indices), which identify the micro-batch and the rank within the epoch.
    """

    def __init__(self, collate: Callable[[list[Any]], Any] | None) -> None:
        self.collate = collate or default_collate
        self.generators = DataGenerators(self.collate, "collate")

    def __call__(self, batch: list[Any]) -> Any:
        seed = getattr(batch, "seed", None)
        if seed is None:
            return self.collate(batch)
        with _seeded_rngs(seed), _reseeded(self.generators, seed):
            return self.collate(list(batch))


@contextlib.contextmanager
def _seeded_rngs(seed: int) -> Iterator[None]:
    """Python, NumPy and torch CPU seeded for the block, each restored afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % (2**32))
        torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also seeds every device (100x slower)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


@contextlib.contextmanager
def _reseeded(generators: DataGenerators, *seed_parts: int) -> Iterator[None]:
    """Each task-owned generator seeded from ``seed_parts`` and its path for the block, then put
    back: the caller's own draws from a generator it shares with the data stay its own."""
    found = generators.found()
    before = [get_state(g) for _, g in found]
    for salt, g in found:
        reseed(g, derive_seed(*seed_parts, salt))
    try:
        yield
    finally:
        for (_, g), state in zip(found, before, strict=True):
            set_state(g, state)


def epoch_loader(dataset: MapDataset, *, micro_batch_size: int, world_size: int, rank: int, seed: int,
                 epoch: int, start: int, collate: Any, num_workers: int,
                 samples_per_epoch: int | None = None, sampler: str = SAMPLER_VERSION) -> DataLoader:
    """A DataLoader over this rank's remaining micro-batches of ``epoch``.

    It gets its own generator so creating it never draws from the global torch RNG (which would
    shift the model's dropout stream between a resumed and an uninterrupted run).
    """
    batches = RankMicroBatches(len(dataset), micro_batch_size, world_size, rank, seed, epoch, start,
                               samples_per_epoch, sampler)
    return DataLoader(
        SeededSamples(dataset, seed, epoch), batch_sampler=batches, collate_fn=SeededCollate(collate),
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(derive_seed(seed, epoch, DATALOADER_GENERATOR_SALT)),
    )
