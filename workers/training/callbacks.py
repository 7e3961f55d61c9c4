"""``Task.callbacks``: your code at the points of a run people ask for, without moving its trajectory.

Hooks (any subset, on any object; every rank calls them at the same points, in list order):

=======================  ===========================================  ====================================
hook                     when                                         what it gets
=======================  ===========================================  ====================================
``on_start(info)``       the attempt starts training (fresh, resumed  ``StartInfo``: attempt, resumed_from,
                         or restarted in the same submission)         restart, optimizer_step, rank, world
``on_step(info, model)`` after every optimizer step                   ``StepInfo`` and the module, read-only
``on_log(record)``       a logged step (``train.log_every``)          the step's record (loss, lr, lrs...)
``on_evaluate(metrics)`` after an evaluation (``train.eval_every``)   the evaluation's metrics
``on_state_committed``   a state is committed (every rank)            the state's name and save reasons
``(state, reasons)``
``on_end(info)``         the run reached its end                      ``EndInfo``: final state, steps
=======================  ===========================================  ====================================

Why it is shielded: a callback that draws a random number (a sampled generation, a shuffled
probe) would shift every later draw of training, and the resumed run, which calls it at other
points in its life, would no longer be the uninterrupted one. So every call runs with every RNG
syncpoint restores (Python, NumPy, torch CPU and CUDA, the task's own generators) saved before
and put back after, and ``on_step`` sees the model under ``torch.no_grad()``. What a callback must
not do is change training: the model's parameters, the optimizer, the data. A callback that keeps
state of its own which training reads belongs in ``Task.stateful`` (saved and restored with every
state). An exception in a callback fails the attempt as a crash, naming the callback and hook.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from syncpoint.policies.contracts.errors import TaskError
from syncpoint.workers.training import rng

__all__ = ["HOOKS", "CallbackFailed", "Callbacks", "EndInfo", "StartInfo", "StepInfo", "check"]

HOOKS = ("on_start", "on_step", "on_log", "on_evaluate", "on_state_committed", "on_end")


class CallbackFailed(RuntimeError):
    """A callback raised: the attempt fails as a crash (retried within ``failure.max_failures``)."""


@dataclass(frozen=True)
class StartInfo:
    """What ``on_start`` callbacks receive: where this attempt starts."""

    attempt: int  # 1 for a submission's first attempt
    resumed_from: str | None  # the state this attempt continues (None: a fresh start or init_from)
    restart: bool  # an earlier attempt of this submission ran (a Ray Train restart)
    optimizer_step: int
    global_micro_step: int
    rank: int
    world_size: int


@dataclass(frozen=True)
class StepInfo:
    """What ``on_step`` callbacks receive after each optimizer step."""

    optimizer_step: int
    global_micro_step: int
    epoch: int
    loss: float  # the step's mean loss over every rank (the same on each)
    lrs: tuple[float, ...]  # every param group's learning rate at this step
    rank: int


@dataclass(frozen=True)
class EndInfo:
    """What ``on_end`` callbacks receive when the run finishes."""

    final_state: str  # the run's last committed state
    optimizer_step: int
    global_micro_step: int
    rank: int


def check(path: str, callbacks: Any) -> None:
    """``Task.callbacks`` as the loop needs it, or ``TaskError`` naming the entry: a list of objects,
    each with at least one hook and no other ``on_*`` attribute (a misspelt hook would never run)."""
    if not isinstance(callbacks, (list, tuple)):
        raise TaskError(
            f"task.path: {path!r} returned Task.callbacks of type {type(callbacks).__name__}: it must be a list of "
            f"objects with any of {', '.join(HOOKS)}"
        )
    for i, cb in enumerate(callbacks):
        # looked up statically: a property of the user's that raises must not fail the check itself
        hooks = [h for h in HOOKS if callable(inspect.getattr_static(cb, h, None))]
        unknown = sorted(
            a
            for a in dir(cb)
            if a.startswith("on_") and a not in HOOKS and callable(inspect.getattr_static(cb, a, None))
        )
        if unknown:
            raise TaskError(
                f"task.path: {path!r}: Task.callbacks[{i}] ({type(cb).__qualname__}) has {unknown}, which is no "
                f"hook syncpoint calls; the hooks are {', '.join(HOOKS)}"
            )
        if not hooks:
            raise TaskError(
                f"task.path: {path!r}: Task.callbacks[{i}] ({type(cb).__qualname__}) has none of the hooks "
                f"{', '.join(HOOKS)}"
            )


class Callbacks:
    """The task's callbacks, each call shielded (``__doc__``); a no-op when there are none."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = list(callbacks)

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for i, cb in enumerate(self.callbacks):
            fn = getattr(cb, hook, None)
            if not callable(fn):
                continue
            saved = rng.snapshot()
            try:
                with torch.no_grad():
                    fn(*args)
            except Exception as e:
                raise CallbackFailed(
                    f"Task.callbacks[{i}] ({type(cb).__qualname__}).{hook} raised {type(e).__name__}: {str(e)[:500]}"
                ) from e
            finally:
                rng.restore(saved)
