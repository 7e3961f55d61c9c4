"""Stream datasets: iterables whose position is their own state, not an index.

A task may return as ``Task.dataset`` a Hugging Face ``datasets.IterableDataset``
(``load_dataset(..., streaming=True)``, with ``.map``, ``.with_format("torch")``, ...) or any
iterable dataset with ``state_dict()`` / ``load_state_dict()`` (torchdata's ``Stateful``). The task
returns the whole stream; each rank reads its own part of it:

* a ``datasets.IterableDataset`` is split with ``datasets.distributed.split_dataset_by_node`` (by
  shard when ``n_shards`` is a multiple of the world size, else every rank keeps one example in
  ``world_size``);
* any other stateful stream must have ``split(rank, world_size)`` returning this rank's stream
  (itself stateful; with DataLoader workers it takes its worker's share with
  ``torch.utils.data.get_worker_info()``, as any torch IterableDataset does). ``set_epoch(k)``,
  when it has one, is called before each pass; ``stream_identity()``, when it has one, returns a
  JSON value that names the stream (its files, say), compared at selection.

Why syncpoint batches the stream itself (``RankStream``): each rank must draw exactly one
micro-batch per micro-step, so its micro-batches have ``train.micro_batch_size`` examples (the rest
of a pass is dropped) and its stream repeats: when it ends, the rank's next pass starts
(``set_epoch(pass)``, which re-seeds a ``datasets`` shard shuffle), independently of the other
ranks. Every example is drawn, and every micro-batch collated, with Python's, NumPy's and torch's
global RNG and the stream's own generators seeded from (seed, rank, pass, DataLoader worker, count),
so random augmentation in a ``.map`` or the collate is a function of the position, in whichever
process runs it. ``train.stream_shuffle_buffer`` shuffles the examples through a buffer whose draws
are derived the same way and whose content is part of the state, so a resume continues the same
order. A ``datasets`` stream's own ``.shuffle(seed, buffer_size)`` is run by that buffer
(``lift_hf_buffer``): ``datasets`` keeps no buffer content in its state (huggingface/datasets#7444:
a resume refills it with other examples), so syncpoint takes the buffer over, draws it from the
shuffle's own generator, and leaves ``datasets`` the shard order, whose interleave of shards
syncpoint runs in the calling thread (``stream_hf``). Where ``datasets`` may compute an example in
another draw than the one that yields it (a batched ``.map``, an interleave reading ahead), the
function runs under a seed of its own position instead (``SeededCall``); ``stream_hf`` says where.

The rank's position (``StreamSource.capture``) is its pass number and torchdata's
``StatefulDataLoader`` state, which holds every DataLoader worker's ``RankStream`` state (the
stream's own ``state_dict()``, the counts, the buffer); ``syncpoint.workers.data.stream_state`` writes it without
pickle. A stream's state is per rank and per DataLoader worker: selection refuses it on another
world size or another ``train.dataloader_workers`` (``syncpoint.policies.decisions.candidates``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import torch

from syncpoint.policies.contracts.errors import JobConfigError, TaskError
from syncpoint.policies.contracts.spec import JobSpec
from syncpoint.policies.contracts.state_identity import StreamFields
from syncpoint.policies.decisions.elastic import Layout, stream_layout
from syncpoint.workers.data.sampler import SeededBatch, SeededCollate, _reseeded, _seeded_rngs
from syncpoint.workers.data.stream_draws import SeededCall, drawing, hf_pipeline, reading_source  # noqa: F401 - this module's API too
from syncpoint.workers.data.stream_identity import (
    HF_EMPTY_BUFFER_NOTE,
    LiftedBuffer,
    buffer_of,
    custom_identity,
    generator_seed,
    hf_buffer_steps,
    hf_identity,
)
from syncpoint.workers.data.stream_state import SavedStream, encode
from syncpoint.workers.observation.log_filters import drop
from syncpoint.workers.task import hf_iterable
from syncpoint.workers.training.rng import derive_seed
from syncpoint.workers.training.task_rngs import DataGenerators

# Salts of the seeds a stream derives (with seed, rank, pass, worker and a count). Part of the resume
# contract: a state resumes to the same examples only while these stay as they are.
STREAM_EXAMPLE_SALT = 0x57EA4E  # each example's draw from the stream (its .map's randomness)


STREAM_COLLATE_SALT = 0x57C011  # each micro-batch's collate


STREAM_SHUFFLE_SALT = 0x575FF1  # each draw from the shuffle buffer


STREAM_LOADER_SALT = 0x57DA7A  # the DataLoader's generator (its workers' base seed)


@dataclass
class PreparedStream:
    """This rank's stream, ready for the loop, and what a state records of it."""

    stream: RankStream
    record: StreamFields  # what a state records of it (``StreamRecord``)
    layout: Layout


