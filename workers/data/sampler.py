"""Data position: a deterministic global sampler where skipping is index arithmetic.

Why: resuming at micro-step 10^5 must not load, decode or transform 10^5 batches. The epoch's
order is a pure function of (seed, epoch); each rank's slice of each global micro-batch is
arithmetic on it, so starting at any position costs the same. The order is computed per position
(``syncpoint.workers.data.index_permutation``: a keyed bijection, O(1) memory and start-up at any dataset size);
states written before it keep the materialised ``torch.randperm`` of the epoch
(``syncpoint.policies.contracts.state_format.LEGACY_SAMPLER``), and a run continues with its state's sampler. Data-side
randomness (random augmentation in ``__getitem__``, random collate, DataLoader worker processes) is made a function of
(seed, epoch, sample index) by seeding every RNG around each sample fetch and each batch's collate, so a resumed run, a
run with worker processes and a run on another world size all see the same sample values.
Generators the task keeps on its dataset or collate (``np.random.default_rng``, ``random.Random``,
``torch.Generator``; found by ``syncpoint.workers.training.task_rngs``) are reseeded the same way, each from its own
path, in whichever process runs the fetch, and put back afterwards.
"""

from __future__ import annotations

import bisect
import contextlib
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from syncpoint.policies.contracts.errors import DataLayoutError
from syncpoint.policies.contracts.state_format import LEGACY_SAMPLER, SAMPLER_VERSION, SHARD_WINDOW_SAMPLER
from syncpoint.workers.data.index_permutation import FEW_POSITIONS, FeistelPermutation
from syncpoint.workers.task import MapDataset
from syncpoint.workers.training.rng import derive_seed
from syncpoint.workers.training.task_rngs import DataGenerators, get_state, reseed, set_state

# Salts: the part of each derived seed that names the stream it seeds, so two streams of the same
# (seed, epoch) never coincide. A sample's own seed, (seed, epoch, index), needs none. The values
# are part of the resume contract (old states must resume to the same samples): never change them.
EPOCH_PERMUTATION_SALT = 0x5EED  # the order of the epoch's samples
COLLATE_SALT = 0xC011A7E  # a micro-batch's collate, followed by the batch's sample indices
DATALOADER_GENERATOR_SALT = 0xDA7A  # the DataLoader's own generator (worker base seeds)
SHARD_ORDER_SALT = 0x5A4D  # shard-window/v1: the epoch's shard order
WINDOW_ROWS_SALT = 0x3140  # shard-window/v1: the order of the rows within one window (followed by its number)

# The most sample indices computed ahead in one call of the order (a few KiB): the order's cost per
# call is mostly NumPy's per-operation overhead, so an epoch's indices are computed in chunks.
INDEX_CHUNK_SAMPLES = 4096


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The legacy sampler's whole epoch order (``LEGACY_SAMPLER``): num_samples int64s per rank."""
    g = torch.Generator().manual_seed(derive_seed(seed, epoch, EPOCH_PERMUTATION_SALT))
    return torch.randperm(num_samples, generator=g)


