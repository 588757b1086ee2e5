"""Building blocks shared by every architecture: norms, rotary embeddings, attention, MLPs.

Conventions follow Hugging Face `transformers` (rotate-half RoPE, `weight * normalized` RMSNorm) so that
checkpoints map onto these modules without permuting weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import sdpa_kernel


class RMSNorm(nn.Module):
    """x / rms(x) scaled by `weight` (Llama), or by `1 + weight` when `offset` (Gemma: the weight starts at 0
    and the product is taken in float32 before rounding back, as Hugging Face does)."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if not self.offset and dtype == self.weight.dtype == torch.float32 and not isinstance(x, DTensor) \
                and not isinstance(self.weight, DTensor):
            # torch's fused kernel: the same float32 result as below, in one pass over x. Not for DTensors (tensor
            # parallel): sharding propagation refuses its in-place add on a norm across sharded heads (OLMo 2).
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


def build_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """`rms`, `rms_offset` or `layer` (LayerNorm with a bias)."""
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    return RMSNorm(dim, eps, offset=kind == "rms_offset")


def rope_inverse_frequencies(head_dim: int, theta: float, scaling=None) -> torch.Tensor:
    """Inverse frequencies of RoPE over `head_dim` dims, scaled as `scaling` says (see `args.RopeScaling`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Maps position ids (batch, seq) to the cos/sin tables (batch, seq, rotary_dim / 2) used by every layer: the
    two halves of a head's rotary dims share their angles, so one half is kept. `rotary_dim` is the head's
    leading dims that rotate (all of them but in GPT-NeoX). The tables of the default positions 0..seq-1 are
    kept between forwards (batch 1, broadcast), so a training step computes none."""

    def __init__(self, rotary_dim: int, theta: float, scaling=None):
        super().__init__()
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2), persistent=False)
        self._kept: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_inverse_frequencies(self.rotary_dim, self.theta, self.scaling))

    def tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def forward(self, position_ids: torch.Tensor | None, dtype: torch.dtype, seq: int = 0,
                device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables of `position_ids`; None: of positions 0..seq-1 on `device`, kept for the next call (until
        the frequencies change: a new device, `reset_parameters`)."""
        if position_ids is not None:
            return self.tables(position_ids, dtype)
        key = (seq, device, dtype, self.inv_freq.data_ptr(), self.inv_freq._version)
        if self._kept is None or self._kept[0] != key:
            self._kept = (key, self.tables(torch.arange(seq, device=device)[None], dtype))
        return self._kept[1]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (batch or 1, seq, rotary_dim / 2), the angles of both halves
    (Hugging Face's rotate-half convention). Dims past rotary_dim pass through."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    # x * cos + rotate_half(x) * sin, by halves: the same numbers without the negated copy of x.
    parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half != x.shape[-1]:
        parts.append(x[..., 2 * half:])
    # Keep x's dtype: under autocast the tables are float32 while q and k are bfloat16, and the fused kernels
    # (varlen, flex) take q, k and v in one dtype. SDPA under autocast would round to bfloat16 all the same.
    return torch.cat(parts, dim=-1).to(x.dtype)


def causal_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """(q, k) boolean mask from absolute positions: causal, and within the last `window` tokens (itself
    included) when a window is given."""
    diff = q_pos[:, None] - k_pos[None, :]
    return (diff >= 0) if window is None else (diff >= 0) & (diff < window)


def document_causal_mask(document_ids: torch.Tensor | None, seq: int, device: torch.device,
                         window: int | None = None, split: "ContextSplit | None" = None) -> torch.Tensor:
    """(batch, 1, seq, seq) boolean mask: causal, within one document of `document_ids` (batch, seq) when
    given, and within the sliding `window` when given. With `split` (context parallel): (batch, 1, seq, keys)
    for this rank's `seq` queries over every rank's keys."""
    pos = torch.arange(seq, device=device)
    q_pos, k_pos = (pos, pos) if split is None else (split.query_positions, split.key_positions)
    mask = causal_window_mask(q_pos, k_pos, window)[None]
    if document_ids is not None:
        keys = document_ids if split is None else split.key_document_ids
        mask = mask & (document_ids[:, :, None] == keys[:, None, :])
    return mask.unsqueeze(1)


@dataclass(frozen=True)
class ContextSplit:
    """A forward's share of each sequence under context parallel (`maester.parallel.context_parallel`): the
    indices in the sequence of this rank's queries and of the keys they attend to (every rank's, in the order
    `gather_kv` returns them), the keys' document ids (None without documents), and `gather_kv`, which maps this
    rank's keys and values to every rank's."""

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    key_document_ids: torch.Tensor | None
    gather_kv: Any


# ---------------------------------------------------------------- attention backends

ATTENTION_BACKENDS = ("auto", "sdpa", "flex", "varlen")
_FLEX: dict[str, Any] = {}

@functools.cache
def _varlen() -> tuple[Any, bool]:
    """(varlen_attn, whether it takes grouped-query heads as they are), (None, False) where torch has none.
    Imported on first use: the module loads torch._dynamo, most of a second that a run without it never needs."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    # Newer torch takes grouped-query heads as they are (enable_gqa); older gets them repeated by `attend`.
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def _flex(device: torch.device) -> tuple[Any, Any]:
    """(flex_attention, create_block_mask) for `device`. On CUDA both are compiled, once per process and on
    first use (eager flex attention materialises every score; compiling at import would cost each process the
    seconds Inductor takes to load). On CPU, where flex runs forward only, both stay eager: in torch 2.15 the
    compiled CPU kernel gets the last sequence of a batch wrong (even NaN) when seq is not a multiple of its
    128-token blocks."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        _FLEX.update(cuda=(torch.compile(flex_attention), torch.compile(create_block_mask)),
                     eager=(flex_attention, create_block_mask))
    return _FLEX["cuda" if device.type == "cuda" else "eager"]


def resolve_attention(choice: str, device: torch.device, has_documents: bool, window: int | None = None,
                      seq: int | None = None, softcap: bool = False) -> str:
    """The backend a forward uses. `auto`: `flex` on CUDA whenever a mask is needed, i.e. with document ids or a
    sliding window shorter than the sequence (the dense mask of `sdpa` costs batch x seq^2 memory there, and with
    grouped-query heads it sends SDPA to its math kernel), else `sdpa`.

    With `softcap` (attention scores soft-capped, which no SDPA kernel does): `auto` gives `flex` on CUDA and
    `eager` (the same attention in plain torch ops, with a dense mask) elsewhere, `sdpa` gives `eager`, and
    `varlen` is an error."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {choice!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if softcap:
        if choice == "varlen":
            raise ValueError("model.attention = 'varlen' cannot soft-cap attention scores (the model sets "
                             "attn_logit_softcap): use 'auto' or 'flex'")
        if choice == "auto":
            return "flex" if device.type == "cuda" else "eager"
        return "eager" if choice == "sdpa" else choice
    if choice == "auto":
        masked = has_documents or (window is not None and (seq is None or window < seq))
        return "flex" if device.type == "cuda" and masked else "sdpa"
    return choice


