"""Servicing save requests at sync boundaries, synchronously or with one upload in flight.

The loop hands every boundary to ``SaveCoordinator.at_boundary``. A pending request is serviced
only when no save is in flight (it stays pending otherwise: never dropped, never two
overlapping). With ``checkpoint.async``, only the snapshot to local staging blocks training; the
upload runs in a background thread, and the commit (a collective) happens on the main thread at
the first boundary where every rank reports its upload done, or at the end of the run, which
waits for its last save.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from policies.save_triggers import PendingSave
from workers.checksum import DEFAULT
from workers.events import EventLog
from workers.faults import Faults
from workers.state_writer import AsyncUpload, SaveResult, commit_snapshot, save_state, take_snapshot
from workers.storage import RunStorage


class SaveCoordinator:
    def __init__(self, engine, storage: RunStorage, faults: Faults, events: EventLog | None, *, rank: int,
                 attempt: int, use_async: bool, full_optimizer_state: bool = False, retain: Callable[[], None],
                 flush_progress: Callable[[], None], last_saved: str | None, checksum: str = DEFAULT) -> None:
        self.engine, self.storage, self.faults, self.events = engine, storage, faults, events
        self.rank, self.attempt, self.use_async = rank, attempt, use_async
        self.full_optimizer_state = full_optimizer_state
        self.checksum = checksum
        self.retain, self.flush_progress = retain, flush_progress
        self.upload = AsyncUpload(storage, rank, faults)
        self.reasons_in_flight: list[str] = []
        self.last_saved = last_saved
        self.last_save_time = time.monotonic()
        self.micro_step = 0

    def still_uploading(self) -> float:
        """This rank's vote for the boundary collective: 1.0 while its upload is running."""
        return 1.0 if self.upload.uploading() else 0.0

    def at_boundary(self, pending: PendingSave, trainer_record: Callable[[list[str]], dict[str, Any]], *,
                    ranks_uploading: float, last: bool, micro_step: int) -> None:
        self.micro_step = micro_step
        if self.upload.in_flight and (ranks_uploading == 0 or last):
            self._record(commit_snapshot(self.storage, self.upload.finish(), self.faults), self.reasons_in_flight)
        if not pending.pending or self.upload.in_flight:
            return  # nothing asked, or one save is in flight: the request waits for a later boundary
        reasons = pending.take()
        trainer = trainer_record(reasons)
        self.last_save_time = time.monotonic()
        if self.use_async and not last:
            self.upload.start(take_snapshot(self.engine, trainer, self.faults, self.full_optimizer_state,
                                            algo=self.checksum))
            self.reasons_in_flight = reasons
        else:
            self._record(save_state(self.engine, self.storage, trainer, self.faults, self.full_optimizer_state,
                                    self.checksum), reasons)

    def _record(self, result: SaveResult, reasons: list[str]) -> None:
        self.last_saved = result.name
        if self.events:
            self.flush_progress()
            self.events.emit("state_committed", attempt=self.attempt, state=result.name,
                             global_micro_step=int(result.name), optimizer_step=result.optimizer_step,
                             bytes=result.bytes, seconds=result.seconds, blocked_seconds=result.blocked_seconds,
                             committed_at_micro_step=self.micro_step, reasons=reasons)
        self.faults.at_phase("before_retention")
        if self.rank == 0:
            self.retain()
        if "preemption" in reasons:
            self.faults.after_preemption_save()
