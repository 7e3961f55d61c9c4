"""A lease on the run directory: exactly one submission writes it, fenced by a generation.

Two runs writing states into one run directory would interleave commits and retention, so rank 0
of a submission holds ``<run>/lease.json``: its job identity, submission, a holder token and a
*fencing generation* that goes up by one on every acquisition. Every manifest records the
generation that committed it.

Why each rule:

* **Compare-and-swap, never read-then-write.** Every change of the lease (create, take-over,
  heartbeat, release) is ``RunStorage.write_if``: a conditional PUT on S3 (``If-None-Match: *`` to
  create, ``If-Match: <etag>`` to replace), a read-compare-rename under an exclusive ``flock``
  locally, a process lock on memory://. Two drivers that both see "free" cannot both win, and
  an owner whose lease was taken over cannot write it back: its next heartbeat fails.
* **The storage's clock, not ours.** A lease expires when the *storage* says it was last written
  more than its TTL ago (file mtime against a freshly touched file; object LastModified against
  the response's Date). A successor whose clock runs ahead cannot take over a live owner, and
  an owner whose clock runs ahead cannot make its lease immortal. The ``heartbeat`` field is
  informational only.
* **Re-checked where it matters.** The heartbeat re-writes the lease every ``ttl/3`` through the
  compare-and-swap; rank 0 renews it before every save starts writing, right before every
  manifest and before every retention pass (``confirm``), so a commit happens at most
  milliseconds after the lease was proven ours and renewed, a full TTL before anyone could take
  it. A lost lease stops the run with ``LeaseLostError`` on every rank, naming the submission
  that took over: rank 0 broadcasts the verdict in the save's own collectives, and a loss the
  heartbeat finds between saves rides on the next boundary's all-reduce
  (``syncpoint.workers.training.boundary_vote.BoundaryVote.lease_lost``).
* **A malformed lease is not a crash.** It is reported, treated as held by an unknown owner, and
  taken over once the storage says it is older than this run's TTL.
* **A lease that is no file is not read.** ``lease.json`` is read up to ``LEASE_MAX_BYTES``, and
  locally only as a regular file reached without a link (so is its ``.lock``, where a planted link
  is replaced, never created through): a link, a FIFO or a huge file refuses the submission with
  what it is (the driver's wait gives up at once), instead of blocking or reading forever.

A restart inside the same submission (Ray Train's worker-group restart) takes the lease back at
once with a new generation; a successor of the same job takes over once the lease has expired (the
owner died: a KubeRay retry, a re-submitted job); another job is always refused. A finished
submission marks the lease released (a tombstone, so the generation keeps counting up).

A re-submission right after its predecessor died (a lost head pod: driver, controller and lease
holder gone at once, then a KubeRay retry or a user re-submitting) would find the dead holder's
lease still young and be refused, costing a whole retry. A holder that is provably dead (it ran on
this host and its process is gone: ``holder_process``) is taken over at once; for any other, the
driver first waits, bounded, in ``await_expiry``: it watches the lease until the storage says it
expired (then rank 0 takes it over) or until its holder renews it (alive after all: rank 0 refuses). The rule that
decides stays in ``RunLease``; the wait only picks the moment to ask.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeGuard

from syncpoint.policies.contracts.errors import LeaseLostError, LeaseRefused, UnsafeEntry
from syncpoint.workers.storage import RunStorage, holder_process
from syncpoint.workers.storage.lease_record import (
    LEASE,
    LEASE_FORMAT,
    LEASE_MAX_BYTES,
    HeldLease,
    LeaseRecord,
    encode,
    read_lease,
)

CONFIRM_TRIES = 3


def _warn(message: str) -> None:
    print(f"[syncpoint] WARNING: {message}", file=sys.stderr, flush=True)


class RunLease:
    """Rank 0's hold on the run directory: acquire, heartbeat, confirm before writes, release."""

    def __init__(self, storage: RunStorage, *, job_identity: str, job_name: str, submission: str, ttl_s: float) -> None:
        self.storage, self.ttl = storage, float(ttl_s)
        self.identity: LeaseRecord = {
            "job_identity": job_identity,
            "job_name": job_name,
            "submission": submission,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            **holder_process.this_process(),  # what proves this holder dead to a successor on this host
            "ttl_s": self.ttl,
        }
        self.token = uuid.uuid4().hex  # this holder, distinct from an earlier attempt of the same submission
        self.generation = 0
        self.lost: LeaseLostError | None = None
        self.predecessor: HeldLease | None = None  # the expired lease this holder took over, as it read it
        self._version: str | None = None
        self._beats = 0
        self._renewed = 0.0  # monotonic time of the last write proven ours
        self._mutex = threading.Lock()  # the heartbeat and a commit's confirm never race each other
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- acquisition
    def acquire(self) -> str:
        """Take the lease or raise ``LeaseRefused`` naming the holder and the fix; returns how
        (``new``, ``released``, ``restart``, ``takeover``)."""
        try:
            how = self._take()
        except LeaseRefused:
            raise
        except UnsafeEntry as e:  # a link, a FIFO, a huge file: planted, never read
            raise LeaseRefused(
                f"{self.storage.url}: the run directory's lease cannot be read: {e}. A lease is a small "
                f"regular file syncpoint writes: remove {LEASE} (once no other submission of this job "
                "is running), then retry"
            ) from None
        except Exception as e:  # noqa: BLE001 - any storage failure becomes a refusal that names it
            raise LeaseRefused(
                f"{self.storage.url}: could not take the run directory's lease "
                f"({type(e).__name__}: {e}); check that the storage is reachable and "
                "writable, then retry"
            ) from None
        self._thread = threading.Thread(target=self._beat, name="syncpoint-lease", daemon=True)
        self._thread.start()
        return how

    def _take(self) -> str:
        lost_race = False
        for _ in range(8):
            held = read_lease(self.storage)
            how, generation = self._judge(held, lost_race)
            version = self.storage.write_if(
                encode(self._record(generation)), LEASE, expect=held.version if held else None, limit=LEASE_MAX_BYTES
            )
            if version is not None:
                self.generation, self._version, self._renewed = generation, version, time.monotonic()
                self.predecessor = held if how == "takeover" else None
                return how
            lost_race = True  # someone changed it between our read and our write: judge it again
        raise LeaseRefused(
            f"{self.storage.url}: the lease kept changing while this submission tried to take "
            "it: another submission is starting on the same run directory. Retry once it is "
            "running (this one will then be refused) or gone."
        )

    def _judge(self, held: HeldLease | None, lost_race: bool) -> tuple[str, int]:
        """How this submission may take the lease as it stands, and the next generation; raises
        ``LeaseRefused`` when it may not."""
        if held is None:
            return "new", 1
        nxt = held.generation + 1
        if held.problem is not None:
            self._judge_malformed(held)
            return "takeover", nxt
        rec = held.record or {}
        if held.released:
            return "released", nxt
        if rec["submission"] == self.identity["submission"]:
            return "restart", nxt
        if rec["job_identity"] != self.identity["job_identity"]:
            raise LeaseRefused(
                f"{self.storage.url} belongs to another job ({rec.get('job_name')!r}, identity "
                f"{rec['job_identity']}; lease written {_age_text(held.age_s)} from {rec.get('host')}). "
                "Use another name or storage for this job."
            )
        ttl = float(rec["ttl_s"])
        if not self._expired(held, ttl) and not holder_process.provably_dead(rec):
            race = "took the lease at the same moment; " if lost_race else ""
            raise LeaseRefused(
                f"{self.storage.url} is in use by another running submission of this job ({rec['submission']} "
                f"{race}host {rec.get('host')}, pid {rec.get('pid')}, generation {held.generation}, lease "
                f"written {_age_text(held.age_s)} by the storage's clock). Wait for it to finish, stop it, or, "
                f"if it is dead, retry after its lease expires ({ttl:.0f}s without a heartbeat)."
            )
        return "takeover", nxt

    def _judge_malformed(self, held: HeldLease) -> None:
        """A malformed lease belongs to an unknown owner: held until it is older than our TTL."""
        expired = self._expired(held, self.ttl)
        _warn(
            f"{self.storage.url}/{LEASE} is malformed ({held.problem}); treated as held until it is "
            f"{self.ttl:.0f}s old by the storage's clock (it was written {_age_text(held.age_s)})"
            + ("; taking it over" if expired else "")
        )
        if not expired:
            raise LeaseRefused(
                f"{self.storage.url}/{LEASE} is malformed ({held.problem}) and was written "
                f"{_age_text(held.age_s)}: it counts as held by an unknown submission until it is "
                f"{self.ttl:.0f}s old. If no other submission is running, retry then (or delete it)."
            )

    def _expired(self, held: HeldLease, ttl: float) -> bool:
        if held.age_s is not None:
            return held.age_s >= ttl
        return self._unchanged_for(held, ttl)

    def _unchanged_for(self, held: HeldLease, ttl: float) -> bool:
        """A store that cannot date its files: the lease expired if it stays unchanged for a full
        TTL of our own monotonic clock (a live owner re-writes it every ttl/3)."""
        deadline = time.monotonic() + ttl
        while time.monotonic() < deadline:
            time.sleep(min(1.0, ttl / 10))
            now = read_lease(self.storage)
            if now is None or now.version != held.version:
                return False
        return True

    def takeover_line(self) -> str | None:
        """After a take-over: one line naming the dead holder and how long its lease had gone
        unrenewed by the storage's clock (so a log shows the hand-over was not early)."""
        held = self.predecessor
        if held is None:
            return None
        rec = held.record or {}
        who = (
            f"submission {rec['submission']} (host {rec.get('host')}, pid {rec.get('pid')})"
            if held.problem is None
            else f"a malformed lease ({held.problem})"
        )
        ttl = float(rec["ttl_s"]) if held.problem is None else self.ttl
        age = (
            f"unrenewed for {held.age_s:.1f}s by the storage's clock"
            if held.age_s is not None
            else "unchanged for a whole TTL while watched"
        )
        if held.problem is None and holder_process.provably_dead(rec) and not self._expired(held, ttl):
            return (
                f"took over the run directory's lease from {who}, generation {held.generation}: its process is "
                f"gone from this host ({age}, before its {ttl:g}s TTL); this submission writes as generation "
                f"{self.generation}"
            )
        return (
            f"took over the run directory's lease from {who}, generation {held.generation}: {age}, past its "
            f"{ttl:g}s TTL; this submission writes as generation {self.generation}"
        )

    def _record(self, generation: int, released: bool = False) -> LeaseRecord:
        return {
            "format": LEASE_FORMAT,
            **self.identity,
            "generation": generation,
            "holder": self.token,
            "beat": self._beats,
            "heartbeat": time.time(),
            "released": released,
        }

    # ---- holding
    def renew(self, *, from_heartbeat: bool = False) -> None:
        """Re-read and re-write the lease in one compare-and-swap; ``LeaseLostError`` when it is no
        longer ours (and from then on, for good)."""
        with self._mutex:
            if from_heartbeat and self._stop.is_set():
                return
            if self.lost is not None:
                raise self.lost
            if self._version is None:
                raise RuntimeError("the lease is not held (never acquired, or released)")
            held = None
            for _ in range(2):
                self._beats += 1
                version = self.storage.write_if(
                    encode(self._record(self.generation)), LEASE, expect=self._version, limit=LEASE_MAX_BYTES
                )
                if version is not None:
                    self._version, self._renewed = version, time.monotonic()
                    return
                held = read_lease(self.storage)
                if not self._is_mine(held):
                    break
                self._version = held.version  # our own write landed (a retried PUT)
            raise self._lose(held)

    def _is_mine(self, held: HeldLease | None) -> TypeGuard[HeldLease]:
        return bool(
            held
            and held.record
            and not held.released
            and held.record.get("holder") == self.token
            and held.generation == self.generation
        )

    def confirm(self) -> str | None:
        """Right before a manifest or a retention pass: ``None`` while this run holds the lease
        (just renewed, so nobody can take it for a full TTL), else why not; the run must stop."""
        error: Exception | None = None
        for attempt in range(CONFIRM_TRIES):
            try:
                self.renew()
                return None
            except LeaseLostError as e:
                return str(e)
            except Exception as e:  # noqa: BLE001 - a storage hiccup is retried, then named in the loss
                error = e
                time.sleep(0.5 * (attempt + 1))
        lost = self._set_lost(
            f"{self.storage.url}: could not confirm that this run still holds the run directory's lease "
            f"({type(error).__name__}: {error}); it stopped before writing rather than risk two writers. Check "
            "that the storage is reachable, then re-submit: the run resumes from its newest committed state."
        )
        return str(lost)

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew(from_heartbeat=True)
            except LeaseLostError:
                return
            except Exception as e:  # noqa: BLE001 - the heartbeat thread must survive a storage hiccup
                if time.monotonic() - self._renewed >= self.ttl:
                    self._set_lost(
                        f"{self.storage.url}: could not renew the run directory's lease for {self.ttl:.0f}s "
                        f"({type(e).__name__}: {e}); another submission may have taken it over, so this run "
                        "stops. Check the storage, then re-submit."
                    )
                    return

    def _lose(self, held: HeldLease | None) -> LeaseLostError:
        return self._set_lost(
            f"{self.storage.url}: this run (submission {self.identity['submission']}, lease generation "
            f"{self.generation}) lost the run directory's lease to {_who(held, self.identity['submission'])}; it "
            "stopped before writing anything more, so that two runs never commit into one directory. Only one "
            "submission of a job may run at a time: let the other one finish (or stop it), then re-submit; the "
            "run resumes from its newest committed state."
        )

    def _set_lost(self, message: str) -> LeaseLostError:
        if self.lost is None:
            self.lost = LeaseLostError(message)
            _warn(message)
        self._stop.set()
        return self.lost

    def stop(self) -> None:
        """Stop heart-beating (what a crash does); the lease then expires after its TTL."""
        self._stop.set()

    def release(self) -> None:
        """A finished run: stop heart-beating and mark the lease released. Raises
        ``LeaseLostError`` if it was lost meanwhile: another submission writes here now."""
        self.stop()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, self.ttl))
        with self._mutex:
            if self.lost is not None:
                raise self.lost
            if self._version is None:
                return
            version = self.storage.write_if(
                encode(self._record(self.generation, released=True)),
                LEASE,
                expect=self._version,
                limit=LEASE_MAX_BYTES,
            )
            if version is None:
                raise self._lose(read_lease(self.storage))
            self._version = None


