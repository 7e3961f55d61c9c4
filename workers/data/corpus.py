"""Sharded corpora on any fsspec URL, map-style, read a few shards at a time.

A task returns ``ShardedCorpus(shards, format, ...)`` as its dataset: many files (token shards
``.npy`` / raw ``.bin``, JSON Lines, Parquet) under a glob or a list of URLs (local, ``s3://``,
anything fsspec reads). Sample ``i`` is row ``i - start(s)`` of the shard ``s`` whose range of the
cumulative row counts holds it; nothing is read until a sample is asked for.

Why an index: skipping to a position is arithmetic on the shards' row counts, so they must be known
without reading the corpus each attempt. The index (per shard: path, size, a storage stamp, the
xxh3_128 of its bytes, its rows) is built once per node and cached in the cache directory under a
checksum; each attempt re-lists the shards (one listing per directory) and re-reads only those
whose size or stamp (ETag, mtime) changed. Its content part is the corpus's identity
(``syncpoint.policies.contracts.corpus_identity``): recorded in every state, compared at selection, so a changed
corpus is refused by the shard's name before anything is loaded.

Why a cache: with the shard-window order (``syncpoint.workers.data.sampler.ShardWindowOrder``) a
rank reads one window of shards at a time; remote shards are fetched into a node-local cache of
bounded size (``syncpoint.workers.data.shard_cache``) ahead of use, by a fetch process beside the
reader that follows the loader's position (``syncpoint.workers.data.fetch_process``; the reader's
own threads where no child can reach the storage), and evicted least recently used. A resume at
position ``p`` fetches the shards from ``p`` on. Every download is verified against the index (size
and checksum) before it is renamed into the cache, and every cached shard again on its first open in
each process: a shard changed while the run reads it is an error naming it, a wrong file in the cache
is downloaded again. The cache directory (index, shards, locks) is this user's private one (0700,
checked; ``shard_cache.open_private_dir``). Shards on a local filesystem are read in place (checked
against their stamp, and their checksum when the stamp moved).

Reads: ``.npy`` memory-mapped (never unpickled), ``.bin`` as ``np.memmap``, JSON Lines by the line
offsets of the cached file, Parquet by row group (pyarrow, memory-mapped). Each process (a rank, a
DataLoader worker) opens its own readers lazily; the object pickles without them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import posixpath
import re
import stat
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from syncpoint.policies.contracts.corpus_identity import (
    CORPUS_DIR,
    MAX_SHARDS,
    CorpusIdentity,
    ShardRecord,
)
from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError, JobConfigError
from syncpoint.policies.contracts.spec import CorpusSpec, JobSpec
from syncpoint.workers.data.fetch_process import FetchProcess, travels
from syncpoint.workers.data.npy_map import map_npy
from syncpoint.workers.data.shard_cache import (
    Prefetcher,
    RemoteShard,
    ShardCache,
    fd_path,
    locked,
    open_private_dir,
    private_subdir,
)
from syncpoint.workers.storage import RunStorage, backend_for, nofollow
from syncpoint.workers.storage.fsspec_backend import checksum_file

FORMATS = ("tokens-npy", "tokens-bin", "jsonl", "parquet")
TOKEN_FORMATS = ("tokens-npy", "tokens-bin")  # rows of integer tokens: read by a gather into one batch
INDEX_CACHE_VERSION = 1
INDEX_CACHE_MAX_BYTES = 256 << 20
_HEX32 = re.compile(r"[0-9a-f]{32}")  # an xxh3_128 checksum
MAX_OPEN_SHARDS = 64  # readers a process keeps open (least recently used closed beyond)


# ------------------------------------------------------------------ settings (the spec's corpus section)


@dataclass(frozen=True)
class CacheSettings:
    """Where and how much a sharded corpus caches on this node (``corpus.*`` in the spec)."""

    directory: str
    bytes: int
    prefetch_shards: int | None = None  # None: one window ahead
    concurrency: int = 4
    run_url: str | None = None  # the job's run directory: its copy of the index serves a node that joins later


def default_cache_dir() -> str:
    """The node's corpus cache directory: ``SYNCPOINT_CORPUS_CACHE``, else one per user in the temp directory."""
    return os.environ.get("SYNCPOINT_CORPUS_CACHE") or os.path.join(
        tempfile.gettempdir(), f"syncpoint-corpus-{os.getuid()}"
    )