class ShardWindowOrder:
    """shard-window/v1: an epoch order that reads a sharded corpus a few shards at a time.

    The epoch's shard order is a keyed permutation of the shards (``(seed, epoch)``); consecutive
    runs of ``window`` shards of that order form windows, and the rows of each window are permuted
    among themselves (keyed by ``(seed, epoch, window)``). Position ``p`` of the epoch lies in the
    window whose prefix sum of row counts covers it, so any position maps to its sample in
    O(log shards) with O(shards) memory, and the order depends on nothing but the seed, the epoch,
    the shards' row counts (index order) and ``window``: the same at every world size.

    Randomness: every sample once per epoch and every epoch another order, but a micro-batch (and
    every step until the window is used up) draws from at most ``window`` shards, so samples stored
    together are trained together; a global permutation mixes the whole corpus into every batch.
    """

    def __init__(self, shard_rows: Sequence[int], window: int, seed: int, epoch: int) -> None:
        # Few NumPy calls: a resume builds this before its first batch, in a process whose first
        # calls of each NumPy operation cost tens of microseconds.
        rows = np.asarray(shard_rows, dtype=np.int64)
        if rows.ndim != 1 or not len(rows) or rows.min() < 0:
            raise ValueError("a shard-window order needs at least one shard with rows")
        n = len(rows)
        self.window, self.seed, self.epoch = int(window), seed, epoch
        self.shard_start = np.zeros(n + 1, np.int64)  # each shard's first sample index
        np.cumsum(rows, out=self.shard_start[1:])
        self.size = int(self.shard_start[-1])
        if not self.size:
            raise ValueError("a shard-window order needs at least one shard with rows")
        self.shards = FeistelPermutation(n, seed, epoch, SHARD_ORDER_SALT).table()
        self.ordered_start = np.zeros(n + 1, np.int64)  # each ordered shard's first position
        np.cumsum(rows[self.shards], out=self.ordered_start[1:])
        # each window's first position, and the epoch's end
        self.window_start = np.concatenate((self.ordered_start[0 : n : self.window], self.ordered_start[n:]))
        self._rows: dict[int, FeistelPermutation] = {}

    @property
    def windows(self) -> int:
        return len(self.window_start) - 1

    def window_of(self, position: int) -> int:
        return int(np.searchsorted(self.window_start, position, side="right") - 1)

    def window_shards(self, window: int) -> np.ndarray:
        """The shards (index numbers) of one window, in the epoch's shard order."""
        return self.shards[window * self.window : (window + 1) * self.window]

    def shards_from(self, position: int, count: int) -> list[int]:
        """The first ``count`` shards the epoch reads from ``position`` on (its window first)."""
        first = self.window_of(position) * self.window
        return [int(s) for s in self.shards[first : first + count]]

    def _window_rows(self, window: int) -> FeistelPermutation:
        perm = self._rows.get(window)
        if perm is None:
            if len(self._rows) > 4:
                self._rows.clear()
            n = int(self.window_start[window + 1] - self.window_start[window])
            perm = self._rows[window] = FeistelPermutation(n, self.seed, self.epoch, WINDOW_ROWS_SALT, window)
        return perm

    def at(self, positions: Sequence[int]) -> list[int]:
        """``self(positions)`` for a few positions (a micro-batch), on Python ints (``FeistelPermutation.at``)."""
        out = []
        for q in positions:
            if not 0 <= q < self.size:
                raise IndexError(f"positions must lie in [0, {self.size}), got {q}")
            w = bisect.bisect_right(self.window_start, q) - 1
            start = int(self.window_start[w])
            placed = start + self._window_rows(w).at([q - start])[0]
            o = bisect.bisect_right(self.ordered_start, placed) - 1
            out.append(int(self.shard_start[self.shards[o]]) + placed - int(self.ordered_start[o]))
        return out

    def __call__(self, positions: np.ndarray | list[int] | range) -> np.ndarray:
        """The sample index at each position (``0 <= position < size``), as int64."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (p.min() < 0 or p.max() >= self.size):
            raise IndexError(f"positions must lie in [0, {self.size}), got [{p.min()}, {p.max()}]")
        windows = np.searchsorted(self.window_start, p, side="right") - 1
        placed = np.empty_like(p)  # each position's place in the window-shuffled order
        for w in np.unique(windows):
            at = windows == w
            start = self.window_start[w]
            placed[at] = start + self._window_rows(int(w))(p[at] - start)
        ordered = np.searchsorted(self.ordered_start, placed, side="right") - 1
        shard = self.shards[ordered]
        return self.shard_start[shard] + (placed - self.ordered_start[ordered])


def epoch_order(
    sampler: str,
    num_samples: int,
    seed: int,
    epoch: int,
    *,
    shard_rows: Sequence[int] | None = None,
    window_shards: int | None = None,
) -> Callable[[np.ndarray], np.ndarray]:
    """positions -> sample indices for one epoch, by the state's sampler version (shard-window/v1
    also needs the corpus's shard row counts and its window)."""
    if sampler == SAMPLER_VERSION:
        return FeistelPermutation(num_samples, seed, epoch, EPOCH_PERMUTATION_SALT)
    if sampler == LEGACY_SAMPLER:
        permutation = epoch_permutation(num_samples, seed, epoch).numpy()
        return lambda positions: permutation[positions]
    if sampler == SHARD_WINDOW_SAMPLER:
        if shard_rows is None or window_shards is None:
            raise ValueError(f"sampler {SHARD_WINDOW_SAMPLER} needs the corpus's shard rows and window")
        order = ShardWindowOrder(shard_rows, window_shards, seed, epoch)
        if order.size != num_samples:
            raise ValueError(f"the corpus's shards hold {order.size} rows, the dataset {num_samples}")
        return order
    raise ValueError(
        f"unknown sampler {sampler!r} (known: {SAMPLER_VERSION}, {LEGACY_SAMPLER}, {SHARD_WINDOW_SAMPLER})"
    )


