"""The one reader of JSONL (plain, `.gz`, `.zst`) and Parquet records and plain `.txt` documents, each bad one named
by file and position.

`maester data` streams records with `RecordReader`; pretraining (`text_files.TextSource`) reads the same files in
pieces, through `JsonlLines`, `parquet_row_groups` and `read_row_group`, and makes each record a document with
`document_of_line` and `check_document`, so that both see the same documents and the same errors.

Inputs are files, directories (every data file under them, hidden files left out) or globs, expanded in sorted
order; the format comes from the suffix, in any case. JSONL is read as bytes, one line at a time, and decoded per
line, so that invalid UTF-8 is one bad record at its `file:line` (lines count from 1), not a failure of the whole
file; a UTF-8 byte order mark before the first line is dropped. Parquet rows are named `file: row N` (rows count
from 0).

Every error of reading is an `InvalidDocument` (a ValueError). A bad record raises `InvalidRecord`, whose `reason`
says what kind of bad it is. A reader made with `skip_invalid=True` skips such records instead and counts them in
`skipped`, by reason: nothing is dropped without being counted. A file that cannot be read at all (a corrupt Parquet
file, a truncated `.gz`) is always an error, `UnreadableFile`.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import gzip
import io
import itertools
import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from maester.data.zstd_frames import ZstdFrames

# Suffix -> format, longest first so that `.jsonl.gz` is not taken for `.gz`.
SUFFIX_FORMATS = (
    (".jsonl.zstd", "jsonl.zst"), (".jsonl.zst", "jsonl.zst"), (".json.zst", "jsonl.zst"),
    (".jsonl.gz", "jsonl.gz"), (".json.gz", "jsonl.gz"),
    (".jsonl", "jsonl"), (".json", "jsonl"), (".parquet", "parquet"), (".txt", "txt"),
)
SUFFIXES_HELP = ".jsonl, .jsonl.gz, .jsonl.zst, .parquet, .txt"

# How to read another field or column, said when the one asked for is missing.
TEXT_KEY_HINT = "pass --text-key to read another field or column"

# Reasons a record is invalid, as counted in `RecordReader.skipped`.
BLANK_LINE = "blank line"
INVALID_UTF8 = "invalid UTF-8"
MALFORMED_JSON = "malformed JSON"
NOT_AN_OBJECT = "not a JSON object"
MISSING_FIELD = "missing field"
NOT_TEXT = "not text"
EMPTY_DOCUMENT = "empty document"
INVALID_MESSAGES = "invalid messages"

_READ_BYTES = 1 << 20
_PARQUET_BATCH_ROWS = 8192


class InvalidDocument(ValueError):
    """Data that cannot be trained on, named by file and line or row: one bad record (`InvalidRecord`) or a whole
    file that cannot be read (`UnreadableFile`)."""


class InvalidRecord(InvalidDocument):
    """One record that cannot be used; the message names its file and line or row, `reason` its kind."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # survives the trip back from a worker process
        return type(self), (str(self), self.reason)


class UnreadableFile(InvalidDocument):
    """A whole file that cannot be read: not Parquet, corrupt, truncated, or without the column asked for."""


class Document(NamedTuple):
    text: str
    path: Path
    line: int | None = None  # JSONL: 1-based line
    row: int | None = None  # Parquet: 0-based row

    @property
    def where(self) -> str:
        return _where(self.path, self.line, self.row)


def _where(path: Path, line: int | None, row: int | None) -> str:
    return f"{path}:{line}" if line is not None else f"{path}: row {row}"


# --- finding the files ---------------------------------------------------------------------------------------------

def input_format(path: Path) -> str:
    """`jsonl`, `jsonl.gz`, `jsonl.zst`, `parquet` or `txt`, from the file name; other suffixes are an error."""
    found = _format_or_none(path)
    if found is None:
        raise ValueError(f"{path}: cannot tell the format from the file name; expected one of {SUFFIXES_HELP}")
    return found