def settings_of(spec: CorpusSpec, run_url: str | None = None) -> CacheSettings:
    """The cache settings a job's ``corpus`` section names."""
    return CacheSettings(
        spec.cache_dir or default_cache_dir(), spec.cache_bytes, spec.prefetch_shards, spec.fetch_concurrency, run_url
    )


_job_settings: CacheSettings | None = None
_pid = os.getpid()  # this process's (os.getpid() is a system call per sample otherwise)


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)


def use_job_settings(spec: JobSpec | None) -> None:
    """The job's cache settings for every corpus this process builds from now on (set before the
    task function runs, so a corpus the task already reads inside ``build`` uses them too)."""
    global _job_settings
    _job_settings = settings_of(spec.corpus, spec.run_url) if spec is not None else None


# ------------------------------------------------------------------ the index


@dataclass(frozen=True)
class Shard:
    """One shard of the index: where it is, how to tell it changed, and what it holds."""

    name: str  # its path below the corpus root: the identity's name (location-independent)
    path: str  # the filesystem's path (``bucket/key`` on S3)
    size: int
    stamp: str  # the storage's version stamp (ETag, mtime and inode): the index cache's validity
    checksum: str  # xxh3_128 of its bytes
    rows: int

    def remote(self) -> RemoteShard:
        return RemoteShard(self.name, self.path, self.size, self.checksum)


def _has_magic(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def _stamp(fs: Any, path: str, info: dict[str, Any]) -> str:
    """What changes when a file is rewritten: inode and mtime locally, the ETag (and version) on
    object stores, whatever the filesystem reports elsewhere."""
    if isinstance(fs, LocalFileSystem):
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CorpusError(f"corpus shard {path} is not a regular file: a corpus is read from regular files only")
        return f"{st.st_ino}:{st.st_mtime_ns}"
    keys = ("ETag", "VersionId", "etag", "generation", "md5", "mtime", "created", "LastModified")
    return json.dumps({k: str(info[k]) for k in keys if info.get(k) is not None}, sort_keys=True)


def _listed(fs: Any, patterns: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    """(path, info) of every shard, in order: each glob's matches sorted, explicit paths as given;
    explicit paths of one directory share one listing (a HEAD per object is slow on S3)."""
    with contextlib.suppress(Exception):
        fs.invalidate_cache()  # a listing cached by an earlier attempt in this process may be stale
    out: list[tuple[str, dict[str, Any]]] = []
    listings: dict[str, dict[str, dict[str, Any]]] = {}
    for pattern in patterns:
        path = fs._strip_protocol(pattern)
        if _has_magic(path):
            matches = fs.glob(path, detail=True)
            files = sorted((p, i) for p, i in matches.items() if i.get("type") != "directory")
            if not files:
                raise CorpusError(f"corpus shards: nothing matches {pattern!r}; check the URL and the glob")
            out += files
            continue
        parent = posixpath.dirname(path)
        if parent not in listings:
            try:
                listings[parent] = {e["name"].rstrip("/"): e for e in fs.ls(parent, detail=True)}
            except (FileNotFoundError, NotADirectoryError):
                listings[parent] = {}
        info = listings[parent].get(path.rstrip("/"))
        if info is None or info.get("type") == "directory":
            raise CorpusError(f"corpus shard {pattern!r} does not exist (or is a directory); check the URL")
        out.append((path, info))
    paths = [p for p, _ in out]
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise CorpusError(f"corpus shard {dup!r} is listed twice; each shard may appear once")
    if len(out) > MAX_SHARDS:
        raise CorpusError(
            f"the corpus has {len(out)} shards, more than the {MAX_SHARDS} syncpoint indexes; merge shards"
        )
    return out


def _names(paths: Sequence[str]) -> list[str]:
    """Each path below the shards' common directory."""
    root = posixpath.dirname(paths[0]) if len(paths) == 1 else posixpath.commonpath(list(paths))
    if len(paths) > 1 and root in paths:
        root = posixpath.dirname(root)
    return [posixpath.relpath(p, root) if root else p for p in paths]


# ------------------------------------------------------------------ formats: rows of a local file


def _npy(path: str, params: dict[str, Any], name: str) -> np.ndarray:
    """The shard as a [rows, seq_len] integer view of its memory map (never unpickled)."""
    try:
        arr = map_npy(path)
        if arr is None:  # not the plain header np.save writes for integers: NumPy reads it
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError) as e:
        raise CorpusError(f"corpus shard {name} is not a .npy array ({e})") from None
    seq_len = params["seq_len"]
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


def _bin(path: str, params: dict[str, Any], name: str) -> np.ndarray:
    dtype, seq_len = np.dtype(params["dtype"]), params["seq_len"]
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


def _parquet_file(path: str, params: dict[str, Any], name: str) -> Any:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path, memory_map=True)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors: one message naming the shard
        raise CorpusError(f"corpus shard {name} is not a Parquet file ({type(e).__name__}: {e})") from None
    missing = [c for c in params.get("columns") or [] if c not in pf.schema_arrow.names]
    if missing:
        raise CorpusError(f"corpus shard {name} has no column(s) {missing} (it has {pf.schema_arrow.names})")
    return pf


