"""What the training loop carries between micro-steps, and the records it writes at a boundary.

``LoopState`` is everything that changes from one micro-step to the next (the loop object in
``syncpoint.workers.training.loop`` holds only what stays fixed for the attempt), so what a resumed attempt
must rebuild is in one place: the position comes back from the state, the rest starts empty at a
sync boundary, which is the only place a state is ever written.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from syncpoint.policies.contracts.state_format import (
    SHARD_WINDOW_SAMPLER,
    TRAINER_SCHEMA_VERSION,
    DataRecord,
    SchedulerRecord,
    TrainState,
)
from syncpoint.policies.decisions.save_triggers import PendingSave
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.finite import NonfiniteSteps
from syncpoint.workers.training.param_groups import settings_of
from syncpoint.workers.training.position import TrainingPosition

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


@dataclass
class LoopState:
    """What changes between micro-steps: the position, the pending save request, the current
    accumulation cycle's sums, the last boundary's learning rates and the non-finite streak."""

    at: TrainingPosition
    nonfinite: NonfiniteSteps
    pending: PendingSave = field(default_factory=PendingSave)  # carried to the next boundary, never dropped
    finished: bool = False  # the last boundary was serviced (or the resumed state had already finished)
    # this rank's losses since the last boundary: a float64 tensor on the loss's device once a loss is added
    cycle_loss_sum: float | torch.Tensor = 0.0
    cycle_sample_ids: list[list[int]] = field(default_factory=list)  # with train.record_samples
    lrs: list[float] = field(default_factory=list)  # every param group's rate, set at the last boundary

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add one micro-batch's loss to the cycle's sum without reading it on the host.

        Why: ``float(loss)`` at every micro-step is a device-to-host sync on a GPU (the host waits
        for the backward it just queued); the sum is read once, in the boundary vote. Each loss is
        widened to float64 and added in order, the same sum, bit for bit, as Python floats gave."""
        self.cycle_loss_sum = self.cycle_loss_sum + loss.detach().to(torch.float64)

    def new_cycle(self) -> None:
        """A sync boundary (or an epoch's start) begins the next accumulation cycle."""
        self.cycle_loss_sum, self.cycle_sample_ids = 0.0, []


def step_record(
    at: TrainingPosition, loss: float, lrs: list[float], cycle_sample_ids: list[list[int]] | None, world: int
) -> dict[str, Any]:
    """One optimizer step for the progress log (and ``WorkerResult.history``): ``lr`` is the first
    param group's rate, ``lrs`` every group's (only when there are several)."""
    record: dict[str, Any] = {
        "optimizer_step": at.optimizer_step,
        "global_micro_step": at.global_micro_step,
        "epoch": at.epoch,
        "loss": loss,
        "lr": lrs[0],
        "time": time.time(),
    }
    if len(lrs) > 1:
        record["lrs"] = lrs
    if cycle_sample_ids is not None:
        record["samples"] = gather_samples(cycle_sample_ids, world)
    return record


def gather_samples(cycle: list[list[int]], world: int) -> list[int]:
    """Sample ids of one optimizer step, in global order (micro-batch major, rank minor)."""
    parts: list[list[list[int]] | None] = [None] * world
    dist.all_gather_object(parts, cycle)
    return [i for m in range(len(cycle)) for r in range(world) for i in parts[r][m]]  # type: ignore[index]


def trainer_record(
    attempt: Attempt,
    at: TrainingPosition,
    engine: DeepSpeedEngine,
    reasons: list[str],
    *,
    loss: float,
    sampler: str,
    evaluated: dict[str, float] | None = None,
) -> TrainState:
    """``trainer.json``: the position, the identity selection compares, which param-group keys are
    the optimizer's running state, the sampler the run orders its epochs with, and why this state
    was saved; ``evaluated``: the latest evaluation at or before it (``eval_<name>``), for
    ``best-metric``. Every rank calls it."""
    live, spec = attempt.live.identity, attempt.spec
    running = settings_of(engine).running_record(engine.optimizer.param_groups)  # a collective
    # the identity selection compares, field for field (StateIdentity); the records below add the position
    identity = {k: v for k, v in live if k not in ("optimizer", "scheduler", "data")}
    return TrainState(
        schema_version=TRAINER_SCHEMA_VERSION,
        job_name=spec.name,
        **identity,
        optimizer=live.optimizer.model_copy(update={"running": running}),
        epoch=at.epoch,
        position_in_epoch=at.position_in_epoch,
        global_micro_step=at.global_micro_step,
        optimizer_step=at.optimizer_step,
        scheduler=SchedulerRecord.of(spec.train.scheduler, at.schedule_position),
        schedule_horizon=attempt.run_length.schedule_horizon,
        data=DataRecord(
            **{
                **dict(live.data),
                # the order this state continues with: its resume's own (a new run's is the live one)
                "sampler": sampler,
                "window_shards": live.data.window_shards if sampler == SHARD_WINDOW_SAMPLER else None,
            },
            global_samples=at.global_samples,
            samples_in_epoch=at.position_in_epoch * live.micro_batch_size * live.world_size,
        ),
        # the optimizer state loads at another world size (ZeRO 0 holds it whole; 1/2 in elastic form)
        elastic_optimizer=live.zero_stage == 0 or bool(live.elastic),  # elastic ZeRO-1/2 add optim/full.safetensors
        per_rank_buffers=True,  # every rank writes its module buffers (syncpoint.workers.training.buffers)
        metrics={"loss": loss, **(evaluated or {})},
        save_reasons=reasons,
        attempt=attempt.number,
        submission=attempt.submission_id,  # a restart of this submission continues from its own states
        created_at=time.time(),
    )
