"""Named flavors of each architecture: the published shapes, plus tiny ones for tests and debugging.

Each architecture is a dict of defaults (what makes it Llama or Gemma) applied under every flavor's shape.
The published parameter counts these give are checked in tests/models/test_flavors.py.
"""

from __future__ import annotations

from maester.models.args import MoEArgs, RopeScaling, TransformerArgs


def _family(defaults: dict, shapes: dict[str, dict]) -> dict[str, TransformerArgs]:
    return {name: TransformerArgs(**{**defaults, **shape}) for name, shape in shapes.items()}


LLAMA = dict(norm="rms", norm_eps=1e-5, rope_theta=500000.0)
_LLAMA3_VOCAB = 128256
_LLAMA31 = dict(vocab_size=_LLAMA3_VOCAB, rope_scaling=RopeScaling(factor=8.0))
_LLAMA2 = dict(vocab_size=32000, rope_theta=10000.0, max_seq_len=4096)
_SMOLLM2 = dict(vocab_size=49152, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True)
LLAMA_FLAVORS = _family(LLAMA, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, rope_theta=10000.0),
    # The demo model: small enough to learn byte-level text on a laptop CPU in a couple of minutes.
    "demo": dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_hidden_dim=512, rope_theta=10000.0,
                 max_seq_len=2048),
    # Llama 3.2 (1B, 3B: tied heads), 3.1 / 3.3 (8B, 70B, 405B).
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden_dim=8192, vocab_size=_LLAMA3_VOCAB,
               rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    "3B": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_hidden_dim=8192, vocab_size=_LLAMA3_VOCAB,
               rope_scaling=RopeScaling(factor=32.0), tie_embeddings=True),
    "8B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, **_LLAMA31),
    "70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, **_LLAMA31),
    "405B": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_hidden_dim=53248, **_LLAMA31),
    # Llama 2 (RoPE base 10k, 32k SentencePiece vocabulary, 4k context; grouped-query heads only at 70B).
    "llama2-7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008, **_LLAMA2),
    "llama2-13B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_dim=13824, **_LLAMA2),
    "llama2-70B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, **_LLAMA2),
    # SmolLM2: small Llamas with tied heads and a 49k vocabulary.
    "smollm2-135M": dict(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, ffn_hidden_dim=1536, **_SMOLLM2),
    "smollm2-360M": dict(dim=960, n_layers=32, n_heads=15, n_kv_heads=5, ffn_hidden_dim=2560, **_SMOLLM2),
    "smollm2-1.7B": dict(dim=2048, n_layers=24, n_heads=32, n_kv_heads=32, ffn_hidden_dim=8192,
                         **{**_SMOLLM2, "rope_theta": 130000.0}),
})

# Mistral: Llama's block; 7B v0.1 slides every layer over 4096 tokens, later models attend fully.
MISTRAL = dict(norm="rms", norm_eps=1e-5, rope_theta=10000.0, max_seq_len=32768)
_MISTRAL_7B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336)
MISTRAL_FLAVORS = _family(MISTRAL, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, sliding_window=8),
    "7B-v0.1": dict(**_MISTRAL_7B, vocab_size=32000, sliding_window=4096),
    "7B-v0.3": dict(**_MISTRAL_7B, vocab_size=32768, rope_theta=1_000_000.0),
    "nemo-12B": dict(dim=5120, n_layers=40, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden_dim=14336,
                     vocab_size=131072, rope_theta=1_000_000.0, max_seq_len=1024000),
})

# Gemma 3 text: 5 sliding-window layers per global one, QK-norm, sandwich (1 + w) RMSNorms, tanh-GeGLU,
# embeddings scaled by sqrt(dim), local RoPE base 10k and global 1M (linearly scaled by 8 from 4B up).
GEMMA3 = dict(norm="rms_offset", norm_eps=1e-6, norm_placement="sandwich", qk_norm="head", mlp="geglu",
              rope_theta=1_000_000.0, local_rope_theta=10_000.0, sliding_window_pattern=6, embedding_scale=True,
              tie_embeddings=True, head_dim=256, query_pre_attn_scalar=256)
_GEMMA3_LONG = dict(vocab_size=262208, sliding_window=1024, max_seq_len=131072,
                    rope_scaling=RopeScaling(rope_type="linear", factor=8.0))
GEMMA3_FLAVORS = _family(GEMMA3, {
    "tiny": dict(dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, head_dim=16,
                 query_pre_attn_scalar=16, sliding_window=8),
    "270M": dict(dim=640, n_layers=18, n_heads=4, n_kv_heads=1, ffn_hidden_dim=2048, vocab_size=262144,
                 sliding_window=512, max_seq_len=32768),
    "1B": dict(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, ffn_hidden_dim=6912, vocab_size=262144,
               sliding_window=512, max_seq_len=32768),
    "4B": dict(dim=2560, n_layers=34, n_heads=8, n_kv_heads=4, ffn_hidden_dim=10240, **_GEMMA3_LONG),
    "12B": dict(dim=3840, n_layers=48, n_heads=16, n_kv_heads=8, ffn_hidden_dim=15360, **_GEMMA3_LONG),
    "27B": dict(dim=5376, n_layers=62, n_heads=32, n_kv_heads=16, ffn_hidden_dim=21504, head_dim=128,
                query_pre_attn_scalar=168, **_GEMMA3_LONG),
})

