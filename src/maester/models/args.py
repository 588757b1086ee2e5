"""The arguments of a decoder-only transformer (no torch import: configs validate without it).

One argument set describes every architecture in the registry: Llama, Mistral, Gemma 2 and 3, Qwen 2 and 3, OLMo 2,
Phi-3 and GPT-NeoX differ only in the switches below (norm kind and placement, QK-norm, MLP kind, biases, partial
rotary, sliding windows, logit soft-capping); OLMoE, Qwen 3 MoE and Mixtral add a mixture of experts (`moe`). An architecture is a set of defaults plus named flavors (`maester.models.flavors`).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from maester.config.base import Section


class RopeScaling(BaseModel):
    """RoPE frequency scaling: `llama3` (Llama 3.1: low frequencies divided by `factor`, a smooth band between)
    or `linear` (every frequency divided by `factor`, positions interpolated; Gemma 3's global layers)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rope_type: Literal["llama3", "linear"] = "llama3"
    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


class MupConfig(Section):
    """μP (maximal update parametrization), relative to a base model of width `base_width` (m = dim / base_width):
    hidden-matrix init std x 1/sqrt(m), hidden-matrix Adam LR x 1/m, logits x output_alpha / m, attention scale
    sqrt(base_head_dim) / head_dim, embeddings x input_alpha; embedding and readout LR unchanged. At m = 1 with
    the alphas at 1 the model, its init and its LRs are exactly the standard ones."""

    enabled: bool = False
    base_width: int | None = Field(None, gt=0)
    """The width (model dim) at which the hyperparameters were tuned."""
    input_alpha: float = Field(1.0, gt=0)
    output_alpha: float = Field(1.0, gt=0)
    base_head_dim: int | None = Field(None, gt=0)
    """The base model's head dim. None: the model's own, right when the head count grows with the width and the
    head dim stays fixed (the scale stays 1/sqrt(head_dim)); set it when the head dim grows instead, and the
    scale goes as 1/head_dim."""
    zero_init_readout: bool = False
    """Start the (untied) output layer at zero, which removes the logits' 1/sqrt(width) shrinking at init."""
    zero_init_query: bool = False
    """Start the query projections at zero."""

    @model_validator(mode="after")
    def _check_base(self) -> "MupConfig":
        if self.enabled and self.base_width is None:
            raise ValueError("mup.enabled needs mup.base_width (the model dim the hyperparameters were tuned at)")
        return self


class MoEArgs(BaseModel):
    """A mixture-of-experts feed-forward in place of the dense MLP: each token goes to its `top_k` experts
    (token choice, dropless: no capacity, no dropped token), plus `n_shared_experts` that see every token.
    Experts are gated MLPs of the model's `mlp` kind with `expert_hidden_dim` hidden units."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    n_experts: int = Field(gt=1)
    top_k: int = Field(gt=0)
    expert_hidden_dim: int = Field(gt=0)
    gate: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become scores: a softmax over the experts (Mixtral, OLMoE, Qwen 3 MoE) or a sigmoid
    per expert (DeepSeek-V3)."""
    norm_topk_prob: bool = False
    """Renormalise the chosen experts' scores to sum to 1 (Qwen 3 MoE, Mixtral, DeepSeek-V3); off in OLMoE."""
    n_shared_experts: int = Field(0, ge=0)
    """Experts every token goes through, fused into one MLP of n_shared_experts x expert_hidden_dim units."""
    aux_loss_coef: float = Field(0.0, ge=0)
    """Weight of the load-balancing loss E * sum_e f_e * P_e (Switch Transformer; f_e the routed assignments of
    expert e per token, P_e its mean score; top_k at perfect balance), averaged over the MoE layers: HF's
    `router_aux_loss_coef`."""
    z_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE), averaged over the MoE layers. Not in HF
    configs (a training setting: exports leave it out)."""
    bias_balancing: float = Field(0.0, ge=0)
    """Auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer step every expert's selection bias moves
    by this rate toward balance (up when under-loaded). The bias changes which experts are chosen, never the
    gates' weights. 0: off. HF's OLMoE and Qwen 3 MoE have no such bias: such a model does not export to them."""

    @model_validator(mode="after")
    def _check_experts(self) -> "MoEArgs":
        if self.top_k > self.n_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) cannot exceed moe.n_experts ({self.n_experts})")
        if self.top_k == 1 and self.norm_topk_prob:
            raise ValueError("moe.norm_topk_prob with top_k = 1 would set every gate to 1: the router would get no "
                             "gradient")
        return self


class TransformerArgs(BaseModel):
    """Every architecture field; any of them can be overridden by `model.overrides`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    vocab_size: int | None = Field(None, le=2**31 - 1)
    """None: the tokenizer's vocabulary size, rounded up to a multiple of 64. At most 2^31 - 1: token ids are
    int32 in every dataset format."""
    head_dim: int | None = None  # None: dim // n_heads
    norm: Literal["rms", "rms_offset", "layer"] = "rms"
    """`rms`: RMSNorm scaled by w; `rms_offset`: RMSNorm scaled by (1 + w) (Gemma); `layer`: LayerNorm with bias."""
    norm_eps: float = Field(1e-5, gt=0, allow_inf_nan=False)
    norm_placement: Literal["pre", "post", "sandwich"] = "pre"
    """Where each block normalises: `pre` the sublayer's input (Llama), `post` its output before the residual
    add (OLMo 2), `sandwich` both (Gemma)."""
    parallel_residual: bool = False
    """x + attention(norm1(x)) + mlp(norm2(x)) (GPT-NeoX, GPT-J) instead of two residual steps."""
    qk_norm: Literal["none", "head", "full"] = "none"
    """Normalise queries and keys before RoPE: per head (Qwen 3, Gemma 3) or across all heads (OLMo 2)."""
    attention_bias: bool = False  # biases on the q, k, v and output projections
    qkv_bias: bool = False  # biases on the q, k and v projections only (Qwen 2)
    mlp: Literal["swiglu", "geglu", "gelu"] = "swiglu"
    """`swiglu`: down(silu(gate(x)) * up(x)); `geglu`: the same with tanh-GELU (Gemma); `gelu`: down(gelu(up(x)))
    with exact GELU (GPT-NeoX)."""
    mlp_bias: bool = False
    rope_theta: float = Field(500000.0, gt=0, allow_inf_nan=False)
    rope_scaling: RopeScaling | None = None
    rotary_fraction: float = 1.0  # the leading fraction of each head's dims that RoPE rotates (GPT-NeoX: 0.25)
    sliding_window: int | None = None
    """Tokens a sliding-window layer sees, itself included (as Hugging Face's `sliding_window`). None: all global."""
    sliding_window_pattern: int = 0
    """With a sliding window: every `sliding_window_pattern`-th layer (the 6th, 12th, ... for 6) is global and
    the others slide; 0: every layer slides."""
    local_rope_theta: float | None = Field(None, gt=0, allow_inf_nan=False)
    """RoPE base of the sliding-window layers, unscaled (Gemma 3: 10,000). None: the global RoPE."""
    query_pre_attn_scalar: float | None = None  # attention scale is its inverse square root; None: head_dim
    attn_logit_softcap: float | None = Field(None, gt=0)
    """Attention scores (after scaling, before the mask) become c * tanh(score / c) (Gemma 2). None: off. SDPA
    cannot do it: such a model attends with FlexAttention on CUDA and in plain torch ops otherwise."""
    final_logit_softcap: float | None = Field(None, gt=0)
    """The output logits become c * tanh(logit / c), in the loss as well (Gemma 2). None: off."""
    embedding_scale: bool = False  # multiply embeddings by sqrt(dim) (Gemma)
    tie_embeddings: bool = False
    max_seq_len: int = 131072
    init_std: float = 0.02
    # The attention kernel, set from `model.attention` (not an override): it changes no parameter or result.
    attention: Literal["auto", "sdpa", "flex", "varlen"] = "auto"
    moe: MoEArgs | None = None
    """A mixture-of-experts feed-forward in every block (OLMoE, Qwen 3 MoE, Mixtral); None: the dense MLP. With it
    `ffn_hidden_dim` is unused (flavors keep HF's intermediate_size there)."""
    mup: MupConfig | None = None
    """μP (maximal update parametrization): the run's `mup` section where it is enabled; None: off."""

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
        if self.qkv_bias and self.attention_bias:
            raise ValueError("qkv_bias and attention_bias are both set: attention_bias already biases q, k and v")
        if self.attn_logit_softcap is not None and self.attention == "varlen":
            raise ValueError("attention = 'varlen' cannot soft-cap attention scores (attn_logit_softcap is set): use "
                             "'auto' (FlexAttention on CUDA) or 'flex'")
        if self.moe is not None and self.mlp == "gelu":
            raise ValueError("moe experts are gated MLPs: mlp must be 'swiglu' or 'geglu', not 'gelu'")
        if self.moe is not None and self.mlp_bias:
            raise ValueError("moe experts have no biases: mlp_bias must be false with moe")
        self._check_mup()
        return self

    def _check_mup(self) -> None:
        if self.mup is None:
            return
        if not self.mup.enabled:
            raise ValueError("mup is given but mup.enabled is false: leave it None for a model without μP")
        if self.mup.zero_init_readout and self.tie_embeddings:
            raise ValueError("mup.zero_init_readout needs an untied output layer (tie_embeddings is set: the head "
                             "is the embedding matrix, which cannot start at zero)")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.resolved_head_dim * self.rotary_fraction)

    @property
    def width_mult(self) -> float:
        """μP's width multiplier m = dim / mup.base_width; 1.0 with μP off."""
        return self.dim / self.mup.base_width if self.mup is not None else 1.0

    @property
    def attention_scale(self) -> float:
        """The softmax scale: 1/sqrt(query_pre_attn_scalar or head_dim); under μP times
        sqrt(mup.base_head_dim / head_dim), which goes as 1/head_dim when the head dim grows."""
        standard = (self.query_pre_attn_scalar or self.resolved_head_dim) ** -0.5
        base = self.mup.base_head_dim if self.mup is not None else None
        if base is None or base == self.resolved_head_dim:
            return standard
        return standard * math.sqrt(base / self.resolved_head_dim)

    @property
    def embedding_multiplier(self) -> float:
        """What the embeddings are multiplied by: sqrt(dim) with `embedding_scale` (Gemma; sqrt(mup.base_width)
        under μP, so that it does not grow with the width), times mup.input_alpha."""
        if self.mup is None:
            return self.dim ** 0.5 if self.embedding_scale else 1.0
        return (self.mup.base_width ** 0.5 if self.embedding_scale else 1.0) * self.mup.input_alpha

    @property
    def output_multiplier(self) -> float:
        """What the final hidden state is multiplied by before the head: μP's mup.output_alpha / width_mult."""
        return (self.mup.output_alpha if self.mup is not None else 1.0) / self.width_mult

    def mup_deviations(self) -> list[str]:
        """How μP makes this model compute something other than the same architecture without μP (empty when it
        does not: m = 1 and alphas 1, or multipliers that cancel). Init-only settings do not count."""
        plain = self.model_copy(update={"mup": None})
        out = []
        for what in ("embedding_multiplier", "output_multiplier", "attention_scale"):
            ours, theirs = getattr(self, what), getattr(plain, what)
            if ours != theirs:
                out.append(f"{what} {ours:g} (without μP {theirs:g})")
        return out

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
