"""``lease.json``: the one record of who holds a run directory, and its one strict parse.

Why apart from the lease's protocol (``syncpoint.workers.storage.lease``): the record is read by the
holder, a successor waiting for it, ``syncpoint status`` and the reaper of a dead holder alike, and
storage may be hostile, so every field a decision reads is checked in one place (``parse_lease``)
before any arithmetic touches it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, cast

from syncpoint.policies.contracts.spec import MAX_LEASE_TTL_S
from syncpoint.workers.storage import RunStorage
from syncpoint.workers.storage.holder_process import HolderProcess

LEASE = "lease.json"
LEASE_FORMAT = "syncpoint-lease/2"
# A lease is one small JSON object (~400 bytes); a larger lease.json is not one syncpoint wrote and is
# refused unread (storage may be hostile: a lease linked to /dev/zero must not be read forever).
LEASE_MAX_BYTES = 64 << 10


class LeaseRecord(HolderProcess, total=False):
    """``lease.json``'s fields. None is required: one read from storage is checked by ``parse_lease``
    for those a decision reads, and the rest are read with ``get``."""

    format: str
    job_identity: str
    job_name: str
    submission: str
    host: str
    ttl_s: float
    generation: int
    holder: str | None
    beat: int
    heartbeat: float
    released: bool
    released_because: str


@dataclass(frozen=True)
class HeldLease:
    """What ``lease.json`` says now: the parsed record, or why it is malformed."""

    record: LeaseRecord | None
    problem: str | None
    version: str
    age_s: float | None  # by the storage's clock; None where the store cannot tell
    generation: int

    @property
    def released(self) -> bool:
        return bool(self.record and self.record.get("released"))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def generation_of(obj: Any) -> int:
    """A record's fencing generation, 0 where it has none or a malformed one."""
    gen = obj.get("generation", 0) if isinstance(obj, dict) else 0
    return gen if isinstance(gen, int) and not isinstance(gen, bool) and gen >= 0 else 0


def parse_lease(data: bytes) -> tuple[LeaseRecord | None, str | None]:
    """``(record, None)`` for a usable lease, ``(None, why)`` for a malformed one.

    Every field a decision reads is checked here, so no malformed value (``"heartbeat": "soon"``,
    ``null``, a string TTL, NaN) can reach arithmetic and crash rank 0 while the others wait.
    """
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return None, f"not JSON ({type(e).__name__})"
    if not isinstance(obj, dict):
        return None, f"not a JSON object but {type(obj).__name__}"
    for key in ("submission", "job_identity"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            return None, f"{key} is {obj.get(key)!r}, not a non-empty string"
    if not _finite(obj.get("ttl_s")) or obj["ttl_s"] <= 0:
        return None, f"ttl_s is {obj.get('ttl_s')!r}, not a positive number of seconds"
    if obj["ttl_s"] > MAX_LEASE_TTL_S:  # no job spec can set more: not a lease syncpoint wrote
        return None, f"ttl_s is {obj['ttl_s']!r}, over the {MAX_LEASE_TTL_S:.0f}s any job's resume.lease_ttl_s may be"
    if "heartbeat" in obj and not _finite(obj["heartbeat"]):
        return None, f"heartbeat is {obj['heartbeat']!r}, not a time"
    gen = obj.get("generation", 0)
    if not isinstance(gen, int) or isinstance(gen, bool) or gen < 0:
        return None, f"generation is {gen!r}, not a non-negative integer"
    if not isinstance(obj.get("holder", ""), (str, type(None))) or not isinstance(obj.get("released", False), bool):
        return None, "holder or released has the wrong type"
    return cast(LeaseRecord, obj), None  # its fields a decision reads, checked above


def read_lease(storage: RunStorage) -> HeldLease | None:
    """The lease as stored now (``None``: there is none)."""
    got = storage.read_versioned(LEASE, limit=LEASE_MAX_BYTES)
    if got is None:
        return None
    record, problem = parse_lease(got.data)
    generation = record["generation"] if record and "generation" in record else generation_of(loose_json(got.data))
    return HeldLease(record, problem, got.version, got.age_s, generation)


def loose_json(data: bytes) -> Any:
    """JSON if it parses, else None: a malformed lease still tells its generation where it can."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def encode(record: LeaseRecord) -> bytes:
    """The bytes of ``lease.json`` (one encoding, so a version compare sees equal records as equal)."""
    return json.dumps(record, indent=1, sort_keys=True).encode()
