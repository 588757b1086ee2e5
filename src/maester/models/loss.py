"""Token-level cross-entropy of the output layer, summed (the step divides by the label count of the whole step),
computed in chunks of tokens so that the float32 logits of the whole batch never exist.

A (tokens x vocabulary) float32 logits tensor, its log-softmax and their gradients are the largest tensors of a
step with a large vocabulary: 16k tokens x 262k (Gemma 3) is 16 GiB each. Here each chunk's logits are made,
reduced to a loss and freed; backward makes them again, one chunk at a time (activation checkpointing of the
head, as torchtitan's chunked loss and OLMo-core's fused linear loss avoid the full logits).

Under tensor parallel the head is vocabulary-sharded (a DTensor) and each chunk's logits are too: every chunk's
cross-entropy is loss_parallel's, over this rank's V / tp columns, so a rank holds one chunk of its shard.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

CHUNK_ELEMENTS = 2**27
"""Logits per chunk (512 MiB in float32): large enough that the matmuls stay efficient."""

IGNORE_INDEX = -100
"""The label that takes no loss (PyTorch's cross-entropy default, and Hugging Face's)."""


def softcap_logits(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(logits / softcap): logits bounded to (-softcap, softcap) (Gemma 2's final soft-capping)."""
    return softcap * torch.tanh(logits / softcap)


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Sum of the per-token losses in float32; positions labelled IGNORE_INDEX contribute nothing. `softcap`: the
    logits are soft-capped first (in float32)."""
    logits = logits.flatten(0, -2).float()
    if softcap is not None:
        logits = softcap_logits(logits, softcap)
    return F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def chunk_tokens_for(vocab_size: int) -> int:
    """Tokens per chunk: a power of two with at most CHUNK_ELEMENTS logits (at least 1)."""
    return 1 << max(0, (CHUNK_ELEMENTS // max(vocab_size, 1)).bit_length() - 1)


def _head_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None) -> torch.Tensor:
    return cross_entropy_sum(F.linear(h, weight), labels, softcap)


def linear_cross_entropy_sum(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                             chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """`cross_entropy_sum(F.linear(h, weight), labels, softcap)` without the whole logits tensor: `h` (..., dim)
    hidden states, `weight` (vocab, dim), `labels` (...). Chunks of `chunk_tokens` tokens (default:
    `chunk_tokens_for` this rank's rows of `weight`); a batch that fits in one chunk is computed directly.

    A vocabulary-sharded `weight` (a DTensor, Shard(0) over tp: tensor parallel) gives each chunk Shard(-1)
    logits, whose cross-entropy is loss_parallel's (run it under `loss_parallel()`); `h` is made whole on every
    tp rank first (from its sequence shards under sequence parallel), as the output layer's ColwiseParallel did."""
    vocab = weight.shape[0]
    if isinstance(weight, DTensor):
        vocab = weight.to_local().shape[0]
        if not isinstance(h, DTensor):
            h = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
        elif not all(p.is_replicate() for p in h.placements):
            h = h.redistribute(h.device_mesh, [Replicate()] * h.device_mesh.ndim)
    h, labels = h.flatten(0, -2), labels.flatten()
    chunk = chunk_tokens or chunk_tokens_for(vocab)
    if h.shape[0] <= chunk:
        return _head_loss(h, weight, labels, softcap)
    if not torch.is_grad_enabled():
        return sum(_head_loss(hc, weight, lc, softcap) for hc, lc in zip(h.split(chunk), labels.split(chunk)))
    total = None
    for hc, lc in zip(h.split(chunk), labels.split(chunk)):
        part = checkpoint(_head_loss, hc, weight, lc, softcap, use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total
