"""SFT conversations as two aligned Megatron / GPT-NeoX indexed datasets, one sequence per conversation:
`<prefix>_text_document` (the token ids) and `<prefix>_label_document` (the labels), both int32, as GPT-NeoX's
`preprocess_data_with_mask.py` writes them and its `train_label_data_paths` reads them.

GPT-NeoX's labels are aligned with the tokens: label j is token j where it is a loss target, else -100; the model
input is `tokens[:-1]` and its target `labels[1:]`. Inside maester labels are pre-shifted (`labels[i]` is the target
of position i, see `packing`), so `aligned_labels` and `read_conversations` convert between the two. The first label
of a sequence predicts nothing: it is written -100 and ignored when read.
"""

from __future__ import annotations

import os

import numpy as np

from maester.data.batch import IGNORE_INDEX
from maester.data.indexed import IndexedDataset, IndexedDatasetWriter

TEXT_DOCUMENT = "_text_document"
LABEL_DOCUMENT = "_label_document"
DTYPE = np.dtype(np.int32)  # both files, as GPT-NeoX's SFT tools write them: labels hold -100


def label_prefix_of(text_prefix: str | os.PathLike) -> str:
    """`<prefix>_label_document` for `<prefix>_text_document`; ValueError for a prefix not named so."""
    text = os.fspath(text_prefix)
    if not text.endswith(TEXT_DOCUMENT):
        raise ValueError(f"{text}: the labels of an indexed SFT dataset are found beside a prefix ending in "
                         f"{TEXT_DOCUMENT!r}; name the label dataset with the source's label_path")
    return text[:-len(TEXT_DOCUMENT)] + LABEL_DOCUMENT


def aligned_labels(shifted: np.ndarray) -> np.ndarray:
    """GPT-NeoX's labels of one conversation from its pre-shifted ones: -100 at the first token, then each
    pre-shifted label one place later."""
    out = np.empty(len(shifted), dtype=DTYPE)
    if len(out):
        out[0] = IGNORE_INDEX
        out[1:] = shifted[:-1]
    return out


class ConversationWriter:
    """Writes `<output_prefix>_text_document.bin/.idx` and `<output_prefix>_label_document.bin/.idx`. Use as a
    context manager: an exception discards both, a clean exit finalizes both."""

    def __init__(self, output_prefix: str | os.PathLike):
        prefix = os.fspath(output_prefix)
        self.text_prefix, self.label_prefix = prefix + TEXT_DOCUMENT, prefix + LABEL_DOCUMENT
        self._tokens = IndexedDatasetWriter(self.text_prefix, DTYPE)
        self._labels = IndexedDatasetWriter(self.label_prefix, DTYPE)

    def __enter__(self) -> "ConversationWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._tokens.abort()
            self._labels.abort()
            return
        try:
            self._tokens.finalize()
        except BaseException:
            self._labels.abort()
            raise
        self._labels.finalize()

    def add(self, tokens: np.ndarray, shifted: np.ndarray) -> None:
        """One conversation: its tokens and pre-shifted labels."""
        self._tokens.add_document(tokens)
        self._labels.add_document(aligned_labels(shifted))


def open_pair(text_prefix: str, label_prefix: str) -> tuple[IndexedDataset, IndexedDataset]:
    """The token and label datasets, checked to hold sequences of the same sizes."""
    tokens, labels = IndexedDataset(text_prefix), IndexedDataset(label_prefix)
    if len(tokens) != len(labels):
        raise ValueError(f"{label_prefix}: {len(labels)} label sequences, but {text_prefix} holds {len(tokens)} "
                         f"token sequences")
    differ = np.flatnonzero(np.asarray(tokens.sizes) != np.asarray(labels.sizes))
    if differ.size:
        i = int(differ[0])
        raise ValueError(f"{label_prefix}: sequence {i} has {int(labels.sizes[i])} labels, but {text_prefix} "
                         f"sequence {i} has {int(tokens.sizes[i])} tokens")
    return tokens, labels


