"""Sharded corpora (``syncpoint.workers.data.corpus``): the index, the shard-window order, the shard cache, and
selection's refusal of another corpus. Fast: local files and memory://, no training; the runs on
moto's S3 server are in tests/integration/workers/data/test_corpus_runs.py."""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing as mp
import os
import time

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from syncpoint.policies.contracts.corpus_identity import CorpusIdentity, first_difference, parse_document
from syncpoint.policies.contracts.errors import CorpusChanged, CorpusError, JobConfigError, SpecError
from syncpoint.policies.contracts.state_format import SAMPLER_VERSION, SHARD_WINDOW_SAMPLER
from syncpoint.policies.decisions.candidates import LiveJob, Verdict, classify
from syncpoint.workers.data import corpus_index as index_mod
from syncpoint.workers.data import data_plan
from syncpoint.workers.data.corpus import CacheSettings, ShardedCorpus
from syncpoint.workers.data.data_plan import plan_for
from syncpoint.workers.data.sampler import RankMicroBatches, ShardWindowOrder
from syncpoint.workers.data.shard_cache import RemoteShard, ShardCache, fetched_names, flocked
from syncpoint.workers.storage.fsspec_backend import checksum_file
from tests.helpers import lm_spec
from tests.meta import candidate_for, changed, live


def _npy(values: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, values)
    return buf.getvalue()


def _write_shards(root, counts, seq_len=4, dtype=np.int32) -> list[str]:
    """Local 1-D token shards: shard i holds rows*seq_len (+ a remainder) tokens counting from i*10^4."""
    os.makedirs(root, exist_ok=True)
    paths = []
    for i, rows in enumerate(counts):
        path = os.path.join(root, f"s{i:03d}.npy")
        with open(path, "wb") as f:
            f.write(_npy(np.arange(i * 10**4, i * 10**4 + rows * seq_len + 1, dtype=dtype)))
        paths.append(path)
    return paths


@pytest.fixture
def memory_corpus(request):
    """A memory:// corpus of 12 shards of 10 rows (seq_len 4), removed afterwards."""
    fs = fsspec.filesystem("memory")
    root = f"/corpus-{request.node.name[:40]}"
    for i in range(12):
        fs.pipe_file(f"{root}/s{i:03d}.npy", _npy(np.arange(i * 1000, i * 1000 + 40, dtype=np.int32)))
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def _settings(tmp_path, bound=1 << 30, **kw) -> CacheSettings:
    return CacheSettings(str(tmp_path / "cache"), bound, **kw)


# ------------------------------------------------------------------ the index


def test_rows_of_every_format_and_samples_by_position(tmp_path):
    _write_shards(tmp_path / "npy", [3, 5, 0, 2])  # a shard of fewer tokens than a row holds no rows
    c = ShardedCorpus(str(tmp_path / "npy" / "*.npy"), seq_len=4, cache=_settings(tmp_path))
    assert len(c) == 10 and c.shard_rows.tolist() == [3, 5, 0, 2]
    assert c[0].tolist() == [0, 1, 2, 3] and c[3].tolist() == [10**4, 10**4 + 1, 10**4 + 2, 10**4 + 3]
    assert c[9].tolist() == [3 * 10**4 + 4 + k for k in range(4)] and c[9].dtype == torch.int64
    with pytest.raises(IndexError):
        c[10]

    two_d = tmp_path / "two_d.npy"
    np.save(two_d, np.arange(12, dtype=np.int16).reshape(4, 3))
    assert [t.tolist() for t in ShardedCorpus(str(two_d), seq_len=3, cache=_settings(tmp_path))] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, 10, 11],
    ]

    np.arange(10, dtype=np.uint16).tofile(tmp_path / "t.bin")
    b = ShardedCorpus(str(tmp_path / "t.bin"), "tokens-bin", seq_len=3, cache=_settings(tmp_path))
    assert len(b) == 3 and b[2].tolist() == [6, 7, 8]

    (tmp_path / "a.jsonl").write_bytes(b'{"a": 1}\n\n  \r\n{"a": 2}\r\n{"a": 3}')
    j = ShardedCorpus(str(tmp_path / "a.jsonl"), "jsonl", cache=_settings(tmp_path))
    assert [j[i] for i in range(len(j))] == [{"a": 1}, {"a": 2}, {"a": 3}]

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"x": list(range(25)), "t": [str(i) for i in range(25)]}), tmp_path / "p.parquet", row_group_size=7
    )
    p = ShardedCorpus(str(tmp_path / "p.parquet"), "parquet", columns=["x"], cache=_settings(tmp_path))
    assert len(p) == 25 and p[0] == {"x": 0} and p[8] == {"x": 8} and p[24] == {"x": 24}


