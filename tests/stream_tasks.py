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
    """The datasets example with datasets' own ``.shuffle(seed, buffer_size)`` (syncpoint runs its buffer),
    before the random ``.map``: datasets reads a shuffle's shards in threads, where a ``.map`` after it
    draws unseeded."""
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
