"""A sharded corpus's index: its shards listed, stamped, checksummed and counted once per node, and cached.

Why an index: skipping to a position is arithmetic on the shards' row counts, so they are known
without reading the corpus each attempt; each attempt re-lists the shards and re-reads only those whose
size or stamp changed. Its cache lives under this user's private directory, checked before use, and a
copy in the run directory serves a node that joins later.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import stat
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict

from fsspec.implementations.local import LocalFileSystem

from syncpoint.policies.contracts.corpus_identity import (
    CORPUS_DIR,
    MAX_SHARDS,
)
from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError
from syncpoint.workers.data.shard_cache import (
    RemoteShard,
    fd_path,
    locked,
    open_private_dir,
    private_subdir,
)
from syncpoint.workers.data.shard_formats import ShardParams, count_rows
from syncpoint.workers.storage import RunStorage, backend_for, nofollow
from syncpoint.workers.storage.fsspec_backend import checksum_file

INDEX_CACHE_VERSION = 1

if TYPE_CHECKING:  # the corpus module, which builds its index here, holds the settings
    from syncpoint.workers.data.corpus import CacheSettings

_HEX32 = re.compile(r"[0-9a-f]{32}")  # an xxh3_128 checksum


INDEX_CACHE_MAX_BYTES = 256 << 20


@dataclass(frozen=True)
class Shard:
    """One shard of the index: where it is, how to tell it changed, and what it holds."""

    name: str  # its path below the corpus root: the identity's name (location-independent)
    path: str  # the filesystem's path (``bucket/key`` on S3)
    size: int
    stamp: str  # the storage's version stamp (ETag, mtime and inode): the index cache's validity
    checksum: str  # xxh3_128 of its bytes
    rows: int

    def remote(self) -> RemoteShard:
        return RemoteShard(self.name, self.path, self.size, self.checksum)


def _has_magic(path: str) -> bool:
    return any(ch in path for ch in "*?[")


StampKey = Literal["ETag", "VersionId", "etag", "generation", "md5", "mtime", "created", "LastModified"]


class FileInfo(TypedDict, total=False):
    """fsspec's details of one file, as far as they are read here: which backend reports which
    stamp key (and of what type) varies, so each is only shown as text."""

    name: str
    size: int | None
    type: str
    ETag: object
    VersionId: object
    etag: object
    generation: object
    md5: object
    mtime: object
    created: object
    LastModified: object


def _stamp(fs: Any, path: str, info: FileInfo) -> str:
    """What changes when a file is rewritten: inode and mtime locally, the ETag (and version) on
    object stores, whatever the filesystem reports elsewhere."""
    if isinstance(fs, LocalFileSystem):
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CorpusError(f"corpus shard {path} is not a regular file: a corpus is read from regular files only")
        return f"{st.st_ino}:{st.st_mtime_ns}"
    keys: tuple[StampKey, ...] = ("ETag", "VersionId", "etag", "generation", "md5", "mtime", "created", "LastModified")
    return json.dumps({k: str(info[k]) for k in keys if info.get(k) is not None}, sort_keys=True)


def _listed(fs: Any, patterns: Sequence[str]) -> list[tuple[str, FileInfo]]:
    """(path, info) of every shard, in order: each glob's matches sorted, explicit paths as given;
    explicit paths of one directory share one listing (a HEAD per object is slow on S3)."""
    with contextlib.suppress(Exception):
        fs.invalidate_cache()  # a listing cached by an earlier attempt in this process may be stale
    out: list[tuple[str, FileInfo]] = []
    listings: dict[str, dict[str, FileInfo]] = {}
    for pattern in patterns:
        path = fs._strip_protocol(pattern)
        if _has_magic(path):
            matches = fs.glob(path, detail=True)
            files = sorted((p, i) for p, i in matches.items() if i.get("type") != "directory")
            if not files:
                raise CorpusError(f"corpus shards: nothing matches {pattern!r}; check the URL and the glob")
            out += files
            continue
        parent = posixpath.dirname(path)
        if parent not in listings:
            try:
                listings[parent] = {e["name"].rstrip("/"): e for e in fs.ls(parent, detail=True)}
            except (FileNotFoundError, NotADirectoryError):
                listings[parent] = {}
        info = listings[parent].get(path.rstrip("/"))
        if info is None or info.get("type") == "directory":
            raise CorpusError(f"corpus shard {pattern!r} does not exist (or is a directory); check the URL")
        out.append((path, info))
    paths = [p for p, _ in out]
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise CorpusError(f"corpus shard {dup!r} is listed twice; each shard may appear once")
    if len(out) > MAX_SHARDS:
        raise CorpusError(
            f"the corpus has {len(out)} shards, more than the {MAX_SHARDS} syncpoint indexes; merge shards"
        )
    return out


def _names(paths: Sequence[str]) -> list[str]:
    """Each path below the shards' common directory."""
    root = posixpath.dirname(paths[0]) if len(paths) == 1 else posixpath.commonpath(list(paths))
    if len(paths) > 1 and root in paths:
        root = posixpath.dirname(root)
    return [posixpath.relpath(p, root) if root else p for p in paths]


