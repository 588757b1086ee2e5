"""`maester data convert`: JSONL (plain, .gz, .zst) and Parquet into shards of about a target size, either way.

Shards are `part-00000.parquet`, `part-00001.parquet`, ... (or `.jsonl`), in input order. A shard is closed once
it holds `shard_size_mb` of data: JSON bytes for JSONL, uncompressed text for Parquet (the file is then smaller).

- To Parquet: one string column. Text records keep only their text (`text_key`); conversations (records with a
  `messages_key` list of {role, content} and no text) keep only their messages, as a JSON string column named
  `messages_key`. Other fields are dropped and named in the summary.
- To JSONL: one JSON object per record, with every field (every column of a Parquet row); a messages column
  stored as a JSON string becomes a list again.

The first valid record decides whether the run holds text or conversations; records of the other kind are then
invalid. All shards are written under temporary names and renamed only when the whole run succeeded.
"""

from __future__ import annotations

import datetime
import decimal
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from maester.data.records import RecordReader
from maester.files import AtomicOutputs
from maester.tools.data_report import Progress, Summary

FORMATS = ("parquet", "jsonl")
_PROGRESS_EVERY = 1000


class _ParquetShards:
    def __init__(self, directory: Path, outputs: AtomicOutputs, target_bytes: int):
        self.directory, self.outputs, self.target = directory, outputs, target_bytes
        self.paths: list[Path] = []
        self._column: str | None = None
        self._values: list[str] = []
        self._size = 0

    def add(self, column: str, value: str) -> None:
        self._column = column
        self._values.append(value)
        self._size += len(value)
        if self._size >= self.target:
            self.flush()

    def flush(self) -> None:
        if not self._values:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.directory / f"part-{len(self.paths):05d}.parquet"
        table = pa.table({self._column: pa.array(self._values, type=pa.string())})
        pq.write_table(table, self.outputs.temp_for(path))
        self.paths.append(path)
        self._values, self._size = [], 0


class _JsonlShards:
    def __init__(self, directory: Path, outputs: AtomicOutputs, target_bytes: int):
        self.directory, self.outputs, self.target = directory, outputs, target_bytes
        self.paths: list[Path] = []
        self._file = None
        self._size = 0

    def add(self, line: bytes) -> None:
        if self._file is None:
            path = self.directory / f"part-{len(self.paths):05d}.jsonl"
            self._file = open(self.outputs.temp_for(path), "wb")
            self.paths.append(path)
        self._file.write(line)
        self._size += len(line)
        if self._size >= self.target:
            self.flush()

    def flush(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file, self._size = None, 0


def _json_value(value):
    """What json.dumps cannot write by itself, as Parquet rows may hold it."""
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")  # UnicodeDecodeError (a ValueError) names the record below
    raise TypeError(f"{type(value).__name__} has no JSON form")


def _json_line(record: dict, where: str) -> bytes:
    try:
        return (json.dumps(record, ensure_ascii=False, default=_json_value) + "\n").encode("utf-8")
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: cannot be written as JSON: {e}") from None


def convert(inputs: Sequence[str], output_dir: str, to: str, *, shard_size_mb: float = 256.0,
            text_key: str = "text", messages_key: str = "messages", skip_invalid: bool = False) -> Summary:
    """Write the records of `inputs` as `to` ("parquet" or "jsonl") shards `part-NNNNN.<to>` in `output_dir`."""
    if to not in FORMATS:
        raise ValueError(f"--to must be parquet or jsonl, got {to!r}")
    if not shard_size_mb > 0:
        raise ValueError(f"--shard-size-mb must be positive, got {shard_size_mb}")
    reader = RecordReader(inputs, text_key=text_key, skip_invalid=skip_invalid)
    directory = Path(output_dir)
    old = sorted(directory.glob("part-*")) if directory.is_dir() else []
    if old:
        raise ValueError(f"{directory}: already holds {old[0].name} (and {len(old) - 1} more part-* files): "
                         f"choose an empty --output-dir, or remove them")
    target = max(1, int(shard_size_mb * (1 << 20)))
    summary = Summary("convert")
    dropped: Counter[str] = Counter()
    pending = 0
    with Progress("convert", summary, reader.count_records()) as progress, AtomicOutputs() as outputs:
        shards = (_ParquetShards if to == "parquet" else _JsonlShards)(directory, outputs, target)
        for where, record in reader.records(messages_key):
            if to == "jsonl":
                shards.add(_json_line(record, where))
            else:
                key = messages_key if reader.kind == "messages" else text_key
                value = record[key]
                shards.add(key, json.dumps(value, ensure_ascii=False) if reader.kind == "messages" else value)
                dropped.update(k for k in record if k != key)
            pending += 1
            if pending == _PROGRESS_EVERY:
                progress.update(pending)
                pending = 0
        progress.update(pending)
        shards.flush()
    summary.skipped = reader.skipped
    summary.extra = {"kind": reader.kind or "none", "shards": len(shards.paths), "output": str(directory)}
    if dropped:
        summary.extra["dropped_fields"] = ",".join(sorted(dropped))
    return summary