def count_rows(fmt: str, path: str, params: dict[str, Any], name: str) -> int:
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

    def get(self, row: int) -> dict[str, Any]:
        g = int(np.searchsorted(self.group_start, row, side="right") - 1)
        if self._group is None or self._group[0] != g:
            self._group = (g, self.pf.read_row_group(g, columns=self.columns))
        return self._group[1].slice(row - int(self.group_start[g]), 1).to_pylist()[0]

    def get_many(self, rows: np.ndarray) -> list[dict[str, Any]]:
        return [self.get(int(r)) for r in rows]

    def close(self) -> None:
        self._group = None


def open_rows(fmt: str, path: str, params: dict[str, Any], name: str) -> Any:
    """A reader of a local shard's rows by its format (token rows, JSON Lines, Parquet)."""
    if fmt == "tokens-npy":
        return _TokenRows(_npy(path, params, name))
    if fmt == "tokens-bin":
        return _TokenRows(_bin(path, params, name))
    if fmt == "jsonl":
        return _JsonlRows(path)
    return _ParquetRows(_parquet_file(path, params, name), params.get("columns"))


# ------------------------------------------------------------------ the corpus


@dataclass
class _Process:
    """What one process keeps of a corpus (never pickled): readers, the cache, the prefetcher."""

    pid: int
    fs: Any
    cache: ShardCache | None  # None: shards on a local filesystem, read in place
    readers: OrderedDict[int, Any] = field(default_factory=OrderedDict)
    verified: set[int] = field(default_factory=set)  # local shards checked against the index
    lock: threading.Lock = field(default_factory=threading.Lock)
    prefetcher: Prefetcher | None = None
    fetcher: FetchProcess | None = None  # downloads in a child process where one can reach the storage
    keep: list[str] = field(default_factory=list)  # the prefetch plan's cache keys


