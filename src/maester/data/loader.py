"""From data sources to batches: the choice of loader for a config (the Batch they yield is in `data/batch.py`).

Raw text (Parquet, JSONL) is tokenized on the fly by `text_loader.TextLoader`; conversations are encoded and
packed by `sft_loader.SFTLoader`; pre-tokenized corpora (Megatron /
GPT-NeoX indexed datasets, llm.c shards, nanoGPT bins) are read by `token_loader.TokenLoader`. All order their
samples by a pure function of (seed, epoch, position), keep only counters as state, and resume exactly, also on
another number of data-parallel ranks.
"""

from __future__ import annotations

from typing import Protocol

import torch

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.batch import Batch, BatchPlan, make_batch
from maester.data.sft_loader import SFTLoader
from maester.data.records import InvalidDocument
from maester.data.text_files import TextSource
from maester.data.text_loader import TextLoader
from maester.data.sources import PRETOKENIZED, source_format
from maester.data.token_loader import TokenLoader, TokenSource


class Loader(Protocol):
    """What the trainer uses of a loader; `TextLoader`, `TokenLoader` and `SFTLoader` each provide it."""

    batch: BatchPlan

    def next_step(self) -> list[Batch]:
        """This rank's `batch.accumulation_steps` micro-batches of the next step, on the host."""

    def state_dict(self) -> dict:
        """Counters only: where the next step starts (checkpointed with the model)."""

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` left off; refuses a state of other data or another split."""

    def source_metrics(self) -> dict[str, dict]:
        """Per source, over all ranks (a collective): what the run has taken so far."""

    def validation_batches(self, micro_batch: int) -> list[Batch]:
        """This rank's share of the held-out split of the training sources."""

    def close(self) -> None:
        """End the worker processes, if any."""


def is_pretokenized(cfg: DataConfig) -> bool:
    kinds = {source_format(s) in PRETOKENIZED for s in cfg.sources}
    if len(kinds) > 1:
        raise ValueError("data.sources mixes raw text and pre-tokenized data; use one kind per job")
    return kinds.pop()


def build_loader(cfg: DataConfig, tokenizer_cfg: TokenizerConfig, tokenizer, *, seed: int, batch: BatchPlan,
                 group=None) -> Loader:
    kw = dict(seed=seed, batch=batch)
    if cfg.mode == "sft":
        return SFTLoader(cfg, tokenizer_cfg, tokenizer, group=group, **kw)
    if is_pretokenized(cfg):
        return TokenLoader(cfg, tokenizer, **kw)
    return TextLoader(cfg, tokenizer_cfg, tokenizer, group=group, **kw)


def validation_source_batches(source: DataSourceConfig, data: DataConfig, tokenizer, micro_batch: int,
                              dp_rank: int = 0, dp_size: int = 1) -> list[Batch]:
    """This rank's equal share of every window of the held-out source `source` (one of `data.validation`), cut
    like training data: raw text joined into one stream (BOS if `data.add_bos`, EOS after each document),
    pre-tokenized data as its windows."""
    import numpy as np

    seq = data.seq_len
    if source_format(source) in PRETOKENIZED:
        held = TokenSource(source, seq, tokenizer.vocab_size)
        windows = [held.window(w) for w in range(held.num_windows)]
    else:
        prefix, eos = [tokenizer.bos_id] if data.add_bos else [], [tokenizer.eos_id]
        texts = []
        for doc in TextSource(source, data.chunk_documents).documents():
            if isinstance(doc, InvalidDocument):
                if not data.skip_invalid:
                    raise doc
                continue
            texts.append(doc)
        stream = np.array([p for ids in tokenizer.encode_batch(texts) for p in prefix + ids + eos], np.int64)
        n = (len(stream) - 1) // seq
        windows = [(stream[w * seq:w * seq + seq + 1], None) for w in range(n)]
    per_rank = len(windows) // dp_size
    if per_rank == 0:
        raise ValueError(f"data.validation source {source.path!r} holds {len(windows)} window(s) of data.seq_len + 1 "
                         f"= {seq + 1} tokens: too few for {dp_size} data-parallel rank(s)")
    mine = windows[dp_rank * per_rank:(dp_rank + 1) * per_rank]
    rows = torch.from_numpy(np.stack([t for t, _ in mine]))
    docs = torch.from_numpy(np.stack([d for _, d in mine])) if mine[0][1] is not None else None
    return [make_batch(rows[i:i + micro_batch], data.document_masking, tokenizer.eos_id,
                       None if docs is None else docs[i:i + micro_batch]) for i in range(0, len(rows), micro_batch)]