def prepare(
    spec: JobSpec, dataset: Any, collate: Callable[[list[Any]], Any] | None, rank: int, world_size: int
) -> PreparedStream:
    """Check the job fits a stream, split it for this rank, and wrap it (``JobConfigError`` /
    ``TaskError``, one paragraph, when it cannot be resumed exactly)."""
    check_spec(spec)
    try:
        import torchdata.stateful_dataloader  # noqa: F401 - needed before the first fetch: checked at start
    except ImportError:
        raise TaskError(
            f"task.path: {spec.task.path!r} returned a stream dataset, which syncpoint reads through "
            "torchdata's StatefulDataLoader: install it on every worker (pip install "
            "'syncpoint[datasets]', or torchdata==0.11.*)"
        ) from None
    train = spec.train
    buffer, shuffle_seed = train.stream_shuffle_buffer, None
    if hf_iterable(dataset):
        _check_hf(spec, dataset)
        lifted = lift_hf_buffer(spec, dataset)
        if lifted is not None:
            buffer, shuffle_seed = lifted.buffer_size, lifted.seed
        from datasets.distributed import split_dataset_by_node

        from syncpoint.workers.data import stream_hf

        stream_hf.adjust(dataset)
        own = stream_hf.rank_dataset(split_dataset_by_node(dataset, rank=rank, world_size=world_size))
        source, identity = "huggingface", hf_identity(dataset)
    else:
        source, own = "custom", _custom_split(spec, dataset, rank, world_size)
        identity = custom_identity(dataset, spec.task.path)
    record: StreamFields = {
        "source": source,
        "identity": identity,
        "dataloader_workers": train.dataloader_workers,
        "shuffle_buffer": buffer,
    }
    stream = RankStream(
        own,
        seed=train.seed,
        rank=rank,
        micro_batch_size=train.micro_batch_size,
        collate=collate,
        shuffle_buffer=buffer,
        shuffle_seed=shuffle_seed,
    )
    return PreparedStream(
        stream, record, stream_layout(train.micro_batch_size, train.grad_accum, world_size, train.stream_epoch_steps)
    )


def check_spec(spec: JobSpec) -> None:
    """What a stream job must say: its length in optimizer steps (a stream has none), a fixed number
    of workers (its position is per rank), no sample ids to record (a stream has no index)."""
    train, where = spec.train, f"task {spec.task.path} returns a stream dataset"
    if train.stream_epoch_steps is None:
        if train.max_steps is None or train.epochs is not None:
            raise JobConfigError(
                f"train.epochs: {where}, which has no length, so epochs cannot be counted. Set train.max_steps (the "
                "run's length in optimizer steps) and remove train.epochs, or declare an epoch with "
                "train.stream_epoch_steps (optimizer steps per epoch) for train.epochs to count"
            )
        epoch_units = [
            name
            for name, unit in (
                ("train.scheduler.unit", train.scheduler.unit),
                ("train.eval_every", train.eval_every.unit if train.eval_every.value else None),
            )
            if unit == "epochs"
        ]
        if epoch_units:
            raise JobConfigError(
                f"{epoch_units[0]}: {where}, which has no epochs; count in optimizer_steps, or "
                "declare an epoch with train.stream_epoch_steps"
            )
    if spec.scaling.elastic:
        raise JobConfigError(
            f"scaling.num_workers: {where}; its position is each rank's own (its shard position, DataLoader "
            "workers and shuffle buffer), so a state cannot continue on another number of workers: set a fixed "
            "scaling.num_workers"
        )
    if train.record_samples:
        raise JobConfigError(f"train.record_samples: {where}, whose examples have no index to record; remove it")


