"""Stream tasks for tests: a stateful custom stream, and the datasets example with datasets' own shuffle."""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from examples.tiny_lm import VOCAB
from syncpoint.workers.task import Task
from tests.tasks import mse


class CountingStream(torch.utils.data.IterableDataset):
    """A stateful stream of ``n`` fixed vectors and their sums, the contract of a custom stream:
    ``split(rank, world_size)`` gives each rank every ``world_size``-th example, each DataLoader
    worker takes its share (``get_worker_info``), ``state_dict`` is the next index of this copy.
    Each example is augmented from the global torch RNG and from the stream's own NumPy generator,
    so a resume is exact only if both are seeded by position."""

    def __init__(self, n: int, dim: int = 4, part: int = 0, parts: int = 1, bad_state: bool = False) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, dim, generator=g)
        self.n, self.dim, self.part, self.parts, self.bad_state = n, dim, part, parts, bad_state
        self.rng = np.random.default_rng(11)
        self.next, self.loaded, self.epoch = 0, False, 0

    def split(self, rank: int, world_size: int) -> CountingStream:
        return CountingStream(self.n, self.dim, rank, world_size, self.bad_state)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict:
        state = {"next": self.next}
        if self.bad_state:
            state["seen"] = {self.next}  # a set: no JSON value
        return state

    def load_state_dict(self, state: dict) -> None:
        self.next, self.loaded = state["next"], True

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if not self.loaded:
            self.next = 0
        self.loaded = False
        shares = self.parts * workers
        mine = self.part * workers + worker
        for i in range(self.next, self.n):
            if i % shares != mine:
                continue
            self.next = i + 1
            noise = 0.01 * torch.randn(self.dim) + float(self.rng.normal()) * 0.01
            yield self.x[i] + noise, self.x[i].sum(dim=0, keepdim=True)


