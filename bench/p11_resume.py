"""P11 part ``resume``: time from "resume at position P" to the first batch, syncpoint vs its peers.

One corpus of tiny records (record ``i`` is one int32 holding ``i``: any batch names its positions),
8 shards, written three ways from the same arrays: Parquet (pyarrow's default row groups of 1Mi
rows; what ``datasets`` streams), ``.npy`` token shards (what ``ShardedCorpus`` reads as
``tokens-npy`` with ``seq_len`` 1; torchdata's map-style loader reads the same corpus object) and
MDS shards written by ``streaming.MDSWriter`` (what MosaicML ``StreamingDataset`` reads). Full size:
8 x 13,333,334 records (1.07e8); ``--quick``: 8 x 133,334. The largest position (10^8, or 10^6 with
``--quick``) lies half-way into shard 7, and every position lies inside a row group: a shard-wise
or row-group-wise skip does its average work there, not its best.

Order: every peer reads the corpus in file order (no shuffle; ``datasets`` and MosaicML with
``shuffle=False``, torchdata with its sequential sampler), so an uninterrupted run's batch at P is
records P..P+15. syncpoint reads in its own epoch order (seed 0, epoch 0; the corpus's default
shard-window order, window 4, and the global per-position permutation; ``--quick``: the
shard-window order only, the goal's): its uninterrupted batch at P is micro-batch P/16 of that
order. A batch is 16 records, world size 1, no DataLoader workers.

What is timed, in a fresh process per system (imports done, the dataset object built and timed
apart as "open"; the saved state at hand): from giving the state (``load_state_dict``, or the
loader at the position) to holding the first batch. Each system resumes from what it saves:

* syncpoint map-style: ``epoch_loader(corpus, start=P/16)`` (index arithmetic; the position is the
  state's counters).
* syncpoint stream (``workers.stream``): a ``datasets`` stream read through syncpoint's stream path
  (``StreamSource`` over a ``RankStream``), resumed from its stream file's bytes at P.
* ``datasets``: ``IterableDataset.load_state_dict(state at P)``; ``IterableDataset.skip(P)``; and
  HF Trainer's resume of a stream, ``accelerate.skip_first_batches(DataLoader(stream), P/16)``
  (replays P examples; measured at the smaller positions and extrapolated, marked so).
* torchdata ``StatefulDataLoader`` over the ``datasets`` stream (its ``state_dict`` at P), and over
  the map-style corpus (its default: the sampler fast-forwarded P indices).
* MosaicML ``StreamingDataset``: ``state_dict(num_samples=P, from_beginning=True)`` taken while it
  iterates epoch 0, ``load_state_dict`` on a fresh one.

States: each comes from an uninterrupted run that reaches P, where that run is affordable (every
position for MosaicML and syncpoint, whose states are counters; 10^5 and 10^6 for the ``datasets``
streams, 10^5 for syncpoint's stream path: a per-example replay to 10^8 takes hours here; with
``--quick``, a decade less: 10^4 and 10^5, and 10^4). Beyond
those, the state at P is the system's own ``state_dict`` layout filled in for P (``datasets``: the
shard, the row group holding P and the rows into it), and the bench checks the filled-in state is
equal to the one the system wrote at every position where it ran, and that resuming from it
returns records P..P+15.

"Equal to uninterrupted": the resumed batch against the uninterrupted run's batch at P: the run
itself where it ran (its batch at P); elsewhere, for the in-order peers, records P..P+15 (what each
uninterrupted run returned at every measured position), for syncpoint its uninterrupted sampler's
micro-batch P/16 fetched the same way (what its uninterrupted loader yields at that step).
"""

from __future__ import annotations

import gc
import glob
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import types
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

BATCH = 16  # divides every position (10^4 ... 10^8)
SHARDS = 8
WINDOW = 4
FULL_ROWS, QUICK_ROWS = 13_333_334, 133_334
GOAL_FACTOR = 0.01


@dataclass(frozen=True)
class Corpus:
    """The bench corpus on local disk: 8 shards, record i holds i."""

    root: str
    shard_rows: int

    @property
    def n(self) -> int:
        return SHARDS * self.shard_rows

    @property
    def parquet_files(self) -> list[str]:
        return sorted(glob.glob(os.path.join(self.root, "parquet", "*.parquet")))

    @property
    def npy_glob(self) -> str:
        return os.path.join(self.root, "npy", "*.npy")

    @property
    def mds(self) -> str:
        return os.path.join(self.root, "mds")

    def records(self, first: int, count: int = BATCH) -> list[int]:
        """Records ``first..first+count-1`` read from the ``.npy`` shards (the ground truth)."""
        out: list[int] = []
        for i in range(first, first + count):
            shard, row = divmod(i, self.shard_rows)
            out.append(int(np.load(sorted(glob.glob(self.npy_glob))[shard], mmap_mode="r")[row]))
        return out