def check_map_spec(spec: JobSpec) -> None:
    """The stream fields set for a map-style dataset would silently do nothing: refused."""
    train = spec.train
    for name, value in (
        ("stream_shuffle_buffer", train.stream_shuffle_buffer),
        ("stream_epoch_steps", train.stream_epoch_steps),
    ):
        if value:
            raise JobConfigError(
                f"train.{name}: applies to stream datasets, and task {spec.task.path} returns a map-style dataset "
                "(its epochs are its length, its order syncpoint's per-epoch permutation): remove it"
            )


def _check_hf(spec: JobSpec, dataset: Any) -> None:
    if getattr(dataset, "_distributed", None) is not None:
        raise TaskError(
            f"task.path: {spec.task.path!r} returned a datasets.IterableDataset already split with "
            "split_dataset_by_node: return the whole stream; syncpoint splits it per rank"
        )


def lift_hf_buffer(spec: JobSpec, dataset: Any) -> LiftedBuffer | None:
    """Take a ``datasets`` stream's shuffle buffer over (None when it has none larger than one).

    Why: ``datasets``' state holds no buffer content (huggingface/datasets#7444), so its own buffer
    cannot resume exactly; syncpoint's buffer is saved with every state. The step keeps its shard-
    order shuffle (its ``buffer_size`` becomes 1, which ``datasets`` resumes exactly); the buffer
    moves to the end of the pipeline, after any later ``.map``/``.filter`` (a per-example step draws
    the same examples either way), and its draws come from the step's generator and the position. The
    step is changed in place and remembers what it had, so a second ``prepare`` of the same object
    (a restart in the same process) lifts the same buffer."""
    steps = [s for s in hf_buffer_steps(dataset) if buffer_of(s) > 1]
    if not steps:
        return None
    where = f"task.path: {spec.task.path!r} returned a datasets.IterableDataset"
    if len(steps) > 1:
        sizes = ", ".join(str(buffer_of(s)) for s in steps)
        raise TaskError(
            f"{where} shuffled with {len(steps)} buffers (buffer_size {sizes}): syncpoint runs a stream's shuffle "
            "buffer itself, once, at the end of the pipeline; keep one .shuffle(seed, buffer_size)"
        )
    if spec.train.stream_shuffle_buffer > 1:
        raise TaskError(
            f"train.stream_shuffle_buffer: {spec.train.stream_shuffle_buffer}, and {where} shuffled with a buffer "
            f"(.shuffle(buffer_size={buffer_of(steps[0])})): one shuffle buffer per stream; remove "
            "train.stream_shuffle_buffer or the .shuffle(...)"
        )
    step = steps[0]
    drop("datasets.iterable_dataset", HF_EMPTY_BUFFER_NOTE)
    lifted = getattr(step, "_syncpoint_lifted", None)
    if not isinstance(lifted, LiftedBuffer):
        lifted = LiftedBuffer(int(step.buffer_size), generator_seed(step.generator))
        step._syncpoint_lifted = lifted
        step.buffer_size = 1
    return lifted


