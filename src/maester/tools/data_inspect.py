"""`maester data inspect`: the first documents of a dataset as text, then as a table of token ids and pieces.

Reads an indexed dataset (`.bin/.idx`), a token Parquet file (an `input_ids` column, as `tokenize --format
parquet` writes), or raw JSONL/Parquet/.txt text, which is tokenized first (raw input needs `--tokenizer`). Beside an
indexed `<prefix>_text_document`, its label dataset `<prefix>_label_document` (`tokenize --template`) is shown too:
each token's label, -100 where it is not trained.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import numpy as np

from maester.config import TokenizerConfig
from maester.data.records import RecordReader, input_format, parquet_columns, resolve_inputs
from maester.data.tokenizers import Tokenizer, build_tokenizer
from maester.tools.data_report import Progress, Summary
from maester.tools.data_tokenize import resolve_indexed_prefix

TOKEN_COLUMN = "input_ids"


def inspect(path: str, n: int = 5, tokenizer: TokenizerConfig | None = None, *, text_key: str = "text",
            max_tokens: int = 64, out: TextIO | None = None, split_on_blank_lines: bool = False) -> Summary:
    """Print the first `n` documents of `path` to `out` (stdout); `max_tokens` rows of each table (0: all)."""
    if n < 0:
        raise ValueError(f"-n must be 0 or more, got {n}")
    out = out or sys.stdout
    tok = build_tokenizer(tokenizer) if tokenizer is not None else None
    header, documents = _open(path, tok, text_key, split_on_blank_lines)
    print(header, file=out)
    summary = Summary("inspect", tokens=0)
    with Progress("inspect", summary) as progress:
        for i, (where, ids, text, labels) in enumerate(itertools.islice(documents, n)):
            trained = "" if labels is None else f", {trained_in(labels)} trained"
            print(f"\n--- document {i} ({where}): {len(ids)} tokens{trained} ---", file=out)
            if text is None and tok is not None:
                text = tok.decode(ids.tolist())
            print(text if text is not None else "(pass --tokenizer to decode the ids)", file=out)
            _print_table(ids, tok, max_tokens, out, labels)
            progress.update(1, len(ids))
    return summary


def _open(path: str, tok: Tokenizer | None, text_key: str, split_on_blank_lines: bool
          ) -> tuple[str, Iterator[tuple[str, np.ndarray, str | None, np.ndarray | None]]]:
    """A header line and (where, ids, original text or None, labels or None) for each document."""
    try:
        prefix = resolve_indexed_prefix(path)
    except FileNotFoundError:
        prefix = None
    if prefix is not None:
        from maester.data.indexed import IndexedDataset

        ds = IndexedDataset(prefix)
        header = (f"{prefix}: indexed dataset, {ds.num_documents} documents, {len(ds)} sequences, "
                  f"{ds.num_tokens} tokens, dtype {ds.dtype}")
        labels = _label_dataset(prefix)
        if labels is not None:
            header += f"; labels from {labels.prefix} (-100: not trained)"
            refusal = _refusal(prefix, labels.prefix, tok)
            if refusal:
                header += f"\nTRAINING REFUSES THIS DATASET: {refusal}"
        return header, _indexed_documents(ds, labels)
    file = Path(path)
    if file.is_file() and input_format(file) == "parquet" and TOKEN_COLUMN in parquet_columns(file):
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(file).metadata.num_rows
        return f"{file}: token Parquet, {rows} documents", _token_parquet_documents(file)
    if tok is None:
        resolve_inputs([path])  # a missing path is reported as missing
        raise ValueError(f"{path}: raw text (not an indexed dataset or a Parquet file with an {TOKEN_COLUMN!r} "
                         f"column): pass --tokenizer to tokenize it")
    reader = RecordReader([path], text_key=text_key, split_on_blank_lines=split_on_blank_lines)
    return f"{path}: raw text in {len(reader.files)} file(s), tokenized here", _raw_documents(reader, tok)


def _label_dataset(prefix: str):
    """The label dataset beside `<prefix>_text_document`, checked against it, or None when there is none."""
    from maester.data.sft_indexed import LABEL_DOCUMENT, TEXT_DOCUMENT, open_pair

    if not prefix.endswith(TEXT_DOCUMENT):
        return None
    labels = prefix[:-len(TEXT_DOCUMENT)] + LABEL_DOCUMENT
    return open_pair(prefix, labels)[1] if Path(f"{labels}.idx").is_file() else None


def _refusal(text_prefix: str, label_prefix: str, tok: Tokenizer | None) -> str | None:
    """Why `data.mode = "sft"` training refuses this pair (`sft_indexed.check_pair`: labels, token ids against the
    tokenizer's vocabulary when one is given, sequences that train nothing), or None."""
    from maester.data.sft_indexed import check_pair

    try:
        check_pair(text_prefix, label_prefix, None if tok is None else tok.vocab_size)
    except ValueError as e:
        return str(e)
    return None


def trained_in(labels: np.ndarray) -> int:
    """Tokens a sequence's aligned labels train: those not -100, less the first, which nothing predicts."""
    return int((labels[1:] != -100).sum())


def _indexed_documents(ds, labels) -> Iterator[tuple[str, np.ndarray, None, np.ndarray | None]]:
    for d in range(ds.num_documents):
        first, end = int(ds.doc_idx[d]), int(ds.doc_idx[d + 1])
        parts = [np.asarray(ds[s]) for s in range(first, end)]
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=ds.dtype)
        label_ids = None
        if labels is not None:
            label_ids = np.concatenate([np.asarray(labels[s]) for s in range(first, end)] or [np.zeros(0, np.int64)])
        where = f"sequences {first}..{end - 1}" if end - first != 1 else f"sequence {first}"
        yield where, ids, None, label_ids