def test_a_shard_of_another_format_is_refused_naming_it(tmp_path):
    np.save(tmp_path / "f.npy", np.zeros(8, dtype=np.float32))
    with pytest.raises(CorpusError, match=r"shard f\.npy holds float32, not integer tokens"):
        len(ShardedCorpus(str(tmp_path / "f.npy"), seq_len=2, cache=_settings(tmp_path)))
    with pytest.raises(CorpusError, match="nothing matches"):
        len(ShardedCorpus(str(tmp_path / "none-*.npy"), seq_len=2, cache=_settings(tmp_path)))
    with pytest.raises(CorpusError, match="needs seq_len"):
        ShardedCorpus(str(tmp_path / "f.npy"))


def test_the_index_is_cached_and_only_changed_shards_are_read_again(tmp_path, monkeypatch):
    paths = _write_shards(tmp_path / "c", [3, 4, 5])
    reads: list[str] = []
    original = index_mod._read_shard

    def counting(fs, params, settings, path, *rest):
        reads.append(os.path.basename(path))
        return original(fs, params, settings, path, *rest)

    monkeypatch.setattr(index_mod, "_read_shard", counting)
    glob = str(tmp_path / "c" / "*.npy")
    first = ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path))
    assert len(first) == 12 and sorted(reads) == ["s000.npy", "s001.npy", "s002.npy"]
    reads.clear()
    again = ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path))
    assert len(again) == 12 and reads == []  # from the node's cache: nothing read
    assert again.identity() == first.identity()

    with open(paths[1], "wb") as f:  # rewritten: another row count
        f.write(_npy(np.arange(6 * 4, dtype=np.int32)))
    changed = ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path))
    assert len(changed) == 14 and reads == ["s001.npy"]
    assert changed.identity().digest != first.identity().digest

    reads.clear()
    cache_file = next((tmp_path / "cache" / "index").glob("*.json"))
    raw = json.loads(cache_file.read_text())
    raw["shards"][0]["rows"] = 99  # damaged (or edited): its checksum no longer matches
    cache_file.write_text(json.dumps(raw))
    rebuilt = ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path))
    assert len(rebuilt) == 14 and sorted(reads) == ["s000.npy", "s001.npy", "s002.npy"]


def test_a_node_that_joins_later_takes_the_index_from_the_run_directory(memory_corpus, tmp_path, monkeypatch):
    from syncpoint.workers.storage import RunStorage

    run_url = str(tmp_path / "run")
    first = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path / "node1"))
    data_plan.publish_index(RunStorage(run_url), first, first.identity())  # rank 0, holding the lease
    reads: list[str] = []
    monkeypatch.setattr(index_mod, "_read_shard", lambda *a: reads.append(a[3]))
    joined = ShardedCorpus(
        f"{memory_corpus}/*.npy", seq_len=4, cache=dataclasses.replace(_settings(tmp_path / "node2"), run_url=run_url)
    )
    assert joined.identity() == first.identity() and reads == []  # no shard read to index it
    monkeypatch.undo()

    store = RunStorage(run_url)
    name = next(n for n in store.list_files("corpus") if "listing-" in n).rsplit("/", 1)[-1]
    raw = json.loads(store.read_bytes("corpus", name, limit=1 << 20))
    body = {k: raw[k] for k in ("version", "params", "shards")}
    body["shards"][3]["rows"] = 9  # edited on purpose, its checksum made to fit
    store.write_bytes(
        index_mod.listing_bytes(body["params"], [index_mod.Shard(**e) for e in body["shards"]]), "corpus", name
    )
    hostile = ShardedCorpus(
        f"{memory_corpus}/*.npy", seq_len=4, cache=dataclasses.replace(_settings(tmp_path / "node3"), run_url=run_url)
    )
    assert len(hostile) == 119
    with pytest.raises(CorpusChanged, match=r"shard s003\.npy holds 10 rows, its index entry says 9"):
        hostile[35]


