"""Servicing save requests at sync boundaries, synchronously or with one upload in flight.

The loop hands every boundary to ``SaveCoordinator.at_boundary``. A pending request is serviced
only when no save is in flight (it stays pending otherwise: never dropped, never two
overlapping). With ``checkpoint.async``, only the snapshot to local staging blocks training; the
upload runs in a background thread, and the commit (a collective) happens on the main thread at
the first boundary where every rank reports its upload done, or at the end of the run, which
waits for its last save. The writing itself, phase by phase, is the attempt's
``syncpoint.workers.state.writer.StateWriter``. After every commit rank 0 applies retention, here,
where the commit is known, rather than being handed a callback to do it (its deletes in a thread:
``syncpoint.workers.state.retention``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch.distributed as dist

from syncpoint.policies.contracts.errors import LeaseLostError, TaskError
from syncpoint.policies.contracts.journal import StateCommitted
from syncpoint.policies.contracts.state_format import TrainState
from syncpoint.policies.decisions.save_triggers import PendingSave
from syncpoint.workers.observation.progress import ProgressLog
from syncpoint.workers.state.rank_parts import LiveRank, capture_all
from syncpoint.workers.state.retention import Retention
from syncpoint.workers.state.writer import NonfiniteSnapshot, SaveResult, StateWriter
from syncpoint.workers.training.attempt import Attempt
from syncpoint.workers.training.boundary_vote import BoundaryVote
from syncpoint.workers.training.device import busy_core_share
from syncpoint.workers.training.finite import agreed_finite, refused_save

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine


class SaveCoordinator:
    """Services save requests at sync boundaries: when to save, sync or async, commit, retention, events."""

    def __init__(
        self, engine: DeepSpeedEngine, attempt: Attempt, progress: ProgressLog, *, last_saved: str | None
    ) -> None:
        spec = attempt.spec
        self.engine, self.attempt, self.progress = engine, attempt, progress
        self.faults, self.events = attempt.faults, attempt.events
        self.use_async = spec.checkpoint.async_save
        self.lease = attempt.lease  # rank 0's: commits confirm it, and a lost lease stops every rank
        self.retention = Retention(attempt)  # rank 0's passes after each commit (``retention``)
        self.writer = StateWriter(
            engine,
            attempt.storage,
            attempt.faults,
            rank=attempt.rank,
            lease=attempt.lease,
            signing_key=attempt.signing_key,
            checksum=spec.checkpoint.checksum,
            # Elastic ZeRO 1-3 runs also write the gathered optimizer state, loadable at another world size.
            full_optimizer_state=spec.scaling.elastic and spec.deepspeed.zero_stage in (1, 2, 3),
            memory=attempt.memory_copy,
        )
        # what an async upload's CPU time costs training here (save_every auto counts it: save_interval)
        self.busy_share = busy_core_share(attempt.world_size, spec.scaling.use_gpu)
        self.reasons_in_flight: list[str] = []
        self.last_saved = last_saved
        self.last_save_time = time.monotonic()
        self.last_commit_s: float | None = None  # the last committed save, its start to its commit
        self.micro_step = 0
        self.deferred = False  # a save request waits for a finite state (said once per wait)
        # Called after each commit on every rank (syncpoint.workers.observation.metric_sinks.RunMetrics.committed:
        # TensorBoard).
        self.on_commit: Callable[[SaveResult, list[str]], None] | None = None
        # A stream dataset's: this rank's stream position as its stream file's bytes, at the boundary.
        self.stream_state: Callable[[], bytes] | None = None

    def seconds_since_last_save(self) -> float:
        return time.monotonic() - self.last_save_time

    def before_optimizer_step(self) -> None:
        """The loop's next optimizer step changes what an in-flight asynchronous save staged: its
        copies must be made first (``StateWriter.wait_staged``)."""
        self.writer.wait_staged()

    def uploading(self) -> bool:
        """This rank's vote at the boundary: its asynchronous upload is still running."""
        return self.writer.uploading()

    def lease_lost(self) -> bool:
        """Rank 0's vote at the boundary: its heartbeat found the run directory's lease lost."""
        return self.lease is not None and self.lease.lost is not None

    def at_boundary(
        self,
        pending: PendingSave,
        trainer_record: Callable[[list[str]], TrainState],
        agreed: BoundaryVote,
        *,
        last: bool,
        micro_step: int,
        loss: float = 0.0,
    ) -> None:
        self.micro_step = micro_step
        self.faults.at_boundary(micro_step)
        if agreed.lease_lost:  # every rank stops here, before any further write
            raise LeaseLostError(
                str(self.lease.lost)
                if self.lease is not None and self.lease.lost
                else "rank 0 lost the run directory's lease to another submission (its error names it)"
            )
        if self.writer.in_flight and (agreed.uploading == 0 or last):
            try:
                self._record(self.writer.commit_in_flight(), self.reasons_in_flight)
            except NonfiniteSnapshot as e:  # not committed: its request waits for a finite boundary
                for reason in self.reasons_in_flight:
                    pending.request(reason)
                self._defer(f"the state at micro-step {int(e.name)} is not finite on rank(s) {e.ranks}")
        if not pending.pending or self.writer.in_flight:
            return  # nothing asked, or one save is in flight: the request waits for a later boundary
        since = time.perf_counter()  # the loop is blocked by this save from here (SaveResult.blocked_seconds)
        background = self.use_async and not last
        # every rank: a non-finite state is never committed. An async save checks its snapshot's tensors
        # in its upload thread (the commit refuses a non-finite one); here only the agreed loss, the same
        # on every rank (the boundary vote), so no collective is needed
        if not (math.isfinite(loss) if background else agreed_finite(self.engine, loss)):
            if last:
                raise refused_save(micro_step)
            self._defer(f"the state at micro-step {micro_step} is not finite (loss {loss})")
            return  # the request stays pending (never dropped): the next finite boundary services it
        self.deferred = False
        # rank 0: the last retention pass ends before this save's claim, which every rank's writes follow,
        # so a pass (planned against the states of its commit) never deletes a directory being written
        self.retention.wait()
        reasons = pending.take()
        trainer = trainer_record(reasons)
        self.last_save_time = time.monotonic()
        files = self._rank_files(trainer)
        if background:
            self.writer.save_in_background(trainer, rank_files=files, since=since)
            self.reasons_in_flight = reasons
        else:
            self._record(self.writer.save(trainer, rank_files=files, since=since), reasons)

    def settle(self) -> None:
        """At the attempt's failure (any exception out of the loop): the save in flight and retention's
        last pass end before the failure leaves it, as a crash would have ended them (neither may write
        or delete beside a later attempt); their own errors are said, the attempt's is raised."""
        self.writer.upload.settle()
        self.retention.settle()

    def _defer(self, what: str) -> None:
        """A save that waits for a finite state, said once per wait."""
        if not self.deferred:
            self.attempt.warn(f"{what}: not saved; the save waits for a boundary whose state is finite")
        self.deferred = True

    def _rank_files(self, trainer: TrainState) -> dict[str, bytes]:
        """This rank's file of every per-rank part this save carries (``rank_parts``: its RNG, module
        buffers, ``Task.stateful`` objects, a stream's position), captured at the boundary before
        anything of the state is written. A value a file cannot hold (a ``TaskError`` naming it: a
        stream's or a ``Task.stateful`` object's) fails every rank here, at the first save, with the
        first rank's message: one gather, so none is left waiting in a collective."""
        files: dict[str, bytes] = {}
        problem: TaskError | None = None
        live = LiveRank(self.attempt.rank, self.engine.module, self.attempt.stateful, self.stream_state)
        try:
            files = capture_all(live, trainer)
        except TaskError as e:
            problem = e
        problems: list[tuple[str, str] | None] = [None] * self.attempt.world_size
        dist.all_gather_object(problems, None if problem is None else (type(problem).__name__, str(problem)))
        first = next(((r, p) for r, p in enumerate(problems) if p), None)
        if first is not None:
            raise _task_error_named(first[1][0])(f"rank {first[0]}: {first[1][1]}")
        return files

    def _record(self, result: SaveResult, reasons: list[str]) -> None:
        result.contended_seconds = result.background_cpu_seconds * self.busy_share
        self.last_saved = result.name
        self.last_commit_s = result.seconds
        if self.events:
            self.progress.flush()
            self.events.emit(
                StateCommitted(
                    attempt=self.attempt.number,
                    state=result.name,
                    global_micro_step=int(result.name),
                    optimizer_step=result.optimizer_step,
                    bytes=result.bytes,
                    seconds=result.seconds,
                    blocked_seconds=result.blocked_seconds,
                    contended_seconds=result.contended_seconds,
                    committed_at_micro_step=self.micro_step,
                    reasons=reasons,
                )
            )
        if self.on_commit is not None:
            self.on_commit(result, reasons)
        self.faults.at_phase("before_retention")
        if self.attempt.rank == 0:
            self.retention.after_commit(keep=result.name)
        if "preemption" in reasons:
            self.retention.wait()  # the process may end right after this save
            self.faults.after_preemption_save()


def _task_error_named(name: str) -> type[TaskError]:
    """The ``TaskError`` subclass another rank raised, by its name (a gather carries names, not classes)."""
    kinds, seen = [TaskError], {}
    while kinds:
        kind = kinds.pop()
        seen[kind.__name__] = kind
        kinds += kind.__subclasses__()
    return seen.get(name, TaskError)
