"""The Llama model: causality, document masking, published sizes, meta-device init, RoPE scaling, GQA."""

from __future__ import annotations

import math

import pytest
import torch

from maester.config import ModelConfig
from maester.models.build import build_model, build_on_meta, count_parameters, materialize, resolve_args
from maester.models.layers import rope_inverse_frequencies
from maester.models.args import RopeScaling

CPU = torch.device("cpu")
BYTE_VOCAB = 269  # the byte tokenizer's vocabulary; the model rounds it up to 320


def tiny_model(seed: int = 0, **overrides) -> torch.nn.Module:
    cfg = ModelConfig(flavor="tiny", overrides=overrides)
    model = build_model(cfg, BYTE_VOCAB, CPU, seed)
    return model.eval()


def random_ids(shape, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- causality


@pytest.mark.parametrize("with_document_ids", [False, True], ids=["is_causal", "mask"])
def test_changing_a_later_token_never_changes_earlier_logits(with_document_ids):
    model = tiny_model()
    vocab = model.args.vocab_size
    seq = 24
    ids = random_ids((2, seq), vocab, seed=1)
    kwargs = {}
    if with_document_ids:  # one document per row: the explicit-mask path must be causal too
        kwargs["document_ids"] = torch.zeros(2, seq, dtype=torch.long)
    with torch.no_grad():
        base = model(ids, **kwargs)
        for t in (0, 5, 17, seq - 2):
            for k in (1, 3):
                if t + k >= seq:
                    continue
                changed = ids.clone()
                changed[:, t + k] = (changed[:, t + k] + 1 + k) % vocab
                out = model(changed, **kwargs)
                torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
                # ... and the change is visible from position t + k on (the test can see a difference).
                assert (out[:, t + k] - base[:, t + k]).abs().max() > 1e-4


# ---------------------------------------------------------------- document masking


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_packed_documents_match_each_document_alone(tied):
    model = tiny_model(seed=3, tie_embeddings=tied)
    assert (model.output is None) == tied
    vocab = model.args.vocab_size
    lengths = (7, 11, 5)
    docs = [random_ids((1, n), vocab, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(docs, dim=1)
    document_ids = torch.cat([torch.full((1, n), i) for i, n in enumerate(lengths)], dim=1)
    position_ids = torch.cat([torch.arange(n)[None] for n in lengths], dim=1)
    with torch.no_grad():
        out = model(packed, position_ids=position_ids, document_ids=document_ids)
        assert out.shape == (1, sum(lengths), vocab)
        start = 0
        for doc in docs:
            alone = model(doc)
            n = doc.shape[1]
            torch.testing.assert_close(out[:, start:start + n], alone, rtol=0, atol=1e-5)
            start += n
        # Without the mask the later documents do see the earlier ones: the masking is what makes them equal.
        unmasked = model(packed, position_ids=position_ids)
        assert (unmasked[:, lengths[0]:] - out[:, lengths[0]:]).abs().max() > 1e-3


def test_position_ids_are_used_and_only_relative_positions_matter():
    # Inside a document only relative positions matter to RoPE (which is why packed documents match them
    # alone); so check directly that the model honours `position_ids` rather than counting 0..seq-1 itself.
    model = tiny_model(seed=4)
    ids = random_ids((2, 12), model.args.vocab_size, seed=6)
    positions = torch.arange(12).expand(2, 12)
    with torch.no_grad():
        base = model(ids)
        torch.testing.assert_close(model(ids, position_ids=positions), base, rtol=0, atol=0)
        torch.testing.assert_close(model(ids, position_ids=positions + 37), base, rtol=0, atol=1e-4)
        stretched = model(ids, position_ids=positions * 3)
        assert (stretched[:, 1:] - base[:, 1:]).abs().max() > 1e-3
        # Position 0 attends only to itself: its logits do not depend on the positions at all.
        torch.testing.assert_close(stretched[:, 0], base[:, 0], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- published sizes


@pytest.mark.parametrize("flavor,expected", [
    ("1B", 1_235_814_400),
    ("3B", 3_212_749_824),
    ("8B", 8_030_261_248),
    ("70B", 70_553_706_496),
])
def test_real_flavors_have_the_published_parameter_counts(flavor, expected):
    cfg = ModelConfig(flavor=flavor)
    model = build_on_meta(cfg, resolve_args(cfg, 128256))
    assert all(p.is_meta for p in model.parameters())
    assert model.args.vocab_size == 128256
    assert count_parameters(model) == expected


# ---------------------------------------------------------------- meta construction and materialisation


def test_materialize_is_a_function_of_the_seed():
    cfg = ModelConfig(flavor="tiny")
    args = resolve_args(cfg, BYTE_VOCAB)

    def build(seed):
        return materialize(build_on_meta(cfg, args), CPU, seed)

    torch.manual_seed(1234)
    expected_next = torch.rand(4)
    torch.manual_seed(1234)
    a = build(7)
    # Initialisation draws from a forked generator: the caller's random stream is left alone.
    torch.testing.assert_close(torch.rand(4), expected_next, rtol=0, atol=0)
    b, c = build(7), build(8)

    for model in (a, b, c):
        assert not any(t.is_meta for t in model.parameters())
        assert not any(t.is_meta for t in model.buffers())
        assert all(t.device == CPU for t in model.state_dict().values())
        assert all(torch.isfinite(p).all() for p in model.parameters())
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        torch.testing.assert_close(sa[name], sb[name], rtol=0, atol=0, msg=f"{name} differs for the same seed")
    randomly_initialised = [n for n in sa if not n.endswith("norm.weight")]
    assert randomly_initialised
    for name in randomly_initialised:
        assert not torch.equal(sa[name], sc[name]), f"{name} is the same for another seed"
    # Norms start at one; the RoPE table is filled in (not left as uninitialised memory).
    for name in sa:
        if name.endswith("norm.weight"):
            assert torch.equal(sa[name], torch.ones_like(sa[name]))
    torch.testing.assert_close(a.rotary.inv_freq, rope_inverse_frequencies(16, 10000.0), rtol=0, atol=0)


# ---------------------------------------------------------------- RoPE scaling (Llama 3.1)


def reference_llama31_scaling(freqs: list[float], factor: float, low_freq_factor: float,
                              high_freq_factor: float, original: int) -> list[float]:
    """Meta's published `apply_scaling`, in plain Python floats."""
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


def test_rope_llama31_scaling_matches_the_published_formula():
    head_dim, theta = 128, 500000.0
    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
    base = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    expected = torch.tensor(reference_llama31_scaling(base, 8.0, 1.0, 4.0, 8192), dtype=torch.float64)

    unscaled = rope_inverse_frequencies(head_dim, theta)
    scaled = rope_inverse_frequencies(head_dim, theta, scaling)
    assert unscaled.shape == scaled.shape == (head_dim // 2,)
    torch.testing.assert_close(unscaled.double(), torch.tensor(base, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(scaled.double(), expected, rtol=1e-5, atol=0)

    wavelen = 2 * math.pi / torch.tensor(base, dtype=torch.float64)
    high = wavelen < 8192 / 4.0
    low = wavelen > 8192 / 1.0
    medium = ~high & ~low
    assert high.sum() > 0 and low.sum() > 0 and medium.sum() > 0  # the test exercises all three bands
    # High frequencies (short wavelengths) unchanged; low frequencies divided by the factor.
    assert torch.equal(scaled[high], unscaled[high])
    torch.testing.assert_close(scaled[low], unscaled[low] / 8.0, rtol=1e-6, atol=0)
    # In between the ratio falls smoothly and monotonically from 1 to 1/factor.
    ratio = (scaled.double() / unscaled.double())
    assert torch.all(ratio[1:] <= ratio[:-1] + 1e-7)
    assert torch.all((ratio[medium] < 1.0) & (ratio[medium] > 1 / 8.0))
    # The interpolation is in 1/wavelength: ratio = s + (1 - s)/factor with s linear in original/wavelen.
    s = (8192 / wavelen[medium] - 1.0) / (4.0 - 1.0)
    torch.testing.assert_close(ratio[medium], s + (1 - s) / 8.0, rtol=1e-5, atol=0)


def test_rope_scaling_is_used_by_the_model():
    cfg = ModelConfig(flavor="tiny", overrides={"rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 64}})
    model = build_model(cfg, BYTE_VOCAB, CPU, 0)
    expected = rope_inverse_frequencies(16, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=64))
    torch.testing.assert_close(model.rotary.inv_freq, expected, rtol=0, atol=0)
    assert not torch.equal(model.rotary.inv_freq, rope_inverse_frequencies(16, 10000.0))


# ---------------------------------------------------------------- grouped-query attention


def test_gqa_output_shape_and_equivalence_to_repeated_kv_heads():
    gqa = tiny_model(seed=5)
    args = gqa.args
    assert args.n_kv_heads < args.n_heads
    ids = random_ids((3, 13), args.vocab_size, seed=2)
    with torch.no_grad():
        out = gqa(ids)
    assert out.shape == (3, 13, args.vocab_size)
    assert torch.isfinite(out).all()

    # The same model with every KV head repeated for its group of query heads is multi-head attention.
    mha = tiny_model(seed=5, n_kv_heads=args.n_heads)
    group, hd = args.n_heads // args.n_kv_heads, args.resolved_head_dim
    state = {}
    for name, tensor in gqa.state_dict().items():
        if name.endswith(("attention.k_proj.weight", "attention.v_proj.weight")):
            tensor = tensor.view(args.n_kv_heads, hd, args.dim).repeat_interleave(group, dim=0)
            tensor = tensor.reshape(args.n_heads * hd, args.dim)
        state[name] = tensor
    mha.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(mha(ids), out, rtol=0, atol=1e-5)
        # Each query head must use its own group's KV head: a wrong grouping gives different logits.
        wrong = dict(state)
        for name, tensor in gqa.state_dict().items():
            if name.endswith(("attention.k_proj.weight", "attention.v_proj.weight")):
                t = tensor.view(args.n_kv_heads, hd, args.dim).repeat(group, 1, 1)
                wrong[name] = t.reshape(args.n_heads * hd, args.dim)
        mha.load_state_dict(wrong)
        assert (mha(ids) - out).abs().max() > 1e-4
