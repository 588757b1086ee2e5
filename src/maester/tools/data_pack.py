"""`maester data pack`: conversations encoded with a chat template and packed whole into rows of `seq_len`, as
Parquet that the SFT loader reads without tokenizing again.

Every conversation is encoded (tokens and pre-shifted labels, per `--mask`), fitted to `seq_len` (longer ones
truncated or dropped, per `--overlong`), then all of them are packed at once by best-fit decreasing: a
conversation is never split. Rows come out in the seeded order of `best_fit_decreasing`, written as
`part-00000.parquet`, ... of at most `rows_per_file` rows, one row group per `_ROWS_PER_GROUP` rows. All encoded
conversations are held in memory until packing (about 8 bytes per token).

With several workers, chunks of records are encoded in worker processes through `map_in_order`, which hands results
back in input order, so the output is the same for any number of workers.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from maester.config import SFTConfig, TokenizerConfig
from maester.data.packing import (IGNORE_INDEX, OVERLONG, PackedRows, best_fit_decreasing, fit_length, pack_rows,
                                  packing_efficiency)
from maester.data.records import RecordReader
from maester.files import AtomicOutputs
from maester.tools.data_report import Progress, Summary
from maester.data.sft_loader import RecordEncoder, encode_in_chunks

COLUMNS = ("input_ids", "labels", "position_ids", "document_ids", "seq_lens")
DEFAULT_ROWS_PER_FILE = 8192
_ROWS_PER_GROUP = 256
_CHUNK_RECORDS = 256
_OPTIONS = {"chat_template_path": "--chat-template"}  # SFTConfig field -> option, where the names differ


# --- writing ----------------------------------------------------------------------------------------------------

def _list_column(values: np.ndarray, lengths: np.ndarray):
    import pyarrow as pa

    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(np.int32, copy=False)))


class _PackedParquetFiles:
    """`part-NNNNN.parquet` files of at most `rows_per_file` rows, under temporary names until committed."""

    def __init__(self, directory: Path, outputs: AtomicOutputs, rows_per_file: int, metadata: dict[str, str]):
        import pyarrow as pa

        self.directory, self.outputs, self.rows_per_file = directory, outputs, rows_per_file
        self.schema = pa.schema([(name, pa.list_(pa.int32())) for name in COLUMNS],
                                metadata={k.encode(): v.encode() for k, v in metadata.items()})
        self.paths: list[Path] = []
        self._writer = None
        self._rows_in_file = 0

    def add(self, rows: PackedRows) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        n, seq_len = rows.input_ids.shape
        done = 0
        while done < n:
            if self._writer is None:
                path = self.directory / f"part-{len(self.paths):05d}.parquet"
                self._writer = pq.ParquetWriter(self.outputs.temp_for(path), self.schema)
                self.paths.append(path)
                self._rows_in_file = 0
            take = min(n - done, self.rows_per_file - self._rows_in_file)
            part = slice(done, done + take)
            full = np.full(take, seq_len, dtype=np.int64)
            seq_lens = rows.seq_lens[part]
            columns = [_list_column(getattr(rows, name)[part].reshape(-1), full) for name in COLUMNS[:4]]
            columns.append(_list_column(np.concatenate(seq_lens), np.fromiter(map(len, seq_lens), np.int64, take)))
            self._writer.write_table(pa.Table.from_arrays(columns, schema=self.schema))
            done += take
            self._rows_in_file += take
            if self._rows_in_file == self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# --- the command ------------------------------------------------------------------------------------------------

def sft_config(**values) -> SFTConfig:
    """The `data.sft` section of command-line options; a bad value is named by its option."""
    from pydantic import ValidationError

    try:
        return SFTConfig(**values)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        option = _OPTIONS.get(field, "--" + field.replace("_", "-"))
        raise ValueError(f"{option}: {err['msg'].removeprefix('Value error, ')}") from None


def pack(inputs: Sequence[str], output_dir: str, tokenizer: TokenizerConfig, *, seq_len: int,
         template: str = "chatml", mask: str = "assistant_only", seed: int = 0, overlong: str = "truncate",
         messages_key: str = "messages", text_key: str = "text", system_prompt: str | None = None,
         chat_template: str | None = None, skip_invalid: bool = False, workers: int = 1,
         rows_per_file: int = DEFAULT_ROWS_PER_FILE) -> Summary:
    """Encode the conversations of `inputs`, pack them into rows of `seq_len` tokens and write them as
    `part-NNNNN.parquet` in `output_dir`."""
    for name, value in (("seq-len", seq_len), ("workers", workers), ("rows-per-file", rows_per_file)):
        if value < 1:
            raise ValueError(f"--{name} must be at least 1, got {value}")
    if seed < 0:
        raise ValueError(f"--seed must be at least 0, got {seed}")
    if overlong not in OVERLONG:
        raise ValueError(f"--overlong must be truncate or drop, got {overlong!r}")
    sft = sft_config(template=template, mask=mask, messages_key=messages_key, system_prompt=system_prompt,
                      chat_template_path=chat_template, overlong=overlong)
    directory = Path(output_dir)
    old = sorted(directory.glob("part-*")) if directory.is_dir() else []
    if old:
        raise ValueError(f"{directory}: already holds {old[0].name} (and {len(old) - 1} more part-* files): "
                         f"choose an empty --output, or remove them")
    reader = RecordReader(inputs, text_key=text_key, skip_invalid=skip_invalid)
    init_args = (tokenizer, sft, text_key, skip_invalid)
    encoder = RecordEncoder(*init_args)  # a bad tokenizer or template fails here, before any output
    pad_id = encoder.tokenizer.pad_id if encoder.tokenizer.pad_id is not None else encoder.tokenizer.eos_id
    records = reader.records(None if template == "markers" else messages_key)

    summary = Summary("pack", tokens=0)
    counts: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    examples: list[tuple[np.ndarray, np.ndarray]] = []
    with Progress("pack", summary, reader.count_records()) as progress, AtomicOutputs() as outputs:
        for read, encoded in encode_in_chunks(records, init_args, _CHUNK_RECORDS, workers, skipped):
            tokens = 0
            for result in encoded:
                fitted = fit_length(result[0], result[1], seq_len, overlong)
                if fitted is None:
                    counts["dropped"] += 1
                    continue
                counts["truncated"] += len(fitted[0]) < len(result[0])
                counts["untrained"] += not (fitted[1] != IGNORE_INDEX).any()
                examples.append(fitted)
                tokens += len(fitted[0])
            progress.update(read, tokens)

        if not examples:
            raise ValueError(f"no conversation to pack: {summary.documents} read, {counts['dropped']} longer than "
                             f"--seq-len {seq_len} and dropped, {sum(skipped.values()) + sum(reader.skipped.values())} "
                             f"invalid and skipped")
        start = time.perf_counter()
        lengths = np.fromiter((len(t) for t, _ in examples), dtype=np.int64, count=len(examples))
        bins = best_fit_decreasing(lengths, seq_len, seed)
        pack_seconds = time.perf_counter() - start
        metadata = {"seq_len": str(seq_len), "pad_id": str(pad_id), "template": template, "mask": mask,
                    "overlong": overlong, "seed": str(seed), "tokenizer": json.dumps(tokenizer.model_dump(mode="json")),
                    "sft": json.dumps(sft.model_dump(mode="json"))}
        files = _PackedParquetFiles(directory, outputs, rows_per_file, metadata)
        try:
            for first in range(0, len(bins), _ROWS_PER_GROUP):
                files.add(pack_rows(examples, bins[first:first + _ROWS_PER_GROUP], seq_len, pad_id))
        finally:
            files.close()
    skipped.update(reader.skipped)
    summary.skipped = skipped
    efficiency = packing_efficiency(int(lengths.sum()), len(bins), seq_len)
    summary.extra = {"kept": len(examples), "truncated": counts["truncated"], "dropped": counts["dropped"],
                     "untrained": counts["untrained"], "rows": len(bins), "efficiency": f"{efficiency:.2%}",
                     "pack_time": f"{pack_seconds:.2f}s", "files": len(files.paths), "output": str(directory)}
    return summary
