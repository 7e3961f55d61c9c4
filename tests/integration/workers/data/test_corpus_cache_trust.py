"""The corpus cache on a shared node (``syncpoint.workers.data.shard_cache``, ``corpus_index.build_index``): its
directory is this user's private one (another account's, or one others can write, is refused), its
files are 0600, no other account can take its locks, every lock wait ends with a reason, a wrong or
planted shard is downloaded again instead of read, and a link or FIFO planted at ``fetches.log`` or at
the index is replaced, never written through nor waited on.

The other account is a real one (``tests.second_account``): what keeps it out is the kernel's
decision for another user. The entries planted by this user stand for a cache written before these
rules, or damaged: the rules below the private directory do not depend on who planted them."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import numpy as np
import pytest
import xxhash

from syncpoint.policies.contracts.errors import CorpusError
from syncpoint.workers.data import corpus as corpus_mod
from syncpoint.workers.data import corpus_index as index_mod
from syncpoint.workers.data import shard_cache
from syncpoint.workers.data.corpus import CacheSettings, ShardedCorpus
from syncpoint.workers.data.shard_cache import (
    FETCH_LOG,
    LockWaitExpired,
    RemoteShard,
    ShardCache,
    fetched_names,
    flocked,
    open_private_dir,
)
from syncpoint.workers.storage.fsspec_backend import checksum_file
from tests.integration.workers.data.test_corpus import _local_download
from tests.second_account import second_account

SHARDS, ROWS, SEQ = 12, 10, 4


def _npy(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values)
    return buf.getvalue()


def _tokens(i: int, shift: int = 0) -> np.ndarray:
    return np.arange(i * 1000, i * 1000 + ROWS * SEQ, dtype=np.int32) + shift


@pytest.fixture
def memory_corpus(request) -> Iterator[str]:
    """A memory:// corpus of 12 shards of 10 rows (seq_len 4): shard i counts from i*1000."""
    fs = fsspec.filesystem("memory")
    root = f"/trust-{request.node.name[:40]}"
    for i in range(SHARDS):
        fs.pipe_file(f"{root}/s{i:03d}.npy", _npy(_tokens(i)))
    yield f"memory://{root}/*.npy"
    fs.rm(root, recursive=True)