def counting_stream(config: dict) -> Task:
    dim = int(config.get("dim", 4))
    model = torch.nn.Sequential(torch.nn.Linear(dim, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    data = CountingStream(int(config.get("num_samples", 24)), dim, bad_state=bool(config.get("bad_state", False)))
    return Task(model=model, dataset=data, loss=mse)


def hf_buffer_shuffled(config: dict) -> Task:
    """The datasets example with datasets' own ``.shuffle(seed, buffer_size)`` (syncpoint runs its buffer)
    before the random ``.map``."""
    from examples.stream_lm import build

    seed, size = int(config.get("hf_shuffle_seed", 3)), int(config.get("hf_buffer", 8))
    return build({**config, "shard_shuffle": True, "shard_shuffle_seed": seed, "shuffle_buffer_size": size})


def hf_already_split(config: dict) -> Task:
    """The datasets example split by the task itself (refused: syncpoint splits the whole stream)."""
    from datasets.distributed import split_dataset_by_node

    from examples.stream_lm import build

    task = build(config)
    task.dataset = split_dataset_by_node(task.dataset, rank=0, world_size=1)
    return task


OFFSET = 0  # read by _offset_tokens: a module-level value the stream's .map depends on (tests change it)


def _offset_tokens(example: dict) -> dict:
    return {"tokens": (example["tokens"] + OFFSET) % VOCAB}


def hf_offset_mapped(config: dict) -> Task:
    """The datasets example with one more ``.map``, whose result depends on a module-level value."""
    from examples.stream_lm import build

    task = build(config)
    task.dataset = task.dataset.map(_offset_tokens)
    return task


def hf_interleaved(config: dict) -> Task:
    """The datasets example with its corpus read as two streams mixed by ``interleave_datasets(probabilities=...,
    seed=...)``: the mixture's state holds a NumPy PCG64 generator state (128-bit integers), which must resume."""
    from datasets import interleave_datasets, load_dataset

    from examples.stream_lm import build, corpus_files, tokenize

    task = build(config)
    seq_len = int(config.get("seq_len", 32))
    files = corpus_files(
        str(config["corpus_dir"]),
        "jsonl",
        int(config.get("shards", 4)),
        int(config.get("docs_per_shard", 64)),
        doc_chars=seq_len + int(config.get("doc_slack", 16)),
    )
    half = len(files) // 2
    sources = [
        load_dataset("json", data_files=part, split="train", streaming=True) for part in (files[:half], files[half:])
    ]
    mixed = interleave_datasets(sources, probabilities=[0.3, 0.7], seed=int(config.get("mix_seed", 7)))
    task.dataset = mixed.map(partial(tokenize, seq_len=seq_len, crop=True), remove_columns=["text"]).with_format(
        "torch"
    )
    return task


# ----------------------------------------------------------------------------- compositions of datasets steps


def _crop(ids: list[int], seq_len: int, random_crop: bool) -> list[int]:
    start = int(torch.randint(0, len(ids) - seq_len, ()).item()) if random_crop else 0
    return ids[start : start + seq_len + 1]


def _token_ids(text: str) -> list[int]:
    return [0 if ch == " " else (ord(ch) - 96) % VOCAB for ch in text]


def tokenize_one(example: dict, *, seq_len: int, random_crop: bool) -> dict:
    return {"tokens": _crop(_token_ids(example["text"]), seq_len, random_crop)}


def tokenize_batch(batch: dict, *, seq_len: int, random_crop: bool) -> dict:
    """The batched form: the whole batch computed in one call, its crops drawn one after another."""
    return {"tokens": [_crop(_token_ids(text), seq_len, random_crop) for text in batch["text"]]}


def keep_one(example: dict, *, random_keep: bool) -> bool:
    """Keep about three examples in four: at random, or by id."""
    return bool(torch.rand(()) < 0.75) if random_keep else int(example["id"]) % 4 != 3


def keep_batch(batch: dict, *, random_keep: bool) -> list[bool]:
    if random_keep:
        return [bool(k) for k in torch.rand(len(batch["id"])) < 0.75]
    return [int(i) % 4 != 3 for i in batch["id"]]


def composed(config: dict) -> Task:
    """The stream example's corpus through a composition of ``datasets`` steps, each drawn by the
    stream property test (``tests/integration/workers/data/test_stream_property_streams.py``):

    * ``interleave``: the shards as two sources (even and odd shards), ``interleave_datasets``'d;
      ``probabilities``: with probabilities and a seed;
    * ``map``: ``none``, ``plain`` or ``random`` (a random crop); ``map_batch``: 0 (per example) or a
      batch size; ``map_first``: the map on each source, before the interleave and the shuffle;
    * ``shuffle``: ``none``, ``shards`` (``.shuffle(seed, buffer_size=1)``) or ``buffer``
      (``.shuffle(seed, shuffle_buffer_size)``);
    * ``filter``: ``none``, ``plain`` (by id) or ``random``; ``filter_batch``: 0 or a batch size.

    The collate is the example's (it flips tokens at random)."""
    from functools import partial

    from datasets import interleave_datasets, load_dataset

    from examples.stream_lm import corpus_files, lm_loss, noisy_collate
    from examples.tiny_lm import TinyLM

    seq_len = int(config.get("seq_len", 8))
    files = corpus_files(
        str(config["corpus_dir"]), "jsonl", int(config.get("shards", 4)), int(config.get("docs_per_shard", 10)), 24
    )
    kind, batch = str(config.get("map", "random")), int(config.get("map_batch", 0))
    settings = {"seq_len": seq_len, "random_crop": kind == "random"}
    tokens = partial(tokenize_batch if batch else tokenize_one, **settings)

    def mapped(ds):
        extra = {"batched": True, "batch_size": batch} if batch else {}
        return ds.map(tokens, remove_columns=["text"], **extra) if kind != "none" else ds

    def load(shard_files):
        ds = load_dataset("json", data_files=shard_files, split="train", streaming=True)
        return mapped(ds) if config.get("map_first") else ds

    if config.get("interleave"):
        sources = [load(files[0::2]), load(files[1::2])]
        chance = {"probabilities": [0.5, 0.5], "seed": 11} if config.get("probabilities") else {}
        ds = interleave_datasets(sources, **chance)
    else:
        ds = load(files)
    shuffle = str(config.get("shuffle", "none"))
    if shuffle != "none":
        size = 1 if shuffle == "shards" else int(config.get("shuffle_buffer_size", 6))
        ds = ds.shuffle(seed=int(config.get("shuffle_seed", 5)), buffer_size=size)
    keep, filter_batch = str(config.get("filter", "none")), int(config.get("filter_batch", 0))
    if keep != "none":
        rule = partial(keep_batch if filter_batch else keep_one, random_keep=keep == "random")
        ds = ds.filter(rule, **({"batched": True, "batch_size": filter_batch} if filter_batch else {}))
    if not config.get("map_first"):
        ds = mapped(ds)
    if kind == "none":  # the text itself, cut to a window: the collate stacks tokens
        ds = ds.map(partial(tokenize_one, seq_len=seq_len, random_crop=False), remove_columns=["text"])
    model = TinyLM(d_model=int(config.get("d_model", 16)), n_layers=1, seq_len=seq_len, dropout=0.1)
    return Task(model=model, dataset=ds.with_format("torch"), loss=lm_loss, collate=partial(noisy_collate, noise=0.05))
