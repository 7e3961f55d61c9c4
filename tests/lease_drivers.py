"""Driver processes for the lease tests, in a module of their own so that a spawned child imports
only what it uses (the test modules import the whole training stack)."""

from __future__ import annotations

import json
import os
import tempfile
import time

from syncpoint.workers.storage.lease import LEASE_MAX_BYTES
from tests.meta import live, trainer_for

JOB = "job-identity"


def race(url: str, submission: str, start, out, skew_s: float = 0.0) -> None:
    """Wait for every racer, then try to take the lease once; report the outcome. ``skew_s``: this
    driver's clock runs that far ahead (another machine with a wrong clock)."""
    from syncpoint.policies.contracts.errors import LeaseRefused
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.storage.lease import RunLease

    if skew_s:
        real = time.time
        time.time = lambda: real() + skew_s  # type: ignore[assignment]  # a skewed clock, in this driver process only

    lease = RunLease(RunStorage(url), job_identity=JOB, job_name="job", submission=submission, ttl_s=30.0)
    start.wait()
    try:
        lease.acquire()
        out.put((submission, "won", lease.confirm()))
    except LeaseRefused as e:
        out.put((submission, "refused", str(e)))
    lease.stop()


def committer(url: str, submission: str, first_step: int, stall_s: float, commits: int, out, ready) -> None:
    """A driver committing states through the real ``commit_snapshot`` (a one-rank gloo group).

    It takes the lease (polling while another submission holds it), then commits ``commits``
    states; the stalling one (``stall_s``) stops heart-beating after two commits, once the other
    driver is trying to take over (``ready``), sleeps past its TTL and tries to commit again.
    """
    import torch.distributed as dist

    from syncpoint.policies.contracts.errors import LeaseLostError, LeaseRefused
    from syncpoint.policies.contracts.state_format import TrainState
    from syncpoint.workers.state.writer import Snapshot, commit_snapshot, state_name
    from syncpoint.workers.storage import RunStorage
    from syncpoint.workers.storage.lease import RunLease
    from syncpoint.workers.supervision.faults import Faults
    from syncpoint.workers.supervision.free_ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    storage = RunStorage(url)
    lease = RunLease(storage, job_identity=JOB, job_name="job", submission=submission, ttl_s=1.0)
    if not stall_s:
        ready.set()
    deadline = time.monotonic() + 120
    while True:
        try:
            lease.acquire()
            break
        except LeaseRefused:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    out.put((submission, "acquired", lease.generation))
    committed: list[int] = []
    try:
        for i in range(commits):
            if i == 2 and stall_s:
                assert ready.wait(120)
                time.sleep(0.3)  # the successor is polling
                lease.stop()  # the driver stalls past its TTL (a pause, a partition) ...
                time.sleep(stall_s)  # ... and wakes up to commit again
            step = first_step + i
            exp = live(JOB, 1, 1, 1, 10**6, 1, "f", 0, precision="fp32")
            trainer = TrainState.model_validate(trainer_for(step, exp))
            snap = Snapshot(state_name(step), tempfile.mkdtemp(), trainer, time.perf_counter())
            commit_snapshot(storage, snap, Faults([], storage, 0), lease)
            committed.append(step)
            time.sleep(0.05)
        out.put((submission, "done", committed))
    except LeaseLostError as e:
        out.put((submission, "lost", committed, str(e)))
    lease.stop()
    dist.destroy_process_group()


class StealLeaseAt:
    """A save trigger that, on rank 0 at micro-step ``SYNCPOINT_TEST_STEAL_AT``, hands the run
    directory's lease to another submission (what a successor that legitimately took over after a
    stall would have written), then waits ``SYNCPOINT_TEST_PAUSE_S`` (for the heartbeat to
    notice). It asks for a save at every optimizer step, or at ``SYNCPOINT_TEST_SAVE_AT``."""

    seen: list[int] = []

    def __init__(self) -> None:
        self.at = int(os.environ["SYNCPOINT_TEST_STEAL_AT"])
        self.url = os.environ["SYNCPOINT_TEST_RUN_URL"]
        self.pause = float(os.environ.get("SYNCPOINT_TEST_PAUSE_S", "0"))
        self.save_at = {int(s) for s in os.environ.get("SYNCPOINT_TEST_SAVE_AT", "").split(",") if s}

    def wants_save(self, tick) -> bool:
        StealLeaseAt.seen.append(tick.global_micro_step)
        if tick.global_micro_step == self.at and int(os.environ.get("RANK", "0")) == 0:
            self._steal()
            time.sleep(self.pause)
        return tick.global_micro_step in self.save_at if self.save_at else tick.stepped

    def _steal(self) -> None:
        from syncpoint.workers.storage import RunStorage
        from syncpoint.workers.storage.lease import read_lease

        store = RunStorage(self.url)
        held = read_lease(store)
        write_lease(
            store,
            {
                **held.record,
                "submission": "thief",
                "host": "elsewhere",
                "pid": 1,
                "ttl_s": 600.0,
                "generation": held.generation + 1,
                "holder": "thief-token",
                "heartbeat": time.time(),
            },
        )


def write_lease(store, record: dict) -> None:
    """Replace the lease whatever it holds, through the store's compare-and-swap (so a heartbeat
    landing at the same moment cannot silently undo it)."""
    data = json.dumps(record).encode()
    while True:
        current = store.read_versioned("lease.json", limit=LEASE_MAX_BYTES)
        if (
            store.write_if(data, "lease.json", expect=current.version if current else None, limit=LEASE_MAX_BYTES)
            is not None
        ):
            return


def race_processes(url: str, n: int, timeout: float) -> list:
    """``n`` spawned drivers race for one lease at once; their (submission, outcome, ...) reports."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # children reach moto through the FSSPEC_S3_* variables
    out, start = ctx.Queue(), ctx.Barrier(n)
    procs = [ctx.Process(target=race, args=(url, f"proc-{i}", start, out)) for i in range(n)]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(30)
    return results


def race_threads(leases: list) -> tuple[list, list[str]]:
    """Every lease tries ``acquire`` at the same moment from its own thread: (winners, refusals)."""
    import threading

    from syncpoint.policies.contracts.errors import LeaseRefused

    start = threading.Barrier(len(leases))
    won: list = []
    refused: list[str] = []

    def take(lease) -> None:
        start.wait()
        try:
            lease.acquire()
            won.append(lease)
        except LeaseRefused as e:
            refused.append(str(e))

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return won, refused
