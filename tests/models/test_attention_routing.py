"""Which kernel each attention call gets on a GPU, decided without one: the routing (F5), one dtype into the
kernel under autocast (F6), document offsets made on the host (F16), SDPA's backend order (F18) and the compile
that selective checkpointing with FlexAttention needs (F12). The CUDA tests run on a GPU (`-m cuda`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from maester.config import load_config
from maester.data.batch import BatchPlan
from maester.data.batch import make_batch
from maester.models import layers
from maester.models.build import build_model
from maester.models.layers import document_offsets, resolve_attention, sdpa_priority

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("choice, device, documents, window, seq, expected", [
    ("auto", CUDA, True, None, 128, "flex"),      # documents need a mask
    ("auto", CUDA, False, 64, 128, "flex"),       # so does a sliding window shorter than the sequence
    ("auto", CUDA, False, 128, 128, "sdpa"),      # a window as long as the sequence is plain causal
    ("auto", CUDA, False, None, 128, "sdpa"),
    ("auto", CPU, True, 64, 128, "sdpa"),         # flex has no backward on CPU
    ("sdpa", CUDA, True, None, 128, "sdpa"),      # an explicit choice is kept
    ("varlen", CUDA, True, None, 128, "varlen"),
])
def test_auto_routes_every_masked_cuda_call_to_flex(choice, device, documents, window, seq, expected):
    assert resolve_attention(choice, device, documents, window, seq) == expected


@pytest.mark.parametrize("choice, device, expected", [
    ("auto", CUDA, "flex"),   # soft-capped scores: no SDPA kernel caps them
    ("auto", CPU, "eager"),   # flex has no backward on CPU
    ("sdpa", CUDA, "eager"),
    ("sdpa", CPU, "eager"),
    ("flex", CPU, "flex"),
])
def test_soft_capped_attention_routes_to_a_backend_that_caps(choice, device, expected):
    assert resolve_attention(choice, device, False, None, 128, softcap=True) == expected
    assert resolve_attention(choice, device, True, 64, 128, softcap=True) == expected


def test_soft_capping_is_never_dropped():
    from maester.models.args import TransformerArgs

    with pytest.raises(ValueError, match="varlen.*attn_logit_softcap"):
        resolve_attention("varlen", CUDA, True, None, 128, softcap=True)
    with pytest.raises(ValueError, match="varlen"):
        TransformerArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=128, attn_logit_softcap=50.0,
                        attention="varlen")
    q = k = v = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="cannot cap"):  # a mask built for SDPA
        layers.attend(q, k, v, layers.attention_mask("sdpa", None, 1, 8, CPU, needs_grad=False), softcap=5.0)


def test_soft_capped_attention_is_the_same_on_every_path():
    """Gemma 2 (soft-capped scores) on the eager path and on FlexAttention (forward on CPU), with packed
    documents and sliding windows; and with the KV cache."""
    from maester.models.transformer import KVCache, Transformer

    def gemma2(**changes):
        base = tiny("gemma2")
        model = Transformer(base.args.model_copy(update={"attn_logit_softcap": 1.0, **changes}))
        model.init_weights()  # the RoPE tables, which the state dict does not hold
        model.load_state_dict(state)
        return model

    state = {k: v + torch.randn_like(v) * 0.2 for k, v in tiny("gemma2").state_dict().items()}
    tokens = torch.randint(0, 256, (2, 20))
    docs = torch.tensor([[0] * 12 + [1] * 8, [0] * 20])
    eager, flex = gemma2(attention="sdpa"), gemma2(attention="flex")
    with torch.no_grad():
        expected = eager(tokens, document_ids=docs)
        torch.testing.assert_close(flex(tokens, document_ids=docs), expected, rtol=0, atol=1e-5)
        full = eager(tokens)
        cache = KVCache(eager.args, 2, 20, CPU, torch.float32)
        steps = [eager(tokens[:, :9], cache=cache)] + [eager(tokens[:, i:i + 1], cache=cache) for i in range(9, 20)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)
        assert (gemma2(attn_logit_softcap=None)(tokens) - full).abs().max() > 1e-2  # the cap was in force


def tiny(name: str, precision_dtype=None):
    cfg = load_config(None, [f"--model.name={name}", "--model.flavor=tiny"], environ={})
    return build_model(cfg.model, 256, CPU, 0, cfg.mup)


@pytest.mark.parametrize("name", ["qwen3", "olmo2", "gemma3"])
def test_qk_norm_models_give_the_kernel_one_dtype_under_autocast(name, monkeypatch):
    seen = []
    original = F.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    model = tiny(name)  # float32 weights: the QK-norm output is float32 while v is bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 256, (2, 16)))
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen


def test_loader_offsets_equal_the_device_computation():
    rows = torch.randint(3, 50, (3, 65))
    rows[0, [5, 20, 21]] = 1
    rows[2, 40] = 1
    batch = make_batch(rows, document_masking=True, eos_id=1)
    assert batch.document_offsets.dtype == torch.int32
    assert torch.equal(batch.document_offsets, document_offsets(batch.document_ids, 3, 64, CPU))
    assert make_batch(rows, document_masking=False, eos_id=1).document_offsets is None


def test_sft_batches_carry_offsets(tmp_path):
    import json

    from maester.data.loader import build_loader
    from maester.data.tokenizers import build_tokenizer
    from tests.data.test_sft import write_conversations

    chats = tmp_path / "chats.jsonl"
    write_conversations(chats, 20)
    cfg = load_config(None, ["--data.mode=sft", "--data.seq_len=128",
                             f"--data.sources={json.dumps([{'path': str(chats)}])}"], environ={})
    loader = build_loader(cfg.data, cfg.tokenizer, build_tokenizer(cfg.tokenizer), seed=0,
                          batch=BatchPlan(4, 2))
    for batch in loader.next_step():
        assert torch.equal(batch.document_offsets, document_offsets(batch.document_ids, 2, 128, CPU))


def micro_batches_with_documents(n: int = 3) -> list:
    g = torch.Generator().manual_seed(0)
    batches = []
    for i in range(n):
        rows = torch.randint(2, 50, (2, 65), generator=g)
        rows[0, 4:4 + 6 * i:6] = 1  # i end-of-document tokens: a different count of documents each
        rows[1, 30 - 5 * i] = 1
        batches.append(make_batch(rows, document_masking=True, eos_id=1))
    return batches


def test_pipeline_stages_get_each_micro_batchs_document_offsets():
    """F16 under PP: the offsets go to the stages as one host tensor that torch's pipelining splits like every
    argument (its own split_args_kwargs_into_chunks), and each stage reads its micro-batch's back on the host."""
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    batches = micro_batches_with_documents()
    assert len({len(b.document_offsets) for b in batches}) > 1
    packed = layers.pack_offsets([b.document_offsets for b in batches])
    joined = torch.cat([b.position_ids for b in batches])
    _, chunks = split_args_kwargs_into_chunks((), {"document_offsets": packed, "position_ids": joined}, len(batches))
    for batch, chunk in zip(batches, chunks):
        assert torch.equal(chunk["position_ids"], batch.position_ids)
        assert torch.equal(layers.unpack_offsets(chunk["document_offsets"]), batch.document_offsets)
    # a batch moved to the device keeps its offsets on the host, where they were made
    assert batches[0].to(CPU).document_offsets.device == CPU