def _format_or_none(path: Path) -> str | None:
    name = path.name.lower()
    return next((fmt for suffix, fmt in SUFFIX_FORMATS if name.endswith(suffix)), None)


def file_format(path: Path, given: str = "auto") -> str:
    """The format of a file: told by its name (`auto`), or as `given` (`jsonl`, `parquet`); a file given as JSONL
    whose name ends in `.gz` or `.zst` is still decompressed."""
    if given == "auto":
        return input_format(path)
    found = _format_or_none(path)
    return found if given == "jsonl" and found and found.startswith("jsonl") else given


def resolve_inputs(inputs: Sequence[str | os.PathLike], fmt: str = "auto") -> list[Path]:
    """The files of each input, in the order given: a file, every data file under a directory (sorted, hidden
    files left out), or the matches of a glob (sorted). `fmt`: the format of every file, when not `auto`."""
    if not inputs:
        raise ValueError("no input files given")
    files: list[Path] = []
    for given in inputs:
        if not isinstance(given, (str, os.PathLike)):  # a file on the Hub (`hub_datasets.HubFile`), found already
            file_format(given, fmt)
            files.append(given)
            continue
        text = os.fspath(given)
        path = Path(text)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
                            and _format_or_none(p)), key=str)
            if not found:
                raise FileNotFoundError(f"{text}: the directory holds no {SUFFIXES_HELP} files")
            _one_kind_in_directory(text, found)
        elif any(ch in text for ch in "*?["):
            found = sorted((Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file()), key=str)
            if not found:
                raise FileNotFoundError(f"{text}: the pattern matches no files")
        else:
            raise FileNotFoundError(f"{text}: no such file or directory")
        for f in found:
            file_format(f, fmt)
        files.extend(found)
    return files


def _one_kind_in_directory(directory: str, found: list[Path]) -> None:
    """A directory holds .txt documents or records, not both: a README.txt beside JSONL shards is not data."""
    texts = [p for p in found if _format_or_none(p) == "txt"]
    if texts and len(texts) < len(found):
        other = next(p for p in found if p not in texts)
        raise ValueError(f"{directory}: the directory holds both .txt documents ({texts[0]}) and records ({other}); "
                         f"give the files, or a glob of one kind")


# --- plain text -----------------------------------------------------------------------------------------------

class TextFileDocuments:
    """The documents of a plain `.txt` file by number: the whole file (a UTF-8 byte order mark dropped), or with
    `split_on_blank_lines` each paragraph, its lines between blank (or whitespace-only) lines, without the last line
    break. Only each document's byte span and first line are kept; `read` reads a piece."""

    def __init__(self, path: Path, split_on_blank_lines: bool = False):
        self.path = path
        spans: list[tuple[int, int, int]] = []  # first byte, end byte, first line (1-based)
        try:
            with open(path, "rb") as f:
                if not split_on_blank_lines:
                    spans.append((3 if f.read(3) == codecs.BOM_UTF8 else 0, os.fstat(f.fileno()).st_size, 1))
                else:
                    spans = _paragraphs(f)
        except OSError as e:
            raise UnreadableFile(f"{path}: cannot be read: {e}") from e
        self.spans = np.array(spans, dtype=np.int64).reshape(-1, 3)
        self.count = len(self.spans)

    def read(self, first: int, count: int) -> list[tuple[int, bytes]]:
        """(first line, raw bytes) of the `count` documents after the first `first`."""
        spans = self.spans[first:first + count]
        if not len(spans):
            return []
        with open(self.path, "rb") as f:
            f.seek(int(spans[0, 0]))
            blob = f.read(int(spans[-1, 1] - spans[0, 0]))
        base = int(spans[0, 0])
        return [(line, blob[a - base:b - base]) for a, b, line in spans.tolist()]


