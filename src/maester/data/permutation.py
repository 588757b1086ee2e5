"""A seeded permutation of range(n) evaluated at any index, without materialising it.

A 4-round Feistel network is a bijection on [0, 2**bits); walking the cycle until the value falls below n
restricts it to a bijection on [0, n). Memory is O(1) whatever n is, so a corpus of billions of windows can be
shuffled per epoch without an index file.
"""

from __future__ import annotations

import numpy as np


def mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser: a fast, well-spread hash of uint64 values."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def mix_key(*parts: int) -> int:
    """One 64-bit key from several integers, each folded in by `mix64` in turn."""
    key = np.uint64(0x9E3779B97F4A7C15)
    for part in parts:
        with np.errstate(over="ignore"):
            key = mix64(np.uint64(key) ^ np.uint64(int(part) & 0xFFFFFFFFFFFFFFFF)) + np.uint64(0x9E3779B97F4A7C15)
    return int(key)


# What the run's seed is drawn on: each purpose, the counts that tell its draws apart (all below 2**63), and the
# salt folded in after them. Two purposes never fold the same numbers, so never draw the same key: of two layouts
# of one length, the salts differ, or one has a salt of 2**63 or more where the other has a count. The one pair
# that can fold the same numbers, "source order" and "sft order", is drawn by different loaders, never in one run.
# The layouts without a salt and the small salts are those of the streams before their purposes had names; they
# stay, so that runs and their checkpoints go on reading the same data. A new purpose takes a salt of 2**63 or
# more (here: its name's SHA-256 with the top bit set), written out, so that renaming it changes no key.
PURPOSES: dict[str, tuple[tuple[str, ...], int | None]] = {
    "source order": (("source", "epoch"), None),  # a text source's chunks, a token source's windows
    "chunk rows": (("source", "position"), 1),  # the rows of a text source's chunk at a position of its sequence
    "sft choice": (("source", "epoch"), 7),  # the examples an SFT source gives an epoch, after its weight
    "sft packing": (("epoch",), None),  # the order of equal lengths and of the bins of an epoch's best fit
    "sft order": (("epoch",), 3),  # the order of an epoch's rows: its bins and pre-packed rows
    "sft validation packing": ((), 0xA904422432BD3EBE),  # "sft packing" of the held-out conversations
}


def seed_key(seed: int, purpose: str, *counts: int) -> int:
    """The key of one draw on `seed` for `purpose` (one of `PURPOSES`), told from its other draws by `counts`."""
    if purpose not in PURPOSES:
        raise ValueError(f"no seed purpose {purpose!r}: expected one of {', '.join(PURPOSES)}")
    names, salt = PURPOSES[purpose]
    if len(counts) != len(names) or not all(0 <= int(c) < 1 << 63 for c in counts):
        raise ValueError(f"seed purpose {purpose!r} takes {len(names)} count(s) ({', '.join(names)}) in "
                         f"[0, 2**63), got {counts}")
    return mix_key(seed, *counts, *(() if salt is None else (salt,)))


class Permutation:
    """`perm[i]` for a bijection of range(n) drawn from `key`; `perm[array]` is vectorised."""

    ROUNDS = 4

    def __init__(self, n: int, key: int):
        if n <= 0:
            raise ValueError(f"cannot permute {n} elements")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(mix_key(key, r)) for r in range(self.ROUNDS)]

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (mix64(right ^ k) & self.mask)
        return (left << h) | right

    def __getitem__(self, index):
        scalar = np.isscalar(index)
        i = np.atleast_1d(np.asarray(index, dtype=np.int64))
        if len(i) and (i.min() < 0 or i.max() >= self.n):
            raise IndexError(f"index out of range for a permutation of {self.n}")
        x = i.astype(np.uint64)
        todo = np.arange(len(x))
        while len(todo):  # cycle-walking: the expected number of rounds is below 4
            x[todo] = self._feistel(x[todo])
            todo = todo[x[todo] >= np.uint64(self.n)]
        out = x.astype(np.int64)
        return int(out[0]) if scalar else out

    def __len__(self) -> int:
        return self.n