def _who(held: HeldLease | None, mine: str) -> str:
    if held is None:
        return "nobody: lease.json was deleted"
    if held.problem is not None:
        return f"a malformed lease.json ({held.problem})"
    rec = held.record or {}
    if held.released:
        return f"a release of submission {rec['submission']} (its driver declared it over)"
    same = rec["submission"] == mine
    whose = "a newer attempt of this same submission" if same else f"submission {rec['submission']}"
    return f"{whose} (generation {held.generation}, host {rec.get('host')}, pid {rec.get('pid')})"


def _age_text(age: float | None) -> str:
    return "at an unknown time" if age is None else f"{age:.0f}s ago"


def release_lease(storage: RunStorage, submission: str) -> None:
    """The driver's last word on a submission (finished or failed for good): mark the lease
    released if this submission still holds it. Never raises: it runs in the driver's cleanup."""
    try:
        for _ in range(3):
            held = read_lease(storage)
            if held is None or held.record is None or held.released or held.record.get("submission") != submission:
                return
            tombstone: LeaseRecord = {**held.record, "released": True}
            if storage.write_if(encode(tombstone), LEASE, expect=held.version, limit=LEASE_MAX_BYTES) is not None:
                return
    except Exception as e:  # noqa: BLE001 - driver cleanup never raises; the lease expires anyway
        _warn(
            f"{storage.url}: could not release the lease of submission {submission} ({type(e).__name__}: {e}); "
            "it expires after its TTL"
        )


