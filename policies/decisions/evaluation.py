"""Evaluation decisions: when one is due, which eval samples each rank takes, and how values combine.

Pure functions of counters (no I/O, no torch), so the rules are tested without a process group:

* **When.** ``train.eval_every`` (optimizer steps or epochs) at sync boundaries only, after the
  optimizer step, and always at the run's last boundary; never mid-cycle, so an evaluation sees the
  weights a state at that boundary holds.
* **Which samples.** Rank ``r`` of ``W`` takes indices ``r, r + W, r + 2W, ...``: every sample is
  counted exactly once, nothing is padded or dropped, and the split is a function of the eval set's
  size and the world size alone (a resumed attempt at the same world size splits the same way).
* **How many forwards.** Under ZeRO-3 every forward is a collective (the parameter all-gather), so
  every rank runs the same number of forwards: the largest shard's batch count. A rank with fewer
  batches repeats one with weight 0, which gathers the parameters with the others and counts nothing.
* **How values combine.** Sums and counts, never averages of averages: a 0-d metric is a batch mean
  (weighted by the batch's sample count), a 1-d metric holds one value per item (summed, each item
  counted). The ranks add their sums and counts (float64) and divide once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# trainer.json ``metrics`` keys of evaluation results: ``eval_loss``, ``eval_<name>``.
EVAL_PREFIX = "eval_"
MAX_METRIC_NAME_CHARS = 100


def due(value: int, unit: str, *, optimizer_step: int, epoch: int, epoch_end: bool, last: bool) -> bool:
    """Whether this sync boundary evaluates. ``value`` 0 is off (not even at the end); ``epoch`` is
    the 0-indexed epoch this boundary belongs to; ``last`` is the run's last boundary."""
    if value <= 0:
        return False
    if last:
        return True
    if unit == "optimizer_steps":
        return optimizer_step % value == 0
    if unit == "epochs":
        return epoch_end and (epoch + 1) % value == 0
    raise ValueError(f"unknown eval_every unit {unit!r}")


def shard_batches(num_samples: int, micro_batch_size: int, world_size: int, rank: int) -> list[list[int]]:
    """This rank's eval batches: indices ``rank, rank + W, ...`` in chunks of ``micro_batch_size``
    (the last one may be short)."""
    mine = list(range(rank, num_samples, world_size))
    return [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]


def forwards_per_rank(num_samples: int, micro_batch_size: int, world_size: int) -> int:
    """The forwards every rank runs: the largest shard's (rank 0's) batch count."""
    largest_shard = -(-num_samples // world_size)
    return -(-largest_shard // micro_batch_size)


def padding_batch(batches: list[list[int]], num_samples: int, micro_batch_size: int) -> list[int]:
    """The batch a rank repeats (weight 0) to keep its forward count: its own last batch, or, with
    no sample of its own (fewer samples than ranks), the eval set's first samples."""
    return batches[-1] if batches else list(range(min(micro_batch_size, num_samples)))


def metric_key(name: str) -> str:
    """The ``trainer.json`` ``metrics`` key of an evaluation metric (``loss`` -> ``eval_loss``)."""
    return EVAL_PREFIX + name


def name_problem(name: Any) -> str | None:
    """Why a metric name returned by ``Task.metrics`` cannot be recorded, or None."""
    if not isinstance(name, str) or not name:
        return f"a metric name must be a non-empty string, got {name!r}"
    if len(name) > MAX_METRIC_NAME_CHARS or not all(ch.isalnum() or ch in "_-./" for ch in name):
        return (
            f"metric name {name[:80]!r} must be at most {MAX_METRIC_NAME_CHARS} characters of letters, digits and _-./"
        )
    return None


def averages(names: list[str], sums: list[float], counts: list[float]) -> dict[str, float]:
    """Each metric's exact average over every evaluated item (the reduced sums over the reduced counts)."""
    return {n: s / c for n, s, c in zip(names, sums, counts, strict=True)}


def carried(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """The evaluation results a state recorded (finite numbers under ``eval_`` keys), carried into
    the states after it until the next evaluation replaces them: a state's metrics always hold the
    latest evaluation at or before it, also across a resume."""
    out: dict[str, float] = {}
    for k, v in (metrics or {}).items():
        if (
            isinstance(k, str)
            and k.startswith(EVAL_PREFIX)
            and isinstance(v, int | float)
            and not isinstance(v, bool)
            and math.isfinite(v)
        ):
            out[k] = float(v)
    return out


def eval_line(attempt: int, optimizer_step: int, metrics: Mapping[str, float], seconds: float) -> str:
    """An evaluation's console line: the rank-0 worker's, and the driver's above its progress bar."""
    shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
    return f"[syncpoint] attempt {attempt} step {optimizer_step} eval {shown} ({seconds:.2f} s)"
