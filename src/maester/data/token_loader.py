"""Loader for pre-tokenized corpora: Megatron / GPT-NeoX indexed datasets, llm.c shards, nanoGPT bins.

Each source is cut into `seq_len + 1` windows with stride `seq_len` (never across two files). Global sample g
goes to the source whose slice of [0, 1) holds the golden-ratio point frac(g * phi), so every prefix of the
stream follows the weights closely; a source's k-th sample is window perm_e(k mod n) of its training windows,
with e = k div n its epoch and perm_e a seeded permutation evaluated in O(1) memory. Every rank computes the
same global step and takes its slice: the state is the sample counter and one counter per source.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from maester.config import DataConfig, DataSourceConfig
from maester.data.batch import BatchPlan, make_batch
from maester.data.loader_base import LoaderBase
from maester.data.indexed import IndexedDataset, read_llmc_shard, read_nanogpt_bin
from maester.data.permutation import Permutation, seed_key
from maester.data.sources import shard_files, source_format  # noqa: F401 (source_format: what importers use)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / phi
OPEN_SCAN_TOKENS = 1 << 28  # files up to this many tokens are checked whole at open (about 0.3 s per GB)


def _fingerprint_file(path: Path, h) -> None:
    size = path.stat().st_size
    h.update(f"{path.name}:{size}:".encode())
    with open(path, "rb") as f:  # the ends of the file: cheap on terabytes, and catches a rewrite
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))


class TokenSource:
    """One pre-tokenized source as windows; the last `validation_fraction` of them is held out."""

    def __init__(self, cfg: DataSourceConfig, seq_len: int, vocab_size: int):
        self.cfg, self.seq_len, self.format = cfg, seq_len, source_format(cfg)
        self.vocab_size = vocab_size
        self.indexed: IndexedDataset | None = None
        if self.format == "indexed":
            self.indexed = IndexedDataset(cfg.path)
            self.files = [self.indexed.idx_path, self.indexed.bin_path]
            self.pieces = [self.indexed.tokens()]
        else:
            read = read_llmc_shard if self.format == "llmc" else read_nanogpt_bin
            self.files = shard_files(cfg)
            self.pieces = [read(m) for m in self.files]
        self.token_files = [self.indexed.bin_path] if self.indexed is not None else self.files
        for j, piece in enumerate(self.pieces):  # files up to 2^28 tokens now; larger ones window by window
            if len(piece) <= OPEN_SCAN_TOKENS:
                for start in range(0, len(piece), 1 << 24):
                    self._check_ids(np.asarray(piece[start:start + (1 << 24)]), j, start)
        counts = [max(0, (len(p) - 1) // seq_len) for p in self.pieces]
        self.ends = np.cumsum(counts)
        total = int(self.ends[-1]) if len(counts) else 0
        held = int(np.ceil(total * cfg.validation_fraction))
        self.num_train = total - held
        self.num_windows = total
        if self.num_train < 1:
            raise ValueError(f"data source {cfg.path!r} holds {total} window(s) of data.seq_len + 1 = {seq_len + 1} "
                             f"tokens{f', {held} held out for validation' if held else ''}: nothing to train on")

    def window(self, w: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Window w's tokens and, for indexed data, the document (sequence) index of each token."""
        j = int(np.searchsorted(self.ends, w, side="right"))
        i = w - (int(self.ends[j - 1]) if j else 0)
        start = i * self.seq_len
        tokens = np.asarray(self.pieces[j][start:start + self.seq_len + 1], dtype=np.int64)
        self._check_ids(tokens, j, start)
        if self.indexed is None:
            return tokens, None
        item = self.indexed.dtype.itemsize
        offsets = np.arange(start, start + self.seq_len + 1, dtype=np.int64) * item
        return tokens, np.searchsorted(self.indexed.pointers, offsets, side="right") - 1

    def _check_ids(self, tokens: np.ndarray, j: int, start: int) -> None:
        """Every id of `tokens` (piece j from token `start`) is in the vocabulary: checked on the host, where a bad
        id is an error naming the file, not an index error in the embedding (a device-side assert on a GPU)."""
        if tokens.size and (int(tokens.max()) >= self.vocab_size or int(tokens.min()) < 0):
            at = int(np.flatnonzero((tokens >= self.vocab_size) | (tokens < 0))[0])
            raise ValueError(f"data source {self.cfg.path!r}: {self.token_files[j]}: token id {int(tokens[at])} at token "
                             f"{start + at:,} is outside the tokenizer's vocabulary of {self.vocab_size} ids: the "
                             f"data was tokenized with another tokenizer, or the file is damaged")

    def fingerprint(self, h) -> None:
        h.update(json.dumps([self.cfg.path, self.format, self.cfg.weight, self.cfg.validation_fraction]).encode())
        for f in self.files:
            _fingerprint_file(Path(f), h)


