"""The storage protocol: every byte syncpoint persists goes through this one fsspec wrapper.

Why: the run must work on any fsspec URL (local path, ``file://``, ``memory://``, ``s3://``) and
without a shared filesystem, and commit semantics differ by backend. On a local filesystem a
file is durable after ``fsync`` and the manifest is committed by an atomic rename; on an object
store a completed single PUT is durable and atomic, and there is no rename. Discovery and
policies never see which backend is underneath.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from workers.checksum import DEFAULT, ChecksummingWriter, new_hasher
from workers.direct_io import DirectFileWriter

CHUNK = 8 << 20


class RunStorage:
    """One run directory (``<storage>/<job name>``) on any fsspec filesystem."""

    def __init__(self, run_url: str) -> None:
        self.url = run_url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.root = self.root.rstrip("/")
        self.local = isinstance(self.fs, LocalFileSystem)

    # ---- paths
    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p.strip("/") for p in parts if p]])

    def url_of(self, *parts: str) -> str:
        return "/".join([self.url, *[p.strip("/") for p in parts if p]])

    # ---- reads
    def exists(self, *parts: str) -> bool:
        p = self.path(*parts)
        self.fs.invalidate_cache(p)
        return self.fs.exists(p)

    def read_bytes(self, *parts: str) -> bytes:
        return self.fs.cat_file(self.path(*parts))

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def _entries(self, parts: tuple[str, ...], detail: bool) -> tuple[str, list]:
        """One fresh listing of a directory: object-store listings are cached per process, and other
        writers (ranks, drivers) add states and events."""
        p = self.path(*parts)
        self.fs.invalidate_cache(p)
        try:
            return p, self.fs.ls(p, detail=detail)
        except FileNotFoundError:
            return p, []

    def list_dirs(self, *parts: str) -> list[str]:
        """Names of the sub-directories of a directory (empty if it does not exist)."""
        _, entries = self._entries(parts, detail=True)
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e.get("type") == "directory")

    def list_names(self, *parts: str) -> list[str]:
        """Entry names of a directory without stat-ing each one (cheap for 10^4 states)."""
        p, entries = self._entries(parts, detail=False)
        return sorted(str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries if str(e).rstrip("/") != p.rstrip("/"))

    def list_files(self, *parts: str) -> list[str]:
        _, entries = self._entries(parts, detail=True)
        return sorted(e["name"].rsplit("/", 1)[-1] for e in entries if e.get("type") == "file")

    def listing(self, *parts: str) -> dict[str, int]:
        """Every file below a directory as relative path -> size (one listing call, no reads)."""
        base = self.path(*parts)
        self.fs.invalidate_cache(base)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for name, info in found.items():
            out[name[len(base):].lstrip("/")] = int(info.get("size") or 0)
        return out

    # ---- durable writes
    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole file durably (fsync locally, one PUT on object stores)."""
        p = self.path(*parts)
        if self.local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.pipe_file(p, data)

    def write_json(self, obj: Any, *parts: str) -> bytes:
        data = json.dumps(obj, indent=1, sort_keys=True).encode()
        self.write_bytes(data, *parts)
        return data

    def commit_bytes(self, data: bytes, *parts: str) -> None:
        """Atomically publish a file: temp name + fsync + rename locally, a single PUT elsewhere.

        This is how a manifest commits a state: readers either see the whole file or none.
        """
        p = self.path(*parts)
        if self.local:
            d = os.path.dirname(p)
            os.makedirs(d, exist_ok=True)
            tmp = p + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, p)
            _fsync_path(d)  # the rename itself is durable
        else:
            self.fs.pipe_file(p, data)

    @contextlib.contextmanager
    def open_durable(self, *parts: str, algo: str = DEFAULT) -> Iterator[ChecksummingWriter]:
        """A file written in one pass: checksummed on the way, durable when the block exits
        (fsync locally; the upload completes on close on object stores). On an error the partial
        file is left (locally) or discarded (object stores): without a manifest it is torn anyway."""
        p = self.path(*parts)
        if self.local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with DirectFileWriter(p) as f:  # page-cache bypass, fsync on a clean exit
                yield ChecksummingWriter(f, algo)
            return
        f = self.fs.open(p, "wb")
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

    def upload_file(self, local_path: str, *parts: str, algo: str = DEFAULT,
                    known: dict[str, Any] | None = None) -> tuple[int, str]:
        """Copy a local file into storage durably; returns (size, checksum).

        ``known``: the file's manifest entry when it was checksummed as it was written (a staged
        snapshot); no checksum is computed again. Locally the file is read straight into the
        page-aligned buffers of a ``DirectFileWriter`` (checksummed there when not known) and
        written with O_DIRECT while the next buffer fills; elsewhere a second thread checksums
        while fsspec uploads (hashlib and xxhash release the GIL).
        """
        p = self.path(*parts)
        if self.local:
            os.makedirs(os.path.dirname(p), exist_ok=True)
            hasher = new_hasher(algo) if known is None else None
            with open(local_path, "rb", buffering=0) as src, DirectFileWriter(p) as dst:
                size = dst.fill_from(src, hasher.update if hasher else None)
            return (size, hasher.hexdigest()) if hasher else (int(known["size"]), str(known[algo]))  # type: ignore[index]
        with ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(_checksum_file, local_path, algo) if known is None else None
            with open(local_path, "rb") as src, self.fs.open(p, "wb") as dst:
                shutil.copyfileobj(src, dst, CHUNK)
            if digest is None:
                return int(known["size"]), str(known[algo])  # type: ignore[index]
            return digest.result()

    def download_file(self, local_path: str, *parts: str, algo: str = DEFAULT) -> tuple[int, str]:
        """Copy a stored file to local disk; returns (size, checksum) for verification."""
        h = new_hasher(algo)
        size = 0
        os.makedirs(os.path.dirname(local_path), exist_ok=True)
        with self.fs.open(self.path(*parts), "rb") as src, open(local_path, "wb") as dst:
            while chunk := src.read(CHUNK):
                h.update(chunk)
                dst.write(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    def delete_tree(self, *parts: str) -> None:
        p = self.path(*parts)
        try:
            self.fs.rm(p, recursive=True)
        except FileNotFoundError:
            pass

    def rename_tree(self, src: tuple[str, ...], dst: tuple[str, ...]) -> None:
        self.fs.mv(self.path(*src), self.path(*dst), recursive=True)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _checksum_file(path: str, algo: str) -> tuple[int, str]:
    h, size = new_hasher(algo), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