@pytest.fixture
def shared_tmp(monkeypatch) -> Iterator[str]:
    """A temp directory as a node's ``/tmp`` is (1777: everyone may create in it), made the process's
    temp directory, so the cache goes where it goes by default: ``<tmp>/syncpoint-corpus-<uid>``."""
    shared = tempfile.mkdtemp(prefix="sp-shared-", dir="/tmp")
    os.chmod(shared, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", shared)
    monkeypatch.delenv("SYNCPOINT_CORPUS_CACHE", raising=False)
    yield shared
    shutil.rmtree(shared)


def _default_corpus(url: str) -> ShardedCorpus:
    return ShardedCorpus(url, seq_len=SEQ, cache=CacheSettings(corpus_mod.default_cache_dir(), 1 << 30))


def _within(fn: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """``fn()`` on a thread, which must end (a hang is the failure this guards against)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{what} still waits after {timeout:g} s"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _release(fifo: str) -> None:
    """Unblock whoever still waits in an open of this FIFO (only when the code under test hung)."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(fifo, flags))
        except OSError:
            pass


def _modes(top: str) -> dict[str, str]:
    """Every entry below ``top`` (itself included) and its permission bits."""
    out = {".": oct(stat.S_IMODE(os.lstat(top).st_mode))}
    for d, dirs, files in os.walk(top):
        for name in dirs + files:
            path = os.path.join(d, name)
            out[os.path.relpath(path, top)] = oct(stat.S_IMODE(os.lstat(path).st_mode))
    return out


# ------------------------------------------------------------------ the directory and its files are private

READ_AS_STRANGER = """
import json, os, sys
out = {}
for p in sys.argv[1:]:
    try:
        os.listdir(p) if p.endswith("/") else open(p, "rb").read(1)
        out[p] = "read"
    except OSError as e:
        out[p] = type(e).__name__
print(json.dumps(out))
"""


def test_the_cache_is_private_another_account_reads_nothing_of_it(memory_corpus, shared_tmp):
    c = _default_corpus(memory_corpus)
    assert c[0].tolist() == [0, 1, 2, 3]  # indexed, shard 0 fetched, logged
    top = corpus_mod.default_cache_dir()
    assert top == os.path.join(shared_tmp, f"syncpoint-corpus-{os.getuid()}")
    modes = _modes(top)
    dirs = {p for p in modes if os.path.isdir(os.path.join(top, p))}
    assert {p: m for p, m in modes.items() if p in dirs} == dict.fromkeys(dirs, "0o700"), modes
    assert {p: m for p, m in modes.items() if p not in dirs} == {p: "0o600" for p in modes if p not in dirs}
    shard = next(p for p in modes if p.startswith("shards-cache/shards/"))
    index = next(p for p in modes if p.startswith("index/") and p.endswith(".json"))
    targets = [f"{top}/", os.path.join(top, shard), os.path.join(top, index), os.path.join(top, "shards-cache/")]
    with second_account() as stranger:
        got = stranger.python(READ_AS_STRANGER, args=tuple(targets))
    assert got == dict.fromkeys(targets, "PermissionError"), got


# ------------------------------------------------------------------ locks: no other account takes one; every wait ends

LOCK_AS_STRANGER = """
import fcntl, json, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print(json.dumps("held"))
except OSError as e:
    print(json.dumps(type(e).__name__))
"""


def test_another_account_cannot_hold_a_shard_lock(memory_corpus, shared_tmp):
    c = _default_corpus(memory_corpus)
    assert c[0].tolist() == [0, 1, 2, 3]  # shard 0 fetched: its lock file exists
    locks = os.path.join(corpus_mod.default_cache_dir(), "shards-cache", "locks")
    (lock,) = os.listdir(locks)
    with second_account() as stranger:
        assert stranger.python(LOCK_AS_STRANGER, args=(os.path.join(locks, lock),)) == "PermissionError"
    again = _default_corpus(memory_corpus)
    assert _within(lambda: again[1].tolist(), "a read of shard 0") == [4, 5, 6, 7]


def _source_shard(tmp_path, data: bytes, name: str = "s0") -> RemoteShard:
    path = tmp_path / f"src-{name}"
    path.write_bytes(data)
    size, checksum = checksum_file(str(path), "xxh3_128")
    return RemoteShard(name, str(path), size, checksum)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_a_lock_held_past_its_bound_ends_the_wait_naming_the_lock_and_its_holder(tmp_path):
    data = _npy(_tokens(0))
    shard = _source_shard(tmp_path, data)
    cache = ShardCache(str(tmp_path / "cache"), 1 << 20, _local_download, lock_wait_s=0.2)
    lock = os.path.join(cache.locks_dir, shard.key)
    with flocked(lock):  # a holder that never lets go (a stuck process)
        with pytest.raises(LockWaitExpired) as refused:
            _within(lambda: cache.open(shard, _read), "an open of a shard whose lock is held")
    message = str(refused.value)
    assert lock in message and "another process" in message and f"pid {os.getpid()}" in message, message
    assert cache.open(shard, _read) == data  # let go: the open goes on


def test_a_held_index_lock_ends_the_wait_with_a_reason(memory_corpus, tmp_path, monkeypatch):
    settings = CacheSettings(str(tmp_path / "cache"), 1 << 30)
    c = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=settings)
    key = index_mod.index_key(c._fs(), c.patterns, c.params)
    os.close(open_private_dir(settings.directory))
    os.mkdir(tmp_path / "cache" / "index", 0o700)
    lock = str(tmp_path / "cache" / "index" / f"{key}.json.lock")
    monkeypatch.setattr(shard_cache, "LOCK_WAIT_S", 0.2)
    with flocked(lock):  # another process builds the index, and hangs
        with pytest.raises(LockWaitExpired, match="another process"):
            _within(lambda: len(c), "the index build")
    assert len(c) == SHARDS * ROWS


# ------------------------------------------------------------------ a directory another account made is refused


PLANT_AS_STRANGER = """
import json, os, sys
top, key, data = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
for d in ("", "shards-cache", "shards-cache/shards", "shards-cache/locks"):
    os.mkdir(os.path.join(top, d))
    os.chmod(os.path.join(top, d), 0o777)
with open(os.path.join(top, "shards-cache", "shards", key), "wb") as f:
    f.write(data)
print(json.dumps(sorted(os.listdir(top))))
"""


def test_a_cache_directory_another_account_made_is_refused_and_its_shard_never_read(memory_corpus, shared_tmp):
    planted = _npy(_tokens(0, shift=1))  # shard 0's size, other tokens
    key = f"{xxhash.xxh3_128(_npy(_tokens(0))).hexdigest()}-{len(planted)}"  # shard 0's name in the cache
    top = corpus_mod.default_cache_dir()
    with second_account() as stranger:
        assert stranger.python(PLANT_AS_STRANGER, args=(top, key, planted.hex())) == ["shards-cache"]
        c = _default_corpus(memory_corpus)
        with pytest.raises(CorpusError) as refused:
            c[0]
    message = str(refused.value)
    assert f"owner uid {stranger.uid}" in message and "not this user's private directory" in message, message
    assert "corpus.cache_dir" in message and top in message
    assert sorted(os.listdir(top)) == ["shards-cache"]  # nothing written into it


def test_a_cache_directory_others_can_write_is_refused(memory_corpus, tmp_path):
    top = tmp_path / "cache"
    top.mkdir()
    os.chmod(top, 0o777)
    c = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=CacheSettings(str(top), 1 << 30))
    with pytest.raises(CorpusError, match="mode 777"):
        len(c)
    assert os.listdir(top) == []


