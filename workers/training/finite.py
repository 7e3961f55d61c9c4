"""A diverging run stops, and never commits a non-finite state as resumable.

Why it must: a loss that turns NaN does not stop DeepSpeed. With a loss scaler (fp16, and every
ZeRO stage even in fp32) each step's update is skipped ("OVERFLOW! Skipping step") and the run goes
on to "finish" with the weights of its last finite step; without one (ZeRO 0 in fp32 or bf16) the
weights become NaN and every later save commits them. Resumed exactly, a diverged run diverges
again at the same step, so retrying is no remedy either: the run fails, naming where it began.

Why counted at the boundary from agreed values: the agreed loss (every rank's cycle losses, summed
in the boundary vote) and the agreed skipped-update count are the same on every rank, so every rank
counts the same streak and raises at the same boundary (none is left waiting in a collective). The
streak (``train.max_nonfinite_steps``) is not saved with a state: a resumed attempt counts afresh.

Why a skipped update with a finite loss may not count: fp16's dynamic loss scaler starts high (2^16
by default) and finds its scale by overflowing, skipping an update and halving (with hysteresis,
up to ~32 skips before it reaches its minimum), so a healthy fp16 run can skip more steps in a row
early on than the limit allows. While the scaler can still lower its scale, such a skip is the
scaler calibrating: it neither counts nor ends a streak. At its minimum scale, or with a static
scale, a skip counts; a non-finite loss always counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from syncpoint.policies.contracts.errors import TrainingDiverged

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


class NonfiniteSteps:
    """The current streak of non-finite optimizer steps, and its first step."""

    def __init__(self, limit: int) -> None:
        self.limit, self.streak = limit, 0
        self.first: tuple[int, int, str] | None = None  # (optimizer step, micro-step, what happened there)

    def observe(
        self, *, loss: float, skipped: bool, optimizer_step: int, micro_step: int, calibrating: bool = False
    ) -> str | None:
        """Take one optimizer step's agreed facts; the reason to stop when the streak reached the limit.
        ``calibrating``: the loss scaler could still lower its scale (the module docstring)."""
        if math.isfinite(loss) and not skipped:
            self.streak, self.first = 0, None
            return None
        if math.isfinite(loss) and calibrating:
            return None
        self.streak += 1
        if self.first is None:
            what = (
                f"loss {loss}" if not math.isfinite(loss) else f"update skipped (gradients overflowed; loss {loss:.4g})"
            )
            self.first = (optimizer_step, micro_step, what)
        if self.streak < self.limit:
            return None
        step, micro, what = self.first
        return (
            f"the run diverged: {self.streak} optimizer steps in a row had a non-finite loss or an update "
            f"DeepSpeed skipped for overflowing gradients, from optimizer step {step} (micro-step {micro}: "
            f"{what}) on "
            f"(train.max_nonfinite_steps {self.limit}). Resumed, it would diverge there again: lower train.lr or "
            "set train.gradient_clipping, and check the data and Task.loss for inf/NaN; no non-finite state was "
            "committed, so the newest committed state is from before it"
        )


def scaler_calibrating(engine: DeepSpeedEngine) -> bool:
    """Whether the engine's loss scaler is dynamic and above its minimum scale (the same on every
    rank: DeepSpeed agrees overflow across ranks before it updates the scale)."""
    scaler = getattr(getattr(engine, "optimizer", None), "loss_scaler", None)
    if scaler is None or not getattr(scaler, "dynamic", False):
        return False
    scale, floor = getattr(scaler, "cur_scale", None), getattr(scaler, "min_scale", None)
    return isinstance(scale, (int, float)) and isinstance(floor, (int, float)) and scale > floor


def tensors_finite(engine: DeepSpeedEngine) -> bool:
    """This rank's parameters and optimizer state (master weights, moments) are all finite.

    Reads the module's parameters (ZeRO-3's are empty placeholders: their partitions are the
    optimizer's) and every tensor of the innermost torch optimizer: its param groups' tensors (the fp32
    partitions under ZeRO) and its state (the moments), wherever they live (an offloaded state on CPU).
    Not the module's buffers: a mask buffer may hold -inf by design."""
    return all_finite(_state_tensors(engine))


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every floating tensor of ``tensors`` is finite, each memory read once.

    Why ``aminmax`` and not ``isfinite(t).all()``: both are exact (a NaN anywhere makes the min and the
    max NaN, an infinity shows as one of them), but ``isfinite`` writes a boolean tensor as large as
    the state and reads it again: on one CPU thread 480 ms against 35 ms for 256 MB. The same memory
    seen twice (ZeRO 0's optimizer holds the module's own parameters) is read once."""
    seen: set[tuple[int, int, torch.dtype]] = set()
    for t in tensors:
        if not t.numel() or not t.is_floating_point():
            continue
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        low, high = torch.aminmax(t.detach())
        if not (bool(torch.isfinite(low)) and bool(torch.isfinite(high))):
            return False
    return True


def _state_tensors(engine: DeepSpeedEngine) -> list[torch.Tensor]:
    tensors = [p.detach() for p in engine.module.parameters()]
    optimizer: Any = engine.optimizer
    for _ in range(4):  # DeepSpeed's wrappers (ZeRO, fp16) hold the torch optimizer as .optimizer
        if isinstance(optimizer, torch.optim.Optimizer) or not hasattr(optimizer, "optimizer"):
            break
        optimizer = optimizer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        tensors += [p.detach() for g in optimizer.param_groups for p in g["params"]]
        tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def agreed_finite(engine: DeepSpeedEngine, loss: float) -> bool:
    """Whether the state about to be saved is finite on every rank (one all-reduce, every rank calls
    it before a save): the agreed step loss, and each rank's ``tensors_finite``."""
    vote = torch.tensor(
        [0.0 if math.isfinite(loss) and tensors_finite(engine) else 1.0], dtype=torch.float64, device=engine.device
    )
    if dist.is_initialized():
        dist.all_reduce(vote)
    return float(vote.item()) == 0.0


def refused_save(micro_step: int) -> TrainingDiverged:
    """The error when the run's last state is not finite: it is never saved over a good one."""
    return TrainingDiverged(
        f"the state at micro-step {micro_step}, the run's last, is not finite (its loss, parameters or optimizer "
        "moments hold inf/NaN): it was not committed, and the run fails instead of finishing with it. Lower "
        "train.lr or set train.gradient_clipping, and check the data and Task.loss for inf/NaN"
    )
