"""Text documents from Parquet or JSONL files: find the files, read the text column, fail loudly on bad records."""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path

from maester.config import DataSourceConfig

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


def resolve_files(source: DataSourceConfig) -> list[Path]:
    """The files of a source, sorted: a file, every data file under a directory, or a glob's matches."""
    if source.path.startswith("builtin:"):
        from maester.data.builtin_corpora import materialize_builtin
        return [materialize_builtin(source.path.removeprefix("builtin:"))]
    path = Path(source.path)
    if any(ch in source.path for ch in "*?["):
        files = sorted((Path(p) for p in glob.glob(source.path, recursive=True) if Path(p).is_file()), key=str)
    elif path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES), key=str)
    elif path.is_file():
        files = [path]
    else:
        raise FileNotFoundError(f"data source {source.path!r} does not exist")
    if not files:
        raise FileNotFoundError(f"data source {source.path!r} matches no .parquet/.jsonl files")
    for f in files:
        _file_format(f, source)
    return files


def _file_format(path: Path, source: DataSourceConfig) -> str:
    if source.format != "auto":
        return source.format
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: cannot tell the format from the suffix {path.suffix!r}; "
                         f"set format = 'parquet' or 'jsonl' on the data source")
    return SUFFIXES[path.suffix]


def read_documents(path: Path, source: DataSourceConfig) -> Iterator[str]:
    """Every document's text in file order; a missing column, null or non-string text is an error."""
    if _file_format(path, source) == "parquet":
        yield from _read_parquet(path, source.text_column)
    else:
        yield from _read_jsonl(path, source.text_column)


def _read_parquet(path: Path, column: str) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from e
    names = pf.schema_arrow.names
    if column not in names:
        raise ValueError(f"{path}: no column {column!r} (columns: {', '.join(names)}); set text_column")
    row = 0
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        values = batch.column(0).to_pylist()
        for value in values:
            if not isinstance(value, str):
                raise ValueError(f"{path}: row {row}: column {column!r} holds {type(value).__name__}, not text")
            yield value
            row += 1


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
            if not isinstance(record, dict) or field not in record:
                raise ValueError(f"{path}:{lineno}: record has no field {field!r}")
            if not isinstance(record[field], str):
                raise ValueError(f"{path}:{lineno}: field {field!r} holds {type(record[field]).__name__}, not text")
            yield record[field]
