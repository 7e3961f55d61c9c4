"""One task that can carry every kind of state a resume must bring back, chosen by ``task.config.kinds``
(a comma-separated subset): ``generators`` (the loss draws from a task-owned torch and NumPy
generator, the dataset from its own NumPy generator), ``buffers`` (a running statistic the forward
updates and subtracts, non-persistent), ``groups`` (an optimizer whose param groups keep running
state, ``tests.tasks.GrowingSteps``), ``counters`` (the loss reads DeepSpeed's step counters) and
``hash`` (the dataset's order follows the string hash). The property test draws the subset."""

from __future__ import annotations

import numpy as np
import torch

from syncpoint.workers.task import Task
from tests.rng_tasks import HashOrdered, OwnRngVectors
from tests.tasks import COUNTERS, GrowingSteps, RunningCenter, Vectors, mse

KINDS = ("generators", "buffers", "groups", "counters", "hash")


def kinds_of_state(config: dict) -> Task:
    kinds = {k for k in str(config.get("kinds", "")).split(",") if k}
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}")
    n, dim = int(config.get("num_samples", 16)), 4
    layers: list[torch.nn.Module] = [torch.nn.Linear(dim, 8)]
    if "buffers" in kinds:
        layers.append(RunningCenter(8))
    layers += [torch.nn.Dropout(0.1), torch.nn.Linear(8, 1)]
    model = torch.nn.Sequential(*layers)
    if "hash" in kinds:
        dataset: torch.utils.data.Dataset = HashOrdered(n, dim)
    elif "generators" in kinds:
        dataset = OwnRngVectors(n, dim)
    else:
        dataset = Vectors(n, dim)
    noise, scale = torch.Generator().manual_seed(7), np.random.default_rng(8)

    def loss(engine, batch):
        x, y = batch
        factor = 1.0
        if "generators" in kinds:
            x = x + 0.05 * torch.randn(x.shape, generator=noise)
            factor *= 1.0 + 0.5 * float(scale.random())
        if "counters" in kinds:
            c = [float(getattr(engine, name)) for name in COUNTERS]
            factor *= 1 + 1e-3 * c[0] + 1e-2 * c[1] + 1e-4 * c[2] + c[3]
        return factor * mse(engine, (x, y))

    task = Task(model=model, dataset=dataset, loss=loss)
    if "groups" in kinds:
        task.optimizer = lambda m: GrowingSteps(m.parameters(), weight_decay=0.01)
    return task
