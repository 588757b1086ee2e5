"""Llama 3.x architecture arguments and named flavors (no torch import: configs validate without it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator


class RopeScaling(BaseModel):
    """Llama 3.1 RoPE frequency scaling (`rope_type = "llama3"` in Hugging Face configs)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class LlamaArgs(BaseModel):
    """Every architecture field of a Llama model; any of them can be overridden by `model.overrides`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    # None: take the tokenizer's vocabulary size, rounded up to a multiple of 64.
    vocab_size: int | None = None
    head_dim: int | None = None  # None: dim // n_heads
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    init_std: float = 0.02
    # The attention kernel, set from `model.attention` (not an override): it changes no parameter or result.
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"

    @model_validator(mode="after")
    def _check_shapes(self) -> "LlamaArgs":
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) or head_dim set")
        if self.resolved_head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}")
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads


_LLAMA3_VOCAB = 128256

LLAMA_FLAVORS: dict[str, LlamaArgs] = {
    # Tiny shapes for tests and debugging.
    "tiny": LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, rope_theta=10000.0),
    # The demo model: small enough to learn byte-level text on a laptop CPU in a couple of minutes.
    "demo": LlamaArgs(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_hidden_dim=512, rope_theta=10000.0,
                      max_seq_len=2048),
    # Published Llama 3.2 / 3.1 / 3.3 shapes.
    "1B": LlamaArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192,
                    vocab_size=_LLAMA3_VOCAB, rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    "3B": LlamaArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden_dim=8192,
                    vocab_size=_LLAMA3_VOCAB, rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    "8B": LlamaArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336,
                    vocab_size=_LLAMA3_VOCAB, rope_scaling=RopeScaling(factor=8.0)),
    "70B": LlamaArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672,
                     vocab_size=_LLAMA3_VOCAB, rope_scaling=RopeScaling(factor=8.0)),
}
