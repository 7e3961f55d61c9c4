"""The epoch order as a keyed bijection per position (``syncpoint.workers.data.index_permutation``): a bijection
exhaustively at small sizes and by inversion at large ones, keyed only by its integers, and cheap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from syncpoint.workers.data.index_permutation import FeistelPermutation


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 3000), key=st.lists(st.integers(0, 2**40), min_size=1, max_size=3))
def test_every_small_permutation_is_a_bijection(size, key):
    perm = FeistelPermutation(size, *key)
    order = perm(np.arange(size))
    assert np.array_equal(np.sort(order), np.arange(size))
    assert np.array_equal(perm.inverse(order), np.arange(size))


@settings(max_examples=50, deadline=None)
@given(
    size=st.integers(10**6, 10**11),
    seed=st.integers(0, 2**31),
    starts=st.lists(st.integers(0, 10**11), min_size=1, max_size=5),
)
def test_large_permutations_invert_exactly_on_samples(size, seed, starts):
    """Injective where sampled: the inverse of each image is its position (a map with an inverse on
    its image is injective there), and every image lies in range."""
    perm = FeistelPermutation(size, seed)
    positions = np.unique(np.concatenate([np.arange(s % size, min(s % size + 64, size)) for s in starts]))
    images = perm(positions)
    assert images.min() >= 0 and images.max() < size
    assert np.array_equal(perm.inverse(images), positions)
    assert len(np.unique(images)) == len(positions)


def test_the_order_depends_only_on_its_key():
    a, b = FeistelPermutation(10**9, 1, 2), FeistelPermutation(10**9, 1, 2)
    p = np.arange(10**8, 10**8 + 1000)
    assert np.array_equal(a(p), b(p))
    assert not np.array_equal(a(p), FeistelPermutation(10**9, 1, 3)(p))
    # pinned values: the order is part of the resume contract (old states resume to the same samples)
    assert FeistelPermutation(10**10, 7, 0, 0x5EED)(np.arange(3)).tolist() == [6622854455, 6833246930, 4641762128]
    assert FeistelPermutation(10, 3)(np.arange(10)).tolist() == [9, 4, 1, 2, 7, 5, 3, 8, 0, 6]


def test_a_shuffled_order_looks_random():
    n = 100_000
    order = FeistelPermutation(n, 42)(np.arange(n))
    assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.02
    assert (order == np.arange(n)).sum() < 10  # about one fixed point expected
    first_tenth = order[: n // 10]
    assert abs(first_tenth.mean() - n / 2) < n * 0.02  # no drift towards either end


def test_out_of_range_positions_are_refused():
    perm = FeistelPermutation(10, 1)
    with pytest.raises(IndexError):
        perm([10])
    with pytest.raises(IndexError):
        perm([-1])
    with pytest.raises(ValueError):
        FeistelPermutation(0, 1)


# ---------------------------------------------------------------- the sampler built on it


@settings(max_examples=100, deadline=None)
@given(
    num_samples=st.integers(1, 400),
    micro_batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 5),
)
def test_every_sample_once_per_epoch_across_ranks_and_the_same_order_on_every_world_size(
    num_samples, micro_batch_size, world, seed, epoch
):
    """The ranks' micro-batches of an epoch cover its first ``samples_per_epoch`` positions of one global
    order exactly once; a global micro-batch is the same samples in the same order on any world size
    whose micro-batches tile it (what the elastic rules allow: the global batch stays fixed)."""
    from syncpoint.policies.contracts.errors import DataLayoutError
    from syncpoint.workers.data.sampler import RankMicroBatches

    try:
        ranks = [RankMicroBatches(num_samples, micro_batch_size, world, r, seed, epoch, 0) for r in range(world)]
    except DataLayoutError:
        assert num_samples < micro_batch_size * world  # fewer samples than one global micro-batch
        return
    per_epoch = ranks[0].micro_batches_per_epoch
    seen = [i for mb in range(per_epoch) for r in ranks for i in r.indices(mb)]
    assert len(seen) == len(set(seen)) == per_epoch * micro_batch_size * world
    order = FeistelPermutation(num_samples, seed, epoch, 0x5EED)(np.arange(len(seen))).tolist()
    assert seen == order  # global order, micro-batch major, rank minor: independent of the world size
    one = RankMicroBatches(num_samples, micro_batch_size * world, 1, 0, seed, epoch, 0)
    assert [i for mb in range(one.micro_batches_per_epoch) for i in one.indices(mb)][: len(seen)] == seen


def test_the_legacy_sampler_is_the_materialised_permutation_it_always_was():
    """States written before the per-position sampler resume to the same samples: the legacy order is
    ``epoch_permutation`` sliced as before."""
    from syncpoint.policies.contracts.state_format import LEGACY_SAMPLER
    from syncpoint.workers.data.sampler import RankMicroBatches, epoch_permutation

    legacy = RankMicroBatches(64, 4, 2, 1, seed=1, epoch=3, start=0, sampler=LEGACY_SAMPLER)
    perm = epoch_permutation(64, 1, 3)
    assert [legacy.indices(mb) for mb in range(8)] == [perm[mb * 8 + 4 : mb * 8 + 8].tolist() for mb in range(8)]


def test_a_sampler_at_any_position_of_a_ten_billion_sample_epoch_costs_no_memory():
    import tracemalloc

    from syncpoint.workers.data.sampler import RankMicroBatches

    tracemalloc.start()
    try:
        sampler = RankMicroBatches(10**10, 8, 8, 5, seed=0, epoch=2, start=10**8)
        first = next(iter(sampler))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(first) == 8 and all(0 <= i < 10**10 for i in first) and len(set(first)) == 8
    assert len(sampler) == 10**10 // 64 - 10**8
    assert peak < 1 << 20  # < 1 MB: no order is materialised


@settings(max_examples=150, deadline=None)
@given(
    size=st.one_of(st.integers(1, 4100), st.integers(4100, 10**12)),
    key=st.lists(st.integers(0, 2**40), min_size=1, max_size=3),
    picks=st.lists(st.integers(0, 10**12), min_size=1, max_size=200),
)
def test_the_table_the_python_walk_and_the_vectorised_walk_give_the_same_order(size, key, picks):
    """Three ways to compute one order (a table for small sizes, Python ints for a micro-batch's few
    positions, NumPy for many): the same values as the reference walk, so no state ever resumes to
    other samples because a call took another path."""
    perm = FeistelPermutation(size, *key)
    positions = np.array([p % size for p in picks], dtype=np.int64)
    reference = perm._walk(positions.astype(np.uint64), perm._encrypt).astype(np.int64)
    assert np.array_equal(perm(positions), reference)
    assert perm.at(positions.tolist()) == reference.tolist()
    assert np.array_equal(perm(positions[:3]), reference[:3])  # few positions: the Python walk
    if size <= 4100:
        assert np.array_equal(perm.table(), perm(np.arange(size)))
    with pytest.raises(IndexError):
        perm.at([size])


@settings(max_examples=60, deadline=None)
@given(
    num_samples=st.integers(40, 3000),
    micro_batch_size=st.integers(1, 70),
    world=st.integers(1, 3),
    start=st.integers(0, 30),
    sampler=st.sampled_from(["feistel/v1", "global-permutation/v1", "shard-window/v1"]),
    windows=st.integers(1, 4),
)
def test_a_sampler_yields_its_orders_micro_batches_whether_computed_in_chunks_or_one_at_a_time(
    num_samples, micro_batch_size, world, start, sampler, windows
):
    """Iteration computes indices ahead in chunks (and the first micro-batch alone); every yielded
    micro-batch must be the order's positions for it, exactly as ``indices(i)`` gives them."""
    from syncpoint.policies.contracts.errors import DataLayoutError
    from syncpoint.workers.data.sampler import RankMicroBatches

    shard_rows = [num_samples // 5] * 4 + [num_samples - 4 * (num_samples // 5)]
    extra = {"shard_rows": shard_rows, "window_shards": windows} if sampler == "shard-window/v1" else {}
    for rank in range(world):
        try:
            s = RankMicroBatches(num_samples, micro_batch_size, world, rank, 9, 2, 0, sampler=sampler, **extra)
        except DataLayoutError:
            return
        s.start = min(start, s.micro_batches_per_epoch)
        told: list[int] = []
        s.on_position = lambda first, count, told=told: told.append(first)
        got = list(s)
        g = micro_batch_size * world
        want = [
            s.order(np.arange(m * g + rank * micro_batch_size, m * g + (rank + 1) * micro_batch_size)).tolist()
            for m in range(s.start, s.micro_batches_per_epoch)
        ]
        assert got == want
        assert got == [s.indices(m) for m in range(s.start, s.micro_batches_per_epoch)]
        assert told == [m * g for m in range(s.start, s.micro_batches_per_epoch)]
