"""A ``datasets`` stream's pipeline, adjusted so that every composition resumes exactly.

``syncpoint.workers.data.stream`` seeds each draw from a rank's stream by its position, which makes
random work exact wherever ``datasets`` computes an example inside the draw that yields it, and
resumes each DataLoader worker from its saved state. Where ``datasets`` 5.2 does otherwise,
``adjust`` changes the pipeline in place (once: a second call keeps the first's changes):

* **Calls it repeats.** A batched ``.map``/``.filter`` computes its whole batch inside the draw of
  the batch's first example and, resumed mid-batch, recomputes it inside the first draw after the
  resume; ``interleave_datasets`` reads each source one example ahead and rereads it on resume.
  Such a step's function (a batched one, and every one below a batched step or an interleave)
  becomes a ``stream_draws.SeededCall``, seeded by its own position, which ``datasets`` saves and restores.
* **Threads.** ``interleave_datasets`` fetches its sources' next examples on a thread pool, where a
  random draw races the training process's own. ``SequentialCycling`` runs ``datasets``' own
  interleave code with its fetches in the calling thread.
* **The shard interleave of ``.shuffle``** reads up to 10 shards round robin, one item ahead of
  each, on threads. ``ShardInterleave`` reads the same round robin in the calling thread without
  looking ahead, so what it reads belongs to the draw that yields it; the order and the state
  layout are ``datasets``' (a state written before resumes the same).
* **The rest of a lifted ``.shuffle``** (its buffer is syncpoint's: ``stream.lift_hf_buffer``):
  ``LiftedShuffle`` passes items through, where ``datasets``' buffer of 1 would still permute each
  Arrow table it is given with a generator it restarts on every resume.
* **A DataLoader worker's resume.** ``IterableDataset._iter_pytorch`` first loads a worker's saved
  state into the whole, unsharded pipeline, then into the worker's shard of it; a shard
  interleave's state (an entry per shard the worker reads) does not fit the whole pipeline, and the
  load failed (syncpoint refused ``.shuffle`` with DataLoader workers for it). ``RankDataset``
  skips the first, discarded load.

Everything here leans on ``datasets`` internals, hence its pin (``datasets==5.2.*``); the stream
property test (``tests/integration/workers/data/test_stream_property_streams.py``) walks the compositions. This module
imports ``datasets``: ``stream`` imports it only for a ``datasets`` stream.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypedDict, cast

import datasets.iterable_dataset as hf
import torch.utils.data
from datasets import IterableDataset

from syncpoint.workers.data.stream_draws import SeededCall, hf_pipeline, reading_source


def adjust(dataset: Any) -> None:
    """Adjust a ``datasets`` stream's steps in place (the module docstring)."""
    steps = hf_pipeline(dataset)
    repeated = _repeated_calls(steps)
    for position, step in enumerate(steps):
        replacement = REPLACED.get(type(step))
        if type(step) is hf.BufferShuffledExamplesIterable and getattr(step, "_syncpoint_lifted", None) is not None:
            replacement = LiftedShuffle
        if replacement is not None:
            step.__class__ = replacement
        if id(step) in repeated:
            _seed_calls(step, position)


def _repeated_calls(steps: list[Any]) -> set[int]:
    """The ids of the function steps ``datasets`` may call again in a later draw: batched ones, and
    every one below a batched step or an interleave of sources."""
    out: set[int] = set()

    def walk(step: Any, below: bool, depth: int) -> None:
        if step is None or depth > 256:
            return
        function_step = isinstance(step, hf.MappedExamplesIterable)
        if function_step and (below or step.batched):
            out.add(id(step))
        below = below or (function_step and step.batched) or isinstance(step, hf.CyclingMultiSourcesExamplesIterable)
        for child in [getattr(step, "ex_iterable", None), *(getattr(step, "ex_iterables", None) or [])]:
            walk(child, below, depth + 1)

    if steps:
        walk(steps[0], False, 0)
    return out


def _seed_calls(step: Any, position: int) -> None:
    """The step's function as a ``SeededCall`` salted by its pipeline position (once). Asynchronous
    functions, which ``datasets`` runs concurrently, and its own table accumulators stay as they are."""
    if getattr(step, "_syncpoint_function", None) is not None or step.is_batch_accumulate_arrow_table_function:
        return
    filtering = isinstance(step, hf.FilteredExamplesIterable)
    own = step.mask_function if filtering else step.function
    if inspect.iscoroutinefunction(own):
        return
    seeded = SeededCall(own, position, bool(step.with_indices))
    step._syncpoint_function = step.function  # what the step's identity digests (stream_identity.hf_identity)
    if filtering:
        step.mask_function = seeded
        step.function = partial(hf.add_mask, seeded, mask_column_name=step.mask_column_name)
    else:
        step.function = seeded
    step.with_indices = True


