"""From documents to batches: a token stream cut into windows, read in a seeded global order.

The order of samples is a pure function of (seed, epoch, position): epoch `e` visits every window once, in
the permutation drawn from `(seed, e)`. The loader's whole state is one counter, the number of samples the
run has consumed over all data-parallel ranks, so a run resumes exactly, also on a different number of ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import numpy as np
import torch

from maester.config import DataConfig
from maester.data.text_files import read_documents, resolve_files
from maester.data.tokenizers import Tokenizer

IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch, in Hugging Face names. `document_ids` is None when attention spans the whole row."""

    input_ids: torch.Tensor  # (batch, seq) int64
    labels: torch.Tensor  # (batch, seq) int64, IGNORE_INDEX where no loss is taken
    position_ids: torch.Tensor  # (batch, seq) int64
    document_ids: torch.Tensor | None = None  # (batch, seq) int64, -1 on padding

    def to(self, device: torch.device) -> "Batch":
        return Batch(**{f.name: None if getattr(self, f.name) is None else
                        getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def tokenize_documents(cfg: DataConfig, tokenizer: Tokenizer, batch_docs: int = 1024) -> np.ndarray:
    """All documents of all sources as one token stream: [BOS] doc EOS [BOS] doc EOS ..."""
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    pieces: list[np.ndarray] = []
    prefix = [tokenizer.bos_id] if cfg.add_bos else []
    if cfg.add_bos and tokenizer.bos_id is None:
        raise ValueError("data.add_bos is set but the tokenizer has no BOS token")
    for source in cfg.sources:
        for path in resolve_files(source):
            docs: list[str] = []
            for text in read_documents(path, source):
                docs.append(text)
                if len(docs) == batch_docs:
                    pieces += _encode(tokenizer, docs, prefix, dtype)
                    docs = []
            pieces += _encode(tokenizer, docs, prefix, dtype)
    if not pieces:
        raise ValueError("the data sources hold no documents")
    return np.concatenate(pieces)


def _encode(tokenizer: Tokenizer, docs: list[str], prefix: list[int], dtype) -> list[np.ndarray]:
    return [np.array(prefix + ids + [tokenizer.eos_id], dtype=dtype) for ids in tokenizer.encode_batch(docs)]


class TokenWindows:
    """A token stream as windows of `seq_len + 1` tokens with stride `seq_len`: every token is a label once."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"the data holds {len(tokens)} tokens, fewer than one sequence of "
                             f"data.seq_len + 1 = {seq_len + 1}")
        self.tokens, self.seq_len = tokens, seq_len
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def fingerprint(self) -> str:
        """Identifies the token stream, so a resume on different data fails instead of silently drifting."""
        if self._fingerprint is None:
            h = hashlib.sha256(f"{len(self.tokens)}:{self.seq_len}:{self.tokens.dtype}:".encode())
            h.update(memoryview(np.ascontiguousarray(self.tokens)).cast("B"))
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint


class WindowLoader:
    """Yields each optimizer step's micro-batches for one data-parallel rank."""

    def __init__(self, windows: TokenWindows, *, seed: int, global_batch: int, micro_batch: int,
                 eos_id: int, document_masking: bool = False, dp_rank: int = 0, dp_size: int = 1):
        if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
            raise ValueError(f"global batch of {global_batch} sequences does not split into {dp_size} ranks "
                             f"x micro-batches of {micro_batch}")
        self.windows, self.seed = windows, seed
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.eos_id, self.document_masking = eos_id, document_masking
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.samples_consumed = 0
        self._epoch_order: tuple[int, np.ndarray] | None = None

    @property
    def accumulation_steps(self) -> int:
        return self.global_batch // self.dp_size // self.micro_batch

    @property
    def epoch(self) -> int:
        return self.samples_consumed // len(self.windows)

    def _order(self, epoch: int) -> np.ndarray:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._epoch_order = (epoch, rng.permutation(len(self.windows)))
        return self._epoch_order[1]

    def _sample(self, k: int) -> np.ndarray:
        n = len(self.windows)
        return self.windows[int(self._order(k // n)[k % n])]

    def next_step(self) -> list[Batch]:
        per_rank = self.global_batch // self.dp_size
        first = self.samples_consumed + self.dp_rank * per_rank
        rows = np.stack([self._sample(first + j) for j in range(per_rank)]).astype(np.int64)
        self.samples_consumed += self.global_batch
        return [self._batch(rows[i:i + self.micro_batch]) for i in range(0, per_rank, self.micro_batch)]

    def _batch(self, rows: np.ndarray) -> Batch:
        tokens = torch.from_numpy(rows)
        inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        seq = inputs.shape[1]
        if not self.document_masking:
            return Batch(inputs, labels, torch.arange(seq).expand_as(inputs).contiguous())
        document_ids, position_ids = documents_from_eos(inputs, self.eos_id)
        return Batch(inputs, labels, position_ids, document_ids)

    def state_dict(self) -> dict:
        return {"samples_consumed": self.samples_consumed, "fingerprint": self.windows.fingerprint(),
                "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["fingerprint"] != self.windows.fingerprint() or state["seed"] != self.seed:
            raise ValueError("the checkpoint's data position belongs to different data or another seed "
                             f"(checkpoint fingerprint {state['fingerprint']}, seed {state['seed']}; now "
                             f"{self.windows.fingerprint()}, seed {self.seed}); refusing to resume on it")
        self.samples_consumed = int(state["samples_consumed"])


def documents_from_eos(inputs: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids (a new document starts after each EOS) and positions restarting at each document."""
    is_eos = (inputs == eos_id).long()
    document_ids = torch.cumsum(is_eos, dim=1) - is_eos  # the EOS belongs to the document it ends
    seq = inputs.shape[1]
    idx = torch.arange(seq).expand_as(inputs)
    starts = torch.where(torch.nn.functional.pad(is_eos[:, :-1], (1, 0)).bool(), idx, torch.zeros_like(idx))
    position_ids = idx - torch.cummax(starts, dim=1).values
    return document_ids, position_ids


def build_loader(cfg: DataConfig, tokenizer: Tokenizer, *, seed: int, global_batch: int, micro_batch: int,
                 dp_rank: int = 0, dp_size: int = 1) -> WindowLoader:
    windows = TokenWindows(tokenize_documents(cfg, tokenizer), cfg.seq_len)
    return WindowLoader(windows, seed=seed, global_batch=global_batch, micro_batch=micro_batch,
                        eos_id=tokenizer.eos_id, document_masking=cfg.document_masking,
                        dp_rank=dp_rank, dp_size=dp_size)
