"""The launcher's exchange of rank 0's store address between the supervisors (``failure.in_place``
without Ray). Rank 0 answers only once its store agent runs, after its fork server's imports, which
took over a minute on a starved CI machine: the others wait as long as the launcher lets the run
live, not the collective timeout, and a rank 0 that dies ends their wait at once. Then every
supervisor waits for the others' agents, so no rank's first collective waits on another's imports.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from syncpoint.workers.supervision.free_ports import free_port
from syncpoint.workers.supervision.rank_process import StoreExchange as _StoreExchange

NAMESPACE = "5" * 32  # the launcher's secret, as run_spawned hands it to every rank


def _rank_0(port: int, answer_after_s: float, die: bool, listening: Any = None) -> None:
    exchange = _StoreExchange(0, port, 60, NAMESPACE)
    if listening is not None:
        listening.set()
    time.sleep(answer_after_s)
    if not die:
        exchange(["127.0.0.1", 1234])
        time.sleep(5)  # the store lives until rank 1 has read it


def _start_rank_0(
    port: int, answer_after_s: float, die: bool = False, listening: bool = False
) -> mp.process.BaseProcess:
    """Rank 0 in a spawned process; ``listening``: returns once its store listens (an event, bounded
    generously), so a short wait of the other rank is the exchange's, not a spawned interpreter's start-up."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event() if listening else None
    proc = ctx.Process(target=_rank_0, args=(port, answer_after_s, die, ready), daemon=True)
    proc.start()
    if ready is not None:
        assert ready.wait(300), "rank 0's store did not start listening"
    return proc


def test_a_rank_gets_the_address_of_a_rank_0_that_answers_late():
    port = free_port()
    rank_0 = _start_rank_0(port, answer_after_s=6)
    try:
        assert _StoreExchange(1, port, 60, NAMESPACE)(None) == ["127.0.0.1", 1234]
    finally:
        rank_0.kill()
        rank_0.join()


def test_the_wait_is_bounded_and_ends_at_once_when_rank_0_dies():
    port = free_port()
    rank_0 = _start_rank_0(port, answer_after_s=600, listening=True)
    try:
        started = time.monotonic()
        with pytest.raises(dist.DistStoreError):
            _StoreExchange(1, port, 3, NAMESPACE)(None)
        assert time.monotonic() - started < 60  # its own bound, not rank 0's 600 s
    finally:
        rank_0.kill()
        rank_0.join()
    port = free_port()
    rank_0 = _start_rank_0(port, answer_after_s=3, die=True, listening=True)
    try:
        exchange = _StoreExchange(1, port, 600, NAMESPACE)
        started = time.monotonic()
        with pytest.raises(dist.DistError):  # the store's connection closed: rank 0 is gone
            exchange(None)
        assert time.monotonic() - started < 60  # not the 600 s it would wait for a live rank 0
    finally:
        rank_0.join()


def test_a_supervisor_starts_training_only_once_every_rank_has_joined():
    """Rank 1's agent joins 3 s late (its fork server still importing): rank 0 waits for it, so
    neither rank's first training process waits on the other inside a collective timeout."""
    from datetime import timedelta

    from syncpoint.workers.supervision.supervisor import Coordinator

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    rank_0 = Coordinator(server, ("127.0.0.1", server.port, ""), 0, 2)  # a TCPStore answers what an agent does
    joined_at: list[float] = []

    def rank_1_joins_late() -> None:
        time.sleep(3)
        joined_at.append(time.monotonic())
        Coordinator(dist.TCPStore("127.0.0.1", server.port, None, False), ("127.0.0.1", server.port, ""), 1, 2).join(30)

    late = threading.Thread(target=rank_1_joins_late)
    late.start()
    rank_0.join(30)
    assert joined_at and time.monotonic() >= joined_at[0]
    late.join()

    alone = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not every rank's supervisor joined within 2 s"):
        Coordinator(alone, ("127.0.0.1", alone.port, ""), 0, 2).join(2)
    assert time.monotonic() - started < 30