# Gemma 2: Gemma's sandwich (1 + w) RMSNorms, tanh-GeGLU, sqrt(dim) embeddings and tied head; every other layer
# slides over 4096 tokens; attention scores soft-capped at 50 and logits at 30; no QK-norm, one RoPE base.
GEMMA2 = dict(norm="rms_offset", norm_eps=1e-6, norm_placement="sandwich", mlp="geglu", rope_theta=10_000.0,
              sliding_window_pattern=2, embedding_scale=True, tie_embeddings=True, head_dim=256,
              query_pre_attn_scalar=256, attn_logit_softcap=50.0, final_logit_softcap=30.0)
_GEMMA2_PUBLISHED = dict(vocab_size=256000, sliding_window=4096, max_seq_len=8192)
GEMMA2_FLAVORS = _family(GEMMA2, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, head_dim=16,
                 query_pre_attn_scalar=16, sliding_window=8),
    "2B": dict(dim=2304, n_layers=26, n_heads=8, n_kv_heads=4, ffn_hidden_dim=9216, **_GEMMA2_PUBLISHED),
    "9B": dict(dim=3584, n_layers=42, n_heads=16, n_kv_heads=8, ffn_hidden_dim=14336, **_GEMMA2_PUBLISHED),
    "27B": dict(dim=4608, n_layers=46, n_heads=32, n_kv_heads=16, ffn_hidden_dim=36864, head_dim=128,
                query_pre_attn_scalar=144, **_GEMMA2_PUBLISHED),
})

# Qwen 2 and 2.5: Llama with biases on q, k and v (none on the output projection); small sizes tie the head.
# The flavors are Qwen 2.5's shapes (Qwen 2's 0.5B, 1.5B, 7B and 72B are the same).
QWEN2 = dict(norm="rms", norm_eps=1e-6, qkv_bias=True, rope_theta=1_000_000.0, vocab_size=151936, max_seq_len=32768)
QWEN2_FLAVORS = _family(QWEN2, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, vocab_size=None,
                 tie_embeddings=True),
    "0.5B": dict(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_hidden_dim=4864, tie_embeddings=True),
    "1.5B": dict(dim=1536, n_layers=28, n_heads=12, n_kv_heads=2, ffn_hidden_dim=8960, tie_embeddings=True),
    "3B": dict(dim=2048, n_layers=36, n_heads=16, n_kv_heads=2, ffn_hidden_dim=11008, tie_embeddings=True),
    "7B": dict(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_hidden_dim=18944, vocab_size=152064),
    "14B": dict(dim=5120, n_layers=48, n_heads=40, n_kv_heads=8, ffn_hidden_dim=13824, vocab_size=152064),
    "32B": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648, vocab_size=152064),
    "72B": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=29568, vocab_size=152064),
})

# Qwen 3 dense: Llama with per-head QK-norm and head_dim 128; small sizes tie the head.
QWEN3 = dict(norm="rms", norm_eps=1e-6, qk_norm="head", rope_theta=1_000_000.0, head_dim=128, vocab_size=151936,
             max_seq_len=40960)
QWEN3_FLAVORS = _family(QWEN3, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, head_dim=16, vocab_size=None),
    "0.6B": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=3072, tie_embeddings=True),
    "1.7B": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, ffn_hidden_dim=6144, tie_embeddings=True),
    "4B": dict(dim=2560, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=9728, tie_embeddings=True),
    "8B": dict(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_hidden_dim=12288),
    "14B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=8, ffn_hidden_dim=17408),
    "32B": dict(dim=5120, n_layers=64, n_heads=64, n_kv_heads=8, ffn_hidden_dim=25600),
})

# OLMo 2: RMSNorm on each sublayer's output (before the residual add) and QK-norm across all heads.
OLMO2 = dict(norm="rms", norm_eps=1e-6, norm_placement="post", qk_norm="full", rope_theta=500000.0,
             vocab_size=100352, max_seq_len=4096)
OLMO2_FLAVORS = _family(OLMO2, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden_dim=192, vocab_size=None),
    "1B": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_hidden_dim=8192),
    "7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=11008),
    "13B": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_hidden_dim=13824),
    "32B": dict(dim=5120, n_layers=64, n_heads=40, n_kv_heads=8, ffn_hidden_dim=27648),
})

# Phi-3: Llama's block (HF fuses q/k/v and gate/up into one matrix each); the 4k models slide every layer over
# 2047 tokens. The 128k models' LongRoPE is not supported.
PHI3 = dict(norm="rms", norm_eps=1e-5, rope_theta=10000.0, vocab_size=32064, max_seq_len=4096)
PHI3_FLAVORS = _family(PHI3, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=192, vocab_size=None),
    "mini-4k": dict(dim=3072, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=8192, sliding_window=2047),
    "medium-4k": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=10, ffn_hidden_dim=17920, sliding_window=2047),
})