def micro_batches_per_epoch(num_samples: int, micro_batch_size: int, world_size: int) -> int:
    """Whole global micro-batches in an epoch; ``DataLayoutError`` when not even one fits."""
    global_batch = micro_batch_size * world_size
    n = num_samples // global_batch
    if n < 1:
        raise DataLayoutError(
            f"the dataset has {num_samples} samples, fewer than one global micro-batch "
            f"(train.micro_batch_size {micro_batch_size} x {world_size} workers = {global_batch}); "
            "use more samples, a smaller micro_batch_size or fewer workers"
        )
    return n


class RankMicroBatches(Sampler[list[int]]):
    """This rank's sample indices for micro-batches ``start..micro_batches_per_epoch-1`` of one epoch.

    Constructing it at any position costs the same as at 0 and touches no sample: with the default
    sampler nothing at all (each micro-batch's indices are computed when it is fetched), with the
    legacy one a whole permutation.
    """

    def __init__(
        self,
        num_samples: int,
        micro_batch_size: int,
        world_size: int,
        rank: int,
        seed: int,
        epoch: int,
        start: int,
        samples_per_epoch: int | None = None,
        sampler: str = SAMPLER_VERSION,
        *,
        shard_rows: Sequence[int] | None = None,
        window_shards: int | None = None,
    ) -> None:
        self.micro_batch_size, self.world_size, self.rank = micro_batch_size, world_size, rank
        self.micro_batches_per_epoch = micro_batches_per_epoch(
            samples_per_epoch or num_samples, micro_batch_size, world_size
        )
        self.start = start
        self.order = epoch_order(sampler, num_samples, seed, epoch, shard_rows=shard_rows, window_shards=window_shards)
        # told each global micro-batch's positions (first, count) before this rank's part is yielded
        # (a sharded corpus's prefetcher)
        self.on_position: Callable[[int, int], None] | None = None

    def indices(self, micro_batch: int) -> list[int]:
        return self._indices(micro_batch, 1)[0]

    def _indices(self, first_micro_batch: int, count: int) -> list[list[int]]:
        """This rank's indices for ``count`` micro-batches from ``first_micro_batch``, in one call of
        the order: the same values as ``count`` calls, at one call's NumPy overhead."""
        global_micro_batch = self.micro_batch_size * self.world_size
        at = getattr(self.order, "at", None)
        if count * self.micro_batch_size <= FEW_POSITIONS and at is not None:
            base = first_micro_batch * global_micro_batch + self.rank * self.micro_batch_size
            return [
                at(range(base + k * global_micro_batch, base + k * global_micro_batch + self.micro_batch_size))
                for k in range(count)
            ]
        firsts = (first_micro_batch + np.arange(count)) * global_micro_batch + self.rank * self.micro_batch_size
        positions = (firsts[:, None] + np.arange(self.micro_batch_size)[None, :]).ravel()
        return self.order(positions).reshape(count, self.micro_batch_size).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        global_micro_batch = self.micro_batch_size * self.world_size
        ahead = 1  # the first micro-batch alone (a resume's first fetch waits on it), then chunks
        i = self.start
        while i < self.micro_batches_per_epoch:
            count = min(ahead, self.micro_batches_per_epoch - i)
            for k, indices in enumerate(self._indices(i, count)):
                if self.on_position is not None:
                    self.on_position((i + k) * global_micro_batch, global_micro_batch)
                yield indices
            i += count
            ahead = max(1, min(INDEX_CHUNK_SAMPLES // self.micro_batch_size, 2 * ahead))

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
        with _streams_restored():
            return self._seeded(index)

    def _seeded(self, index: int) -> Any:
        """One sample with every stream seeded from its index (the caller restores them)."""
        with self._seeding(index):
            return self.dataset[index]

    @contextlib.contextmanager
    def _seeding(self, index: int) -> Iterator[None]:
        seed, i = self.seed, int(index)
        _seed_streams(derive_seed(seed, self.epoch, i))
        with _reseeded(self.generators, seed, self.epoch, i):
            yield

    def __getitems__(self, indices: list[int]) -> SeededBatch:
        """A micro-batch: each sample seeded by its index, and the batch itself by its indices, so
        the user's collate sees the same randomness wherever and whenever the batch is built. The
        caller's streams are saved and restored once per batch (saving NumPy's costs more than
        seeding it); each sample's values depend on its own seed only. A dataset that reads a batch
        at once (``seeded_items``, a sharded corpus) seeds each sample's randomness through
        ``_seeding`` itself."""
        many = getattr(self.dataset, "seeded_items", None)
        with _StreamsGuard() as guard:
            if callable(many):

                def seeding(index: int) -> contextlib.AbstractContextManager[None]:
                    guard.save()
                    return self._seeding(index)

                samples = many(indices, seeding)
            else:
                guard.save()
                samples = [self._seeded(i) for i in indices]
            batch = SeededBatch(samples)
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
        if seed is None or self.collate is default_collate:  # torch's stacks and draws nothing: no seeding
            return self.collate(batch)
        with _seeded_rngs(seed), _reseeded(self.generators, seed):
            return self.collate(list(batch))


@contextlib.contextmanager
def _streams_restored() -> Iterator[None]:
    """Python, NumPy and torch CPU as they were before the block, whatever it seeds or draws."""
    with _StreamsGuard() as guard:
        guard.save()
        yield


class _StreamsGuard:
    """Python, NumPy and torch CPU put back at exit as they were before the first ``save()``; nothing
    saved, nothing to put back. Why lazy: saving NumPy's stream costs ~40 us, and a batch whose
    samples seed nothing (a corpus read without a transform) should not pay it every micro-batch."""

    def __init__(self) -> None:
        self.saved: tuple[Any, Any, torch.Tensor] | None = None

    def save(self) -> None:
        if self.saved is None:
            self.saved = (random.getstate(), np.random.get_state(), torch.get_rng_state())

    def __enter__(self) -> _StreamsGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            py_state, np_state, torch_state = self.saved
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)


def _seed_streams(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.default_generator.manual_seed(seed)  # CPU only: torch.manual_seed also seeds every device (100x slower)


@contextlib.contextmanager
def _seeded_rngs(seed: int) -> Iterator[None]:
    """Python, NumPy and torch CPU seeded for the block, each restored afterwards."""
    with _streams_restored():
        _seed_streams(seed)
        yield


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


def epoch_loader(
    dataset: MapDataset,
    *,
    micro_batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
    epoch: int,
    start: int,
    collate: Any,
    num_workers: int,
    samples_per_epoch: int | None = None,
    sampler: str = SAMPLER_VERSION,
    window_shards: int | None = None,
) -> DataLoader:
    """A DataLoader over this rank's remaining micro-batches of ``epoch``.

    It gets its own generator so creating it never draws from the global torch RNG (which would
    shift the model's dropout stream between a resumed and an uninterrupted run). A sharded corpus
    (``syncpoint.workers.data.corpus``) is told each micro-batch's position, so it fetches the shards from there on.
    """
    shard_rows = getattr(dataset, "shard_rows", None) if sampler == SHARD_WINDOW_SAMPLER else None
    batches = RankMicroBatches(
        len(dataset),
        micro_batch_size,
        world_size,
        rank,
        seed,
        epoch,
        start,
        samples_per_epoch,
        sampler,
        shard_rows=shard_rows,
        window_shards=window_shards,
    )
    follow = getattr(dataset, "follow", None)
    if callable(follow):
        batches.on_position = follow(batches.order)
    return DataLoader(
        SeededSamples(dataset, seed, epoch),
        batch_sampler=batches,
        collate_fn=SeededCollate(collate),
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(derive_seed(seed, epoch, DATALOADER_GENERATOR_SALT)),
    )