class ShardedCorpus(torch.utils.data.Dataset):
    """A map-style dataset over many shard files (module docstring).

    ``shards``: a URL or glob (``s3://bucket/corpus/*.npy``), or a list of them (globs expanded in
    sorted order, explicit URLs in the order given); every shard on the same filesystem. The list's
    order is part of the corpus's identity.
    ``format``: ``tokens-npy`` (1-D token streams cut into non-overlapping rows of ``seq_len``
    tokens, or 2-D ``[rows, seq_len]`` arrays; a sample is an int64 tensor of ``seq_len`` tokens),
    ``tokens-bin`` (raw tokens of ``dtype``, default uint16, cut the same way), ``jsonl`` (one JSON
    value per non-blank line; a sample is the parsed value), ``parquet`` (a sample is a row as a
    dict, of ``columns`` when given).
    ``transform``: applied to each sample (tokenise a text, pick fields); not part of the identity.
    ``cache``: the cache settings outside a syncpoint job (inside one the spec's ``corpus`` section).
    """

    def __init__(
        self,
        shards: str | Sequence[str],
        format: str = "tokens-npy",
        *,
        seq_len: int | None = None,
        dtype: str | None = None,
        columns: Sequence[str] | None = None,
        transform: Callable[[Any], Any] | None = None,
        cache: CacheSettings | None = None,
    ) -> None:
        self.patterns = [shards] if isinstance(shards, str) else [str(s) for s in shards]
        if not self.patterns:
            raise CorpusError("ShardedCorpus needs at least one shard URL or glob")
        if format not in FORMATS:
            raise CorpusError(f"ShardedCorpus format {format!r} is not one of {', '.join(FORMATS)}")
        tokens = format.startswith("tokens-")
        if tokens and (not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1):
            raise CorpusError(f"ShardedCorpus format {format} needs seq_len (tokens per sample, >= 1), not {seq_len!r}")
        if not tokens and (seq_len is not None or dtype is not None):
            raise CorpusError(
                f"ShardedCorpus format {format} takes no seq_len or dtype (rows are its "
                f"{'lines' if format == 'jsonl' else 'rows'})"
            )
        if columns is not None and format != "parquet":
            raise CorpusError("ShardedCorpus columns applies to format parquet only")
        if format == "tokens-bin":
            dtype = dtype or "uint16"
            if np.dtype(dtype).kind not in "iu":
                raise CorpusError(f"ShardedCorpus dtype {dtype!r} is no integer type (token ids)")
        elif dtype is not None:
            raise CorpusError("ShardedCorpus dtype applies to format tokens-bin (a .npy names its own)")
        self.format = format
        self.params: dict[str, Any] = {
            "format": format,
            "seq_len": seq_len,
            "dtype": dtype,
            "columns": list(columns) if columns is not None else None,
        }
        self.transform = transform
        self._settings = cache
        self._shards: list[Shard] | None = None
        self._starts: np.ndarray | None = None
        self._proc: _Process | None = None

    # ---- settings, filesystem, index
    @property
    def settings(self) -> CacheSettings:
        if self._settings is None:
            self._settings = _job_settings or CacheSettings(default_cache_dir(), CorpusSpec().cache_bytes)
        return self._settings

    def configure(self, settings: CacheSettings) -> None:
        """Use these cache settings (before the first sample is read in this process)."""
        self._settings = settings
        if self._proc is not None and self._proc.cache is not None:
            self._proc = None

    def _fs(self) -> Any:
        protocols = {fsspec.core.split_protocol(p)[0] or "file" for p in self.patterns}
        if len(protocols) > 1:
            raise CorpusError(f"corpus shards lie on several filesystems ({sorted(protocols)}); use one")
        fs, _ = fsspec.core.url_to_fs(self.patterns[0])
        return fs

    @property
    def local(self) -> bool:
        return isinstance(self._process().fs, LocalFileSystem)

    @property
    def shards(self) -> list[Shard]:
        if self._shards is None:
            self._shards = build_index(self._process().fs, self.patterns, self.params, self.settings)
            self._starts = np.concatenate([[0], np.cumsum([s.rows for s in self._shards], dtype=np.int64)])
            if not self._starts[-1]:
                raise CorpusError(f"the corpus {self.patterns[0]!r} holds no rows in {len(self._shards)} shard(s)")
        return self._shards

    @property
    def shard_rows(self) -> np.ndarray:
        return np.array([s.rows for s in self.shards], dtype=np.int64)

    def identity(self) -> CorpusIdentity:
        params = tuple(sorted((k, v) for k, v in self.params.items() if v is not None))
        return CorpusIdentity(params, tuple(ShardRecord(s.name, s.size, s.checksum, s.rows) for s in self.shards))

    def __len__(self) -> int:
        self.shards  # noqa: B018 - builds the index
        assert self._starts is not None
        return int(self._starts[-1])

    # ---- per process
    def _process(self) -> _Process:
        proc = self._proc
        if proc is None or proc.pid != _pid:  # first use, or a forked DataLoader worker
            fs = self._fs()
            cache = None
            if not isinstance(fs, LocalFileSystem):
                backend = backend_for(fs, "")
                os.close(open_private_dir(self.settings.directory))  # made 0700 (and checked) before anything in it
                cache = ShardCache(
                    os.path.join(self.settings.directory, "shards-cache"),
                    self.settings.bytes,
                    lambda src, dst, limit: backend.download_file(dst, src, "xxh3_128", limit),
                )
            proc = self._proc = _Process(_pid, fs, cache)
        return proc

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_settings"] = self.settings
        state["_proc"] = None
        return state

    # ---- samples
    def __getitem__(self, index: int) -> Any:
        i = int(index)
        n = len(self)
        if not 0 <= i < n:
            raise IndexError(f"sample {i} is outside the corpus's {n} rows")
        assert self._starts is not None
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        item = self._reader(s).get(i - int(self._starts[s]))
        return self.transform(item) if self.transform is not None else item

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch (what a DataLoader asks for): the rows of each shard read at once."""
        return self.seeded_items(indices, None)

    def seeded_items(
        self, indices: Sequence[int], seeding: Callable[[int], contextlib.AbstractContextManager[Any]] | None
    ) -> list[Any]:
        """Samples ``indices``, the rows of each shard read at once (the read draws no randomness),
        then ``transform`` on each under ``seeding(index)``: the hook ``syncpoint.workers.data.sampler.SeededSamples``
        seeds every stream through, so a sample's values are those one fetch of it would give."""
        idx = [int(i) for i in indices]
        groups = self._by_shard(idx)
        out = self._token_rows(len(idx), groups) if self.format in TOKEN_FORMATS else self._rows(len(idx), groups)
        if self.transform is None:
            return out
        if seeding is None:
            return [self.transform(item) for item in out]
        transformed = []
        for i, item in zip(idx, out, strict=True):
            with seeding(i):
                transformed.append(self.transform(item))
        return transformed

    def _by_shard(self, idx: list[int]) -> dict[int, tuple[list[int], list[int]]]:
        """shard -> (places in the batch, rows in the shard) of a batch's samples. Python lists: a
        micro-batch is a few dozen samples, where NumPy's per-call overhead would cost more."""
        n = len(self)
        if idx and (min(idx) < 0 or max(idx) >= n):
            raise IndexError(f"samples must lie in [0, {n}), got [{min(idx)}, {max(idx)}]")
        assert self._starts is not None
        starts = self._starts
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for k, (i, s) in enumerate(zip(idx, (np.searchsorted(starts, idx, side="right") - 1).tolist(), strict=True)):
            group = groups.get(s)
            if group is None:
                group = groups[s] = ([], [])
            group[0].append(k)
            group[1].append(i - int(starts[s]))
        return groups

    def _rows(self, count: int, groups: dict[int, tuple[list[int], list[int]]]) -> list[Any]:
        out: list[Any] = [None] * count
        for s, (places, rows) in groups.items():
            for k, item in zip(places, self._reader(s).get_many(np.asarray(rows, dtype=np.int64)), strict=True):
                out[k] = item
        return out

    def _token_rows(self, count: int, groups: dict[int, tuple[list[int], list[int]]]) -> list[torch.Tensor]:
        """Token rows gathered straight into one int64 batch (the cast happens in the gather): one
        allocation and one ``unbind`` per micro-batch, whatever the number of shards it spans."""
        batch = np.empty((count, self.params["seq_len"]), np.int64)
        if len(groups) == 1:
            ((s, (_, rows)),) = groups.items()
            batch[:] = self._reader(s).rows[rows]
        else:
            for s, (places, rows) in groups.items():
                batch[places] = self._reader(s).rows[rows]
        return list(torch.from_numpy(batch).unbind(0))

    def _reader(self, s: int) -> Any:
        proc = self._process()
        with proc.lock:
            reader = proc.readers.get(s)
            if reader is not None:
                proc.readers.move_to_end(s)
                return reader
        reader = self._open(proc, s)
        with proc.lock:
            proc.readers[s] = reader
            while len(proc.readers) > MAX_OPEN_SHARDS:
                proc.readers.popitem(last=False)[1].close()
        return reader

    def _open(self, proc: _Process, s: int) -> Any:
        """The shard's reader: in place (checked against the index), or from the cache (fetched and
        verified first); its rows must be the index's."""
        shard = self.shards[s]
        if proc.cache is None:
            if s not in proc.verified:
                _verify_in_place(proc.fs, shard)
                proc.verified.add(s)
            reader = open_rows(self.format, shard.path, self.params, shard.name)
        else:
            reader = proc.cache.open(
                shard.remote(), lambda path: open_rows(self.format, path, self.params, shard.name), keep=proc.keep
            )
        rows = len(reader)
        if rows != shard.rows:
            reader.close()
            raise CorpusChanged(
                f"shard {shard.name} holds {rows} rows, its index entry says {shard.rows}: the "
                "index is not this corpus's (the cache directory's or the run directory's copy was "
                "edited); remove the corpus index files to rebuild them"
            )
        return reader

    # ---- prefetch
    def follow(self, order: Callable[[np.ndarray], np.ndarray]) -> Callable[[int, int], None] | None:
        """The loader's hook (``RankMicroBatches.on_position``): told each global micro-batch's
        positions, it keeps the shards from there on fetched: the window in use and the next
        ``prefetch_shards`` of a shard-window order, the next two micro-batches' shards otherwise.
        Nothing for shards read in place."""
        from syncpoint.workers.data.sampler import ShardWindowOrder

        proc = self._process()
        if proc.cache is None:
            return None
        cache, shards = proc.cache, self.shards
        if proc.prefetcher is None:  # the reader's own threads: where no fetch process can serve
            if travels(proc.fs):
                proc.fetcher = FetchProcess(self.patterns[0], cache.directory, cache.bound, self.settings.concurrency)
                proc.fetcher.start()
            proc.prefetcher = Prefetcher(
                lambda s, keep: cache.fetch(shards[s].remote(), keep),
                lambda s: shards[s].remote().key,
                lambda s: cache.has(shards[s].remote()),
                self.settings.concurrency,
            )
        prefetcher, fetcher, at = proc.prefetcher, proc.fetcher, {"window": -1}

        def on_position(first: int, count: int) -> None:
            if isinstance(order, ShardWindowOrder):
                window = order.window_of(first)
                if window == at["window"]:
                    return
                at["window"] = window
                ahead = order.window if self.settings.prefetch_shards is None else self.settings.prefetch_shards
                plan = order.shards_from(first, order.window + ahead)
            else:
                assert self._starts is not None
                positions = np.arange(first, min(first + 2 * count, len(self)))
                plan = list(dict.fromkeys(int(s) for s in np.searchsorted(self._starts, order(positions), "right") - 1))
            proc.keep = [shards[s].remote().key for s in plan]
            if fetcher is not None and fetcher.want([shards[s].remote() for s in plan]):
                return
            prefetcher.want(plan)

        return on_position

    def check_cache(self, window: int | None, prefetch: int) -> None:
        """Refuse (naming corpus.cache_bytes) a cache that cannot hold the shards in use at once:
        a window and what is fetched ahead of it, at the largest shard's size."""
        if self.local or window is None:
            return
        shards = self.shards
        held = min(len(shards), window + prefetch)
        need = held * max(s.size for s in shards)
        if need > self.settings.bytes:
            raise JobConfigError(
                f"corpus.cache_bytes ({self.settings.bytes} bytes) cannot hold {held} shards of up to "
                f"{max(s.size for s in shards)} bytes (corpus.window_shards {window} + prefetch {prefetch}): set "
                f"corpus.cache_bytes to at least {need}, or lower corpus.window_shards / corpus.prefetch_shards"
            )