def test_touching_a_shard_without_changing_it_keeps_the_identity(tmp_path):
    paths = _write_shards(tmp_path / "c", [3, 4])
    glob = str(tmp_path / "c" / "*.npy")
    before = ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path)).identity()
    os.utime(paths[0], ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))  # same bytes, another stamp
    assert ShardedCorpus(glob, seq_len=4, cache=_settings(tmp_path)).identity() == before


def test_the_first_difference_between_two_corpora_names_the_shard(tmp_path):
    def identity(counts, *, seq_len=4, edit=None, order=None):
        root = tmp_path / f"v{len(list(tmp_path.iterdir()))}"
        paths = _write_shards(root, counts, seq_len=seq_len)
        if edit is not None:
            data = bytearray(open(paths[edit], "rb").read())
            data[-1] ^= 1  # same size, other contents
            open(paths[edit], "wb").write(bytes(data))
        shards = paths if order is None else [paths[i] for i in order]
        return ShardedCorpus(shards, seq_len=seq_len, cache=_settings(tmp_path)).identity()

    base = identity([3, 4, 5])
    assert first_difference(base, identity([3, 6, 5])) == "shard s001.npy changed: 4 rows in the state's corpus, 6 now"
    assert "shard s002.npy changed contents (same size" in first_difference(base, identity([3, 4, 5], edit=2))
    assert (
        first_difference(base, identity([3, 4, 5, 1])) == "shard s003.npy is new (the state's corpus has no such shard)"
    )
    assert (
        first_difference(base, identity([3, 4]))
        == "shard s002.npy is gone (the state's corpus has it, this run's does not)"
    )
    assert (
        first_difference(base, identity([3, 4, 5], order=[1, 0, 2]))
        == "the shard order differs at position 0: s000.npy in the state's corpus, s001.npy now"
    )
    assert (
        first_difference(base, identity([3, 4, 5], seq_len=2)) == "seq_len is 4 in the state's corpus, 2 in this run's"
    )
    assert identity([3, 4, 5]).digest == base.digest  # the same bytes elsewhere: the same corpus


def test_the_index_document_must_hash_to_its_name(tmp_path):
    _write_shards(tmp_path / "c", [3, 4])
    ident = ShardedCorpus(str(tmp_path / "c" / "*.npy"), seq_len=4, cache=_settings(tmp_path)).identity()
    doc = json.loads(json.dumps(ident.document()))
    assert parse_document(doc, ident.digest) == (ident, None)
    doc["shards"][1]["rows"] = 5
    got, problem = parse_document(doc, ident.digest)
    assert got is None and "changed after it was written" in problem
    assert parse_document({"format": "x"}, ident.digest)[0] is None


