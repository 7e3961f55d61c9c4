"""A draw from a rank's stream, as every random call inside it sees it: which draw is in progress
(``drawing``), which source an interleave of shard copies is reading (``reading_source``), and the
``.map``/``.filter`` calls that ``datasets`` may repeat in a later draw, run under a seed of their
own position (``SeededCall``); and the ``datasets`` pipeline a stream is built of (``hf_pipeline``).

Why a module of its own: ``syncpoint.workers.data.stream`` (which draws) and ``stream_hf`` (which
puts ``SeededCall`` and ``reading_source`` into a ``datasets`` pipeline) both build on it, and the
first imports the second.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from syncpoint.workers.data.sampler import _reseeded, _seeded_rngs
from syncpoint.workers.training.rng import derive_seed
from syncpoint.workers.training.task_rngs import DataGenerators

STREAM_CALL_SALT = 0x57CA11  # each call of a .map/.filter that datasets may repeat in another draw


def hf_pipeline(dataset: Any) -> list[Any]:
    """The ``datasets`` examples iterables the stream is built of, outermost first (internal API:
    ``_ex_iterable`` and each step's ``ex_iterable`` / ``ex_iterables``)."""
    out, todo, seen = [], [getattr(dataset, "_ex_iterable", None)], 0
    while todo and seen < 256:
        step = todo.pop(0)
        if step is None:
            continue
        out.append(step)
        seen += 1
        todo.append(getattr(step, "ex_iterable", None))
        todo.extend(getattr(step, "ex_iterables", None) or [])
    return out


# The draw in progress in this process (``drawing``) and the shard-interleave sources it is reading
# (``reading_source``): the part of a repeated call's seed that is not the call's own. Draws and reads
# are sequential (nothing below a draw runs on a thread: ``stream_hf``), so process-wide stacks do.
_DRAWS: list[tuple[int, ...]] = []
_SOURCES: list[int] = []


@contextlib.contextmanager
def drawing(key: tuple[int, ...]) -> Iterator[None]:
    """A draw from the stream keyed ``key`` (seed, rank, pass, DataLoader worker) is in progress."""
    _DRAWS.append(key)
    try:
        yield
    finally:
        _DRAWS.pop()


@contextlib.contextmanager
def reading_source(index: int) -> Iterator[None]:
    """An interleave of shard copies is reading its source ``index`` (``stream_hf.RoundRobin``)."""
    _SOURCES.append(index)
    try:
        yield
    finally:
        _SOURCES.pop()


class SeededCall:
    """A ``.map``/``.filter`` function that ``datasets`` may call again in a later draw, run under a
    seed of its own position: the draw's key, its step's place in the pipeline, the shard copy
    reading it, and the index ``datasets`` gives the call's first input (which it saves and restores
    with the step). Why: a batched step computes its batch in the draw of the batch's first example
    and, resumed mid-batch, in the first draw after the resume; seeded by that draw, its random work
    would differ.

    Its step passes indices (``with_indices``); the call takes them off unless the task asked for
    them. Outside a draw (the task iterating its own dataset) the function runs as it is."""

    def __init__(self, function: Callable[..., Any], step: int, wants_indices: bool) -> None:
        self.function, self.step, self.wants_indices = function, step, wants_indices
        self.generators = DataGenerators(function, "dataset")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        *inputs, indices = args
        call = (*inputs, indices) if self.wants_indices else tuple(inputs)
        if not _DRAWS:
            return self.function(*call, **kwargs)
        first = indices[0] if isinstance(indices, (list, tuple)) and indices else indices
        seed = derive_seed(*_DRAWS[-1], STREAM_CALL_SALT, self.step, len(_SOURCES), *_SOURCES, int(first))
        with _seeded_rngs(seed), _reseeded(self.generators, seed):
            return self.function(*call, **kwargs)
