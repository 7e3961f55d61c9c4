"""The storage protocol: every byte syncpoint persists goes through this one fsspec wrapper.

Why: the run must work on any fsspec URL (local path, ``file://``, ``memory://``, ``s3://``) and
without a shared filesystem, and commit semantics differ by backend. On a local filesystem a
file is durable after ``fsync`` and the manifest is committed by an atomic rename; on an object
store a completed single PUT is durable and atomic, and there is no rename. Discovery and
policies never see which backend is underneath.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any, Iterator

import fsspec
from fsspec.implementations.local import LocalFileSystem

from workers.checksum import DEFAULT, ChecksummingWriter, new_hasher
from workers.direct_io import DirectFileWriter

CHUNK = 8 << 20

# memory:// lives in this process: one lock serialises its compare-and-swap writes, and this
# process's monotonic clock is the store's own clock (path -> when the file was last written).
_MEMORY_LOCK = threading.Lock()
_MEMORY_STAMPS: dict[str, tuple[str, float]] = {}  # path -> (version, monotonic time it was written)


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

    # ---- compare-and-swap of small control files (the lease)
    @property
    def conditional_writes(self) -> str:
        """How ``write_if`` is made atomic on this store (README: *One writer per run directory*)."""
        if self.local:
            return "flock"  # an exclusive lock file serialises read-compare-rename
        if _is_s3(self.fs):
            return "s3"  # If-None-Match: * to create, If-Match: <etag> to replace
        if _is_memory(self.fs):
            return "process-lock"
        return "none"  # write, then read back: best effort

    def read_versioned(self, *parts: str) -> Versioned | None:
        """A small file with its version and storage-clock age (``None`` if it does not exist)."""
        p = self.path(*parts)
        if self.local:
            with _local_lock(p) as now:
                return _local_read(p, now)
        if _is_s3(self.fs):
            return _s3_read(self.fs, p)
        if _is_memory(self.fs):
            with _MEMORY_LOCK:
                return _memory_read(self.fs, p)
        return _plain_read(self.fs, p)

    def write_if(self, data: bytes, *parts: str, expect: str | None) -> str | None:
        """Write ``data`` only if the file is still at version ``expect`` (``None``: only if it does
        not exist); returns the new version, or ``None`` when someone else changed it first.

        Why a compare-and-swap: two drivers that both read "free" (or "expired") must not both
        win. S3 checks the precondition on the server; a local filesystem compares under an
        exclusive ``flock`` and lands the bytes by rename; memory:// under a process lock. Other
        stores fall back to write-then-read-back, which narrows the race but cannot close it.
        """
        p = self.path(*parts)
        if self.local:
            with _local_lock(p):
                return _local_write_if(p, data, expect)
        if _is_s3(self.fs):
            return _s3_write_if(self.fs, p, data, expect)
        if _is_memory(self.fs):
            with _MEMORY_LOCK:
                return _memory_write_if(self.fs, p, data, expect)
        return _plain_write_if(self.fs, p, data, expect)

    # ---- deletion (retention) and what a listing says about each entry
    def entry_kinds(self, *parts: str) -> dict[str, str]:
        """Each entry of a directory as ``dir``, ``file``, ``link`` or ``other``, never following a
        link: retention must know that ``states/x`` is a link before it deletes anything in it."""
        p = self.path(*parts)
        if self.local:
            try:
                with os.scandir(p) as it:
                    return {e.name: _scandir_kind(e) for e in it}
            except (FileNotFoundError, NotADirectoryError):
                return {}
        _, entries = self._entries(parts, detail=True)
        kinds = {"directory": "dir", "file": "file"}
        return {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: kinds.get(e.get("type"), "other")
                for e in entries if str(e["name"]).rstrip("/") != p.rstrip("/")}

    def is_link(self, *parts: str) -> bool:
        """Whether the entry itself is a symbolic link (only local filesystems have them)."""
        return self.local and os.path.islink(self.path(*parts))

    def remove(self, *parts: str) -> None:
        """Delete one file (never a directory; a missing file is fine).

        Locally the parent directory is opened with ``O_NOFOLLOW`` and the name unlinked relative to
        it, so a parent that is (or was just swapped for) a symbolic link is refused rather than
        followed: deleting ``states/<link>/manifest.json`` would delete a file outside the run.
        """
        p = self.path(*parts)
        if not self.local:
            try:
                self.fs.rm_file(p)
            except FileNotFoundError:
                pass
            return
        parent, name = os.path.split(p)
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

    def delete_tree(self, *parts: str) -> None:
        p = self.path(*parts)
        if self.is_link(*parts):
            raise OSError(f"refusing to delete through a symbolic link: {p}")
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


# ---- the compare-and-swap backends behind RunStorage.read_versioned / write_if


def _content_version(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def _scandir_kind(e: os.DirEntry) -> str:
    if e.is_symlink():
        return "link"
    if e.is_dir(follow_symlinks=False):
        return "dir"
    return "file" if e.is_file(follow_symlinks=False) else "other"


def _is_s3(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


def _is_memory(fs: Any) -> bool:
    from fsspec.implementations.memory import MemoryFileSystem

    return isinstance(fs, MemoryFileSystem)  # subclasses too: their store lives in this process


@contextlib.contextmanager
def _local_lock(path: str) -> Iterator[float]:
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


def _local_read(path: str, now: float) -> Versioned | None:
    try:
        with open(path, "rb") as f:
            mtime = os.fstat(f.fileno()).st_mtime
            data = f.read()
    except FileNotFoundError:
        return None
    return Versioned(data, _content_version(data), max(0.0, now - mtime))


def _local_write_if(path: str, data: bytes, expect: str | None) -> str | None:
    try:
        with open(path, "rb") as f:
            current: str | None = _content_version(f.read())
    except FileNotFoundError:
        current = None
    if current != expect:
        return None
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path))
    return _content_version(data)


def _s3_error_code(e: BaseException) -> tuple[str, int]:
    """(S3 error code, HTTP status) of a botocore error, wherever s3fs wrapped it."""
    seen: BaseException | None = e
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            return (str(response.get("Error", {}).get("Code", "")),
                    int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0))
        seen = seen.__cause__ or seen.__context__
    return "", 0


def _s3_precondition_failed(e: BaseException) -> bool:
    code, status = _s3_error_code(e)
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


def _s3_read(fs: Any, path: str) -> Versioned | None:
    """One GET: the body, its ETag, and its age as the server's Date minus its LastModified."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[bytes, dict]:
        resp = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        body = resp["Body"]
        try:
            return await body.read(), resp
        finally:
            body.close()

    try:
        data, resp = sync(fs.loop, get)
    except FileNotFoundError:
        return None
    date = resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    modified = resp.get("LastModified")
    age = None
    if date and modified is not None:
        age = max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
    return Versioned(data, str(resp["ETag"]), age)


