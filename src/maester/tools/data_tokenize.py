"""`maester data tokenize` and `maester data count`: documents to token ids, chunk by chunk, over a process pool.

Documents are cut into chunks of `chunk_size` in input order; each chunk is encoded with one `encode_batch` call.
With several workers the chunks go through `map_in_order`, which gives results back in input order, so the output
is byte-identical for any number of workers. Each worker builds its own tokenizer from the `TokenizerConfig`.
"""

from __future__ import annotations

import itertools
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from maester.config import TokenizerConfig
from maester.data.indexed import IndexedDatasetWriter, best_dtype
from maester.data.records import RecordReader
from maester.data.tokenizers import Tokenizer, build_tokenizer
from maester.files import AtomicOutputs
from maester.tools.data_report import Progress, Summary
from maester.data.worker_pool import chunked, map_in_order

DEFAULT_CHUNK_SIZE = 1000
_KINDS = ("hf", "sentencepiece", "tiktoken")
_RANK_LINE = re.compile(rb"^[A-Za-z0-9+/]+=*[ \t]+[0-9]+\r?$")


# --- the tokenizer spec -----------------------------------------------------------------------------------------

def parse_pairs(values: Sequence[str], option: str, form: str) -> dict[str, str]:
    """`["A=B", ...]` as a dict, split at the first `=`; `option` and `form` name the option in errors."""
    out: dict[str, str] = {}
    for value in values:
        left, sep, right = value.partition("=")
        if not sep or not left or not right:
            raise ValueError(f"{option}: {value!r} is not of the form {form}")
        out[left] = right
    return out


def parse_special_tokens(values: Sequence[str]) -> dict[str, int]:
    """`--special-tokens TOKEN=ID ...`, split at the last `=`."""
    out: dict[str, int] = {}
    for value in values:
        token, sep, tid = value.rpartition("=")
        if not sep or not token or not tid.isdigit():
            raise ValueError(f"--special-tokens: {value!r} is not of the form TOKEN=ID (ID a number)")
        out[token] = int(tid)
    return out