def _paragraphs(f) -> list[tuple[int, int, int]]:
    spans, pos, start, end, first = [], 0, -1, 0, 0
    for lineno, raw in enumerate(f, 1):
        skip = len(codecs.BOM_UTF8) if lineno == 1 and raw.startswith(codecs.BOM_UTF8) else 0
        if raw.strip():
            if start < 0:
                start, first = pos + skip, lineno
            end = pos + len(raw.rstrip(b"\r\n"))
        elif start >= 0:
            spans.append((start, end, first))
            start = -1
        pos += len(raw)
    return spans + ([(start, end, first)] if start >= 0 else [])


def document_of_text(raw: bytes, path: Path, lineno: int) -> str:
    """A `.txt` document from its bytes; InvalidRecord if it is not UTF-8 or empty."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRecord(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the document)", INVALID_UTF8) from None
    if not text:
        raise InvalidRecord(f"{path}:{lineno}: an empty document", EMPTY_DOCUMENT)
    return text


# --- JSONL ------------------------------------------------------------------------------------------------------

def _open_jsonl(path: Path, fmt: str):
    if fmt == "jsonl.gz":
        return gzip.open(path, "rb")
    if fmt == "jsonl.zst":
        return io.BufferedReader(ZstdFrames(path), _READ_BYTES)
    return open(path, "rb", buffering=_READ_BYTES)


def _read_errors() -> tuple[type[BaseException], ...]:
    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError


def _jsonl_lines(path: Path, fmt: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) for each line; a file that cannot be read or decompressed is an error."""
    lineno = 0
    try:
        with _open_jsonl(path, fmt) as f:
            for lineno, raw in enumerate(f, 1):
                yield lineno, raw
    except _read_errors() as e:
        after = f" past line {lineno}" if lineno else ""
        raise UnreadableFile(f"{path}: cannot be read{after}: {e}") from e


def parse_line(raw: bytes, path: Path, lineno: int) -> dict:
    """One JSONL line as a JSON object; InvalidRecord if it is blank, not UTF-8, not JSON or not an object."""
    if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    if not raw.strip():
        raise InvalidRecord(f"{path}:{lineno}: blank line, not a JSON record", BLANK_LINE)
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidRecord(f"{path}:{lineno}: not valid UTF-8 (byte {e.start} of the line)", INVALID_UTF8) from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRecord(f"{path}:{lineno}: malformed JSON: {e}", MALFORMED_JSON) from None
    if not isinstance(record, dict):
        raise InvalidRecord(f"{path}:{lineno}: a JSON {type(record).__name__}, not an object", NOT_AN_OBJECT)
    return record


def document_of_line(raw: bytes, path: Path, lineno: int, key: str, hint: str = TEXT_KEY_HINT) -> str:
    """The document text of one JSONL line, field `key`; InvalidRecord if the line or the field is bad."""
    where = f"{path}:{lineno}"
    text = text_of(parse_line(raw, path, lineno), where, key, messages_key="messages", hint=hint)
    if b"\\ud" in raw or b"\\uD" in raw:
        _check_encodable(text, where, f"field {key!r}")
    return text


class JsonlLines:
    """The lines of one JSONL file by number, for reading it in pieces. A plain file's line offsets are found once
    (one pass over its bytes) and a piece is one read; a compressed file is counted once and read from its start
    up to the piece, as a compressed stream cannot be entered in the middle."""

    def __init__(self, path: Path, fmt: str):
        self.path, self.fmt = path, fmt
        self.starts: np.ndarray | None = None  # plain: byte offset of each line, plus the end of the file
        if fmt == "jsonl":
            data = np.fromfile(path, dtype=np.uint8)
            ends = np.flatnonzero(data == ord("\n")) + 1
            if len(data) and (not len(ends) or ends[-1] != len(data)):
                ends = np.append(ends, len(data))  # a last line without a newline
            self.starts = np.concatenate([[0], ends]).astype(np.int64)
            self.count = len(ends)
        else:
            self.count = sum(1 for _ in _jsonl_lines(path, fmt))

    def read(self, first: int, count: int) -> list[tuple[int, bytes]]:
        """(1-based line number, raw line) of the `count` lines after the first `first`."""
        if self.starts is None:
            lines = _jsonl_lines(self.path, self.fmt)
            try:
                return list(itertools.islice(lines, first, first + count))
            finally:
                lines.close()
        starts = self.starts[first:first + count + 1] - self.starts[first]
        with open(self.path, "rb") as f:
            f.seek(int(self.starts[first]))
            blob = f.read(int(starts[-1]))
        # each line with its newline, as a compressed file's are read
        return [(first + k + 1, blob[a:b]) for k, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist()))]