@functools.cache
def sdpa_priority(device: torch.device) -> list | None:
    """SDPA backends in order of preference where torch's default order is not the best: on NVIDIA Hopper
    (SM90), cuDNN, then Flash, then memory-efficient, then math (torchtitan pins cuDNN first there); None: torch's
    default (CPU, ROCm, other GPUs)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return None
    if torch.cuda.get_device_capability(device) != (9, 0):
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]


@dataclass(frozen=True)
class AttentionMask:
    """Where each token may attend, built once per forward by `attention_mask` and shared by every layer.

    Exactly one of the payloads is set for the backend: `dense` (sdpa or eager with documents or a window; None:
    plain causal), `block_mask` (flex), `cu_seqlens` and `max_len` (varlen, which applies `window` itself).
    """

    backend: str
    window: int | None = None
    dense: torch.Tensor | None = None
    block_mask: Any = None  # torch.nn.attention.flex_attention.BlockMask
    cu_seqlens: torch.Tensor | None = None  # (documents + 1,) int32 offsets into the flattened batch
    max_len: int = 0
    cast_dtype: torch.dtype | None = None  # the autocast dtype q, k and v are cast to; None: no autocast
    sdpa_backends: tuple | None = None  # SDPA's backend order (`sdpa_priority`); None: torch's default
    gather_kv: Any = None  # context parallel: (k, v) -> every cp rank's k and v (`ContextSplit`); None: local


def attention_mask(choice: str, document_ids: torch.Tensor | None, batch: int, seq: int,
                   device: torch.device, needs_grad: bool, window: int | None = None,
                   offsets: torch.Tensor | None = None, softcap: bool = False,
                   split: ContextSplit | None = None) -> AttentionMask:
    """See `_attention_mask` (and `context_parallel_mask` with `split`); also records, outside any compiled
    block, the autocast dtype and SDPA's backend order for `attend`."""
    if split is None:
        mask = _attention_mask(choice, document_ids, batch, seq, device, needs_grad, window, offsets, softcap)
    else:
        mask = context_parallel_mask(choice, document_ids, batch, seq, device, needs_grad, window, softcap, split)
    priority = sdpa_priority(device) if mask.backend == "sdpa" else None
    return dataclasses.replace(mask, cast_dtype=_autocast_dtype(device),
                               sdpa_backends=tuple(priority) if priority else None)


