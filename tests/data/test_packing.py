"""Best-fit-decreasing packing: no item lost or split, bins never overflow, seeded order, efficiency; row layout."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from maester.data.packing import (IGNORE_INDEX, best_fit_decreasing, fit_length, pack_rows,
                                  packing_efficiency)
from tests.helpers import REPO, clean_env


def reference_bfd_loads(lengths: list[int], capacity: int) -> list[int]:
    """Best-fit decreasing the slow, obvious way: the sorted loads of its bins."""
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        fitting = [b for b, load in enumerate(loads) if load + n <= capacity]
        if fitting:
            b = max(fitting, key=lambda b: loads[b])
            loads[b] += n
        else:
            loads.append(n)
    return sorted(loads)


def check_bins(bins: list[np.ndarray], lengths: np.ndarray, capacity: int) -> None:
    placed = np.concatenate(bins) if bins else np.zeros(0, np.int64)
    assert sorted(placed.tolist()) == list(range(len(lengths)))  # every item exactly once, none split
    for b in bins:
        assert 1 <= len(b) and int(lengths[b].sum()) <= capacity
        assert lengths[b].tolist() == sorted(lengths[b].tolist(), reverse=True)  # placed longest first


def lognormal_lengths(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    # Chat SFT sets are right-skewed: most conversations are a few hundred tokens, a long tail runs to
    # thousands (multi-turn, code, long documents), which a lognormal with sigma ~1 reproduces. Median 300
    # gives a mean of about 490 tokens; 0.5% are longer than 4096 and are clipped, as truncation would do.
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(300), 1.0, n)), 1, capacity).astype(np.int64)


@pytest.mark.parametrize("case", range(60))
def test_bfd_places_every_item_once_without_overflow_and_matches_the_reference(case):
    rng = np.random.default_rng(case)
    capacity = int(rng.choice([1, 2, 7, 16, 100, 4096]))
    n = int(rng.integers(1, 300))
    shape = case % 3
    if shape == 0:
        lengths = rng.integers(1, capacity + 1, n)
    elif shape == 1:  # many small items and a few near capacity
        lengths = np.where(rng.random(n) < 0.2, capacity, rng.integers(1, max(2, capacity // 8) + 1, n))
        lengths = np.minimum(lengths, capacity)
    else:
        lengths = np.full(n, int(rng.integers(1, capacity + 1)))  # all equal
    bins = best_fit_decreasing(lengths, capacity, seed=case)
    check_bins(bins, lengths, capacity)
    assert sorted(int(lengths[b].sum()) for b in bins) == reference_bfd_loads(lengths.tolist(), capacity)


@pytest.mark.parametrize("lengths, capacity, rows", [
    ([5], 5, 1),  # one item, exactly full
    ([1], 4096, 1),
    ([8, 8, 8], 8, 3),  # every item is the capacity
    ([3] * 10, 10, 4),  # all equal: three per bin, one left over
    ([6, 5, 4, 3, 2], 10, 2),  # 6+4, 5+3+2
])
def test_bfd_edge_cases(lengths, capacity, rows):
    lengths = np.array(lengths)
    bins = best_fit_decreasing(lengths, capacity)
    check_bins(bins, lengths, capacity)
    assert len(bins) == rows


def test_bfd_takes_the_fullest_bin_that_fits_not_the_first():
    lengths = np.array([1, 4, 7, 4])
    bins = sorted(sorted(b.tolist()) for b in best_fit_decreasing(lengths, 10))
    assert bins == [[0, 1, 3], [2]]  # 4+4+1 = 9 and 7; first fit would put the 1 with the 7


def test_bfd_of_nothing_is_no_bins():
    assert best_fit_decreasing(np.zeros(0, dtype=np.int64), 8) == []


@pytest.mark.parametrize("lengths, capacity, message", [
    ([3, 9], 8, r"lengths\[1\] = 9 is outside 1..8"),
    ([0, 1], 8, r"lengths\[0\] = 0 is outside 1..8"),
    ([1.5], 8, "integers"),
    ([1], 0, "capacity must be at least 1"),
])
def test_bfd_refuses_lengths_it_cannot_pack(lengths, capacity, message):
    with pytest.raises(ValueError, match=message):
        best_fit_decreasing(np.array(lengths), capacity)


def test_bfd_is_deterministic_for_a_seed_and_another_seed_reorders():
    lengths = lognormal_lengths(5000, 2048, seed=1)
    a = best_fit_decreasing(lengths, 2048, seed=3)
    b = best_fit_decreasing(lengths, 2048, seed=3)
    c = best_fit_decreasing(lengths, 2048, seed=4)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    assert [x.tolist() for x in a[:20]] != [x.tolist() for x in c[:20]]  # the rows come in another order
    # equal lengths are interchangeable: another seed gives the same bin loads, in another order
    loads = [int(lengths[x].sum()) for x in a]
    other = [int(lengths[x].sum()) for x in c]
    assert sorted(loads) == sorted(other) and loads != other


def test_bfd_efficiency_on_100k_lognormal_conversations():
    capacity = 4096
    lengths = lognormal_lengths(100_000, capacity)
    start = time.perf_counter()
    bins = best_fit_decreasing(lengths, capacity, seed=0)
    seconds = time.perf_counter() - start
    check_bins(bins, lengths, capacity)
    total = int(lengths.sum())
    efficiency = packing_efficiency(total, len(bins), capacity)
    print(f"100k lognormal conversations: {len(bins)} rows, efficiency {efficiency:.4%}, {seconds:.2f}s")
    assert len(bins) >= -(-total // capacity)  # no packing beats the volume bound
    assert efficiency >= 0.99
    assert seconds < 10  # about 0.2 s on one core; loose, for loaded test machines


def test_the_benchmark_prints_bfd_well_above_next_fit():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "packing.py"), "--smoke"], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[2].strip() for r in rows[1:]] == ["best-fit decreasing", "next-fit (baseline)"]
    bfd, next_fit = (float(r[5].strip().rstrip("%")) for r in rows[1:])
    assert bfd >= 99.0 and next_fit < 95.0
    assert int(rows[1][3].replace(",", "")) >= int(rows[1][4].replace(",", ""))  # never below the volume bound


def test_packing_efficiency():
    assert packing_efficiency(3000, 1, 4096) == pytest.approx(3000 / 4096)
    assert packing_efficiency(8192, 2, 4096) == 1.0
    assert packing_efficiency(0, 0, 4096) == 0.0


# ---------------------------------------------------------------- rows


def example(tokens: list[int], labels: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.array(tokens, dtype=np.int64), np.array(labels, dtype=np.int64)


def test_pack_rows_lays_out_each_bin_then_padding():
    examples = [
        example([10, 11, 12], [11, 12, -100]),
        example([20, 21], [-100, -100]),
        example([30, 31, 32, 33], [-100, 32, 33, -100]),
    ]
    rows = pack_rows(examples, [np.array([2, 1]), np.array([0])], seq_len=8, pad_id=99)
    assert rows.input_ids.tolist() == [[30, 31, 32, 33, 20, 21, 99, 99], [10, 11, 12, 99, 99, 99, 99, 99]]
    assert rows.labels.tolist() == [[-100, 32, 33, -100, -100, -100, -100, -100],
                                    [11, 12, -100, -100, -100, -100, -100, -100]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 0], [0, 1, 2, 0, 0, 0, 0, 0]]
    assert rows.document_ids.tolist() == [[0, 0, 0, 0, 1, 1, -1, -1], [0, 0, 0, -1, -1, -1, -1, -1]]
    assert [s.tolist() for s in rows.seq_lens] == [[4, 2], [3]]
    for field in (rows.input_ids, rows.labels, rows.position_ids, rows.document_ids):
        assert field.dtype == np.int64 and field.shape == (2, 8)


def test_pack_rows_full_row_has_no_padding():
    rows = pack_rows([example([1, 2], [2, -100]), example([3, 4], [4, -100])], [np.array([0, 1])], 4, pad_id=0)
    assert rows.input_ids.tolist() == [[1, 2, 3, 4]]
    assert rows.document_ids.tolist() == [[0, 0, 1, 1]]
    assert rows.position_ids.tolist() == [[0, 1, 0, 1]]


def test_pack_rows_of_bfd_bins_keeps_every_conversation_whole():
    rng = np.random.default_rng(0)
    seq_len = 64
    lengths = rng.integers(1, seq_len + 1, 500)
    examples = [(rng.integers(0, 1000, n), np.where(rng.random(n) < 0.5, -100, rng.integers(0, 1000, n)))
                for n in lengths]
    bins = best_fit_decreasing(lengths, seq_len, seed=1)
    rows = pack_rows(examples, bins, seq_len, pad_id=-1)
    padding = rows.document_ids == -1
    assert (rows.input_ids[padding] == -1).all() and (rows.labels[padding] == IGNORE_INDEX).all()
    assert (rows.position_ids[padding] == 0).all()
    assert int((~padding).sum()) == int(lengths.sum())
    for r, items in enumerate(bins):
        assert rows.seq_lens[r].tolist() == lengths[items].tolist()
        assert int(rows.seq_lens[r].sum()) == int((~padding[r]).sum())
        for d, i in enumerate(items):
            at = rows.document_ids[r] == d
            assert rows.input_ids[r, at].tolist() == examples[i][0].tolist()
            assert rows.labels[r, at].tolist() == examples[i][1].tolist()
            assert rows.position_ids[r, at].tolist() == list(range(lengths[i]))
        assert np.all(np.diff(rows.document_ids[r][~padding[r]]) >= 0)  # documents contiguous, in order


def test_pack_rows_refuses_overfull_or_empty_bins_and_mismatched_labels():
    examples = [example([1, 2, 3], [2, 3, -100]), example([4, 5], [5, -100])]
    with pytest.raises(ValueError, match="bin 0 holds 2 examples of 5 tokens"):
        pack_rows(examples, [np.array([0, 1])], 4, pad_id=0)
    with pytest.raises(ValueError, match="bin 1 holds 0 examples"):
        pack_rows(examples, [np.array([0]), np.array([], dtype=np.int64)], 4, pad_id=0)
    with pytest.raises(ValueError, match="example 0 has 3 tokens but 2 labels"):
        pack_rows([example([1, 2, 3], [2, 3])], [np.array([0])], 4, pad_id=0)


def test_pack_rows_of_no_bins():
    rows = pack_rows([], [], 16, pad_id=0)
    assert rows.input_ids.shape == (0, 16) and rows.seq_lens == []


# ---------------------------------------------------------------- fit_length


def test_fit_length_keeps_what_fits_untouched():
    tokens, labels = example([1, 2, 3, 4], [2, 3, 4, 9])
    fitted = fit_length(tokens, labels, 4, "truncate")
    assert fitted is not None
    assert fitted[0].tolist() == [1, 2, 3, 4] and fitted[1].tolist() == [2, 3, 4, 9]
    assert fit_length(tokens, labels, 4, "drop") is not None


def test_fit_length_truncates_and_masks_the_last_kept_label():
    tokens, labels = example([1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, -100])
    fitted = fit_length(tokens, labels, 4, "truncate")
    assert fitted is not None
    assert fitted[0].tolist() == [1, 2, 3, 4]
    assert fitted[1].tolist() == [2, 3, 4, -100]  # the target of position 3 (token 5) is not in the row
    assert labels.tolist() == [2, 3, 4, 5, 6, -100]  # the caller's labels are not changed


def test_fit_length_drops_what_is_too_long():
    tokens, labels = example([1, 2, 3, 4, 5], [2, 3, 4, 5, -100])
    assert fit_length(tokens, labels, 4, "drop") is None


def test_fit_length_refuses_bad_arguments():
    tokens, labels = example([1, 2], [2, -100])
    with pytest.raises(ValueError, match="overlong must be truncate or drop, got 'cut'"):
        fit_length(tokens, labels, 4, "cut")
    with pytest.raises(ValueError, match="2 tokens but 1 labels"):
        fit_length(tokens, labels[:1], 4, "truncate")
