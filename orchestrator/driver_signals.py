"""The driver's own signals are a preemption notice for the whole job.

Why: a single spot VM's shutdown sends SIGTERM to every process, a user stops a run with Ctrl-C, and a
closed terminal sends SIGHUP. Each is what a node drain is to a rank: a notice. The first SIGINT,
SIGTERM or SIGHUP to ``syncpoint run`` marks a stop on the submission's heartbeat board (a Ray actor
every rank already knows, ``syncpoint.workers.supervision.heartbeat.BeatBoard``); each rank's notice source sees it
through a cheap background poll (``StopWatch``: one small actor call per ``POLL_S``, never one per
micro-step), every rank saves at the next sync boundary they agree on and returns without finishing
(``syncpoint.workers.training.loop.TrainingLoop.stop``), and the driver's last line says what was kept and how to
go on, with the shell's exit code for the signal (128 + its number). A second signal stops at once:
nothing more is saved, the last committed state is what a rerun resumes from. A notice that no
boundary answers within the grace (``checkpoint.sigterm_grace_s``, else ``DEFAULT_GRACE_S``) becomes
that second signal.

Python runs signal handlers on the main thread only, between bytecodes: the handler records the
signal and wakes ``DriverSignals``' thread, which talks to Ray (never from inside a handler).
``install`` runs again after ``ray.init``: Ray's core worker installs its own C++ SIGTERM handler (the
``*** SIGTERM received ... PC: @`` stack dump), which must not be what the user sees.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from syncpoint.policies.decisions.grace_window import Notice
from syncpoint.workers.supervision.preemption import DRIVER

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
DEFAULT_GRACE_S = 120.0  # without checkpoint.sigterm_grace_s: a boundary that takes longer is not waited for
POLL_S = 0.5  # how often a rank asks the board whether the driver was signalled
ASK_TIMEOUT_S = 10.0  # one board read, bounded (a busy GCS): the next poll asks again


class StopNow(KeyboardInterrupt):
    """A second signal: the driver stops at once. A ``KeyboardInterrupt``: no ``except Exception`` takes
    it for a failure of the fit, and Ray's blocking calls end on it (they turn any other exception a
    handler raises into a printed warning and wait on); they raise a plain ``KeyboardInterrupt`` of
    their own, so ``DriverSignals.at_once`` is what says it was this."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class DriverSignals:
    """For a job's length on the driver: SIGINT, SIGTERM and SIGHUP are the job's stop notice.

    ``received``: the first signal's number (None: none yet); ``at_once``: a second one stopped the
    driver; ``say`` prints the driver's lines about it; ``rerun``: the command that resumes the job, or
    (``rerun_resumes`` False: a drill's, which starts its runs over) the command that starts it over.

    Why a wakeup fd: Python runs a handler only when the main thread next checks (inside Ray's blocking
    get, about once a second) and runs it once for any number of deliveries of the same signal in
    between, so a quick double Ctrl-C would read as one. The C-level handler writes a byte per delivery
    to the wakeup fd; a thread reads them, counts, and acts at once. The Python handler only raises
    ``StopNow`` in the main thread once the thread has decided so (the thread re-sends the signal to the
    main thread to make sure the handler runs after that decision)."""

    def __init__(
        self, grace_s: float | None, say: Callable[[str], None], rerun: str, *, rerun_resumes: bool = True
    ) -> None:
        self.grace_s = grace_s or DEFAULT_GRACE_S
        self.say, self.rerun, self.rerun_resumes = say, rerun, rerun_resumes
        self.received: int | None = None
        self.at_once = False
        self.board: Any = None
        self._previous: dict[int, Any] = {}
        self._previous_fd: int | None = None
        self._raised = False
        self._wake = threading.Event()
        self._done = threading.Event()
        self._marked = False
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)

    def __enter__(self) -> DriverSignals:
        threading.Thread(target=self._count, name="syncpoint-driver-signal-count", daemon=True).start()
        threading.Thread(target=self._serve, name="syncpoint-driver-signals", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._wake.set()
        if threading.current_thread() is threading.main_thread():
            for signum, previous in self._previous.items():
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(signum, previous)
            if self._previous_fd is not None:
                with contextlib.suppress(ValueError, OSError):
                    signal.set_wakeup_fd(self._previous_fd)
        self._previous.clear()
        self._writer.close()
        # the counting thread reads EOF and ends
        with contextlib.suppress(OSError):
            self._reader.shutdown(socket.SHUT_RDWR)

    def install(self) -> None:
        """Take the three signals, from where the job starts (after any wait for a predecessor's lease,
        which a Ctrl-C ends as before), and again after ``ray.init`` (its core worker installs its own
        SIGTERM handler). A signal the process was started ignoring (``nohup``, ``cmd &`` in a script)
        stays ignored, as Unix commands do."""
        if threading.current_thread() is not threading.main_thread():
            return  # a driver run from a thread (a drill's): the process's owner handles signals
        for signum in SIGNALS:
            if signum not in self._previous and signal.getsignal(signum) == signal.SIG_IGN:
                continue
            try:
                previous = signal.signal(signum, self._handle)
            except (ValueError, OSError):
                continue
            self._previous.setdefault(signum, previous)
        previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        if self._previous_fd is None and previous_fd != self._writer.fileno():
            self._previous_fd = previous_fd

    def attach(self, board: Any) -> None:
        """The submission's heartbeat board exists: a signal already received is marked on it now."""
        self.board = board
        self._wake.set()

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def exit_code(self) -> int:
        """The shell's code for a process ended by the signal: 130 SIGINT, 143 SIGTERM, 129 SIGHUP."""
        return 128 + int(self.received or 0)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.at_once and not self._raised:
            self._raised = True
            raise StopNow(signum)

    def _count(self) -> None:
        """Each delivery of one of the signals, as it comes: the first is the notice, the second stops at once."""
        while not self._done.is_set():
            try:
                data = self._reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in (b for b in data if b in SIGNALS):
                self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        if self.received is None:
            self.received = signum
            self._wake.set()
        elif not self.at_once:
            self.at_once = True
            with contextlib.suppress(ValueError, OSError):  # the handler raises in the main thread now
                signal.pthread_kill(threading.main_thread().ident or 0, signum)

    def _serve(self) -> None:
        """Say what happens, mark the board, and give up waiting after the grace."""
        while self.received is None:  # woken by a signal, the board's arrival, or the job's end
            self._wake.wait()
            self._wake.clear()
            if self._done.is_set():
                return
        name = self.name
        self.say(
            f"syncpoint: {name} received: every rank saves at its next sync boundary, then the job stops "
            f"(again to stop at once, saving nothing more)"
        )
        deadline = time.monotonic() + self.grace_s
        while not self._done.is_set() and time.monotonic() < deadline:
            if self.board is not None and not self._marked:
                self._mark()
            self._wake.clear()
            self._wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))
        if not self._done.is_set() and not self.at_once:
            self.say(f"syncpoint: no sync boundary answered the {name} within {self.grace_s:g}s")
            self._on_signal(self.received)  # the second signal's path: stop at once

    def _mark(self) -> None:
        with contextlib.suppress(Exception):  # the board is gone (Ray stopping): the driver's own ending follows
            self.board.stop.remote({"source": DRIVER, "signal": self.name})
            self._marked = True


class StopWatch:
    """A rank's view of the driver's stop notice: a daemon thread asks the board every ``POLL_S``
    until it says stop; ``notice()`` is then the driver's notice (else None), read without a call.
    ``ask``: how one question is asked (default: the board's ``driver_stop``, through Ray)."""

    def __init__(self, board: Any, ask: Callable[[], Notice | None] | None = None) -> None:
        self.board = board
        self.ask = ask or self._ask_ray
        self._notice: Notice | None = None
        self._closed = threading.Event()
        if board is not None:
            threading.Thread(target=self._poll, name="syncpoint-driver-stop", daemon=True).start()

    def notice(self) -> Notice | None:
        return self._notice

    def close(self) -> None:
        self._closed.set()

    def _ask_ray(self) -> Notice | None:
        import ray

        answer: Notice | None = ray.get(self.board.driver_stop.remote(), timeout=ASK_TIMEOUT_S)
        return answer

    def _poll(self) -> None:
        while self._notice is None and not self._closed.wait(POLL_S):
            try:
                self._notice = self.ask()
            except Exception:  # noqa: BLE001 - a lost or busy board: asked again at the next poll
                continue