def _custom_split(spec: JobSpec, dataset: Any, rank: int, world_size: int) -> Any:
    """The contract for a stateful stream that is not a ``datasets`` one: ``split(rank, world_size)``."""
    split = getattr(dataset, "split", None)
    if not callable(split):
        if world_size == 1:
            return dataset
        raise TaskError(
            f"task.path: {spec.task.path!r} returned a stateful stream ({type(dataset).__qualname__}) without "
            f"split(rank, world_size): on {world_size} workers each rank needs its own part of the stream. Give it a "
            "split(rank: int, world_size: int) method returning this rank's stream (itself with "
            "state_dict()/load_state_dict()), or use a datasets.IterableDataset (split with split_dataset_by_node)"
        )
    own = split(rank, world_size)
    if not (callable(getattr(own, "state_dict", None)) and callable(getattr(own, "load_state_dict", None))):
        raise TaskError(
            f"task.path: {spec.task.path!r}: the dataset's split({rank}, {world_size}) returned "
            f"{type(own).__qualname__}, which has no state_dict()/load_state_dict(); it must return this "
            "rank's stream, stateful like the whole one"
        )
    return own


class StreamGenerators(DataGenerators):
    """The generators a draw reseeds: those reachable from the stream, less a ``datasets`` step's own
    (a ``.shuffle``'s, ``interleave_datasets``' with probabilities or a seed). Those are ``datasets``'
    state, which it saves and restores itself; reseeded in every draw, the copies it makes of them
    as a pass begins were the draw's (an interleave with probabilities resumed to other examples)."""

    def __init__(self, obj: Any, root: str) -> None:
        super().__init__(obj, root)
        self._kept_pid: int | None = None
        self._kept: list[tuple[int, Any]] = []

    def __getstate__(self) -> dict[str, object]:
        return {**super().__getstate__(), "_kept_pid": None, "_kept": []}

    def found(self) -> list[tuple[int, Any]]:
        if self._kept_pid != os.getpid():
            steps = {id(getattr(step, "generator", None)) for step in hf_pipeline(self.obj)}
            self._kept = [(salt, g) for salt, g in super().found() if id(g) not in steps]
            self._kept_pid = os.getpid()
        return self._kept


class Position(TypedDict):
    """Where one copy of the stream is in its pass: examples drawn, buffer draws taken, micro-batches
    made, whether the stream ran out, and the shuffle buffer's examples."""

    examples: int
    taken: int
    batches: int
    exhausted: bool
    buffer: list[object]


# A copy's saved position (``RankStream.state_dict``): its pass (absent from states written before
# states named it), the stream's own state (None: the pass's start) and ``Position``'s fields.
# Functional form: ``pass`` is a keyword.
WorkerState = TypedDict(
    "WorkerState",
    {
        "pass": NotRequired[int],
        "inner": object,
        "examples": int,
        "taken": int,
        "batches": int,
        "exhausted": bool,
        "buffer": list[object],
    },
)


