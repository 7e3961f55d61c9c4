"""A lease on the run directory: one live owner at a time, taken over when its heartbeat stops.

Two runs writing states into one run directory would interleave commits and retention. The
owner (rank 0 of a submission) writes ``<run>/lease.json`` with its job identity, submission id
and a heartbeat refreshed every ``ttl/3`` seconds. Another submission is refused while the
heartbeat is fresh; a restart inside the same submission (Ray Train's worker-group restart)
keeps the lease; a successor of the same job takes over once the heartbeat is older than the TTL
(the owner died: a KubeRay retry, a re-submitted job). Object stores have no compare-and-swap,
so the take-over is write-then-verify: after writing, the successor re-reads the lease and
backs off if someone else won.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

from workers.storage import RunStorage

LEASE = "lease.json"


class LeaseRefused(RuntimeError):
    pass


class RunLease:
    def __init__(self, storage: RunStorage, *, job_identity: str, job_name: str, submission: str,
                 ttl_s: float) -> None:
        self.storage, self.ttl = storage, ttl_s
        self.record = {"job_identity": job_identity, "job_name": job_name, "submission": submission,
                       "host": socket.gethostname(), "pid": os.getpid(), "ttl_s": ttl_s}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> dict[str, Any] | None:
        try:
            return self.storage.read_json(LEASE)
        except (FileNotFoundError, ValueError):
            return None

    def _write(self) -> None:
        self.storage.write_json({**self.record, "heartbeat": time.time()}, LEASE)

    def acquire(self) -> str:
        """Take the lease or raise ``LeaseRefused`` naming the holder and the fix; returns how."""
        held = self._read()
        how = "new"
        if held:
            age = time.time() - float(held.get("heartbeat", 0))
            if held.get("submission") == self.record["submission"]:
                how = "restart"
            elif held.get("job_identity") != self.record["job_identity"]:
                raise LeaseRefused(
                    f"{self.storage.url} belongs to another job ({held.get('job_name')!r}, identity "
                    f"{held.get('job_identity')}; last heartbeat {age:.0f}s ago from {held.get('host')}). "
                    "Use another name or storage for this job.")
            elif age < float(held.get("ttl_s", self.ttl)):
                raise LeaseRefused(
                    f"{self.storage.url} is in use by another running submission of this job (host "
                    f"{held.get('host')}, pid {held.get('pid')}, heartbeat {age:.0f}s ago). Wait for it to finish, "
                    f"stop it, or, if it is dead, retry after its lease expires ({held.get('ttl_s', self.ttl):.0f}s "
                    "without a heartbeat).")
            else:
                how = "takeover"
        self._write()
        time.sleep(0.02 if self.storage.local else min(0.2, self.ttl / 10))  # let a racing writer land
        now = self._read()
        if not now or now.get("submission") != self.record["submission"]:
            raise LeaseRefused(f"{self.storage.url}: another submission took the lease at the same moment; retry")
        self._thread = threading.Thread(target=self._beat, name="syncpoint-lease", daemon=True)
        self._thread.start()
        return how

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self._write()
            except Exception:  # noqa: BLE001 - a missed beat is retried; the TTL absorbs it
                pass

    def stop(self) -> None:
        """Stop heart-beating (what a crash does); the lease then expires after its TTL."""
        self._stop.set()

    def release(self) -> None:
        self.stop()
        release_lease(self.storage, self.record["submission"])


def release_lease(storage: RunStorage, submission: str) -> None:
    """The driver's last word on a submission (finished or failed for good): free the run directory."""
    try:
        held = storage.read_json(LEASE)
    except (FileNotFoundError, ValueError):
        return
    if held.get("submission") == submission:
        try:
            storage.fs.rm(storage.path(LEASE))
        except FileNotFoundError:
            pass