class TokenLoader(LoaderBase):
    """Each optimizer step's micro-batches for one data-parallel rank, from pre-tokenized sources."""

    KIND, WHAT = "tokens", "a pre-tokenized"

    def __init__(self, cfg: DataConfig, tokenizer, *, seed: int, batch: BatchPlan):
        super().__init__(batch, seed)
        self.data, self.tokenizer = cfg, tokenizer
        self.sources = [TokenSource(s, cfg.seq_len, tokenizer.vocab_size) for s in cfg.sources]
        weights = np.array([s.weight for s in cfg.sources], dtype=np.float64)
        self.bounds = np.cumsum(weights / weights.sum())[:-1]
        self.samples = 0
        self.counts = np.zeros(len(self.sources), dtype=np.int64)
        self._fingerprint: str | None = None
        self._perms: dict[int, tuple[int, Permutation]] = {}  # source -> (epoch, its permutation)

    def sources_of(self, first: int, n: int) -> np.ndarray:
        """The source of global samples first .. first + n - 1: where frac(g * phi) falls among the weights."""
        g = np.arange(first + 1, first + n + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            u = (g * _GOLDEN).astype(np.float64) / 2.0 ** 64
        return np.searchsorted(self.bounds, u, side="right")

    def _windows(self, p: int, ks: np.ndarray) -> np.ndarray:
        """Source p's window index of each of its sample numbers ks (one permutation per epoch)."""
        n = self.sources[p].num_train
        out = np.empty(len(ks), dtype=np.int64)
        for epoch in np.unique(ks // n):
            where = ks // n == epoch
            cached = self._perms.get(p)
            if cached is None or cached[0] != epoch:
                key = seed_key(self.seed, "source order", p, int(epoch))
                cached = self._perms[p] = (int(epoch), Permutation(n, key))
            out[where] = cached[1][ks[where] % n]
        return out

    def next_step(self) -> list:
        src = self.sources_of(self.samples, self.global_batch)
        k = np.empty(self.global_batch, dtype=np.int64)
        for p in range(len(self.sources)):
            where = np.flatnonzero(src == p)
            k[where] = self.counts[p] + np.arange(len(where))
            self.counts[p] += len(where)
        self.samples += self.global_batch
        mine = slice(self.my_rows.start, self.my_rows.stop)
        src, k = src[mine], k[mine]
        windows = np.empty(len(src), dtype=np.int64)
        for p in np.unique(src):
            windows[src == p] = self._windows(int(p), k[src == p])
        taken = [self.sources[p].window(w) for p, w in zip(src.tolist(), windows.tolist())]
        return self._batches([t for t, _ in taken], [d for _, d in taken], self.micro_batch)

    def _batches(self, tokens: list, docs: list, micro_batch: int) -> list:
        rows = torch.from_numpy(np.stack(tokens)) if tokens else torch.zeros(0, self.data.seq_len + 1, dtype=torch.long)
        doc_ids = torch.from_numpy(np.stack(docs)) if docs and docs[0] is not None else None
        eos = self.tokenizer.eos_id
        return [make_batch(rows[i:i + micro_batch], self.data.document_masking, eos,
                           None if doc_ids is None else doc_ids[i:i + micro_batch])
                for i in range(0, len(rows), micro_batch)]

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            h = hashlib.sha256(f"{self.data.seq_len}:".encode())
            for s in self.sources:
                s.fingerprint(h)
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict:
        return {**self.header(), "samples": self.samples, "counts": self.counts.tolist()}

    def load_state_dict(self, state: dict) -> None:
        self.check_resume(state)
        self.samples = int(state["samples"])
        self.counts = np.array(state["counts"], dtype=np.int64)

    def source_metrics(self) -> dict[str, dict]:
        """Tokens and epochs per source over the whole run (every rank computes the same numbers)."""
        return {cfg.display_name(): {"tokens": int(c) * self.data.seq_len, "epochs": int(c) / s.num_train}
                for cfg, s, c in zip(self.data.sources, self.sources, self.counts)}

    def validation_batches(self, micro_batch: int) -> list:
        """This rank's share of the held-out windows of every source (the same number on every rank)."""
        taken = [s.window(w) for s in self.sources for w in range(s.num_train, s.num_windows)]
        per_rank = len(taken) // self.dp_size
        mine = taken[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        return self._batches([t for t, _ in mine], [d for _, d in mine], micro_batch)