def test_a_batch_read_gives_each_sample_the_values_one_fetch_of_it_gives(memory_corpus, tmp_path):
    import functools

    from examples.sharded_lm import add_noise
    from syncpoint.workers.data.sampler import SeededSamples

    c = ShardedCorpus(
        f"{memory_corpus}/*.npy",
        seq_len=4,
        cache=_settings(tmp_path),
        transform=functools.partial(add_noise, noise=0.5),
    )  # random per sample
    seeded = SeededSamples(c, 3, 1)
    idx = [17, 3, 99, 4, 58, 3]
    batch = seeded.__getitems__(idx)  # each shard's rows read at once, each sample's noise under its own seed
    assert [t.tolist() for t in batch] == [seeded[i].tolist() for i in idx]
    assert batch[1].tolist() == batch[5].tolist()  # the same sample, the same seed
    plain = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path))
    rows = plain.__getitems__(idx)
    assert [t.tolist() for t in rows] == [plain[i].tolist() for i in idx]
    assert any(a.tolist() != b.tolist() for a, b in zip(batch, rows, strict=True))  # the noise did draw


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
    picks=st.lists(st.floats(0, 1, exclude_max=True), max_size=40),
)
def test_a_token_batch_is_each_samples_own_row_in_the_batchs_order(tmp_path_factory, counts, picks):
    root = tmp_path_factory.mktemp("tok")
    _write_shards(root, counts, seq_len=3, dtype=np.uint16)
    c = ShardedCorpus(str(root / "*.npy"), seq_len=3, cache=CacheSettings(str(root / "cache"), 1 << 30))
    idx = [int(p * len(c)) for p in picks]  # any order, repeats, one shard or several, or none
    batch = c.__getitems__(idx)
    assert [t.tolist() for t in batch] == [c[i].tolist() for i in idx]
    assert all(t.dtype == torch.int64 for t in batch)
    with pytest.raises(IndexError):
        c.__getitems__([*idx, len(c)])


# ------------------------------------------------------------------ the shard-window order


@pytest.mark.parametrize("rows,window", [([5, 0, 7, 1, 9, 3], 2), ([10] * 7, 3), ([4], 1), ([1, 2, 3], 8)])
def test_the_shard_window_order_is_a_bijection_per_epoch(rows, window):
    n = sum(rows)
    orders = []
    for epoch in range(3):
        order = ShardWindowOrder(rows, window, 11, epoch)
        got = order(np.arange(n))
        assert sorted(got.tolist()) == list(range(n)), f"epoch {epoch} is no permutation"
        orders.append(got.tolist())
    assert n < 4 or len({tuple(o) for o in orders}) == 3  # every epoch another order


def test_every_sample_once_per_epoch_on_every_world_size_in_one_global_order():
    rows, window, mbs = [9, 13, 0, 7, 11, 5, 8, 12], 3, 2
    order = ShardWindowOrder(rows, window, 5, 1)
    n = sum(rows)
    sequences = []
    for world in (1, 2, 4):
        per_epoch = n // (mbs * world) * mbs * world
        ranks = [
            RankMicroBatches(
                n, mbs, world, r, 5, 1, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=rows, window_shards=window
            )
            for r in range(world)
        ]
        seen = [i for m in range(len(ranks[0])) for r in ranks for i in r.indices(m)]
        assert len(seen) == len(set(seen)) == per_epoch
        assert seen == order(np.arange(per_epoch)).tolist()
        sequences.append(seen)
    common = min(len(s) for s in sequences)
    assert sequences[0][:common] == sequences[1][:common] == sequences[2][:common]


def test_a_micro_batch_reads_only_the_shards_of_its_window():
    rows, window, mbs, world = [20, 35, 0, 17, 41, 26, 30, 12, 23], 3, 4, 2
    starts = np.concatenate([[0], np.cumsum(rows)])
    order = ShardWindowOrder(rows, window, 3, 0)
    ranks = [
        RankMicroBatches(
            sum(rows), mbs, world, r, 3, 0, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=rows, window_shards=window
        )
        for r in range(world)
    ]
    straddling = 0
    for m in range(len(ranks[0])):
        first, last = m * mbs * world, (m + 1) * mbs * world - 1
        windows = range(order.window_of(first), order.window_of(last) + 1)
        allowed = {int(s) for w in windows for s in order.window_shards(w)}
        shards = {int(np.searchsorted(starts, i, side="right") - 1) for r in ranks for i in r.indices(m)}
        assert shards <= allowed, f"micro-batch {m} read shards outside its window"
        if len(windows) == 1:
            assert len(shards) <= window
        straddling += len(windows) > 1
    assert straddling < len(ranks[0]) / 4  # only micro-batches at a window's end span two
    assert ShardWindowOrder(rows, window, 3, 0).shards.tolist() != ShardWindowOrder(rows, window, 3, 1).shards.tolist()