def _token_parquet_documents(path: Path) -> Iterator[tuple[str, np.ndarray, None, None]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=[TOKEN_COLUMN], batch_size=64):
        for ids in batch.column(0).to_pylist():
            yield f"row {row}", np.asarray(ids if ids is not None else [], dtype=np.int64), None, None
            row += 1


def _raw_documents(reader: RecordReader, tok: Tokenizer) -> Iterator[tuple[str, np.ndarray, str, None]]:
    for doc in reader.documents():
        yield doc.where, np.asarray(tok.encode(doc.text), dtype=np.int64), doc.text, None


def _print_table(ids: np.ndarray, tok: Tokenizer | None, max_tokens: int, out: TextIO,
                 labels: np.ndarray | None = None) -> None:
    """One row per token: its id, its label (with a label dataset), its piece (with a tokenizer)."""
    shown = ids if max_tokens <= 0 else ids[:max_tokens]
    width = max(len("id"), *(len(str(i)) for i in shown.tolist())) if len(shown) else 2
    label_width = max(width, len("label"))
    columns = [f"{'id':>{width}}"] + ([f"{'label':>{label_width}}"] if labels is not None else [])
    print("  ".join(columns + (["token"] if tok is not None else [])), file=out)
    for k, tid in enumerate(shown.tolist()):
        row = [f"{tid:>{width}}"] + ([f"{int(labels[k]):>{label_width}}"] if labels is not None else [])
        if tok is not None:
            row.append(json.dumps(_piece(tok, tid), ensure_ascii=False))
        print("  ".join(row), file=out)
    if len(shown) < len(ids):
        print(f"... {len(ids) - len(shown)} more tokens (--max-tokens 0 shows all)", file=out)


def _piece(tok: Tokenizer, tid: int) -> str:
    try:
        return tok.decode([tid])
    except (ValueError, IndexError, KeyError, OverflowError) as e:  # an id outside this tokenizer's vocabulary
        return f"<not in the vocabulary: {e}>"