def context_parallel_mask(choice: str, document_ids: torch.Tensor | None, batch: int, seq: int,
                          device: torch.device, needs_grad: bool, window: int | None, softcap: bool,
                          split: ContextSplit) -> AttentionMask:
    """`_attention_mask` for this rank's `seq` queries over every cp rank's keys (`split`): always masked (the
    keys are not the queries), so `auto` gives flex on CUDA; varlen, whose documents cannot span ranks, is
    refused."""
    backend = resolve_attention(choice, device, True, window, None, softcap)
    if backend == "varlen":
        raise ValueError("model.attention = 'varlen' cannot run under context parallel (parallel.cp > 1): its "
                         "documents would span ranks; use 'auto', 'flex' (CUDA) or 'sdpa'")
    if backend == "flex":
        _check_flex_trains(device, needs_grad)
        mask = AttentionMask("flex", window, block_mask=document_block_mask(document_ids, batch, seq, device,
                                                                             window, split))
    else:
        mask = AttentionMask(backend, window, dense=document_causal_mask(document_ids, seq, device, window, split))
    return dataclasses.replace(mask, gather_kv=split.gather_kv)


def _autocast_dtype(device: torch.device) -> torch.dtype | None:
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _attention_mask(choice: str, document_ids: torch.Tensor | None, batch: int, seq: int,
                    device: torch.device, needs_grad: bool, window: int | None = None,
                    offsets: torch.Tensor | None = None, softcap: bool = False) -> AttentionMask:
    """Causal attention within documents (and within a sliding `window` of tokens, itself included, when
    given) for the backend `choice` resolves to on `device`.

    `document_ids` (batch, seq): each document is one run of equal ids in its row, padding is -1 and attends
    only to padding (causally, so no row of scores is empty). None: each row is one document. `offsets`: the
    batch's `document_offsets`, made on the host by the loader (varlen; else computed here, which waits for the
    device). `softcap`: the attention scores are soft-capped (see `resolve_attention`).
    """
    backend = resolve_attention(choice, device, document_ids is not None, window, seq, softcap)
    if backend in ("sdpa", "eager"):
        plain = document_ids is None and (window is None or window >= seq)
        return AttentionMask(backend, window, dense=None if plain else
                             document_causal_mask(document_ids, seq, device, window))
    if backend == "flex":
        _check_flex_trains(device, needs_grad)
        return AttentionMask("flex", window, block_mask=document_block_mask(document_ids, batch, seq, device, window))
    if device.type != "cuda":
        raise ValueError(f"model.attention = 'varlen' needs a CUDA device (torch's varlen_attn runs Flash or "
                         f"cuDNN kernels), this forward is on {device.type}: use 'sdpa' or 'auto'")
    if _varlen()[0] is None:
        raise ValueError(f"model.attention = 'varlen' needs torch.nn.attention.varlen.varlen_attn, which torch "
                         f"{torch.__version__} does not have: use 'flex' or 'sdpa'")
    # max_len bounds every document by its row's length: the exact maximum would wait for the device again.
    if offsets is None:
        offsets = document_offsets(document_ids, batch, seq, device)
    elif offsets.ndim == 2:  # one micro-batch's row of `pack_offsets`, from a pipeline schedule
        offsets = unpack_offsets(offsets)
    # From the host (pinned, `Batch.to`) without waiting for the device.
    cu_seqlens = offsets.to(device=device, dtype=torch.int32, non_blocking=True)
    # One compiled graph for every number of documents, not one per count.
    torch._dynamo.maybe_mark_dynamic(cu_seqlens, 0)
    return AttentionMask("varlen", window, cu_seqlens=cu_seqlens, max_len=seq)


def _check_flex_trains(device: torch.device, needs_grad: bool) -> None:
    if device.type == "cpu" and needs_grad:
        raise ValueError(f"model.attention = 'flex': FlexAttention has no backward on CPU (torch "
                         f"{torch.__version__}; the forward runs, e.g. under torch.no_grad()): use 'sdpa' "
                         f"or 'auto' to train on CPU")


