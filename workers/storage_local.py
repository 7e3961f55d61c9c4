"""The local-filesystem backend (plain paths and ``file://``, NFS included).

Why it differs from the fsspec backend: a local file is durable only after ``fsync``, and a
manifest commits by temp name + fsync + atomic rename + fsync of the directory, so readers see the
whole file or none. Big files bypass the page cache (``workers.direct_io``). The lease's
compare-and-swap reads, compares and renames under an exclusive ``flock``, and dates the file by
the filesystem's own clock (a freshly touched lock file), the file server's on NFS. And a local
directory can hold symbolic links: retention and deletion must never follow one out of the run.
Listings and reads are the fsspec backend's (``LocalFileSystem``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from typing import Any

from workers.checksum import ChecksummingWriter, new_hasher
from workers.direct_io import DirectFileWriter
from workers.storage_fsspec import FsspecBackend
from workers.storage_protocol import Versioned, content_version


class LocalBackend(FsspecBackend):
    conditional_writes = "flock"  # an exclusive lock file serialises read-compare-rename

    def local_path(self, path: str) -> str | None:
        return path

    # ---- durable writes
    def write_bytes(self, data: bytes, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write_synced(path, data)

    def commit_bytes(self, data: bytes, path: str) -> None:
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = path + ".tmp"
        _write_synced(tmp, data)
        os.replace(tmp, path)
        _fsync_path(directory)  # the rename itself is durable

    @contextlib.contextmanager
    def open_durable(self, path: str, algo: str) -> Iterator[ChecksummingWriter]:
        """Page-cache bypass, fsync on a clean exit; on an error the partial file is left (without a
        manifest it is torn anyway)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with DirectFileWriter(path) as f:
            yield ChecksummingWriter(f, algo)

    def upload_file(self, local_path: str, path: str, algo: str, known: dict[str, Any] | None) -> tuple[int, str]:
        """Read straight into the page-aligned buffers of a ``DirectFileWriter`` (checksummed there
        when not known) and write with O_DIRECT while the next buffer fills."""
        if known is None:
            hasher = new_hasher(algo)
            return self._copy_direct(local_path, path, hasher.update), hasher.hexdigest()
        self._copy_direct(local_path, path, None)
        return int(known["size"]), str(known[algo])

    @staticmethod
    def _copy_direct(local_path: str, path: str, on_chunk: Any) -> int:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(local_path, "rb", buffering=0) as src, DirectFileWriter(path) as dst:
            return dst.fill_from(src, on_chunk)

    # ---- compare-and-swap under flock
    def read_versioned(self, path: str) -> Versioned | None:
        with _lock(path) as now:
            try:
                with open(path, "rb") as f:
                    mtime = os.fstat(f.fileno()).st_mtime
                    data = f.read()
            except FileNotFoundError:
                return None
            return Versioned(data, content_version(data), max(0.0, now - mtime))

    def write_if(self, data: bytes, path: str, expect: str | None) -> str | None:
        with _lock(path):
            try:
                with open(path, "rb") as f:
                    current: str | None = content_version(f.read())
            except FileNotFoundError:
                current = None
            if current != expect:
                return None
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            _write_synced(tmp, data)
            os.replace(tmp, path)
            _fsync_path(os.path.dirname(path))
            return content_version(data)

    # ---- links and deletion
    def entry_kinds(self, path: str) -> dict[str, str]:
        """Each entry as ``dir``, ``file``, ``link`` or ``other``, never following a link:
        retention must know that ``states/x`` is a link before it deletes anything in it."""
        try:
            with os.scandir(path) as it:
                return {e.name: _scandir_kind(e) for e in it}
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def is_link(self, path: str) -> bool:
        return os.path.islink(path)

    def remove(self, path: str) -> None:
        """The parent directory is opened with ``O_NOFOLLOW`` and the name unlinked relative to it,
        so a parent that is (or was just swapped for) a symbolic link is refused rather than
        followed: deleting ``states/<link>/manifest.json`` would delete a file outside the run."""
        parent, name = os.path.split(path)
        try:
            fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        try:
            os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)

    def delete_tree(self, path: str) -> None:
        if self.is_link(path):
            raise OSError(f"refusing to delete through a symbolic link: {path}")
        super().delete_tree(path)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _scandir_kind(e: os.DirEntry) -> str:
    if e.is_symlink():
        return "link"
    if e.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if e.is_file(follow_symlinks=False) else "other"


@contextlib.contextmanager
def _lock(path: str) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``<path>.lock`` (threads and processes alike: every call
    opens its own file description); yields the filesystem's "now", read by touching the lock file
    so that ages compare two timestamps from the same clock (the file server's, on NFS)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.utime(fd)
        yield os.fstat(fd).st_mtime
    finally:
        os.close(fd)  # releases the lock