class RankStream(torch.utils.data.IterableDataset):
    """This rank's stream as micro-batches, every draw seeded by its position, with its state.

    In each DataLoader worker (or the main process) one copy iterates; ``state_dict`` is that
    copy's position: the stream's own state, how many examples and micro-batches it drew in this
    pass, the shuffle buffer's content and draws, and whether the stream ran out (the buffer then
    drains). ``load_state_dict`` takes effect at the next ``__iter__``; until then the loaded state
    is this copy's position. A state is tagged with its pass: asked before it has begun the current
    pass (a DataLoader worker at a pass's start, which torchdata records as the worker's state until
    the worker yields), a copy says it is at that pass's start, not where the last pass ended.

    The pass reaches the stream's own ``set_epoch`` where it is safe: a ``datasets`` stream keeps
    its epoch in one shared-memory tensor that every DataLoader worker sees, and updates it with a
    read-modify-write (``_epoch += epoch - _epoch``), so two workers setting it at once can leave
    pass 1 as epoch 2, and its shard order (reshuffled every epoch > 0) differs from run to run: it
    is set once, in the loop's process, before the pass's workers start. Any other stream is set
    in each worker, on that worker's own copy.
    """

    def __init__(
        self,
        inner: Any,
        *,
        seed: int,
        rank: int,
        micro_batch_size: int,
        collate: Callable[[list[Any]], Any] | None,
        shuffle_buffer: int,
        shuffle_seed: int | None = None,
    ) -> None:
        self.inner, self.seed, self.rank = inner, seed, rank
        self.micro_batch_size, self.shuffle_buffer = micro_batch_size, shuffle_buffer
        # a lifted datasets .shuffle's own seed joins the buffer's draws (None: train.stream_shuffle_buffer)
        self.shuffle_salt = (STREAM_SHUFFLE_SALT,) if shuffle_seed is None else (STREAM_SHUFFLE_SALT, shuffle_seed)
        self.collate = SeededCollate(collate)
        self.generators = StreamGenerators(inner, "dataset")
        # shared memory: DataLoader workers live across passes and read the pass the loop set
        self._pass = torch.zeros((), dtype=torch.int64).share_memory_()
        self._epoch_in_loop_process = hf_iterable(inner)  # its epoch is shared memory (the docstring)
        self._resume: WorkerState | None = None
        self._position: Position = _fresh_position()
        self._position_pass = -1  # the pass self._position is in (-1: none begun in this copy)

    @property
    def pass_number(self) -> int:
        return int(self._pass)

    def set_epoch(self, pass_number: int) -> None:
        """The next ``__iter__`` (in every DataLoader worker) reads pass ``pass_number``."""
        self._pass.fill_(pass_number)
        if self._epoch_in_loop_process:
            self.inner.set_epoch(pass_number)

    def state_dict(self) -> WorkerState:
        if self._resume is not None:
            return WorkerState(**self._resume)
        if self._position_pass != self.pass_number:  # "inner": None, the stream's own start of the pass
            return {"pass": self.pass_number, "inner": None, **_fresh_position()}
        p = self._position
        return {
            "pass": self._position_pass,
            "inner": self.inner.state_dict(),
            "examples": p["examples"],
            "taken": p["taken"],
            "batches": p["batches"],
            "exhausted": p["exhausted"],
            "buffer": list(p["buffer"]),
        }

    def load_state_dict(self, state: WorkerState) -> None:
        self._resume = state

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        key = (self.seed, self.rank, self.pass_number, info.id if info is not None else 0)
        if not self._epoch_in_loop_process and callable(getattr(self.inner, "set_epoch", None)):
            self.inner.set_epoch(self.pass_number)  # in this process: a worker's copy is its own
        resume, self._resume = self._resume, None
        if resume is not None and _of_pass(resume, self.pass_number):
            if resume["inner"] is not None:
                self.inner.load_state_dict(resume["inner"])
            self._position = {
                "examples": resume["examples"],
                "taken": resume["taken"],
                "batches": resume["batches"],
                "exhausted": resume["exhausted"],
                "buffer": list(resume["buffer"]),
            }
        else:
            self._position = _fresh_position()
        self._position_pass = self.pass_number
        source = iter(self.inner)
        while True:
            examples: list[Any] = []
            while len(examples) < self.micro_batch_size:
                example = self._next_example(source, key)
                if example is _END:
                    return  # the pass's last examples, fewer than a micro-batch, are dropped
                examples.append(example)
            batch = SeededBatch(examples)
            batch.seed = derive_seed(*key, STREAM_COLLATE_SALT, self._position["batches"])
            self._position["batches"] += 1
            yield self.collate(batch)

    def _draw(self, source: Iterator[Any], key: tuple[int, ...]) -> Any:
        """The stream's next example, its randomness seeded by its count in this pass."""
        p = self._position
        if p["exhausted"]:
            return _END
        seed = derive_seed(*key, STREAM_EXAMPLE_SALT, p["examples"])
        with _seeded_rngs(seed), _reseeded(self.generators, seed), drawing(key):
            try:
                example = next(source)
            except StopIteration:
                p["exhausted"] = True
                return _END
        p["examples"] += 1
        return example

    def _next_example(self, source: Iterator[Any], key: tuple[int, ...]) -> Any:
        if self.shuffle_buffer <= 1:
            return self._draw(source, key)
        p = self._position
        buffer = p["buffer"]
        while len(buffer) < self.shuffle_buffer:
            example = self._draw(source, key)
            if example is _END:
                break
            buffer.append(example)
        if not buffer:
            return _END
        j = derive_seed(*key, *self.shuffle_salt, p["taken"]) % len(buffer)
        p["taken"] += 1
        buffer[j], buffer[-1] = buffer[-1], buffer[j]
        return buffer.pop()


