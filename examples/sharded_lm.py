"""The tiny language model of ``examples.tiny_lm`` trained on a sharded token corpus on storage.

``task.config.shards`` names the corpus (a glob or URLs of ``.npy`` token shards, local or
``s3://``); each sample is a row of ``seq_len + 1`` tokens (inputs and shifted targets), with a
random per-sample token noise (data-side randomness, as in the tiny example). Write a synthetic
corpus to try it:

    python -m examples.sharded_lm write /tmp/corpus --shards 16 --rows 64 --seq-len 32
    syncpoint run examples/tiny_lm.yaml --set task.path=examples.sharded_lm:build \\
        --set 'task.config={shards: "/tmp/corpus/*.npy", seq_len: 32}' --set train.eval_every=0 \\
        --set corpus.window_shards=4
"""

from __future__ import annotations

import argparse
import functools
import io
from typing import Any

import fsspec
import numpy as np
import torch

from examples.tiny_lm import VOCAB, TinyLM, lm_loss, synthetic_corpus
from syncpoint import ShardedCorpus
from syncpoint.workers.task import Task


def add_noise(tokens: torch.Tensor, noise: float) -> torch.Tensor:
    """Flip a few tokens at random (seeded per sample by syncpoint)."""
    flip = torch.rand(tokens.shape) < noise
    tokens = tokens.clone()
    tokens[flip] = torch.randint(1, VOCAB, (int(flip.sum()),))
    return tokens


def build(config: dict[str, Any]) -> Task:
    seq_len = int(config.get("seq_len", 32))
    transform = functools.partial(add_noise, noise=float(config.get("noise", 0.05)))
    corpus = ShardedCorpus(config["shards"], "tokens-npy", seq_len=seq_len + 1, transform=transform)
    model = TinyLM(d_model=int(config.get("d_model", 32)), seq_len=seq_len, dropout=float(config.get("dropout", 0.1)))
    return Task(model=model, dataset=corpus, loss=lm_loss)


def write_corpus(url: str, shards: int, rows: int, seq_len: int, seed: int = 7, vary: bool = True) -> list[str]:
    """``shards`` ``.npy`` files of synthetic text tokens under ``url`` (any fsspec URL); shard ``i``
    holds ``rows`` (``rows + i % 5`` with ``vary``) rows of ``seq_len + 1`` tokens, as a 1-D stream."""
    width = seq_len + 1
    counts = [rows + (i % 5 if vary else 0) for i in range(shards)]
    tokens = synthetic_corpus(sum(counts) * width, seed=seed).numpy().astype(np.uint8)
    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    paths, at = [], 0
    for i, n in enumerate(counts):
        buf = io.BytesIO()
        np.save(buf, tokens[at * width : (at + n) * width])
        at += n
        path = f"{root.rstrip('/')}/shard-{i:05d}.npy"
        fs.pipe_file(path, buf.getvalue())
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.sharded_lm")
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write a synthetic token corpus")
    w.add_argument("url")
    w.add_argument("--shards", type=int, default=16)
    w.add_argument("--rows", type=int, default=64)
    w.add_argument("--seq-len", type=int, default=32)
    args = p.parse_args(argv)
    print(f"wrote {len(write_corpus(args.url, args.shards, args.rows, args.seq_len))} shards to {args.url}")


if __name__ == "__main__":
    main()
