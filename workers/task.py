"""The user's side of the contract: a task function returns model, dataset and loss.

Users never write the training loop. ``task.path: "pkg.mod:build"`` names a function called as
``build(config: dict) -> Task`` on every worker, after syncpoint has seeded every RNG from
``train.seed`` (so model initialisation is identical on every attempt and every rank).

Randomness a resume reproduces: the global streams (Python ``random``, NumPy's global functions,
torch CPU and CUDA), and generators the task keeps on its own objects (``random.Random``,
``np.random.Generator`` / ``RandomState`` / a bit generator, ``torch.Generator``) where
``workers.task_rngs`` finds them: those reachable from ``dataset``, ``collate`` and
``eval_dataset`` are reseeded per sample / batch from (seed, epoch, index), those reachable from
``loss``, ``model``, ``metrics`` and ``optimizer`` are saved with the rank's RNG. Seed them (from
the global RNG, which syncpoint seeded, or from ``config``): a generator drawing OS entropy, or one
created anew inside ``__getitem__`` or ``loss`` without a seed, differs on every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from policies.errors import TaskError
from policies.import_path import load_function


@runtime_checkable
class MapDataset(Protocol):
    """What syncpoint needs of a dataset: map-style, so skipping to a position is index arithmetic
    (a ``torch.utils.data.Dataset`` with ``__len__`` is one; an iterable-only dataset is not)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@dataclass
class Task:
    model: torch.nn.Module
    dataset: MapDataset
    loss: Callable[[Any, Any], torch.Tensor]  # loss(model, batch) -> scalar tensor
    collate: Callable[[list[Any]], Any] | None = None
    # Evaluation (``train.eval_every``, ``workers.evaluation``): a map-style eval set, and what to
    # measure on a batch: ``metrics(model, batch) -> {name: tensor}``, a 0-d tensor being the batch's
    # mean and a 1-d tensor one value per item. Default: the task's loss, recorded as ``eval_loss``.
    eval_dataset: MapDataset | None = None
    metrics: Callable[[Any, Any], dict[str, torch.Tensor]] | None = None
    # optimizer(model) -> any torch optimizer, any param groups (each with its own lr, weight decay, ...);
    # None: the spec's train.optimizer (with train.optimizer.no_decay). The schedule scales each group's lr.
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None


def load_task(path: str, config: dict[str, Any]) -> Task:
    try:
        fn = load_function(path)
    except ValueError as e:
        raise TaskError(f"task.path: {e}. Point it at a function 'package.module:function' returning a Task, "
                        "importable on every worker (ship the code with --working-dir).") from None
    try:
        task = fn(dict(config))
    except TypeError as e:
        if "argument" not in str(e):
            raise
        raise TaskError(f"task.path: {path!r} cannot be called as {path.split(':')[1]}(config: dict): {e}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task.path: {path!r} returned {type(task).__name__}, expected workers.task.Task")
    if task.optimizer is not None and not callable(task.optimizer):
        raise TaskError(f"task.path: {path!r} returned a Task whose optimizer is not callable; it must be "
                        "optimizer(model) -> torch.optim.Optimizer, or None for the spec's train.optimizer")
    if not hasattr(task.dataset, "__len__") or not hasattr(task.dataset, "__getitem__"):
        raise TaskError(f"task.path: {path!r} returned a dataset without __len__/__getitem__ (map-style needed)")
    if task.eval_dataset is not None and (not hasattr(task.eval_dataset, "__len__")
                                          or not hasattr(task.eval_dataset, "__getitem__")):
        raise TaskError(f"task.path: {path!r} returned an eval_dataset without __len__/__getitem__ "
                        "(Task.eval_dataset must be map-style, like Task.dataset)")
    if task.metrics is not None and not callable(task.metrics):
        raise TaskError(f"task.path: {path!r} returned Task.metrics that is not callable; it must be a function "
                        "metrics(model, batch) -> dict[str, Tensor]")
    return task


def check_loss(loss: Any, path: str) -> None:
    """What ``engine.backward`` needs of ``Task.loss``'s value, checked at every micro-step (metadata
    only: no device sync): a 0-d floating tensor computed from the model. Anything else is the task's
    bug, the same on every retry: a refusal (``TaskError``), not retried, naming what came back."""
    what = "Task.loss must return the batch's loss as a 0-d floating tensor computed from the model"
    if not isinstance(loss, torch.Tensor):
        raise TaskError(f"{what}; {path} returned {type(loss).__name__[:80]}. Return a tensor, e.g. "
                        "torch.nn.functional.cross_entropy(model(x), y)")
    if loss.dim() != 0:
        raise TaskError(f"{what}; {path} returned a tensor of shape {tuple(loss.shape)}. Reduce it to the batch's "
                        "mean (reduction='mean', or .mean())")
    if not loss.is_floating_point():
        raise TaskError(f"{what}; {path} returned a {str(loss.dtype).removeprefix('torch.')} tensor. Compute it in "
                        "floating point (a loss over labels: cross_entropy of the model's logits)")
    if not loss.requires_grad:
        raise TaskError(f"{what}; {path} returned a tensor no gradient reaches (the batch does not reach the "
                        "model's trainable parameters, or the loss was detached / computed under no_grad). Compute "
                        "it from model(batch), the engine passed to loss()")