def verify_in_place(fs: Any, shard: Shard) -> None:
    """A local shard must still be the bytes the index names: its stamp, else its checksum."""
    if _stamp(fs, shard.path, {}) == shard.stamp:
        return
    size, checksum = checksum_file(shard.path, "xxh3_128")
    if (size, checksum) != (shard.size, shard.checksum):
        raise CorpusChanged(
            f"shard {shard.name} changed since the corpus index was built: {size} bytes with xxh3_128 {checksum} now, "
            f"{shard.size} bytes with {shard.checksum} then. A corpus must not change while a run reads it; restore "
            "the shard, or start a new run on the new corpus (another name, or resume.policy: fresh)"
        )


def index_key(fs: Any, patterns: Sequence[str], params: ShardParams) -> str:
    """Names a corpus's cached index: its filesystem, shard patterns and parameters."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return hashlib.sha256(json.dumps([protocol, list(patterns), params], sort_keys=True).encode()).hexdigest()[:24]


def listing_file(key: str) -> str:
    """The run directory's copy of a corpus's index (under ``corpus/``), with paths and stamps: a
    node that joins later (a replacement, an elastic one) reads it instead of the whole corpus."""
    return f"listing-{key}.json"


def _cache_checksum(body: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def listing_bytes(params: ShardParams, shards: Sequence[Shard]) -> bytes:
    """A corpus index's cached form, with a checksum over its content (a damaged copy is rebuilt)."""
    body = {"version": INDEX_CACHE_VERSION, "params": params, "shards": [asdict(s) for s in shards]}
    return json.dumps({**body, "checksum": _cache_checksum(body)}, sort_keys=True).encode()


def _parse_listing(data: bytes, params: ShardParams) -> dict[str, Shard]:
    """A cached index by path, or nothing when it is torn, fails its checksum or is another corpus's.
    A wrong entry that passes (written on purpose) cannot pass unseen: every fetch checks size and
    checksum, every open the rows."""
    try:
        raw = json.loads(data)
        body = {k: raw[k] for k in ("version", "params", "shards")}
        if (
            raw.get("checksum") != _cache_checksum(body)
            or body["version"] != INDEX_CACHE_VERSION
            or body["params"] != params
        ):
            return {}
        shards = [Shard(**s) for s in body["shards"]]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for s in shards for v in (s.size, s.rows)):
            return {}
        if not all(isinstance(s.checksum, str) and _HEX32.fullmatch(s.checksum) for s in shards):
            return {}  # a checksum names cache files: 32 hex digits or nothing
        return {s.path: s for s in shards}
    except (ValueError, KeyError, TypeError, RecursionError):
        return {}


def _node_listing(index: int, name: str, shown: str, params: ShardParams) -> dict[str, Shard]:
    """The node's cached index (a bounded read of a regular file, never through a link), or nothing;
    a link, FIFO or oversized file there is rebuilt and replaced."""
    try:
        return _parse_listing(nofollow.read_file(index, name, INDEX_CACHE_MAX_BYTES, shown), params)
    except OSError:
        return {}


