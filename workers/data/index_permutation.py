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
  ``(seed, epoch, salt, round)`` with ``syncpoint.workers.rng.derive_seed`` (blake2b), so the order depends
  on nothing but those integers: not on NumPy's or torch's RNG algorithms, versions or threads.
  Six rounds: statistically a random-looking order (four already make a pseudo-random
  permutation from a pseudo-random ``F``); each costs a handful of vectorised uint64 operations.

The tests check bijectivity exhaustively at small sizes and by inversion at large ones.
"""

from __future__ import annotations

import numpy as np

from syncpoint.workers.rng import derive_seed

ROUNDS = 6
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (wrapping uint64 arithmetic)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


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
        return self._walk(p, self._encrypt).astype(np.int64)

    def inverse(self, indices: np.ndarray | list[int] | range) -> np.ndarray:
        """The position of each sample index: ``perm.inverse(perm(p)) == p``."""
        i = self._checked(indices)
        return self._walk(i, self._decrypt).astype(np.int64)

    def _checked(self, values: np.ndarray | list[int] | range) -> np.ndarray:
        a = np.asarray(values, dtype=np.int64)
        if a.size and (a.min() < 0 or a.max() >= self.size):
            raise IndexError(f"positions must lie in [0, {self.size}), got [{a.min()}, {a.max()}]")
        return a.astype(np.uint64)
