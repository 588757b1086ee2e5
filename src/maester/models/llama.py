"""Llama 3.x: pre-norm decoder with grouped-query attention, RoPE (3.1 scaling), RMSNorm and SwiGLU."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from maester.models.layers import Attention, AttentionMask, RMSNorm, RotaryEmbedding, SwiGLU, attention_mask
from maester.models.llama_args import LlamaArgs


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.resolved_head_dim)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = SwiGLU(args.dim, args.ffn_hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        if args.vocab_size is None:
            raise ValueError("LlamaArgs.vocab_size must be resolved (from the tokenizer) before building")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rotary = RotaryEmbedding(args.resolved_head_dim, args.rope_theta, args.rope_scaling)
        # A ModuleDict keyed by layer index keeps fully-qualified names stable when layers are wrapped.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied embeddings: the head reuses the embedding matrix (no second parameter to keep tied).
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from the meta device)."""
        std = self.args.init_std
        # Residual-branch outputs are scaled down with depth (GPT-2) so activations stay O(1).
        out_std = std / math.sqrt(2 * self.args.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        self.rotary.reset_parameters()
        for block in self.layers.values():
            block.attention_norm.reset_parameters()
            block.ffn_norm.reset_parameters()
            for lin in (block.attention.q_proj, block.attention.k_proj, block.attention.v_proj,
                        block.feed_forward.gate_proj, block.feed_forward.up_proj):
                nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)
            for lin in (block.attention.o_proj, block.feed_forward.down_proj):
                nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        self.norm.reset_parameters()
        if self.output is not None:
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids (batch, seq) -> logits (batch, seq, vocab).

        `position_ids` default to 0..seq-1; with `document_ids` (-1 on padding), attention stays within each
        document. `args.attention` picks the kernel (see `layers.resolve_attention`), never the result.
        """
        bsz, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device).expand_as(input_ids)
        h = self.tok_embeddings(input_ids)
        cos, sin = self.rotary(position_ids, h.dtype)
        needs_grad = torch.is_grad_enabled() and self.tok_embeddings.weight.requires_grad
        mask = attention_mask(self.args.attention, document_ids, bsz, seq, input_ids.device, needs_grad)
        for block in self.layers.values():
            h = block(h, cos, sin, mask)
        h = self.norm(h)
        return self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