# --- Parquet ----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def open_parquet(path: Path) -> Iterator:
    """A Parquet file, closed on leaving the block: a local path, or a file on the Hub (`hub_datasets.HubFile`) read
    by byte range through its `open()`, which pyarrow does not close itself (and which the garbage collector would
    only free with its reference cycles)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path if isinstance(path, (str, os.PathLike)) else path.open())
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UnreadableFile(f"{path}: not a readable Parquet file: {e}") from e
    try:
        yield pf
    finally:
        pf.close(force=True)


def parquet_columns(path: Path) -> list[str]:
    with open_parquet(path) as pf:
        return pf.schema_arrow.names


def require_column(path: Path, names: list[str], wanted: list[str], hint: str) -> None:
    """UnreadableFile unless the columns `names` of a Parquet file hold one of `wanted`."""
    if not any(name in names for name in wanted):
        raise UnreadableFile(f"{path}: no column {' or '.join(map(repr, wanted))} (columns: {', '.join(names)}); "
                             f"{hint}")


def parquet_row_groups(path: Path, column: str, hint: str) -> list[tuple[int, int]]:
    """(first row, rows) of each row group of a Parquet file, which must have `column`."""
    with open_parquet(path) as pf:
        require_column(path, pf.schema_arrow.names, [column], hint)
        meta = pf.metadata
    groups, first = [], 0
    for g in range(meta.num_row_groups):
        rows = meta.row_group(g).num_rows
        groups.append((first, rows))
        first += rows
    return groups


def read_row_group(path: Path, group: int, column: str) -> list:
    """The values of `column` in one row group of a Parquet file."""
    import pyarrow as pa

    with open_parquet(path) as pf:
        try:
            table = pf.read_row_group(group, columns=[column])
        except (pa.ArrowException, OSError, ValueError) as e:
            raise UnreadableFile(f"{path}: row group {group} cannot be read: {e}") from e
    return table.column(0).to_pylist()


def _parquet_batches(path: Path, columns: list[str] | None) -> Iterator[tuple[int, object]]:
    """(first row, record batch) for each batch of the file, reading only `columns` (all when None)."""
    import pyarrow as pa

    with open_parquet(path) as pf:
        row = 0
        batches = pf.iter_batches(columns=columns, batch_size=_PARQUET_BATCH_ROWS)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowException, OSError, ValueError) as e:
                raise UnreadableFile(f"{path}: corrupt Parquet data after row {row}: {e}") from e
            yield row, batch
            row += batch.num_rows


# --- fields -------------------------------------------------------------------------------------------------------

def _missing_field(record: dict, where: str, key: str, other_key: str | None, mix_up: str,
                   hint: str) -> InvalidRecord:
    fields = ", ".join(list(record)[:8]) or "none"
    hint = f"it holds {other_key!r}: {mix_up}" if other_key and other_key in record else hint
    return InvalidRecord(f"{where}: record has no field {key!r} (fields: {fields}); {hint}", MISSING_FIELD)


def check_document(value, where: str, field: str) -> str:
    """The text of one record's field `field`, or InvalidRecord: not text, not valid UTF-8, or empty.

    `where` locates the record (`file:line` or `file: row N`).
    """
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRecord(f"{where}: field {field!r} is not valid UTF-8 (byte {e.start})", INVALID_UTF8) from None
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise InvalidRecord(f"{where}: field {field!r} holds {kind}, not text", NOT_TEXT)
    if not value:
        raise InvalidRecord(f"{where}: field {field!r} is an empty document", EMPTY_DOCUMENT)
    return value


def text_of(record: dict, where: str, key: str, messages_key: str | None = None, hint: str = TEXT_KEY_HINT) -> str:
    """The document text of a record: a non-empty string in field `key`, else InvalidRecord."""
    if key not in record:
        raise _missing_field(record, where, key, messages_key, "a conversation where a text record was expected",
                             hint)
    return check_document(record[key], where, key)


def _check_encodable(text: str, where: str, what: str) -> None:
    """JSON escapes can spell lone surrogates (`"\\ud800"`), which no UTF-8 encoder accepts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRecord(f"{where}: {what} holds a lone surrogate at character {e.start}, not valid UTF-8",
                            INVALID_UTF8) from None


