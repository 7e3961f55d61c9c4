"""Token windows: one token array cut into ``seq_len``-token inputs and their next-token targets.

A task returns ``TokenWindows("data/train.bin", seq_len=1024)`` as its dataset: nanoGPT's
``get_batch`` as a map-style dataset. Sample ``i`` is the pair ``(tokens[s:s+seq_len],
tokens[s+1:s+1+seq_len])`` (int64 tensors) of the window starting at ``s``:

* ``windows="random"`` (nanoGPT's training batches): ``s`` is drawn uniformly from
  ``[0, len(tokens) - seq_len)``. Inside a syncpoint job the draw comes from torch's generator as
  syncpoint seeds it around every sample (``syncpoint.workers.data.sampler.SeededSamples``: from
  ``(train.seed, epoch, i)``), so the window of every position is a pure function of the seed, the
  epoch and the index: a resume's data position is index arithmetic, with no generator state saved,
  at any world size and with DataLoader workers. Outside a job it draws from torch's global generator.
* ``windows="sequential"``: the windows tile the array, ``s = i * seq_len`` (each token is an input
  once per epoch; the epoch's order is syncpoint's shuffle, as for any map-style dataset).

``samples_per_epoch`` is the dataset's length, so an epoch, ``train.epochs`` and the schedule mean
what the user says; by default as many windows as tile the array (one pass over the tokens).

Why a memory map and the corpus machinery: a token file can be larger than memory (OpenWebText's
``train.bin`` is 17 GB), so it is never loaded; the file is indexed (size, xxh3_128, token count) and,
on storage (``s3://`` or any fsspec URL), fetched into the node's private corpus cache and verified
by ``syncpoint.workers.data.corpus.ShardedCorpus`` (one shard of one-token rows), and memory-mapped
from there. The index is the dataset's identity, recorded in every state: a resume on another token
file (or other windows) is refused at selection, naming it. A local file is opened without following
a link (``O_NOFOLLOW``), read only when it is a regular file, and checked against the index when
opened.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from syncpoint.policies.contracts.corpus_identity import CorpusIdentity
from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError, JobConfigError, UnsafeEntry
from syncpoint.workers.data.corpus import CacheSettings, ShardedCorpus
from syncpoint.workers.data.corpus_index import Shard
from syncpoint.workers.data.shard_cache import fd_path
from syncpoint.workers.data.shard_formats import open_rows
from syncpoint.workers.storage import nofollow
from syncpoint.workers.storage.fsspec_backend import checksum_file

WINDOWS = ("random", "sequential")
Window = tuple[torch.Tensor, torch.Tensor]


def _format_of(url: str, format: str | None) -> str:
    if format is None:
        return "tokens-npy" if url.endswith(".npy") else "tokens-bin"
    if format not in ("tokens-bin", "tokens-npy"):
        raise CorpusError(f"TokenWindows format {format!r} is neither tokens-bin (raw tokens) nor tokens-npy")
    return format


def _count(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CorpusError(f"TokenWindows {name} must be an integer >= {minimum}, not {value!r}")
    return value


class TokenWindows(torch.utils.data.Dataset):
    """Windows of ``seq_len`` tokens and their shifted targets from one token array (module docstring).

    ``tokens``: the array's path or fsspec URL: nanoGPT's ``.bin`` (raw tokens of ``dtype``, default
    uint16) or a 1-D integer ``.npy`` (never unpickled).
    ``seq_len``: tokens per input (nanoGPT's ``block_size``); a window reads ``seq_len + 1`` tokens.
    ``windows``: ``random`` (uniform start offsets, as ``get_batch``) or ``sequential`` (tiling).
    ``samples_per_epoch``: windows per epoch (the dataset's length); default ``(tokens - 1) // seq_len``.
    ``format``: ``tokens-bin`` or ``tokens-npy``; default by the name's suffix (``.npy``, else ``.bin``).
    ``cache``: the cache settings outside a syncpoint job (inside one the spec's ``corpus`` section).
    """

    def __init__(
        self,
        tokens: str | os.PathLike[str],
        seq_len: int,
        *,
        windows: str = "random",
        samples_per_epoch: int | None = None,
        dtype: str | None = None,
        format: str | None = None,
        cache: CacheSettings | None = None,
    ) -> None:
        url = os.fspath(tokens)
        if not isinstance(url, str) or not url or any(ch in url for ch in "*?["):
            raise CorpusError(f"TokenWindows reads one token file: {tokens!r} is no single path or URL (no globs)")
        self.seq_len = _count("seq_len", seq_len, 1)
        if windows not in WINDOWS:
            raise CorpusError(f"TokenWindows windows={windows!r} is neither 'random' nor 'sequential'")
        self.windows = windows
        self.samples = None if samples_per_epoch is None else _count("samples_per_epoch", samples_per_epoch, 1)
        self.url, self.format = url, _format_of(url, format)
        if self.format == "tokens-bin":
            dtype = dtype or "uint16"
        self.corpus = ShardedCorpus(url, self.format, seq_len=1, dtype=dtype, cache=cache)  # a row is a token
        self._shard: Shard | None = None  # the file's index entry, once checked
        self._arr: np.ndarray | None = None  # this process's memory map (kept across fork: read-only)

    # ---- the file
    @property
    def shard(self) -> Shard:
        """The file's index entry (built on first use): a local file must be a regular file, no link."""
        if self._shard is None:
            if self.corpus._shards is None and self.corpus.local:
                _refuse_link(self.corpus._process().fs._strip_protocol(self.url))
            try:
                self.corpus.shards  # noqa: B018 - builds the index
            except CorpusError as e:
                if "has shape" in str(e):
                    raise CorpusError(f"TokenWindows reads a 1-D token array: {e}. Save it flattened") from None
                if self.corpus._shards is None:  # not indexed; an empty file is, and is refused below
                    raise
            assert self.corpus._shards is not None
            shard = self.corpus._shards[0]
            self._check_size(shard)
            self._shard = shard
        return self._shard

    def _check_size(self, shard: Shard) -> None:
        dtype = self.corpus.params["dtype"]
        itemsize = np.dtype(dtype).itemsize if self.format == "tokens-bin" else 0
        if itemsize and shard.size % itemsize:
            raise CorpusError(
                f"token file {shard.name} holds {shard.size} bytes, not a whole number of {dtype} "
                f"tokens ({itemsize} bytes each): it is truncated, or its dtype is another (TokenWindows dtype)"
            )
        if shard.rows < self.seq_len + 1:
            raise CorpusError(
                f"token file {shard.name} holds {shard.rows} tokens, fewer than one window of seq_len + 1 = "
                f"{self.seq_len + 1}: use a longer file or a smaller seq_len"
            )

    @property
    def num_tokens(self) -> int:
        return self.shard.rows

    @property
    def tiles(self) -> int:
        """Windows that tile the array (each input token once)."""
        return (self.num_tokens - 1) // self.seq_len

    def __len__(self) -> int:
        if self.samples is None:
            return self.tiles
        if self.windows == "sequential" and self.samples > self.tiles:
            raise CorpusError(
                f"TokenWindows samples_per_epoch {self.samples} is more than the {self.tiles} sequential windows of "
                f"{self.seq_len} tokens in {self.shard.name}: lower it, or use windows='random'"
            )
        return self.samples

    def identity(self) -> CorpusIdentity:
        """The file's identity (size, checksum, tokens) and what turns it into samples (``seq_len``,
        ``windows``): recorded in every state, so a resume on other windows is refused, naming them."""
        base = self.corpus.identity()
        params = {**dict(base.params), "seq_len": self.seq_len, "windows": self.windows}
        return CorpusIdentity(tuple(sorted(params.items())), base.shards)

    def check_cache(self) -> None:
        """On storage, the node's cache must hold the file (refused naming corpus.cache_bytes)."""
        size, bound = self.shard.size, self.corpus.settings.bytes
        if not self.corpus.local and size > bound:
            raise JobConfigError(
                f"corpus.cache_bytes ({bound} bytes) cannot hold the token file {self.shard.name} ({size} bytes), "
                f"which TokenWindows reads from the node's cache: set corpus.cache_bytes to at least {size}"
            )

    # ---- reading
    def _tokens(self) -> np.ndarray:
        if self._arr is None:
            shard = self.shard
            if self.corpus.local:
                arr = self._map_local(shard)
            else:
                cache = self.corpus._process().cache
                assert cache is not None
                arr = cache.open(shard.remote(), lambda path: self._map(path, shard))
            self._arr = arr
        return self._arr

    def _map(self, path: str, shard: Shard) -> np.ndarray:
        arr = open_rows(self.format, path, self.corpus.params, shard.name).rows.reshape(-1)
        if len(arr) != shard.rows:
            raise CorpusChanged(
                f"token file {shard.name} holds {len(arr)} tokens, its index entry says {shard.rows}: the index "
                "is not this file's (edited); remove the corpus index files to rebuild them"
            )
        return arr

    def _map_local(self, shard: Shard) -> np.ndarray:
        """The local file, opened without following a link, checked against the index (its stamp,
        else its checksum), and mapped through that very descriptor."""
        try:
            fd = nofollow.open_regular(None, shard.path, shard.path)
        except UnsafeEntry as e:
            raise CorpusError(f"token file {shard.name}: {e}") from None
        try:
            st = os.fstat(fd)
            if f"{st.st_ino}:{st.st_mtime_ns}" != shard.stamp:
                size, checksum = checksum_file(fd_path(fd), "xxh3_128")
                if (size, checksum) != (shard.size, shard.checksum):
                    raise CorpusChanged(
                        f"token file {shard.name} changed since it was indexed ({size} bytes with xxh3_128 {checksum} "
                        f"now, {shard.size} with {shard.checksum} then). A token file must not change while a run "
                        "reads it; restore it, or start a new run on the new file"
                    )
            return self._map(fd_path(fd), shard)
        finally:
            os.close(fd)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_arr"] = None  # a memory map pickles as a copy of the whole file: each process maps its own
        return state

    def _start(self, index: int) -> int:
        if self.windows == "sequential":
            return index * self.seq_len
        return int(torch.randint(self.num_tokens - self.seq_len, (1,)))

    def _check(self, idx: Sequence[int]) -> None:
        n = len(self)
        if idx and (min(idx) < 0 or max(idx) >= n):
            raise IndexError(f"samples must lie in [0, {n}), got [{min(idx)}, {max(idx)}]")

    def _windows(self, starts: Sequence[int]) -> list[Window]:
        """The windows at ``starts`` gathered into one int64 array, each sample a view of its row."""
        arr, span = self._tokens(), self.seq_len + 1
        batch = np.empty((len(starts), span), np.int64)
        for k, s in enumerate(starts):
            batch[k] = arr[s : s + span]
        rows = torch.from_numpy(batch)
        return [(row[:-1], row[1:]) for row in rows.unbind(0)]

    def __getitem__(self, index: int) -> Window:
        i = int(index)
        self._check([i])
        return self._windows([self._start(i)])[0]

    def seeded_items(
        self, indices: Sequence[int], seeding: Callable[[int], contextlib.AbstractContextManager[Any]] | None
    ) -> list[Window]:
        """A micro-batch at once (what ``SeededSamples`` asks for): each random start drawn under its
        own index's seeding, so it is the start one fetch of that index gives."""
        idx = [int(i) for i in indices]
        self._check(idx)
        if self.windows == "sequential" or seeding is None:
            return self._windows([self._start(i) for i in idx])
        starts = []
        for i in idx:
            with seeding(i):
                starts.append(self._start(i))
        return self._windows(starts)

    def __getitems__(self, indices: Sequence[int]) -> list[Window]:
        return self.seeded_items(indices, None)


def _refuse_link(path: str) -> None:
    """A local token file must be a regular file reached without a link (checked before it is indexed)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CorpusError(f"token file {path!r} does not exist; check TokenWindows' path") from None
    if not stat.S_ISREG(mode):
        raise CorpusError(
            f"token file {path} is {nofollow.what(mode)}, not a regular file: never read ({nofollow.NEVER}). "
            "Point TokenWindows at the file itself"
        )
