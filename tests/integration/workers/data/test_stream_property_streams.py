"""Property: a ``datasets`` stream, whatever composition of steps produced it, resumes from any
interruption to the micro-batches its uninterrupted run draws, or is refused before training,
naming why.

Hypothesis draws a composition (``tests.stream_tasks.composed``): a ``.map`` (none, plain or a
random crop; per example or batched; on each source or last), a ``.filter`` (none, by id or
random; per example or batched), an ``interleave_datasets`` of two sources (in turn, or drawn with
probabilities and a seed: the stream state then holds the generator's 128-bit state), ``datasets``'
``.shuffle`` (shard order only, or a buffer of 6 or 30) and ``train.stream_shuffle_buffer``; and how
it is read: 1 or 2 ranks (split by shard or by example), 0 to 3 DataLoader workers, one or two
interruptions, and whether the resume builds the task anew (a restarted process) or prepares the
same dataset object again (a restart in place).

Each rank's ``StreamSource`` (the loop's source of micro-batches: ``RankStream`` in a
``StatefulDataLoader``) draws the uninterrupted run's micro-batches and captures its state at the
first interruption; a source resumed from that capture, through the state file's codec, must draw
the same micro-batches tensor for tensor, and so must one resumed from its own capture at the
second. Training itself is left out: ``test_streams.py`` resumes whole runs, bit for bit, on what
this finds exact.

``make test`` runs 6 examples; ``tests/drills/test_property_streams.py`` runs 150 (``long``), as
does this one with ``SYNCPOINT_SLOW=1``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from syncpoint.policies.contracts.errors import TaskError
from syncpoint.workers.data.stream import StreamSource, prepare
from syncpoint.workers.data.stream_state import parse
from syncpoint.workers.task import load_task
from tests.helpers import needs, stream_spec

pytestmark = needs("datasets", "torchdata")

FAST_EXAMPLES = 150 if os.environ.get("SYNCPOINT_SLOW") == "1" else 6
COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DRAWS = 14  # micro-batches each rank draws: a pass is 3 to 20 of them, so most runs cross a pass's end


@dataclass(frozen=True)
class Composition:
    interleave: bool
    probabilities: bool
    map: str  # none | plain | random
    map_batch: int  # 0: per example
    map_first: bool  # on each source, before the interleave and the shuffle
    shuffle: str  # none | shards | buffer: datasets' .shuffle
    shuffle_buffer: int  # its buffer_size (datasets fills it from tables of buffer_size // 10 rows)
    buffer: int  # train.stream_shuffle_buffer
    filter: str  # none | plain | random
    filter_batch: int
    shards: int
    world: int
    workers: int  # train.dataloader_workers
    points: tuple[int, ...]  # the interruptions: micro-batches drawn before each, increasing
    in_place: bool  # the resume prepares the same dataset object again

    def overrides(self) -> list[str]:
        config = {
            "interleave": self.interleave,
            "probabilities": self.probabilities,
            "map": self.map,
            "map_batch": self.map_batch,
            "map_first": self.map_first,
            "shuffle": self.shuffle,
            "shuffle_buffer_size": self.shuffle_buffer,
            "filter": self.filter,
            "filter_batch": self.filter_batch,
            "shards": self.shards,
        }
        return [
            "task.path=tests.stream_tasks:composed",
            *(f"task.config.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in config.items()),
            f"train.stream_shuffle_buffer={self.buffer}",
            f"train.dataloader_workers={self.workers}",
        ]

    @property
    def refusal(self) -> str | None:
        """What a refusal must name, or None: the composition resumes exactly."""
        if self.shuffle == "buffer" and self.buffer > 1:
            return r"train\.stream_shuffle_buffer: \d+, and .* shuffled with a buffer .*one shuffle buffer per stream"
        return None


def _shards(draw: Any, world: int, interleave: bool) -> int:
    """A shard count for which the ranks split the stream by shard or by example (drawn): the
    interleave of the even and the odd shards has as many shards as its smaller source."""
    by_shard = world == 1 or draw(st.booleans())
    if interleave:
        counts = [4, 5, 8] if by_shard and world == 2 else [2, 3, 6, 7]
    else:
        counts = [2, 4, 6] if by_shard and world == 2 else [3, 5]
    return draw(st.sampled_from(counts if world == 2 else [2, 3, 4, 5]))


@st.composite
def compositions(draw: Any) -> Composition:
    interleave, world = draw(st.booleans()), draw(st.sampled_from([1, 2]))
    kind = draw(st.sampled_from(["none", "plain", "random", "random"]))
    keep = draw(st.sampled_from(["none", "plain", "random"]))
    first = draw(st.integers(1, DRAWS - 1))
    points = (first,) if first >= DRAWS - 1 or draw(st.booleans()) else (first, draw(st.integers(first + 1, DRAWS - 1)))
    return Composition(
        interleave=interleave,
        probabilities=interleave and draw(st.booleans()),
        map=kind,
        map_batch=draw(st.sampled_from([0, 0, 3, 8])) if kind != "none" else 0,
        map_first=kind != "none" and draw(st.booleans()),
        shuffle=draw(st.sampled_from(["none", "shards", "buffer", "buffer"])),
        shuffle_buffer=draw(st.sampled_from([6, 30])),
        buffer=draw(st.sampled_from([0, 0, 0, 5])),
        filter=keep,
        filter_batch=draw(st.sampled_from([0, 0, 4])) if keep != "none" else 0,
        shards=_shards(draw, world, interleave),
        world=world,
        workers=draw(st.integers(0, 3)),
        points=points,
        in_place=draw(st.booleans()),
    )


# ------------------------------------------------------------------ the sources


def _source(spec: Any, dataset: Any, collate: Any, rank: int, world: int, saved: Any = None) -> StreamSource:
    prepared = prepare(spec, dataset, collate, rank, world)
    return StreamSource(
        prepared, seed=spec.train.seed, rank=rank, num_workers=spec.train.dataloader_workers, saved=saved
    )


def _draw(source: StreamSource, count: int) -> list[torch.Tensor]:
    return [source.next_batch() for _ in range(count)]


def _assert_same(expected: list[torch.Tensor], got: list[torch.Tensor], what: str) -> None:
    assert len(expected) == len(got)
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert torch.equal(a, b), f"{what}: micro-batch {i} differs"


def check_rank(c: Composition, spec: Any, rank: int) -> None:
    """One rank: the uninterrupted micro-batches, then each resume's, compared tensor for tensor."""
    task = load_task(spec.task.path, spec.task.config)
    whole = _source(spec, task.dataset, task.collate, rank, c.world)
    try:
        expected = _draw(whole, c.points[0])
        capture = whole.capture()
        expected += _draw(whole, DRAWS - c.points[0])
    finally:
        whole.close()
    ends = [*c.points[1:], DRAWS]
    for start, end in zip(c.points, ends, strict=True):
        if not c.in_place:
            task = load_task(spec.task.path, spec.task.config)
        resumed = _source(spec, task.dataset, task.collate, rank, c.world, parse(capture, "stream/rank.safetensors"))
        try:
            _assert_same(expected[start:end], _draw(resumed, end - start), f"rank {rank} resumed at {start}")
            capture = resumed.capture()
        finally:
            resumed.close()


