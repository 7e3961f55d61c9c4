"""The tiny language model of ``examples.tiny_lm`` on a Hugging Face ``datasets`` corpus (no downloads).

On first use the example writes a small local corpus of synthetic documents, a few JSONL (or
Parquet) shards under ``task.config.corpus_dir``, and loads it with
``load_dataset(..., streaming=True)``: a ``datasets.IterableDataset`` that syncpoint splits per rank
(``split_dataset_by_node``), shuffles through ``train.stream_shuffle_buffer`` and resumes from each
rank's saved stream state. ``.map`` tokenizes each document and crops it at a random offset (random
per example: syncpoint seeds every example's draw by its position), ``.with_format("torch")`` makes
the tokens tensors, and the collate flips a few tokens at random (seeded per micro-batch).

``shard_shuffle: true`` adds ``datasets``' ``.shuffle(seed, buffer_size)`` (``shuffle_buffer_size``,
default 1: shard order only) before the ``.map``. It resumes exactly with any number of DataLoader
workers: ``datasets`` keeps the shard order, syncpoint runs the buffer and saves it.

``task.config.streaming: false`` loads the same corpus as a map-style ``datasets.Dataset`` instead
(no random crop: ``Dataset.map`` runs once, eagerly), which syncpoint orders and skips by index like
any map-style dataset. ``format: parquet`` writes Parquet shards instead of JSONL.
"""

from __future__ import annotations

import json
import os
import tempfile
from functools import partial
from typing import Any

import torch

from examples.tiny_lm import VOCAB, TinyLM, synthetic_corpus
from syncpoint.workers.task import Task

FORMATS = {"jsonl": ("json", "jsonl"), "parquet": ("parquet", "parquet")}


def corpus_files(corpus_dir: str, fmt: str, shards: int, docs_per_shard: int, doc_chars: int) -> list[str]:
    """The corpus's shard files, written once (every rank may call this at the same time: each file
    is written under a temporary name and renamed into place, with the same content whoever writes it)."""
    builder, ext = FORMATS[fmt]
    os.makedirs(corpus_dir, exist_ok=True)
    files = []
    for shard in range(shards):
        path = os.path.join(corpus_dir, f"shard_{shard:03d}.{ext}")
        if not os.path.exists(path):
            first = shard * docs_per_shard
            _write_atomically(path, [_document(first + i, doc_chars) for i in range(docs_per_shard)], first, fmt)
        files.append(path)
    return files


def _document(index: int, chars: int) -> str:
    codes = synthetic_corpus(chars, seed=1000 + index).tolist()
    return "".join(" " if c == 0 else chr(96 + c) for c in codes)


def _write_atomically(path: str, docs: list[str], first: int, fmt: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".partial-")
    os.close(fd)
    if fmt == "jsonl":
        with open(tmp, "w") as f:
            for i, text in enumerate(docs, start=first):
                f.write(json.dumps({"id": i, "text": text}) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(first, first + len(docs))), "text": docs}), tmp)
    os.replace(tmp, path)


def tokenize(example: dict[str, Any], *, seq_len: int, crop: bool) -> dict[str, Any]:
    """Characters to token ids, ``seq_len + 1`` of them (a random window when ``crop``)."""
    ids = [0 if ch == " " else (ord(ch) - 96) % VOCAB for ch in example["text"]]
    start = int(torch.randint(0, len(ids) - seq_len, ()).item()) if crop else 0
    return {"tokens": ids[start : start + seq_len + 1]}


def noisy_collate(examples: list[dict[str, torch.Tensor]], *, noise: float) -> torch.Tensor:
    """Stack the windows and flip a few tokens at random (seeded per micro-batch by syncpoint)."""
    x = torch.stack([e["tokens"] for e in examples])
    flip = torch.rand(x.shape) < noise
    x[flip] = torch.randint(1, VOCAB, (int(flip.sum()),))
    return x


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def build(config: dict) -> Task:
    from datasets import load_dataset

    seq_len = int(config.get("seq_len", 32))
    model = TinyLM(
        d_model=int(config.get("d_model", 32)),
        n_layers=int(config.get("n_layers", 1)),
        seq_len=seq_len,
        dropout=float(config.get("dropout", 0.1)),
    )
    fmt, streaming = str(config.get("format", "jsonl")), bool(config.get("streaming", True))
    corpus_dir = str(config.get("corpus_dir", "runs/stream_lm_corpus"))
    files = corpus_files(
        corpus_dir,
        fmt,
        int(config.get("shards", 4)),
        int(config.get("docs_per_shard", 64)),
        doc_chars=seq_len + int(config.get("doc_slack", 16)),
    )
    if streaming:
        ds = load_dataset(FORMATS[fmt][0], data_files=files, split="train", streaming=True)
        if config.get("shard_shuffle"):  # datasets' shuffle, reseeded every pass (its buffer: syncpoint's, saved)
            ds = ds.shuffle(
                seed=int(config.get("shard_shuffle_seed", 0)), buffer_size=int(config.get("shuffle_buffer_size", 1))
            )
        ds = ds.map(partial(tokenize, seq_len=seq_len, crop=True), remove_columns=["text"])
    else:
        ds = load_dataset(
            FORMATS[fmt][0], data_files=files, split="train", cache_dir=os.path.join(corpus_dir, ".hf-cache")
        )
        ds = ds.map(partial(tokenize, seq_len=seq_len, crop=False), remove_columns=["text"], keep_in_memory=True)
    ds = ds.with_format("torch")
    noise = float(config.get("noise", 0.05))
    return Task(model=model, dataset=ds, loss=lm_loss, collate=partial(noisy_collate, noise=noise))
