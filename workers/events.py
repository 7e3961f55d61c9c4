"""The run's event log: one JSON object per event under ``<run>/events/``.

Why one file per event: object stores cannot append, and a crashed writer must never corrupt
earlier events. File names sort by time, so listing the directory is reading the timeline.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from workers.storage import RunStorage


class EventLog:
    def __init__(self, storage: RunStorage, source: str = "worker") -> None:
        self.storage, self.source = storage, source

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "time": time.time(), "source": self.source, **fields}
        name = f"{time.time_ns():020d}-{kind}-{uuid.uuid4().hex[:6]}.json"
        self.storage.write_json(event, "events", name)
        return event

    def read_all(self) -> list[dict[str, Any]]:
        out = []
        for name in self.storage.list_files("events"):
            if name.endswith(".json"):
                try:
                    out.append(self.storage.read_json("events", name))
                except (ValueError, OSError):
                    continue
        return sorted(out, key=lambda e: e.get("time", 0))