def test_resuming_at_any_position_continues_the_same_order():
    rows = [9, 13, 7, 11, 5]
    full = RankMicroBatches(45, 2, 2, 1, 7, 2, 0, sampler=SHARD_WINDOW_SAMPLER, shard_rows=rows, window_shards=2)
    tail = RankMicroBatches(45, 2, 2, 1, 7, 2, 6, sampler=SHARD_WINDOW_SAMPLER, shard_rows=rows, window_shards=2)
    assert list(tail) == list(full)[6:]


# ------------------------------------------------------------------ the shard cache


def _local_download(src: str, dst: str, limit: int) -> tuple[int, str]:
    with open(src, "rb") as f:
        data = f.read(limit + 1)
    with open(dst, "wb") as f:
        f.write(data)
    return checksum_file(dst, "xxh3_128")


def _remote(path: str, name: str) -> RemoteShard:
    size, checksum = checksum_file(path, "xxh3_128")
    return RemoteShard(name, path, size, checksum)


def test_the_cache_stays_within_its_bound_evicting_the_least_recently_used(tmp_path):
    shards = []
    for i in range(5):
        p = tmp_path / f"src{i}"
        p.write_bytes(bytes([i]) * 1000)
        shards.append(_remote(str(p), f"s{i}"))
    cache = ShardCache(str(tmp_path / "cache"), 3000, _local_download)
    for s in shards[:3]:
        assert cache.fetch(s)
        time.sleep(0.01)  # distinct mtimes
    assert not cache.fetch(shards[0])  # cached: no download, and now the most recently used
    assert cache.fetch(shards[3])  # evicts s1, the least recently used
    assert [cache.has(s) for s in shards] == [True, False, True, True, False]
    assert cache.fetch(shards[4], keep=[shards[2].key])  # s2 is kept: s0 goes
    assert [cache.has(s) for s in shards] == [False, False, True, True, True]
    total = sum(f.stat().st_size for f in (tmp_path / "cache" / "shards").iterdir())
    assert total <= 3000
    with flocked(os.path.join(cache.locks_dir, shards[2].key)):  # being read by another process
        with pytest.raises(CorpusError, match="corpus.cache_bytes"):
            cache.fetch(shards[0], keep=[shards[3].key, shards[4].key])
    assert fetched_names(str(tmp_path / "cache")) == ["s0", "s1", "s2", "s3", "s4"]
    assert cache.downloads == 5


def test_a_shard_changed_since_the_index_is_refused_when_fetched_naming_it(memory_corpus, tmp_path):
    c = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path))
    assert len(c) == 120
    fs = fsspec.filesystem("memory")
    path = c.shards[4].path
    fs.pipe_file(path, _npy(np.arange(40, dtype=np.int32) + 1))  # same size, other tokens
    with pytest.raises(CorpusChanged, match=r"shard s004\.npy changed since the corpus index was built"):
        c[4 * 10]
    assert c[0].tolist() == [0, 1, 2, 3]  # the others still read


def test_a_local_shard_changed_in_place_is_refused_naming_it(tmp_path):
    paths = _write_shards(tmp_path / "c", [3, 4])
    c = ShardedCorpus(str(tmp_path / "c" / "*.npy"), seq_len=4, cache=_settings(tmp_path))
    assert len(c) == 7
    data = bytearray(open(paths[1], "rb").read())
    data[-5] ^= 1
    open(paths[1], "wb").write(bytes(data))
    with pytest.raises(CorpusChanged, match=r"shard s001\.npy changed"):
        c[3]


def _read_epoch(c: ShardedCorpus, start: int, window: int) -> RankMicroBatches:
    batches = RankMicroBatches(
        len(c), 5, 2, 0, 1, 0, start, sampler=SHARD_WINDOW_SAMPLER, shard_rows=c.shard_rows, window_shards=window
    )
    batches.on_position = c.follow(batches.order)
    for idx in batches:
        for i in idx:
            c[i]
    return batches