def _s3_write_if(fs: Any, path: str, data: bytes, expect: str | None) -> str | None:
    bucket, key, _ = fs.split_path(path)
    condition = {"IfNoneMatch": "*"} if expect is None else {"IfMatch": expect}
    try:
        out = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except (OSError, FileExistsError) as e:
        if isinstance(e, FileExistsError) or _s3_precondition_failed(e):
            return None
        raise
    finally:
        fs.invalidate_cache(path)
    return str(out["ETag"])


def _memory_read(fs: Any, path: str) -> Versioned | None:
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    version, now = _content_version(data), time.monotonic()
    stamp = _MEMORY_STAMPS.get(path)
    if stamp is None or stamp[0] != version:  # written behind write_if's back: its age counts from now
        stamp = _MEMORY_STAMPS[path] = (version, now)
    return Versioned(data, version, now - stamp[1])


def _memory_write_if(fs: Any, path: str, data: bytes, expect: str | None) -> str | None:
    try:
        current: str | None = _content_version(fs.cat_file(path))
    except FileNotFoundError:
        current = None
    if current != expect:
        return None
    fs.pipe_file(path, data)
    version = _content_version(data)
    _MEMORY_STAMPS[path] = (version, time.monotonic())
    return version


def _plain_read(fs: Any, path: str) -> Versioned | None:
    fs.invalidate_cache(path)
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    return Versioned(data, _content_version(data), None)


def _plain_write_if(fs: Any, path: str, data: bytes, expect: str | None) -> str | None:
    """No conditional writes: compare, write, let a racing writer land, read back."""
    before = _plain_read(fs, path)
    if (before.version if before else None) != expect:
        return None
    fs.pipe_file(path, data)
    time.sleep(0.2)
    after = _plain_read(fs, path)
    return after.version if after is not None and after.data == data else None
