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

import torch.distributed as dist

from policies.errors import LeaseLostError
from policies.save_triggers import PendingSave
from workers.checksum import DEFAULT
from workers.events import EventLog
from workers.faults import Faults
from workers.lease import RunLease
from workers.state_writer import AsyncUpload, SaveResult, commit_snapshot, save_state, state_name, take_snapshot
from workers.storage import RunStorage

# Rank 0's share of the boundary vote once its heartbeat found the lease lost: far above any sum
# of "still uploading" votes, so every rank sees it in the same all-reduce and stops together.
LEASE_LOST_VOTE = float(2**40)


class SaveCoordinator:
    def __init__(self, engine, storage: RunStorage, faults: Faults, events: EventLog | None, *, rank: int,
                 attempt: int, use_async: bool, full_optimizer_state: bool = False, retain: Callable[[], None],
                 flush_progress: Callable[[], None], last_saved: str | None, checksum: str = DEFAULT,
                 lease: RunLease | None = None, signing_key: bytes | None = None) -> None:
        self.engine, self.storage, self.faults, self.events = engine, storage, faults, events
        self.rank, self.attempt, self.use_async = rank, attempt, use_async
        self.full_optimizer_state = full_optimizer_state
        self.checksum = checksum
        self.retain, self.flush_progress = retain, flush_progress
        self.lease = lease  # rank 0's: commits confirm it, and a lost lease stops every rank
        self.signing_key = signing_key
        self.upload = AsyncUpload(storage, rank, faults)
        self.reasons_in_flight: list[str] = []
        self.last_saved = last_saved
        self.last_save_time = time.monotonic()
        self.micro_step = 0

    def still_uploading(self) -> float:
        """This rank's vote for the boundary collective: 1.0 while its upload is running, plus
        ``LEASE_LOST_VOTE`` once rank 0's heartbeat found the run directory's lease lost."""
        lost = self.lease is not None and self.lease.lost is not None
        return (1.0 if self.upload.uploading() else 0.0) + (LEASE_LOST_VOTE if lost else 0.0)

    def at_boundary(self, pending: PendingSave, trainer_record: Callable[[list[str]], dict[str, Any]], *,
                    ranks_uploading: float, last: bool, micro_step: int) -> None:
        self.micro_step = micro_step
        if ranks_uploading >= LEASE_LOST_VOTE:  # every rank stops here, before any further write
            raise LeaseLostError(str(self.lease.lost) if self.lease is not None and self.lease.lost else
                                 "rank 0 lost the run directory's lease to another submission (its error names it)")
        if self.upload.in_flight and (ranks_uploading == 0 or last):
            self._record(commit_snapshot(self.storage, self.upload.finish(), self.faults, self.lease),
                         self.reasons_in_flight)
        if not pending.pending or self.upload.in_flight:
            return  # nothing asked, or one save is in flight: the request waits for a later boundary
        reasons = pending.take()
        trainer = trainer_record(reasons)
        self.last_save_time = time.monotonic()
        self._before_writing(state_name(trainer["global_micro_step"]))
        if self.use_async and not last:
            self.upload.start(take_snapshot(self.engine, trainer, self.faults, self.full_optimizer_state,
                                            algo=self.checksum, signing_key=self.signing_key))
            self.reasons_in_flight = reasons
        else:
            self._record(save_state(self.engine, self.storage, trainer, self.faults, self.full_optimizer_state,
                                    self.checksum, lease=self.lease, signing_key=self.signing_key), reasons)

    def _before_writing(self, name: str) -> None:
        """Before a save writes anything (all ranks, one broadcast): rank 0 re-checks the lease, so a
        run that lost it never streams shards into a directory the new owner may be writing
        (commits re-check right before the manifest); and it un-commits a state of the same name
        still committed from an earlier trajectory (a run resumed from an older pin recomputes it,
        possibly under another spec), so no manifest ever describes files being rewritten."""
        verdict = self.lease.confirm() if self.rank == 0 and self.lease is not None else None
        if self.rank == 0 and verdict is None and self.storage.exists("states", name, "manifest.json"):
            self.storage.remove("states", name, "manifest.json")
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise LeaseLostError(box[0])

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