@pytest.mark.cuda
@needs_cuda
def test_varlen_takes_host_offsets_without_waiting_for_the_gpu():  # pragma: no cover - GPU check
    """F16 on a GPU: a batch's host offsets, and a pipeline stage's row of packed ones, become the same cu_seqlens
    on the device with no synchronisation."""
    import warnings

    batches = micro_batches_with_documents()
    cuda_batch = batches[1].to(CUDA)
    assert cuda_batch.document_offsets.is_pinned()
    row = layers.pack_offsets([b.document_offsets for b in batches]).pin_memory()[1:2]
    masks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for offsets in (cuda_batch.document_offsets, row):
                masks.append(layers.attention_mask("varlen", cuda_batch.document_ids, 2, 64, CUDA, True,
                                                   offsets=offsets))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert not [w for w in caught if "synchroniz" in str(w.message).lower()]
    for mask in masks:
        assert torch.equal(mask.cu_seqlens.cpu(), batches[1].document_offsets)


def test_sdpa_keeps_torch_order_off_hopper():
    assert sdpa_priority(CPU) is None


@pytest.mark.parametrize("attention, documents, window, compile_, device, expected", [
    ("auto", True, None, False, "cuda", True),
    ("flex", False, None, False, "cuda", True),
    ("auto", False, 64, False, "cuda", True),
    ("auto", False, None, False, "cuda", False),   # no mask: SDPA
    ("auto", True, None, True, "cuda", False),     # compiled already
    ("auto", True, None, False, "cpu", False),     # CPU: SDPA
    ("sdpa", True, None, False, "cuda", False),
])
def test_selective_checkpointing_with_flex_forces_compile(attention, documents, window, compile_, device, expected):
    from types import SimpleNamespace

    from maester.config import ParallelConfig
    from maester.parallel.parallelize import selective_checkpointing_needs_compile

    parallel = ParallelConfig(activation_checkpointing="selective-op", compile=compile_)
    args = SimpleNamespace(attention=attention, sliding_window=window, attn_logit_softcap=None)
    assert selective_checkpointing_needs_compile(parallel, args, documents, 128, device) is expected
    full = ParallelConfig(activation_checkpointing="full", compile=False)
    assert not selective_checkpointing_needs_compile(full, args, documents, 128, device)
    if attention == "auto" and device == "cuda" and not compile_:
        # Soft-capped attention scores (Gemma 2) go to flex on CUDA even without a mask.
        capped = SimpleNamespace(attention=attention, sliding_window=None, attn_logit_softcap=50.0)
        assert selective_checkpointing_needs_compile(parallel, capped, False, 128, device)


