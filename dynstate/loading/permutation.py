"""A keyed pseudo-random permutation of ``[0, n)`` that maps any position to its row in O(1).

The sampler shuffles each epoch with it: position ``p`` of an epoch maps to its row without
materialising the order, so resuming at row 10M costs what resuming at row 0 costs, and every
rank of a data-parallel run computes its share of any step on its own.
"""

from __future__ import annotations

import numpy as np


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a fast, well-distributed 64-bit hash (wrapping uint64 math)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class FeistelPermutation:
    """A pseudo-random bijection of [0, n) keyed by (seed, epoch); O(1) state, vectorized."""

    ROUNDS = 4

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        bits = max(2, (max(n, 2) - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        base = np.array([seed & 0xFFFFFFFFFFFFFFFF, epoch & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64)
        k = _mix64(_mix64(base[:1]) ^ base[1:])[0]
        self.keys = [
            _mix64(np.array([k + np.uint64(r + 1)], dtype=np.uint64))[0] for r in range(self.ROUNDS)
        ]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix64(right ^ key) & self.mask)
        return (left << half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        out = self._encrypt(positions.astype(np.uint64))
        # Cycle-walk values outside [0, n) back into range: still a bijection on [0, n).
        bad = out >= np.uint64(self.n)
        while bad.any():
            out[bad] = self._encrypt(out[bad])
            bad = out >= np.uint64(self.n)
        return out.astype(np.int64)


class EpochOrder:
    """The rows at positions of an epoch's order — the permutation keyed by ``(seed, epoch)``,
    or the identity without shuffling — computed a block at a time and kept for the next
    positions, since a sampler asks for them in order."""

    def __init__(self, shuffle: bool, seed: int, block: int = 1024):
        self.shuffle, self.seed, self.block = shuffle, seed, block
        self._key: tuple[int, int] | None = None
        self._start = 0
        self._rows: list[int] = []

    def positions(self, epoch: int, n: int, start: int, stop: int) -> list[int]:
        """Rows at positions ``start .. stop`` of epoch ``epoch`` over ``n`` rows (uncached)."""
        positions = np.arange(start, stop, dtype=np.int64)
        if self.shuffle:
            positions = FeistelPermutation(n, self.seed, epoch)(positions)
        return positions.tolist()

    def rows(self, epoch: int, n: int, start: int, count: int) -> list[int]:
        """Rows at positions ``start .. start + count``, from the kept block when it holds them."""
        if count <= 0:
            return []
        offset = start - self._start
        if (epoch, n) != self._key or offset < 0 or offset + count > len(self._rows):
            stop = min(n, start + max(count, self.block))
            self._key, self._start = (epoch, n), start
            self._rows = self.positions(epoch, n, start, stop)
            offset = 0
        return self._rows[offset : offset + count]
