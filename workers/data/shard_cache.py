"""A node-local, bounded cache of corpus shards, shared by every process of the node.

Why on local disk and keyed by content: a shard is read by every rank of a node and by their
DataLoader worker processes; one copy per node, fetched once, serves them all, and a key made of
the shard's checksum and size (``<xxh3_128>-<size>``) means a cached file is exactly the bytes the
corpus index names, whatever URL or job they came from.

How processes agree (``fcntl.flock``, which also excludes two threads of one process):

* one lock file per shard (``locks/<key>``): held while the shard is fetched and while a reader
  opens it, so two processes never download the same shard and a reader never opens a file that
  is being evicted; a fetch lands as ``<key>.part`` (pre-sized, so the bound counts it) and is
  renamed into place only after its size and checksum matched the index;
* one lock for the whole cache (``cache.lock``): held while room is made for a fetch, which
  evicts the least recently used shards (a shard's mtime is its last fetch or open) whose own lock
  is free, never the ones the fetching process needs next (``keep``); an opened shard stays
  readable after its eviction (its mapping outlives the name).

A lock inherited through ``fork`` (a DataLoader worker started while a prefetch thread held one)
would stay held for the child's life, so the child closes every lock descriptor it inherited.
``fetches.log`` lists every download (shard name), for the curious and the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from syncpoint.policies.errors import CorpusChanged, CorpusError, UnsafeEntry

FETCH_LOG = "fetches.log"
FETCH_LOG_MAX_BYTES = 1 << 20  # then it starts over (fetches.log.1 keeps the previous one)
T = TypeVar("T")

# every flock descriptor this process holds: a forked child closes its copies (module docstring)
_held: set[int] = set()
_held_guard = threading.Lock()


def _forget_inherited_locks() -> None:
    global _held_guard
    _held_guard = threading.Lock()
    for fd in list(_held):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_inherited_locks)


@contextlib.contextmanager
def flocked(path: str, *, blocking: bool = True) -> Iterator[bool]:
    """An exclusive ``flock`` on ``path`` (created) for the block; ``False`` without waiting when
    ``blocking`` is off and someone else holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        with _held_guard:
            _held.add(fd)
        try:
            yield True
        finally:
            with _held_guard:
                _held.discard(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RemoteShard:
    """What the cache needs of a shard: where it is, and the size and checksum it must have."""

    name: str  # for messages and the fetch log
    path: str  # the storage's path (``bucket/key`` on S3)
    size: int
    checksum: str  # xxh3_128

    @property
    def key(self) -> str:
        return f"{self.checksum}-{self.size}"


# download(remote path, local path, limit) -> (size, xxh3_128) of what landed locally
Download = Callable[[str, str, int], tuple[int, str]]


class ShardCache:
    """A node's bounded cache of fetched shards: verified before use, evicted least recently used, shared
    by the node's processes through file locks."""

    def __init__(self, directory: str, bound: int, download: Download) -> None:
        self.directory, self.bound, self.download = directory, int(bound), download
        self.shards_dir = os.path.join(directory, "shards")
        self.locks_dir = os.path.join(directory, "locks")
        os.makedirs(self.shards_dir, exist_ok=True)
        os.makedirs(self.locks_dir, exist_ok=True)
        self.downloads = 0  # by this process

    def _data(self, key: str) -> str:
        return os.path.join(self.shards_dir, key)

    def _lock(self, key: str) -> str:
        return os.path.join(self.locks_dir, key)

    def has(self, shard: RemoteShard) -> bool:
        return os.path.exists(self._data(shard.key))

    def open(self, shard: RemoteShard, opener: Callable[[str], T], keep: Collection[str] = ()) -> T:
        """``opener(local path)`` of the shard, fetched first if it is not cached; the open happens
        under the shard's lock, so no eviction removes the file in between."""
        with flocked(self._lock(shard.key)):
            data = self._data(shard.key)
            if not os.path.exists(data):
                self._fetch(shard, keep)
            os.utime(data)  # recently used: evicted last
            return opener(data)

    def fetch(self, shard: RemoteShard, keep: Collection[str] = ()) -> bool:
        """Make sure the shard is cached (the prefetcher's call); ``True`` when this call downloaded it."""
        with flocked(self._lock(shard.key)):
            data = self._data(shard.key)
            if os.path.exists(data):
                os.utime(data)
                return False
            self._fetch(shard, keep)
            return True

    def _fetch(self, shard: RemoteShard, keep: Collection[str]) -> None:
        """Download under the shard's lock (held by the caller), verified before it is renamed in."""
        data, part = self._data(shard.key), self._data(shard.key) + ".part"
        with contextlib.suppress(FileNotFoundError):
            os.remove(part)  # a dead process's: we hold its lock
        with flocked(os.path.join(self.directory, "cache.lock")):
            self._make_room(shard, {shard.key, *keep})
            open(part, "wb").close()  # counted by the bound (at the size its key names) while it downloads
        try:
            size, checksum = self.download(shard.path, part, shard.size)
        except BaseException as e:
            with contextlib.suppress(FileNotFoundError):
                os.remove(part)
            if isinstance(e, UnsafeEntry):  # larger than indexed, or changed while it downloaded
                raise CorpusChanged(
                    f"shard {shard.name} changed since the corpus index was built ({e}). A corpus must not change "
                    "while a run reads it; restore the shard, or start a new run on the new corpus (another name, "
                    "or resume.policy: fresh)"
                ) from None
            raise
        if size != shard.size or checksum != shard.checksum:
            os.remove(part)
            raise CorpusChanged(
                f"shard {shard.name} changed since the corpus index was built: {size} bytes with xxh3_128 {checksum} "
                f"now, {shard.size} bytes with {shard.checksum} then. A corpus must not change while a run reads it; "
                "restore the shard, or start a new run on the new corpus (another name, or resume.policy: fresh)"
            )
        os.replace(part, data)
        self.downloads += 1
        self._log(shard.name)

    def _entries(self) -> list[tuple[float, int, str, bool]]:
        """(mtime, size, key, is a part) of every cached or downloading shard; a download counts
        at the size its key names from its start."""
        out = []
        with os.scandir(self.shards_dir) as it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                key, part = e.name.removesuffix(".part"), e.name.endswith(".part")
                size = st.st_size
                if part:
                    with contextlib.suppress(ValueError):
                        size = max(size, int(key.rsplit("-", 1)[-1]))
                out.append((st.st_mtime, size, key, part))
        return out

    def _make_room(self, shard: RemoteShard, keep: Collection[str]) -> None:
        """Evict (under the cache lock) until ``shard`` fits the bound: stale downloads first, then
        the least recently used shards not in ``keep`` whose lock is free."""
        entries = self._entries()
        used = sum(size for _, size, _, _ in entries)
        for _mtime, size, key, part in sorted(entries, key=lambda e: (not e[3], e[0])):
            if used + shard.size <= self.bound:
                return
            if key in keep:
                continue
            with flocked(self._lock(key), blocking=False) as free:
                if not free:
                    continue  # being fetched or opened right now
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._data(key) + (".part" if part else ""))
                used -= size
        if used + shard.size > self.bound:
            raise CorpusError(
                f"corpus.cache_bytes ({self.bound} bytes) cannot hold shard {shard.name} ({shard.size} bytes) beside "
                f"the {used} bytes of shards in use in {self.directory}: raise corpus.cache_bytes, or lower "
                "corpus.window_shards / corpus.prefetch_shards"
            )

    def _log(self, name: str) -> None:
        log = os.path.join(self.directory, FETCH_LOG)
        with contextlib.suppress(FileNotFoundError):
            if os.path.getsize(log) > FETCH_LOG_MAX_BYTES:
                os.replace(log, log + ".1")
        with open(log, "a") as f:
            f.write(f"{time.time():.3f} {os.getpid()} {name}\n")


