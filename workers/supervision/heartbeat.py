"""Heartbeat: each rank tells the driver's side how far it got, so lost work is measured, not inferred.

Why: progress reaches the event log only every few seconds (one storage write per flush), so a
node lost without notice was charged from the last flush, not from where training really was.
A beat is one fire-and-forget Ray actor call carrying (rank, attempt, micro-step, wall time),
sent at every sync boundary and at most every ``BEAT_EVERY_S`` in between; the board (a tiny
actor the driver creates, ``num_cpus=0``, on the driver's node so it outlives any worker node)
keeps each rank's last beat. When the controller learns of a failure it reads the board and writes
an ``interrupted`` event before the next attempt starts (``syncpoint.orchestrator.failure_policy``).
Outside Ray (a bare torch process group) there is no board: no beats, and the timeline falls
back to the flushed progress.

Written by hand because Ray has no per-rank "last seen" record a driver can read after a worker's
node is gone (Ray Train's reports are barriers, which a lost rank never reaches).
"""

from __future__ import annotations

import time
from typing import Any, TypedDict

from syncpoint.policies.decisions.grace_window import Notice

BEAT_EVERY_S = 0.2  # how stale the measured interruption point may be between two boundaries


class Beat(TypedDict):
    """A rank's last beat as the board gives it (read into ``journal.RankReached``)."""

    rank: int
    global_micro_step: int
    time: float


class BeatBoard:
    """Each rank's last beat per attempt (the state of the driver's ``ray.remote`` actor)."""

    def __init__(self) -> None:
        self.beats: dict[int, dict[int, tuple[int, float]]] = {}
        self.stop_notice: Notice | None = None

    def stop(self, notice: Notice) -> None:
        """The driver was signalled: every rank's notice source reads this (``driver_stop``) and the job
        saves at its next boundary and stops (``syncpoint.orchestrator.driver_signals``)."""
        self.stop_notice = self.stop_notice or notice

    def driver_stop(self) -> Notice | None:
        return self.stop_notice

    def beat(self, rank: int, attempt: int, global_micro_step: int, wall_time: float) -> None:
        self.beats.setdefault(attempt, {})[rank] = (global_micro_step, wall_time)

    def read(self, attempt: int) -> list[Beat]:
        """The attempt's last beat of each rank that beat: ``{"rank", "global_micro_step", "time"}``."""
        return [
            {"rank": r, "global_micro_step": g, "time": t} for r, (g, t) in sorted(self.beats.get(attempt, {}).items())
        ]


class Heartbeat:
    """A rank's sender: at every boundary, and at other micro-steps once ``BEAT_EVERY_S`` passed.

    ``board`` is the actor handle (anything whose ``beat.remote(...)`` takes the beat) or None."""

    def __init__(self, board: Any | None, rank: int, attempt: int) -> None:
        self.board, self.rank, self.attempt = board, rank, attempt
        self.last = float("-inf")

    def at_micro_step(self, global_micro_step: int, boundary: bool) -> None:
        if self.board is None:
            return
        now = time.monotonic()
        if not boundary and now - self.last < BEAT_EVERY_S:
            return
        self.last = now
        try:  # fire and forget: the ref is dropped, the actor still runs the call
            self.board.beat.remote(self.rank, self.attempt, global_micro_step, time.time())
        except Exception:  # noqa: BLE001 - a lost board costs the measurement, never the training
            self.board = None