def tokenizer_config(spec: str, *, bos_token: str | None = None, eos_token: str | None = None,
                     special_tokens: dict[str, int] | None = None, pattern: str | None = None,
                     control_tokens: dict[str, str] | None = None) -> TokenizerConfig:
    """The TokenizerConfig a `--tokenizer SPEC` names.

    SPEC is `byte`; a Hugging Face `tokenizer.json` or a directory holding one; a SentencePiece `.model`; or a
    tiktoken rank file (`.tiktoken`, or a `.model` made of `<base64 token> <rank>` lines, as Llama 3's). `KIND:PATH`
    (KIND one of hf, sentencepiece, tiktoken) names the kind outright; `tiktoken:NAME` (no such file) is one of
    tiktoken's named encodings, as `cl100k_base`.
    """
    from pydantic import ValidationError

    head, _, name = spec.partition(":")
    if head == "tiktoken" and name and "/" not in name and not Path(name).exists():
        if special_tokens or pattern:
            raise ValueError(f"--tokenizer {spec}: a named encoding has its own special tokens and pattern; drop "
                             f"--special-tokens and --pattern")
        return TokenizerConfig(kind="tiktoken", encoding=name, bos_token=bos_token, eos_token=eos_token,
                               control_tokens=control_tokens or {})
    kind, path = _kind_and_path(spec)
    if kind == "byte" and (bos_token or eos_token):
        raise ValueError("--tokenizer byte has fixed special tokens: --bos-token/--eos-token do not apply")
    if kind != "tiktoken" and (special_tokens or pattern):
        raise ValueError(f"--{'special-tokens' if special_tokens else 'pattern'} applies to tiktoken rank files "
                         f"only, not to --tokenizer {spec}")
    if kind == "tiktoken" and not (eos_token and special_tokens):
        raise ValueError(f"--tokenizer {spec}: a tiktoken rank file has no special tokens of its own: pass "
                         f"--special-tokens TOKEN=ID ... and --eos-token TOKEN")
    try:
        return TokenizerConfig(kind=kind, path=path, bos_token=bos_token, eos_token=eos_token,
                               special_tokens=special_tokens or {}, pattern=pattern,
                               control_tokens=control_tokens or {})
    except ValidationError as e:
        raise ValueError(f"--tokenizer {spec}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


def _kind_and_path(spec: str) -> tuple[str, str | None]:
    if spec == "byte":
        return "byte", None
    head, sep, rest = spec.partition(":")
    if sep and head in _KINDS:
        if not Path(rest).exists():
            raise FileNotFoundError(f"--tokenizer {spec}: {rest} does not exist")
        return head, rest
    path = Path(spec)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return "hf", spec
        if (path / "tokenizer.model").is_file():
            return _kind_of_model_file(path / "tokenizer.model"), str(path / "tokenizer.model")
        raise FileNotFoundError(f"--tokenizer {spec}: the directory holds no tokenizer.json or tokenizer.model")
    if not path.is_file():
        raise FileNotFoundError(f"--tokenizer {spec}: no such file or directory (a tokenizer is `byte`, a "
                                f"tokenizer.json or its directory, a SentencePiece .model or a tiktoken rank file)")
    if path.suffix == ".json":
        return "hf", spec
    if path.suffix == ".tiktoken":
        return "tiktoken", spec
    if path.suffix == ".model":
        return _kind_of_model_file(path), spec
    raise ValueError(f"--tokenizer {spec}: cannot tell the kind from the suffix {path.suffix!r}; write "
                     f"hf:{spec}, sentencepiece:{spec} or tiktoken:{spec}")


def _kind_of_model_file(path: Path) -> str:
    """A `.model` is a tiktoken rank file when its first line is `<base64> <rank>`, else SentencePiece."""
    with open(path, "rb") as f:
        first = f.readline(4096)
    return "tiktoken" if _RANK_LINE.match(first.rstrip(b"\n")) else "sentencepiece"


# --- encoding ---------------------------------------------------------------------------------------------------

class ChunkEncoder:
    """Encodes a chunk of documents into (tokens of all documents end to end, tokens per document)."""

    def __init__(self, cfg: TokenizerConfig, dtype, append_eod: bool = False, add_bos: bool = False,
                 lengths_only: bool = False):
        self.tokenizer: Tokenizer = build_tokenizer(cfg)
        if add_bos and self.tokenizer.bos_id is None:
            raise ValueError(f"--add-bos: the tokenizer ({_describe(cfg)}) has no BOS token; pass --bos-token")
        self.bos = [self.tokenizer.bos_id] if add_bos else []
        self.eos = [self.tokenizer.eos_id] if append_eod else []
        self.dtype = np.dtype(dtype)
        self.lengths_only = lengths_only

    def __call__(self, texts: list[str]) -> tuple[np.ndarray | None, np.ndarray]:
        encoded = self.tokenizer.encode_batch(texts)
        extra = len(self.bos) + len(self.eos)
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
        if self.lengths_only:
            return None, lengths + extra
        body = np.fromiter(itertools.chain.from_iterable(encoded), dtype=np.int64, count=int(lengths.sum()))
        if extra:
            ends = np.cumsum(lengths + extra)
            tokens = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
            starts = ends - lengths - extra
            body_at = np.arange(len(body)) + np.repeat(starts + len(self.bos) - np.cumsum(lengths) + lengths,
                                                       lengths)
            tokens[body_at] = body
            if self.bos:
                tokens[starts] = self.bos[0]
            if self.eos:
                tokens[ends - 1] = self.eos[0]
            lengths = lengths + extra
        else:
            tokens = body
        if tokens.size:
            info = np.iinfo(self.dtype)
            lo, hi = int(tokens.min()), int(tokens.max())
            if lo < info.min or hi > info.max:
                raise ValueError(f"token ids in [{lo}, {hi}] do not fit {self.dtype}")
        return tokens.astype(self.dtype), lengths


def _describe(cfg: TokenizerConfig) -> str:
    return cfg.kind if cfg.path is None else f"{cfg.kind} {cfg.path}"


def encode_chunks(chunks: Iterable[list[str]], cfg: TokenizerConfig, dtype, *, workers: int = 1,
                  append_eod: bool = False, add_bos: bool = False,
                  lengths_only: bool = False) -> Iterator[tuple[np.ndarray | None, np.ndarray]]:
    """The encoding of each chunk, in input order, in `workers` processes."""
    return map_in_order(ChunkEncoder, (cfg, dtype, append_eod, add_bos, lengths_only), chunks, workers)


# --- writing ----------------------------------------------------------------------------------------------------

def indexed_prefix(output_prefix: str | os.PathLike, text_key: str = "text") -> str:
    """GPT-NeoX's name for the dataset of one JSON key: `<prefix>_text_document`."""
    return f"{os.fspath(output_prefix)}_{text_key}_document"


def resolve_indexed_prefix(given: str | os.PathLike) -> str:
    """The prefix of an indexed dataset from what a user typed: the prefix itself, either of its two files, or
    the `--output-prefix` that `tokenize` was given (`<prefix>_text_document`)."""
    given = os.fspath(given)
    prefix = given[:-4] if given.endswith((".bin", ".idx")) else given
    if Path(f"{prefix}.idx").is_file() or Path(f"{prefix}.bin").is_file():
        return prefix
    named = indexed_prefix(prefix)
    if Path(f"{named}.idx").is_file():
        return named
    raise FileNotFoundError(f"{given}: no indexed dataset: neither {prefix}.idx nor {named}.idx exists")


class IndexedChunkWriter:
    """`<prefix>.bin/.idx` through IndexedDatasetWriter, fed chunk by chunk: one sequence per document."""

    def __init__(self, prefix: str, dtype):
        self.shown = f"{prefix}.bin/.idx"
        self._writer = IndexedDatasetWriter(prefix, dtype)

    def __enter__(self) -> "IndexedChunkWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._writer.__exit__(exc_type, exc, tb)

    def add_chunk(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        self._writer.add_documents(tokens, lengths)


class TokenParquetWriter:
    """`<path>` with one `input_ids` list<int32> column, one row per document, one row group per chunk."""

    def __init__(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.shown = str(path)
        self._outputs = AtomicOutputs()
        self._schema = pa.schema([("input_ids", pa.list_(pa.int32()))])
        self._writer = pq.ParquetWriter(self._outputs.temp_for(path), self._schema)

    def __enter__(self) -> "TokenParquetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self._writer.close()
        finally:
            self._outputs.__exit__(exc_type, exc, tb)

    def add_chunk(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        import pyarrow as pa

        offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens.astype(np.int32, copy=False)))
        self._writer.write_table(pa.Table.from_arrays([column], schema=self._schema))


# --- the commands -----------------------------------------------------------------------------------------------

def _check_at_least_one(**options: int) -> None:
    for name, value in options.items():
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def tokenize(inputs: Sequence[str], output_prefix: str, tokenizer: TokenizerConfig, *, workers: int = 1,
             append_eod: bool = False, add_bos: bool = False, text_key: str = "text", fmt: str = "indexed",
             skip_invalid: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, split_on_blank_lines: bool = False,
             chat: dict | None = None) -> Summary:
    """Tokenize every document of `inputs` into `<output_prefix>_<text_key>_document.bin/.idx` (fmt "indexed")
    or `<output_prefix>.parquet` (fmt "parquet"). With `chat` (the `data.sft` values: template, mask, ...), every
    record is a conversation, written with its labels by `tokenize_conversations`."""
    if fmt not in ("indexed", "parquet"):
        raise ValueError(f"--format must be indexed or parquet, got {fmt!r}")
    _check_at_least_one(workers=workers, chunk_size=chunk_size)
    reader = RecordReader(inputs, text_key=text_key, skip_invalid=skip_invalid,
                          split_on_blank_lines=split_on_blank_lines)
    total = reader.count_records()  # an unreadable file fails here, before any output
    if chat is not None:
        given = [name for name, on in (("--append-eod", append_eod), ("--add-bos", add_bos),
                                       ("--format parquet", fmt == "parquet")) if on]
        if given:
            raise ValueError(f"{given[0]} does not apply with --template: the template writes each conversation's "
                             f"tokens, and conversations go to an indexed dataset with its labels (`maester data "
                             f"pack` writes packed Parquet rows)")
        return tokenize_conversations(reader, total, output_prefix, tokenizer, chat, workers=workers,
                                      chunk_size=chunk_size)
    probe = ChunkEncoder(tokenizer, np.int64, append_eod, add_bos)  # a bad tokenizer fails here, before any output
    dtype = best_dtype(probe.tokenizer.vocab_size) if fmt == "indexed" else np.dtype(np.int32)
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    sink: IndexedChunkWriter | TokenParquetWriter
    if fmt == "indexed":
        sink = IndexedChunkWriter(indexed_prefix(output_prefix, text_key), dtype)
    else:
        sink = TokenParquetWriter(Path(f"{os.fspath(output_prefix)}.parquet"))
    summary = Summary("tokenize", tokens=0)
    with Progress("tokenize", summary, total) as progress, sink:
        for tokens, lengths in encode_chunks(chunked(reader.texts(), chunk_size), tokenizer, dtype,
                                             workers=workers, append_eod=append_eod, add_bos=add_bos):
            sink.add_chunk(tokens, lengths)
            progress.update(len(lengths), int(lengths.sum()))
    summary.skipped = reader.skipped
    summary.extra = {"dtype": dtype.name, "output": sink.shown}
    return summary


def tokenize_conversations(reader: RecordReader, total: int | None, output_prefix: str, tokenizer: TokenizerConfig,
                           chat: dict, *, workers: int = 1, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Summary:
    """Each record a conversation, encoded as `data.sft` would in training (`chat`: its values), written as
    `<output_prefix>_text_document` and `<output_prefix>_label_document` (one sequence per conversation)."""
    from maester.data.batch import IGNORE_INDEX
    from maester.data.sft_indexed import ConversationWriter
    from maester.data.sft_loader import RecordEncoder, encode_in_chunks
    from maester.tools.data_pack import sft_config

    sft = sft_config(**chat)
    init_args = (tokenizer, sft, reader.text_key, reader.skip_invalid)
    RecordEncoder(*init_args)  # a bad tokenizer or template fails here, before any output
    records = reader.records(None if sft.template == "markers" else sft.messages_key)
    summary = Summary("tokenize", tokens=0)
    skipped: Counter[str] = Counter()
    trained = 0
    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    with Progress("tokenize", summary, total) as progress, ConversationWriter(output_prefix) as out:
        for read, encoded in encode_in_chunks(records, init_args, chunk_size, workers, skipped):
            tokens = 0
            for result in encoded:
                out.add(*result)
                tokens += len(result[0])
                trained += int((result[1] != IGNORE_INDEX).sum())
            progress.update(read, tokens)
    skipped.update(reader.skipped)
    summary.skipped = skipped
    summary.extra = {"trained": trained, "dtype": "int32", "template": sft.template, "mask": sft.mask,
                     "output": f"{out.text_prefix}.bin/.idx, {out.label_prefix}.bin/.idx"}
    return summary


def indexed_prefixes(inputs: Sequence[str]) -> list[str] | None:
    """The prefixes of `inputs` when every one names an indexed dataset, None when none does; a mix is an error."""
    found = []
    for given in inputs:
        try:
            found.append(resolve_indexed_prefix(given))
        except FileNotFoundError:
            found.append(None)
    if all(p is None for p in found):
        return None
    if any(p is None for p in found):
        indexed = next(given for given, prefix in zip(inputs, found) if prefix is not None)
        raise ValueError(f"{inputs[found.index(None)]} is not an indexed dataset, but {indexed} is: count indexed "
                         f"datasets and documents separately")
    return found


def count_indexed(prefixes: Sequence[str], output: str | None = None, vocab_size: int | None = None,
                  skip_invalid: bool = False) -> Summary:
    """The tokens of every sequence of existing indexed datasets, from their index (as GPT-NeoX's
    `count_tokens.py`); with `output`, one count per line there. Beside a label dataset (`_label_document`), the
    tokens it trains are counted too, after the checks training makes of the pair (`sft_indexed.check_pair`, with
    the tokenizer's vocabulary when given): what training refuses is an error here too (with `skip_invalid`, the
    sequences that train nothing are counted as `nothing_to_train`); each line of `output` is then `tokens trained`."""
    from maester.data.indexed import IndexedDataset
    from maester.data.sft_indexed import (LABEL_DOCUMENT, TEXT_DOCUMENT, check_pair, open_pair,
                                          trained_per_sequence)

    summary = Summary("count", tokens=0)
    longest, trained, untrained = 0, None, 0
    with Progress("count", summary) as progress, AtomicOutputs() as outputs:
        out = open(outputs.temp_for(Path(output)), "w") if output else None
        try:
            for prefix in prefixes:
                labels = prefix[:-len(TEXT_DOCUMENT)] + LABEL_DOCUMENT if prefix.endswith(TEXT_DOCUMENT) else None
                per_sequence = None
                if labels is not None and Path(f"{labels}.idx").is_file():
                    untrained += int((~check_pair(prefix, labels, vocab_size, skip_invalid)[3]).sum())
                    ds, label_ds = open_pair(prefix, labels)
                    per_sequence = trained_per_sequence(label_ds)
                    trained = (trained or 0) + int(per_sequence.sum())
                else:
                    ds = IndexedDataset(prefix)
                sizes = np.asarray(ds.sizes, dtype=np.int64)
                if out is not None:
                    out.write("".join(f"{n}\n" for n in sizes.tolist()) if per_sequence is None else
                              "".join(f"{n} {t}\n" for n, t in zip(sizes.tolist(), per_sequence.tolist())))
                longest = max(longest, int(sizes.max()) if len(sizes) else 0)
                progress.update(len(sizes), int(sizes.sum()))
        finally:
            if out is not None:
                out.close()
    summary.extra = {"mean": f"{summary.tokens / summary.documents if summary.documents else 0.0:.2f}",
                     "max": longest}
    if trained is not None:
        summary.extra["trained"] = trained
    if untrained:
        summary.extra["nothing_to_train"] = untrained
    if output:
        summary.extra["output"] = output
    return summary


def count(inputs: Sequence[str], tokenizer: TokenizerConfig | None, *, output: str | None = None, workers: int = 1,
          append_eod: bool = False, add_bos: bool = False, text_key: str = "text", skip_invalid: bool = False,
          chunk_size: int = DEFAULT_CHUNK_SIZE, split_on_blank_lines: bool = False) -> Summary:
    """Count the tokens of every document (or of every sequence of indexed datasets); with `output`, write one
    count per line there."""
    _check_at_least_one(workers=workers, chunk_size=chunk_size)
    if output and Path(output).is_dir():
        raise ValueError(f"--output {output} is a directory: give the file to write the counts to")
    prefixes = indexed_prefixes(inputs)
    if prefixes is not None:
        vocab = None if tokenizer is None else build_tokenizer(tokenizer).vocab_size
        return count_indexed(prefixes, output, vocab, skip_invalid)
    if tokenizer is None:
        raise ValueError("--tokenizer is needed to count the tokens of documents (not of an indexed dataset)")
    reader = RecordReader(inputs, text_key=text_key, skip_invalid=skip_invalid,
                          split_on_blank_lines=split_on_blank_lines)
    ChunkEncoder(tokenizer, np.int64, append_eod, add_bos)  # a bad tokenizer fails here, before any output
    summary = Summary("count", tokens=0)
    longest = 0
    with Progress("count", summary, reader.count_records()) as progress, AtomicOutputs() as outputs:
        out = open(outputs.temp_for(Path(output)), "w") if output else None
        try:
            for _, lengths in encode_chunks(chunked(reader.texts(), chunk_size), tokenizer, np.int64,
                                            workers=workers, append_eod=append_eod, add_bos=add_bos,
                                            lengths_only=True):
                if out is not None:
                    out.write("".join(f"{n}\n" for n in lengths.tolist()))
                longest = max(longest, int(lengths.max()))
                progress.update(len(lengths), int(lengths.sum()))
        finally:
            if out is not None:
                out.close()
    mean = summary.tokens / summary.documents if summary.documents else 0.0
    summary.skipped = reader.skipped
    summary.extra = {"mean": f"{mean:.2f}", "max": longest}
    if output:
        summary.extra["output"] = output
    return summary
