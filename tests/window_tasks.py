"""A nanoGPT-shaped task on ``syncpoint.TokenWindows``: a token file (``task.config.tokens``) cut into
windows of ``seq_len`` inputs and their next-token targets, the tiny example's model, cross-entropy
on ``(x, y)`` batches (nanoGPT's ``get_batch`` as a dataset)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from examples.tiny_lm import VOCAB, TinyLM, synthetic_corpus
from syncpoint import TokenWindows
from syncpoint.workers.task import Task


def write_tokens(path: str, num_tokens: int, seed: int = 7) -> str:
    """nanoGPT's format: raw uint16 tokens (synthetic text of the tiny example's vocabulary)."""
    synthetic_corpus(num_tokens, seed=seed).numpy().astype(np.uint16).tofile(path)
    return path


def window_loss(model: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).reshape(-1, VOCAB).float(), y.reshape(-1))


def build(config: dict[str, Any]) -> Task:
    seq_len = int(config.get("seq_len", 8))
    samples = config.get("samples_per_epoch")
    data = TokenWindows(
        config["tokens"],
        seq_len,
        windows=str(config.get("windows", "random")),
        samples_per_epoch=None if samples is None else int(samples),
    )
    model = TinyLM(d_model=int(config.get("d_model", 16)), seq_len=seq_len, dropout=float(config.get("dropout", 0.1)))
    return Task(model=model, dataset=data, loss=window_loss)
