"""Fault injection: crash a rank at a micro-step or at a named save phase, once per run.

A save phase is picked by the attempt's save ordinal (``at_save``) or as the first save whose
snapshot is at or after a micro-step (``at_micro_step``: the storm drill's points). ``mode: hold``
stops the rank after a micro-step until its node is taken away (the drill's node loss at an exact
point), for at most ``SYNCPOINT_FAULT_HOLD_S`` seconds.

Why record the firing in storage: the restarted attempt (Ray Train's restart, or re-running
``syncpoint run`` on the same storage) must not crash again at the same place, and that holds even
when the driver or the whole cluster is replaced. This is how users rehearse preemption.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from syncpoint.policies.contracts.journal import FaultFired
from syncpoint.policies.contracts.spec import CrashFault
from syncpoint.workers.storage import RunStorage


class InjectedCrash(BaseException):
    """Raised by ``mode: raise`` faults (single-process tests); BaseException so user code can't swallow it."""


class Faults:
    """This rank's planned faults (``faults:`` in a drill's or a test's spec), fired at the micro-step
    or save phase each names, once each: a fired fault leaves a marker in the run directory, so the
    attempt after the crash does not crash again at the same point."""

    def __init__(
        self, faults: list[CrashFault], storage: RunStorage, rank: int, send_sigterm: Callable[[], None] | None = None
    ) -> None:
        self.storage, self.rank = storage, rank
        self.mine = [f for f in faults if f.rank == rank and not storage.exists("faults", f.fault_id + ".fired")]
        self.saves_seen = 0
        self.boundary_micro_step = 0  # the boundary being serviced (set by the save coordinator)
        self.save_micro_step = 0  # the micro-step of the save in progress (its snapshot's boundary)
        self.attempt = 0  # set by the loop once the attempt number is known
        # How ``mode: sigterm`` reaches this worker (the loop's preemption notices); only sent, never read here.
        self.send_sigterm = send_sigterm
        self.exit_after_preemption_save = False

    def _fire(self, f: CrashFault, where: str, micro_step: int | None = None) -> None:
        from syncpoint.workers.observation.events import EventLog

        self.storage.write_json(
            {"fault": f.fault_id, "where": where, "time": time.time()}, "faults", f.fault_id + ".fired"
        )
        EventLog(self.storage, source=f"rank{self.rank}").emit(
            FaultFired(
                fault=f.fault_id,
                mode=f.mode,
                where=where,
                rank=self.rank,
                global_micro_step=micro_step,
                attempt=self.attempt,
            )
        )
        self.mine.remove(f)
        print(f"[syncpoint] injected crash on rank {self.rank} at {where}", file=sys.stderr, flush=True)
        if f.mode == "raise":
            raise InjectedCrash(where)
        if f.mode == "hold":
            _hold(self.rank, where)
            return
        if f.mode == "sigterm":
            # A spot notice: the worker gets SIGTERM, saves at the next boundary, then its node goes away.
            if self.send_sigterm is not None:
                self.send_sigterm()
            self.exit_after_preemption_save = True
            return
        os._exit(17)

    def at_micro_step(self, step: int) -> None:
        for f in list(self.mine):
            if f.phase is None and f.at_micro_step == step:  # with a phase, the micro-step picks the save
                self._fire(f, f"micro-step {step}", step)

    def after_preemption_save(self) -> None:
        if self.exit_after_preemption_save:
            print(
                f"[syncpoint] rank {self.rank}: node reclaimed after the preemption save", file=sys.stderr, flush=True
            )
            os._exit(143)

    def at_boundary(self, micro_step: int) -> None:
        """A sync boundary is being serviced: a save started now snapshots this micro-step."""
        self.boundary_micro_step = micro_step

    def save_started(self) -> None:
        self.saves_seen += 1
        self.save_micro_step = self.boundary_micro_step

    def _this_save(self, f: CrashFault, phase: str) -> bool:
        if f.phase != phase:
            return False
        if f.at_micro_step is not None:  # the first save at or after the micro-step (once: then it is fired)
            return self.save_micro_step >= f.at_micro_step
        return f.at_save == self.saves_seen

    def at_phase(self, phase: str) -> None:
        """Fire any fault planned for this save phase (the writer calls it at each phase it passes)."""
        for f in list(self.mine):
            if self._this_save(f, phase):
                self._fire(f, f"save {self.saves_seen} (micro-step {self.save_micro_step}) phase {phase}")

    def during_manifest(self, storage: RunStorage, manifest: bytes, *parts: str) -> None:
        """The ``during_manifest`` rehearsal, called right before the manifest commits: a crash
        half-way through its write leaves half its bytes under the temp name (what a torn local
        commit leaves behind), then the fault fires. Nothing happens unless it fires at this save."""
        if any(self._this_save(f, "during_manifest") for f in self.mine):
            storage.write_bytes(manifest[: len(manifest) // 2], *parts[:-1], parts[-1] + ".tmp")
            self.at_phase("during_manifest")


def _hold(rank: int, where: str) -> None:
    """``mode: hold``: wait for the node to go away (the drill removes it), bounded: a drill that never
    comes must not leave a rank, and so the run, waiting forever."""
    limit = float(os.environ.get("SYNCPOINT_FAULT_HOLD_S", "120"))
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.1)
    print(
        f"[syncpoint] rank {rank}: held at {where} for {limit:g} s (SYNCPOINT_FAULT_HOLD_S) and its node was not "
        "taken away; exiting as a crash",
        file=sys.stderr,
        flush=True,
    )
    os._exit(18)
