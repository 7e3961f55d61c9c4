"""Preemption notices: Ray's drain notice and a SIGTERM to the worker, as one source the loop asks.

Why one object: a node going away announces itself two ways (Ray raises a drain notice; the node's
agent, a spot reclaim or a local launcher sends SIGTERM), and the loop should ask one question at
every boundary, "is my node going away?", whatever the source. Fault injection rehearses a spot
notice by *sending* a SIGTERM here, so a rehearsal exercises the same path as the real thing.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from syncpoint.policies.decisions.grace_window import Notice, notice_deadline

RayNotice = Callable[[], "Notice | None"]

# A notice's source when the driver itself was signalled (``syncpoint run`` got SIGINT, SIGTERM or
# SIGHUP: ``syncpoint.orchestrator.driver_signals``): every rank saves at the next boundary and the job
# then stops, where any other notice saves and trains on until the node goes.
DRIVER = "driver"


def is_stop(notice: Notice | None) -> bool:
    """Whether a notice asks the job to stop after its save (the driver's own signal)."""
    return notice is not None and notice.get("source") == DRIVER


class PreemptionNotices:
    """This rank's preemption notices (SIGTERM, Ray's drain), agreed on by every rank at each boundary."""

    def __init__(self, ray_notice: RayNotice | None = None) -> None:
        # Ray's get_preemption_info (or a test's stand-in): a collective, so asked on every rank
        # at every boundary.
        self.ray_notice = ray_notice
        self.sigterm_received = False
        self.sigterm_at: float | None = None  # UNIX seconds: the grace a platform gives runs from here
        self.in_grace_window = False  # every rank agreed a notice arrived: its state committed, more may follow
        self.stop_noticed = False  # the driver's notice reached this rank: save at the next boundary, then stop
        self._previous_handler: Any = None
        self._listening = False

    def listen_for_sigterm(self) -> None:
        """Take SIGTERM as a notice from now on. Python handles signals on the main thread only:
        elsewhere (Ray Train's worker thread) Ray's drain notice is the source."""
        if threading.current_thread() is not threading.main_thread():
            return
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._listening = True
        except (ValueError, OSError):
            pass

    def stop_listening(self) -> None:
        """Give SIGTERM back to the previous handler, so a process that hosts the loop (a test, a
        notebook) can still be terminated after the run."""
        if self._listening and self._previous_handler is not None:  # None: set outside Python, not restorable
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._listening, self._previous_handler = False, None

    def send_sigterm(self) -> None:
        """What a spot reclaim does to this worker (fault injection's ``mode: sigterm``). Where the
        handler listens, a real signal goes through it; where it cannot (off the main thread) the
        notice is recorded as the handler would have, since a real SIGTERM would end the process."""
        if self._listening:
            signal.raise_signal(signal.SIGTERM)
        else:
            self._record_sigterm()

    def poll(self) -> Notice | None:
        """This rank's notice at this boundary: Ray's details if it has any, else SIGTERM's."""
        notice = self.ray_notice() if self.ray_notice else None
        if notice is None and self.sigterm_received:
            notice = {"source": "sigterm"}
        self.stop_noticed = self.stop_noticed or is_stop(notice)
        return notice

    def agreed(self, ranks_noticed: int) -> bool:
        """Enter the grace window once any rank was noticed; True only at the boundary that does."""
        if self.in_grace_window or not ranks_noticed:
            return False
        self.in_grace_window = True
        return True

    def deadline(self, notice: Notice, sigterm_grace_s: float | None) -> float | None:
        """When this rank's node goes (UNIX seconds), if its notice says
        (``syncpoint.policies.decisions.grace_window``)."""
        return notice_deadline(notice, sigterm_at=self.sigterm_at, sigterm_grace_s=sigterm_grace_s)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._record_sigterm()

    def _record_sigterm(self) -> None:
        if not self.sigterm_received:
            self.sigterm_at = time.time()
        self.sigterm_received = True