def _verify_in_place(fs: Any, shard: Shard) -> None:
    """A local shard must still be the bytes the index names: its stamp, else its checksum."""
    if _stamp(fs, shard.path, {}) == shard.stamp:
        return
    size, checksum = checksum_file(shard.path, "xxh3_128")
    if (size, checksum) != (shard.size, shard.checksum):
        raise CorpusChanged(
            f"shard {shard.name} changed since the corpus index was built: {size} bytes with xxh3_128 {checksum} now, "
            f"{shard.size} bytes with {shard.checksum} then. A corpus must not change while a run reads it; restore "
            "the shard, or start a new run on the new corpus (another name, or resume.policy: fresh)"
        )


# ------------------------------------------------------------------ building and caching the index


def index_key(fs: Any, patterns: Sequence[str], params: dict[str, Any]) -> str:
    """Names a corpus's cached index: its filesystem, shard patterns and parameters."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return hashlib.sha256(json.dumps([protocol, list(patterns), params], sort_keys=True).encode()).hexdigest()[:24]


def listing_file(key: str) -> str:
    """The run directory's copy of a corpus's index (under ``corpus/``), with paths and stamps: a
    node that joins later (a replacement, an elastic one) reads it instead of the whole corpus."""
    return f"listing-{key}.json"


def _cache_checksum(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def listing_bytes(params: dict[str, Any], shards: Sequence[Shard]) -> bytes:
    """A corpus index's cached form, with a checksum over its content (a damaged copy is rebuilt)."""
    body = {"version": INDEX_CACHE_VERSION, "params": params, "shards": [asdict(s) for s in shards]}
    return json.dumps({**body, "checksum": _cache_checksum(body)}, sort_keys=True).encode()