# GPT-NeoX: LayerNorm with bias, parallel residual, RoPE on a quarter of each head, biased projections and a
# plain GELU MLP. Pythia flavors are the suite's published shapes.
GPT_NEOX = dict(norm="layer", norm_eps=1e-5, parallel_residual=True, attention_bias=True, mlp="gelu",
                mlp_bias=True, rotary_fraction=0.25, rope_theta=10000.0, max_seq_len=2048)
GPT_NEOX_FLAVORS = _family(GPT_NEOX, {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_hidden_dim=256),
    "pythia-70m": dict(dim=512, n_layers=6, n_heads=8, n_kv_heads=8, ffn_hidden_dim=2048, vocab_size=50304),
    "pythia-160m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_hidden_dim=3072, vocab_size=50304),
    "pythia-410m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_hidden_dim=4096, vocab_size=50304),
    "pythia-1b": dict(dim=2048, n_layers=16, n_heads=8, n_kv_heads=8, ffn_hidden_dim=8192, vocab_size=50304),
    "pythia-1.4b": dict(dim=2048, n_layers=24, n_heads=16, n_kv_heads=16, ffn_hidden_dim=8192, vocab_size=50304),
    "pythia-2.8b": dict(dim=2560, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=10240,
                        vocab_size=50304),
    "pythia-6.9b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden_dim=16384,
                        vocab_size=50432),
    "pythia-12b": dict(dim=5120, n_layers=36, n_heads=40, n_kv_heads=40, ffn_hidden_dim=20480, vocab_size=50688),
    "20B": dict(dim=6144, n_layers=44, n_heads=64, n_kv_heads=64, ffn_hidden_dim=24576, vocab_size=50432),
})

# Mixtures of experts: the dense family's block with `moe` in place of the MLP (`ffn_hidden_dim` is then the
# experts' hidden size and unused by the model). Tiny flavors route 8 experts top-2.
_TINY_MOE = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=None)


def _moe(n_experts: int, top_k: int, hidden: int, dense_hidden: int | None = None, **kw) -> dict:
    """`dense_hidden`: HF's intermediate_size where it is kept beside the experts' (Qwen 3 MoE); unused."""
    return dict(ffn_hidden_dim=dense_hidden or hidden,
                moe=MoEArgs(n_experts=n_experts, top_k=top_k, expert_hidden_dim=hidden, **kw))


# OLMoE: OLMo's QK-norm across all heads with pre-norm blocks; softmax gates, top-k scores not renormalised,
# load-balancing loss 0.01 (HF's router_aux_loss_coef). OLMoE was trained with a router z-loss of 0.001 too, which
# HF configs do not carry: set moe.z_loss_coef to train as it was (flavors hold what an HF config can).
OLMOE = dict(norm="rms", norm_eps=1e-5, qk_norm="full", rope_theta=10000.0, vocab_size=50304, max_seq_len=4096)
OLMOE_FLAVORS = _family(OLMOE, {
    "tiny": dict(**_TINY_MOE, **_moe(8, 2, 32, aux_loss_coef=0.01)),
    "1B-7B": dict(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, **_moe(64, 8, 1024, aux_loss_coef=0.01)),
})

# Qwen 3 MoE: Qwen 3's block (per-head QK-norm) with 128 experts top-8, renormalised top-k scores.
_QWEN3_MOE_LOSSES = dict(norm_topk_prob=True, aux_loss_coef=0.001)
QWEN3_MOE_FLAVORS = _family(QWEN3, {
    "tiny": dict(**_TINY_MOE, head_dim=16, **_moe(8, 2, 32, **_QWEN3_MOE_LOSSES)),
    "30B-A3B": dict(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4,
                    **_moe(128, 8, 768, dense_hidden=6144, **_QWEN3_MOE_LOSSES)),
    "235B-A22B": dict(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4,
                      **_moe(128, 8, 1536, dense_hidden=12288, **_QWEN3_MOE_LOSSES)),
})

# Mixtral: Mistral's block with 8 experts top-2, gates renormalised over the chosen two; HF's default
# router_aux_loss_coef.
MIXTRAL = dict(norm="rms", norm_eps=1e-5, rope_theta=1_000_000.0, max_seq_len=32768)
MIXTRAL_FLAVORS = _family(MIXTRAL, {
    "tiny": dict(**_TINY_MOE, **_moe(8, 2, 32, norm_topk_prob=True, aux_loss_coef=0.001)),
    "8x7B": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                 **_moe(8, 2, 14336, norm_topk_prob=True, aux_loss_coef=0.001)),
    "8x22B": dict(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, vocab_size=32768, max_seq_len=65536,
                  **_moe(8, 2, 16384, norm_topk_prob=True, aux_loss_coef=0.001)),
})
