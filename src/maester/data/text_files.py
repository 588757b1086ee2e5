"""Raw text documents in Parquet, JSONL or plain `.txt` files as a pretraining source: the files of a data source, their
records in chunks that can be read in any order, every bad record as its error naming file and line or row.

Reading is `records`' (the one reader of JSONL and Parquet, also behind `maester data`): the same files, suffixes,
decompression, byte order mark and errors, record for record.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from maester.config import DataSourceConfig
from maester.data.hub_datasets import HubFile, is_hub_source, resolve_hub_files
from maester.data.records import (InvalidRecord, JsonlLines, TextFileDocuments, check_document, document_of_line,
                                  document_of_text, file_format, parquet_row_groups, read_row_group, resolve_inputs)

log = logging.getLogger(__name__)

# A compressed JSONL file read in more pieces than this is worth a warning: each piece decompresses from its start.
WARN_COMPRESSED_PIECES = 4

# How a pretraining source reads another field or column, said when the one asked for is missing.
TEXT_COLUMN_HINT = "set text_column on the data source"


def resolve_files(source: DataSourceConfig) -> list[Path | HubFile]:
    """The files of a source: a file, every data file under a directory (sorted, hidden files left out), a glob's
    matches (sorted), a built-in corpus, or the Parquet files of a dataset on the Hub (`hf://datasets/...`, at the
    commit its revision names now)."""
    if source.path.startswith("builtin:"):
        from maester.data.builtin_corpora import materialize_builtin
        return [materialize_builtin(source.path.removeprefix("builtin:"))]
    if is_hub_source(source.path):
        return resolve_hub_files(source.path, source.format)
    return resolve_inputs([source.path], source.format)


@dataclass(frozen=True)
class Chunk:
    """Rows `start : start + rows` of one file; never crosses a Parquet row group."""

    file: int
    start: int
    rows: int


class TextSource:
    """A raw-text source as a list of chunks of at most `chunk_documents` rows, read by chunk.

    Only metadata is read up front (Parquet footers, JSONL line offsets, the line count of a compressed JSONL
    file); nothing is written anywhere, so the data may live on a read-only filesystem. Recently read Parquet row
    groups are kept in a small cache.
    """

    CACHED_ROW_GROUPS = 4

    def __init__(self, cfg: DataSourceConfig, chunk_documents: int):
        self.cfg, self.column = cfg, cfg.text_column
        self.files = resolve_files(cfg)
        self.formats = [file_format(f, cfg.format) for f in self.files]
        self.chunks: list[Chunk] = []
        self._row_groups: dict[int, list[tuple[int, int]]] = {}  # parquet file -> (first row, rows) per group
        self._lines: dict[int, JsonlLines] = {}  # jsonl file -> its lines
        self._texts: dict[int, TextFileDocuments] = {}  # txt file -> its documents
        self.num_rows = 0
        for i, (path, fmt) in enumerate(zip(self.files, self.formats)):
            if fmt == "parquet":
                spans = self._row_groups[i] = parquet_row_groups(path, self.column, TEXT_COLUMN_HINT)
            elif fmt == "txt":
                self._texts[i] = TextFileDocuments(path, cfg.split_on_blank_lines)
                spans = [(0, self._texts[i].count)]
            else:
                self._lines[i] = JsonlLines(path, fmt)
                spans = [(0, self._lines[i].count)]
            pieces = len(self.chunks)
            for first, rows in spans:
                for start in range(first, first + rows, chunk_documents):
                    self.chunks.append(Chunk(i, start, min(chunk_documents, first + rows - start)))
                self.num_rows += rows
            pieces = len(self.chunks) - pieces
            if fmt in ("jsonl.gz", "jsonl.zst") and pieces > WARN_COMPRESSED_PIECES:
                log.warning("%s is compressed and read in %d chunks of %d documents; each chunk decompresses it from "
                            "its start (about %d passes over the file in an epoch). Decompress it, or tokenize it "
                            "once with `maester data tokenize`, to read it in one pass",
                            path, pieces, chunk_documents, (pieces + 1) // 2)
        if not self.chunks:
            raise ValueError(f"data source {cfg.path!r} holds no documents")
        self._cache: OrderedDict[tuple[int, int], list] = OrderedDict()

    def __getstate__(self):  # worker processes start with an empty cache
        return {**self.__dict__, "_cache": OrderedDict()}

    def file_key(self, i: int) -> int:
        """A stable number for file i: a hash of its name relative to the source, not of its place on disk."""
        path = self.files[i]
        root = Path(self.cfg.path)
        name = (path.key_name if isinstance(path, HubFile) else path.relative_to(root).as_posix() if root.is_dir()
                else path.name)
        return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")

    def read(self, chunk: Chunk) -> list[str | InvalidRecord]:
        """The documents of a chunk in row order; a bad record is returned as its InvalidRecord."""
        path = self.files[chunk.file]
        if chunk.file in self._texts:
            return [_document_or_error(document_of_text, raw, path, lineno)
                    for lineno, raw in self._texts[chunk.file].read(chunk.start, chunk.rows)]
        if chunk.file in self._lines:
            return [_document_or_error(document_of_line, raw, path, lineno, self.column, TEXT_COLUMN_HINT)
                    for lineno, raw in self._lines[chunk.file].read(chunk.start, chunk.rows)]
        values, first = self._row_group_values(chunk)
        return [_document_or_error(check_document, values[k - first], f"{path}: row {k}", self.column)
                for k in range(chunk.start, chunk.start + chunk.rows)]

    def _row_group_values(self, chunk: Chunk) -> tuple[list, int]:
        groups = self._row_groups[chunk.file]
        g = next(g for g, (first, rows) in enumerate(groups) if first <= chunk.start < first + rows)
        key = (chunk.file, g)
        if key not in self._cache:
            self._cache[key] = read_row_group(self.files[chunk.file], g, self.column)
            while len(self._cache) > self.CACHED_ROW_GROUPS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return self._cache[key], groups[g][0]

    def documents(self) -> Iterator[str | InvalidRecord]:
        """Every record in file order."""
        for chunk in self.chunks:
            yield from self.read(chunk)


def _document_or_error(read_document, *args) -> str | InvalidRecord:
    try:
        return read_document(*args)
    except InvalidRecord as e:
        return e
