"""Evaluation at sync boundaries (``train.eval_every``), without disturbing training.

The decisions (when, which samples per rank, how values combine) are ``syncpoint.policies.decisions.evaluation``; this
module runs them on the DeepSpeed engine. Why each part is here:

* **Training is not disturbed.** An evaluation captures every RNG (Python, NumPy, torch CPU and
  CUDA, the task's own train-side generators; ``syncpoint.workers.training.rng``) and every submodule's train/eval
  flag, and puts them back afterwards, so
  a run with evaluation is bitwise the training trajectory of one without. It reads samples
  without a DataLoader, so no loader generator or worker process draws from anything training
  uses; forwards run under ``torch.no_grad()`` through the engine (as ``Task.loss`` does), so
  ZeRO-3 gathers the partitioned parameters as it does in training.
* **Same numbers after a resume.** The evaluation's own randomness (augmentation in the eval set's
  ``__getitem__``, a random collate, model-side sampling) is seeded from ``train.seed`` and
  ``EVALUATION_SALT`` alone, per sample as the training data is: every evaluation of a run sees
  the same eval samples (its curve measures the model, not the draw), and a resumed attempt that
  evaluates a step again reports the numbers the uninterrupted run reported.
* **Exact reduction.** Each rank sums its shard's values in float64 (a 0-d metric times the batch's
  sample count, a 1-d metric's items), one all-reduce adds the ranks' sums and counts, and each
  metric is divided once. Every rank runs the same number of forwards (ZeRO-3's all-gathers must
  pair up); a problem with a returned value is agreed before anyone raises, so no rank is left
  waiting in a collective.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from syncpoint.policies.contracts.bounded_json import JSONObject
from syncpoint.policies.contracts.errors import TaskError
from syncpoint.policies.contracts.journal import Evaluated
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.decisions import evaluation as rules
from syncpoint.workers.data.sampler import SeededCollate, SeededSamples
from syncpoint.workers.observation.events import EventLog
from syncpoint.workers.task import MapDataset, Task
from syncpoint.workers.training import rng
from syncpoint.workers.training.device import to_device
from syncpoint.workers.training.rng import derive_seed

if TYPE_CHECKING:
    from deepspeed.runtime.engine import DeepSpeedEngine

    from syncpoint.workers.training.position import TrainingPosition

# The part of the evaluation's seed that names its stream (see the salts in ``syncpoint.workers.data.sampler``). Its
# value is part of the resume contract (a resumed run must evaluate the same samples): never change it.
EVALUATION_SALT = 0xE7A1


class Evaluation:
    """One attempt's evaluations: whether a boundary is due, running it, and the latest results
    (``eval_<name>``) that every state written after it records in ``trainer.json`` ``metrics``."""

    def __init__(
        self,
        spec: JobSpec,
        task: Task,
        *,
        rank: int,
        world_size: int,
        attempt: int,
        events: EventLog | None,
        carried: JSONObject | None,
        print_progress: bool,
    ) -> None:
        self.every = spec.train.eval_every
        self.spec, self.task, self.rank, self.world_size = spec, task, rank, world_size
        self.attempt, self.events, self.print_progress = attempt, events, print_progress
        # The resumed state's own results: its successors carry them until this attempt evaluates.
        self.latest: dict[str, float] = rules.carried(carried)
        check_task(spec, task)

    def due(self, at: TrainingPosition, *, epoch_end: bool, last: bool) -> bool:
        return rules.due(
            int(self.every.value),
            self.every.unit,
            optimizer_step=at.optimizer_step,
            epoch=at.epoch,
            epoch_end=epoch_end,
            last=last,
        )

    def run(self, engine: DeepSpeedEngine, at: TrainingPosition) -> dict[str, float]:
        """Evaluate now (every rank), record the results (rank 0) and return them."""
        assert self.task.eval_dataset is not None
        began = time.monotonic()
        results = evaluate(
            engine,
            self.task.eval_dataset,
            metrics_of(self.task),
            self.task.collate,
            micro_batch_size=self.spec.train.micro_batch_size,
            world_size=self.world_size,
            rank=self.rank,
            seed=derive_seed(self.spec.train.seed, EVALUATION_SALT),
        )
        seconds = time.monotonic() - began
        self.latest = {rules.metric_key(k): v for k, v in results.items()}
        if self.events is not None:
            self.events.emit(
                Evaluated(
                    attempt=self.attempt,
                    optimizer_step=at.optimizer_step,
                    global_micro_step=at.global_micro_step,
                    metrics=results,
                    seconds=seconds,
                )
            )
        if self.rank == 0 and self.print_progress:
            print(rules.eval_line(self.attempt, at.optimizer_step, results, seconds), flush=True)
        return results


def check_task(spec: JobSpec, task: Task) -> None:
    """``train.eval_every`` needs an eval set with samples (checked on every rank before training)."""
    every = spec.train.eval_every
    if every.value <= 0:
        return
    if task.eval_dataset is None:
        raise TaskError(
            f"train.eval_every is {int(every.value)} {every.unit} but the task ({spec.task.path}) returns "
            "no Task.eval_dataset: return one from the task function, or set train.eval_every to 0"
        )
    if len(task.eval_dataset) < 1:
        raise TaskError(
            f"Task.eval_dataset of {spec.task.path} is empty: train.eval_every needs at least one sample "
            "(or set train.eval_every to 0)"
        )


Metrics = Callable[[Any, Any], Any]


def metrics_of(task: Task) -> Metrics:
    """``Task.metrics``, or by default the task's loss as ``loss`` (a batch mean)."""
    if task.metrics is not None:
        return task.metrics
    loss = task.loss
    return lambda model, batch: {"loss": loss(model, batch)}


