"""The driver's signal handling without Ray (``syncpoint.orchestrator.driver_signals``): the first signal
is marked on the board with its name, a second raises ``StopNow`` in the main thread, handlers go back
afterwards, and a signal the process ignores stays ignored (the whole job: tests/ray/test_driver_signals.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from syncpoint.orchestrator.driver_signals import DriverSignals, StopNow, StopWatch
from tests.helpers import sigint_set


class Board:
    """The heartbeat board's two calls the driver and a rank make, as Ray's actor handle spells them."""

    def __init__(self) -> None:
        self.notice: dict | None = None
        self.marked = threading.Event()
        self.stop = self._Call(self._stop)
        self.driver_stop = self._Call(lambda: self.notice)

    class _Call:
        def __init__(self, fn):
            self.remote = fn

    def _stop(self, notice: dict) -> None:
        self.notice = notice
        self.marked.set()


def _until(pred, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_first_signal_is_marked_on_the_board_and_a_second_stops_at_once():
    # SIGINT at Python's default, as a terminal starts a command: a suite run in the background (a CI
    # step, `make test &`) inherits it ignored, and DriverSignals keeps an ignored signal ignored (as
    # nohup expects), so the SIGINT below would never arrive (it failed so, 30 s on)
    with sigint_set(signal.default_int_handler):
        _first_marked_second_stops()


def _first_marked_second_stops() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    board, lines = Board(), []
    with DriverSignals(None, lines.append, "syncpoint run job.yaml") as signals:
        signals.install()
        signals.attach(board)
        os.kill(os.getpid(), signal.SIGTERM)
        assert board.marked.wait(30)
        assert board.notice == {"source": "driver", "signal": "SIGTERM"} and signals.exit_code() == 143
        assert lines[0].startswith("syncpoint: SIGTERM received: every rank saves at its next sync boundary")
        with pytest.raises(StopNow):
            os.kill(os.getpid(), signal.SIGINT)
            _until(lambda: False, "the second signal raised StopNow")
        assert signals.at_once and signals.received == signal.SIGTERM
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_the_process_ignores_stays_ignored_and_a_rank_sees_the_mark():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with DriverSignals(None, print, "syncpoint run job.yaml") as signals:
            signals.install()
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == signals._handle
    finally:
        signal.signal(signal.SIGHUP, previous)
    board = Board()
    watch = StopWatch(board, ask=board.driver_stop.remote)
    try:
        assert watch.notice() is None
        board.stop.remote({"source": "driver", "signal": "SIGINT"})
        _until(lambda: watch.notice() is not None, "the rank's poll saw the driver's notice")
        assert watch.notice() == {"source": "driver", "signal": "SIGINT"}
    finally:
        watch.close()
