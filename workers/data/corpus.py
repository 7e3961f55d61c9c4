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
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from syncpoint.policies.contracts.corpus_identity import (
    CorpusIdentity,
    ShardRecord,
)
from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError, JobConfigError
from syncpoint.policies.contracts.spec import CorpusSpec, JobSpec
from syncpoint.workers.data.corpus_index import Shard, build_index, verify_in_place
from syncpoint.workers.data.fetch_process import FetchProcess, travels
from syncpoint.workers.data.shard_cache import (
    Prefetcher,
    ShardCache,
    open_private_dir,
)
from syncpoint.workers.data.shard_formats import FORMATS, TOKEN_FORMATS, ShardParams, open_rows
from syncpoint.workers.storage import backend_for

MAX_OPEN_SHARDS = 64  # readers a process keeps open (least recently used closed beyond)


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
        self.params: ShardParams = {
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

    def __getstate__(self) -> dict[str, object]:
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
        batch = np.empty((count, cast(int, self.params["seq_len"])), np.int64)  # a token format: set
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
                verify_in_place(proc.fs, shard)
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
