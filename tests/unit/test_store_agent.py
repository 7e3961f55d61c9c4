"""The supervisors' store agent (``syncpoint.workers.store_agent``): a real ``TCPStore`` served by
rank 0's agent and joined by another's, driven over the pipes a supervisor uses; an agent that
cannot start, or that ends, is an error for its supervisor, never a hang."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from syncpoint.workers.store_agent import AgentError
from syncpoint.workers.supervisor import CoordinatorPlan, _agent


def _spawn(target, args, name):
    proc = mp.get_context("spawn").Process(target=target, args=args, name=name)
    proc.start()
    return proc


def test_rank_zero_serves_the_store_and_another_rank_joins_it():
    served = {}

    def exchange(value):
        served.setdefault("address", value)
        return served["address"]

    zero = CoordinatorPlan(0, 2, "127.0.0.1", 5.0, exchange).connect(_spawn)
    one = CoordinatorPlan(1, 2, "127.0.0.1", 5.0, exchange).connect(_spawn)
    try:
        assert served["address"] == ("127.0.0.1", zero.port) and one.port == zero.port
        assert not one.failed(0)
        zero.mark_failed(0)
        assert one.failed(0) and zero.failed(0)
        assert one.store.add("g0/left", 1) == 1 and zero.store.add("g0/left", 1) == 2
        one.store.set("g0/action", "recover")
        assert zero.store.check(["g0/action"]) and zero.store.get("g0/action") == b"recover"
        assert not zero.store.check(["g0/nothing"])
    finally:
        one.close()
        zero.close()
    for coordinator in (zero, one):
        assert coordinator.store.proc.exitcode == 0  # the pipe closed: the agent ended


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
