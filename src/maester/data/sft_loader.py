"""Supervised fine-tuning data: conversations encoded with a chat template and packed whole into rows.

Every rank reads and encodes all conversations once (SFT sets are small next to pretraining corpora), then each
epoch is a pure function of (seed, epoch): the conversations of all sources (repeated or subsampled by weight) are
packed by best-fit-decreasing into bins, and the bins, together with rows pre-packed by `maester data pack`, are
put in a seeded order. A step takes the next `global_batch` rows of that order and each data-parallel rank its
slice, so the state is three counters and a resume on any number of ranks continues exactly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from maester.config import DataConfig, DataSourceConfig, SFTConfig, TokenizerConfig
from maester.data.batch import IGNORE_INDEX, Batch, BatchPlan
from maester.data.hub_datasets import pinned_commits, source_commits, source_identity
from maester.data.loader_base import LoaderBase
from maester.data.permutation import Permutation, mix64, mix_key, seed_key

log = logging.getLogger("maester")

PACKED_COLUMNS = ("input_ids", "labels", "position_ids", "document_ids", "seq_lens")


@dataclass
class SFTSource:
    """One source's training and held-out material: encoded conversations, or rows packed offline."""

    cfg: DataSourceConfig
    files: list[Path]
    train: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # (tokens, labels) pairs
    validation: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    packed: dict[str, np.ndarray] | None = None  # rows of a pre-packed source (training part)
    packed_validation: dict[str, np.ndarray] | None = None
    counts: Counter = field(default_factory=Counter)  # read, kept, truncated, dropped, skipped

    @property
    def units(self) -> int:
        """What the weight multiplies: conversations, or rows for a pre-packed source."""
        return len(self.packed["input_ids"]) if self.packed is not None else len(self.train)


class RecordEncoder:
    """(tokens, labels) as int32 for each (where, record) of a chunk, or the InvalidRecord it raised when
    `skip_invalid` (else the error propagates). Picklable by its arguments, for worker processes."""

    def __init__(self, tokenizer_cfg: TokenizerConfig, sft: SFTConfig, text_key: str, skip_invalid: bool):
        from maester.data.chat import ChatEncoder
        from maester.data.tokenizers import build_tokenizer, tokenizer_path

        self.tokenizer = build_tokenizer(tokenizer_cfg)
        self.encoder = ChatEncoder(self.tokenizer, sft, tokenizer_cfg.path and str(tokenizer_path(tokenizer_cfg)))
        self.text_key, self.skip_invalid = text_key, skip_invalid

    def __call__(self, chunk: list[tuple[str, dict]]) -> list:
        from maester.data.records import InvalidRecord

        out: list = []
        for where, record in chunk:
            try:
                encoded = self.encoder.encode_record(record, where, self.text_key)
            except InvalidRecord as e:
                if not self.skip_invalid:
                    raise
                out.append(e)
                continue
            out.append((np.asarray(encoded.tokens, dtype=np.int32), np.asarray(encoded.labels(), dtype=np.int32)))
        return out


def encode_in_chunks(records, init_args: tuple, chunk_size: int, workers: int, skipped: Counter):
    """Encode (where, record) pairs with `RecordEncoder(*init_args)` in `workers` processes, in input order. Yields,
    per chunk, (records read, its valid (tokens, labels)); each InvalidRecord is counted in `skipped` by reason."""
    from maester.data.records import InvalidRecord
    from maester.data.worker_pool import chunked, map_in_order

    for results in map_in_order(RecordEncoder, init_args, chunked(records, chunk_size), workers):
        valid = []
        for result in results:
            if isinstance(result, InvalidRecord):
                skipped[result.reason] += 1
            else:
                valid.append(result)
        yield len(results), valid


