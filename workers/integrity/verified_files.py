"""A local state's files verified where they lie: opened without following links, checksummed in
one read, and loaded from the very inode that was checksummed.

Why: on local storage, copying a state into a temporary directory before loading it (what the
reader does for object stores) reads every byte twice and writes it once more, which made a local
restore several times slower than reading its files (bench/results/p10_object_store.md). Reading in place must keep what
the copy gave:

* only the state's own files: each manifest name (already a normalized path inside the state,
  ``syncpoint.policies.contracts.state_paths``) is opened component by component relative to the state directory with
  ``O_NOFOLLOW`` (``syncpoint.workers.storage.nofollow``; the state directory itself is reached the same way from the
  run directory), so a symbolic link anywhere below the state, or the state directory itself being
  one, is refused rather than followed out of it; a name that is not a regular file is refused, and
  a FIFO cannot block the open (``O_NONBLOCK``); no file is read past its manifest size plus one byte;
* a checksum before use: the file's size and checksum are verified on the open descriptor before
  anything unpickles it, and every later read (the weights-only check, DeepSpeed's load through the
  checkpoint engine) goes through that same descriptor (``/proc/self/fd/N``), so a file renamed or
  swapped in behind it is never what is loaded;
* the bytes loaded are the bytes checksummed: a descriptor does not stop someone with write access
  from rewriting the file in place between the checksum and the load, so :meth:`VerifiedFile.
  unchanged` compares the file's inode, size, modification and change times (the change time cannot
  be set by a writer) before and after the load, and a file changed meanwhile is refused before any
  tensor is used for training.

Linux only (``/proc/self/fd``); elsewhere :func:`available` is false and the reader copies.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from syncpoint.policies.contracts.errors import OversizedEntry, StateRefused, UnsafeEntry
from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import new_hasher
from syncpoint.workers.storage.nofollow import open_dirs, open_regular, read_fd
from syncpoint.workers.storage.protocol import CHUNK

Identity = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns


def available() -> bool:
    """Whether this system can hand an open descriptor to a loader by path (``/proc/self/fd``)."""
    return hasattr(os, "O_NOFOLLOW") and os.path.isdir("/proc/self/fd")


class ChecksumMismatch(StateRefused):
    """A file's bytes differ from its manifest entry (size or checksum)."""


@dataclass
class VerifiedFile:
    """One file of a state, open and verified; loaders read it by :attr:`path`."""

    rel: str
    fd: int
    signature: Identity  # device, inode, size, mtime_ns, ctime_ns when verified

    @property
    def path(self) -> str:
        """A path that opens this descriptor's file (never the name in the state directory)."""
        return f"/proc/self/fd/{self.fd}"

    def unchanged(self) -> None:
        """Refuse (``StateRefused``) when the file was written since it was verified."""
        if identity(os.fstat(self.fd)) != self.signature:
            raise StateRefused(
                f"{self.rel} changed while it was being loaded (written after its checksum was verified): refused"
            )

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_verified(root_fd: int, rel: str, entry: ManifestEntry, known: Identity | None = None) -> VerifiedFile:
    """Open ``rel`` below the state directory ``root_fd`` without following links, then verify its
    size and checksum in one sequential read. Raises ``StateRefused`` (``ChecksumMismatch`` for
    changed bytes); ``OSError`` is the disk, not the state.

    ``known``: the identity another rank of this node had for this file when its checksum matched
    (``syncpoint.workers.state.node_share``); a descriptor with exactly that identity is taken
    without reading it again, as :meth:`VerifiedFile.unchanged` takes a file unchanged since its
    own checksum."""
    fd = _open_below(root_fd, rel)
    try:
        st = os.fstat(fd)
        if known is not None and identity(st) == known and st.st_size == entry.size:
            return VerifiedFile(rel, fd, known)
        if st.st_size != entry.size:
            raise ChecksumMismatch(
                f"{rel} is {st.st_size} bytes, the manifest says {entry.size} (changed after commit)"
            )
        size, digest = checksum_fd(fd, entry.algorithm, entry.size)
        if size != entry.size or digest != entry.digest:
            raise ChecksumMismatch(
                f"{rel}: {entry.algorithm} does not match the manifest (content changed after commit)"
            )
        return VerifiedFile(rel, fd, identity(st))
    except BaseException:
        os.close(fd)
        raise


def read_verified(root_fd: int, rel: str, entry: ManifestEntry) -> bytes:
    """A small file read whole into memory, opened and checked as :func:`open_verified` does."""
    fd = _open_below(root_fd, rel)
    try:
        data = read_fd(fd, entry.size, rel)
    except OversizedEntry:
        raise ChecksumMismatch(
            f"{rel} is larger than the {entry.size} bytes the manifest says (changed after commit)"
        ) from None
    finally:
        os.close(fd)
    h = new_hasher(entry.algorithm)
    h.update(data)
    if len(data) != entry.size or h.hexdigest() != entry.digest:
        raise ChecksumMismatch(f"{rel}: {entry.algorithm} does not match the manifest")
    return data


def checksum_fd(fd: int, algo: str, size_limit: int | None = None) -> tuple[int, str]:
    """(size, checksum) of an open file from its start, read in ``CHUNK`` pieces into one reused
    buffer; with ``size_limit``, no more than one byte past it is read (a larger size tells)."""
    h, size, offset = new_hasher(algo), 0, 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    stop = None if size_limit is None else size_limit + 1
    while True:
        want = CHUNK if stop is None else min(CHUNK, stop - offset)
        n = os.preadv(fd, [view[:want]], offset) if want > 0 else 0
        if not n:
            break
        h.update(view[:n])
        size += n
        offset += n
    return size, h.hexdigest()


def read_ahead(root_fd: int, rel: str, start: int, end: int) -> None:
    """Read bytes ``[start, end)`` of ``rel`` (opened as :func:`open_verified` opens it) into one
    reused buffer and drop them: only the page cache keeps them, for the rank of this node that
    checksums the file (``syncpoint.workers.state.node_share``). Nothing read here is trusted or
    kept; never past ``end`` (the manifest's size bounds it) nor the file's end."""
    fd = _open_below(root_fd, rel)
    try:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        offset = start
        while offset < end:
            n = os.preadv(fd, [view[: min(CHUNK, end - offset)]], offset)
            if not n:
                break
            offset += n
    finally:
        os.close(fd)


def _open_below(root_fd: int, rel: str) -> int:
    """Each directory of ``rel`` and then the file, relative to the one before, none through a link;
    only a regular file (``syncpoint.workers.storage.nofollow``)."""
    parts = rel.split("/")
    try:
        dir_fd = open_dirs(root_fd, parts[:-1])
    except OSError as e:  # UnsafeEntry too
        raise _refusal(rel, e) from None
    try:
        return open_regular(dir_fd, parts[-1], rel)
    except OSError as e:  # UnsafeEntry too
        raise _refusal(rel, e) from None
    finally:
        os.close(dir_fd)


def _refusal(rel: str, e: OSError) -> BaseException:
    if isinstance(e, UnsafeEntry):
        return StateRefused(f"{e}; a state never contains one: refused (corrupt)")
    if e.errno == errno.ENOENT:
        return StateRefused(f"{rel}: missing from storage, though the manifest lists it: refused (corrupt)")
    return e


def identity(st: os.stat_result) -> Identity:
    """What says a file is the one verified: its inode, size, and its modification and change times
    (a writer cannot set the change time back)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
