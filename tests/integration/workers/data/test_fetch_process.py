"""Shard downloads in a process of their own (``syncpoint.workers.data.fetch_process``), against
moto's S3 server on loopback: the child downloads the plan into the node cache, the reader's
samples are the ones it reads without the child, the child ends with its reader (closed, idle,
killed), and a child that dies leaves the downloads to the reader, which says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from examples.sharded_lm import write_corpus
from syncpoint.policies.contracts.state_format import SHARD_WINDOW_SAMPLER
from syncpoint.workers.data import corpus as corpus_mod
from syncpoint.workers.data.corpus import CacheSettings, ShardedCorpus
from syncpoint.workers.data.fetch_process import FetchProcess, travels
from syncpoint.workers.data.sampler import RankMicroBatches
from syncpoint.workers.data.shard_cache import FETCH_LOG, fetched_names
from tests.own_processes import process_gone
from tests.s3_server import BUCKET

SHARDS, WINDOW = 8, 2


@pytest.fixture(scope="module")
def corpus_url(s3) -> str:
    url = f"s3://{BUCKET}/fetch-process"
    write_corpus(url, SHARDS, 6, 8)
    return f"{url}/*.npy"


def _corpus(url: str, cache) -> ShardedCorpus:
    return ShardedCorpus(url, seq_len=9, cache=CacheSettings(str(cache), 1 << 30))


def _epoch(c: ShardedCorpus) -> tuple[RankMicroBatches, list[torch.Tensor]]:
    batches = RankMicroBatches(
        len(c), 4, 1, 0, 3, 0, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=c.shard_rows, window_shards=WINDOW
    )
    batches.on_position = c.follow(batches.order)
    return batches, [row for idx in batches for row in c.__getitems__(idx)]


def _fetch_pids(cache) -> list[int]:
    try:
        with open(os.path.join(str(cache), "shards-cache", FETCH_LOG)) as f:
            return [int(line.split(" ")[1]) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def _ended(fetcher: FetchProcess, timeout: float = 20.0) -> bool:
    """The child of ours has exited (reapable: every thread of it gone, not only its main one)."""
    child = fetcher._child
    assert child is not None
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def test_an_s3_corpus_downloads_in_its_own_process_and_reads_the_same_samples(corpus_url, tmp_path, monkeypatch):
    c = _corpus(corpus_url, tmp_path / "child")
    batches = RankMicroBatches(
        len(c), 4, 1, 0, 3, 0, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=c.shard_rows, window_shards=WINDOW
    )
    on_position = c.follow(batches.order)
    fetcher = c._process().fetcher
    assert fetcher is not None and fetcher.ready()
    child = fetcher.pid
    assert on_position is not None
    on_position(0, 4)  # the first window and one ahead: the child fetches them before any read
    plan = batches.order.shards_from(0, 2 * WINDOW)
    deadline = time.monotonic() + 60  # a fetch is logged after its file lands: wait for the log
    while len(_fetch_pids(tmp_path / "child")) < len(plan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fetch_pids(tmp_path / "child") == [child] * len(plan)

    _, samples = _epoch(c)
    pids = _fetch_pids(tmp_path / "child")
    assert len(pids) == SHARDS and child in pids and child != os.getpid()

    monkeypatch.setattr(corpus_mod, "travels", lambda fs: False)  # the reader's own threads
    plain = _corpus(corpus_url, tmp_path / "threads")
    _, expected = _epoch(plain)
    assert plain._process().fetcher is None and set(_fetch_pids(tmp_path / "threads")) == {os.getpid()}
    assert len(samples) == len(expected) == len(c) // 4 * 4  # whole micro-batches
    assert all(torch.equal(a, b) for a, b in zip(samples, expected, strict=True))
    fetcher.close()
    assert process_gone(child)


def test_the_child_ends_when_closed_when_idle_and_starts_again_for_the_next_plan(corpus_url, tmp_path):
    c = _corpus(corpus_url, tmp_path)
    shards = [s.remote() for s in c.shards]
    fetcher = FetchProcess(corpus_url, str(tmp_path / "shards-cache"), 1 << 30, 2, idle_s=1.0)
    assert fetcher.want(shards[:1]) and fetcher.ready()
    first = fetcher.pid
    assert _ended(fetcher)  # idle for a second after its one download
    assert fetcher.want(shards[1:2]) and fetcher.ready()  # a new child for the new plan
    second = fetcher.pid
    assert second is not None and second != first and fetcher.failed is None
    fetcher.close()
    assert process_gone(second, timeout=1.0)  # reaped by close


def test_a_killed_child_leaves_the_downloads_to_the_reader_which_says_so(corpus_url, tmp_path, capsys):
    c = _corpus(corpus_url, tmp_path)
    batches = RankMicroBatches(
        len(c), 4, 1, 0, 3, 0, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=c.shard_rows, window_shards=WINDOW
    )
    batches.on_position = c.follow(batches.order)
    fetcher = c._process().fetcher
    assert fetcher is not None and fetcher.ready() and fetcher.pid is not None
    os.kill(fetcher.pid, signal.SIGKILL)
    assert _ended(fetcher)
    rows = [row for idx in batches for row in c.__getitems__(idx)]
    assert len(rows) == len(c) // 4 * 4
    assert "the shard fetch process ended with exit code -9; this process downloads the shards itself" in (
        capsys.readouterr().err
    )
    assert os.getpid() in _fetch_pids(tmp_path)


def test_the_child_ends_when_its_reader_is_killed(corpus_url, tmp_path):
    """A reader killed outright (no close, no atexit): its child sees the pipe close and ends."""
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from syncpoint.workers.data.fetch_process import FetchProcess
                f = FetchProcess({corpus_url!r}, {str(tmp_path)!r}, 1 << 30, 2)
                f.start()
                assert f.ready()
                print(f.pid, flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
    )
    try:
        assert reader.stdout is not None
        child = int(reader.stdout.readline())
        reader.kill()
        reader.wait()
        assert process_gone(child)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()


def test_an_in_process_filesystem_keeps_its_downloads_in_the_reader(tmp_path):
    import fsspec

    assert not travels(fsspec.filesystem("memory"))
    assert not travels(fsspec.filesystem("file"))


@pytest.mark.parametrize("swap", ["same size, other bytes", "a huge object"])
def test_a_shard_swapped_on_s3_is_refused_by_the_reader_naming_it_and_never_cached(s3, tmp_path, swap):
    """The child's download of a swapped shard fails its checks and is never cached (nor logged);
    the reader's own fetch raises the refusal, naming the shard; the other shards still read."""
    import io

    import numpy as np

    from syncpoint.policies.contracts.errors import CorpusChanged

    url = f"s3://{BUCKET}/fetch-swap-{len(swap)}"
    write_corpus(url, 4, 6, 8, vary=False)
    c = _corpus(f"{url}/*.npy", tmp_path)
    victim = c.shards[2]
    original = s3.get_object(Bucket=BUCKET, Key=victim.path.split("/", 1)[1])["Body"].read()
    if swap == "a huge object":
        body = original + b"\0" * (8 << 20)  # far past the index's size: at most one part is read
    else:
        body = original[:-8] + bytes(8)
    s3.put_object(Bucket=BUCKET, Key=victim.path.split("/", 1)[1], Body=body)
    batches = RankMicroBatches(
        len(c), 4, 1, 0, 3, 0, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=c.shard_rows, window_shards=4
    )
    batches.on_position = c.follow(batches.order)
    fetcher = c._process().fetcher
    assert fetcher is not None and fetcher.ready()
    with pytest.raises(CorpusChanged, match=r"shard shard-00002\.npy changed since the corpus index was built"):
        for idx in batches:
            c.__getitems__(idx)
    cache = c._process().cache
    assert not cache.has(victim.remote())
    assert victim.name not in fetched_names(os.path.join(str(tmp_path), "shards-cache"))
    first = c.shards[0]
    stored = np.load(io.BytesIO(s3.get_object(Bucket=BUCKET, Key=first.path.split("/", 1)[1])["Body"].read()))
    assert c[0].tolist() == stored[:9].tolist() and cache.has(first.remote())  # the others still read
    fetcher.close()