# ------------------------------------------------------------------ writing the corpus (cached)


def import_streaming() -> Any:
    """MosaicML ``streaming``: its package imports its vision datasets, which import torchvision;
    the CPU torch here has no matching torchvision (PyPI's is built against CUDA torch), and the
    bench reads MDS only, so that subpackage is stubbed out."""
    if "streaming" not in sys.modules:
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def _write_mds_part(root: str, shard: int, shard_rows: int) -> None:
    streaming = import_streaming()
    out = os.path.join(root, "mds", f"{shard:02d}")
    shutil.rmtree(out, ignore_errors=True)
    with streaming.MDSWriter(out=out, columns={"x": "int32"}) as writer:
        for i in range(shard * shard_rows, (shard + 1) * shard_rows):
            writer.write({"x": i})


def write_corpus(rows: int, root: str | None = None, row_group_rows: int | None = None) -> Corpus:
    """The corpus of ``SHARDS`` x ``rows`` records, written once under ``root`` (by default one
    directory per size under the temp directory; ``complete`` marks it whole). ``row_group_rows``:
    the Parquet row groups (pyarrow's default when None)."""
    corpus = Corpus(root or os.path.join(tempfile.gettempdir(), f"syncpoint-bench-p11-resume-{rows}"), rows)
    marker = os.path.join(corpus.root, "complete")
    if os.path.exists(marker):
        return corpus
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.rmtree(corpus.root, ignore_errors=True)
    for sub in ("parquet", "npy", "mds"):
        os.makedirs(os.path.join(corpus.root, sub))
    t0 = time.perf_counter()
    for k in range(SHARDS):
        x = np.arange(k * rows, (k + 1) * rows, dtype=np.int32)
        pq.write_table(
            pa.table({"x": x}),
            os.path.join(corpus.root, "parquet", f"shard-{k:02d}.parquet"),
            row_group_size=row_group_rows,
        )
        np.save(os.path.join(corpus.root, "npy", f"shard-{k:02d}.npy"), x)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:  # MDSWriter is per-sample Python: both cores
        list(pool.map(_write_mds_part, [corpus.root] * SHARDS, range(SHARDS), [rows] * SHARDS))
    import_streaming()
    from streaming.base.util import merge_index

    merge_index([os.path.join(corpus.mds, f"{k:02d}", "index.json") for k in range(SHARDS)], corpus.mds)
    with open(marker, "w") as f:
        f.write(f"{corpus.n} records in {time.perf_counter() - t0:.0f} s\n")
    return corpus
    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.rmtree(corpus.root, ignore_errors=True)
    for sub in ("parquet", "npy", "mds"):
        os.makedirs(os.path.join(corpus.root, sub))
    t0 = time.perf_counter()
    for k in range(SHARDS):
        x = np.arange(k * rows, (k + 1) * rows, dtype=np.int32)
        pq.write_table(pa.table({"x": x}), os.path.join(corpus.root, "parquet", f"shard-{k:02d}.parquet"))
        np.save(os.path.join(corpus.root, "npy", f"shard-{k:02d}.npy"), x)
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:  # MDSWriter is per-sample Python: both cores
        list(pool.map(_write_mds_part, [corpus.root] * SHARDS, range(SHARDS), [rows] * SHARDS))
    import_streaming()
    from streaming.base.util import merge_index

    merge_index([os.path.join(corpus.mds, f"{k:02d}", "index.json") for k in range(SHARDS)], corpus.mds)
    with open(marker, "w") as f:
        f.write(f"{corpus.n} records in {time.perf_counter() - t0:.0f} s\n")
    return corpus


# ------------------------------------------------------------------ what each system resumes from


@dataclass
class Resumed:
    """One resume: seconds to build the dataset object ("open"), seconds from the state to the
    first batch (the best of ``tries``), and that batch's records."""

    system: str
    position: int
    open_s: float
    resume_s: float
    batch: list[int]
    tries: int = 1


@dataclass
class Reached:
    """An uninterrupted run at a position: its state there, its batch there, seconds to get there."""

    position: int
    state: Any
    batch: list[int]
    seconds: float


