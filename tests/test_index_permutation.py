"""The epoch order as a keyed bijection per position (``workers.index_permutation``): a bijection
exhaustively at small sizes and by inversion at large ones, keyed only by its integers, and cheap."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.index_permutation import FeistelPermutation


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 3000), key=st.lists(st.integers(0, 2**40), min_size=1, max_size=3))
def test_every_small_permutation_is_a_bijection(size, key):
    perm = FeistelPermutation(size, *key)
    order = perm(np.arange(size))
    assert np.array_equal(np.sort(order), np.arange(size))
    assert np.array_equal(perm.inverse(order), np.arange(size))


@settings(max_examples=50, deadline=None)
@given(size=st.integers(10**6, 10**11), seed=st.integers(0, 2**31),
       starts=st.lists(st.integers(0, 10**11), min_size=1, max_size=5))
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
