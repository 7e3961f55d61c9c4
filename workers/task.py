"""The user's side of the contract: a task function returns model, dataset and loss.

Users never write the training loop. ``task.path: "pkg.mod:build"`` names a function called as
``build(config: dict) -> Task`` on every worker, after syncpoint has seeded every RNG from
``train.seed`` (so model initialisation is identical on every attempt and every rank).

Randomness a resume reproduces: the global streams (Python ``random``, NumPy's global functions,
torch CPU and CUDA), and generators the task keeps on its own objects (``random.Random``,
``np.random.Generator`` / ``RandomState`` / a bit generator, ``torch.Generator``) where
``syncpoint.workers.training.task_rngs`` finds them: those reachable from ``dataset``, ``collate`` and
``eval_dataset`` are reseeded per sample / batch from (seed, epoch, index), those reachable from
``loss``, ``model``, ``metrics`` and ``optimizer`` are saved with the rank's RNG. Seed them (from
the global RNG, which syncpoint seeded, or from ``config``): a generator drawing OS entropy, or one
created anew inside ``__getitem__`` or ``loss`` without a seed, differs on every run.

``dataset`` is map-style (``__len__`` and ``__getitem__``: positions are index arithmetic) or a
stream whose position is its own state: a Hugging Face ``datasets.IterableDataset``, or an iterable
with ``state_dict()`` / ``load_state_dict()`` (``syncpoint.workers.data.stream`` says how each is split per rank and
resumed). A plain iterable is refused: nothing could say where a resume continues it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from syncpoint.policies.contracts.errors import TaskError
from syncpoint.policies.contracts.import_path import load_function
from syncpoint.workers.state import user_state
from syncpoint.workers.training import callbacks


@runtime_checkable
class MapDataset(Protocol):
    """What syncpoint needs of a dataset: map-style, so skipping to a position is index arithmetic
    (a ``torch.utils.data.Dataset`` with ``__len__`` is one; an iterable-only dataset is not)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


class Stateful(Protocol):
    """What ``Task.stateful`` holds: an object whose ``state_dict()`` is saved with every state and
    whose ``load_state_dict(state)`` restores it (``syncpoint.workers.state.user_state``)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


def hf_iterable(dataset: Any) -> bool:
    """A Hugging Face ``datasets.IterableDataset`` (``datasets`` is looked up, never imported: a
    task that returns one has imported it)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.IterableDataset)


def is_stream(dataset: Any) -> bool:
    """A stream: a ``datasets.IterableDataset``, or an iterable (no map-style dataset) with
    ``state_dict()`` and ``load_state_dict()``."""
    if hf_iterable(dataset):
        return True
    stateful = callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
    return stateful and hasattr(dataset, "__iter__") and not is_map_style(dataset)


def is_map_style(dataset: Any) -> bool:
    """``__len__`` and ``__getitem__``, and no torch ``IterableDataset`` (whose ``__getitem__`` is
    torch's base class raising NotImplementedError)."""
    return (
        not isinstance(dataset, torch.utils.data.IterableDataset)
        and hasattr(dataset, "__len__")
        and hasattr(dataset, "__getitem__")
    )


def dataset_problem(path: str, dataset: Any) -> str | None:
    """Why ``Task.dataset`` cannot be trained on with exact resume, in one paragraph, or None."""
    if is_stream(dataset) or is_map_style(dataset):
        return None
    kind = type(dataset).__qualname__
    if not hasattr(dataset, "__iter__"):
        return (
            f"task.path: {path!r} returned a dataset ({kind}) that is neither map-style (__len__ and "
            "__getitem__) nor iterable; return a map-style dataset, or a stream (see below)"
        )
    return (
        f"task.path: {path!r} returned a plain iterable dataset ({kind}): it has no state_dict()/"
        "load_state_dict(), so no state could say where a resume continues it, and it cannot be resumed "
        "exactly. Return instead a map-style dataset (__len__ and __getitem__: syncpoint orders each epoch and "
        "skips by index arithmetic), a Hugging Face datasets.IterableDataset (load_dataset(..., "
        "streaming=True): syncpoint splits it per rank with split_dataset_by_node and saves its state_dict), "
        "or an IterableDataset with state_dict()/load_state_dict() (torchdata's Stateful) and split(rank, "
        "world_size) returning each rank's stream; streams need train.max_steps"
    )


