"""The arguments of a decoder-only transformer (no torch import: configs validate without it).

One argument set describes every architecture in the registry: Llama, Gemma 3, Qwen 3, OLMo 2 and GPT-NeoX
differ only in the switches below (norm kind and placement, QK-norm, MLP kind, biases, partial rotary,
sliding windows). An architecture is a set of defaults plus named flavors (`maester.models.flavors`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class RopeScaling(BaseModel):
    """RoPE frequency scaling: `llama3` (Llama 3.1: low frequencies divided by `factor`, a smooth band between)
    or `linear` (every frequency divided by `factor`, positions interpolated; Gemma 3's global layers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class TransformerArgs(BaseModel):
    """Every architecture field; any of them can be overridden by `model.overrides`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    # None: take the tokenizer's vocabulary size, rounded up to a multiple of 64.
    vocab_size: int | None = None
    head_dim: int | None = None  # None: dim // n_heads
    norm: Literal["rms", "rms_offset", "layer"] = "rms"
    """`rms`: RMSNorm scaled by w; `rms_offset`: RMSNorm scaled by (1 + w) (Gemma); `layer`: LayerNorm with bias."""
    norm_eps: float = 1e-5
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where each block normalises: `pre` the sublayer's input (Llama), `post` its output before the residual
    add (OLMo 2), `sandwich` both (Gemma)."""
    parallel_residual: bool = False
    """x + attention(norm1(x)) + mlp(norm2(x)) (GPT-NeoX, GPT-J) instead of two residual steps."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """Normalise queries and keys before RoPE: per head (Qwen 3, Gemma 3) or across all heads (OLMo 2)."""
    attention_bias: bool = False  # biases on the q, k, v and output projections
    mlp: Literal["swiglu", "geglu", "gelu"] = "swiglu"
    """`swiglu`: down(silu(gate(x)) * up(x)); `geglu`: the same with tanh-GELU (Gemma); `gelu`: down(gelu(up(x)))
    with exact GELU (GPT-NeoX)."""
    mlp_bias: bool = False
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0  # the leading fraction of each head's dims that RoPE rotates (GPT-NeoX: 0.25)
    sliding_window: int | None = None
    """Tokens a sliding-window layer sees, itself included (as Hugging Face's `sliding_window`). None: all global."""
    sliding_window_pattern: int = 0
    """With a sliding window: every `sliding_window_pattern`-th layer (the 6th, 12th, ... for 6) is global and
    the others slide; 0: every layer slides."""
    local_rope_theta: float | None = None
    """RoPE base of the sliding-window layers, unscaled (Gemma 3: 10,000). None: the global RoPE."""
    query_pre_attn_scalar: float | None = None  # attention scale is its inverse square root; None: head_dim
    embedding_scale: bool = False  # multiply embeddings by sqrt(dim) (Gemma)
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    init_std: float = 0.02
    # The attention kernel, set from `model.attention` (not an override): it changes no parameter or result.
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"

    @model_validator(mode="after")
    def _check_shapes(self) -> "TransformerArgs":
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) or head_dim set")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"rotary dims (head_dim {self.resolved_head_dim} x rotary_fraction "
                             f"{self.rotary_fraction}) must be positive and even, got {self.rotary_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.sliding_window_pattern < 0:
            raise ValueError(f"sliding_window_pattern must be >= 0, got {self.sliding_window_pattern}")
        if self.parallel_residual and self.norm_placement != "pre":
            raise ValueError("parallel_residual needs norm_placement = 'pre'")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.resolved_head_dim * self.rotary_fraction)

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.resolved_head_dim) ** -0.5

    def differences(self, other: "TransformerArgs", ignore: tuple[str, ...] = ()) -> dict[str, tuple]:
        """Field -> (this value, other's value) where the two differ, except the fields in `ignore`; head_dim is
        compared resolved (None and dim // n_heads are the same model)."""
        out = {}
        for key in type(self).model_fields:
            ours, theirs = getattr(self, key), getattr(other, key)
            if key == "head_dim":
                ours, theirs = self.resolved_head_dim, other.resolved_head_dim
            if key not in ignore and ours != theirs:
                out[key] = (ours, theirs)
        return out

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based), None for a global layer."""
        if self.sliding_window is None:
            return None
        pattern = self.sliding_window_pattern
        return None if pattern and (layer + 1) % pattern == 0 else self.sliding_window

    def layer_rope(self, layer: int) -> str:
        """Which RoPE table layer `layer` uses: `global` or `local` (a sliding layer with its own base)."""
        local = self.local_rope_theta is not None and self.layer_window(layer) is not None
        return "local" if local else "global"
