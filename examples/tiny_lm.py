"""A tiny causal language model on synthetic text the example generates itself (no downloads).

It has dropout (model-side randomness) and a random per-sample augmentation (data-side
randomness: a random crop offset and random token noise), so exact resume has to get both RNG
streams right. ``task.config`` sets ``num_samples`` and ``seq_len`` so tests choose the epoch
length from the spec. ``eval_samples`` (default 128, 0 for none) windows from a later, disjoint part of
the same corpus, with the same augmentation, form the eval set that ``train.eval_every`` evaluates.
"""

from __future__ import annotations

import random

import torch
import torch.nn as nn
import torch.nn.functional as F

from syncpoint.workers.task import Task

VOCAB = 48
WORDS = [
    "ray",
    "train",
    "spot",
    "node",
    "save",
    "state",
    "resume",
    "step",
    "epoch",
    "batch",
    "zero",
    "shard",
    "loss",
    "drain",
    "notice",
    "boundary",
    "exact",
    "bitwise",
    "manifest",
    "commit",
]


def synthetic_corpus(num_chars: int, seed: int = 7) -> torch.Tensor:
    """Deterministic pseudo-English: words from a small vocabulary with a bigram preference."""
    rnd = random.Random(seed)
    out: list[str] = []
    prev, length = 0, 0  # length: the text so far, each word with its space
    while length < num_chars:
        idx = (prev * 7 + rnd.randrange(4)) % len(WORDS) if rnd.random() < 0.8 else rnd.randrange(len(WORDS))
        out.append(WORDS[idx])
        length += len(WORDS[idx]) + 1
        prev = idx
    text = " ".join(out)[:num_chars]
    return torch.tensor([(ord(c) - 96) % VOCAB if c != " " else 0 for c in text], dtype=torch.long)


class SyntheticText(torch.utils.data.Dataset):
    """Windows over the corpus; each fetch crops at a random offset and flips a few tokens."""

    def __init__(self, num_samples: int, seq_len: int, noise: float = 0.05, skip: int = 0) -> None:
        """``skip``: start ``skip`` windows into the corpus (the eval split starts past every training
        window; the corpus's prefix does not depend on its length, so the training windows stay as they are)."""
        self.seq_len, self.noise, self.num_samples = seq_len, noise, num_samples
        self.corpus = synthetic_corpus((skip + num_samples + 4) * seq_len)[skip * seq_len :]

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> torch.Tensor:
        offset = int(torch.randint(0, self.seq_len, ()).item())  # random augmentation (data-side RNG)
        start = i * self.seq_len + offset
        x = self.corpus[start : start + self.seq_len + 1].clone()
        flip = torch.rand(x.shape) < self.noise
        x[flip] = torch.randint(1, VOCAB, (int(flip.sum()),))
        return x


class TinyLM(nn.Module):
    def __init__(self, d_model: int = 32, n_layers: int = 1, seq_len: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=2, dim_feedforward=2 * d_model, dropout=dropout, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.drop(self.embed(tokens) + self.pos[:n])
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=tokens.device, dtype=h.dtype)
        return self.head(self.blocks(h, mask=mask, is_causal=True))


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), batch[:, 1:].reshape(-1))


def build(config: dict) -> Task:
    seq_len = int(config.get("seq_len", 32))
    model = TinyLM(
        d_model=int(config.get("d_model", 32)),
        n_layers=int(config.get("n_layers", 1)),
        seq_len=seq_len,
        dropout=float(config.get("dropout", 0.1)),
    )
    num_samples, noise = int(config.get("num_samples", 512)), float(config.get("noise", 0.05))
    data = SyntheticText(num_samples, seq_len, noise)
    # Training windows end before window num_samples + 2 (crop offset < seq_len): the eval split starts past them.
    eval_samples = int(config.get("eval_samples", 128))
    eval_data = SyntheticText(eval_samples, seq_len, noise, skip=num_samples + 4) if eval_samples > 0 else None
    return Task(model=model, dataset=data, loss=lm_loss, eval_dataset=eval_data)
