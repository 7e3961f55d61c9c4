"""The supervisors' store agent (``syncpoint.workers.supervision.store_agent``): a real ``TCPStore`` served by
rank 0's agent and joined by another's, driven over the pipes a supervisor uses; an agent that
cannot start, or that ends, is an error for its supervisor, never a hang."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from syncpoint.policies.decisions.failures import FINISHED, PREEMPTION, FailureFacts, RankEnd, classify_failure
from syncpoint.workers.supervision import coordination
from syncpoint.workers.supervision.coordination import CoordinatorPlan, _agent
from syncpoint.workers.supervision.store_agent import AgentError, StoreFault, open_store, valid_address
from tests.second_account import second_account


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
    monkeypatch.setattr(coordination, "JOIN_BOUND_S", 60.0)
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

    monkeypatch.setattr(coordination, "JOIN_BOUND_S", 2.0)
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
    store = _agent(_spawn, ("127.0.0.1", None, 5.0, "0" * 32), "test-store")
    store.proc.kill()
    store.proc.join()
    with pytest.raises(AgentError, match="store agent ended"):
        store.add("k", 1)
    store.close()


def test_a_store_whose_server_went_with_its_node_reads_as_a_lost_peer_or_a_fault_of_the_node(monkeypatch):
    """Rank 0's agent serves the store; when it dies (its node is lost, or a flood exhausted it), rank 1's
    next use of the store fails with what the controller reads as a lost peer, so it waits for Ray to
    declare the node dead (a preemption); if no node died, the ``StoreFault`` says it is the node's, and
    the failure policy charges it as one (a new worker group), never to ``failure.max_failures``. So
    does a store that does not answer a new generation's process."""
    from syncpoint.policies.decisions.failures import looks_like_lost_peer

    with _connected_side_by_side(2, monkeypatch) as (zero, one):
        zero.store.proc.kill()
        zero.store.proc.join(30)
        with pytest.raises(StoreFault) as lost:
            for _ in range(50):  # the first request may still be answered from a socket's buffer
                one.store.add("g0/left", 1)
        assert looks_like_lost_peer(str(lost.value)), str(lost.value)
    with pytest.raises(StoreFault) as unanswered:  # a new generation's process: nothing answers at the port
        open_store("127.0.0.1", zero.port, "0" * 32, 2.0)
    for fault in (lost.value, unanswered.value):
        verdict = classify_failure(FailureFacts(False, (), False, messages=(str(fault),)))
        assert verdict.kind == PREEMPTION and "a fault of the node" in verdict.reason, verdict
        assert "not of your code" in str(fault)


def _listening_addresses(port: int) -> set[str]:
    """The local addresses a socket listens on at ``port`` (the kernel's tables, IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.add(address)
    return found


def test_the_store_listens_on_the_jobs_address_alone(monkeypatch):
    """Not on every interface (``TCPStore``'s own server binds them all, IPv6 too): on the one
    address the ranks reach it at."""
    with _connected_side_by_side(2, monkeypatch) as (zero, _):
        assert _listening_addresses(zero.port) == {"0100007F"}  # 127.0.0.1, and nothing else


# What another local account tries against the job's store: forge what the supervisors act on
# under the names the job's code uses, read what they publish, flood the port with connections,
# garbage and large values of its own.
_STRANGER = r"""
import json, socket, sys
from datetime import timedelta
import torch.distributed as dist
port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
store.add("g0/failed", 1)
store.set("g0/action", "escalate")
store.add("joined", 5)
store.set("g0/end/1", '{"status": "raised", "message": "forged"}')
read = {}
for key in ("g0/reports/0", "g0/end/0", "syncpoint/supervisors"):
    try:
        read[key] = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=1)).get(key).decode()
    except Exception:
        read[key] = None
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2000)]
for sock in held[:50]:
    sock.sendall(bytes(range(256)) * 64)
for size in (1 << 20, 64 << 20):  # torch's server drops a client whose payload is over its limit
    try:
        dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30)).set(f"junk{size}", b"x" * size)
    except Exception:
        pass
print(json.dumps({"read": read, "held": len(held)}))
"""


def test_a_second_local_account_can_neither_read_nor_forge_nor_disturb_the_store(monkeypatch):
    """The stranger reaches the port (loopback is everyone's), but every key of the job lies under
    a namespace it cannot name: its forged marks are its own keys, it reads nothing the supervisors
    published, and its flood leaves the job's store answering."""
    with second_account() as stranger:
        stranger.needs("torch.distributed")
        _attack_as(stranger, monkeypatch)


def _attack_as(stranger, monkeypatch) -> None:
    with _connected_side_by_side(2, monkeypatch) as (zero, one):
        zero.publish(0, RankEnd(rank=0, status=FINISHED), reports=3)
        result = stranger.python(_STRANGER, args=(str(zero.port),))
        assert result == {"read": dict.fromkeys(("g0/reports/0", "g0/end/0", "syncpoint/supervisors")), "held": 2000}
        assert not one.failed(0) and not zero.failed(0)  # its "failed" mark is not the job's
        assert zero.store.add("joined", 0) == 2
        assert not one.store.check(["g0/action", "g0/end/1"])  # no forged decision, no forged end
        one.publish(0, RankEnd(rank=1, status=FINISHED), reports=3)
        assert [e.status for e in zero.ends(0, 30)] == [FINISHED] * 2
        assert zero.most_reports(0) == 3


@pytest.mark.parametrize(
    "value",
    [None, ["127.0.0.1", 1234], ["127.0.0.1", "1234", "0" * 32], ["127.0.0.1", 1234, "guessable"], "x", 7],
)
def test_a_rank_refuses_an_address_that_is_not_rank_zeros(value):
    assert valid_address(value) is None
    assert valid_address(["127.0.0.1", 1234, "0" * 32]) == ("127.0.0.1", 1234, "0" * 32)