@dataclass
class Task:
    """What your task function returns: ``build(config) -> Task``, named by ``task.path``.

    Attributes:
        model: the module to train; syncpoint wraps it in a DeepSpeed engine.
        dataset: map-style (``__len__``, ``__getitem__``), a ``syncpoint.ShardedCorpus``, a
            ``syncpoint.TokenWindows`` (one token array in windows, nanoGPT's ``get_batch``), or a
            stream with its own state (a Hugging Face ``datasets.IterableDataset``, or an iterable with
            ``state_dict()`` / ``load_state_dict()``).
        loss: ``loss(model, batch) -> scalar tensor``; ``model`` is the DeepSpeed engine.
        collate: the DataLoader's ``collate_fn`` (default: torch's).
        eval_dataset: a map-style evaluation set, evaluated every ``train.eval_every``.
        metrics: ``metrics(model, batch) -> {name: tensor}`` on evaluation batches: a 0-d tensor is the
            batch's mean, a 1-d tensor one value per item (default: the loss, as ``eval_loss``).
        optimizer: ``optimizer(model) -> torch.optim.Optimizer`` with any param groups; default: the
            spec's ``train.optimizer``.
        stateful: ``{name: object}``, objects with ``state_dict()`` / ``load_state_dict()`` the engine
            does not own (an EMA, a curriculum, a mixture's weights), saved per rank with every
            state and restored before the first fetch (``syncpoint.workers.state.user_state``).
        callbacks: objects with any of the hooks ``on_start``, ``on_step``, ``on_log``,
            ``on_evaluate``, ``on_state_committed``, ``on_end``, called on every rank with every RNG
            shielded (``syncpoint.workers.training.callbacks``).
    """

    model: torch.nn.Module
    dataset: MapDataset | Any  # map-style, or a stream (``is_stream``)
    loss: Callable[[Any, Any], torch.Tensor]  # loss(model, batch) -> scalar tensor
    collate: Callable[[list[Any]], Any] | None = None
    # Evaluation (``train.eval_every``, ``syncpoint.workers.training.evaluation``): a map-style eval set, and what to
    # measure on a batch: ``metrics(model, batch) -> {name: tensor}``, a 0-d tensor being the batch's
    # mean and a 1-d tensor one value per item. Default: the task's loss, recorded as ``eval_loss``.
    eval_dataset: MapDataset | None = None
    metrics: Callable[[Any, Any], dict[str, torch.Tensor]] | None = None
    # optimizer(model) -> any torch optimizer, any param groups (each with its own lr, weight decay, ...);
    # None: the spec's train.optimizer (with train.optimizer.no_decay). The schedule scales each group's lr.
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None
    # objects the task keeps state in, by name: saved with every state, per rank, restored exactly
    stateful: dict[str, Stateful] = field(default_factory=dict)
    # your code at the run's points (syncpoint.workers.training.callbacks): it observes, training is unchanged
    callbacks: list[Any] = field(default_factory=list)


def load_task(path: str, config: Mapping[str, object]) -> Task:
    """Call the task builder ``task.path`` names with its config; the error names the path and what to fix."""
    try:
        fn = load_function(path)
    except ValueError as e:
        raise TaskError(
            f"task.path: {e}. Point it at a function 'package.module:function' returning a Task, "
            "importable on every worker (ship the code with --working-dir)."
        ) from None
    try:
        task = fn(dict(config))
    except TypeError as e:
        if "argument" not in str(e):
            raise
        raise TaskError(f"task.path: {path!r} cannot be called as {path.split(':')[1]}(config: dict): {e}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task.path: {path!r} returned {type(task).__name__}, expected syncpoint.Task")
    if task.optimizer is not None and not callable(task.optimizer):
        raise TaskError(
            f"task.path: {path!r} returned a Task whose optimizer is not callable; it must be "
            "optimizer(model) -> torch.optim.Optimizer, or None for the spec's train.optimizer"
        )
    user_state.check(path, task.stateful)
    callbacks.check(path, task.callbacks)
    problem = dataset_problem(path, task.dataset)
    if problem:
        raise TaskError(problem)
    if task.eval_dataset is not None and (
        not hasattr(task.eval_dataset, "__len__") or not hasattr(task.eval_dataset, "__getitem__")
    ):
        raise TaskError(
            f"task.path: {path!r} returned an eval_dataset without __len__/__getitem__ "
            "(Task.eval_dataset must be map-style, like Task.dataset)"
        )
    if task.metrics is not None and not callable(task.metrics):
        raise TaskError(
            f"task.path: {path!r} returned Task.metrics that is not callable; it must be a function "
            "metrics(model, batch) -> dict[str, Tensor]"
        )
    return task


def check_loss(loss: Any, path: str) -> None:
    """What ``engine.backward`` needs of ``Task.loss``'s value, checked at every micro-step (metadata
    only: no device sync): a 0-d floating tensor computed from the model. Anything else is the task's
    bug, the same on every retry: a refusal (``TaskError``), not retried, naming what came back."""
    what = "Task.loss must return the batch's loss as a 0-d floating tensor computed from the model"
    if not isinstance(loss, torch.Tensor):
        raise TaskError(
            f"{what}; {path} returned {type(loss).__name__[:80]}. Return a tensor, e.g. "
            "torch.nn.functional.cross_entropy(model(x), y)"
        )
    if loss.dim() != 0:
        raise TaskError(
            f"{what}; {path} returned a tensor of shape {tuple(loss.shape)}. Reduce it to the batch's "
            "mean (reduction='mean', or .mean())"
        )
    if not loss.is_floating_point():
        raise TaskError(
            f"{what}; {path} returned a {str(loss.dtype).removeprefix('torch.')} tensor. Compute it in "
            "floating point (a loss over labels: cross_entropy of the model's logits)"
        )
    if not loss.requires_grad:
        raise TaskError(
            f"{what}; {path} returned a tensor no gradient reaches (the batch does not reach the "
            "model's trainable parameters, or the loss was detached / computed under no_grad). Compute "
            "it from model(batch), the engine passed to loss()"
        )
