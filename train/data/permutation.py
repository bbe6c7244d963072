"""A seeded permutation of [0, n) evaluated one index at a time: the shuffle of a corpus' windows.

`torch.randperm(n)` holds n int64 (and DistributedSampler turns them into a Python list: ~36 bytes per
window), so a shuffled epoch of a 10B-token corpus would cost gigabytes on every rank. A Feistel network
is a bijection on [0, 2^bits) computed from the index alone; walking the cycle until the value falls in
[0, n) ("cycle walking") restricts it to a bijection on [0, n). Memory is O(1) in n, and any stretch of
the permutation (a data-parallel rank's, the rest of an epoch after a resume) is computed directly.
"""

from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 6
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every output bit depends on every input bit (uint64 arrays wrap silently)."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """The bijection of [0, n) fixed by `key` (any ints, e.g. (seed, epoch, source)).

    `perm[i]` for an int, `perm.take(indices)` for a numpy array of indices in [0, n).
    """

    def __init__(self, n: int, *key: int):
        if n < 1:
            raise ValueError(f"A permutation needs n >= 1 elements (got {n}).")
        self.n = int(n)
        bits = max(2, (self.n - 1).bit_length())
        bits += bits % 2  # two equal halves
        self._half = bits // 2
        self._mask = np.uint64((1 << self._half) - 1)
        digest = hashlib.sha256(repr((self.n, *map(int, key))).encode()).digest()
        self._keys = [np.uint64(int.from_bytes(digest[4 * r : 4 * r + 8], "little")) for r in range(_ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self._half)
        left, right = x >> half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << half) | right

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The permuted values of `indices` (int64 array, each in [0, n))."""
        x = np.asarray(indices, dtype=np.uint64)
        out = self._encrypt(x)
        # Cycle walking: the domain is < 4n, so few values need more than a couple of steps.
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for a permutation of {self.n}")
        return int(self.take(np.array([index]))[0])

    def __len__(self) -> int:
        return self.n
