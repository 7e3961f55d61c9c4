"""Sync-boundary arithmetic: the single source of truth for where optimizer steps fire.

Why a module of its own: the loop, the state classifier and the tests must all agree on what a
boundary is, and the answer must come from the 1-indexed position *within the epoch* (not from a
global counter modulo accumulation), because the epoch end flushes a short cycle.
With 10 micro-batches per epoch and accumulation 4, steps fire after global micro-steps
4, 8, 10, 14, 18, 20, ...
"""

from __future__ import annotations

from dataclasses import dataclass


def is_boundary(position_in_epoch: int, grad_accum: int, micro_batches_per_epoch: int) -> bool:
    """True when the micro-batch at this 1-indexed position fills the quota or ends the epoch."""
    if position_in_epoch < 1 or position_in_epoch > micro_batches_per_epoch:
        return False
    return position_in_epoch % grad_accum == 0 or position_in_epoch == micro_batches_per_epoch


def cycle_length(position_in_epoch: int, grad_accum: int, micro_batches_per_epoch: int) -> int:
    """How many micro-batches the cycle containing this position accumulates.

    Full cycles hold ``grad_accum``; the short cycle at the epoch end holds the remainder. The
    loop divides each micro-batch loss by this number so a short cycle averages over the
    micro-batches it really accumulated.
    """
    full_cycles_end = (micro_batches_per_epoch // grad_accum) * grad_accum
    if position_in_epoch > full_cycles_end:
        return micro_batches_per_epoch - full_cycles_end
    return grad_accum


def optimizer_steps_per_epoch(grad_accum: int, micro_batches_per_epoch: int) -> int:
    """Number of optimizer steps one epoch performs (ceil: the short cycle is a real step)."""
    return -(-micro_batches_per_epoch // grad_accum)


@dataclass(frozen=True)
class Position:
    """Where a run stands after ``global_micro_step`` micro-batches (0 = nothing consumed)."""

    epoch: int  # 0-indexed epoch that holds the next micro-batch to consume
    position_in_epoch: int  # micro-batches of ``epoch`` already consumed (0..micro_batches_per_epoch)
    global_micro_step: int
    optimizer_step: int


def position_after(global_micro_step: int, grad_accum: int, micro_batches_per_epoch: int) -> Position:
    """Pure arithmetic from a global micro-step to (epoch, position, optimizer step).

    A state saved at the end of an epoch is reported as (epoch, micro_batches_per_epoch) so it round-trips exactly to
    what the writer recorded; the loop rolls it over to the next epoch when it resumes.
    """
    if global_micro_step == 0:
        return Position(0, 0, 0, 0)
    epoch, pos = divmod(global_micro_step, micro_batches_per_epoch)
    if pos == 0:
        epoch, pos = epoch - 1, micro_batches_per_epoch
    steps = epoch * optimizer_steps_per_epoch(grad_accum, micro_batches_per_epoch)
    steps += sum(1 for p in _boundaries_up_to(pos, grad_accum, micro_batches_per_epoch))
    return Position(epoch, pos, global_micro_step, steps)


def _boundaries_up_to(pos: int, grad_accum: int, micro_batches_per_epoch: int) -> list[int]:
    full = pos // grad_accum
    out = [grad_accum * i for i in range(1, full + 1)]
    if pos == micro_batches_per_epoch and micro_batches_per_epoch % grad_accum:
        out.append(micro_batches_per_epoch)
    return out


def boundary_micro_steps(grad_accum: int, micro_batches_per_epoch: int, epochs: int) -> list[int]:
    """Every global micro-step after which an optimizer step fires: the contract's list (10 micro-batches,
    accumulation 4: 4, 8, 10, 14, 18, 20, ...), which the tests check the loop against."""
    out = []
    for e in range(epochs):
        for p in range(1, micro_batches_per_epoch + 1):
            if is_boundary(p, grad_accum, micro_batches_per_epoch):
                out.append(e * micro_batches_per_epoch + p)
    return out
