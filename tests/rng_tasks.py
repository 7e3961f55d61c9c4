"""Tasks whose randomness lives outside the global RNGs: their own generators, their own hash order."""

from __future__ import annotations

import numpy as np
import torch

from syncpoint.workers.task import Task
from tests.tasks import Vectors, linear, mse


class OwnRngVectors(torch.utils.data.Dataset):
    """Vectors augmented from the dataset's own ``np.random.default_rng`` (NumPy's recommended API,
    what augmentation libraries keep), never from a global RNG."""

    def __init__(self, n: int, dim: int = 4) -> None:
        base = Vectors(n, dim, augment=False)
        self.x, self.y = base.x, base.y
        self.rng = np.random.default_rng(1234)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.from_numpy(self.rng.normal(0.0, 0.05, self.x.shape[1]).astype(np.float32))
        return self.x[i] + noise, self.y[i]


def own_generators(config: dict) -> Task:
    """linear, but the dataset draws from its own NumPy generator and the loss from a task-owned
    ``torch.Generator`` and a NumPy ``Generator`` (closures), without dropout: every random number
    of the run comes from a generator the task owns."""
    task = linear({**config, "dropout": 0.0})
    task.dataset = OwnRngVectors(int(config.get("num_samples", 64)))
    noise, scale = torch.Generator().manual_seed(7), np.random.default_rng(8)

    def loss(model, batch):
        x, y = batch
        x = x + 0.05 * torch.randn(x.shape, generator=noise)
        return (1.0 + 0.5 * float(scale.random())) * mse(model, (x, y))

    task.loss = loss
    if config.get("eval_samples"):  # evaluated with the loss: its draws come from the same generators
        task.eval_dataset = OwnRngVectors(int(config["eval_samples"]))
    return task


class HashOrdered(torch.utils.data.Dataset):
    """Sample ``i`` is the vector named by the ``i``-th string of a set: the order follows the
    interpreter's string hash (``PYTHONHASHSEED``), as code that iterates a set or dict of strings does."""

    def __init__(self, n: int, dim: int = 4) -> None:
        base = Vectors(n, dim, augment=False)
        self.x, self.y = base.x, base.y
        self.names = list({f"v{k}" for k in range(n)})

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        k = int(self.names[i][1:])
        return self.x[k], self.y[k]


def hash_ordered(config: dict) -> Task:
    task = linear({**config, "dropout": 0.0})
    task.dataset = HashOrdered(int(config.get("num_samples", 64)))
    return task