def _parse_listing(data: bytes, params: dict[str, Any]) -> dict[str, Shard]:
    """A cached index by path, or nothing when it is torn, fails its checksum or is another corpus's.
    A wrong entry that passes (written on purpose) cannot pass unseen: every fetch checks size and
    checksum, every open the rows."""
    try:
        raw = json.loads(data)
        body = {k: raw[k] for k in ("version", "params", "shards")}
        if (
            raw.get("checksum") != _cache_checksum(body)
            or body["version"] != INDEX_CACHE_VERSION
            or body["params"] != params
        ):
            return {}
        shards = [Shard(**s) for s in body["shards"]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for s in shards for v in (s.size, s.rows)):
            return {}
        if not all(isinstance(s.checksum, str) and _HEX32.fullmatch(s.checksum) for s in shards):
            return {}  # a checksum names cache files: 32 hex digits or nothing
        return {s.path: s for s in shards}
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}


def _node_listing(index: int, name: str, shown: str, params: dict[str, Any]) -> dict[str, Shard]:
    """The node's cached index (a bounded read of a regular file, never through a link), or nothing;
    a link, FIFO or oversized file there is rebuilt and replaced."""
    try:
        return _parse_listing(nofollow.read_file(index, name, INDEX_CACHE_MAX_BYTES, shown), params)
    except OSError:
        return {}


