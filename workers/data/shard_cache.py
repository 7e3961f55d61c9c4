"""A node-local, bounded cache of corpus shards, shared by every process of the node.

Why on local disk and keyed by content: a shard is read by every rank of a node and by their
DataLoader worker processes; one copy per node, fetched once, serves them all, and a key made of
the shard's checksum and size (``<xxh3_128>-<size>``) means a cached file is exactly the bytes the
corpus index names, whatever URL or job they came from.

Trust: the node is shared, so the cache trusts nothing another account could have put there. Its
directory is this user's private one (created 0700, checked on its descriptor: owned by this user,
no group or other bit; anything else is refused with the fix), so no other account reads the
training data, plants a file or takes a lock in it. Below it, every entry is reached from its
parent's descriptor without following a link (``syncpoint.workers.storage.nofollow``), files are
created 0600, a shard is opened only as a regular file, and ``fetches.log`` is appended to only as a
regular file (a link, FIFO or socket there is replaced, never written through). A cached shard is
checked against the index (size and xxh3_128) on its first open in each process, through the very
descriptor the reader then maps; a wrong one is removed and downloaded again. Later opens of the
same file (same inode) in that process skip the checksum, so steady-state reads stay fast.

How processes agree (``fcntl.flock``, which also excludes two threads of one process):

* one lock file per shard (``locks/<key>``): held while the shard is fetched and while a reader
  opens it, so two processes never download the same shard and a reader never opens a file that
  is being evicted; a fetch lands as ``<key>.part`` (pre-sized, so the bound counts it) and is
  renamed into place only after its size and checksum matched the index;
* one lock for the whole cache (``cache.lock``): held while room is made for a fetch, which
  evicts the least recently used shards (a shard's mtime is its last fetch or open) whose own lock
  is free, never the ones the fetching process needs next (``keep``); an opened shard stays
  readable after its eviction (its mapping outlives the name).

Every wait for a lock is bounded (``LOCK_WAIT_S`` since the holder last showed progress, by touching
the lock file): a holder that never lets go ends the wait with ``LockWaitExpired`` naming the lock
file and its holder, never a hang.

A lock inherited through ``fork`` (a DataLoader worker started while a prefetch thread held one)
would stay held for the child's life, so the child closes every lock descriptor it inherited.
``fetches.log`` lists every download (shard name), for the curious and the tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError, UnsafeEntry
from syncpoint.workers.integrity.verified_files import checksum_fd
from syncpoint.workers.storage import nofollow

FETCH_LOG = "fetches.log"
FETCH_LOG_MAX_BYTES = 1 << 20  # then it starts over (fetches.log.1 keeps the previous one)
LOCK_WAIT_S = 600.0  # the longest wait for a lock whose holder shows no progress (one shard's download)
LOCK_POLL_S = 0.05  # the longest pause between two tries of a held lock
CHECKSUM = "xxh3_128"  # the index's checksum of a shard (what the download computes)
_HEX32 = re.compile(r"[0-9a-f]{32}")
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


class LockWaitExpired(RuntimeError):
    """Another process held a cache lock past the bound without showing progress: the wait ends with
    the lock file's name and its holder, never as a hang."""


# ------------------------------------------------------------------ the private directory


def open_private_dir(path: str) -> int:
    """A descriptor of the cache directory ``path``, created 0700 when missing (its parents as the
    user named them), never through a link, and refused (``CorpusError``, with the fix) unless it is
    this user's private directory: another account's directory, or one others can read or write,
    could hold planted shards, an index or locks, or show the training data to others."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    top = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return nofollow.open_private(top, name, path, create=True)
    except (UnsafeEntry, NotADirectoryError) as e:
        raise CorpusError(
            f"the corpus cache directory cannot be used: {e}. Another account could read the training data "
            f"there, or plant shards, an index or locks. Remove {path} (syncpoint makes it again, 0700), or set "
            "corpus.cache_dir (or SYNCPOINT_CORPUS_CACHE) to a directory of your own"
        ) from None
    finally:
        os.close(top)


def private_subdir(parent: int, name: str, shown: str) -> int:
    """A directory below a private one (made 0700), opened without following a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=parent)
    return nofollow.open_dirs(parent, [name], shown=[shown])