def test_resume_at_a_position_fetches_only_the_shards_from_there_on(memory_corpus, tmp_path):
    window = 2
    c = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path / "a", bound=6 * 1000))
    order = _read_epoch(c, 0, window).order  # 12 micro-batches of 10 samples (world 2 x 5)
    assert sorted(fetched_names(str(tmp_path / "a" / "cache" / "shards-cache"))) == sorted(s.name for s in c.shards)
    cached = os.listdir(tmp_path / "a" / "cache" / "shards-cache" / "shards")
    assert len(cached) * c.shards[0].size <= 6 * 1000  # bounded: earlier windows were evicted

    resumed = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path / "b", bound=6 * 1000))
    start = 7  # micro-batch 7: position 70, in window 3 (shards 6 and 7 of the order)
    _read_epoch(resumed, start, window)
    first_window = order.window_of(start * 10)
    expected = [resumed.shards[s].name for s in order.shards[first_window * window :]]
    assert sorted(fetched_names(str(tmp_path / "b" / "cache" / "shards-cache"))) == sorted(expected)
    assert len(expected) < len(c.shards)


def test_a_cache_too_small_for_a_window_is_refused_before_training(memory_corpus, tmp_path):
    c = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path, bound=3 * 200))
    spec = lm_spec(tmp_path, "corpus.window_shards=2", "corpus.prefetch_shards=1")
    with pytest.raises(JobConfigError, match="corpus.cache_bytes .* cannot hold 3 shards"):
        plan_for(spec, c)
    plan = plan_for(lm_spec(tmp_path, "corpus.shuffle=global"), c)
    assert plan.sampler == SAMPLER_VERSION and plan.window_shards is None and plan.identity == c.identity()
    with pytest.raises(JobConfigError, match="corpus.shuffle shard-window needs the task's dataset"):
        plan_for(lm_spec(tmp_path, "corpus.shuffle=shard-window"), [1, 2, 3])