def _run_listing(run_url: str | None, key: str, params: dict[str, Any]) -> dict[str, Shard]:
    """The run directory's copy (bounded read, never through a link), or nothing."""
    if not run_url:
        return {}
    try:
        return _parse_listing(
            RunStorage(run_url).read_bytes(CORPUS_DIR, listing_file(key), limit=INDEX_CACHE_MAX_BYTES), params
        )
    except OSError:
        return {}


@contextlib.contextmanager
def _cache_subdir(settings: CacheSettings, name: str) -> Iterator[int]:
    """A directory of the node's cache (``index``, ``tmp``), below its checked private directory."""
    top = open_private_dir(settings.directory)
    try:
        fd = private_subdir(top, name, settings.directory)
    finally:
        os.close(top)
    try:
        yield fd
    finally:
        os.close(fd)


def build_index(fs: Any, patterns: Sequence[str], params: dict[str, Any], settings: CacheSettings) -> list[Shard]:
    """Every shard's entry: from the node's cached index, else the run directory's copy, where size
    and stamp still match; read (checksum and rows) where not. One process per node builds it at a
    time (a file lock, touched after each shard read: the others wait while it makes progress)."""
    key = index_key(fs, patterns, params)
    file = f"{key}.json"
    shown = os.path.join(settings.directory, "index", file)
    with _cache_subdir(settings, "index") as index, locked(index, f"{file}.lock", f"{shown}.lock"):
        listed = _listed(fs, patterns)
        names = _names([p for p, _ in listed])
        current = [
            (p, name, int(info.get("size") or 0), _stamp(fs, p, info))
            for (p, info), name in zip(listed, names, strict=True)
        ]
        node = _node_listing(index, file, shown, params)
        known = (
            node
            if all(_matches(node.get(p), n, size, st) for p, n, size, st in current)
            else {**_run_listing(settings.run_url, key, params), **node}
        )
        shards: list[Shard | None] = [
            known.get(p) if _matches(known.get(p), n, size, st) else None for p, n, size, st in current
        ]
        todo = [(i, *current[i]) for i, s in enumerate(shards) if s is None]
        if todo:
            with ThreadPoolExecutor(max(1, min(settings.concurrency, len(todo)))) as pool:
                for i, shard in zip(
                    [t[0] for t in todo],
                    pool.map(lambda t: _read_shard(fs, params, settings, *t[1:]), todo),
                    strict=True,
                ):
                    shards[i] = shard
                    os.utime(f"{file}.lock", dir_fd=index, follow_symlinks=False)  # progress, for the waiters
        complete = [s for s in shards if s is not None]
        if [node.get(s.path) for s in complete] != complete:
            nofollow.write_replacing(index, file, listing_bytes(params, complete), shown, mode=0o600)
        return complete


