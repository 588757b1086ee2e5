"""The micro-batch every loader yields (`Batch`, in Hugging Face names), how windows of tokens become one
(`make_batch`), and how a global batch splits over ranks and micro-batches (`BatchPlan`). The bottom of `data/`: it
imports nothing of `data/`, only the loss's IGNORE_INDEX and the models' document offsets."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from maester.models.loss import IGNORE_INDEX  # noqa: F401 (the label that takes no loss, for data/)


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
    cu_seqlens); made here on the host from `document_ids`, so the device never waits to count documents, and kept
    there by `to` (pinned for a GPU): the varlen mask copies them over without waiting, and a pipeline schedule
    hands each stage its micro-batch's from the host (`layers.pack_offsets`)."""

    def __post_init__(self):
        if self.document_offsets is None and self.document_ids is not None and not self.document_ids.is_cuda:
            from maester.models.layers import document_offsets  # on the host: no device to wait for

            self.document_offsets = document_offsets(self.document_ids, *self.document_ids.shape,
                                                     self.document_ids.device)

    def to(self, device: torch.device) -> "Batch":
        """On `device`; to a GPU through pinned memory, without waiting for the copy."""
        def move(t, stay_on_host: bool = False):
            if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()
            return t if stay_on_host and t.device.type == "cpu" else t.to(device, non_blocking=True)

        return Batch(**{f.name: None if getattr(self, f.name) is None else
                        move(getattr(self, f.name), f.name == "document_offsets") for f in fields(self)})

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


@dataclass(frozen=True)
class BatchPlan:
    """How a step's global batch of sequences splits: over `dp_size` data-parallel ranks (this one is `dp_rank`),
    each running `accumulation_steps` micro-batches of `micro_batch` sequences. Checked once, when made
    (`ParallelDims.batch_plan` makes the run's); every loader takes it as it is."""

    global_batch: int
    micro_batch: int
    dp_size: int = 1
    dp_rank: int = 0

    def __post_init__(self):
        if min(self.global_batch, self.micro_batch, self.dp_size) < 1 or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"a batch plan needs positive sizes and a rank below dp_size, got {self}")
        if self.global_batch % (self.micro_batch * self.dp_size):
            raise ValueError(f"global batch of {self.global_batch} sequences does not split into {self.dp_size} "
                             f"data-parallel rank(s) x micro-batches of {self.micro_batch}: make "
                             f"training.global_batch_size a multiple of {self.micro_batch * self.dp_size} sequences")

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def accumulation_steps(self) -> int:
        return self.per_rank // self.micro_batch


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