# ------------------------------------------------------------------ a wrong shard in the cache is never read


def _plant(kind: str, path: str, right: bytes, wrong: bytes, elsewhere: str) -> None:
    os.unlink(path)
    if kind == "other bytes, same size":
        with open(path, "wb") as f:
            f.write(wrong)
    elif kind == "a link to the right bytes":
        with open(elsewhere, "wb") as f:
            f.write(right)
        os.symlink(elsewhere, path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["other bytes, same size", "a link to the right bytes", "a FIFO"])
def test_a_wrong_cached_shard_is_downloaded_again_never_read(tmp_path, capsys, kind):
    right, wrong = _npy(_tokens(0)), _npy(_tokens(0, shift=1))
    shard = _source_shard(tmp_path, right)
    directory = str(tmp_path / "cache")
    assert ShardCache(directory, 1 << 20, _local_download).fetch(shard)
    cached = os.path.join(directory, "shards", shard.key)
    elsewhere = str(tmp_path / "elsewhere")
    _plant(kind, cached, right, wrong, elsewhere)
    capsys.readouterr()
    fresh = ShardCache(directory, 1 << 20, _local_download)  # another process: it checks what it opens
    try:
        assert _within(lambda: fresh.open(shard, _read), "an open of the cached shard") == right
    finally:
        _release(cached)
    assert stat.S_ISREG(os.lstat(cached).st_mode)
    assert fetched_names(directory) == ["s0", "s0"]  # downloaded again
    err = capsys.readouterr().err
    assert "cached shard s0" in err and "downloaded again" in err, err
    if kind == "a link to the right bytes":
        assert _read(elsewhere) == right  # its target was never touched


def test_a_cached_shard_is_checked_once_per_process(tmp_path, monkeypatch):
    calls: list[int] = []
    checksum_fd = shard_cache.checksum_fd

    def counted(*args: Any) -> tuple[int, str]:
        calls.append(1)
        return checksum_fd(*args)

    monkeypatch.setattr(shard_cache, "checksum_fd", counted)
    data = _npy(_tokens(3))
    shard = _source_shard(tmp_path, data)
    directory = str(tmp_path / "cache")
    first = ShardCache(directory, 1 << 20, _local_download)
    assert first.fetch(shard) and first.open(shard, _read) == data
    assert calls == []  # its own download was checked as it landed
    other = ShardCache(directory, 1 << 20, _local_download)  # another process of the node
    assert [other.open(shard, _read) for _ in range(3)] == [data] * 3
    assert calls == [1]  # once, on its first open


