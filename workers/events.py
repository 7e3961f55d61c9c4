"""The run's event log: one JSON object per event under ``<run>/events/``.

Why one file per event: object stores cannot append, and a crashed writer must never corrupt
earlier events. File names sort by time, so listing the directory is reading the timeline.
What an event holds is ``policies.journal``'s models; what is asked of a log is its ``Journal``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from policies.journal import Event, Journal, event_to_emit, stored_form
from workers.storage import RunStorage


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
        self.storage.write_json(stored_form(typed), "events", name)
        return typed

    def read_all(self) -> list[dict[str, Any]]:
        """Every stored record as written, in time order: the raw log (``syncpoint events --json``).
        Files that hold no JSON object are skipped. Code that asks questions of the log reads ``journal()``."""
        out = []
        for name in self.storage.list_files("events"):
            if name.endswith(".json"):
                try:
                    record = self.storage.read_json("events", name)
                except (ValueError, OSError):
                    continue
                if isinstance(record, dict):
                    out.append(record)
        return sorted(out, key=_time_of)

    def journal(self) -> Journal:
        return Journal.parse(self.read_all())


def _time_of(record: dict[str, Any]) -> float:
    t = record.get("time")
    return float(t) if isinstance(t, int | float) else 0.0
