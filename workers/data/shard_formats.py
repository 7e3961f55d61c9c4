"""A corpus shard's rows by format: token arrays (``.npy``, raw ``.bin``), JSON Lines and Parquet.

Why apart from the corpus: counting a shard's rows (for the index) and reading rows (for samples)
are per format, with the same bounds on what a shard may declare; the corpus only picks the format.
"""

from __future__ import annotations

import json
import mmap
import os
from typing import Any, TypedDict, cast

import numpy as np
import torch

from syncpoint.policies.contracts.errors import CorpusError
from syncpoint.workers.data.npy_map import map_npy

FORMATS = ("tokens-npy", "tokens-bin", "jsonl", "parquet")


TOKEN_FORMATS = ("tokens-npy", "tokens-bin")  # rows of integer tokens: read by a gather into one batch


class ShardParams(TypedDict):
    """How a corpus's shards are read (``ShardedCorpus.params``); part of its index's key and cached form."""

    format: str
    seq_len: int | None  # the token formats' row length (required there: ``ShardedCorpus`` checks)
    dtype: str | None  # tokens-bin's
    columns: list[str] | None  # Parquet's, when not all


def _npy(path: str, params: ShardParams, name: str) -> np.ndarray:
    """The shard as a [rows, seq_len] integer view of its memory map (never unpickled)."""
    try:
        arr = map_npy(path)
        if arr is None:  # not the plain header np.save writes for integers: NumPy reads it
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise CorpusError(f"corpus shard {name} is not a .npy array ({e})") from None
    seq_len = cast(int, params["seq_len"])  # a token format: set
    if arr.dtype.kind not in "iu":
        raise CorpusError(f"corpus shard {name} holds {arr.dtype}, not integer tokens (format tokens-npy)")
    if arr.ndim == 1:
        rows = len(arr) // seq_len
        return arr[: rows * seq_len].reshape(rows, seq_len)
    if arr.ndim == 2 and arr.shape[1] == seq_len:
        return arr
    raise CorpusError(
        f"corpus shard {name} has shape {arr.shape}: tokens-npy takes 1-D token streams or 2-D "
        f"[rows, seq_len={seq_len}] arrays"
    )


def _bin(path: str, params: ShardParams, name: str) -> np.ndarray:
    dtype, seq_len = np.dtype(params["dtype"]), cast(int, params["seq_len"])  # a token format: set
    rows = os.path.getsize(path) // (dtype.itemsize * seq_len)
    if not rows:
        return np.zeros((0, seq_len), dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(rows * seq_len,)).reshape(rows, seq_len)


def _jsonl_lines(buf: Any) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of every line holding more than whitespace (blank lines are no rows)."""
    data = np.frombuffer(buf, dtype=np.uint8)
    if not len(data):
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    newlines = np.flatnonzero(data == 10)
    starts = np.concatenate([[0], newlines + 1])
    ends = np.concatenate([newlines, [len(data)]])
    keep = ends > starts
    first = data[np.minimum(starts, len(data) - 1)]
    for i in np.flatnonzero(keep & np.isin(first, np.frombuffer(b" \t\r", np.uint8))):
        if not bytes(data[starts[i] : ends[i]]).strip():  # only lines starting with whitespace can be blank
            keep[i] = False
    return starts[keep], ends[keep]


def _parquet_file(path: str, params: ShardParams, name: str) -> Any:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors: one message naming the shard
        raise CorpusError(f"corpus shard {name} is not a Parquet file ({type(e).__name__}: {e})") from None
    missing = [c for c in params.get("columns") or [] if c not in pf.schema_arrow.names]
    if missing:
        raise CorpusError(f"corpus shard {name} has no column(s) {missing} (it has {pf.schema_arrow.names})")
    return pf


def count_rows(fmt: str, path: str, params: ShardParams, name: str) -> int:
    """The rows a local copy of a shard holds, by its format."""
    if fmt == "tokens-npy":
        return len(_npy(path, params, name))
    if fmt == "tokens-bin":
        return len(_bin(path, params, name))
    if fmt == "jsonl":
        if not os.path.getsize(path):
            return 0
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            return len(_jsonl_lines(mm)[0])
    return int(_parquet_file(path, params, name).metadata.num_rows)


class _TokenRows:
    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows.view(np.ndarray)  # the same mapping, without np.memmap's per-index bookkeeping

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, row: int) -> torch.Tensor:
        return torch.from_numpy(np.array(self.rows[row], dtype=np.int64))

    def get_many(self, rows: np.ndarray) -> list[torch.Tensor]:
        """One copy for the rows of one shard; each sample a row of it."""
        return list(torch.from_numpy(self.rows[rows].astype(np.int64)).unbind(0))

    def close(self) -> None:
        self.rows = np.zeros((0, 0), np.int64)


class _JsonlRows:
    def __init__(self, path: str) -> None:
        self.file = open(path, "rb")  # kept open while the reader is
        size = os.fstat(self.file.fileno()).st_size
        self.mm = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        empty = np.zeros(0, np.int64)
        lines: tuple[np.ndarray, np.ndarray] = _jsonl_lines(self.mm) if size else (empty, empty)
        self.starts, self.ends = lines

    def __len__(self) -> int:
        return len(self.starts)

    def get(self, row: int) -> Any:
        return json.loads(self.mm[int(self.starts[row]) : int(self.ends[row])])

    def get_many(self, rows: np.ndarray) -> list[Any]:
        return [self.get(int(r)) for r in rows]

    def close(self) -> None:
        if isinstance(self.mm, mmap.mmap):
            self.mm.close()
        self.file.close()


class _ParquetRows:
    def __init__(self, pf: Any, columns: list[str] | None) -> None:
        self.pf, self.columns = pf, columns
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
        self.group_start = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._group: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return int(self.group_start[-1])

    def get(self, row: int) -> dict[str, object]:  # a row as pyarrow gives it, for the task
        g = int(np.searchsorted(self.group_start, row, side="right") - 1)
        if self._group is None or self._group[0] != g:
            self._group = (g, self.pf.read_row_group(g, columns=self.columns))
        return self._group[1].slice(row - int(self.group_start[g]), 1).to_pylist()[0]

    def get_many(self, rows: np.ndarray) -> list[dict[str, object]]:
        return [self.get(int(r)) for r in rows]

    def close(self) -> None:
        self._group = None


def open_rows(fmt: str, path: str, params: ShardParams, name: str) -> Any:
    """A reader of a local shard's rows by its format (token rows, JSON Lines, Parquet)."""
    if fmt == "tokens-npy":
        return _TokenRows(_npy(path, params, name))
    if fmt == "tokens-bin":
        return _TokenRows(_bin(path, params, name))
    if fmt == "jsonl":
        return _JsonlRows(path)
    return _ParquetRows(_parquet_file(path, params, name), params.get("columns"))
