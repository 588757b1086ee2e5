"""`maester data inspect`: the first documents of a dataset as text, then as a table of token ids and pieces.

Reads an indexed dataset (`.bin/.idx`), a token Parquet file (an `input_ids` column, as `tokenize --format
parquet` writes), or raw JSONL/Parquet text, which is tokenized first (raw input needs `--tokenizer`).
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
            max_tokens: int = 64, out: TextIO | None = None) -> Summary:
    """Print the first `n` documents of `path` to `out` (stdout); `max_tokens` rows of each table (0: all)."""
    if n < 0:
        raise ValueError(f"-n must be 0 or more, got {n}")
    out = out or sys.stdout
    tok = build_tokenizer(tokenizer) if tokenizer is not None else None
    header, documents = _open(path, tok, text_key)
    print(header, file=out)
    summary = Summary("inspect", tokens=0)
    with Progress("inspect", summary) as progress:
        for i, (where, ids, text) in enumerate(itertools.islice(documents, n)):
            print(f"\n--- document {i} ({where}): {len(ids)} tokens ---", file=out)
            if text is None and tok is not None:
                text = tok.decode(ids.tolist())
            print(text if text is not None else "(pass --tokenizer to decode the ids)", file=out)
            _print_table(ids, tok, max_tokens, out)
            progress.update(1, len(ids))
    return summary


def _open(path: str, tok: Tokenizer | None, text_key: str
          ) -> tuple[str, Iterator[tuple[str, np.ndarray, str | None]]]:
    """A header line and (where, ids, original text or None) for each document."""
    try:
        prefix = resolve_indexed_prefix(path)
    except FileNotFoundError:
        prefix = None
    if prefix is not None:
        from maester.data.indexed import IndexedDataset

        ds = IndexedDataset(prefix)
        header = (f"{prefix}: indexed dataset, {ds.num_documents} documents, {len(ds)} sequences, "
                  f"{ds.num_tokens} tokens, dtype {ds.dtype}")
        return header, _indexed_documents(ds)
    file = Path(path)
    if file.is_file() and input_format(file) == "parquet" and TOKEN_COLUMN in parquet_columns(file):
        import pyarrow.parquet as pq

        rows = pq.ParquetFile(file).metadata.num_rows
        return f"{file}: token Parquet, {rows} documents", _token_parquet_documents(file)
    if tok is None:
        resolve_inputs([path])  # a missing path is reported as missing
        raise ValueError(f"{path}: raw text (not an indexed dataset or a Parquet file with an {TOKEN_COLUMN!r} "
                         f"column): pass --tokenizer to tokenize it")
    reader = RecordReader([path], text_key=text_key)
    return f"{path}: raw text in {len(reader.files)} file(s), tokenized here", _raw_documents(reader, tok)


def _indexed_documents(ds) -> Iterator[tuple[str, np.ndarray, None]]:
    for d in range(ds.num_documents):
        first, end = int(ds.doc_idx[d]), int(ds.doc_idx[d + 1])
        parts = [np.asarray(ds[s]) for s in range(first, end)]
        ids = np.concatenate(parts) if parts else np.zeros(0, dtype=ds.dtype)
        yield f"sequences {first}..{end - 1}" if end - first != 1 else f"sequence {first}", ids, None


def _token_parquet_documents(path: Path) -> Iterator[tuple[str, np.ndarray, None]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=[TOKEN_COLUMN], batch_size=64):
        for ids in batch.column(0).to_pylist():
            yield f"row {row}", np.asarray(ids if ids is not None else [], dtype=np.int64), None
            row += 1


def _raw_documents(reader: RecordReader, tok: Tokenizer) -> Iterator[tuple[str, np.ndarray, str]]:
    for doc in reader.documents():
        yield doc.where, np.asarray(tok.encode(doc.text), dtype=np.int64), doc.text


def _print_table(ids: np.ndarray, tok: Tokenizer | None, max_tokens: int, out: TextIO) -> None:
    shown = ids if max_tokens <= 0 else ids[:max_tokens]
    width = max(len("id"), *(len(str(i)) for i in shown.tolist())) if len(shown) else 2
    print(f"{'id':>{width}}  token" if tok is not None else f"{'id':>{width}}", file=out)
    for tid in shown.tolist():
        if tok is None:
            print(f"{tid:>{width}}", file=out)
        else:
            print(f"{tid:>{width}}  {json.dumps(_piece(tok, tid), ensure_ascii=False)}", file=out)
    if len(shown) < len(ids):
        print(f"... {len(ids) - len(shown)} more tokens (--max-tokens 0 shows all)", file=out)


def _piece(tok: Tokenizer, tid: int) -> str:
    try:
        return tok.decode([tid])
    except (ValueError, IndexError, KeyError, OverflowError) as e:  # an id outside this tokenizer's vocabulary
        return f"<not in the vocabulary: {e}>"