# ---------------------------------------------------------------- a re-submission waits for a dead holder


def await_expiry(
    storage: RunStorage,
    job_identity: str,
    *,
    own_ttl_s: float,
    say: Callable[[str], None] | None = None,
    poll_s: float | None = None,
) -> str:
    """On the driver, before any worker starts: if another submission of this job holds a live-looking
    lease, watch it until it expires or its holder shows it is alive, and say so while waiting.

    A holder that is provably dead (``holder_process``: this host's kernel and pid namespace, its
    process gone) is not waited for: its lease is marked released and ``"free"`` returned.

    Returns ``"free"`` (no lease, a released or malformed one, another job's: the worker judges at
    once), ``"expired"`` (expired now: rank 0 will take it over), ``"alive"`` (its holder renewed
    it, or another submission took it: rank 0 will refuse, naming it) or ``"undecided"`` (still
    unexpired at the bound: rank 0 judges). Bounded by this job's own limits, not the stored
    lease's: at most the lease's remaining TTL, and never more than ``own_ttl_s`` (the live spec's
    ``resume.lease_ttl_s``), plus ``max(2 s, own_ttl_s/10)``; a lease's ``ttl_s`` comes from storage,
    which anyone with write access can set to centuries. A live holder renews every ttl/3, so a
    live one ends the wait sooner. SIGINT ends it (``KeyboardInterrupt`` passes through). Never
    raises otherwise: a storage error ends the wait and rank 0 judges (and names the error).
    """
    say = say or _say
    try:
        held = read_lease(storage)
        answer = _without_waiting(storage, held, job_identity, say)
        if answer is not None or held is None or held.record is None:
            return answer or "free"
        rec = held.record
        ttl = float(rec["ttl_s"])
        remaining = ttl - (held.age_s or 0.0)
        bound = min(remaining, own_ttl_s) + max(2.0, own_ttl_s / 10)
        poll = poll_s if poll_s is not None else min(1.0, max(0.05, min(ttl, own_ttl_s) / 20))
        started = said = time.monotonic()
        longer = (
            (
                f" (its TTL, {ttl:.0f}s, is longer than this job's resume.lease_ttl_s, {own_ttl_s:g}s: the "
                "workers judge it after that)"
            )
            if remaining > own_ttl_s
            else ""
        )
        say(
            f"the run directory's lease is held by submission {rec['submission']} of this job (host {rec.get('host')}, "
            f"pid {rec.get('pid')}, generation {held.generation}), last renewed {_age_text(held.age_s)} by the "
            f"storage's clock. If its driver is gone (a lost head, a killed driver), the lease expires in "
            f"{remaining:.0f}s: waiting for that, at most {bound:.0f}s{longer}. A live holder renews it every "
            f"{ttl / 3:.0f}s; if it does, this submission is refused. {_how_to_stop()}"
        )
        while True:
            time.sleep(poll)
            now = read_lease(storage)
            waited = time.monotonic() - started
            if now is None or now.problem is not None or now.released:
                return "free"
            if now.version != held.version:
                return "alive"  # renewed by its holder, or taken by another submission: rank 0 judges
            if holder_process.provably_dead(rec):  # it died while watched (an orphaned rank that ended)
                return _release_for_dead_holder(storage, now, say)
            if (now.age_s is not None and now.age_s >= ttl) or (now.age_s is None and waited >= ttl):
                say(
                    f"the lease of submission {rec['submission']} expired after {waited:.0f}s of waiting: "
                    "taking over (a new generation)"
                )
                return "expired"
            if waited >= bound:
                return "undecided"
            if time.monotonic() - said >= 10:
                said = time.monotonic()
                say(
                    f"still waiting for the lease of submission {rec['submission']} to expire "
                    f"({waited:.0f}s of at most {bound:.0f}s)"
                )
    except Exception as e:  # noqa: BLE001 - the wait is a courtesy; rank 0's acquisition judges and names errors
        _warn(
            f"{storage.url}: could not watch the run directory's lease ({type(e).__name__}: {e}); "
            "the training workers will judge it"
        )
        return "undecided"