def check_pair(text_prefix: str, label_prefix: str, vocab_size: int | None = None, skip_invalid: bool = False
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The tokens and GPT-NeoX labels of a pair (int64, all sequences one after another), each sequence's end and
    whether it trains anything, checked as training checks them: a label other than -100 must equal its token, every
    token id lie in the vocabulary (when `vocab_size` is given), no sequence be empty, and every sequence train at
    least one token, as a conversation in a JSONL source must (unless `skip_invalid`: such sequences are then marked
    in the fourth array, False). Each error names the dataset, the sequence and the position."""
    from maester.data.chat.format import NOTHING_TO_TRAIN

    tokens_ds, labels_ds = open_pair(text_prefix, label_prefix)
    sizes = np.asarray(tokens_ds.sizes, dtype=np.int64)
    empty = np.zeros(0, dtype=np.int64)
    if not len(sizes):
        return empty, empty, empty, np.zeros(0, dtype=bool)
    if (sizes == 0).any():
        raise ValueError(f"{text_prefix}: sequence {int(np.flatnonzero(sizes == 0)[0])} is empty")
    tokens = np.asarray(tokens_ds.tokens(), dtype=np.int64)
    labels = np.asarray(labels_ds.tokens(), dtype=np.int64)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    starts_mask = np.zeros(len(tokens), dtype=bool)
    starts_mask[starts] = True
    trained = (labels != IGNORE_INDEX) & ~starts_mask  # a sequence's first label predicts nothing
    checks = [(trained & (labels != tokens), label_prefix, "label", labels,
               "differs from its token, and is not -100")]
    if vocab_size is not None:
        checks.append(((tokens < 0) | (tokens >= vocab_size), text_prefix, "token", tokens,
                       f"is outside the tokenizer's vocabulary of {vocab_size} ids"))
    for bad, prefix, what, values, why in checks:
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            seq = int(np.searchsorted(ends, k, side="right"))
            raise ValueError(f"{prefix}: sequence {seq}, {what} {k - int(starts[seq])} = {int(values[k])} {why}")
    trains = np.add.reduceat(trained, starts) > 0
    if not trains.all() and not skip_invalid:
        seq = int(np.flatnonzero(~trains)[0])
        raise ValueError(f"{label_prefix}: sequence {seq}: {NOTHING_TO_TRAIN} (every label is -100), as in "
                         f"{int((~trains).sum())} of {len(sizes)} sequences; data.skip_invalid = true skips them")
    return tokens, labels, ends, trains


def read_conversations(text_prefix: str, label_prefix: str, vocab_size: int, skip_invalid: bool = False) -> list:
    """(tokens, pre-shifted labels) as int32 for each sequence, checked (`check_pair`); with `skip_invalid`, a
    sequence that trains nothing comes as its InvalidRecord instead (counted as skipped)."""
    from maester.data.chat.format import NOTHING_TO_TRAIN
    from maester.data.records import InvalidRecord

    tokens, labels, ends, trains = check_pair(text_prefix, label_prefix, vocab_size, skip_invalid)
    if not len(ends):
        return []
    starts = ends - np.diff(ends, prepend=0)
    trained = labels != IGNORE_INDEX
    trained[starts] = False
    shifted = np.full(len(tokens), IGNORE_INDEX, dtype=np.int64)
    shifted[:-1] = np.where(trained[1:], tokens[1:], IGNORE_INDEX)
    shifted[ends - 1] = IGNORE_INDEX  # nothing is predicted across two conversations
    cuts = ends[:-1]
    pairs = zip(np.split(tokens.astype(DTYPE), cuts), np.split(shifted.astype(DTYPE), cuts))
    return [pair if ok else InvalidRecord(f"{label_prefix}: sequence {i}: every label is -100", NOTHING_TO_TRAIN)
            for i, (pair, ok) in enumerate(zip(pairs, trains))]


def trained_tokens(labels: IndexedDataset) -> int:
    """How many tokens a label dataset trains: labels other than -100, less each sequence's first."""
    return int(trained_per_sequence(labels).sum())


def trained_per_sequence(labels: IndexedDataset) -> np.ndarray:
    """The tokens each sequence of a label dataset trains: its labels other than -100 but the first (int64)."""
    values = np.asarray(labels.tokens())
    sizes = np.asarray(labels.sizes, dtype=np.int64)
    starts = np.asarray(labels.pointers, dtype=np.int64) // labels.dtype.itemsize
    counted = (values != IGNORE_INDEX).astype(np.int64)
    counted[starts[sizes > 0]] = 0  # nothing predicts a sequence's first token
    running = np.concatenate([[0], np.cumsum(counted)])
    return running[starts + sizes] - running[starts]