def fetched_names(directory: str) -> list[str]:
    """The shard names ``fetches.log`` lists, in order (what was downloaded into this cache)."""
    try:
        with open(os.path.join(directory, FETCH_LOG)) as f:
            return [line.split(" ", 2)[2].rstrip("\n") for line in f if line.count(" ") >= 2]
    except FileNotFoundError:
        return []


class Prefetcher:
    """Background threads that keep the shards of a plan (the next ones the epoch reads, in order)
    fetched ahead of use. A failed fetch is left to the reader, whose own fetch raises it. Idle
    threads end after ``idle_s`` and start again with the next plan."""

    def __init__(
        self,
        fetch: Callable[[Any, Collection[str]], Any],
        key: Callable[[Any], str],
        cached: Callable[[Any], bool],
        concurrency: int,
        idle_s: float = 30.0,
    ) -> None:
        self._fetch, self._key, self._cached = fetch, key, cached
        self.concurrency, self.idle_s = concurrency, idle_s
        self._cond = threading.Condition()
        self._plan: list[Any] = []
        self._in_flight: set[str] = set()
        self._threads: list[threading.Thread] = []
        self.errors: dict[str, BaseException] = {}

    def want(self, plan: list[Any]) -> None:
        """From now on keep these shards fetched (the first ones first)."""
        with self._cond:
            if plan == self._plan:
                return
            self._plan = list(plan)
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self.concurrency:
                t = threading.Thread(target=self._run, name="syncpoint-prefetch", daemon=True)
                self._threads.append(t)
                t.start()
            self._cond.notify_all()

    def busy(self) -> bool:
        """Whether a download is in flight or a shard of the plan is still to fetch."""
        with self._cond:
            if self._in_flight:
                return True
            return any(self._key(s) not in self.errors and not self._cached(s) for s in self._plan)

    def _next(self) -> tuple[Any, list[str]] | None:
        """The first shard of the plan neither cached nor in flight (claimed), and the plan's keys."""
        for shard in self._plan:
            key = self._key(shard)
            if key not in self._in_flight and key not in self.errors and not self._cached(shard):
                self._in_flight.add(key)
                return shard, [self._key(s) for s in self._plan]
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                job = self._next()
                while job is None:
                    if not self._cond.wait(self.idle_s):
                        if threading.current_thread() in self._threads:
                            self._threads.remove(threading.current_thread())
                        return
                    job = self._next()
            shard, keep = job
            try:
                self._fetch(shard, keep)
            except Exception as e:  # noqa: BLE001 - the reader's own fetch raises it where it matters
                with self._cond:
                    self.errors[self._key(shard)] = e
            finally:
                with self._cond:
                    self._in_flight.discard(self._key(shard))
                    self._cond.notify_all()