def _without_waiting(
    storage: RunStorage, held: HeldLease | None, job_identity: str, say: Callable[[str], None]
) -> str | None:
    """``await_expiry``'s answer when there is nothing to wait for, or None."""
    if held is None or held.problem is not None or held.released or held.record is None:
        return "free"
    rec = held.record
    if rec["job_identity"] != job_identity:
        return "free"
    if held.age_s is not None and held.age_s >= float(rec["ttl_s"]):
        return "expired"
    if holder_process.provably_dead(rec):
        return _release_for_dead_holder(storage, held, say)
    return None


def _release_for_dead_holder(storage: RunStorage, held: HeldLease, say: Callable[[str], None]) -> str:
    """Mark the lease of a holder that is provably dead (``holder_process``) released, by compare-and-swap
    on the very version read (anything written since wins, and rank 0 judges that), so rank 0 takes it
    at once wherever it runs, fenced by a new generation."""
    rec = held.record or {}
    tombstone: LeaseRecord = {**rec, "released": True, "released_because": "its holder's process is gone"}
    if storage.write_if(encode(tombstone), LEASE, expect=held.version, limit=LEASE_MAX_BYTES) is None:
        return "alive"
    say(
        f"the run directory's lease was held by submission {rec['submission']} of this job (host {rec.get('host')}, "
        f"pid {rec.get('pid')}, generation {held.generation}), whose process is gone from this host: taking over "
        "at once (a new generation)"
    )
    return "free"


def _how_to_stop() -> str:
    """What ends the wait in this process. A process started with SIGINT ignored (a script's
    ``command &``, ``nohup``) keeps ignoring it, as Unix commands do: Ctrl-C is then no way out, and
    saying it is would leave the user waiting on a promise."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return f"This process ignores SIGINT (started in the background?): `kill {os.getpid()}` stops waiting."
    return "Ctrl-C stops waiting."


def _say(message: str) -> None:
    print(f"syncpoint: {message}", flush=True)