def cached_attention_mask(start: int, seq: int, device: torch.device, window: int | None,
                          padding: torch.Tensor | None = None, softcap: bool = False) -> AttentionMask:
    """Decoding with a KV cache: `seq` new queries at positions start.. over the start + seq cached keys (in
    plain torch ops when the scores are soft-capped). `padding` (batch, cache length): True on the positions no
    query may see but their own (so that a padding query's row of scores is never empty)."""
    q_pos = torch.arange(start, start + seq, device=device)
    k_pos = torch.arange(start + seq, device=device)
    dense = causal_window_mask(q_pos, k_pos, window)[None, None]
    if padding is not None:
        dense = dense & (~padding[:, None, None, :start + seq] | (q_pos[:, None] == k_pos[None, :]))
    return AttentionMask("eager" if softcap else "sdpa", window, dense=dense, cast_dtype=_autocast_dtype(device))


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_block_mask(document_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device,
                        window: int | None = None, split: ContextSplit | None = None):
    """FlexAttention BlockMask: causal, within one document when `document_ids` are given, and within the
    sliding `window` when given. With `split` (context parallel): this rank's `seq` queries over every rank's
    keys, compared by their indices in the sequence."""
    # Tensors only in the closure: compiled create_block_mask then reuses its graph for the next forward's.
    keys = document_ids if split is None else split.key_document_ids
    q_positions, k_positions = (None, None) if split is None else (split.query_positions, split.key_positions)

    def mask_mod(b, h, q_idx, kv_idx):
        q_pos, k_pos = (q_idx, kv_idx) if q_positions is None else (q_positions[q_idx], k_positions[kv_idx])
        keep = _causal(b, h, q_pos, k_pos)
        if window is not None:
            keep = keep & (q_pos - k_pos < window)
        if document_ids is not None:
            keep = keep & (document_ids[b, q_idx] == keys[b, kv_idx])
        return keep

    kv_len = seq if split is None else split.key_positions.numel()
    return _flex(device)[1](mask_mod, batch if document_ids is not None else None, None, seq, kv_len,
                            device=device)