def fd_path(fd: int) -> str:
    """A path that opens exactly the file behind ``fd`` (for readers and downloads that take a path):
    whatever is at the file's name meanwhile, the bytes read are the ones checked."""
    return f"/proc/self/fd/{fd}"


# ------------------------------------------------------------------ bounded locks


@contextlib.contextmanager
def locked(dir_fd: int, name: str, shown: str, *, blocking: bool = True, wait_s: float | None = None) -> Iterator[bool]:
    """An exclusive ``flock`` on the lock file ``name`` below ``dir_fd`` (created 0600, never through a
    link) for the block. ``wait_s`` (default ``LOCK_WAIT_S``): how long to wait for a holder that
    shows no progress, then ``LockWaitExpired``; not ``blocking``: no wait at all (``False`` when
    someone else holds it)."""
    bound = (LOCK_WAIT_S if wait_s is None else wait_s) if blocking else None
    fd = nofollow.open_lock(dir_fd, name, shown, mode=0o600)
    try:
        if not _acquire(fd, shown, bound):
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


def _acquire(fd: int, shown: str, wait_s: float | None) -> bool:
    """Poll ``LOCK_EX|LOCK_NB`` until the lock is ours, or (``wait_s``) until its holder has shown no
    progress for that long: neither since this wait began nor since it last touched the lock file."""
    start, pause = time.monotonic(), 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        if wait_s is None:
            return False
        idle = min(time.monotonic() - start, time.time() - os.fstat(fd).st_mtime)
        if idle >= wait_s:
            holder = _holder(fd)
            raise LockWaitExpired(
                f"{shown} is held by another process{f' (pid {holder})' if holder else ''}, which has shown no "
                f"progress for {wait_s:g} s (it fetches or opens that shard, or builds the corpus index, or is "
                "stuck): syncpoint stopped waiting for it. End that process if it is stuck, then start the run again"
            )
        time.sleep(min(pause, wait_s - idle))
        pause = min(pause * 2, LOCK_POLL_S)