def _run_listing(run_url: str | None, key: str, params: ShardParams) -> dict[str, Shard]:
    """The run directory's copy (bounded read, never through a link), or nothing."""
    if not run_url:
        return {}
    try:
        return _parse_listing(
            RunStorage(run_url).read_bytes(CORPUS_DIR, listing_file(key), limit=INDEX_CACHE_MAX_BYTES), params
        )
    except OSError:
        return {}


@contextlib.contextmanager
def _cache_subdir(settings: CacheSettings, name: str) -> Iterator[int]:
    """A directory of the node's cache (``index``, ``tmp``), below its checked private directory."""
    top = open_private_dir(settings.directory)
    try:
        fd = private_subdir(top, name, settings.directory)
    finally:
        os.close(top)
    try:
        yield fd
    finally:
        os.close(fd)


def build_index(fs: Any, patterns: Sequence[str], params: ShardParams, settings: CacheSettings) -> list[Shard]:
    """Every shard's entry: from the node's cached index, else the run directory's copy, where size
    and stamp still match; read (checksum and rows) where not. One process per node builds it at a
    time (a file lock, touched after each shard read: the others wait while it makes progress)."""
    key = index_key(fs, patterns, params)
    file = f"{key}.json"
    shown = os.path.join(settings.directory, "index", file)
    with _cache_subdir(settings, "index") as index, locked(index, f"{file}.lock", f"{shown}.lock"):
        listed = _listed(fs, patterns)
        names = _names([p for p, _ in listed])
        current = [
            (p, name, int(info.get("size") or 0), _stamp(fs, p, info))
            for (p, info), name in zip(listed, names, strict=True)
        ]
        node = _node_listing(index, file, shown, params)
        known = (
            node
            if all(_matches(node.get(p), n, size, st) for p, n, size, st in current)
            else {**_run_listing(settings.run_url, key, params), **node}
        )
        shards: list[Shard | None] = [
            known.get(p) if _matches(known.get(p), n, size, st) else None for p, n, size, st in current
        ]
        todo = [(i, *current[i]) for i, s in enumerate(shards) if s is None]
        if todo:
            with ThreadPoolExecutor(max(1, min(settings.concurrency, len(todo)))) as pool:
                for i, shard in zip(
                    [t[0] for t in todo],
                    pool.map(lambda t: _read_shard(fs, params, settings, *t[1:]), todo),
                    strict=True,
                ):
                    shards[i] = shard
                    os.utime(f"{file}.lock", dir_fd=index, follow_symlinks=False)  # progress, for the waiters
        complete = [s for s in shards if s is not None]
        if [node.get(s.path) for s in complete] != complete:
            nofollow.write_replacing(index, file, listing_bytes(params, complete), shown, mode=0o600)
        return complete


def _matches(old: Shard | None, name: str, size: int, stamp: str) -> bool:
    return old is not None and (old.name, old.size, old.stamp) == (name, size, stamp)


def _read_shard(
    fs: Any, params: ShardParams, settings: CacheSettings, path: str, name: str, size: int, stamp: str
) -> Shard:
    """One shard's checksum and rows: read in place locally, else downloaded (bounded by its listed
    size) into a temporary file that is deleted afterwards."""
    fmt = params["format"]
    if isinstance(fs, LocalFileSystem):
        got, checksum = checksum_file(path, "xxh3_128")
        if got != size:
            raise CorpusChanged(f"corpus shard {name} changed while it was indexed ({size} bytes listed, {got} read)")
        return Shard(name, path, size, stamp, checksum, count_rows(fmt, path, params, name))
    with _cache_subdir(settings, "tmp") as tmp_dir:
        tmp = uuid.uuid4().hex
        fd = nofollow.create_new(tmp_dir, tmp, os.path.join(settings.directory, "tmp", tmp), mode=0o600)
        try:
            got, checksum = backend_for(fs, "").download_file(fd_path(fd), path, "xxh3_128", size)
            if got != size:
                raise CorpusChanged(
                    f"corpus shard {name} changed while it was indexed ({size} bytes listed, {got} read)"
                )
            return Shard(name, path, size, stamp, checksum, count_rows(fmt, fd_path(fd), params, name))
        finally:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=tmp_dir)