def document_offsets(document_ids: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    """cu_seqlens for varlen attention: where each document starts in the flattened (batch * seq) tokens, then
    the total. A row boundary always starts a document. With `document_ids` this waits for the device once
    (the number of documents sets the size)."""
    if document_ids is None:
        return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    offsets = starts.flatten().nonzero().flatten()
    total = torch.full((1,), batch * seq, dtype=offsets.dtype, device=device)
    return torch.cat((offsets, total)).to(torch.int32)


def pack_offsets(offsets: list[torch.Tensor]) -> torch.Tensor:
    """Micro-batches' `document_offsets` (int32, on the host) as one (micro-batches, 1 + most offsets) int32 host
    tensor, each row its count of offsets then the offsets: a pipeline schedule splits every tensor argument along
    dim 0, so each stage's forward gets its micro-batch's row, and reads it on the host (`unpack_offsets`)."""
    packed = torch.zeros(len(offsets), 1 + max(len(o) for o in offsets), dtype=torch.int32)
    for row, o in zip(packed, offsets):
        row[0] = len(o)
        row[1:1 + len(o)] = o
    return packed


def unpack_offsets(row: torch.Tensor) -> torch.Tensor:
    """The offsets of one micro-batch from its (1, width) row of `pack_offsets` (a view: pinned stays pinned)."""
    return row[0, 1:1 + int(row[0, 0])]


@functools.cache
def softcap_score_mod(softcap: float):
    """FlexAttention's score_mod for soft-capped scores; one function per cap, so compiled flex is not
    recompiled on every call."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: torch.Tensor | None,
                    scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention in plain torch ops, for what no SDPA kernel does (soft-capped scores): scores scaled, then
    capped to softcap * tanh(score / softcap), masked (`dense`; None: causal), softmax in float32. Shapes as
    `attend`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if dense is None:
        pos = torch.arange(q.shape[2], device=q.device)
        dense = causal_window_mask(pos, pos, None)
    scores = scores.masked_fill(~dense, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return (weights @ v).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """q (batch, heads, q_len, head_dim), k and v (batch, kv_heads, k_len, head_dim) -> (batch, q_len, heads,
    head_dim).

    Every backend computes the same causal, within-document (and within-window) softmax attention with
    `scale` (None: 1/sqrt(head_dim)), its scores soft-capped at `softcap` where given (flex and eager only: a
    mask built without `softcap` for another backend is an error, never a silently uncapped result).
    """
    if mask.cast_dtype is not None:
        # QK-norm with float32 weights makes q and k float32 while v is in the autocast dtype; kernels want one
        # dtype (varlen refuses float32). torchtitan casts the same way before its kernels.
        q, k, v = q.to(mask.cast_dtype), k.to(mask.cast_dtype), v.to(mask.cast_dtype)
    if softcap is not None and mask.backend not in ("flex", "eager"):
        raise ValueError(f"attention scores soft-capped at {softcap}, but the mask is for {mask.backend!r}, which "
                         f"cannot cap them: build it with softcap=True")
    if mask.gather_kv is not None:
        k, v = mask.gather_kv(k, v)
    if mask.backend == "eager":
        return eager_attention(q, k, v, mask.dense, scale, softcap)
    if mask.backend == "sdpa":
        context = contextlib.nullcontext() if mask.sdpa_backends is None else \
            sdpa_kernel(list(mask.sdpa_backends), set_priority=True)
        with context:
            if mask.dense is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)
            else:
                if q.is_cuda and k.shape[1] != q.shape[1]:
                    # A mask with enable_gqa leaves CUDA SDPA only its math kernel: give it whole heads.
                    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True, scale=scale)
        return out.transpose(1, 2)
    if mask.backend == "flex":
        score_mod = None if softcap is None else softcap_score_mod(softcap)
        return _flex(q.device)[0](q, k, v, score_mod=score_mod, block_mask=mask.block_mask, enable_gqa=True,
                                  scale=scale).transpose(1, 2)
    if mask.backend != "varlen":
        raise ValueError(f"unknown attention backend {mask.backend!r}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"model.attention = 'varlen' runs Flash/cuDNN kernels, which take bfloat16 or float16, "
                         f"but q is {q.dtype}: train in bf16 (training.precision) or use 'flex' or 'sdpa'")
    bsz, n_heads, seq, head_dim = q.shape
    varlen_attn, gqa = _varlen()
    if not gqa and k.shape[1] != n_heads:
        k = k.repeat_interleave(n_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)

    def tokens(t: torch.Tensor) -> torch.Tensor:  # (batch, heads, seq, d) -> (batch * seq, heads, d)
        return t.transpose(1, 2).reshape(bsz * seq, t.shape[1], head_dim)

    kwargs = {"enable_gqa": True} if gqa else {}
    # The same offsets tensor for q and k: cuDNN takes causal packed sequences only then.
    window = (-1, 0) if mask.window is None else (mask.window - 1, 0)
    out = varlen_attn(tokens(q), tokens(k), tokens(v), mask.cu_seqlens, mask.cu_seqlens, mask.max_len,
                       mask.max_len, window_size=window, scale=scale, **kwargs)
    return out.reshape(bsz, seq, n_heads, head_dim)


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional QK-norm (per head or across heads), biases (`bias` on the q, k
    and v projections, `out_bias` on the output's; None: as `bias`) and soft-capped scores; the kernel is the one
    `mask` was built for (see `attend`). With `cache` (decoding), the new keys and values are written at
    `cache.start` and the queries attend over everything cached so far."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, bias: bool = False,
                 qk_norm: str = "none", norm_kind: str = "rms", norm_eps: float = 1e-6, scale: float | None = None,
                 out_bias: bool | None = None, softcap: float | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.scale = n_heads, n_kv_heads, head_dim, scale
        self.softcap = softcap
        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * head_dim, dim, bias=bias if out_bias is None else out_bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            width = head_dim if qk_norm == "head" else None
            self.q_norm = build_norm(norm_kind, width or n_heads * head_dim, norm_eps)
            self.k_norm = build_norm(norm_kind, width or n_kv_heads * head_dim, norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                cache: "LayerCache | None" = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        # -1 heads: under tensor parallel each rank holds a slice of the heads.
        q = q.view(bsz, seq, -1, self.head_dim)
        k = k.view(bsz, seq, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(bsz, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)
        return self.o_proj(attend(q, k, v, mask, self.scale, self.softcap).reshape(bsz, seq, -1))


class LayerCache:
    """One layer's keys and values for decoding: (batch, kv_heads, max_len, head_dim) buffers, filled up to
    `start` before a forward and up to `start + seq` after it."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, start: int):
        self.k, self.v, self.start = k, v, start

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, decoding needs {end}")
        self.k[:, :, self.start:end] = k
        self.v[:, :, self.start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with `silu` (Llama), GeGLU with tanh-`gelu` (Gemma)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu", bias: bool = False):
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        gate = F.silu(gate) if self.activation == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))


class MLP(nn.Module):
    """down(gelu(up(x))) with exact GELU (GPT-NeoX)."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = True):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))
