"""Raw text documents in Parquet or JSONL files: find the files, read them by chunk, name the file and row of
every bad record."""

from __future__ import annotations

import glob
import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from maester.config import DataSourceConfig

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}


class InvalidDocument(ValueError):
    """A record that cannot be a training document; the message names the file and the line or row."""


def check_document(value, where: str, field: str) -> str:
    """The text of one record, or InvalidDocument: not text, not valid UTF-8, or empty.

    `where` locates the record (`file:line` or `file: row N`); `field` is the column or JSON key read.
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidDocument(f"{where}: field {field!r} is not valid UTF-8 (byte {e.start})") from None
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise InvalidDocument(f"{where}: field {field!r} holds {kind}, not text")
    if not value:
        raise InvalidDocument(f"{where}: field {field!r} is an empty document")
    return value


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


@dataclass(frozen=True)
class Chunk:
    """Rows `start : start + rows` of one file; never crosses a Parquet row group."""

    file: int
    start: int
    rows: int


class TextSource:
    """A raw-text source as a list of chunks of at most `chunk_documents` rows, read by chunk.

    Only metadata is read up front (Parquet footers, JSONL line offsets); nothing is written anywhere, so the
    data may live on a read-only filesystem. Recently read Parquet row groups are kept in a small cache.
    """

    CACHED_ROW_GROUPS = 4

    def __init__(self, cfg: DataSourceConfig, chunk_documents: int):
        self.cfg, self.column = cfg, cfg.text_column
        self.files = resolve_files(cfg)
        self.formats = [_file_format(f, cfg) for f in self.files]
        self.chunks: list[Chunk] = []
        self._row_groups: dict[int, list[tuple[int, int]]] = {}  # parquet file -> (first row, rows) per group
        self._line_starts: dict[int, np.ndarray] = {}  # jsonl file -> byte offset of each line, plus the end
        self.num_rows = 0
        for i, (path, fmt) in enumerate(zip(self.files, self.formats)):
            spans = self._parquet_row_groups(i, path) if fmt == "parquet" else [self._jsonl_lines(i, path)]
            for first, rows in spans:
                for start in range(first, first + rows, chunk_documents):
                    self.chunks.append(Chunk(i, start, min(chunk_documents, first + rows - start)))
                self.num_rows += rows
        if not self.chunks:
            raise ValueError(f"data source {cfg.path!r} holds no documents")
        self._cache: OrderedDict[tuple[int, int], list] = OrderedDict()

    def __getstate__(self):  # worker processes start with an empty cache
        return {**self.__dict__, "_cache": OrderedDict()}

    def _parquet_row_groups(self, i: int, path: Path) -> list[tuple[int, int]]:
        meta = _open_parquet(path).metadata
        if self.column not in meta.schema.names:
            raise ValueError(f"{path}: no column {self.column!r} (columns: {', '.join(meta.schema.names)}); "
                             f"set text_column on the data source")
        groups, first = [], 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            groups.append((first, rows))
            first += rows
        self._row_groups[i] = groups
        return groups

    def _jsonl_lines(self, i: int, path: Path) -> tuple[int, int]:
        data = np.fromfile(path, dtype=np.uint8)
        ends = np.flatnonzero(data == ord("\n")) + 1
        if len(data) and (not len(ends) or ends[-1] != len(data)):
            ends = np.append(ends, len(data))  # a last line without a newline
        self._line_starts[i] = np.concatenate([[0], ends]).astype(np.int64)
        return 0, len(ends)

    def file_key(self, i: int) -> int:
        """A stable number for file i: a hash of its name relative to the source, not of its place on disk."""
        path = self.files[i]
        root = Path(self.cfg.path)
        name = path.relative_to(root).as_posix() if root.is_dir() else path.name
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")

    def read(self, chunk: Chunk) -> list[str | InvalidDocument]:
        """The documents of a chunk in row order; a bad record is returned as its InvalidDocument."""
        path = self.files[chunk.file]
        if self.formats[chunk.file] == "jsonl":
            starts = self._line_starts[chunk.file]
            with open(path, "rb") as f:
                f.seek(int(starts[chunk.start]))
                blob = f.read(int(starts[chunk.start + chunk.rows] - starts[chunk.start]))
            lines = blob.split(b"\n")[:chunk.rows]
            return [_jsonl_document(line, f"{path}:{chunk.start + k + 1}", self.column)
                    for k, line in enumerate(lines)]
        values, first = self._row_group_values(chunk)
        out: list[str | InvalidDocument] = []
        for k in range(chunk.start, chunk.start + chunk.rows):
            try:
                out.append(check_document(values[k - first], f"{path}: row {k}", self.column))
            except InvalidDocument as e:
                out.append(e)
        return out

    def _row_group_values(self, chunk: Chunk) -> tuple[list, int]:
        groups = self._row_groups[chunk.file]
        g = next(g for g, (first, rows) in enumerate(groups) if first <= chunk.start < first + rows)
        key = (chunk.file, g)
        if key not in self._cache:
            path = self.files[chunk.file]
            try:
                table = _open_parquet(path).read_row_group(g, columns=[self.column])
            except Exception as e:
                raise ValueError(f"{path}: row group {g} cannot be read: {e}") from e
            self._cache[key] = table.column(0).to_pylist()
            while len(self._cache) > self.CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key], groups[g][0]

    def documents(self) -> Iterator[str | InvalidDocument]:
        """Every record in file order."""
        for chunk in self.chunks:
            yield from self.read(chunk)


def _open_parquet(path: Path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise ValueError(f"{path}: not a readable Parquet file: {e}") from e


def _jsonl_document(line: bytes, where: str, field: str) -> str | InvalidDocument:
    line = line.rstrip(b"\r")
    if not line.strip():
        return InvalidDocument(f"{where}: blank line, not a JSON record")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return InvalidDocument(f"{where}: not valid UTF-8 (byte {e.start})")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return InvalidDocument(f"{where}: not valid JSON: {e}")
    if not isinstance(record, dict) or field not in record:
        return InvalidDocument(f"{where}: record has no field {field!r}")
    try:
        return check_document(record[field], where, field)
    except InvalidDocument as e:
        return e