def test_a_corpus_reads_the_indexed_bytes_over_a_planted_shard(memory_corpus, tmp_path):
    settings = CacheSettings(str(tmp_path / "cache"), 1 << 30)
    first = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=settings)
    assert first[0].tolist() == [0, 1, 2, 3]
    shards = tmp_path / "cache" / "shards-cache" / "shards"
    (cached,) = shards.iterdir()
    cached.write_bytes(_npy(_tokens(0, shift=1)))  # the same size: only the checksum tells
    resumed = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=settings)  # a new process's reader
    assert [resumed[i].tolist() for i in (0, 9)] == [[0, 1, 2, 3], [36, 37, 38, 39]]


# ------------------------------------------------------------------ fetches.log and the index: links and FIFOs replaced


@pytest.mark.parametrize("kind", ["a symbolic link", "a FIFO"])
def test_a_link_or_fifo_at_the_fetch_log_is_replaced_never_written_through(tmp_path, capsys, kind):
    shard = _source_shard(tmp_path, _npy(_tokens(0)))
    directory = str(tmp_path / "cache")
    cache = ShardCache(directory, 1 << 20, _local_download)
    log = os.path.join(directory, FETCH_LOG)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious\n")
    if kind == "a symbolic link":
        os.symlink(victim, log)
    else:
        os.mkfifo(log)
    try:
        assert _within(lambda: cache.fetch(shard), "a fetch that logs")
    finally:
        _release(log)
    assert victim.read_bytes() == b"precious\n"
    assert stat.S_ISREG(os.lstat(log).st_mode) and stat.S_IMODE(os.lstat(log).st_mode) == 0o600
    assert fetched_names(directory) == ["s0"]
    assert f"{FETCH_LOG} was {kind}; replaced" in capsys.readouterr().err


def _crafted_index(memory_corpus: str, tmp_path) -> tuple[str, str, bytes]:
    """(index file name, a valid index of this corpus with shard 0 said to hold 5 rows, its bytes)."""
    honest = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=CacheSettings(str(tmp_path / "honest"), 1 << 30))
    assert len(honest) == SHARDS * ROWS
    name = f"{index_mod.index_key(honest._fs(), honest.patterns, honest.params)}.json"
    raw = json.loads((tmp_path / "honest" / "index" / name).read_bytes())
    raw["shards"][0]["rows"] = 5
    crafted = index_mod.listing_bytes(raw["params"], [index_mod.Shard(**e) for e in raw["shards"]])
    return name, str(tmp_path / "crafted.json"), crafted


@pytest.mark.parametrize("kind", ["a symbolic link", "a FIFO"])
def test_a_link_or_fifo_at_the_index_is_neither_read_nor_waited_on(memory_corpus, tmp_path, capsys, kind):
    name, target, crafted = _crafted_index(memory_corpus, tmp_path)
    with open(target, "wb") as f:
        f.write(crafted)
    directory = str(tmp_path / "cache")
    os.close(open_private_dir(directory))
    os.mkdir(os.path.join(directory, "index"), 0o700)
    index = os.path.join(directory, "index", name)
    if kind == "a symbolic link":
        os.symlink(target, index)
    else:
        os.mkfifo(index)
    capsys.readouterr()
    c = ShardedCorpus(memory_corpus, seq_len=SEQ, cache=CacheSettings(directory, 1 << 30))
    try:
        assert _within(lambda: len(c), "the index build") == SHARDS * ROWS  # rebuilt: shard 0 holds 10 rows
    finally:
        _release(index)
    assert stat.S_ISREG(os.lstat(index).st_mode) and stat.S_IMODE(os.lstat(index).st_mode) == 0o600
    assert _read(target) == crafted  # the link's target was never written
    assert f"{name} was {kind}; replaced by a regular file" in capsys.readouterr().err
