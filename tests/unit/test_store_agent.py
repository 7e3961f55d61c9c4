"""The supervisors' store agent (``syncpoint.workers.store_agent``): a real ``TCPStore`` served by
rank 0's agent and joined by another's, driven over the pipes a supervisor uses; an agent that
cannot start, or that ends, is an error for its supervisor, never a hang."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from syncpoint.workers import supervisor
from syncpoint.workers.store_agent import AgentError
from syncpoint.workers.supervisor import CoordinatorPlan, _agent


def _spawn(target, args, name):
    proc = mp.get_context("spawn").Process(target=target, args=args, name=name)
    proc.start()
    return proc


@contextmanager
def _connected_side_by_side(world: int, monkeypatch) -> Iterator[list]:
    """Every rank's ``CoordinatorPlan.connect`` at once, as every Ray Train worker makes it: each waits
    in it until every rank joined. The exchange is rank 0's address on every rank, as
    ``broadcast_from_rank_zero`` gives it; the join is bounded so a broken one fails fast. The
    connecting threads live until the end (an agent dies with the thread that started it:
    ``PR_SET_PDEATHSIG``)."""
    monkeypatch.setattr(supervisor, "JOIN_BOUND_S", 60.0)
    served, ready = {}, threading.Event()

    def exchange(value):
        if value is not None:
            served["address"] = value
            ready.set()
        assert ready.wait(60), "rank 0 never published its address"
        return served["address"]

    with ThreadPoolExecutor(world) as pool:
        plans = [CoordinatorPlan(r, world, "127.0.0.1", 5.0, exchange) for r in range(world)]
        coordinators = [c.result(timeout=120) for c in [pool.submit(p.connect, _spawn) for p in plans]]
        try:
            yield coordinators
        finally:
            for coordinator in coordinators:
                coordinator.close()


def test_rank_zero_serves_the_store_and_another_rank_joins_it(monkeypatch):
    with _connected_side_by_side(2, monkeypatch) as (zero, one):
        assert (zero.host, zero.port) == (one.host, one.port) == ("127.0.0.1", zero.store.port)
        assert zero.store.add("joined", 0) == 2  # neither returned before the other joined
        assert not one.failed(0)
        zero.mark_failed(0)
        assert one.failed(0) and zero.failed(0)
        assert one.store.add("g0/left", 1) == 1 and zero.store.add("g0/left", 1) == 2
        one.store.set("g0/action", "recover")
        assert zero.store.check(["g0/action"]) and zero.store.get("g0/action") == b"recover"
        assert not zero.store.check(["g0/nothing"])
    for coordinator in (zero, one):
        coordinator.store.proc.join(30)
        assert coordinator.store.proc.exitcode == 0  # the pipe closed: the agent ended


def test_a_rank_that_never_joins_fails_the_start_and_ends_this_ranks_agent(monkeypatch):
    """Rank 1 of 2 never comes: rank 0's connect raises after the join's bound, and the agent it
    started has ended by then (a failed start leaves no process behind for the worker to outlive)."""
    started = []

    def spawn(target, args, name):
        started.append(_spawn(target, args, name))
        return started[-1]

    monkeypatch.setattr(supervisor, "JOIN_BOUND_S", 2.0)
    with pytest.raises(TimeoutError, match="not every rank's supervisor joined within 2 s") as failed:
        CoordinatorPlan(0, 2, "127.0.0.1", 5.0, lambda v: v).connect(spawn)
    [agent] = started
    try:
        agent.join(10)  # the error is still held (its frames too), as Ray Train holds a worker's error
        assert agent.exitcode == 0 and failed.traceback
    finally:
        if agent.is_alive():  # only on failure: the agent this test started
            agent.kill()
            agent.join()


def test_rank_zero_that_cannot_start_its_agent_tells_the_others_and_raises():
    exchanged = []

    def failing_start(target, args, name):
        raise OSError("no fork server")

    with pytest.raises(OSError, match="no fork server"):
        CoordinatorPlan(0, 2, "127.0.0.1", 5.0, lambda v: exchanged.append(v) or v).connect(failing_start)
    assert exchanged == [None]  # the others learn it at once, not after a timeout
    started = []
    with pytest.raises(AgentError, match="rank 0's supervisor could not start"):
        CoordinatorPlan(1, 2, "127.0.0.1", 5.0, lambda v: None).connect(lambda *a: started.append(a))
    assert started == []


def test_an_agent_that_ended_is_an_error_for_its_supervisor():
    store = _agent(_spawn, ("127.0.0.1", None, 5.0), "test-store")
    store.proc.kill()
    store.proc.join()
    with pytest.raises(AgentError, match="store agent ended"):
        store.add("k", 1)
    store.close()


def test_a_store_whose_server_went_with_its_node_reads_as_a_lost_peer(monkeypatch):
    """Rank 0's agent serves the store; when it dies (its node is lost), rank 1's next use of the store
    fails with what the controller reads as a lost peer, so it waits for Ray to declare the node dead
    (a preemption) instead of charging a crash to ``failure.max_failures``."""
    from syncpoint.policies.failures import looks_like_lost_peer

    with _connected_side_by_side(2, monkeypatch) as (zero, one):
        zero.store.proc.kill()
        zero.store.proc.join(30)
        with pytest.raises(AgentError) as lost:
            for _ in range(50):  # the first request may still be answered from a socket's buffer
                one.store.add("g0/left", 1)
        assert looks_like_lost_peer(str(lost.value)), str(lost.value)