def messages_of(record: dict, where: str, key: str, text_key: str | None = None) -> list[dict]:
    """The conversation of a record: a non-empty list of {"role": str, "content": str} in field `key` (a JSON
    string of such a list is accepted too, as `convert` writes it to Parquet), else InvalidRecord."""
    if key not in record:
        raise _missing_field(record, where, key, text_key, "a text record where a conversation was expected",
                             "pass --messages-key to read another field")
    value = record[key]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise InvalidRecord(f"{where}: field {key!r} is a string but not a JSON list of messages: {e}",
                                INVALID_MESSAGES) from None
    if not isinstance(value, list) or not value:
        kind = "an empty list" if value == [] else "null" if value is None else type(value).__name__
        raise InvalidRecord(f"{where}: field {key!r} holds {kind}, not a list of messages", INVALID_MESSAGES)
    for i, message in enumerate(value):
        if (not isinstance(message, dict) or not isinstance(message.get("role"), str) or not message["role"]
                or not isinstance(message.get("content"), str)):
            raise InvalidRecord(f"{where}: field {key!r}, message {i}: expected {{\"role\": text, \"content\": "
                                f"text}}, got {json.dumps(message, default=str)[:80]}", INVALID_MESSAGES)
    return value


# --- the reader ---------------------------------------------------------------------------------------------------

