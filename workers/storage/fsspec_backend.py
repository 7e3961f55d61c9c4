"""The fsspec backend: any fsspec filesystem (``memory://``, ``gs://``, ...; ``s3://`` adds
server-side conditional writes in ``syncpoint.workers.storage.s3_backend``, local paths add fsync and flock in
``syncpoint.workers.storage.local_backend``).

Why these choices: on an object store a completed single PUT is durable and atomic, so a whole
file is one ``pipe_file`` and a manifest commits with no temp name; an upload is checksummed by a
second thread while fsspec sends it (hashlib and xxhash release the GIL). Listings are cached per
process by fsspec, and other writers (ranks, drivers) add states and events, so every listing
invalidates the cache first. A store without conditional writes gets a best-effort
compare-and-swap (write, then read back), which narrows the race but cannot close it. Every read
is a ranged one of at most its bound plus one byte (``cat_file(start=0, end=limit + 1)``), so a file
larger than it may be is refused having read only that much.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from syncpoint.policies.contracts.errors import OversizedEntry, UnsafeEntry
from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import ChecksummingWriter, new_hasher
from syncpoint.workers.storage.protocol import (
    CHUNK,
    Backend,
    ConditionalWrites,
    Listing,
    Versioned,
    content_version,
)


class FsspecBackend(Backend):
    """One fsspec filesystem, with only what every fsspec filesystem offers: the core, generic
    transfers, and a best-effort compare-and-swap (``ConditionalWrites.NONE``)."""

    conditional_writes = ConditionalWrites.NONE

    def __init__(self, fs: Any) -> None:
        self.fs = fs

    # ---- reads and listings
    def exists(self, path: str) -> bool:
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def read_bytes(self, path: str, limit: int) -> bytes:
        return bounded(self.fs.cat_file(path, start=0, end=limit + 1), limit, path)

    def listing(self, path: str) -> Listing:
        """Every file below a directory as relative path -> size (one listing call, no reads); an entry
        the store calls a link or anything but a file is reported, not counted as a file."""
        self.fs.invalidate_cache(path)
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError:
            return Listing({}, {})
        files: dict[str, int] = {}
        unsafe: dict[str, str] = {}
        for name, info in found.items():
            rel = name[len(path) :].lstrip("/")
            if info.get("islink") or info.get("type") != "file":
                unsafe[rel] = "a symbolic link" if info.get("islink") else f"a {info.get('type')} entry, not a file"
            else:
                files[rel] = int(info.get("size") or 0)
        return Listing(files, unsafe)

    def entry_kinds(self, path: str) -> dict[str, str]:
        """Each entry as ``dir``, ``file`` or ``other`` (object stores have no links), from one fresh
        listing (fsspec lists with details either way, so names alone would cost the same)."""
        self.fs.invalidate_cache(path)
        try:
            entries = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return {}
        kinds = {"directory": "dir", "file": "file"}
        return {
            _name(e["name"]): kinds.get(e.get("type"), "other")
            for e in entries
            if str(e["name"]).rstrip("/") != path.rstrip("/")
        }

    # ---- durable writes: a completed PUT is durable and atomic
    def write_bytes(self, data: bytes, path: str) -> None:
        self.fs.pipe_file(path, data)

    def commit_bytes(self, data: bytes, path: str) -> None:
        self.fs.pipe_file(path, data)

    @contextlib.contextmanager
    def open_durable(self, path: str, algo: str) -> Iterator[ChecksummingWriter]:
        """The upload completes on a clean close; on an error it is discarded where the store can
        (without a manifest a partial file is torn anyway)."""
        f = self.fs.open(path, "wb")
        try:
            yield ChecksummingWriter(f, algo)
        except BaseException:
            discard = getattr(f, "discard", None)
            if callable(discard):
                discard()
            else:
                f.close()
            raise
        f.close()

    def upload_file(self, local_path: str, path: str, algo: str, known: ManifestEntry | None) -> tuple[int, str]:
        if known is not None:
            self._copy(local_path, path)
            return known.size, known.digest
        with ThreadPoolExecutor(max_workers=1) as pool:  # the checksum reads while the copy writes
            digest = pool.submit(checksum_file, local_path, algo)
            self._copy(local_path, path)
            return digest.result()

    def _copy(self, local_path: str, path: str) -> None:
        with open(local_path, "rb") as src, self.fs.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst, CHUNK)

    def download_file(self, local_path: str, path: str, algo: str, limit: int) -> tuple[int, str]:
        """Copy at most ``limit`` bytes; one more is refused (``OversizedEntry``) before it is kept."""
        h = new_hasher(algo)
        size = 0
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with self.fs.open(path, "rb") as src, open(local_path, "wb") as dst:
            while chunk := src.read(min(CHUNK, limit + 1 - size)):
                size += len(chunk)
                bounded(b"", limit, path, size)
                h.update(chunk)
                dst.write(chunk)
        return size, h.hexdigest()

    def download_range(self, local_path: str, path: str, start: int, end: int, limit: int, at: int) -> None:
        """The object's size checked against ``limit`` and ``end`` first; then only ``end - start``
        bytes are read, from ``start``."""
        size = int(self.fs.size(path))
        range_fits(path, size, end, limit)
        with self.fs.open(path, "rb") as src, range_target(local_path) as dst:
            src.seek(start)
            copy_range(lambda _offset, n: src.read(n), dst, start, end, at, path)

    # ---- compare-and-swap without server support: compare, write, let a racing writer land, read back
    def read_versioned(self, path: str, limit: int) -> Versioned | None:
        self.fs.invalidate_cache(path)
        try:
            data = self.read_bytes(path, limit)
        except FileNotFoundError:
            return None
        return Versioned(data, content_version(data), None)

    def write_if(self, data: bytes, path: str, expect: str | None, limit: int) -> str | None:
        before = self.read_versioned(path, limit)
        if (before.version if before else None) != expect:
            return None
        self.fs.pipe_file(path, data)
        time.sleep(0.2)
        after = self.read_versioned(path, max(limit, len(data)))
        return after.version if after is not None and after.data == data else None

    # ---- deletion and moves
    def remove(self, path: str) -> None:
        """Delete one file (a missing file is fine)."""
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def rename_tree(self, src: str, dst: str) -> None:
        self.fs.mv(src, dst, recursive=True)


# memory:// lives in this process: one lock serialises its compare-and-swap writes, and this
# process's monotonic clock is the store's own clock (path -> when the file was last written).
_MEMORY_LOCK = threading.Lock()
_MEMORY_STAMPS: dict[str, tuple[str, float]] = {}  # path -> (version, monotonic time it was written)


class MemoryBackend(FsspecBackend):
    """``memory://`` (and its subclasses): the store lives in this process, so a process lock makes
    the compare-and-swap atomic and this process's monotonic clock dates the files."""

    conditional_writes = ConditionalWrites.PROCESS_LOCK

    def read_versioned(self, path: str, limit: int) -> Versioned | None:
        with _MEMORY_LOCK:
            try:
                data = self.read_bytes(path, limit)
            except FileNotFoundError:
                return None
            version, now = content_version(data), time.monotonic()
            stamp = _MEMORY_STAMPS.get(path)
            if stamp is None or stamp[0] != version:  # written behind write_if's back: its age counts from now
                stamp = _MEMORY_STAMPS[path] = (version, now)
            return Versioned(data, version, now - stamp[1])

    def write_if(self, data: bytes, path: str, expect: str | None, limit: int) -> str | None:
        with _MEMORY_LOCK:
            try:
                current: str | None = content_version(self.read_bytes(path, limit))
            except FileNotFoundError:
                current = None
            if current != expect:
                return None
            self.fs.pipe_file(path, data)
            version = content_version(data)
            _MEMORY_STAMPS[path] = (version, time.monotonic())
            return version


