"""Keys drawn on the run's seed: one per purpose, never shared by two purposes, and unchanged for the streams
runs were made with."""

from __future__ import annotations

import itertools

import pytest

from maester.data.permutation import PURPOSES, Permutation, seed_key

# Loaders that never run together may fold the same numbers; this list may only shrink.
SAME_NUMBERS_IN_DIFFERENT_LOADERS = {frozenset({"source order", "sft order"})}


def test_two_purposes_with_the_same_number_draw_different_keys():
    """The packing of epoch 11 was the packing of the validation set once."""
    assert seed_key(0, "sft packing", 11) != seed_key(0, "sft validation packing")
    keys = {purpose: seed_key(0, purpose, *[11] * len(counts)) for purpose, (counts, _) in PURPOSES.items()}
    assert len(set(keys.values())) == len(keys), keys


def _may_fold_the_same_numbers(a: str, b: str) -> bool:
    """Whether some counts make purposes a and b fold the same numbers after the seed (counts are below 2**63)."""
    layouts = []
    for purpose in (a, b):
        counts, salt = PURPOSES[purpose]
        layouts.append([None] * len(counts) + ([] if salt is None else [salt]))  # None: any count
    if len(layouts[0]) != len(layouts[1]):
        return False
    for x, y in zip(*layouts):
        if x is not None and y is not None and x != y:
            return False
        if (x is None and y is not None and y >= 1 << 63) or (y is None and x is not None and x >= 1 << 63):
            return False
    return True


def test_no_two_purposes_can_fold_the_same_numbers():
    pairs = {frozenset(pair) for pair in itertools.combinations(PURPOSES, 2) if _may_fold_the_same_numbers(*pair)}
    assert pairs == SAME_NUMBERS_IN_DIFFERENT_LOADERS


def test_the_keys_of_existing_streams_stay():
    """The keys the loaders drew before their purposes had names: a change here reorders every run's data."""
    assert seed_key(0, "source order", 0, 0) == 13959451808893450918
    assert seed_key(0, "chunk rows", 0, 0) == 559982798640158568
    assert seed_key(0, "sft choice", 0, 0) == 1341878689877815316
    assert seed_key(0, "sft packing", 0) == 4989520995034593924
    assert seed_key(0, "sft order", 0) == 8000827040330650425
    assert Permutation(10, seed_key(3, "source order", 1, 2))[range(10)].tolist() == \
        [4, 0, 2, 9, 7, 1, 6, 5, 3, 8]


@pytest.mark.parametrize("purpose, counts, match", [
    ("epoch", (1,), "no seed purpose 'epoch'"),
    ("sft packing", (), r"takes 1 count\(s\) \(epoch\)"),
    ("source order", (0, -1), r"in \[0, 2\*\*63\)"),
    ("sft order", (1 << 63,), r"in \[0, 2\*\*63\)"),
])
def test_a_draw_outside_the_purposes_is_an_error(purpose, counts, match):
    with pytest.raises(ValueError, match=match):
        seed_key(0, purpose, *counts)
