"""A W&B offline run's own log read back for its steps: which steps an earlier attempt already logged.

Why by hand: W&B has no API that reads an offline run's ``.wandb`` file; it is a LevelDB log of
``Record`` protobufs (``wandb.proto.wandb_internal_pb2``), and a resumed attempt must not log a step
twice (``syncpoint.workers.observation.trackers``). Read without following a link and up to a bound.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import time
from collections.abc import Iterator
from typing import Any

from syncpoint.policies.contracts.bounded_json import JSONObject

WANDB_LOG_MAX_BYTES = 1 << 30  # an offline .wandb file read for its steps: at most this much
FINISH_WAIT_S = 30.0  # how long a finished run's end waits for its transaction log's last record


class OfflineHistory:
    """What a ``.wandb`` file holds: each history row's step and values (``key`` -> value)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, JSONObject]] = []

    @property
    def steps(self) -> list[int]:
        return [s for s, _ in self.rows]


def offline_files(where: str | None, run_id: str) -> list[str]:
    """The ``.wandb`` files of this run id's offline runs under a W&B directory, oldest first.

    W&B names each offline run ``offline-run-<YYYYMMDD_HHMMSS>-<id>``, and a second run of the same id
    started within the same second ``...-<id>-1`` (then ``-2``): an attempt that follows a failure
    within a second (an in-place recovery, a retry in the same process) is one of those."""
    base = os.path.join(where or os.getcwd(), "wandb")
    named = re.compile(r"offline-run-(\d{8}_\d{6})-" + re.escape(run_id) + r"(?:-(\d+))?")
    try:
        found = [(m.group(1), int(m.group(2) or 0), n) for n in os.listdir(base) if (m := named.fullmatch(n))]
    except OSError:
        return []
    files = [os.path.join(base, n, f"run-{run_id}.wandb") for _, _, n in sorted(found)]
    return [f for f in files if os.path.isfile(f) and not os.path.islink(f)]


def offline_history(path: str) -> OfflineHistory:
    """The history rows of a ``.wandb`` file (W&B's transaction log: a LevelDB log of ``Record``
    protobufs, ``wandb.proto.wandb_internal_pb2``), read up to ``WANDB_LOG_MAX_BYTES``; a torn tail
    (an attempt that died while writing) ends the read."""
    out = OfflineHistory()
    for record in _records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        values = {}
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            with contextlib.suppress(ValueError):
                values[key] = json.loads(item.value_json)
        step = record.history.step.num if record.history.HasField("step") else values.get("_step")
        if isinstance(step, int):
            out.rows.append((step, values))
    return out


def wait_until_written(path: str, timeout_s: float = FINISH_WAIT_S) -> bool:
    """Whether the run's ``.wandb`` file holds its ``exit`` record (W&B writes it last), waiting up to
    ``timeout_s`` for it.

    Why: ``wandb.finish()`` can return before W&B's service has written the run's last records to its
    transaction log (measured here, a second run of an id in one process: 3 of 40 files held none of
    their history rows right after ``finish()``, all of them a moment later), and the next attempt reads
    those files to log no step twice (``trackers.WandbSink.open``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if any(r.WhichOneof("record_type") == "exit" for r in _records(path)):
                return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _records(path: str) -> Iterator[Any]:
    """The ``Record`` protobufs of a ``.wandb`` file, in order, read without following a link and up to
    ``WANDB_LOG_MAX_BYTES``; a torn record ends them."""
    from wandb.proto import wandb_internal_pb2

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        data = f.read(WANDB_LOG_MAX_BYTES)
    for chunk in _log_records(data):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
        try:
            record.ParseFromString(chunk)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError: a torn record
            return
        yield record


_BLOCK, _HEADER = 32768, 7  # LevelDB log: 32 KiB blocks, records of crc32c(4) length(2) type(1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _log_records(data: bytes) -> Iterator[bytes]:
    if data[:4] != b":W&B":
        return
    pos, pending = _HEADER, b""  # the file's own header: ":W&B", a 2-byte magic, a version byte
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        start, end = pos + _HEADER, pos + _HEADER + length
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or end > len(data):
            return
        pos, chunk = end, data[start:end]
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        else:
            yield pending + chunk
            pending = b""
