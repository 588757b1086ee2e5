"""The decoder-only transformer every architecture is built from (Llama, Mistral, Gemma 2 and 3, Qwen 2 and 3,
OLMo 2, Phi-3, GPT-NeoX; OLMoE, Qwen 3 MoE and Mixtral with `maester.models.moe`'s feed-forward).

A block is attention then MLP, each a residual branch; `TransformerArgs` picks the norm kind and where it
sits (pre, post or both), QK-norm, the MLP kind, biases, partial rotary, sliding-window layers, a parallel
residual and soft-capped attention scores and logits. Parameter names are the same for every architecture, so parallel plans and checkpoints need no
per-model code; `maester.models.hf` and `hf_tensors` map them to and from Hugging Face names.
μP (`TransformerArgs.mup`) changes the init of the block matrices and three scalars (embedding multiplier,
attention scale, output multiplier); `parameter_roles` tells the optimizer which parameters are which.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from maester.models.args import TransformerArgs
from maester.models.moe import MoEFeedForward, aux_loss
from maester.models.loss import IGNORE_INDEX, linear_cross_entropy_sum, softcap_logits
from maester.models.layers import (
    MLP,
    Attention,
    AttentionMask,
    GatedMLP,
    LayerCache,
    RMSNorm,
    RotaryEmbedding,
    attention_mask as document_attention_mask,
    build_norm,
    cached_attention_mask,
)


class TransformerBlock(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        norm = lambda: build_norm(args.norm, args.dim, args.norm_eps)  # noqa: E731
        pre, post = args.norm_placement in ("pre", "sandwich"), args.norm_placement in ("post", "sandwich")
        self.parallel_residual = args.parallel_residual
        self.attention_norm = norm() if pre else nn.Identity()
        # None: the kernels' own 1/sqrt(head_dim); Gemma's query_pre_attn_scalar and μP's base head dim change it.
        own_scale = args.query_pre_attn_scalar or args.attention_scale != args.resolved_head_dim ** -0.5
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.resolved_head_dim,
                                   bias=args.attention_bias or args.qkv_bias, qk_norm=args.qk_norm,
                                   norm_kind=args.norm, norm_eps=args.norm_eps,
                                   scale=args.attention_scale if own_scale else None, out_bias=args.attention_bias,
                                   softcap=args.attn_logit_softcap)
        self.post_attention_norm = norm() if post else nn.Identity()
        self.ffn_norm = norm() if pre else nn.Identity()
        if args.moe is not None:
            self.feed_forward = MoEFeedForward(args.dim, args.moe, "silu" if args.mlp == "swiglu" else "gelu")
        elif args.mlp == "gelu":
            self.feed_forward = MLP(args.dim, args.ffn_hidden_dim, bias=args.mlp_bias)
        else:
            self.feed_forward = GatedMLP(args.dim, args.ffn_hidden_dim, "silu" if args.mlp == "swiglu" else "gelu",
                                         bias=args.mlp_bias)
        self.post_ffn_norm = norm() if post else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                cache: LayerCache | None = None) -> torch.Tensor:
        h = self.post_attention_norm(self.attention(self.attention_norm(x), cos, sin, mask, cache=cache))
        if self.parallel_residual:
            return x + h + self.feed_forward(self.ffn_norm(x))
        x = x + h
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))


class KVCache:
    """Keys and values of every layer for incremental decoding, how many positions are filled, and which of them
    are padding (`padding`, batch x max_len, True there; None while none is: a left-padded batch sets it).
    `kv_heads`: the heads this process holds (tensor parallel splits them); None: all of them."""

    def __init__(self, args: TransformerArgs, batch: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 kv_heads: int | None = None):
        shape = (batch, kv_heads or args.n_kv_heads, max_len, args.resolved_head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(args.n_layers)]
        self.length = 0
        self.padding: torch.Tensor | None = None

    def layer(self, i: int) -> LayerCache:
        return LayerCache(self.keys[i], self.values[i], self.length)

    def mark_padding(self, attention_mask: torch.Tensor) -> None:
        """Record which of the next positions are padding: `attention_mask` (batch, seq) is 0 there."""
        if self.padding is None:
            self.padding = torch.zeros(self.keys[0].shape[0], self.keys[0].shape[2], dtype=torch.bool,
                                       device=attention_mask.device)
        self.padding[:, self.length:self.length + attention_mask.shape[1]] = attention_mask == 0


class Transformer(nn.Module):
    def __init__(self, args: TransformerArgs):
        super().__init__()
        if args.vocab_size is None:
            raise ValueError("TransformerArgs.vocab_size must be resolved (from the tokenizer) before building")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rotary = RotaryEmbedding(args.rotary_dim, args.rope_theta, args.rope_scaling)
        if args.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(args.rotary_dim, args.local_rope_theta)
        # A ModuleDict keyed by layer index keeps fully-qualified names stable when layers are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = build_norm(args.norm, args.dim, args.norm_eps)
        # Tied embeddings: the head reuses the embedding matrix (no second parameter to keep tied).
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.layer_windows = [args.layer_window(i) for i in range(args.n_layers)]
        self.layer_ropes = [args.layer_rope(i) for i in range(args.n_layers)]
        # Context parallel, set from outside (`maester.parallel.context_parallel`): the forward takes this rank's
        # tokens of each sequence and its attention spans every rank's keys.
        self.context_parallel = None

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from the meta device).

        μP changes the numbers, never the order of draws: hidden matrices start 1/sqrt(m) smaller, and the zero
        inits overwrite matrices drawn as usual, so every other parameter keeps the weights of the same seed."""
        std = self.args.init_std
        hidden_std = std / math.sqrt(self.args.width_mult)  # m = 1 without μP
        # Residual-branch outputs are scaled down with depth (GPT-2) so activations stay O(1).
        out_std = hidden_std / math.sqrt(2 * self.args.n_layers)
        if self.tok_embeddings is not None:  # None: a pipeline stage after the first
            nn.init.normal_(self.tok_embeddings.weight, std=std)
        for module in self.modules():
            if isinstance(module, (RMSNorm, nn.LayerNorm, RotaryEmbedding)):
                module.reset_parameters()
        for block in self.layers.values():
            attn, mlp = block.attention, block.feed_forward
            mlps = [mlp] if not isinstance(mlp, MoEFeedForward) else [m for m in (mlp.shared_experts,) if m]
            inputs = [attn.q_proj, attn.k_proj, attn.v_proj]
            outputs = [attn.o_proj]
            for m in mlps:
                inputs += [m.gate_proj, m.up_proj] if isinstance(m, GatedMLP) else [m.up_proj]
                outputs.append(m.down_proj)
            for lin, s in [(lin, hidden_std) for lin in inputs] + [(lin, out_std) for lin in outputs]:
                nn.init.trunc_normal_(lin.weight, std=s, a=-3 * s, b=3 * s)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
            if isinstance(mlp, MoEFeedForward):
                self._init_experts(mlp, hidden_std, out_std)
            if self.args.mup is not None and self.args.mup.zero_init_query:
                nn.init.zeros_(attn.q_proj.weight)
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
            if self.args.mup is not None and self.args.mup.zero_init_readout:
                nn.init.zeros_(self.output.weight)

    @staticmethod
    def _init_experts(moe: MoEFeedForward, hidden_std: float, out_std: float) -> None:
        """The experts as the dense MLP (input matrices at the hidden std, the output one at the residual std), the
        router as an input matrix; selection bias and counters at zero."""
        experts = moe.experts
        for w, s in ((moe.router.gate.weight, hidden_std), (experts.gate_proj, hidden_std),
                     (experts.up_proj, hidden_std), (experts.down_proj, out_std)):
            nn.init.trunc_normal_(w, std=s, a=-3 * s, b=3 * s)
        moe.reset_state()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None, cache: KVCache | None = None,
                labels: torch.Tensor | None = None, document_offsets: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab); with `labels` (batch, seq), the summed
        cross-entropy instead (`maester.models.loss`), computed without the whole batch's logits; in training
        mode an MoE model adds its auxiliary losses (`_add_aux_loss`).
        `document_offsets`: where each document starts in the flattened batch (`Batch.document_offsets`, made on
        the host), for varlen attention.

        `position_ids` default to 0..seq-1 (after the cached positions with `cache`); with `document_ids` (-1 on
        padding), attention stays within each document. `args.attention` picks the kernel (see
        `layers.resolve_attention`), never the result. With `cache` the tokens continue the cached ones
        (decoding; masked SDPA, no documents) and the cache grows by seq; `attention_mask` (batch, seq), with
        `cache` only, is 0 on the left padding of a batch of prompts, which no other token attends to (pass their
        `position_ids` too, counted from each row's first token).
        """
        # Without the embedding (a later pipeline stage) `input_ids` are the previous stage's hidden states, which
        # may be sequence-sharded (TP): the sizes come from position_ids.
        first = self.tok_embeddings is not None
        bsz, seq = (input_ids if first else position_ids).shape[:2]
        device = input_ids.device
        start = cache.length if cache is not None else 0
        if position_ids is None and start:
            position_ids = torch.arange(start, start + seq, device=device).expand_as(input_ids)
        h = self.tok_embeddings(input_ids) if first else input_ids
        input_multiplier = self.args.embedding_multiplier if first else 1.0  # Gemma's sqrt(dim), μP's input_alpha
        if input_multiplier != 1.0:
            # In the activations' dtype, as Hugging Face's Gemma rounds its normaliser.
            h = h * torch.tensor(input_multiplier, dtype=h.dtype)
        ropes = {"global": self.rotary(position_ids, h.dtype, seq, device)}
        if "local" in self.layer_ropes:
            ropes["local"] = self.local_rotary(position_ids, h.dtype, seq, device)
        needs_grad = torch.is_grad_enabled() and (self.tok_embeddings.weight if first else h).requires_grad
        masks = {}
        softcap = self.args.attn_logit_softcap is not None
        split = None if self.context_parallel is None or cache is not None else \
            self.context_parallel.split(document_ids, seq, device)
        if split is not None and position_ids is None:
            raise ValueError("under context parallel the forward takes this rank's tokens, not positions "
                             "0..seq-1: pass their position_ids")
        if attention_mask is not None:
            if cache is None:
                raise ValueError("attention_mask marks the padding of a batch decoded with a KV cache: pass cache")
            cache.mark_padding(attention_mask)
        for window in set(self.layer_windows):
            if cache is not None:
                if document_ids is not None:
                    raise ValueError("decoding with a KV cache takes no document_ids")
                masks[window] = cached_attention_mask(start, seq, device, window, cache.padding, softcap)
            else:
                masks[window] = document_attention_mask(self.args.attention, document_ids, bsz, seq, device,
                                                        needs_grad, window, document_offsets, softcap, split)
        for name, block in self.layers.items():
            i = int(name)  # a pipeline stage holds some of the layers, under their indices in the whole model
            cos, sin = ropes[self.layer_ropes[i]]
            if cache is None:
                h = block(h, cos, sin, masks[self.layer_windows[i]])
            else:
                h = block(h, cos, sin, masks[self.layer_windows[i]], cache.layer(i))
        if cache is not None:
            cache.length += seq
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        if self.args.output_multiplier != 1.0:
            # μP's output_alpha / m, on the hidden state: the same for a tied or untied, whole or sharded head.
            h = h * self.args.output_multiplier
        cap = self.args.final_logit_softcap
        if labels is None:
            logits = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
            return logits if cap is None else softcap_logits(logits.float(), cap).to(logits.dtype)
        # Chunked; a vocabulary-sharded head (TP) chunk by chunk under loss_parallel (`maester.models.loss`).
        weight = self.output.weight if self.output is not None else self.tok_embeddings.weight
        return self._add_aux_loss(linear_cross_entropy_sum(h, weight, labels, softcap=cap), labels)

    def _add_aux_loss(self, loss: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The summed cross-entropy plus the MoE layers' weighted auxiliary losses times this batch's label tokens.

        The trainer divides the summed loss by the label tokens of the whole step; scaled so, each micro-batch's
        auxiliary loss enters the step loss as a per-token term, weighted by its share of the step's tokens: the
        coefficients mean what they mean in a single-batch step, whatever the micro-batch split."""
        extra = aux_loss(self) if self.training and self.args.moe is not None else None
        if extra is None:
            return loss
        extra = extra * (labels != IGNORE_INDEX).sum()
        if isinstance(loss, DTensor):  # loss parallel: a replicated DTensor, as every tp rank's aux loss is
            extra = DTensor.from_local(extra, loss.device_mesh, loss.placements, run_check=False)
        return loss + extra


# What activation checkpointing and torch.compile insert into parameter names (FSDP2 and TP insert nothing).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_parameter_name(name: str) -> str:
    """A parameter's name as in the bare model (and in checkpoints): wrapper prefixes removed."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def parameter_roles(model: nn.Module) -> dict[str, str]:
    """Canonical parameter name (`canonical_parameter_name`) -> role, for μP learning rates and Muon's choice of
    matrices: `embedding` (the token embeddings, also the head when tied), `readout` (an untied output layer),
    `hidden` (the matrices inside the blocks) or `vector` (norm gains, biases: anything under 2-D).

    `model` is a `Transformer`, bare or as `maester.parallel.parallelize` left it."""
    roles = {}
    for raw, p in model.named_parameters():
        name = canonical_parameter_name(raw)
        if name == "tok_embeddings.weight":
            roles[name] = "embedding"
        elif name == "output.weight":
            roles[name] = "readout"
        elif p.ndim < 2:
            roles[name] = "vector"
        elif name.startswith("layers."):
            roles[name] = "hidden"
        else:
            raise ValueError(f"parameter {raw} (shape {tuple(p.shape)}) is a matrix outside the blocks that is "
                             f"neither the embedding nor the output layer: it has no μP role")
    return roles