class _KeepsClass:
    """``datasets`` copies a step by naming its class (per epoch, rank and DataLoader worker): the
    copy of a replaced step is replaced too."""

    REPLACES: type = object

    def _kept(self, copy: Any) -> Any:
        if type(copy) is self.REPLACES:
            copy.__class__ = type(self)
        return copy

    def _init_state_dict(self) -> Any:
        """``datasets``' state, named by ``datasets``' class (a state reads the same either way)."""
        state = super()._init_state_dict()  # type: ignore[misc]
        if isinstance(state, dict) and state.get("type") == type(self).__name__:
            state["type"] = self.REPLACES.__name__
        return state

    def shuffle_data_sources(self, *args: Any, **kwargs: Any) -> Any:
        return self._kept(super().shuffle_data_sources(*args, **kwargs))  # type: ignore[misc]

    def shard_data_sources(self, *args: Any, **kwargs: Any) -> Any:
        return self._kept(super().shard_data_sources(*args, **kwargs))  # type: ignore[misc]

    def reshard_data_sources(self) -> Any:
        return self._kept(super().reshard_data_sources())  # type: ignore[misc]


class _Done:
    """A call made at once, in ``concurrent.futures.Future``'s shape: its exception is raised where
    ``datasets`` reads the result, as a thread's would be."""

    def __init__(self, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.value: Any = None
        self.error: Exception | None = None
        try:
            self.value = call(*args)
        except Exception as e:  # noqa: BLE001 - re-raised by result()
            self.error = e

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _InCallingThread:
    """The part of ``concurrent.futures.ThreadPoolExecutor`` that ``datasets``' interleave uses."""

    def __init__(self, max_workers: int | None = None) -> None:
        del max_workers

    def submit(self, call: Callable[..., Any], *args: Any) -> _Done:
        return _Done(call, args)

    def shutdown(self, wait: bool = True) -> None:
        del wait


_NO_THREADS = types.SimpleNamespace(futures=types.SimpleNamespace(ThreadPoolExecutor=_InCallingThread))


def _without_threads(function: Any) -> Any:
    """``datasets``' own code of ``function`` with ``concurrent`` (its thread pool) bound to
    ``_InCallingThread``: the interleave's logic and state stay ``datasets``'; only where its
    fetches run changes."""
    code = function.__code__
    if "concurrent" not in code.co_names or function.__closure__:
        raise RuntimeError(f"datasets' {function.__qualname__} changed: syncpoint cannot run it without threads")
    return types.FunctionType(code, {**vars(hf), "concurrent": _NO_THREADS}, function.__name__, function.__defaults__)


class SequentialCycling(_KeepsClass, hf.CyclingMultiSourcesExamplesIterable):
    """``interleave_datasets`` without probabilities or seed, its fetches in the calling thread."""

    REPLACES = hf.CyclingMultiSourcesExamplesIterable
    __iter__ = _without_threads(hf.CyclingMultiSourcesExamplesIterable.__iter__)
    _iter_arrow = _without_threads(hf.CyclingMultiSourcesExamplesIterable._iter_arrow)


class SequentialRandomlyCycling(_KeepsClass, hf.RandomlyCyclingMultiSourcesExamplesIterable):
    """``interleave_datasets`` with probabilities or a seed, its fetches in the calling thread."""

    REPLACES = hf.RandomlyCyclingMultiSourcesExamplesIterable
    __iter__ = SequentialCycling.__iter__
    _iter_arrow = SequentialCycling._iter_arrow

    def shift_rngs(self, value: int) -> Any:
        return self._kept(super().shift_rngs(value))


class RoundRobinState(TypedDict):
    """``RoundRobin``'s state, in the layout of ``datasets``' cycling interleave."""

    ex_iterable_idx: int  # the source whose turn is next
    previous_states: list[object]  # each source's own state after its last item (None: none yet)
    is_exhausted: list[bool]
    type: str


class RoundRobin(hf._BaseExamplesIterable):
    """Sources read in turn, one example (or Arrow table) each, skipping the exhausted ones, until all
    are: the order of ``datasets``' ``all_exhausted_without_replacement`` interleave, in its state
    layout (``previous_states[i]``: source i after the last item it gave). Each read runs inside
    ``reading_source(i)``: a repeated call below knows which source's copy of its step runs."""

    def __init__(self, ex_iterables: list[Any]) -> None:
        super().__init__()
        self.ex_iterables = ex_iterables

    @property
    def is_typed(self) -> bool:
        return bool(self.ex_iterables[0].is_typed)

    @property
    def features(self) -> Any:
        return self.ex_iterables[0].features

    @property
    def num_shards(self) -> int:
        return min(e.num_shards for e in self.ex_iterables)

    @property
    def iter_arrow(self) -> Callable[[], Iterator[Any]] | None:
        return self._iter_arrow if all(e.iter_arrow for e in self.ex_iterables) else None

    def _init_state_dict(self) -> RoundRobinState:
        for e in self.ex_iterables:
            e._init_state_dict()
        count = len(self.ex_iterables)
        self._state_dict: RoundRobinState = {
            "ex_iterable_idx": 0,
            "previous_states": [None] * count,
            "is_exhausted": [False] * count,
            "type": "CyclingMultiSourcesExamplesIterable",
        }
        return self._state_dict

    def __iter__(self) -> Iterator[Any]:
        return self._in_turn(iter)

    def _iter_arrow(self) -> Iterator[Any]:
        return self._in_turn(lambda source: source.iter_arrow())

    def _in_turn(self, reader: Callable[[Any], Iterator[Any]]) -> Iterator[Any]:
        # datasets' attribute, None until its _init_state_dict (this class's) has run
        state, count = cast("RoundRobinState | None", self._state_dict), len(self.ex_iterables)
        if state:
            for source, saved in zip(self.ex_iterables, state["previous_states"], strict=True):
                if saved is not None:
                    source.load_state_dict(saved)
        readers = [reader(e) for e in self.ex_iterables]
        turn = state["ex_iterable_idx"] if state else 0
        exhausted = list(state["is_exhausted"]) if state else [False] * count
        while not all(exhausted):
            now, turn = turn, (turn + 1) % count
            if exhausted[now]:
                continue
            with reading_source(now):
                item = next(readers[now], None)
            exhausted[now] = item is None
            if state:
                state["is_exhausted"][now] = exhausted[now]
                state["previous_states"][now] = self.ex_iterables[now].state_dict()
                state["ex_iterable_idx"] = turn
            if item is not None:
                yield item


class ShardInterleave(_KeepsClass, hf.InterleavedShardsExamplesIterable):
    """``.shuffle``'s interleave of up to ``max_input_shards`` shards, read by ``RoundRobin``."""

    REPLACES = hf.InterleavedShardsExamplesIterable

    def _interleave_shards(self) -> Any:
        count = min(self.ex_iterable.num_shards, self.max_input_shards)
        if count == 0:
            return self.ex_iterable
        return RoundRobin([self.ex_iterable.shard_data_sources(count, index) for index in range(count)])


class LiftedShuffle(_KeepsClass, hf.BufferShuffledExamplesIterable):
    """A ``.shuffle`` whose buffer syncpoint runs (``stream.lift_hf_buffer``): what remains of it
    passes examples and Arrow tables through as they come. Why not ``datasets``' own with a buffer
    of 1: over tables (of ``buffer_size // 10`` rows, when a format reads them) it permutes each
    table with a generator it restarts on every resume."""

    REPLACES = hf.BufferShuffledExamplesIterable

    def __iter__(self) -> Iterator[Any]:
        yield from self.ex_iterable

    def _iter_arrow(self) -> Iterator[Any]:
        yield from self.ex_iterable.iter_arrow()

    def shift_rngs(self, value: int) -> Any:
        return self._kept(super().shift_rngs(value))


REPLACED: dict[type, type] = {
    hf.CyclingMultiSourcesExamplesIterable: SequentialCycling,
    hf.RandomlyCyclingMultiSourcesExamplesIterable: SequentialRandomlyCycling,
    hf.InterleavedShardsExamplesIterable: ShardInterleave,
}


class RankDataset(IterableDataset):
    """A rank's ``datasets`` stream whose DataLoader workers resume (the module docstring)."""

    def _prepare_ex_iterable_for_iteration(self, *args: Any, **kwargs: Any) -> Any:
        if torch.utils.data.get_worker_info() is None:
            return super()._prepare_ex_iterable_for_iteration(*args, **kwargs)
        # in a worker, _iter_pytorch loads the saved state again into the worker's shard: that one counts
        fields: dict[str, object] = self.__dict__
        starting, fields["_starting_state_dict"] = fields["_starting_state_dict"], None
        try:
            return super()._prepare_ex_iterable_for_iteration(*args, **kwargs)
        finally:
            fields["_starting_state_dict"] = starting


def rank_dataset(own: Any) -> Any:
    """This rank's split stream as a ``RankDataset`` (a plain ``datasets.IterableDataset`` only)."""
    if type(own) is IterableDataset:
        own.__class__ = RankDataset
    return own