class RecordReader:
    """Streams the documents (`documents`) or whole records (`records`) of a list of inputs.

    `skip_invalid`: skip bad records and count them in `skipped` by reason, instead of raising InvalidRecord.
    `fmt`: the format of every file, when not told by its name; `hint`: how to read another field or column.
    `split_on_blank_lines`: a `.txt` file holds one document per paragraph, not one in all.
    """

    def __init__(self, inputs: Sequence[str | os.PathLike], text_key: str = "text", skip_invalid: bool = False,
                 fmt: str = "auto", hint: str = TEXT_KEY_HINT, split_on_blank_lines: bool = False):
        self.files = resolve_inputs(inputs, fmt)
        self.formats = [file_format(path, fmt) for path in self.files]
        self.text_key, self.hint = text_key, hint
        self.split_on_blank_lines = split_on_blank_lines
        self.skip_invalid = skip_invalid
        self.skipped: Counter[str] = Counter()
        self.kind: str | None = None  # set by `records`: "text" or "messages"

    def count_records(self) -> int | None:
        """How many records the inputs hold, for a progress bar's ETA: Parquet row counts from the footers, lines of
        plain JSONL (one fast pass over the bytes); None when a compressed JSONL file would need decompressing."""
        total = 0
        for path, fmt in zip(self.files, self.formats):
            if fmt == "parquet":
                with open_parquet(path) as pf:
                    total += pf.metadata.num_rows
            elif fmt == "txt":
                total += TextFileDocuments(path, self.split_on_blank_lines).count
            elif fmt == "jsonl":
                with open(path, "rb") as f:
                    total += sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 24), b""))
            else:
                return None
        return total

    def _invalid(self, error: InvalidRecord) -> None:
        if not self.skip_invalid:
            raise error
        self.skipped[error.reason] += 1

    def documents(self) -> Iterator[Document]:
        """The text of every valid record, in file order."""
        for path, fmt in zip(self.files, self.formats):
            if fmt == "parquet":
                yield from self._parquet_documents(path)
            elif fmt == "txt":
                yield from self._text_documents(path)
            else:
                yield from self._jsonl_documents(path, fmt)

    def texts(self) -> Iterator[str]:
        return (doc.text for doc in self.documents())

    def _text_documents(self, path: Path) -> Iterator[Document]:
        documents = TextFileDocuments(path, self.split_on_blank_lines)
        for lineno, raw in documents.read(0, documents.count):
            try:
                yield Document(document_of_text(raw, path, lineno), path, line=lineno)
            except InvalidRecord as e:
                self._invalid(e)

    def _jsonl_documents(self, path: Path, fmt: str) -> Iterator[Document]:
        for lineno, raw in _jsonl_lines(path, fmt):
            try:
                text = document_of_line(raw, path, lineno, self.text_key, self.hint)
            except InvalidRecord as e:
                self._invalid(e)
                continue
            yield Document(text, path, line=lineno)

    def _parquet_documents(self, path: Path) -> Iterator[Document]:
        key = self.text_key
        require_column(path, parquet_columns(path), [key], self.hint)
        for first, batch in _parquet_batches(path, [key]):
            for i, value in enumerate(batch.column(0).to_pylist()):
                try:
                    text = check_document(value, _where(path, None, first + i), key)
                except InvalidRecord as e:
                    self._invalid(e)
                    continue
                yield Document(text, path, row=first + i)

    def records(self, messages_key: str | None = "messages") -> Iterator[tuple[str, dict]]:
        """(where, record) for every valid record: JSON objects, or Parquet rows with all their columns.

        A record is a conversation when it has `messages_key` and no text field; the first valid record decides
        which kind the whole run holds (`kind`), and records of the other kind are then invalid. A
        conversation's messages are checked and given back as a list, also when stored as a JSON string.
        """
        self.kind = None if messages_key else "text"
        for path, fmt in zip(self.files, self.formats):
            if fmt == "txt":
                rows = ((doc.where, {self.text_key: doc.text}) for doc in self._text_documents(path))
            else:
                rows = self._parquet_rows(path, messages_key) if fmt == "parquet" else self._jsonl_rows(path, fmt)
            for where, record in rows:
                try:
                    kind = self.kind or ("messages" if messages_key in record and self.text_key not in record
                                         else "text")
                    if kind == "messages":
                        record[messages_key] = messages_of(record, where, messages_key, self.text_key)
                    else:
                        record[self.text_key] = text_of(record, where, self.text_key, messages_key, self.hint)
                except InvalidRecord as e:
                    self._invalid(e)
                    continue
                self.kind = kind
                yield where, record

    def _jsonl_rows(self, path: Path, fmt: str) -> Iterator[tuple[str, dict]]:
        for lineno, raw in _jsonl_lines(path, fmt):
            try:
                record = parse_line(raw, path, lineno)
                if b"\\ud" in raw or b"\\uD" in raw:
                    _check_encodable(json.dumps(record, ensure_ascii=False), f"{path}:{lineno}", "the record")
            except InvalidRecord as e:
                self._invalid(e)
                continue
            yield f"{path}:{lineno}", record

    def _parquet_rows(self, path: Path, messages_key: str | None) -> Iterator[tuple[str, dict]]:
        require_column(path, parquet_columns(path), [self.text_key] + ([messages_key] if messages_key else []),
                       self.hint)
        for first, batch in _parquet_batches(path, None):
            for i, row in enumerate(batch.to_pylist()):
                yield _where(path, None, first + i), row
