"""Elastic layout arithmetic: keep the global batch, and so the samples of every optimizer step,
constant when the number of workers changes.

Global batch G = micro_batch_size x max_workers x grad_accum (``grad_accum`` is stated for the
largest world size). On W workers the accumulation becomes G / (micro_batch_size x W), which must
be an integer: 2 workers x 4 -> 1 worker x 8. An epoch uses the largest multiple of
micro_batch_size x lcm(allowed world sizes) samples of its permutation, so every allowed world
size sees the same epoch, the same cycles and the same short epoch-end cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from syncpoint.policies.contracts.errors import DataLayoutError, ElasticLayoutError


def allowed_world_sizes(micro_batch_size: int, grad_accum: int, min_workers: int, max_workers: int) -> list[int]:
    """The world sizes in ``[min_workers, max_workers]`` that keep the global batch of
    ``max_workers`` (``micro_batch_size x max_workers x grad_accum``) with a whole accumulation: an
    optimizer step then sees the same samples on every allowed world size."""
    g = micro_batch_size * max_workers * grad_accum
    return [w for w in range(min_workers, max_workers + 1) if g % (micro_batch_size * w) == 0]


@dataclass(frozen=True)
class Layout:
    """How one world size walks an epoch with the global batch held fixed."""

    world_size: int
    micro_batch_size: int
    grad_accum: int  # at this world size
    global_batch: int  # samples per full optimizer step, identical for every allowed world size
    samples_per_epoch: int  # usable samples of each epoch's permutation
    micro_batches_per_epoch: int  # at this world size

    def position_for(self, samples_in_epoch: int) -> int:
        per_micro = self.micro_batch_size * self.world_size
        if samples_in_epoch % per_micro:
            raise ElasticLayoutError(
                f"{samples_in_epoch} samples into the epoch is not a whole number of micro-batches on "
                f"{self.world_size} worker(s)"
            )
        return samples_in_epoch // per_micro


def layout(
    num_samples: int,
    micro_batch_size: int,
    grad_accum: int,
    world_size: int,
    min_workers: int | None = None,
    max_workers: int | None = None,
) -> Layout:
    """The layout at ``world_size``; ``ElasticLayoutError`` (naming the sizes that work) when the
    global batch cannot be kept there.

    Args:
        num_samples: the dataset's size; an epoch uses the largest multiple of
            ``micro_batch_size x lcm(allowed world sizes)`` below it, so every allowed world size
            sees the same samples per epoch.
        grad_accum: the accumulation at ``max_workers`` (the spec's); smaller worlds accumulate more.
        min_workers, max_workers: the elastic range (``scaling``); ``None``: ``world_size`` alone.
    """
    lo, hi = min_workers or world_size, max_workers or world_size
    allowed = allowed_world_sizes(micro_batch_size, grad_accum, lo, hi)
    if world_size not in allowed:
        raise ElasticLayoutError(
            f"cannot keep the global batch ({micro_batch_size} x {hi} workers x {grad_accum} = "
            f"{micro_batch_size * hi * grad_accum} samples) on {world_size} worker(s): the accumulation would not "
            f"be a whole number. World sizes that work: {allowed}"
        )
    unit = micro_batch_size * math.lcm(*allowed)
    usable = num_samples // unit * unit
    if usable == 0:
        raise DataLayoutError(
            f"the dataset has {num_samples} samples, fewer than one global micro-batch "
            f"(train.micro_batch_size {micro_batch_size} x {unit // micro_batch_size} workers = {unit}); "
            "use more samples, a smaller micro_batch_size or fewer workers"
        )
    g = micro_batch_size * hi * grad_accum
    return Layout(
        world_size,
        micro_batch_size,
        g // (micro_batch_size * world_size),
        g,
        usable,
        usable // (micro_batch_size * world_size),
    )


# A stream without a declared epoch (train.stream_epoch_steps) runs in one epoch no run reaches the
# end of (train.max_steps <= 10**9 optimizer steps): no epoch-end short cycle, a boundary every
# grad_accum micro-steps.
UNBOUNDED_STREAM_EPOCH_STEPS = 1 << 40


def stream_layout(micro_batch_size: int, grad_accum: int, world_size: int, epoch_steps: int | None) -> Layout:
    """A stream's layout: it has no length, so its epoch is what the job declares, in optimizer
    steps (or unbounded), and each rank draws one micro-batch per micro-step from its own stream."""
    per_epoch = grad_accum * (epoch_steps or UNBOUNDED_STREAM_EPOCH_STEPS)
    per_micro = micro_batch_size * world_size
    return Layout(world_size, micro_batch_size, grad_accum, per_micro * grad_accum, per_epoch * per_micro, per_epoch)