_END = object()


def _fresh_position() -> Position:
    return {"examples": 0, "taken": 0, "batches": 0, "exhausted": False, "buffer": []}


def _of_pass(state: WorkerState, pass_number: int) -> bool:
    """Whether a saved worker state is a position in pass ``pass_number``. A state written before
    states named their pass has none: a ``datasets`` stream's own state names its epoch (the pass),
    which tells a stale one apart; any other is taken as it is."""
    if "pass" in state:
        return bool(state["pass"] == pass_number)
    inner = state.get("inner")
    return not (isinstance(inner, dict) and isinstance(inner.get("epoch"), int)) or inner["epoch"] == pass_number


def _as_is(item: Any) -> Any:
    """The DataLoader's collate: ``RankStream`` yields whole micro-batches, collated already."""
    return item


class StreamSource:
    """This rank's micro-batches, pass after pass, from one ``StatefulDataLoader`` over its stream.

    Its DataLoader workers persist across passes (a pass's start then costs no process start and
    no import of the stream's libraries in each new worker); each pass's number reaches them
    through ``RankStream.set_epoch``. On resume the loader takes the saved state before the first
    fetch. A pass that yields nothing is an error: the stream would never produce the micro-batch
    every rank must draw."""

    def __init__(
        self, prepared: PreparedStream, *, seed: int, rank: int, num_workers: int, saved: SavedStream | None
    ) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.stream, self.rank = prepared.stream, rank
        self.pass_number = saved.pass_number if saved is not None else 0
        self.stream.set_epoch(self.pass_number)
        # its own generator: building the loader never draws from the global torch RNG
        generator = torch.Generator().manual_seed(derive_seed(seed, rank, STREAM_LOADER_SALT))
        with warnings.catch_warnings():  # torchdata 0.11 calls torch's deprecated set_vital: not the user's concern
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            self.loader = StatefulDataLoader(
                self.stream,
                batch_size=None,
                collate_fn=_as_is,
                num_workers=num_workers,
                persistent_workers=num_workers > 0,
                generator=generator,
            )
        if saved is not None:
            self.loader.load_state_dict(saved.loader)
        self.iterator: Iterator[Any] | None = None
        self.yielded_in_pass = saved is not None  # a resumed pass already yielded before the save

    def next_batch(self) -> Any:
        while True:
            if self.iterator is None:
                self.iterator = iter(self.loader)
            try:
                batch = next(self.iterator)
            except StopIteration:
                if not self.yielded_in_pass:
                    raise TaskError(
                        f"rank {self.rank}'s stream yields no micro-batch of train.micro_batch_size examples in a "
                        f"whole pass (pass {self.pass_number}): give it more examples (with DataLoader workers, "
                        "each worker's shards fill micro-batches on their own), a smaller micro_batch_size, "
                        "or fewer workers"
                    ) from None
                self.pass_number += 1
                self.stream.set_epoch(self.pass_number)
                self.iterator, self.yielded_in_pass = None, False
                continue
            self.yielded_in_pass = True
            return batch

    def epoch(self, count: int) -> Iterator[Any]:
        for _ in range(count):
            yield self.next_batch()

    def capture(self) -> bytes:
        """This rank's position at a boundary, as its stream file's bytes (``StreamStateError``
        naming a value the file cannot hold)."""
        return encode(SavedStream(self.pass_number, self.loader.state_dict()))

    def close(self) -> None:
        """Stop the DataLoader's workers, if any (the loader holds them across passes)."""
        shutdown = getattr(getattr(self.loader, "_iterator", None), "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self.iterator = None
