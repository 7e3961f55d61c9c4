"""Progress: one record per optimizer step, for the event log and for the console.

Why the event log gets them in batches: one event per step would be one storage write per step;
but the timeline's lost-work accounting needs a fresh view of progress when a node disappears,
so the batch is flushed at every commit and at least every ``PROGRESS_FLUSH_S`` seconds; and
before it grows near the size a reader accepts for one event file (``EVENT_MAX_BYTES``: a tiny
model with ``train.record_samples`` logs thousands of steps in those seconds).
"""

from __future__ import annotations

import time
from typing import cast

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.journal import Progress, ProgressRecord
from syncpoint.workers.observation.events import EVENT_MAX_BYTES, EventLog

PROGRESS_FLUSH_S = 2.0  # how stale the event log's view of progress may get (lost-work accounting)
FLUSH_AT_BYTES = EVENT_MAX_BYTES // 4  # a batch's estimated JSON size that flushes it whatever the time
_RECORD_BYTES, _SAMPLE_BYTES = 400, 16  # at most: one step's record (indented JSON) without samples; a sample id


class ProgressLog:
    """Per optimizer step records, flushed to the event log at every commit and every few seconds."""

    def __init__(self, events: EventLog | None, attempt: int) -> None:
        self.events, self.attempt = events, attempt
        self.history: list[JSONObject] = []
        self.unflushed: list[JSONObject] = []
        self.unflushed_bytes = 0  # the batch's estimated JSON size
        self.last_flush = time.monotonic()

    def add(self, record: JSONObject) -> None:
        self.history.append(record)
        self.unflushed.append(record)
        samples = cast("list[int] | None", record.get("samples"))  # ProgressRecord's sample ids
        self.unflushed_bytes += _RECORD_BYTES + _SAMPLE_BYTES * len(samples or ())
        if time.monotonic() - self.last_flush > PROGRESS_FLUSH_S or self.unflushed_bytes >= FLUSH_AT_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.events and self.unflushed:
            self.events.emit(
                Progress(attempt=self.attempt, records=[ProgressRecord.model_validate(r) for r in self.unflushed])
            )
        self.unflushed, self.unflushed_bytes, self.last_flush = [], 0, time.monotonic()


class ProgressLine:
    """The console line every ``train.log_every`` optimizer steps, with the throughput since the last one."""

    def __init__(
        self, attempt: int, epochs: int | None, total_steps: int, samples_per_micro_step: int, global_micro_step: int
    ) -> None:
        self.attempt, self.epochs, self.total_steps = attempt, epochs, total_steps
        self.samples_per_micro_step = samples_per_micro_step
        self.last_time, self.last_micro_step = time.monotonic(), global_micro_step

    def print(self, *, epoch: int, optimizer_step: int, global_micro_step: int, loss: float, lr: float) -> None:
        now = time.monotonic()
        samples_per_s = (
            (global_micro_step - self.last_micro_step) * self.samples_per_micro_step / max(now - self.last_time, 1e-9)
        )
        self.last_time, self.last_micro_step = now, global_micro_step
        of_epochs = f"/{self.epochs}" if self.epochs else ""
        print(
            f"[syncpoint] attempt {self.attempt} epoch {epoch + 1}{of_epochs} step {optimizer_step}/"
            f"{self.total_steps} micro-step {global_micro_step} loss {loss:.4f} lr {lr:.3g} "
            f"{samples_per_s:,.0f} samples/s",
            flush=True,
        )
