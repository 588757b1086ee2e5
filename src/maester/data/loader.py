"""From data sources to batches: the Batch every loader yields, and the choice of loader for a config.

Raw text (Parquet, JSONL) is tokenized on the fly by `text_stream.TextLoader`; conversations are encoded and
packed by `sft.SFTLoader`; pre-tokenized corpora (Megatron /
GPT-NeoX indexed datasets, llm.c shards, nanoGPT bins) are read by `token_stream.TokenLoader`. Both order their
samples by a pure function of (seed, epoch, position), keep only counters as state, and resume exactly, also on
another number of data-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from maester.config import DataConfig, DataSourceConfig, TokenizerConfig
from maester.data.packing import IGNORE_INDEX  # noqa: F401 (re-exported: the label that takes no loss)

PRETOKENIZED = ("indexed", "llmc", "nanogpt")


@dataclass
class Batch:
    """One micro-batch, in Hugging Face names. `document_ids` is None when attention spans the whole row."""

    input_ids: torch.Tensor  # (batch, seq) int64
    labels: torch.Tensor  # (batch, seq) int64, IGNORE_INDEX where no loss is taken
    position_ids: torch.Tensor  # (batch, seq) int64
    document_ids: torch.Tensor | None = None  # (batch, seq) int64, -1 on padding
    document_lengths: torch.Tensor | None = None  # (documents,) int64: lengths of the packed documents (SFT)
    document_offsets: torch.Tensor | None = None
    """(documents + 1,) int32: where each document starts in the flattened batch, then its size (varlen's
    cu_seqlens); made here on the host from `document_ids`, so the device never waits to count documents."""

    def __post_init__(self):
        if self.document_offsets is None and self.document_ids is not None and not self.document_ids.is_cuda:
            from maester.models.layers import document_offsets  # on the host: no device to wait for

            self.document_offsets = document_offsets(self.document_ids, *self.document_ids.shape,
                                                     self.document_ids.device)

    def to(self, device: torch.device) -> "Batch":
        """On `device`; to a GPU through pinned memory, without waiting for the copy."""
        def move(t):
            if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        return Batch(**{f.name: None if getattr(self, f.name) is None else move(getattr(self, f.name))
                        for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def check_batch_split(global_batch: int, micro_batch: int, dp_size: int) -> None:
    if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
        raise ValueError(f"global batch of {global_batch} sequences does not split into {dp_size} ranks "
                         f"x micro-batches of {micro_batch}")


def make_batch(rows: torch.Tensor, document_masking: bool, eos_id: int | None,
               document_ids: torch.Tensor | None = None) -> Batch:
    """Windows of seq_len + 1 tokens as inputs and next-token labels. With document masking, documents end at
    each EOS, or where `document_ids` (aligned with the windows) changes."""
    inputs, labels = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    seq = inputs.shape[1]
    if not document_masking:
        return Batch(inputs, labels, torch.arange(seq).expand_as(inputs).contiguous())
    if document_ids is None:
        document_ids, position_ids = documents_from_eos(inputs, eos_id)
    else:
        document_ids = document_ids[:, :-1] - document_ids[:, :1]
        position_ids = positions_in_documents(document_ids)
    return Batch(inputs, labels, position_ids, document_ids)


def documents_from_eos(inputs: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids (a new document starts after each EOS) and positions restarting at each document."""
    is_eos = (inputs == eos_id).long()
    document_ids = torch.cumsum(is_eos, dim=1) - is_eos  # the EOS belongs to the document it ends
    return document_ids, positions_in_documents(document_ids)


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Positions counting from 0 at the start of each run of equal document ids."""
    seq = document_ids.shape[1]
    idx = torch.arange(seq).expand_as(document_ids)
    new = torch.ones_like(document_ids, dtype=torch.bool)
    new[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    starts = torch.where(new, idx, torch.zeros_like(idx))
    return idx - torch.cummax(starts, dim=1).values


def is_pretokenized(cfg: DataConfig) -> bool:
    from maester.data.token_stream import source_format

    kinds = {source_format(s) in PRETOKENIZED for s in cfg.sources}
    if len(kinds) > 1:
        raise ValueError("data.sources mixes raw text and pre-tokenized data; use one kind per job")
    return kinds.pop()


def build_loader(cfg: DataConfig, tokenizer_cfg: TokenizerConfig, tokenizer, *, seed: int, global_batch: int,
                 micro_batch: int, dp_rank: int = 0, dp_size: int = 1, group=None):
    kw = dict(seed=seed, global_batch=global_batch, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size)
    if cfg.mode == "sft":
        from maester.data.sft import SFTLoader

        return SFTLoader(cfg, tokenizer_cfg, tokenizer, group=group, **kw)
    if is_pretokenized(cfg):
        from maester.data.token_stream import TokenLoader

        return TokenLoader(cfg, tokenizer, **kw)
    from maester.data.text_stream import TextLoader

    return TextLoader(cfg, tokenizer_cfg, tokenizer, group=group, **kw)


def validation_source_batches(source: DataSourceConfig, data: DataConfig, tokenizer, micro_batch: int,
                              dp_rank: int = 0, dp_size: int = 1) -> list[Batch]:
    """This rank's equal share of every window of the held-out source `source` (one of `data.validation`), cut
    like training data: raw text joined into one stream (BOS if `data.add_bos`, EOS after each document),
    pre-tokenized data as its windows."""
    import numpy as np

    seq = data.seq_len
    from maester.data.token_stream import TokenSource, source_format

    if source_format(source) in PRETOKENIZED:
        held = TokenSource(source, seq, tokenizer.vocab_size)
        windows = [held.window(w) for w in range(held.num_windows)]
    else:
        from maester.data.text_files import InvalidDocument, TextSource

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