def _matches(old: Shard | None, name: str, size: int, stamp: str) -> bool:
    return old is not None and (old.name, old.size, old.stamp) == (name, size, stamp)


def _read_shard(
    fs: Any, params: dict[str, Any], settings: CacheSettings, path: str, name: str, size: int, stamp: str
) -> Shard:
    """One shard's checksum and rows: read in place locally, else downloaded (bounded by its listed
    size) into a temporary file that is deleted afterwards."""
    fmt = params["format"]
    if isinstance(fs, LocalFileSystem):
        got, checksum = checksum_file(path, "xxh3_128")
        if got != size:
            raise CorpusChanged(f"corpus shard {name} changed while it was indexed ({size} bytes listed, {got} read)")
        return Shard(name, path, size, stamp, checksum, count_rows(fmt, path, params, name))
    with _cache_subdir(settings, "tmp") as tmp_dir:
        tmp = uuid.uuid4().hex
        fd = nofollow.create_new(tmp_dir, tmp, os.path.join(settings.directory, "tmp", tmp), mode=0o600)
        try:
            got, checksum = backend_for(fs, "").download_file(fd_path(fd), path, "xxh3_128", size)
            if got != size:
                raise CorpusChanged(
                    f"corpus shard {name} changed while it was indexed ({size} bytes listed, {got} read)"
                )
            return Shard(name, path, size, stamp, checksum, count_rows(fmt, fd_path(fd), params, name))
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=tmp_dir)