def test_the_corpus_pickles_into_dataloader_workers(memory_corpus, tmp_path):
    c = ShardedCorpus(f"{memory_corpus}/*.npy", seq_len=4, cache=_settings(tmp_path))
    direct = [c[i] for i in range(len(c))]  # the parent opened readers (and holds a cache)
    # memory:// lives in this process, so its workers are forked (a spawned worker would see no shards)
    loader = torch.utils.data.DataLoader(c, batch_size=7, num_workers=2, multiprocessing_context="fork")
    got = [row for batch in loader for row in batch]
    assert all(torch.equal(a, b) for a, b in zip(direct, got, strict=True))
    local = _write_shards(tmp_path / "l", [3, 4, 5])
    lc = ShardedCorpus(local, seq_len=4, cache=_settings(tmp_path))
    loader = torch.utils.data.DataLoader(lc, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    assert [r.tolist() for b in loader for r in b] == [lc[i].tolist() for i in range(len(lc))]


def _started_then_sleep(started, seconds: float) -> None:
    started.set()  # the child runs: its at-fork handlers ran
    time.sleep(seconds)


def test_a_forked_child_does_not_keep_a_lock_its_parent_held(tmp_path):
    path = str(tmp_path / "lock")
    ctx = mp.get_context("fork")
    started = ctx.Event()
    with flocked(path):
        child = ctx.Process(target=_started_then_sleep, args=(started, 3))
        child.start()  # forked while this process holds the lock (a prefetch thread mid-download)
        assert started.wait(30)
    try:
        with flocked(path, blocking=False) as free:
            assert free, "the forked child kept the parent's lock"
    finally:
        child.join()


# ------------------------------------------------------------------ the spec and selection


def test_the_corpus_spec_reads_byte_units_and_refuses_bad_values(tmp_path):
    assert lm_spec(tmp_path, "corpus.cache_bytes='2 GiB'").corpus.cache_bytes == 2 << 30
    assert lm_spec(tmp_path, "corpus.cache_bytes=500MB").corpus.cache_bytes == 500 * 10**6
    with pytest.raises(SpecError, match="corpus.cache_bytes"):
        lm_spec(tmp_path, "corpus.cache_bytes=lots")
    with pytest.raises(SpecError, match="corpus.cache_dir"):
        lm_spec(tmp_path, "corpus.cache_dir=s3://bucket/cache")
    with pytest.raises(SpecError, match="corpus.shuffle"):
        lm_spec(tmp_path, "corpus.shuffle=random")


def _corpus_job(ident: CorpusIdentity, window: int = 2) -> LiveJob:
    exp = live("j", 1, 2, 2, 10, 0, "f", 1, num_samples=ident.rows)
    return changed(exp, corpus=ident.summary(), corpus_index=ident, sampler=SHARD_WINDOW_SAMPLER, window_shards=window)


def _state_of(exp: LiveJob, step: int = 4, **overrides):
    return candidate_for(step, exp, **overrides)


def test_a_state_of_another_corpus_is_incompatible_naming_the_shard(tmp_path):
    _write_shards(tmp_path / "old", [5, 5, 5, 5])
    _write_shards(tmp_path / "new", [5, 5, 6, 5])
    old = ShardedCorpus(str(tmp_path / "old" / "*.npy"), seq_len=4, cache=_settings(tmp_path)).identity()
    new = ShardedCorpus(str(tmp_path / "new" / "*.npy"), seq_len=4, cache=_settings(tmp_path)).identity()
    live = _corpus_job(new)
    state = _state_of(changed(_corpus_job(old), num_samples=new.rows))
    assert classify(_state_of(live), live).verdict is Verdict.RESUMABLE

    unnamed = classify(dataclasses.replace(state), live)
    assert unnamed.verdict is Verdict.INCOMPATIBLE
    assert "the sharded corpus differs from the state's" in unnamed.reason and "not read" in unnamed.reason
    named = dataclasses.replace(state, corpus_index=old)
    c = classify(named, live)
    assert c.verdict is Verdict.INCOMPATIBLE
    assert "shard s002.npy changed: 5 rows in the state's corpus, 6 now" in c.reason


def test_another_shuffle_or_window_is_incompatible_and_other_datasets_unaffected(tmp_path):
    _write_shards(tmp_path / "c", [5, 5, 5])
    ident = ShardedCorpus(str(tmp_path / "c" / "*.npy"), seq_len=4, cache=_settings(tmp_path)).identity()
    job = _corpus_job(ident, window=2)
    c = classify(_state_of(_corpus_job(ident, window=3)), job)
    assert c.verdict is Verdict.INCOMPATIBLE and "corpus.window_shards" in c.reason
    global_state = _state_of(changed(job, sampler=SAMPLER_VERSION, window_shards=None))
    c = classify(global_state, job)
    assert c.verdict is Verdict.INCOMPATIBLE and "corpus.shuffle" in c.reason and "global" in c.reason
    plain = live("j", 1, 2, 2, 10, 0, "f", 1, num_samples=ident.rows)
    c = classify(_state_of(job), plain)
    assert c.verdict is Verdict.INCOMPATIBLE and "the dataset differs" in c.reason
    assert classify(candidate_for(4, plain), plain).verdict is Verdict.RESUMABLE  # no corpus: as before


def test_a_run_on_another_dataset_writes_the_data_record_it_wrote_before():
    from syncpoint.policies.contracts.state_format import DataRecord

    plain = DataRecord(
        sampler=SAMPLER_VERSION,
        num_samples=8,
        global_samples=4,
        samples_in_epoch=4,
        samples_per_epoch=8,
        global_batch=4,
    ).model_dump()
    assert set(plain) == {
        "sampler",
        "num_samples",
        "global_samples",
        "samples_in_epoch",
        "samples_per_epoch",
        "global_batch",
    }
    assert DataRecord.model_validate(plain).corpus is None  # and states without the fields read back
    sharded = DataRecord.model_validate(
        {
            **plain,
            "sampler": SHARD_WINDOW_SAMPLER,
            "window_shards": 2,
            "corpus": {"digest": "ab", "shards": 3, "rows": 8},
        }
    )
    assert sharded.model_dump()["corpus"] == {"digest": "ab", "shards": 3, "rows": 8}
