"""Whole conversations packed into fixed-length rows by best-fit decreasing.

`best_fit_decreasing` groups items into bins of a capacity: longest first, each into the open bin with the
least room that still fits it, else into a new bin. An item is never split. Bins are kept in buckets by their
free space, and a Python int holds one bit per non-empty bucket, so the tightest bin that fits is one shift
and one lowest-set-bit of that int away: a few operations per item, in pure Python and numpy.

`pack_rows` lays each bin out as one row of `seq_len` tokens, in Hugging Face names: `input_ids` (`pad_id` on
padding), `labels` (pre-shifted: `labels[i]` is the target of position i; -100 on padding and wherever no
loss is taken), `position_ids` restarting at 0 for each conversation, `document_ids` 0..k-1 for the k
conversations of a row and -1 on padding, and `seq_lens`, the conversation lengths of each row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from maester.data.batch import IGNORE_INDEX

OVERLONG = ("truncate", "drop")


def fit_length(tokens: np.ndarray, labels: np.ndarray, seq_len: int,
               overlong: str) -> tuple[np.ndarray, np.ndarray] | None:
    """`(tokens, labels)` cut to at most `seq_len` tokens. Longer ones are, by `overlong`: "truncate", kept to
    their first `seq_len` tokens with the last kept label set to -100 (its target was cut off); "drop", None."""
    if overlong not in OVERLONG:
        raise ValueError(f"overlong must be truncate or drop, got {overlong!r}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    if len(tokens) != len(labels):
        raise ValueError(f"{len(tokens)} tokens but {len(labels)} labels")
    if len(tokens) <= seq_len:
        return tokens, labels
    if overlong == "drop":
        return None
    labels = labels[:seq_len].copy()
    labels[-1] = IGNORE_INDEX
    return tokens[:seq_len], labels


def best_fit_decreasing(lengths: np.ndarray, capacity: int, seed: int = 0) -> list[np.ndarray]:
    """Bins of indices into `lengths`, each holding items of total length at most `capacity`.

    Every index is in exactly one bin, in the order it was placed (longest first). `seed` orders items of equal
    length and shuffles the returned bins; the result is a pure function of (lengths, capacity, seed).
    """
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or (lengths.size and not np.issubdtype(lengths.dtype, np.integer)):
        raise ValueError(f"lengths must be a 1-D array of integers, got {lengths.dtype} of shape {lengths.shape}")
    if capacity < 1:
        raise ValueError(f"capacity must be at least 1, got {capacity}")
    if lengths.size == 0:
        return []
    bad = np.flatnonzero((lengths < 1) | (lengths > capacity))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"lengths[{i}] = {int(lengths[i])} is outside 1..{capacity} ({bad.size} such items)")
    rng = np.random.default_rng(seed)
    shuffled = rng.permutation(lengths.size)
    room = (capacity - lengths[shuffled]).astype(np.uint16 if capacity < 1 << 16 else np.int64)  # radix sort
    order = shuffled[np.argsort(room, kind="stable")]  # longest first, equal lengths in seeded order
    bin_of, n_bins = _place(lengths[order].tolist(), capacity)
    placed = np.asarray(bin_of, dtype=np.int64)
    items = order[np.argsort(placed, kind="stable")]  # grouped by bin, each bin in placing order
    ends = np.cumsum(np.bincount(placed, minlength=n_bins)).tolist()
    starts = [0] + ends[:-1]
    return [items[starts[b]:ends[b]] for b in rng.permutation(n_bins).tolist()]


def _place(lengths: list[int], capacity: int) -> tuple[list[int], int]:
    """The bin number of each item, placed in the given order into the fullest open bin that fits it, and the
    number of bins."""
    buckets: list[list[int]] = [[] for _ in range(capacity)]  # free space -> open bins with exactly that room
    nonempty = 0  # bit s set: buckets[s] holds a bin
    bin_of: list[int] = []
    add = bin_of.append
    n_bins = 0
    for length in lengths:
        fits = nonempty >> length
        if fits:
            space = length + (fits & -fits).bit_length() - 1
            bucket = buckets[space]
            b = bucket.pop()
            if not bucket:
                nonempty ^= 1 << space
        else:
            space, b = capacity, n_bins
            n_bins += 1
        add(b)
        left = space - length
        if left:
            bucket = buckets[left]
            if not bucket:
                nonempty |= 1 << left
            bucket.append(b)
    return bin_of, n_bins


@dataclass
class PackedRows:
    """Rows of `seq_len` tokens, each one bin of whole conversations followed by padding."""

    input_ids: np.ndarray  # (rows, seq_len) int64, pad_id on padding
    labels: np.ndarray  # (rows, seq_len) int64, pre-shifted, -100 on padding
    position_ids: np.ndarray  # (rows, seq_len) int64, 0.. per conversation, 0 on padding
    document_ids: np.ndarray  # (rows, seq_len) int64, 0..k-1 per conversation within the row, -1 on padding
    seq_lens: list[np.ndarray]  # per row, the conversation lengths in row order (no padding entry)


def pack_rows(examples: Sequence[tuple[np.ndarray, np.ndarray]], bins: Sequence[np.ndarray], seq_len: int,
              pad_id: int) -> PackedRows:
    """One row per bin: the (tokens, labels) of its examples end to end, in bin order, then padding."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be at least 1, got {seq_len}")
    positions = np.arange(seq_len, dtype=np.int64)
    pad = (np.full(seq_len, pad_id, dtype=np.int64), np.full(seq_len, IGNORE_INDEX, dtype=np.int64),
           np.zeros(seq_len, dtype=np.int64))
    tokens: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    position_ids: list[np.ndarray] = []
    document: list[int] = []  # per piece: its document id within the row, -1 for padding
    piece_lens: list[int] = []  # per piece: its length
    seq_lens: list[np.ndarray] = []
    for r, items in enumerate(bins):
        lens = []
        for i in np.asarray(items).tolist():
            t, lab = examples[i]
            if len(t) != len(lab):
                raise ValueError(f"example {i} has {len(t)} tokens but {len(lab)} labels")
            tokens.append(t)
            labels.append(lab)
            position_ids.append(positions[:len(t)])
            lens.append(len(t))
        used = sum(lens)
        if not lens or used > seq_len:
            raise ValueError(f"bin {r} holds {len(lens)} examples of {used} tokens; a bin needs 1..{seq_len} tokens")
        document.extend(range(len(lens)))
        piece_lens.extend(lens)
        if used < seq_len:
            for pieces, fill in zip((tokens, labels, position_ids), pad):
                pieces.append(fill[:seq_len - used])
            document.append(-1)
            piece_lens.append(seq_len - used)
        seq_lens.append(np.array(lens, dtype=np.int64))
    shape = (len(bins), seq_len)
    if not bins:
        empty = np.zeros(shape, dtype=np.int64)
        return PackedRows(empty, empty.copy(), empty.copy(), empty.copy(), [])
    return PackedRows(
        input_ids=np.concatenate(tokens, dtype=np.int64).reshape(shape),
        labels=np.concatenate(labels, dtype=np.int64).reshape(shape),
        position_ids=np.concatenate(position_ids).reshape(shape),
        document_ids=np.repeat(np.array(document, dtype=np.int64), piece_lens).reshape(shape),
        seq_lens=seq_lens,
    )


def packing_efficiency(total_tokens: int, rows: int, seq_len: int) -> float:
    """The share of the rows' slots that hold tokens (1.0: no padding); 0.0 for no rows."""
    return total_tokens / (rows * seq_len) if rows else 0.0
