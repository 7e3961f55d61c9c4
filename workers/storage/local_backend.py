"""The local-filesystem backend (plain paths and ``file://``, NFS included).

Why it differs from the fsspec backend: a local file is durable only after ``fsync``, and a
manifest commits by temp name + fsync + atomic rename + fsync of the directory, so readers see the
whole file or none. Big files bypass the page cache (``syncpoint.workers.storage.direct_io``). The lease's
compare-and-swap reads, compares and renames under an exclusive ``flock``, and dates the file by
the filesystem's own clock (a freshly touched lock file), the file server's on NFS.

And a local directory can hold symbolic links, FIFOs and links to devices, planted by anyone who can
write it: the backend is anchored at the run directory (``RunStorage``'s root, followed as the user
named it) and reaches everything below it through ``syncpoint.workers.storage.nofollow``, component by component with
``O_NOFOLLOW``. Nothing is read or written through a link; only regular files are read, each up to
its bound; a write replaces a planted link instead of following it (one WARNING line), and deletion
never descends through one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from typing import Any

from syncpoint.policies.contracts.errors import OversizedEntry, UnsafeEntry
from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import ChecksummingWriter, new_hasher
from syncpoint.workers.storage.direct_io import DirectFileWriter
from syncpoint.workers.storage.fsspec_backend import copy_range, range_fits, range_target
from syncpoint.workers.storage.nofollow import (
    Tree,
    delete_tree,
    kind_at,
    open_dirs,
    open_lock,
    open_regular,
    read_fd,
    read_file,
    scan,
    walk_files,
    write_replacing,
)
from syncpoint.workers.storage.protocol import (
    CHUNK,
    Backend,
    ConditionalWrites,
    Listing,
    LocalFiles,
    Versioned,
    content_version,
)


class LocalBackend(Backend, LocalFiles):
    """A local filesystem: writes and reads without following links, atomic commits, flock compare-and-swap."""

    conditional_writes = ConditionalWrites.FLOCK

    def __init__(self, root: str) -> None:
        self.tree = Tree(root)

    def local_path(self, path: str) -> str:
        return path

    # ---- how a path is reached: the anchor, then its components without following links
    @contextlib.contextmanager
    def _parent(self, path: str, *, create: bool = False) -> Iterator[tuple[int, str, str]]:
        """(descriptor of the entry's directory, the entry's name, its path below the run for messages)."""
        parts = self.tree.parts(path)
        if not parts:
            raise UnsafeEntry(f"{path} is the run directory itself, not a file in it")
        with self.tree.directory(parts[:-1], create=create) as fd:
            yield fd, parts[-1], "/".join(parts)

    @contextlib.contextmanager
    def _dir(self, path: str) -> Iterator[int]:
        with self.tree.directory(self.tree.parts(path)) as fd:
            yield fd

    def open_dir(self, path: str) -> int:
        root = self.tree.open_root()
        try:
            return open_dirs(root, self.tree.parts(path))
        finally:
            os.close(root)

    # ---- reads and listings
    def exists(self, path: str) -> bool:
        """Whether the entry is there, looked up without following links (below a link it is not)."""
        if not self.tree.parts(path):
            return os.path.isdir(self.tree.root)
        try:
            with self._parent(path) as (fd, name, _):
                return kind_at(fd, name) is not None
        except (FileNotFoundError, NotADirectoryError, UnsafeEntry):
            return False

    def read_bytes(self, path: str, limit: int) -> bytes:
        with self._parent(path) as (fd, name, shown):
            return read_file(fd, name, limit, shown)

    def listing(self, path: str) -> Listing:
        try:
            with self._dir(path) as fd:
                return Listing(*walk_files(fd))
        except (FileNotFoundError, NotADirectoryError):
            return Listing({}, {})

    def entry_kinds(self, path: str) -> dict[str, str]:
        """Each entry as ``dir``, ``file``, ``link`` or ``other``, never following a link:
        retention must know that ``states/x`` is a link before it deletes anything in it."""
        try:
            with self._dir(path) as fd:
                return scan(fd)
        except (FileNotFoundError, NotADirectoryError):
            return {}

    def is_link(self, path: str) -> bool:
        """Whether the entry, or a directory between the run and it, is a symbolic link."""
        try:
            with self._parent(path) as (fd, name, _):
                return kind_at(fd, name) == "a symbolic link"
        except (FileNotFoundError, NotADirectoryError):
            return False
        except UnsafeEntry:
            return True

    # ---- durable writes
    def write_bytes(self, data: bytes, path: str) -> None:
        with self._parent(path, create=True) as (fd, name, shown):
            write_replacing(fd, name, data, shown)

    def commit_bytes(self, data: bytes, path: str) -> None:
        with self._parent(path, create=True) as (fd, name, shown):
            write_replacing(fd, name, data, shown, sync_dir=True)  # the rename itself is durable

    def _new_file(self, path: str) -> DirectFileWriter:
        with self._parent(path, create=True) as (fd, name, shown):
            return DirectFileWriter(name, dir_fd=fd, shown=shown)

    @contextlib.contextmanager
    def open_durable(self, path: str, algo: str) -> Iterator[ChecksummingWriter]:
        """Page-cache bypass, fsync on a clean exit; on an error the partial file is left (without a
        manifest it is torn anyway)."""
        with self._new_file(path) as f:
            yield ChecksummingWriter(f, algo)

    def upload_file(self, local_path: str, path: str, algo: str, known: ManifestEntry | None) -> tuple[int, str]:
        """Read straight into the page-aligned buffers of a ``DirectFileWriter`` (checksummed there
        when not known) and write with O_DIRECT while the next buffer fills."""
        if known is None:
            hasher = new_hasher(algo)
            return self._copy_direct(local_path, path, hasher.update), hasher.hexdigest()
        self._copy_direct(local_path, path, None)
        return known.size, known.digest

    def _copy_direct(self, local_path: str, path: str, on_chunk: Any) -> int:
        with open(local_path, "rb", buffering=0) as src, self._new_file(path) as dst:
            return dst.fill_from(src, on_chunk)

    def download_file(self, local_path: str, path: str, algo: str, limit: int) -> tuple[int, str]:
        """Copy a regular file (never through a link) to our own local path, at most ``limit`` bytes:
        one more is refused (``OversizedEntry``) before it is kept."""
        h, size = new_hasher(algo), 0
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with self._parent(path) as (fd, name, shown):
            src = open_regular(fd, name, shown)
        try:
            with open(local_path, "wb") as dst:
                while chunk := os.read(src, min(CHUNK, limit + 1 - size)):
                    size += len(chunk)
                    if size > limit:
                        raise OversizedEntry(f"{shown} holds more than the {limit} bytes it can hold: not copied")
                    h.update(chunk)
                    dst.write(chunk)
        finally:
            os.close(src)
        return size, h.hexdigest()

    def download_range(self, local_path: str, path: str, start: int, end: int, limit: int, at: int) -> None:
        """A regular file (never through a link), its size checked against ``limit`` and ``end``;
        only ``end - start`` bytes are read."""
        with self._parent(path) as (fd, name, shown):
            src = open_regular(fd, name, shown)
        try:
            range_fits(shown, os.fstat(src).st_size, end, limit)
            with range_target(local_path) as dst:
                copy_range(lambda offset, n: os.pread(src, n, offset), dst, start, end, at, shown)
        finally:
            os.close(src)

    # ---- compare-and-swap under flock
    def read_versioned(self, path: str, limit: int) -> Versioned | None:
        with self._parent(path, create=True) as (fd, name, shown), _lock(fd, name, shown) as now:
            try:
                src = open_regular(fd, name, shown)
            except FileNotFoundError:
                return None
            try:
                mtime = os.fstat(src).st_mtime
                data = read_fd(src, limit, shown)
            finally:
                os.close(src)
            return Versioned(data, content_version(data), max(0.0, now - mtime))

    def write_if(self, data: bytes, path: str, expect: str | None, limit: int) -> str | None:
        with self._parent(path, create=True) as (fd, name, shown), _lock(fd, name, shown):
            try:
                current: str | None = content_version(read_file(fd, name, limit, shown))
            except FileNotFoundError:
                current = None
            if current != expect:
                return None
            write_replacing(fd, name, data, shown, sync_dir=True)
            return content_version(data)

    # ---- deletion and moves, never through a link
    def remove(self, path: str) -> None:
        """The name is unlinked relative to its directory, reached without following links, so a
        parent that is (or was just swapped for) a symbolic link is refused rather than followed:
        deleting ``states/<link>/manifest.json`` would delete a file outside the run."""
        try:
            with self._parent(path) as (fd, name, _):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        if not self.tree.parts(path):  # the whole run directory (a drill's own)
            if os.path.islink(self.tree.root):
                raise UnsafeEntry(f"refusing to delete through a symbolic link: {path}")
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(self.tree.root)
            return
        try:
            with self._parent(path) as (fd, name, shown):
                delete_tree(fd, name, shown)
        except FileNotFoundError:
            pass

    def rename_tree(self, src: str, dst: str) -> None:
        with self._parent(src) as (sfd, sname, _), self._parent(dst, create=True) as (dfd, dname, _):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


@contextlib.contextmanager
def _lock(dir_fd: int, name: str, shown: str) -> Iterator[float]:
    """Hold an exclusive ``flock`` on ``<name>.lock`` (threads and processes alike: every call
    opens its own file description); yields the filesystem's "now", read by touching the lock file
    so that ages compare two timestamps from the same clock (the file server's, on NFS). The lock
    file is opened without following a link (a planted one is replaced, never created through)."""
    fd = open_lock(dir_fd, name + ".lock", shown + ".lock")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.utime(fd)
        yield os.fstat(fd).st_mtime
    finally:
        os.close(fd)  # releases the lock