def _held_out(name: str, n: int, fraction: float) -> np.ndarray:
    """A fixed validation split: item i of source `name` is held out when its hash falls below the fraction."""
    if fraction == 0 or n == 0:
        return np.zeros(n, dtype=bool)
    key = np.uint64(mix_key(int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")))
    return mix64(np.arange(n, dtype=np.uint64) ^ key) < np.uint64(int(fraction * 2.0 ** 64))


def is_packed_file(path: Path, fmt: str) -> bool:
    """Whether a file holds rows packed by `maester data pack`; `fmt`: its format, as `records.file_format` tells."""
    if fmt != "parquet":
        return False
    from maester.data.records import parquet_columns

    return {"input_ids", "labels"} <= set(parquet_columns(path))


def read_packed(files: list[Path], seq_len: int, tokenizer_cfg: TokenizerConfig,
                vocab_size: int) -> dict[str, np.ndarray]:
    """The rows of Parquet files written by `maester data pack`, checked against `data.seq_len`, the kind of
    tokenizer and its vocabulary (every id of input_ids and labels)."""
    from maester.data.records import open_parquet

    parts: dict[str, list] = {k: [] for k in PACKED_COLUMNS}
    for path in files:
        with open_parquet(path) as parquet:
            schema = parquet.schema_arrow
            meta = schema.metadata or {}
            stored = meta.get(b"seq_len")
            if stored is not None and int(stored) != seq_len:
                raise ValueError(f"{path}: rows were packed to seq_len {int(stored)}, but data.seq_len is {seq_len}")
            packed_with = json.loads(meta.get(b"tokenizer", b"{}"))
            if packed_with and (packed_with.get("kind"), Path(packed_with.get("path") or "").name) != (
                    tokenizer_cfg.kind, Path(tokenizer_cfg.path or "").name):
                raise ValueError(f"{path}: rows were packed with tokenizer {packed_with.get('kind')} "
                                 f"{packed_with.get('path') or ''}, but the job uses {tokenizer_cfg.kind} "
                                 f"{tokenizer_cfg.path or ''}")
            missing = [c for c in PACKED_COLUMNS if c not in schema.names]
            if missing:
                raise ValueError(f"{path}: a packed SFT file needs columns {', '.join(PACKED_COLUMNS)}; "
                                 f"missing {', '.join(missing)}")
            table = parquet.read(columns=list(PACKED_COLUMNS))
        for name in PACKED_COLUMNS[:4]:
            column = table.column(name).combine_chunks()
            flat = column.flatten().to_numpy(zero_copy_only=False).astype(np.int64)
            if len(flat) != len(table) * seq_len:
                raise ValueError(f"{path}: column {name!r} does not hold rows of {seq_len} tokens")
            rows = flat.reshape(len(table), seq_len)
            if name in ("input_ids", "labels"):
                negative = (rows < 0) & (rows != IGNORE_INDEX) if name == "labels" else rows < 0
                bad = (rows >= vocab_size) | negative
                if bad.any():
                    row, col = (int(i[0]) for i in np.nonzero(bad))
                    raise ValueError(f"{path}: row {row}, {name}[{col}] = {int(rows[row, col])} is outside the "
                                     f"tokenizer's vocabulary of {vocab_size} ids: the rows were packed with "
                                     f"another tokenizer, or the file is damaged")
            parts[name].append(rows)
        parts["seq_lens"] += [np.asarray(v, np.int64) for v in table.column("seq_lens").to_pylist()]
    out = {k: np.concatenate(v) for k, v in parts.items() if k != "seq_lens"}
    out["seq_lens"] = np.array(parts["seq_lens"] + [None], dtype=object)[:-1]
    return out


def _take_rows(rows: dict[str, np.ndarray], mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in rows.items()}


def load_source(cfg: DataSourceConfig, data: DataConfig, tokenizer_cfg: TokenizerConfig,
                vocab_size: int) -> SFTSource:
    """Read, encode (in `data.num_workers` processes), fit to `seq_len` and split one source: conversations in
    records, conversations tokenized into an indexed dataset with its labels, or rows packed offline. Bad records
    raise (naming file and line or row) unless `data.skip_invalid`, which counts them instead."""
    from maester.data.records import file_format
    from maester.data.text_files import resolve_files
    from maester.data.sources import source_format

    if source_format(cfg) == "indexed":
        from maester.data.sft_indexed import label_prefix_of, read_conversations

        labels = cfg.label_path or label_prefix_of(cfg.path)
        source = SFTSource(cfg, [Path(f"{prefix}.{ext}") for prefix in (cfg.path, labels) for ext in ("idx", "bin")])
        _keep_fitted(source, read_conversations(cfg.path, labels, vocab_size, data.skip_invalid), data)
        return source
    files = resolve_files(cfg)
    source = SFTSource(cfg, files)
    packed = [f for f in files if is_packed_file(f, file_format(f, cfg.format))]
    if packed:
        if len(packed) != len(files):
            raise ValueError(f"data source {cfg.path!r} mixes packed rows ({packed[0]}) with conversations "
                             f"({next(f for f in files if f not in packed)}); use one source for each")
        rows = read_packed(files, data.seq_len, tokenizer_cfg, vocab_size)
        held = _held_out(cfg.display_name(), len(rows["input_ids"]), cfg.validation_fraction)
        source.packed, source.packed_validation = _take_rows(rows, ~held), _take_rows(rows, held)
        source.counts["rows"] = len(rows["input_ids"])
        return source
    _keep_fitted(source, _encoded_records(source, data, tokenizer_cfg), data)
    return source


def _encoded_records(source: SFTSource, data: DataConfig, tokenizer_cfg: TokenizerConfig):
    """(tokens, labels) of each record of a source, or the InvalidRecord it raised (`data.skip_invalid`); the
    reader's own skips are counted at the end."""
    from maester.data.records import RecordReader
    from maester.data.text_files import TEXT_COLUMN_HINT
    from maester.data.worker_pool import chunked, map_in_order

    cfg = source.cfg
    reader = RecordReader(source.files, text_key=cfg.text_column, skip_invalid=data.skip_invalid, fmt=cfg.format,
                          hint=TEXT_COLUMN_HINT, split_on_blank_lines=cfg.split_on_blank_lines)
    records = reader.records(None if data.sft.template == "markers" else data.sft.messages_key)
    args = (tokenizer_cfg, data.sft, cfg.text_column, data.skip_invalid)
    for results in map_in_order(RecordEncoder, args, chunked(records, 256), max(1, data.num_workers)):
        yield from results
    source.counts["skipped"] += sum(reader.skipped.values())


def _keep_fitted(source: SFTSource, encoded, data: DataConfig) -> None:
    """Fit each encoded conversation to `data.seq_len` (`data.sft.overlong`), count what happened, and split off
    the validation part."""
    from maester.data.packing import fit_length
    from maester.data.records import InvalidRecord

    examples = []
    for result in encoded:
        source.counts["read"] += 1
        if isinstance(result, InvalidRecord):
            source.counts["skipped"] += 1
            continue
        fitted = fit_length(result[0], result[1], data.seq_len, data.sft.overlong)
        if fitted is None:
            source.counts["dropped"] += 1
            continue
        source.counts["truncated"] += len(fitted[0]) < len(result[0])
        source.counts["kept"] += 1
        examples.append(fitted)
    cfg = source.cfg
    held = _held_out(cfg.display_name(), len(examples), cfg.validation_fraction)
    source.train = [e for e, h in zip(examples, held) if not h]
    source.validation = [e for e, h in zip(examples, held) if h]
    if not source.train:
        raise ValueError(f"data source {cfg.path!r}: no conversation left to train on "
                         f"({dict(source.counts)}, validation_fraction {cfg.validation_fraction})")


def weighted_indices(n: int, weight: float, key: int) -> np.ndarray:
    """Each of n items floor(weight) times, plus a seeded subset for the fraction: weight 2.5 takes every item
    twice and a random half once more; weight 0.3 takes a random 30%."""
    whole, frac = int(weight), weight - int(weight)
    extra = Permutation(n, key)[np.arange(int(round(frac * n)))] if frac and n else np.zeros(0, np.int64)
    return np.concatenate([np.tile(np.arange(n), whole), np.sort(extra)]).astype(np.int64)


@dataclass
class EpochPlan:
    """The rows of one epoch, in training order: each a bin of conversation ids or a pre-packed row."""

    bins: list[np.ndarray]  # conversation ids into the epoch's example list
    examples: list[tuple[np.ndarray, np.ndarray]]
    packed: list[tuple[int, int]]  # (source, row) of pre-packed rows
    order: np.ndarray  # row i of the epoch is bins[order[i]] if < len(bins), else packed[order[i] - len(bins)]

    def __len__(self) -> int:
        return len(self.order)


class SFTLoader(LoaderBase):
    """Each optimizer step's micro-batches of packed rows for one data-parallel rank."""

    KIND, WHAT, DATA = "sft", "an SFT", "SFT data (sources, template, tokenizer)"

    def __init__(self, data: DataConfig, tokenizer_cfg: TokenizerConfig, tokenizer, *, seed: int, batch: BatchPlan,
                 group=None):
        super().__init__(batch, seed)
        self.data, self.tokenizer, self.group = data, tokenizer, group
        self.pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else tokenizer.eos_id
        self.sources = [load_source(cfg, data, tokenizer_cfg, tokenizer.vocab_size) for cfg in data.sources]
        self._fingerprint = self._compute_fingerprint(tokenizer_cfg)
        self.epoch, self.offset, self.rows_taken = 0, 0, 0
        self._plan: EpochPlan | None = None
        self._plan_epoch = -1
        self.trained = np.zeros((len(self.sources), 2), np.int64)  # this rank: conversations, tokens per source
        for src in self.sources:
            log.info("SFT source %s: %s", src.cfg.display_name(), ", ".join(f"{k} {v}" for k, v in
                                                                         sorted(src.counts.items())))

    def _compute_fingerprint(self, tokenizer_cfg: TokenizerConfig) -> str:
        h = hashlib.sha256()
        h.update(json.dumps([self.data.seq_len, self.data.sft.model_dump(mode="json"),
                             tokenizer_cfg.model_dump(mode="json")]).encode())
        for src in self.sources:
            h.update(json.dumps([source_identity(src.cfg.path), src.cfg.weight, src.cfg.validation_fraction,
                                 src.cfg.text_column, [f.name for f in src.files], sorted(src.counts.items())]
                                + pinned_commits(src.files)).encode())
        return h.hexdigest()[:16]

    # --- the order of rows ---------------------------------------------------------------------------------------

    def plan(self, epoch: int) -> EpochPlan:
        from maester.data.packing import best_fit_decreasing

        if self._plan is not None and self._plan_epoch == epoch:
            return self._plan
        examples, owners, packed = [], [], []
        for p, src in enumerate(self.sources):
            chosen = weighted_indices(src.units, src.cfg.weight, seed_key(self.seed, "sft choice", p, epoch))
            if src.packed is not None:
                packed += [(p, int(i)) for i in chosen]
            else:
                examples += [src.train[i] for i in chosen]
                owners += [p] * len(chosen)
        lengths = np.array([len(t) for t, _ in examples], np.int64)
        key = seed_key(self.seed, "sft packing", epoch)
        bins = best_fit_decreasing(lengths, self.data.seq_len, key) if len(lengths) else []
        total = len(bins) + len(packed)
        if total == 0:
            raise ValueError("the SFT sources hold nothing to train on after weighting")
        order = Permutation(total, seed_key(self.seed, "sft order", epoch))[np.arange(total)]
        self._plan, self._plan_epoch = EpochPlan(bins, examples, packed, order), epoch
        self._owners = np.array(owners, np.int64)
        return self._plan

    def _rows(self, plan: EpochPlan, positions: np.ndarray) -> dict[str, np.ndarray]:
        from maester.data.packing import pack_rows

        seq = self.data.seq_len
        out = {k: np.empty((len(positions), seq), np.int64) for k in PACKED_COLUMNS[:4]}
        out["seq_lens"] = [None] * len(positions)
        picked = plan.order[positions]
        is_bin = picked < len(plan.bins)
        if is_bin.any():
            bins = [plan.bins[i] for i in picked[is_bin]]
            rows = pack_rows(plan.examples, bins, seq, self.pad_id)
            where = np.flatnonzero(is_bin)
            for k in PACKED_COLUMNS[:4]:
                out[k][where] = getattr(rows, k)
            for w, lens, b in zip(where, rows.seq_lens, bins):
                out["seq_lens"][w] = np.asarray(lens, np.int64)
                owners = self._owners[b]
                np.add.at(self.trained, (owners, 0), 1)
                np.add.at(self.trained, (owners, 1), [len(plan.examples[i][0]) for i in b])
        for w in np.flatnonzero(~is_bin):
            p, r = plan.packed[picked[w] - len(plan.bins)]
            rows = self.sources[p].packed
            for k in PACKED_COLUMNS[:4]:
                out[k][w] = rows[k][r]
            out["seq_lens"][w] = rows["seq_lens"][r]
            self.trained[p] += (len(rows["seq_lens"][r]), int(np.sum(rows["seq_lens"][r])))
        return out

    def next_step(self) -> list:
        """This rank's micro-batches of the next step: rows [rank slice] of the next `global_batch` rows."""
        mine_from, mine_to = self.my_rows.start, self.my_rows.stop
        pieces, taken = [], 0
        while taken < self.global_batch:
            plan = self.plan(self.epoch)
            n = min(len(plan) - self.offset, self.global_batch - taken)
            lo, hi = max(mine_from - taken, 0), min(mine_to - taken, n)  # my share of these n rows
            if lo < hi:
                pieces.append(self._rows(plan, self.offset + np.arange(lo, hi)))
            taken += n
            self.offset += n
            if self.offset == len(plan):
                self.epoch, self.offset = self.epoch + 1, 0
        self.rows_taken += self.global_batch
        rows = {k: np.concatenate([p[k] for p in pieces]) for k in PACKED_COLUMNS[:4]}
        seq_lens = [s for p in pieces for s in p["seq_lens"]]
        return [self._batch(rows, seq_lens, i, i + self.micro_batch) for i in range(0, len(self.my_rows), self.micro_batch)]

    def _batch(self, rows: dict, seq_lens: list, lo: int, hi: int):
        t = {k: torch.from_numpy(np.ascontiguousarray(rows[k][lo:hi])) for k in PACKED_COLUMNS[:4]}
        lengths = np.concatenate([np.asarray(s, np.int64) for s in seq_lens[lo:hi]] or [np.zeros(0, np.int64)])
        return Batch(t["input_ids"], t["labels"], t["position_ids"], t["document_ids"],
                     document_lengths=torch.from_numpy(lengths))

    # --- state ---------------------------------------------------------------------------------------------------

    def _trained_everywhere(self) -> np.ndarray:
        """Conversations and tokens trained per source, summed over the data-parallel ranks (collective)."""
        if self.group is None:
            return self.trained.copy()
        import torch.distributed as dist

        t = torch.from_numpy(self.trained.copy())
        dist.all_reduce(t, group=self.group)
        return t.numpy()

    def state_dict(self) -> dict:
        """Rows taken so far (and where that is in the epochs), plus what was trained per source (collective)."""
        return {**self.header(), "epoch": self.epoch, "offset": self.offset, "rows": self.rows_taken,
                "trained": self._trained_everywhere().tolist()}

    def fingerprint(self) -> str:
        return self._fingerprint

    def source_commits(self) -> dict[str, str]:
        return source_commits([src.cfg for src in self.sources], [src.files for src in self.sources])

    def load_state_dict(self, state: dict) -> None:
        self.check_resume(state)
        self.epoch, self.offset, self.rows_taken = state["epoch"], state["offset"], state["rows"]
        self.trained[:] = 0
        if self.dp_rank == 0:  # the totals so far, counted once
            self.trained += np.asarray(state["trained"], np.int64)

    # --- metrics -------------------------------------------------------------------------------------------------

    def source_metrics(self) -> dict[str, dict]:
        """Per source: conversations and tokens trained on (all ranks; collective), and how reading went."""
        trained = self._trained_everywhere()
        epochs = self.epoch + self.offset / max(len(self.plan(self.epoch)), 1)
        out = {}
        for (conversations, tokens), src in zip(trained, self.sources):
            out[src.cfg.display_name()] = {"conversations": int(conversations), "tokens": int(tokens),
                                           "epochs": epochs, **{k: int(v) for k, v in src.counts.items()}}
        return out

    # --- validation ----------------------------------------------------------------------------------------------

    def validation_batches(self, micro_batch: int) -> list:
        """This rank's share of the held-out conversations, packed like training. The rows are padded with empty
        rows (no labels) to a multiple of ranks x micro-batch, so nothing held out is left out."""
        from maester.data.packing import best_fit_decreasing, pack_rows

        examples = [e for src in self.sources for e in src.validation]
        seq = self.data.seq_len
        parts = []
        if examples:
            lengths = np.array([len(t) for t, _ in examples], np.int64)
            bins = best_fit_decreasing(lengths, seq, seed_key(self.seed, "sft validation packing"))
            rows = pack_rows(examples, bins, seq, self.pad_id)
            parts.append({k: getattr(rows, k) for k in PACKED_COLUMNS[:4]} | {"seq_lens": list(rows.seq_lens)})
        for src in self.sources:
            if src.packed_validation is not None and len(src.packed_validation["input_ids"]):
                parts.append({k: src.packed_validation[k] for k in PACKED_COLUMNS[:4]}
                             | {"seq_lens": list(src.packed_validation["seq_lens"])})
        if not parts:
            return []
        rows = {k: np.concatenate([p[k] for p in parts]) for k in PACKED_COLUMNS[:4]}
        seq_lens = [s for p in parts for s in p["seq_lens"]]
        unit = self.dp_size * micro_batch
        pad = -len(seq_lens) % unit
        if pad:
            empty = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, "position_ids": 0, "document_ids": -1}
            for k, v in empty.items():
                rows[k] = np.concatenate([rows[k], np.full((pad, seq), v, np.int64)])
            seq_lens += [np.zeros(0, np.int64)] * pad
        per_rank = len(seq_lens) // self.dp_size
        lo = self.dp_rank * per_rank
        return [self._batch(rows, seq_lens, i, i + micro_batch) for i in range(lo, lo + per_rank, micro_batch)]
