"""What a storage backend must do for syncpoint: a small core, and capabilities a backend declares.

Why protocols: commit semantics differ by backend (a local file is durable after ``fsync`` and a
manifest commits by an atomic rename; on an object store a completed single PUT is durable and
atomic, and there is no rename), and so does how a compare-and-swap is made atomic. Each backend
states those differences once and subclasses the protocols it implements, so mypy checks it:
``StorageCore`` (read, write, list, stat, delete), ``Transfers`` (big files, streamed),
``ConditionalWriter`` (the lease's compare-and-swap, its strength a ``ConditionalWrites``), and
``LocalFiles`` (local paths, descriptors and links: the local backend only). ``RunStorage`` joins
paths, encodes JSON and derives the rest, so discovery, saving, the lease and retention never see
which backend is underneath. Paths are the backend's own (the run root joined with ``/``), never URLs.

Storage may be hostile (docs/security.md, *Storage that others can write*), so every read takes a bound
(``limit``: the most bytes the file may hold; a larger one raises
``syncpoint.policies.contracts.errors.OversizedEntry``)
derived by the caller from what the file is (a manifest's size for a file it lists, a cap for a
record), and a listing reports what is not a regular file instead of following it. Stores with
links (local filesystems) never read or write through one (``syncpoint.workers.storage.nofollow``).
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, runtime_checkable

from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import ChecksummingWriter

CHUNK = 8 << 20  # the copy size of uploads, downloads and checksums of whole files


@dataclass(frozen=True)
class Versioned:
    """One read of a small control file (the run's lease).

    ``version`` is opaque and only means something to ``write_if`` (an ETag on S3, a content hash
    elsewhere); ``age_s`` is how long ago the file was last written, by the *storage's* clock
    (file mtime against a freshly touched file, object LastModified against the response's Date),
    so a reader whose own clock is wrong cannot misjudge it. ``None`` where the store cannot tell:
    the caller must then watch the version for a while instead.
    """

    data: bytes
    version: str
    age_s: float | None


@dataclass(frozen=True)
class Listing:
    """Every entry below a directory, from one listing, nothing read and no link followed.

    ``files``: the regular files, relative path -> size. ``unsafe``: anything else that is no
    directory (a symbolic link, a FIFO, a device), relative path -> what it is in words; a linked
    directory is reported here and never descended into (only local filesystems have these)."""

    files: dict[str, int]
    unsafe: dict[str, str]


class ConditionalWrites(StrEnum):
    """How a backend makes ``write_if`` atomic: a capability it declares, which the lease's docs and
    checks read (docs/reference/state-format.md, *Lease: one writer per run directory*)."""

    FLOCK = "flock"  # an exclusive lock file serialises read, compare and rename (local filesystems)
    S3 = "s3"  # the server checks the ETag (If-Match / If-None-Match on PUT)
    PROCESS_LOCK = "process-lock"  # one process's lock: only writers of this process exclude each other
    NONE = "none"  # no atomic compare: write, then read back to find out who won


def content_version(data: bytes) -> str:
    """The version of a file on stores without ETags: equal bytes are the same version."""
    return hashlib.sha256(data).hexdigest()[:32]


class StorageCore(Protocol):
    """What every backend implements (read, write, list, stat, delete), on backend paths.

    Why so few: everything else is either derived from these once (``RunStorage`` lists names,
    directories and files from ``entry_kinds``) or a capability below that a backend declares.
    """

    def read_bytes(self, path: str, limit: int) -> bytes:
        """A regular file's bytes, never through a link; ``OversizedEntry`` beyond ``limit`` bytes
        (refused after reading at most one byte more: storage may be hostile)."""
        ...

    def write_bytes(self, data: bytes, path: str) -> None:
        """Write a whole file durably (fsync where the store has one); never through a link."""
        ...

    def commit_bytes(self, data: bytes, path: str) -> None:
        """Write a file that commits something (a manifest): atomically, so a reader sees all of it
        or none (a temp name and a rename locally, a single PUT on object stores)."""
        ...

    def entry_kinds(self, path: str) -> dict[str, str]:
        """Each entry of ``path`` (fresh: other writers add states and events): ``dir``, ``file``,
        ``link`` or ``other``, without following links; empty when it does not exist."""
        ...

    def listing(self, path: str) -> Listing:
        """Every regular file under ``path`` with its size, and what is neither file nor directory
        (links, FIFOs) named apart: selection reads sizes from this, never by opening a file."""
        ...

    def exists(self, path: str) -> bool: ...
    def remove(self, path: str) -> None: ...
    def delete_tree(self, path: str) -> None: ...
    def rename_tree(self, src: str, dst: str) -> None: ...


class Transfers(Protocol):
    """Big files, streamed: every backend has them, ``FsspecBackend``'s generic ones for any fsspec
    store, and the local and S3 backends their own faster ones (O_DIRECT; parallel parts)."""

    def open_durable(self, path: str, algo: str) -> contextlib.AbstractContextManager[ChecksummingWriter]:
        """A writer that streams into ``path`` and checksums (``algo``) exactly the bytes written."""
        ...

    def upload_file(self, local_path: str, path: str, algo: str, known: ManifestEntry | None) -> tuple[int, str]:
        """Copy a staged local file up; (size, checksum), the checksum ``known`` from staging or
        computed from the local bytes."""
        ...

    def download_file(self, local_path: str, path: str, algo: str, limit: int) -> tuple[int, str]:
        """Copy at most ``limit`` bytes down (``OversizedEntry`` beyond); (size, checksum of the
        bytes as they landed locally)."""
        ...

    def download_range(self, local_path: str, path: str, start: int, end: int, limit: int, at: int) -> None:
        """Copy bytes ``[start, end)`` of a stored file of at most ``limit`` bytes (``OversizedEntry``
        beyond; ``UnsafeEntry`` when it is shorter than ``end``) into ``local_path`` at offset ``at``
        (created when missing, never truncated). No checksum: a range is verified with its whole file."""
        ...


class ConditionalWriter(Protocol):
    """The compare-and-swap of small control files (the lease), declared with how strong it is:
    ``conditional_writes`` (``NONE``: write, then read back, which narrows a race but cannot close it)."""

    conditional_writes: ConditionalWrites

    def read_versioned(self, path: str, limit: int) -> Versioned | None:
        """The file's bytes and version (an ETag, or a digest of the bytes) and, where the store
        dates it by its own clock, its age; ``None`` when it does not exist."""
        ...

    def write_if(self, data: bytes, path: str, expect: str | None, limit: int) -> str | None:
        """Write only if the file is still at version ``expect`` (``None``: absent); the new
        version, or ``None`` when another writer got there first (``conditional_writes`` says how)."""
        ...


class Backend(StorageCore, Transfers, ConditionalWriter, Protocol):
    """What ``RunStorage`` needs of a backend: the core, its transfers and its conditional writes."""


@runtime_checkable
class LocalFiles(Protocol):
    """Only a store on this machine's filesystem has these: ``RunStorage`` answers ``None`` (no local
    path or descriptor) and "not a link" for every other store, which has no links."""

    def local_path(self, path: str) -> str:
        """The path on this machine's filesystem."""
        ...

    def open_dir(self, path: str) -> int:
        """A descriptor of a local directory reached without following links (the caller closes it)."""
        ...

    def is_link(self, path: str) -> bool:
        """Whether the entry, or a directory between the run and it, is a symbolic link."""
        ...
