"""Where the loop's micro-batches come from: a map-style dataset or a stream, behind one face.

Why: the loop asks only for each epoch's remaining micro-batches, for the sample ids of one when
``train.record_samples`` is on, and, at a save, for this rank's data position beyond the counters
``trainer.json`` holds. A map-style dataset answers with a DataLoader per epoch over this rank's
slice of the epoch order (``syncpoint.workers.data.sampler``; its position is index arithmetic, nothing to save); a
stream with the rank's stream and its saved state (``syncpoint.workers.data.stream``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from syncpoint.workers.data.sampler import epoch_loader
from syncpoint.workers.data.stream import PreparedStream, StreamSource
from syncpoint.workers.data.stream_state import SavedStream
from syncpoint.workers.task import Task
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.position import TrainingPosition


class MapSource:
    """A map-style dataset: one DataLoader per epoch, starting at the position's micro-batch."""

    capture: Callable[[], bytes] | None = None  # the position is trainer.json's counters

    def __init__(self, attempt: Attempt, task: Task, sampler: str) -> None:
        self.attempt, self.task, self.sampler = attempt, task, sampler
        self.loader: Any = None

    def epoch(self, at: TrainingPosition) -> Iterable[Any]:
        train = self.attempt.spec.train
        self.loader = epoch_loader(
            self.task.dataset,
            micro_batch_size=train.micro_batch_size,
            world_size=self.attempt.world_size,
            rank=self.attempt.rank,
            seed=train.seed,
            epoch=at.epoch,
            start=at.position_in_epoch,
            collate=self.task.collate,
            num_workers=train.dataloader_workers,
            samples_per_epoch=self.attempt.layout.samples_per_epoch,
            sampler=self.sampler,
            window_shards=self.attempt.live.identity.data.window_shards,
        )
        return self.loader

    def sample_ids(self, micro_batch: int) -> list[int]:
        return self.loader.batch_sampler.indices(micro_batch)

    def close(self) -> None:
        """Nothing outlives an epoch's DataLoader."""


class StreamBatches:
    """A stream: the rank's micro-batches continue across epochs from its restored position."""

    def __init__(self, attempt: Attempt, prepared: PreparedStream, saved: SavedStream | None) -> None:
        train = attempt.spec.train
        self.per_epoch = attempt.layout.micro_batches_per_epoch
        self.source = StreamSource(
            prepared, seed=train.seed, rank=attempt.rank, num_workers=train.dataloader_workers, saved=saved
        )
        self.capture: Callable[[], bytes] | None = self.source.capture

    def epoch(self, at: TrainingPosition) -> Iterable[Any]:
        return self.source.epoch(self.per_epoch - at.position_in_epoch)

    def sample_ids(self, micro_batch: int) -> list[int]:
        raise AssertionError("a stream records no sample ids (refused at start: train.record_samples)")

    def close(self) -> None:
        self.source.close()


DataSource = MapSource | StreamBatches


def data_source(
    attempt: Attempt, task: Task, prepared: PreparedStream | None, *, sampler: str, saved: SavedStream | None
) -> DataSource:
    """The loop's source of micro-batches (``saved``: this rank's stream position, when resuming one)."""
    if prepared is None:
        return MapSource(attempt, task, sampler)
    return StreamBatches(attempt, prepared, saved)
