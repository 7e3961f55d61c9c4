"""The storage every byte syncpoint persists goes through: one run directory on any fsspec URL.

Why a facade over backends: the run must work on any fsspec URL (local path, ``file://``,
``memory://``, ``s3://``) and without a shared filesystem, and commit semantics differ by backend.
``RunStorage`` joins path parts, encodes JSON, derives its listings of names from one
``entry_kinds`` and answers the local-only questions for stores that are not local; a backend behind
the protocols of ``syncpoint.workers.storage.protocol`` does the rest (``syncpoint.workers.storage.local_backend``:
fsync, atomic rename, flock, O_DIRECT, links; ``syncpoint.workers.storage.s3_backend``: server-checked conditional PUTs;
``syncpoint.workers.storage.fsspec_backend``: everything else). Discovery, saving, the lease and retention never see
which backend is underneath.

Storage may be hostile, so every read names its bound (``limit``, the most bytes the file may hold:
its manifest size, or the cap of its kind of record) and nothing is read or written through a link
(``syncpoint.workers.storage.nofollow``, for the local backend, anchored at this run directory).
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from syncpoint.policies.contracts.state_format import ManifestEntry
from syncpoint.workers.integrity.checksum import DEFAULT, ChecksummingWriter
from syncpoint.workers.storage.fsspec_backend import FsspecBackend, MemoryBackend
from syncpoint.workers.storage.local_backend import LocalBackend
from syncpoint.workers.storage.protocol import CHUNK, Backend, ConditionalWrites, Listing, LocalFiles, Versioned
from syncpoint.workers.storage.s3_backend import S3Backend, is_s3

__all__ = ["CHUNK", "Backend", "Listing", "RunStorage", "Versioned", "backend_for"]


def backend_for(fs: Any, root: str) -> Backend:
    """The backend for an fsspec filesystem: the one place that asks what kind of store it is.
    ``root``: the run directory, where a local backend anchors (nothing below it is reached through
    a link)."""
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(root)
    if is_s3(fs):
        return S3Backend(fs)
    if isinstance(fs, MemoryFileSystem):  # subclasses too: their store lives in this process
        return MemoryBackend(fs)
    return FsspecBackend(fs)


class RunStorage:
    """One run directory (``<storage>/<job name>``); every method takes the path below it in parts."""

    def __init__(self, run_url: str) -> None:
        self.url = run_url.rstrip("/")
        fs, root = fsspec.core.url_to_fs(self.url)
        self.root = root.rstrip("/")
        self.backend: Backend = backend_for(fs, self.root)
        # asked once (a runtime protocol check costs microseconds, and discovery asks per state)
        self.local_files: LocalFiles | None = self.backend if isinstance(self.backend, LocalFiles) else None

    # ---- paths
    def path(self, *parts: str) -> str:
        """The backend's path of an entry (a filesystem path locally, ``bucket/key`` on S3)."""
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    def local_path(self, *parts: str) -> str | None:
        """The entry's path on this machine's filesystem, ``None`` where the storage is not local."""
        return None if self.local_files is None else self.local_files.local_path(self.path(*parts))

    # ---- reads
    def exists(self, *parts: str) -> bool:
        return self.backend.exists(self.path(*parts))

    def read_bytes(self, *parts: str, limit: int) -> bytes:
        """A whole file of at most ``limit`` bytes (``OversizedEntry`` beyond); locally only a regular
        file, never through a link (``UnsafeEntry``)."""
        return self.backend.read_bytes(self.path(*parts), limit)

    def read_json(self, *parts: str, limit: int) -> Any:
        return json.loads(self.read_bytes(*parts, limit=limit))

    def list_dirs(self, *parts: str) -> list[str]:
        """Names of the sub-directories of a directory (empty if it does not exist)."""
        return sorted(n for n, k in self.entry_kinds(*parts).items() if k == "dir")

    def list_names(self, *parts: str) -> list[str]:
        """Entry names of a directory without stat-ing each one (cheap for 10^4 states)."""
        return sorted(self.entry_kinds(*parts))

    def list_files(self, *parts: str) -> list[str]:
        """Names of the regular files of a directory (never a link: it is a ``link`` entry)."""
        return sorted(n for n, k in self.entry_kinds(*parts).items() if k == "file")

    def listing(self, *parts: str) -> Listing:
        """Every file below a directory as relative path -> size (one listing call, no reads), and
        what is neither file nor directory (a link, a FIFO), reported and never followed."""
        return self.backend.listing(self.path(*parts))

    def open_local_dir(self, *parts: str) -> int | None:
        """A descriptor of the directory, reached without following links (the caller closes it);
        ``None`` where the storage is not local. ``UnsafeEntry`` for a link on the way."""
        return None if self.local_files is None else self.local_files.open_dir(self.path(*parts))

    # ---- durable writes
    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole file durably (fsync locally, one PUT on object stores)."""
        self.backend.write_bytes(data, self.path(*parts))

    def write_json(self, obj: Any, *parts: str) -> bytes:
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        self.write_bytes(data, *parts)
        return data

    def commit_bytes(self, data: bytes, *parts: str) -> None:
        """Atomically publish a file: temp name + fsync + rename locally, a single PUT elsewhere.

        This is how a manifest commits a state: readers either see the whole file or none.
        """
        self.backend.commit_bytes(data, self.path(*parts))

    def open_durable(self, *parts: str, algo: str = DEFAULT) -> contextlib.AbstractContextManager[ChecksummingWriter]:
        """A file written in one pass: checksummed on the way, durable when the block exits
        (fsync locally; the upload completes on close on object stores). On an error the partial
        file is left (locally) or discarded (object stores): without a manifest it is torn anyway."""
        return self.backend.open_durable(self.path(*parts), algo)

    def upload_file(
        self, local_path: str, *parts: str, algo: str = DEFAULT, known: ManifestEntry | None = None
    ) -> tuple[int, str]:
        """Copy a local file into storage durably; returns (size, checksum).

        ``known``: the file's manifest entry when it was checksummed as it was written (a staged
        snapshot); no checksum is computed again.
        """
        return self.backend.upload_file(local_path, self.path(*parts), algo, known)

    def download_file(self, local_path: str, *parts: str, limit: int, algo: str = DEFAULT) -> tuple[int, str]:
        """Copy a stored file of at most ``limit`` bytes to local disk (``OversizedEntry`` beyond, having
        copied one byte more); returns (size, checksum) for verification."""
        return self.backend.download_file(local_path, self.path(*parts), algo, limit)

    def download_range(self, local_path: str, *parts: str, start: int, end: int, limit: int, at: int = 0) -> None:
        """Copy bytes ``[start, end)`` of a stored file of at most ``limit`` bytes into ``local_path`` at
        offset ``at``: a node's ranks download a shared file's ranges side by side
        (``syncpoint.workers.state.node_share``); the whole file's checksum then decides."""
        self.backend.download_range(local_path, self.path(*parts), start, end, limit, at)

    # ---- compare-and-swap of small control files (the lease)
    @property
    def conditional_writes(self) -> ConditionalWrites:
        """How ``write_if`` is made atomic on this store (docs/reference/state-format.md, *Lease: one writer
        per run directory*): ``flock``, ``s3``, ``process-lock`` or ``none``."""
        return self.backend.conditional_writes

    def read_versioned(self, *parts: str, limit: int) -> Versioned | None:
        """A small file (at most ``limit`` bytes) with its version and storage-clock age (``None`` if it
        does not exist)."""
        return self.backend.read_versioned(self.path(*parts), limit)

    def write_if(self, data: bytes, *parts: str, expect: str | None, limit: int) -> str | None:
        """Write ``data`` only if the file is still at version ``expect`` (``None``: only if it does
        not exist); returns the new version, or ``None`` when someone else changed it first.

        Why a compare-and-swap: two drivers that both read "free" (or "expired") must not both
        win. S3 checks the precondition on the server; a local filesystem compares under an
        exclusive ``flock`` and lands the bytes by rename; memory:// under a process lock. Other
        stores fall back to write-then-read-back, which narrows the race but cannot close it.
        ``limit``: the bound of the current file's read (as in ``read_versioned``).
        """
        return self.backend.write_if(data, self.path(*parts), expect, limit)

    # ---- deletion (retention) and what a listing says about each entry
    def entry_kinds(self, *parts: str) -> dict[str, str]:
        """Each entry of a directory as ``dir``, ``file``, ``link`` or ``other``, never following a
        link: retention must know that ``states/x`` is a link before it deletes anything in it."""
        return self.backend.entry_kinds(self.path(*parts))

    def is_link(self, *parts: str) -> bool:
        """Whether the entry itself is a symbolic link (only local filesystems have them)."""
        return self.local_files is not None and self.local_files.is_link(self.path(*parts))

    def remove(self, *parts: str) -> None:
        """Delete one file (never a directory; a missing file is fine), never through a link."""
        self.backend.remove(self.path(*parts))

    def delete_tree(self, *parts: str) -> None:
        """Delete a directory and everything in it; refused (``OSError``) for a symbolic link."""
        self.backend.delete_tree(self.path(*parts))

    def rename_tree(self, src: tuple[str, ...], dst: tuple[str, ...]) -> None:
        self.backend.rename_tree(self.path(*src), self.path(*dst))
