"""An epoch's sample order as a keyed bijection computed per position: O(1) memory at any size.

Why not ``torch.randperm(num_samples)``: it materialises the whole order on every rank every epoch
(10^8 samples: 800 MB and seconds per rank; 10^10 would not fit), although a rank only ever needs
the few indices of its next micro-batch. A permutation that maps a position to a sample index
directly costs nothing to build and a few integer operations per sample.

The bijection (Black and Rogaway, "Ciphers with arbitrary finite domains", 2002): a balanced
Feistel network on ``2^(2h)`` values, ``2^(2h) >= num_samples``, restricted to ``[0, num_samples)``
by cycle-walking.

* A Feistel round ``(L, R) -> (R, L xor F(R))`` is invertible for *any* round function ``F``
  (``(L, R) = (R' xor F(L'), L')``), so the network is a permutation of the ``2^(2h)`` values.
* Cycle-walking: ``y = E(x)``, and while ``y >= n``, ``y = E(y)``. The walk from ``x < n`` follows
  ``x``'s cycle of ``E`` (finite, and containing ``x`` itself, so a value below ``n`` is always
  reached) to the next value below ``n`` on it. On every cycle that is a rotation of the values
  below ``n``, hence a bijection of ``[0, n)``. With ``2^(2h) < 4n`` at least a quarter of the
  domain lies below ``n``: a walk takes at most 4 steps on average.
* ``F`` is the splitmix64 finaliser of ``R`` xor a round key; the keys are derived from
  ``(seed, epoch, salt, round)`` with ``syncpoint.workers.training.rng.derive_seed`` (blake2b), so the order depends
  on nothing but those integers: not on NumPy's or torch's RNG algorithms, versions or threads.
  Six rounds: statistically a random-looking order (four already make a pseudo-random
  permutation from a pseudo-random ``F``); each costs a handful of vectorised uint64 operations.

The tests check bijectivity exhaustively at small sizes and by inversion at large ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from syncpoint.workers.training.rng import derive_seed

ROUNDS = 6
# Up to this many positions the whole permutation is computed once and looked up (a shard order:
# ~4,096 domain values in one vectorised pass); beyond, each call walks its own positions.
TABLE_SIZE = 1 << 11
# Up to this many positions a call walks them on Python ints: for a micro-batch's few positions
# that is faster than NumPy's per-operation overhead (~70 operations per pass, several passes).
FEW_POSITIONS = 64
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (wrapping uint64 arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


_U64 = (1 << 64) - 1


class FeistelPermutation:
    """A bijection of ``[0, size)`` keyed by integers: ``perm(positions)`` gives the sample index at
    each position, ``perm.inverse(indices)`` the position of each index."""

    def __init__(self, size: int, *key: int) -> None:
        if size < 1:
            raise ValueError(f"a permutation needs at least one element, not {size}")
        self.size = int(size)
        self.half = max(1, ((self.size - 1).bit_length() + 1) // 2)  # 2^(2*half) >= size
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(derive_seed(*key, r)) for r in range(ROUNDS)]
        self._table: np.ndarray | None = None  # the whole permutation, for small sizes (TABLE_SIZE)
        self._table_list: list[int] | None = None
        self._int_keys = [int(k) for k in self.keys]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << h) | right

    def _decrypt(self, y: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = y >> h, y & self.mask
        for k in reversed(self.keys):
            left, right = right ^ (_mix(left ^ k) & self.mask), left
        return (left << h) | right

    def _walk(self, values: np.ndarray, step: object) -> np.ndarray:
        out = step(values)  # type: ignore[operator]
        n = np.uint64(self.size)
        outside = out >= n
        while outside.any():
            out[outside] = step(out[outside])  # type: ignore[operator]
            outside = out >= n
        return out

    def __call__(self, positions: np.ndarray | list[int] | range) -> np.ndarray:
        """The sample index at each position (``0 <= position < size``), as int64."""
        p = self._checked(positions)
        if self.size <= TABLE_SIZE:
            return self._whole()[p]
        if p.size <= FEW_POSITIONS:
            return np.array([self._walk_int(int(v)) for v in p], dtype=np.int64)
        return self._walk(p, self._encrypt).astype(np.int64)

    def table(self) -> np.ndarray:
        """The whole permutation, ``perm(range(size))`` (computed once for small sizes)."""
        if self.size <= TABLE_SIZE:
            return self._whole().copy()
        return self(np.arange(self.size))

    def at(self, positions: Sequence[int]) -> list[int]:
        """``perm(positions)`` for a few positions (a micro-batch), on Python ints: no NumPy call,
        whose per-operation overhead (large in a process's first calls: a resume) would dominate."""
        n = self.size
        for q in positions:
            if not 0 <= q < n:
                raise IndexError(f"positions must lie in [0, {n}), got {q}")
        if n <= TABLE_SIZE:
            if self._table_list is None:
                self._table_list = self._whole().tolist()
            table = self._table_list
            return [table[q] for q in positions]
        return [self._walk_int(q) for q in positions]

    def _encrypt_int(self, x: int) -> int:
        """``_encrypt`` of one Python int (the same value)."""
        h, mask = self.half, (1 << self.half) - 1
        left, right = x >> h, x & mask
        for k in self._int_keys:  # _mix on one Python int, inlined: a resume's first batch's main cost
            z = right ^ k
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
            left, right = right, left ^ ((z ^ (z >> 31)) & mask)
        return (left << h) | right

    def _walk_int(self, x: int) -> int:
        """One position's walk on Python ints: the same value as ``_walk`` with ``_encrypt``."""
        x = self._encrypt_int(x)
        while x >= self.size:
            x = self._encrypt_int(x)
        return x

    def _whole(self) -> np.ndarray:
        """The whole permutation of a small size (``TABLE_SIZE``), computed on first use."""
        if self._table is None:
            self._table = self._walked_table()
        return self._table

    def _walked_table(self) -> np.ndarray:
        """The permutation of every position: the network applied to the whole domain once, then
        each walk followed through that table (the same values as walking each position, without a
        full network pass per step of the longest walk)."""
        if self.size <= FEW_POSITIONS:
            return np.array([self._walk_int(q) for q in range(self.size)], dtype=np.int64)
        domain = 1 << (2 * self.half)
        step = self._encrypt(np.arange(domain, dtype=np.uint64)).astype(np.int64)
        out = step[: self.size].copy()
        outside = out >= self.size
        while outside.any():
            out[outside] = step[out[outside]]
            outside = out >= self.size
        return out

    def inverse(self, indices: np.ndarray | list[int] | range) -> np.ndarray:
        """The position of each sample index: ``perm.inverse(perm(p)) == p``."""
        i = self._checked(indices)
        return self._walk(i, self._decrypt).astype(np.int64)

    def _checked(self, values: np.ndarray | list[int] | range) -> np.ndarray:
        a = np.asarray(values, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= self.size):
            raise IndexError(f"positions must lie in [0, {self.size}), got [{a.min()}, {a.max()}]")
        return a.astype(np.uint64)
