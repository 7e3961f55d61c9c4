"""Where training stands, and where the run ends.

Why a type: the position is what a state records (``trainer.json``) and what a resume restores,
so the loop advances it in one place with names that match the record field for field.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncpoint.policies.contracts.spec import TrainSpec
from syncpoint.policies.decisions.boundaries import optimizer_steps_per_epoch
from syncpoint.policies.decisions.elastic import Layout
from syncpoint.policies.decisions.save_triggers import Tick

UNBOUNDED_STEPS = 2**62  # no train.max_steps: the epochs end the run
UNBOUNDED_EPOCHS = 2**40  # no train.epochs: train.max_steps ends the run


@dataclass
class TrainingPosition:
    """Where the run is: epoch, place in the epoch, micro-steps, optimizer steps and samples."""

    epoch: int = 0  # 0-indexed
    position_in_epoch: int = 0  # micro-batches of ``epoch`` consumed (1-indexed position of the last one)
    global_micro_step: int = 0
    optimizer_step: int = 0
    schedule_position: int = 0  # in the schedule's unit (optimizer steps or epochs)
    global_samples: int = 0

    def consume_micro_batch(self, global_micro_batch_samples: int) -> None:
        self.position_in_epoch += 1
        self.global_micro_step += 1
        self.global_samples += global_micro_batch_samples

    def optimizer_stepped(self, schedule_unit: str) -> None:
        self.optimizer_step += 1
        if schedule_unit == "optimizer_steps":
            self.schedule_position += 1

    def epoch_completed(self, schedule_unit: str) -> None:
        """At the epoch's last boundary: an epoch-unit schedule moves on (the epoch counter moves
        when the next epoch starts, so a state saved here records position_in_epoch == its length)."""
        if schedule_unit == "epochs":
            self.schedule_position += 1

    def next_epoch(self) -> None:
        self.epoch, self.position_in_epoch = self.epoch + 1, 0

    def tick(self, stepped: bool, seconds_since_last_save: float) -> Tick:
        return Tick(self.global_micro_step, self.optimizer_step, stepped, seconds_since_last_save)


@dataclass(frozen=True)
class RunLength:
    """Where the run ends (``train.max_steps`` or ``train.epochs``, whichever comes first)."""

    total_steps: int
    epochs: int | None
    schedule_horizon: int  # the schedule's length in its own unit

    @classmethod
    def of(cls, train: TrainSpec, layout: Layout) -> RunLength:
        steps_per_epoch = optimizer_steps_per_epoch(layout.grad_accum, layout.micro_batches_per_epoch)
        total_steps = min(train.max_steps or UNBOUNDED_STEPS, (train.epochs or UNBOUNDED_EPOCHS) * steps_per_epoch)
        s = train.scheduler
        horizon = s.total or (total_steps if s.unit == "optimizer_steps" else (train.epochs or 1))
        return cls(total_steps, train.epochs, horizon)

    def reached(self, at: TrainingPosition) -> bool:
        """A position at or past the end (a resumed state): nothing is left to train."""
        return at.optimizer_step >= self.total_steps or (self.epochs is not None and at.epoch >= self.epochs)

    def is_last_boundary(self, at: TrainingPosition, epoch_end: bool) -> bool:
        return at.optimizer_step >= self.total_steps or (
            epoch_end and self.epochs is not None and at.epoch + 1 >= self.epochs
        )

    def has_epoch(self, epoch: int) -> bool:
        return self.epochs is None or epoch < self.epochs
