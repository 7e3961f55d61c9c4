"""How a job's supervisors agree across ranks: marks and decisions in their store, one generation at a time.

Why a store: a failed generation must end on every rank with one decision (recover in place, or
escalate to Ray Train), whatever rank failed first; each rank publishes how its training process
ended and rank 0 decides. The store is rank 0's ``TCPStore``, held by an agent with torch
(``syncpoint.workers.supervision.store_agent``), under the job's secret namespace.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from syncpoint.policies.decisions.failures import (
    DIED,
    ESCALATE,
    TRACEBACK_LIMIT,
    InPlaceAction,
    RankEnd,
    RankStatus,
)

if TYPE_CHECKING:
    from syncpoint.workers.supervision.store_agent import AgentStore

END_LIMIT = 1 << 16  # a published RankEnd is short; anything longer is not a supervisor's
# how long the supervisors wait for each other's store agents, that is for each rank's fork server's
# imports of torch and DeepSpeed (over a minute on a starved machine)
JOIN_BOUND_S = 600.0
POLL_S = 0.05  # how often a supervisor looks at its child and at the generation's failed mark


# ---------------------------------------------------------------- the supervisors' store
@dataclass(frozen=True)
class CoordinatorPlan:
    """How the supervisors reach their store, before it exists: ``Supervisor.run`` connects it once
    it holds the node's warm server, where the store's agent is forked from
    (``syncpoint.workers.supervision.store_agent``: a supervisor itself does not import torch).

    ``exchange``: the launcher's broadcast from rank 0 (every rank calls it once, with rank 0's
    address or None; it returns rank 0's): Ray Train's ``broadcast_from_rank_zero`` on Ray, a
    ``TCPStore`` on the launcher's port in ``syncpoint.workers.supervision.launch.run_spawned``."""

    rank: int
    world: int
    host: str
    timeout_s: float
    exchange: Callable[[Any], Any]

    def connect(self, start: Callable[[Callable[..., None], tuple[Any, ...], str], Any]) -> Coordinator:
        """Start this rank's store agent with ``start(target, args, name)`` (rank 0's serves the
        store, under a namespace it makes), exchange its address and namespace, and return the
        coordinator on it."""
        from syncpoint.workers.supervision.store_agent import AgentError, new_namespace, valid_address

        name = f"syncpoint-rank{self.rank}-store"
        store, address, failure = None, None, None
        if self.rank == 0:
            try:
                namespace = new_namespace()
                store = _agent(start, (self.host, None, self.timeout_s, namespace), name)
                address = (self.host, store.port, namespace)
            except (AgentError, OSError) as e:
                failure = e  # said to the others (no address) before it is raised here
        exchanged = self.exchange(address)
        if failure is not None:
            raise failure
        if exchanged is None:
            raise AgentError("rank 0's supervisor could not start the supervisors' store")
        checked = valid_address(exchanged)
        if checked is None:
            raise AgentError(f"rank 0's store address is not one ({str(exchanged)[:200]})")
        host, port, namespace = checked
        if store is None:
            store = _agent(start, (host, port, self.timeout_s, namespace), name)
        coordinator = Coordinator(store, (host, port, namespace), self.rank, self.world)
        try:
            coordinator.join(JOIN_BOUND_S)
        except BaseException:
            coordinator.close()  # this rank's agent ends with the failed start, not with the process
            raise
        return coordinator


def _agent(start: Callable[..., Any], args: tuple[Any, ...], name: str) -> Any:
    from syncpoint.workers.supervision.store_agent import AgentStore, serve

    ours, theirs = mp.Pipe(duplex=True)
    proc = start(serve, (theirs, *args), name)
    theirs.close()
    return AgentStore(proc, ours)