def timed_resume(
    system: str, position: int, open_fn: Any, resume_fn: Any, budget_s: float = 2.0, max_tries: int = 5
) -> Resumed:
    """``open_fn()`` -> dataset object; ``resume_fn(obj)`` -> first batch's records. Repeated (a new
    object each time) while the tries take under ``budget_s``, up to ``max_tries``: the best one
    counts (the least disturbed by the machine's other load)."""
    best_open = best = float("inf")
    batch: list[int] = []
    tries = spent = 0
    while tries < max_tries and (tries == 0 or spent < budget_s):
        t0 = time.perf_counter()
        obj = open_fn()
        t1 = time.perf_counter()
        batch = resume_fn(obj)
        t2 = time.perf_counter()
        del obj
        gc.collect()
        best_open, best = min(best_open, t1 - t0), min(best, t2 - t1)
        tries, spent = tries + 1, spent + (t2 - t0)
    return Resumed(system, position, best_open, best, batch, tries)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    import logging

    for name in ("datasets", "streaming", "torchdata"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _values(batch: Any) -> list[int]:
    import torch

    if isinstance(batch, dict):
        batch = batch["x"]
    if isinstance(batch, torch.Tensor):
        return [int(v) for v in batch.flatten().tolist()]
    return [int(v) for v in batch]


def _take(iterator: Any, count: int = BATCH) -> list[int]:
    """The next ``count`` examples' records; the iterator closed afterwards (a generator left to the
    interpreter's exit logs errors from datasets' cleanup)."""
    out = [int(next(iterator)["x"]) for _ in range(count)]
    close = getattr(iterator, "close", None)
    if callable(close):
        close()
    return out


# syncpoint map-style: the position is the counters; the loader at it is the resume.


def _sampler(order: str) -> tuple[str, int | None]:
    from syncpoint.policies.contracts.state_format import SAMPLER_VERSION, SHARD_WINDOW_SAMPLER

    return (SHARD_WINDOW_SAMPLER, WINDOW) if order == "shard-window" else (SAMPLER_VERSION, None)


def _open_corpus(corpus: Corpus) -> Any:
    from syncpoint.workers.data.corpus import CacheSettings, ShardedCorpus

    c = ShardedCorpus(corpus.npy_glob, seq_len=1, cache=CacheSettings(os.path.join(corpus.root, "cache"), 1 << 40))
    len(c)  # the index (cached on this node after the first open)
    return c


def _syncpoint_loader(corpus_obj: Any, order: str, start: int) -> Any:
    from syncpoint.workers.data.sampler import epoch_loader

    sampler, window = _sampler(order)
    return epoch_loader(
        corpus_obj,
        micro_batch_size=BATCH,
        world_size=1,
        rank=0,
        seed=0,
        epoch=0,
        start=start,
        collate=None,
        num_workers=0,
        sampler=sampler,
        window_shards=window,
    )


def syncpoint_resume(corpus: Corpus, order: str, positions: list[int]) -> list[Resumed]:
    _quiet()
    timed_resume(
        "warm-up", 0, lambda: _open_corpus(corpus), lambda c: _values(next(iter(_syncpoint_loader(c, order, 0))))
    )
    return [
        timed_resume(
            f"syncpoint {order}",
            p,
            lambda: _open_corpus(corpus),
            lambda c, p=p: _values(next(iter(_syncpoint_loader(c, order, p // BATCH)))),
        )
        for p in positions
    ]


def syncpoint_uninterrupted(corpus: Corpus, order: str, position: int) -> Reached:
    """The uninterrupted loader from micro-batch 0, iterated to the position's micro-batch."""
    _quiet()
    c = _open_corpus(corpus)
    t0 = time.perf_counter()
    for m, batch in enumerate(_syncpoint_loader(c, order, 0)):
        if m == position // BATCH:
            return Reached(position, None, _values(batch), time.perf_counter() - t0)
    raise AssertionError("the epoch ended before the position")


def syncpoint_expected(corpus: Corpus, order: str, position: int) -> list[int]:
    """The records of the uninterrupted sampler's micro-batch ``position / BATCH`` (what its
    uninterrupted loader yields at that step: ``RankMicroBatches`` yields ``indices(i)`` for each i)."""
    from syncpoint.workers.data.sampler import RankMicroBatches

    sampler, window = _sampler(order)
    shard_rows = np.full(SHARDS, corpus.shard_rows, dtype=np.int64) if window else None
    batches = RankMicroBatches(
        corpus.n, BATCH, 1, 0, 0, 0, 0, sampler=sampler, shard_rows=shard_rows, window_shards=window
    )
    return [corpus.records(i, 1)[0] for i in batches.indices(position // BATCH)]


# datasets: a stream of the Parquet shards.


def _hf_stream(corpus: Corpus) -> Any:
    from datasets import load_dataset

    return load_dataset("parquet", data_files=corpus.parquet_files, split="train", streaming=True)


def hf_uninterrupted(corpus: Corpus, positions: list[int]) -> list[Reached]:
    """One pass from 0: the stream's ``state_dict()`` at each position, then the batch there."""
    _quiet()
    ds = _hf_stream(corpus)
    it, count, out = iter(ds), 0, []
    t0 = time.perf_counter()
    for p in sorted(positions):
        for _ in range(p - count):
            next(it)
        reached = time.perf_counter() - t0
        state = ds.state_dict()
        out.append(Reached(p, state, [int(next(it)["x"]) for _ in range(BATCH)], reached))
        count = p + BATCH
    it.close()
    return out


def _hf_loaded(ds: Any, state: Any) -> list[int]:
    ds.load_state_dict(state)
    return _take(iter(ds))


def hf_resume(corpus: Corpus, jobs: list[tuple[int, Any]]) -> list[Resumed]:
    _quiet()
    timed_resume("warm-up", 0, lambda: _hf_stream(corpus), lambda ds: _take(iter(ds)))
    return [
        timed_resume("datasets load_state_dict", p, lambda: _hf_stream(corpus), lambda ds, s=s: _hf_loaded(ds, s))
        for p, s in jobs
    ]


def hf_skip(corpus: Corpus, positions: list[int]) -> list[Resumed]:
    _quiet()
    timed_resume("warm-up", 0, lambda: _hf_stream(corpus), lambda ds: _take(iter(ds.skip(BATCH))))
    return [
        timed_resume("datasets skip", p, lambda: _hf_stream(corpus), lambda ds, p=p: _take(iter(ds.skip(p))))
        for p in positions
    ]


def _hf_trainer_first(ds: Any, position: int) -> list[int]:
    from accelerate import skip_first_batches
    from torch.utils.data import DataLoader

    loader = skip_first_batches(DataLoader(ds, batch_size=BATCH), position // BATCH)
    return _values(next(iter(loader)))


def hf_trainer(corpus: Corpus, positions: list[int]) -> list[Resumed]:
    """HF Trainer's resume of a stream: a DataLoader over it with accelerate's skip_first_batches
    (every skipped batch fetched and collated)."""
    _quiet()
    timed_resume("warm-up", 0, lambda: _hf_stream(corpus), lambda ds: _hf_trainer_first(ds, BATCH))
    return [
        timed_resume(
            "HF Trainer skip_first_batches",
            p,
            lambda: _hf_stream(corpus),
            lambda ds, p=p: _hf_trainer_first(ds, p),
            max_tries=1,
        )
        for p in positions
    ]


def hf_state_at(corpus: Corpus, template: dict[str, Any], position: int) -> dict[str, Any]:
    """``datasets``' ``state_dict()`` of the Parquet stream after ``position`` examples, filled in
    from the shards' row groups: the example before the position lies in row group [start, end) of
    its shard; the inner iterable has read that group, the rebatching one yielded ``row + 1 - start``
    one-row chunks of it since the inner state before the group (the layout of ``template``, a state
    datasets wrote)."""
    import copy

    import pyarrow.parquet as pq

    shard, row = divmod(position - 1, corpus.shard_rows)
    meta = pq.ParquetFile(corpus.parquet_files[shard]).metadata
    ends = np.cumsum([meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
    g = int(np.searchsorted(ends, row, side="right"))
    start, end = (int(ends[g - 1]) if g else 0), int(ends[g])
    state = copy.deepcopy(template)
    rebatched = state["examples_iterable"]
    rebatched["examples_iterable"].update(shard_idx=shard, shard_example_idx=end)
    # before a shard's first group, the inner iterable's state is the end of the previous shard
    before = (shard - 1, corpus.shard_rows) if start == 0 and shard else (shard, start)
    rebatched["previous_state"].update(shard_idx=before[0], shard_example_idx=before[1])
    rebatched.update(batch_idx=position, num_chunks_since_previous_state=row + 1 - start, cropped_chunk_length=0)
    return state


# torchdata StatefulDataLoader: over the datasets stream, and over the map-style corpus.


def _sdl(dataset: Any) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(dataset, batch_size=BATCH)


def sdl_uninterrupted(corpus: Corpus, over: str, positions: list[int]) -> list[Reached]:
    _quiet()
    loader = _sdl(_hf_stream(corpus) if over == "stream" else _open_corpus(corpus))
    it, count, out = iter(loader), 0, []
    t0 = time.perf_counter()
    for p in sorted(positions):
        for _ in range((p - count) // BATCH):
            next(it)
        reached = time.perf_counter() - t0
        state = loader.state_dict()
        out.append(Reached(p, state, _values(next(it)), reached))
        count = p + BATCH
    del it
    gc.collect()
    return out


def _sdl_loaded(loader: Any, state: Any) -> list[int]:
    loader.load_state_dict(state)
    it = iter(loader)
    batch = _values(next(it))
    del it
    return batch


def sdl_resume(corpus: Corpus, over: str, jobs: list[tuple[int, Any]]) -> list[Resumed]:
    _quiet()

    def open_fn() -> Any:
        return _sdl(_hf_stream(corpus) if over == "stream" else _open_corpus(corpus))

    timed_resume("warm-up", 0, open_fn, lambda loader: _values(next(iter(loader))))
    name = "torchdata StatefulDataLoader " + (
        "(datasets stream)" if over == "stream" else "(map-style corpus, fast-forward)"
    )
    return [timed_resume(name, p, open_fn, lambda loader, s=s: _sdl_loaded(loader, s)) for p, s in jobs]


def sdl_state_at(corpus: Corpus, over: str, template: dict[str, Any], position: int) -> dict[str, Any]:
    """torchdata's ``state_dict()`` after ``position // BATCH`` batches (``template``'s layout): the
    counts, and for the stream the dataset's own state at the position."""
    import copy

    state = copy.deepcopy(template)
    if state["_sampler_iter_state"] is not None:  # None in syncpoint's loader (batch_size None: no sampler)
        state["_sampler_iter_state"]["samples_yielded"] = position
    state["_sampler_iter_yielded"] = state["_num_yielded"] = position // BATCH
    if over == "stream":
        state["dataset_state"] = hf_state_at(corpus, template["dataset_state"], position)
    return state


# syncpoint's stream path over the same datasets stream.


def _stream_source(hf_stream: Any, saved: Any) -> Any:
    from datasets.distributed import split_dataset_by_node

    from syncpoint.workers.data.stream import PreparedStream, RankStream, StreamSource

    stream = RankStream(
        split_dataset_by_node(hf_stream, rank=0, world_size=1),
        seed=0,
        rank=0,
        micro_batch_size=BATCH,
        collate=None,
        shuffle_buffer=0,
    )
    return StreamSource(
        PreparedStream(stream, {}, None),
        seed=0,
        rank=0,
        num_workers=0,  # type: ignore[arg-type]
        saved=saved,
    )


def stream_uninterrupted(corpus: Corpus, positions: list[int]) -> list[Reached]:
    """syncpoint's stream path from 0: the rank's stream file (bytes) at each position."""
    _quiet()
    source = _stream_source(_hf_stream(corpus), None)
    count, out = 0, []
    t0 = time.perf_counter()
    for p in sorted(positions):
        for _ in range((p - count) // BATCH):
            source.next_batch()
        reached = time.perf_counter() - t0
        state = source.capture()
        out.append(Reached(p, state, _values(source.next_batch()), reached))
        count = p + BATCH
    source.close()
    return out


def _stream_loaded(hf_stream: Any, data: bytes) -> list[int]:
    from syncpoint.workers.data.stream_state import parse

    source = _stream_source(hf_stream, parse(data, "stream/rank_00000.safetensors"))
    batch = _values(source.next_batch())
    source.close()
    return batch


def stream_resume(corpus: Corpus, jobs: list[tuple[int, bytes]]) -> list[Resumed]:
    _quiet()

    def first(hf_stream: Any) -> list[int]:
        source = _stream_source(hf_stream, None)
        batch = _values(source.next_batch())
        source.close()
        return batch

    timed_resume("warm-up", 0, lambda: _hf_stream(corpus), first)
    return [
        timed_resume(
            "syncpoint stream (datasets inside)", p, lambda: _hf_stream(corpus), lambda ds, d=d: _stream_loaded(ds, d)
        )
        for p, d in jobs
    ]


def stream_state_at(corpus: Corpus, template: bytes, position: int) -> bytes:
    """The stream file at ``position`` (``template``'s layout): the loader's counts, the rank
    stream's counts and the datasets stream's state inside."""
    from syncpoint.workers.data.stream_state import SavedStream, encode, parse

    saved = parse(template, "stream/rank_00000.safetensors")
    loader = sdl_state_at(corpus, "map", saved.loader, position)  # the counts alone
    inner = loader["dataset_state"]
    inner["inner"] = hf_state_at(corpus, inner["inner"], position)
    inner.update(examples=position, batches=position // BATCH)
    return encode(SavedStream(saved.pass_number, loader))


# MosaicML StreamingDataset over the MDS shards.


def _mosaic(corpus: Corpus) -> Any:
    streaming = import_streaming()
    return streaming.StreamingDataset(local=corpus.mds, shuffle=False, batch_size=BATCH)


def mosaic_states(corpus: Corpus, positions: list[int], replay_to: int | None) -> tuple[list[Reached], Any]:
    """Its ``state_dict(num_samples=P, from_beginning=True)`` at each position, taken while it
    iterates epoch 0 (a count: the run need not reach P for it), and an uninterrupted pass to
    ``replay_to`` (its batch there)."""
    _quiet()
    import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    ds = _mosaic(corpus)
    it = iter(ds)
    next(it)
    states = [Reached(p, ds.state_dict(num_samples=p, from_beginning=True), [], 0.0) for p in positions]
    reference = None
    if replay_to is not None:
        t0 = time.perf_counter()
        for _ in range(replay_to - 1):
            next(it)
        reached = time.perf_counter() - t0
        reference = Reached(replay_to, None, [int(next(it)["x"]) for _ in range(BATCH)], reached)
    del it, ds
    gc.collect()
    return states, reference


def _mosaic_loaded(ds: Any, state: Any) -> list[int]:
    ds.load_state_dict(state)
    it = iter(ds)
    batch = [int(next(it)["x"]) for _ in range(BATCH)]
    del it
    return batch


def mosaic_resume(corpus: Corpus, jobs: list[tuple[int, Any]]) -> list[Resumed]:
    _quiet()
    import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    timed_resume("warm-up", 0, lambda: _mosaic(corpus), lambda ds: _take(iter(ds)))
    return [
        timed_resume(
            "MosaicML StreamingDataset load_state_dict",
            p,
            lambda: _mosaic(corpus),
            lambda ds, s=s: _mosaic_loaded(ds, s),
        )
        for p, s in jobs
    ]


# ------------------------------------------------------------------ the part


def in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new (spawned) interpreter: each system resumes as a restarted process does,
    none inherits another's caches, threads or shared memory. Its name and time go to stderr."""
    t0 = time.perf_counter()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        out = pool.submit(fn, *args).result()
    print(
        f"  [resume] {fn.__name__}{tuple(a for a in args[1:] if isinstance(a, str))}: {time.perf_counter() - t0:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    return out


@dataclass
class Plan:
    positions: list[int]  # where every system resumes
    real: list[int]  # where the datasets streams' uninterrupted runs go (their states there are real)
    real_stream: list[int]  # the same for syncpoint's stream path (a slower replay: seeded per example)
    real_map: list[int]  # the same for torchdata's map-style loader (a cheap replay)
    replay: list[int]  # where HF Trainer's replay is measured (extrapolated beyond)


def plan(quick: bool) -> Plan:
    if quick:  # the full plan one decade down: the largest position's states filled in, as at 10^8
        return Plan([10**4, 10**5, 10**6], [10**4, 10**5], [10**4], [10**4, 10**5], [10**4, 10**5])
    return Plan([10**5, 10**6, 10**7, 10**8], [10**5, 10**6], [10**5], [10**5, 10**6, 10**7], [10**5, 10**6])


@dataclass
class Row:
    system: str
    position: int
    open_s: float | None
    resume_s: float
    equal: bool | None  # None: not run (extrapolated)
    reference: str
    peer: bool
    extrapolated: bool = False


def _exp(p: int) -> str:
    e = round(np.log10(p))
    return f"10^{e}" if 10**e == p else str(p)


def filled_states(reached: list[Reached], positions: list[int], fill: Any) -> tuple[list[tuple[int, Any]], str]:
    """The state at each position: the run's own where it went, else ``fill(template, p)``; and a
    line saying whether ``fill`` reproduces every state the run wrote."""
    template = reached[0].state
    own = {r.position: r.state for r in reached}
    same = [fill(template, r.position) == r.state for r in reached]
    filled = [p for p in positions if p not in own]
    line = (
        (
            f"filled-in state at {', '.join(_exp(p) for p in filled)}; equal to the state it wrote at "
            f"{', '.join(_exp(r.position) for r in reached)}: {'yes' if all(same) else 'NO'}"
        )
        if filled
        else "every state written by its uninterrupted run"
    )
    return [(p, own[p] if p in own else fill(template, p)) for p in positions], line


def _rows(results: list[Resumed], expected: dict[int, list[int]], reference: dict[int, str], peer: bool) -> list[Row]:
    return [
        Row(r.system, r.position, r.open_s, r.resume_s, r.batch == expected[r.position], reference[r.position], peer)
        for r in results
    ]


def part_resume(quick: bool) -> Any:
    from bench.p11_data_scale import Part

    t0 = time.perf_counter()
    corpus = write_corpus(QUICK_ROWS if quick else FULL_ROWS)
    pl = plan(quick)
    target = pl.positions[-1]
    notes: list[str] = [
        f"corpus: {corpus.n:,} records in {SHARDS} shards at {corpus.root} "
        f"(written in {time.perf_counter() - t0:.0f} s this run; kept for the next)"
    ]
    records = {p: corpus.records(p) for p in pl.positions}
    rows: list[Row] = []

    # syncpoint map-style, both orders (--quick: the default shard-window one, the goal's): the
    # uninterrupted run at the first position, its sampler beyond
    for order in ("shard-window",) if quick else ("shard-window", "global"):
        expected = {p: syncpoint_expected(corpus, order, p) for p in pl.positions}
        run = in_fresh_process(syncpoint_uninterrupted, corpus, order, pl.positions[0])
        ref = {p: "its uninterrupted run" if p == run.position else "its uninterrupted sampler" for p in pl.positions}
        expected[run.position] = run.batch
        rows += _rows(in_fresh_process(syncpoint_resume, corpus, order, pl.positions), expected, ref, False)
        notes.append(
            f"syncpoint {order}: the uninterrupted loader's batch at {_exp(run.position)} "
            f"{'equals' if run.batch == syncpoint_expected(corpus, order, run.position) else 'DIFFERS from'}"
            f" its sampler's micro-batch there ({run.seconds:.1f} s to get there)"
        )

    def in_order(reached: list[Reached], name: str) -> dict[int, str]:
        ok = all(r.batch == records.get(r.position, corpus.records(r.position)) for r in reached)
        notes.append(
            f"{name}: its uninterrupted run's batch at {', '.join(_exp(r.position) for r in reached)} "
            f"{'is' if ok else 'is NOT'} records P..P+{BATCH - 1} (file order); "
            + ", ".join(f"{r.seconds:.1f} s to {_exp(r.position)}" for r in reached)
        )
        return {
            p: "its uninterrupted run" if p in {r.position for r in reached} else "records P.. (file order)"
            for p in pl.positions
        }

    # datasets: load_state_dict, skip, HF Trainer's replay
    reached = in_fresh_process(hf_uninterrupted, corpus, pl.real)
    ref = in_order(reached, "datasets")
    expected = {**records, **{r.position: r.batch for r in reached}}
    jobs, line = filled_states(reached, pl.positions, lambda t, p: hf_state_at(corpus, t, p))
    notes.append(f"datasets load_state_dict: {line}")
    rows += _rows(in_fresh_process(hf_resume, corpus, jobs), expected, ref, True)
    rows += _rows(in_fresh_process(hf_skip, corpus, pl.positions), expected, ref, True)
    replayed = in_fresh_process(hf_trainer, corpus, pl.replay)
    rows += _rows(replayed, expected, ref, True)
    slope, intercept = np.polyfit([r.position for r in replayed], [r.resume_s for r in replayed], 1)
    for p in pl.positions:
        if p not in pl.replay:
            rows.append(
                Row(
                    replayed[0].system,
                    p,
                    None,
                    float(intercept + slope * p),
                    None,
                    f"extrapolated from {', '.join(_exp(q) for q in pl.replay)}",
                    True,
                    True,
                )
            )
    notes.append(
        f"HF Trainer skip_first_batches: {slope * 1e6:.2f} us per replayed example (a line through "
        f"{', '.join(f'{_exp(r.position)}: {r.resume_s:.2f} s' for r in replayed)})"
    )

    # torchdata StatefulDataLoader over the stream and over the map-style corpus
    for over, real in (("stream", pl.real), ("map", pl.real_map)):
        reached = in_fresh_process(sdl_uninterrupted, corpus, over, real)
        name = f"torchdata ({'datasets stream' if over == 'stream' else 'map-style corpus'})"
        ref = in_order(reached, name)
        expected = {**records, **{r.position: r.batch for r in reached}}
        jobs, line = filled_states(reached, pl.positions, lambda t, p, over=over: sdl_state_at(corpus, over, t, p))
        notes.append(f"{name}: {line}")
        rows += _rows(in_fresh_process(sdl_resume, corpus, over, jobs), expected, ref, True)

    # syncpoint's stream path
    reached = in_fresh_process(stream_uninterrupted, corpus, pl.real_stream)
    ref = in_order(reached, "syncpoint stream")
    expected = {**records, **{r.position: r.batch for r in reached}}
    jobs, line = filled_states(reached, pl.positions, lambda t, p: stream_state_at(corpus, t, p))
    notes.append(f"syncpoint stream: {line}")
    rows += _rows(in_fresh_process(stream_resume, corpus, jobs), expected, ref, False)

    # MosaicML Streaming
    states, mosaic_run = in_fresh_process(mosaic_states, corpus, pl.positions, pl.positions[0])
    ref = in_order([mosaic_run], "MosaicML StreamingDataset")
    expected = {**records, mosaic_run.position: mosaic_run.batch}
    rows += _rows(in_fresh_process(mosaic_resume, corpus, [(s.position, s.state) for s in states]), expected, ref, True)
    return _report(Part, rows, notes, target, time.perf_counter() - t0)


def _report(part_cls: Any, rows: list[Row], notes: list[str], target: int, seconds: float) -> Any:
    part = part_cls(
        f"(c) resume at position P to the first batch (batch {BATCH}, world size 1; best of up to 5 "
        "tries in a fresh process per system)",
        ("system", "P", "open (s)", "to first batch (s)", "equal to uninterrupted", "compared with"),
    )
    for r in rows:
        seconds_cell = f"~{r.resume_s:.2f} (extrapolated)" if r.extrapolated else f"{r.resume_s:.4f}"
        equal = "not run" if r.equal is None else ("yes" if r.equal else "NO")
        part.rows.append(
            (
                r.system,
                _exp(r.position),
                "-" if r.open_s is None else f"{r.open_s:.3f}",
                seconds_cell,
                equal,
                r.reference,
            )
        )
    ours = next(r for r in rows if r.system == "syncpoint shard-window" and r.position == target)
    peers = [r for r in rows if r.peer and r.position == target and r.equal is not False]
    best = min(peers, key=lambda r: r.resume_s, default=None)
    exp = round(np.log10(target))
    part.goals.append(_speed_goal(ours, best, exp))
    ours_equal = all(r.equal for r in rows if not r.peer)
    part.goals.append(
        f"goal resumed_batches_equal: {'yes' if ours_equal else 'no'} vs yes: {'met' if ours_equal else 'not met'}"
    )
    part.goals.append(
        "(peers' first resumed batch at 10^{}: {})".format(
            exp,
            ", ".join(
                f"{r.system} {'yes' if r.equal else 'NO'}"
                for r in rows
                if r.peer and r.position == target and r.equal is not None
            ),
        )
    )
    versus = "no peer to compare with" if best is None else f"{best.resume_s / ours.resume_s:,.0f}x faster"
    part.goals.append(f"(syncpoint at 10^{exp} vs the best peer: {versus}; part (c) took {seconds:.0f} s)")
    part.notes += notes
    return part


def _speed_goal(ours: Row, best: Row | None, exp: int) -> str:
    """The goal line of the time to the first batch; with no peer that resumed to its own
    uninterrupted batch there is nothing to compare with, and the line says so."""
    head = f"goal resume_to_first_batch_1e{exp}: {ours.resume_s:.4f} s vs <= {GOAL_FACTOR}x best peer"
    if best is None:
        return f"{head} (none resumed to its uninterrupted batch): not met"
    ok = ours.resume_s <= GOAL_FACTOR * best.resume_s
    extrapolated = ", extrapolated" if best.extrapolated else ""
    return f"{head} ({best.resume_s:.4f} s, {best.system}{extrapolated}): {'met' if ok else 'not met'}"