def checksum_file(path: str, algo: str) -> tuple[int, str]:
    """(size, checksum) of a local file."""
    h, size = new_hasher(algo), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def range_fits(path: str, size: int, end: int, limit: int) -> None:
    """Refuse to read a range of a stored file larger than its bound or shorter than the range."""
    if size > limit:
        raise OversizedEntry(f"{path} is {size} bytes, more than the {limit} it can hold: not read")
    if size < end:
        raise UnsafeEntry(f"{path} is {size} bytes, shorter than the {end} its range needs: not read")


def copy_range(read: Callable[[int, int], bytes], dst: int, start: int, end: int, at: int, shown: str) -> None:
    """Bytes ``[start, end)``, read in chunks by ``read(offset, size)``, written to ``dst`` from offset
    ``at``; ``UnsafeEntry`` when the stored file ends before ``end``."""
    offset = start
    while offset < end and (chunk := read(offset, min(CHUNK, end - offset))):
        os.pwrite(dst, chunk, at + offset - start)
        offset += len(chunk)
    if offset != end:
        raise UnsafeEntry(f"{shown} ended at byte {offset} while its bytes to {end} were read: not read")


@contextlib.contextmanager
def range_target(local_path: str) -> Iterator[int]:
    """A local file (this process's own, never through a link) that ranges are written into at their
    offsets: created when missing, never truncated, so several ranges fill one file."""
    os.makedirs(os.path.dirname(local_path), exist_ok=True)
    fd = os.open(local_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


def bounded(data: bytes, limit: int, path: str, size: int | None = None) -> bytes:
    """``data`` when it (or ``size`` bytes read so far) is within ``limit``, else ``OversizedEntry``."""
    if (len(data) if size is None else size) > limit:
        raise OversizedEntry(f"{path} holds more than the {limit} bytes it can hold: not read")
    return data


def _name(entry: Any) -> str:
    """The last path segment of a listing entry."""
    return str(entry).rstrip("/").rsplit("/", 1)[-1]
