"""The run's event log: one JSON object per event under ``<run>/events/``.

Why one file per event: object stores cannot append, and a crashed writer must never corrupt
earlier events. File names sort by time, so listing the directory is reading the timeline.
What an event holds is ``policies.journal``'s models; what is asked of a log is its ``Journal``.
An event file is read up to ``EVENT_MAX_BYTES`` (an event is a few hundred bytes; storage may be
hostile), and one that cannot be read (a link, a FIFO, too large, not JSON) is skipped.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from policies.errors import UnsafeEntry
from policies.journal import Event, Journal, event_to_emit, stored_form
from workers.storage import RunStorage

EVENTS_DIR = "events"
EVENT_MAX_BYTES = 1 << 20  # the largest event written is a resume decision listing candidates: a few KiB


class EventLog:
    def __init__(self, storage: RunStorage, source: str = "worker") -> None:
        self.storage, self.source = storage, source

    def emit(self, event: Event | str, /, **fields: Any) -> Event:
        """Write one event: ``emit(StateCommitted(...))``, or ``emit("state_committed", **fields)``.

        Either way it is validated first (``policies.journal.event_to_emit``): an unknown kind, an
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

    def read_all(self) -> list[dict[str, Any]]:
        """Every stored record as written, in time order: the raw log (``syncpoint events --json``).
        Files that hold no JSON object are skipped. Code that asks questions of the log reads ``journal()``."""
        out = []
        for name in event_files(self.storage):
            record = read_record(self.storage, name)
            if record is not None:
                out.append(record)
        return sorted(out, key=_time_of)

    def journal(self) -> Journal:
        return Journal.parse(self.read_all())


def event_files(storage: RunStorage) -> list[str]:
    """The names of the stored events; none while ``events/`` is no real directory (a planted link is
    never followed; the next event written replaces it, with a warning)."""
    try:
        return [n for n in storage.list_files(EVENTS_DIR) if n.endswith(".json")]
    except UnsafeEntry:
        return []


def read_record(storage: RunStorage, name: str) -> dict[str, Any] | None:
    """One stored event as written, ``None`` when it is not a readable JSON object (yet)."""
    try:
        record = storage.read_json(EVENTS_DIR, name, limit=EVENT_MAX_BYTES)
    except (ValueError, OSError):  # not whole yet, or unsafe (UnsafeEntry): skipped
        return None
    return record if isinstance(record, dict) else None


def _time_of(record: dict[str, Any]) -> float:
    t = record.get("time")
    return float(t) if isinstance(t, int | float) else 0.0