@pytest.mark.parametrize("attention, device, expected", [
    ("auto", "cuda", True), ("sdpa", "cuda", False), ("auto", "cpu", False)])
def test_context_parallel_with_selective_checkpointing_forces_compile(attention, device, expected):
    """N6: pretraining without documents under cp > 1 still masks (the local queries attend over every cp rank's
    keys), so `auto` resolves to flex on CUDA and eager selective checkpointing would wrap compiled flex."""
    from types import SimpleNamespace

    from maester.config import ParallelConfig
    from maester.parallel.parallelize import selective_checkpointing_needs_compile

    args = SimpleNamespace(attention=attention, sliding_window=None, attn_logit_softcap=None)
    assert layers.resolve_attention(attention, torch.device(device), True) == ("flex" if expected else "sdpa")
    cp = ParallelConfig(activation_checkpointing="selective-op", compile=False, cp=2)
    assert selective_checkpointing_needs_compile(cp, args, False, 128, device) is expected
    assert not selective_checkpointing_needs_compile(cp.model_copy(update={"cp": 1}), args, False, 128, device)


def sdpa_kernels_run(fn) -> set[str]:
    """The SDPA kernels (aten ops) that `fn()` dispatches to, as the profiler records them. Restricting the backends
    from outside proves nothing: `attend` sets its own priority list (with MATH last) on Hopper."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product")}


def masked_grouped_attention(device: torch.device, dtype: torch.dtype):
    q = torch.randn(2, 8, 256, 64, device=device, dtype=dtype)
    k = v = torch.randn(2, 2, 256, 64, device=device, dtype=dtype)
    ids = torch.zeros(2, 256, dtype=torch.long, device=device)
    ids[:, 100:] = 1
    mask = layers.attention_mask("sdpa", ids, 2, 256, device, needs_grad=False)
    return lambda: layers.attend(q, k, v, mask)


def test_the_kernel_check_sees_the_math_kernel():
    """The check of the CUDA test below can fail: forced to the math kernel, it names it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    attention = masked_grouped_attention(CPU, torch.float32)
    assert "aten::_scaled_dot_product_attention_math" not in sdpa_kernels_run(attention)
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_kernels_run(attention) == {"aten::_scaled_dot_product_attention_math"}


@pytest.mark.cuda
@needs_cuda
def test_masked_grouped_sdpa_avoids_the_math_kernel():  # pragma: no cover - GPU check
    """F5 on a GPU (N9): masked grouped-query SDPA, with the backend order `attend` itself sets, runs a fused
    kernel, never math."""
    ran = sdpa_kernels_run(masked_grouped_attention(CUDA, torch.bfloat16))
    assert "aten::_scaled_dot_product_attention_math" not in ran, ran
    assert ran & {"aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
                  "aten::_scaled_dot_product_flash_attention"}, ran


@pytest.mark.cuda
@needs_cuda
def test_varlen_takes_qk_norm_models_with_float32_weights():  # pragma: no cover - GPU check
    model = tiny("qwen3").cuda()
    model.args.attention = "varlen"
    tokens = torch.randint(0, 256, (2, 64), device="cuda")
    ids = torch.zeros(2, 64, dtype=torch.long, device="cuda")
    ids[:, 30:] = 1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(tokens, document_ids=ids, labels=tokens)
    loss.backward()
    assert torch.isfinite(loss)


@pytest.mark.cuda
@needs_cuda
def test_hopper_prefers_cudnn_then_flash():  # pragma: no cover - GPU check
    from torch.nn.attention import SDPBackend

    order = sdpa_priority(torch.device("cuda", 0))
    if torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0):
        assert order[:2] == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
    else:
        assert order is None