def _holder(fd: int) -> int | None:
    """The process holding a ``flock`` on ``fd``'s file, from ``/proc/locks`` (for the message)."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                if len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == inode:
                    return int(parts[4])
    except (OSError, ValueError):
        pass
    return None


@contextlib.contextmanager
def flocked(path: str, *, blocking: bool = True, wait_s: float | None = None) -> Iterator[bool]:
    """:func:`locked` on a lock file named by its path (its directory followed as named)."""
    parent = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with locked(parent, os.path.basename(path), path, blocking=blocking, wait_s=wait_s) as got:
            yield got
    finally:
        os.close(parent)


# ------------------------------------------------------------------ the cache


@dataclass(frozen=True)
class RemoteShard:
    """What the cache needs of a shard: where it is, and the size and checksum it must have."""

    name: str  # for messages and the fetch log
    path: str  # the storage's path (``bucket/key`` on S3)
    size: int
    checksum: str  # xxh3_128

    def __post_init__(self) -> None:
        # the key names local files: an index entry (the run directory's copy may be hostile) must not
        # make it a path ("../x") or anything but a checksum and a size
        if not (_HEX32.fullmatch(str(self.checksum)) and type(self.size) is int and self.size >= 0):
            raise CorpusError(
                f"corpus index entry for shard {self.name!r} has checksum {self.checksum!r} and size {self.size!r}: "
                "not an xxh3_128 (32 hex digits) and a byte count; remove the corpus index files to rebuild them"
            )

    @property
    def key(self) -> str:
        return f"{self.checksum}-{self.size}"


# download(remote path, local path, limit) -> (size, xxh3_128) of what landed locally
Download = Callable[[str, str, int], tuple[int, str]]


class ShardCache:
    """A node's bounded cache of fetched shards: private to this user, verified before use, evicted
    least recently used, shared by the node's processes through file locks."""

    def __init__(self, directory: str, bound: int, download: Download, *, lock_wait_s: float | None = None) -> None:
        self.directory, self.bound, self.download = directory, int(bound), download
        self.lock_wait_s = lock_wait_s
        self.shards_dir = os.path.join(directory, "shards")
        self.locks_dir = os.path.join(directory, "locks")
        self._fds: list[int] = []
        self._dir = self._keep(open_private_dir(directory))
        self._shards = self._keep(private_subdir(self._dir, "shards", directory))
        self._locks = self._keep(private_subdir(self._dir, "locks", directory))
        self._verified: dict[str, tuple[int, int]] = {}  # key -> (device, inode) checked in this process
        self.downloads = 0  # by this process

    def _keep(self, fd: int) -> int:
        self._fds.append(fd)
        return fd

    def close(self) -> None:
        """Close the cache's directory descriptors (a cache is never used after)."""
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _shown(self, key: str) -> str:
        return os.path.join(self.shards_dir, key)

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        with locked(self._locks, key, os.path.join(self.locks_dir, key), wait_s=self.lock_wait_s):
            yield

    def has(self, shard: RemoteShard) -> bool:
        """Whether the shard lies in the cache (a regular file of its size; its bytes are checked on open)."""
        try:
            st = os.stat(shard.key, dir_fd=self._shards, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return nofollow.what(st.st_mode) == "a regular file" and st.st_size == shard.size

    def open(self, shard: RemoteShard, opener: Callable[[str], T], keep: Collection[str] = ()) -> T:
        """``opener(path)`` of the shard's verified bytes, fetched first if it is not cached (or not
        right); the open happens under the shard's lock, so no eviction removes the file in between."""
        with self._locked(shard.key):
            fd = self._verified_fd(shard)
            if fd is None:
                self._fetch(shard, keep)
                fd = self._verified_fd(shard)
                if fd is None:  # only this user can write here: a download that is not there now
                    raise CorpusError(f"{self._shown(shard.key)} vanished right after its download: not read")
            try:
                os.utime(fd)  # recently used: evicted last
                return opener(fd_path(fd))
            finally:
                os.close(fd)

    def fetch(self, shard: RemoteShard, keep: Collection[str] = ()) -> bool:
        """Make sure the shard is cached (the prefetcher's call); ``True`` when this call downloaded it.
        A cached file of another size, or not a regular file, is replaced (its bytes are checked when
        a process opens it)."""
        with self._locked(shard.key):
            if self.has(shard):
                os.utime(shard.key, dir_fd=self._shards, follow_symlinks=False)
                return False
            self._discard(shard, "it is not a regular file of the indexed size")
            self._fetch(shard, keep)
            return True

    def _verified_fd(self, shard: RemoteShard) -> int | None:
        """A descriptor of the cached shard when its bytes are the index's (checked once per file and
        process); ``None`` when it is missing or was not right (then removed, said on stderr)."""
        shown = self._shown(shard.key)
        try:
            fd = nofollow.open_regular(self._shards, shard.key, shown)
        except FileNotFoundError:
            return None
        except UnsafeEntry as e:
            self._discard(shard, str(e))
            return None
        st = os.fstat(fd)
        if self._verified.get(shard.key) == (st.st_dev, st.st_ino):
            return fd
        size, checksum = (
            (st.st_size, "not computed") if st.st_size != shard.size else checksum_fd(fd, CHECKSUM, shard.size)
        )
        if (size, checksum) == (shard.size, shard.checksum):
            self._verified[shard.key] = (st.st_dev, st.st_ino)
            return fd
        os.close(fd)
        self._discard(
            shard,
            f"{size} bytes with {CHECKSUM} {checksum}, where the index names {shard.size} bytes with {shard.checksum}",
        )
        return None

    def _discard(self, shard: RemoteShard, why: str) -> None:
        """Remove what lies at a shard's name (never through a link) so that it is downloaded again;
        ``CorpusError`` when it cannot be removed."""
        shown = self._shown(shard.key)
        kind = nofollow.kind_at(self._shards, shard.key)
        if kind is None:
            return
        self._verified.pop(shard.key, None)
        try:
            if kind == "a directory":
                raise IsADirectoryError(f"{shown} is a directory")
            os.unlink(shard.key, dir_fd=self._shards)
        except FileNotFoundError:
            return
        except OSError as e:
            raise CorpusError(
                f"the cached shard {shard.name} ({shown}) is not the shard the index names ({why}) and cannot be "
                f"replaced ({e}): it is not read. Remove it, or set corpus.cache_dir to another directory"
            ) from None
        nofollow.warn(
            f"cached shard {shard.name} ({shown}) was not the shard the index names ({why}): removed, downloaded again"
        )

    def _fetch(self, shard: RemoteShard, keep: Collection[str]) -> None:
        """Download under the shard's lock (held by the caller), verified before it is renamed in."""
        part = shard.key + ".part"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(part, dir_fd=self._shards)  # a dead process's: we hold its lock
        with locked(self._dir, "cache.lock", os.path.join(self.directory, "cache.lock"), wait_s=self.lock_wait_s):
            self._make_room(shard, {shard.key, *keep})
            # counted by the bound (at the size its key names) while it downloads
            fd = nofollow.create_new(self._shards, part, self._shown(part), mode=0o600)
        try:
            try:
                size, checksum = self.download(shard.path, fd_path(fd), shard.size)
            except BaseException as e:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(part, dir_fd=self._shards)
                if isinstance(e, UnsafeEntry):  # larger than indexed, or changed while it downloaded
                    raise CorpusChanged(
                        f"shard {shard.name} changed since the corpus index was built ({e}). A corpus must not "
                        "change while a run reads it; restore the shard, or start a new run on the new corpus "
                        "(another name, or resume.policy: fresh)"
                    ) from None
                raise
            if size != shard.size or checksum != shard.checksum:
                os.unlink(part, dir_fd=self._shards)
                raise CorpusChanged(
                    f"shard {shard.name} changed since the corpus index was built: {size} bytes with xxh3_128 "
                    f"{checksum} now, {shard.size} bytes with {shard.checksum} then. A corpus must not change while "
                    "a run reads it; restore the shard, or start a new run on the new corpus (another name, or "
                    "resume.policy: fresh)"
                )
            os.replace(part, shard.key, src_dir_fd=self._shards, dst_dir_fd=self._shards)
            st = os.fstat(fd)
            self._verified[shard.key] = (st.st_dev, st.st_ino)  # the bytes just checked
        finally:
            os.close(fd)
        self.downloads += 1
        self._log(shard.name)

    def _entries(self) -> list[tuple[float, int, str, bool]]:
        """(mtime, size, key, is a part) of every cached or downloading shard; a download counts
        at the size its key names from its start."""
        out = []
        listing = os.open(".", nofollow.DIR_FLAGS, dir_fd=self._shards)  # its own offset: a scan moves it
        try:
            with os.scandir(listing) as it:
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
        finally:
            os.close(listing)
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
            with locked(self._locks, key, os.path.join(self.locks_dir, key), blocking=False) as free:
                if not free:
                    continue  # being fetched or opened right now
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(key + (".part" if part else ""), dir_fd=self._shards)
                self._verified.pop(key, None)
                used -= size
        if used + shard.size > self.bound:
            raise CorpusError(
                f"corpus.cache_bytes ({self.bound} bytes) cannot hold shard {shard.name} ({shard.size} bytes) beside "
                f"the {used} bytes of shards in use in {self.directory}: raise corpus.cache_bytes, or lower "
                "corpus.window_shards / corpus.prefetch_shards"
            )

    def _log(self, name: str) -> None:
        """One line in ``fetches.log``, appended only to a regular file (never through a link)."""
        shown = os.path.join(self.directory, FETCH_LOG)
        fd = nofollow.open_lock(self._dir, FETCH_LOG, shown, mode=0o600, append=True)
        if os.fstat(fd).st_size > FETCH_LOG_MAX_BYTES:
            os.close(fd)
            os.replace(FETCH_LOG, FETCH_LOG + ".1", src_dir_fd=self._dir, dst_dir_fd=self._dir)
            fd = nofollow.open_lock(self._dir, FETCH_LOG, shown, mode=0o600, append=True)
        try:
            nofollow.write_all(fd, f"{time.time():.3f} {os.getpid()} {name}\n".encode())
        finally:
            os.close(fd)


def fetched_names(directory: str) -> list[str]:
    """The shard names ``fetches.log`` lists, in order (what was downloaded into this cache)."""
    try:
        top = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        data = nofollow.read_file(top, FETCH_LOG, 2 * FETCH_LOG_MAX_BYTES, os.path.join(directory, FETCH_LOG))
    except FileNotFoundError:
        return []
    finally:
        os.close(top)
    lines = data.decode(errors="replace").splitlines()
    return [line.split(" ", 2)[2] for line in lines if line.count(" ") >= 2]


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