def check_composition(c: Composition) -> None:
    note(f"composition: {c}")
    event(f"world {c.world}, {c.workers} loader workers")
    event(f"map {c.map} batch {c.map_batch}{' first' if c.map_first else ''}; filter {c.filter} batch {c.filter_batch}")
    event(f"shuffle {c.shuffle}, buffer {c.buffer}{', interleave' if c.interleave else ''}")
    root = tempfile.mkdtemp(prefix="syncpoint-streams-")
    try:
        spec = stream_spec(os.path.join(root, "run"), os.path.join(root, "corpus"), *c.overrides(), workers=c.world)
        if c.refusal is not None:
            task = load_task(spec.task.path, spec.task.config)
            with pytest.raises(TaskError, match=c.refusal):
                prepare(spec, task.dataset, task.collate, 0, c.world)
            return
        for rank in range(c.world):
            check_rank(c, spec, rank)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _case(**fields: Any) -> Composition:
    """A composition: the plainest stream on 2 ranks, interrupted once, with ``fields`` changed."""
    plain = dict(
        interleave=False,
        probabilities=False,
        map="plain",
        map_batch=0,
        map_first=False,
        shuffle="none",
        shuffle_buffer=6,
        buffer=0,
        filter="none",
        filter_batch=0,
        shards=4,
        world=2,
        workers=0,
        points=(3,),
        in_place=False,
    )
    return Composition(**{**plain, **fields})


# issue 47 §3's cases, in every run of the fast test (each failed before its fix)
ISSUE_CASES = [
    _case(map="random", map_batch=8),  # a batched random map, resumed mid-batch
    _case(filter="random", shards=3, workers=3, points=(6, 7)),  # random filter, split by example, 3 workers
    _case(shuffle="buffer", workers=2, points=(5, 6)),  # datasets' .shuffle recipe with DataLoader workers
    _case(interleave=True, probabilities=True, shuffle="shards", points=(1,)),  # probabilities and a seed
]


@settings(max_examples=FAST_EXAMPLES, **COMMON)
@given(compositions())
@example(ISSUE_CASES[0])
@example(ISSUE_CASES[1])
@example(ISSUE_CASES[2])
@example(ISSUE_CASES[3])
def test_every_stream_composition_resumes_exactly_or_is_refused(composition):
    check_composition(composition)