def evaluate(
    engine: DeepSpeedEngine | torch.nn.Module,
    dataset: MapDataset,
    metrics: Metrics,
    collate: Callable[[list[Any]], Any] | None,
    *,
    micro_batch_size: int,
    world_size: int,
    rank: int,
    seed: int,
) -> dict[str, float]:
    """Every metric's exact average over the whole eval set (a collective: every rank calls it).

    Every RNG and every submodule's train/eval flag are as they were when it returns, whatever happens."""
    saved_rng = rng.capture()
    modes = [(m, m.training) for m in engine.modules()]
    device = getattr(engine, "device", torch.device("cpu"))
    try:
        rng.seed_everything(seed)  # model-side randomness of an eval forward, the same at every evaluation
        # the module's own eval() (DeepSpeedEngine.eval would also re-arm its unscaled-loss warning)
        getattr(engine, "module", engine).eval()
        samples, collate_fn = SeededSamples(dataset, seed, 0), SeededCollate(collate)
        n = len(dataset)
        batches = rules.shard_batches(n, micro_batch_size, world_size, rank)
        sums = _Sums()
        with torch.no_grad():
            for i in range(rules.forwards_per_rank(n, micro_batch_size, world_size)):
                real = i < len(batches)
                indices = batches[i] if real else rules.padding_batch(batches, n, micro_batch_size)
                batch = to_device(collate_fn(samples.__getitems__(indices)), device)
                sums.add(metrics(engine, batch), samples=len(indices), weight=1 if real else 0, indices=indices)
        return _reduce(sums, device, world_size)
    finally:
        for module, training in modes:
            module.training = training
        rng.restore(saved_rng)


class _Sums:
    """This rank's float64 sums and counts per metric, and the first problem with a returned value."""

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}
        self.problem: str | None = None

    def add(self, values: Any, *, samples: int, weight: int, indices: list[int]) -> None:
        if self.problem is not None:
            return  # keep running the forwards (collectives under ZeRO-3), report once they are done
        self.problem = self._problem(values, indices)
        if self.problem is not None:
            return
        for name, v in values.items():
            v = v.detach().to("cpu", torch.float64)
            if v.dim() == 0:
                self.sums[name] += weight * samples * float(v)
                self.counts[name] += weight * samples
            else:
                self.sums[name] += weight * float(v.sum())
                self.counts[name] += weight * v.numel()

    def _problem(self, values: Any, indices: list[int]) -> str | None:
        where = f"on eval samples {indices[:8]}{'...' if len(indices) > 8 else ''}"
        if not isinstance(values, dict) or not values:
            return (
                f"Task.metrics returned {type(values).__name__} {where}; it must return a non-empty dict[str, Tensor]"
            )
        names = list(values)
        if self.names is None:
            for name in names:
                bad = rules.name_problem(name)
                if bad:
                    return f"Task.metrics: {bad}"
            self.names = names
            self.sums, self.counts = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        elif sorted(names) != sorted(self.names):
            return f"Task.metrics returned metrics {sorted(names)} {where}, but {sorted(self.names)} before"
        for name, v in values.items():
            if not isinstance(v, torch.Tensor):
                return (
                    f"Task.metrics returned {name!r} as {type(v).__name__} {where}; every value must be a tensor "
                    "(0-d: the batch's mean; 1-d: one value per sample or item)"
                )
            if v.dim() > 1:
                return (
                    f"Task.metrics returned {name!r} with shape {tuple(v.shape)} {where}; it must be 0-d (the "
                    "batch's mean) or 1-d (one value per sample or item)"
                )
            if v.is_complex() or not bool(torch.isfinite(v.detach()).all()):
                return f"Task.metrics returned a non-finite {name!r} {where} (nan or inf): fix the metric or the model"
        return None


def _reduce(sums: _Sums, device: torch.device, world_size: int) -> dict[str, float]:
    """Agree on names and problems (one object gather), then add sums and counts (one float64 all-reduce)."""
    seen: list[Any] = [None] * world_size
    dist.all_gather_object(seen, (sums.names, sums.problem))
    for r, (_, problem) in enumerate(seen):
        if problem:
            raise TaskError(f"{problem} (rank {r})")
    names = sums.names or []
    if any(sorted(other or []) != sorted(names) for other, _ in seen):
        raise TaskError(
            f"Task.metrics returned other metric names on other ranks: {[other for other, _ in seen]}; "
            "every rank must return the same names"
        )
    names = sorted(names)  # one order on every rank, whatever order each dict had
    vector = torch.tensor(
        [x for n in names for x in (sums.sums[n], sums.counts[n])], dtype=torch.float64, device=device
    )
    dist.all_reduce(vector)
    totals = vector.cpu().tolist()
    counts = totals[1::2]
    empty = [n for n, c in zip(names, counts, strict=True) if c == 0]
    if empty:
        raise TaskError(f"Task.metrics: {empty} counted no values over the whole eval set (empty 1-d tensors)")
    results = rules.averages(names, totals[0::2], counts)
    overflowed = [n for n, v in results.items() if not math.isfinite(v)]
    if overflowed:
        raise TaskError(f"Task.metrics: the sum of {overflowed} over the eval set overflowed float64")
    return results
