"""A virtual corpus of 10^9 samples for deep-position resumes: sample ``i`` is computed from ``i``.

Why its samples are their indices: to resume deep inside a 10^9-sample epoch, a run must first
train that far, here on two shared cores. So a sample costs no storage and almost no Python: the
dataset's sample ``i`` is the integer ``i`` and the task's collate computes every sample's features
and target from its index at once (``features``), for micro-batches of up to 2^20 samples.
``seeded_items`` is the batch-at-once read ``workers.data.SeededSamples`` calls (the samples draw no
randomness, so no per-sample seeding is asked for); ``__getitem__`` returns the same values one at a
time. The model is tiny, with dropout, so the resumed run's RNG streams matter too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from syncpoint.workers.task import Task

SAMPLES = 10**9
DIM = 4
FREQUENCIES = np.array([1e-9, 3.7e-7, 1.3e-4, 0.61], dtype=np.float64)  # visible across the epoch and within a batch


class VirtualCorpus(torch.utils.data.Dataset):
    """``num_samples`` samples, sample ``i`` being ``i`` itself (the collate turns it into features)."""

    def __init__(self, num_samples: int = SAMPLES) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> int:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} is outside the corpus's {self.num_samples}")
        return i

    def seeded_items(self, indices: Sequence[int], seeding: Callable[[int], Any]) -> list[int]:
        """A micro-batch at once (``workers.data.SeededSamples``): no sample draws randomness."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"samples must lie in [0, {self.num_samples})")
        return list(indices)


def features(indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's features (sines of its index) and target, computed in float64 and rounded once."""
    phase = indices.to(torch.float64)[:, None] * torch.from_numpy(FREQUENCIES)[None, :]
    x = torch.sin(phase)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.cos(3.0 * x[:, :1])
    return x.to(torch.float32), y.to(torch.float32)


def collate(samples: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return features(torch.tensor(samples, dtype=torch.int64))


def mse(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def build(config: dict) -> Task:
    torch.manual_seed(int(config.get("init_seed", 0)))
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, 8),
        torch.nn.Tanh(),
        torch.nn.Dropout(float(config.get("dropout", 0.1))),
        torch.nn.Linear(8, 1),
    )
    return Task(model=model, dataset=VirtualCorpus(int(config.get("num_samples", SAMPLES))), loss=mse, collate=collate)