class Coordinator:
    """The supervisors' shared marks for each generation, on a ``TCPStore`` served by rank 0's agent."""

    def __init__(self, store: AgentStore, address: tuple[str, int, str], rank: int, world: int) -> None:
        self.store, self.address, self.rank, self.world = store, address, rank, world
        self.host, self.port = address[0], address[1]

    def close(self) -> None:
        """End this rank's store agent (rank 0's: the store; every rank has left it by then)."""
        self.store.close()

    def join(self, bound_s: float) -> None:
        """Wait (bounded) until every rank's agent has joined the store. Why: each agent comes from
        its rank's fork server, so then every rank forks its first training process at once, and a
        rank whose imports were slow does not spend the others' first collective's timeout
        (``scaling.collective_timeout_s``, which may be seconds)."""
        self.store.add("joined", 1)
        deadline = time.monotonic() + bound_s
        while self.store.add("joined", 0) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-place recovery: not every rank's supervisor joined within {bound_s:g} s")
            time.sleep(POLL_S)

    def mark_failed(self, generation: int) -> None:
        self.store.add(f"g{generation}/failed", 1)

    def failed(self, generation: int) -> bool:
        return self.store.add(f"g{generation}/failed", 0) > 0

    def publish(self, generation: int, end: RankEnd, reports: int) -> None:
        """This rank's end of the generation, and how many reports its child sent (published first)."""
        self.store.set(f"g{generation}/reports/{self.rank}", str(reports))
        self.store.set(f"g{generation}/end/{self.rank}", json.dumps(asdict(end)))

    def most_reports(self, generation: int) -> int:
        """The largest number of reports any rank's child sent in the generation (after ``ends``)."""
        counts = []
        for r in range(self.world):
            raw = self.store.get(f"g{generation}/reports/{r}")
            counts.append(int(raw) if len(raw) < 20 and raw.isdigit() else 0)
        return max(counts)

    def ends(self, generation: int, bound_s: float) -> list[RankEnd]:
        """Every rank's end of the generation, waiting (bounded) for the last supervisor to publish."""
        keys = [f"g{generation}/end/{r}" for r in range(self.world)]
        self._wait(keys, bound_s, "every rank's end")
        return [parse_end(self.store.get(k), r) for r, k in enumerate(keys)]

    def action(self, generation: int, decide: Callable[[], InPlaceAction], bound_s: float) -> InPlaceAction:
        """Rank 0 decides and publishes; the others read its decision (anything else: ESCALATE)."""
        key = f"g{generation}/action"
        if self.rank == 0:
            action = decide()
            self.store.set(key, action.value)
            return action
        self._wait([key], bound_s, "rank 0's decision")
        try:
            return InPlaceAction(self.store.get(key).decode("ascii", "replace"))
        except ValueError:
            return ESCALATE

    def leave(self, generation: int, bound_s: float) -> None:
        """This supervisor has read all it needs of the generation; rank 0 (whose process serves the
        store) waits for every rank to say so before it leaves, bounded."""
        count = self.store.add(f"g{generation}/left", 1)
        if self.rank != 0:
            return
        deadline = time.monotonic() + bound_s
        while count < self.world and time.monotonic() < deadline:
            time.sleep(POLL_S)
            count = self.store.add(f"g{generation}/left", 0)

    def _wait(self, keys: list[str], bound_s: float, what: str) -> None:
        deadline = time.monotonic() + bound_s
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                raise TimeoutError(f"in-place recovery: {what} did not arrive within {bound_s:g} s")
            time.sleep(POLL_S)


def parse_end(raw: bytes, rank: int) -> RankEnd:
    """A published end, as plain data (JSON, bounded: the store is a network service)."""
    try:
        if len(raw) > END_LIMIT:
            raise ValueError("too long")
        data = json.loads(raw)
        end = RankEnd(
            rank=rank,
            status=RankStatus(str(data["status"])),
            message=str(data.get("message", ""))[:2000],
            ours=bool(data.get("ours", False)),
            refusal=None if data.get("refusal") is None else str(data["refusal"])[:2000],
            signature=str(data.get("signature", ""))[:500],
            micro_step=data["micro_step"] if isinstance(data.get("micro_step"), int) else None,
            traceback=str(data.get("traceback", ""))[-TRACEBACK_LIMIT:],
        )
        return end
    except (ValueError, KeyError, TypeError) as e:
        return RankEnd(rank=rank, status=DIED, message=f"rank {rank}'s end could not be read ({e})")
