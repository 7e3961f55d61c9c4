"""The run's event log: one JSON object per event under ``<run>/events/``.

Why one file per event: object stores cannot append, and a crashed writer must never corrupt
earlier events. File names sort by time, so listing the directory is reading the timeline.
What an event holds is ``syncpoint.policies.contracts.journal``'s models; what is asked of a log is its ``Journal``.

Why reading never fails: whoever can write the storage can plant a file among the events, and
every attempt reads the log at its start. A file that holds no record within bounds (``read_record``:
too large, not JSON, nested too deep, an integer beyond 64 bits, no object, no usable time) is
skipped and named (``Journal.skipped``, one line in ``syncpoint events``); the rest is read.
A link or a FIFO among the events is never read, and ``events/`` itself as a link reads as empty.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from syncpoint.policies.contracts.bounded_json import BoundedJsonError, JSONObject, loads_bounded
from syncpoint.policies.contracts.errors import OversizedEntry, UnsafeEntry
from syncpoint.policies.contracts.journal import Event, Journal, event_to_emit, stored_form, time_of
from syncpoint.workers.storage import RunStorage

EVENTS_DIR = "events"
EVENT_MAX_BYTES = 1 << 20  # one event file: the largest written (a resume decision, a progress batch) is KiBs
EVENT_MAX_DEPTH = 16  # an event nests 4 levels (progress -> records -> a record -> its samples)


class EventLog:
    """A run's event log in storage (``events/``): typed events written as JSON lines, read back whole."""

    def __init__(self, storage: RunStorage, source: str = "worker") -> None:
        self.storage, self.source = storage, source

    def emit(self, event: Event | str, /, **fields: Any) -> Event:
        """Write one event: ``emit(StateCommitted(...))``, or ``emit("state_committed", **fields)``.

        Either way it is validated first (``syncpoint.policies.contracts.journal.event_to_emit``): an unknown kind, an
        unknown field or a missing one raises ``pydantic.ValidationError`` and nothing is written.
        The time is stamped here, and the source unless the event names its own (a notice's)."""
        if isinstance(event, str):
            given = {"kind": event, **fields}
        elif fields:
            raise TypeError("emit(event) takes no keyword fields: set them on the event")
        else:
            given = stored_form(event)
        typed = event_to_emit({"source": self.source, **given, "time": time.time()})
        name = f"{time.time_ns():020d}-{typed.kind}-{uuid.uuid4().hex[:6]}.json"
        self.storage.write_json(stored_form(typed), EVENTS_DIR, name)
        return typed

    def read_stored(self) -> StoredLog:
        """Every stored record as written, in time order, and the files that hold none, each named
        with why (``read_record``). Never raises for what a file holds."""
        records: list[JSONObject] = []
        skipped: list[Unreadable] = []
        for name in event_files(self.storage):
            got = read_record(self.storage, name)
            if isinstance(got, Unreadable):
                skipped.append(got)
            else:
                records.append(got)
        return StoredLog(sorted(records, key=lambda r: time_of(r) or 0.0), skipped)

    def read_all(self) -> list[JSONObject]:
        """Every stored record as written, in time order: the raw log (``syncpoint events --json``).
        Code that asks questions of the log reads ``journal()``."""
        return self.read_stored().records

    def journal(self) -> Journal:
        stored = self.read_stored()
        return Journal.parse(stored.records, skipped=[str(u) for u in stored.skipped])


@dataclass(frozen=True)
class Unreadable:
    """An event file that holds no record, and why; ``partial``: it may be one still being written
    (a follower reads it again next time)."""

    name: str
    reason: str
    partial: bool = False

    def __str__(self) -> str:
        return f"{_printable(self.name)} ({self.reason})"


@dataclass(frozen=True)
class StoredLog:
    """What reading the event log gave: the records, and the lines it could not read (named, never raised)."""

    records: list[JSONObject]
    skipped: list[Unreadable] = field(default_factory=list)


def event_files(storage: RunStorage) -> list[str]:
    """The names of the stored events; none while ``events/`` is no real directory (a planted link is
    never followed; the next event written replaces it, with a warning)."""
    try:
        return [n for n in storage.list_files(EVENTS_DIR) if n.endswith(".json")]
    except UnsafeEntry:
        return []


def read_record(storage: RunStorage, name: str) -> JSONObject | Unreadable:
    """One stored event as written, or why the file holds none: unreadable, larger than
    EVENT_MAX_BYTES, not JSON, nested deeper than EVENT_MAX_DEPTH, an integer beyond 64 bits, not an
    object, or a ``time`` that is no usable number of seconds (``syncpoint.policies.contracts.journal.time_of``)."""
    try:
        data = storage.read_bytes(EVENTS_DIR, name, limit=EVENT_MAX_BYTES)
    except OversizedEntry:
        return Unreadable(name, f"larger than {EVENT_MAX_BYTES} bytes")
    except UnsafeEntry as e:  # a link, a FIFO, a device: never read
        return Unreadable(name, _printable(str(e), 200))
    except OSError as e:
        return Unreadable(name, f"unreadable: {type(e).__name__}", partial=True)
    try:
        record = loads_bounded(data, max_bytes=EVENT_MAX_BYTES, max_depth=EVENT_MAX_DEPTH)
    except BoundedJsonError as e:
        return Unreadable(name, str(e), partial=str(e).startswith("not JSON"))
    if not isinstance(record, dict):
        return Unreadable(name, "not a JSON object")
    if time_of(record) is None:
        return Unreadable(name, "its time is not a usable number of seconds")
    return record


def skipped_line(skipped: list[str], shown: int = 5) -> str:
    """One line (``syncpoint events``, the loop): how many files were skipped, naming a few."""
    more = f" and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return f"{len(skipped)} event record(s) unreadable, skipped: {', '.join(skipped[:shown])}{more}"


def _printable(text: str, limit: int = 120) -> str:
    """A file name from storage as a message quotes it: no control characters, bounded."""
    text = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return text if len(text) <= limit else text[:limit] + "..."
