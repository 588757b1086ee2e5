"""μP inside the model: at m = 1 it is the standard model bit for bit; at m > 1 the hidden init, the logits, the
attention scale and Gemma's embedding multiplier follow the μP rules; HF export refuses what HF cannot compute;
parameter roles survive the parallel wrappers."""

from __future__ import annotations

import math
import pytest
import torch

from maester.config import ModelConfig, MupConfig, ParallelConfig
from maester.models.args import TransformerArgs
from maester.models.build import build_model, resolve_args
from maester.models.hf import HFFormatError, check_convertible
from maester.models.transformer import canonical_parameter_name, parameter_roles

CPU = torch.device("cpu")
VOCAB = 269  # the byte tokenizer's; the model rounds it up to 320
BASE = 64  # the tiny flavors' width


def build(name: str = "llama", width: int | None = None, mup: MupConfig | None = None, seed: int = 0,
          **overrides) -> torch.nn.Module:
    cfg = ModelConfig(name=name, flavor="tiny", width=width, attention="sdpa", overrides=overrides)
    return build_model(cfg, VOCAB, CPU, seed, mup).eval()


def ids(seed: int = 1, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def logits(model: torch.nn.Module, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids(), **kwargs)


def mup(**fields) -> MupConfig:
    return MupConfig(enabled=True, **{"base_width": BASE, **fields})


# ---------------------------------------------------------------- m = 1 is the standard model


@pytest.mark.parametrize("name, tied", [("llama", False), ("llama", True), ("gemma3", True), ("gemma3", False)])
def test_at_width_multiplier_one_mup_is_the_standard_model_bit_for_bit(name, tied):
    plain = build(name, tie_embeddings=tied)
    with_mup = build(name, mup=mup(), tie_embeddings=tied)
    # base_head_dim equal to the model's own is the same model too
    explicit = build(name, mup=mup(base_head_dim=16), tie_embeddings=tied)
    assert with_mup.args.mup and with_mup.args.width_mult == 1.0 and not plain.args.mup
    expected = plain.state_dict()
    for model in (with_mup, explicit):
        state = model.state_dict()
        assert list(state) == list(expected)
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        assert torch.equal(logits(model), logits(plain))
    # documents and sliding windows take the same path
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    assert torch.equal(logits(with_mup, document_ids=docs), logits(plain, document_ids=docs))


def test_zero_inits_change_only_their_own_matrices():
    plain = build(seed=4).state_dict()
    zeroed = build(mup=mup(zero_init_query=True, zero_init_readout=True), seed=4).state_dict()
    changed = {k for k in plain if not torch.equal(plain[k], zeroed[k])}
    assert changed == {"layers.0.attention.q_proj.weight", "layers.1.attention.q_proj.weight", "output.weight"}
    assert all(not zeroed[k].any() for k in changed)


# ---------------------------------------------------------------- m = 4


def _std(state: dict, suffix: str) -> float:
    return torch.cat([v.flatten() for k, v in state.items() if k.endswith(suffix)]).std().item()


def test_hidden_init_std_shrinks_by_sqrt_m_and_embedding_and_readout_keep_theirs():
    plain = build(width=256)  # m = 4 against the tiny flavor's 64
    with_mup = build(width=256, mup=mup())
    assert with_mup.args.width_mult == 4.0
    sp, mp_ = plain.state_dict(), with_mup.state_dict()
    trunc = 0.9866  # the std of a normal truncated at 3 sigma, relative to sigma
    out_std = 0.02 / math.sqrt(2 * plain.args.n_layers)
    for suffix, sp_std in [("q_proj.weight", 0.02), ("k_proj.weight", 0.02), ("v_proj.weight", 0.02),
                           ("gate_proj.weight", 0.02), ("up_proj.weight", 0.02),
                           ("o_proj.weight", out_std), ("down_proj.weight", out_std)]:
        assert _std(sp, suffix) == pytest.approx(sp_std * trunc, rel=0.03), suffix
        assert _std(mp_, suffix) == pytest.approx(sp_std * trunc / 2, rel=0.03), suffix
        assert _std(mp_, suffix) / _std(sp, suffix) == pytest.approx(0.5, rel=1e-3), suffix
    for key in ("tok_embeddings.weight", "output.weight"):
        assert torch.equal(mp_[key], sp[key]), key
    # the norms start as in the standard model
    assert all(torch.equal(mp_[k], sp[k]) for k in sp if "norm" in k)


@pytest.mark.parametrize("name, width, alpha, tied", [("llama", 256, 2.0, False), ("llama", 256, 1.0, True),
                                                      ("gemma3", None, 0.25, True)])
def test_logits_are_the_standard_logits_times_alpha_over_m(name, width, alpha, tied):
    """The same weights in both models, so that only the output multiplier differs; it is a power of two, so the
    product is exact."""
    plain = build(name, width=width, tie_embeddings=tied)
    with_mup = build(name, width=width, mup=mup(output_alpha=alpha), tie_embeddings=tied)
    m = with_mup.args.width_mult
    assert with_mup.args.output_multiplier == alpha / m
    assert with_mup.args.attention_scale == plain.args.attention_scale
    assert with_mup.args.embedding_multiplier == plain.args.embedding_multiplier
    with_mup.load_state_dict(plain.state_dict())
    assert torch.equal(logits(with_mup), logits(plain) * (alpha / m))


# ---------------------------------------------------------------- attention scale


def test_attention_scale_values():
    assert build(mup=mup()).args.attention_scale == 16 ** -0.5  # head dim fixed: the standard scale
    for head_dim in (16, 32, 64):  # head dim grows from a base of 16: the scale goes as 1/head_dim
        cfg = ModelConfig(flavor="tiny", overrides={"head_dim": head_dim})
        args = resolve_args(cfg, VOCAB, mup(base_head_dim=16))
        assert args.attention_scale == pytest.approx(math.sqrt(16) / head_dim, rel=1e-12)
        assert resolve_args(cfg, VOCAB).attention_scale == pytest.approx(head_dim ** -0.5, rel=1e-12)
    # Gemma's query_pre_attn_scalar gives the standard scale, which μP multiplies by sqrt(base / head_dim)
    gemma = resolve_args(ModelConfig(name="gemma3", flavor="tiny", overrides={"query_pre_attn_scalar": 64}),
                         VOCAB, mup(base_head_dim=4))
    assert gemma.attention_scale == pytest.approx(64 ** -0.5 * math.sqrt(4 / 16), rel=1e-12)


def test_the_model_attends_with_the_mup_scale():
    """Llama has no QK-norm and RoPE is linear, so scaling the queries by f is scaling the scores by f."""
    plain = build(seed=2)
    with_mup = build(mup=mup(base_head_dim=4), seed=2)  # m = 1, scale x sqrt(4 / 16) = 1/2
    assert with_mup.layers["0"].attention.scale == pytest.approx(16 ** -0.5 / 2)
    assert plain.layers["0"].attention.scale is None  # the kernel's own 1/sqrt(head_dim)
    state = plain.state_dict()
    with_mup.load_state_dict(state)
    plain.load_state_dict({k: v / 2 if k.endswith("q_proj.weight") else v for k, v in state.items()})
    torch.testing.assert_close(logits(with_mup), logits(plain), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(logits(with_mup), logits(build(seed=2)), atol=1e-4)  # the scale does change them


# ---------------------------------------------------------------- embeddings


def test_gemma_embedding_multiplier_uses_the_base_width():
    plain = build("gemma3", width=256)
    with_mup = build("gemma3", width=256, mup=mup(input_alpha=2.0))
    assert plain.args.embedding_multiplier == 16.0  # sqrt(256)
    assert with_mup.args.embedding_multiplier == 8.0 * 2.0  # sqrt(64) x input_alpha
    assert build("llama", width=256, mup=mup(input_alpha=2.0)).args.embedding_multiplier == 2.0
    seen = []
    with_mup.layers["0"].register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    logits(with_mup)
    torch.testing.assert_close(seen[0], with_mup.tok_embeddings.weight[ids()] * 16.0, rtol=0, atol=0)


# ---------------------------------------------------------------- arguments and export


def test_mup_arguments_are_validated_by_name():
    args = build().args.model_dump()
    with pytest.raises(ValueError, match="mup.enabled is false"):
        TransformerArgs(**{**args, "mup": {"output_alpha": 2.0}})
    with pytest.raises(ValueError, match="base_width"):
        TransformerArgs(**{**args, "mup": {"enabled": True, "base_width": 0}})
    with pytest.raises(ValueError, match="input_alpha"):
        TransformerArgs(**{**args, "mup": {"enabled": True, "base_width": 64, "input_alpha": 0.0}})
    with pytest.raises(ValueError, match="mup.zero_init_readout needs an untied output layer"):
        TransformerArgs(**{**args, "mup": {"enabled": True, "base_width": 64, "zero_init_readout": True},
                           "tie_embeddings": True})
    assert TransformerArgs(**{**args, "mup": {"enabled": True, "base_width": 32}}).width_mult == 2.0
    assert TransformerArgs(**args).width_mult == 1.0 and TransformerArgs(**args).output_multiplier == 1.0


@pytest.mark.parametrize("name, width, fields, changed", [
    ("llama", 256, {}, "output_multiplier 0.25"),
    ("llama", None, {"input_alpha": 2.0}, "embedding_multiplier 2"),
    ("llama", None, {"output_alpha": 0.5}, "output_multiplier 0.5"),
    ("llama", None, {"base_head_dim": 4}, "attention_scale 0.125"),
    # logits x 4 / 4, but Gemma's embeddings take sqrt(base width) instead of sqrt(dim)
    ("gemma3", 256, {"output_alpha": 4.0}, "embedding_multiplier 8 (without μP 16)"),
])
def test_export_refuses_a_mup_model_hf_cannot_compute(name, width, fields, changed):
    args = resolve_args(ModelConfig(name=name, flavor="tiny", width=width), VOCAB, mup(**fields))
    with pytest.raises(HFFormatError, match="uses mup") as error:
        check_convertible(name, args)
    assert changed in str(error.value)


@pytest.mark.parametrize("name, width, fields", [
    ("llama", None, {}), ("gemma3", None, {}), ("llama", None, {"zero_init_readout": True, "zero_init_query": True}),
    ("llama", 256, {"output_alpha": 4.0}),  # m = 4 with alpha = m computes the standard logits
])
def test_export_takes_a_mup_model_that_computes_the_standard_function(name, width, fields):
    check_convertible(name, resolve_args(ModelConfig(name=name, flavor="tiny", width=width), VOCAB, mup(**fields)))


# ---------------------------------------------------------------- parameter roles


def _expected_roles(args) -> dict[str, str]:
    roles = {"tok_embeddings.weight": "embedding", "norm.weight": "vector"}
    if not args.tie_embeddings:
        roles["output.weight"] = "readout"
    gated = ("gate_proj", "up_proj", "down_proj")
    for i in range(args.n_layers):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            roles[f"layers.{i}.attention.{proj}.weight"] = "hidden"
        for proj in gated if args.mlp != "gelu" else gated[1:]:
            roles[f"layers.{i}.feed_forward.{proj}.weight"] = "hidden"
    return roles


@pytest.mark.parametrize("name, tied", [("llama", False), ("llama", True), ("gpt_neox", False)])
def test_parameter_roles_of_a_plain_model(name, tied):
    model = build(name, tie_embeddings=tied)
    roles = parameter_roles(model)
    assert list(roles) == [n for n, _ in model.named_parameters()]
    expected = _expected_roles(model.args)
    assert {k: v for k, v in roles.items() if k in expected} == expected
    others = {k: v for k, v in roles.items() if k not in expected}
    assert others and set(others.values()) == {"vector"}  # norm gains (and GPT-NeoX's norm and linear biases)
    assert all(k.endswith((".weight", ".bias")) and ("norm" in k or k.endswith(".bias")) for k in others)


def test_parameter_roles_see_through_checkpointing_and_compile():
    from maester.parallel.dims import ParallelDims
    from maester.parallel.parallelize import parallelize

    bare = parameter_roles(build())
    model = parallelize(build(), ParallelDims(1, 1, 1, 1), ParallelConfig(activation_checkpointing="full",
                                                                        compile=True), CPU)
    raw = [n for n, _ in model.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in raw) and any("_orig_mod." in n for n in raw)
    assert parameter_roles(model) == bare
    assert canonical_parameter_name("layers.0._orig_mod._checkpoint_wrapped_module.attention.q_proj.weight") == \
        "layers.0.attention.q_proj.weight"


def test_a_matrix_outside_the_blocks_has_no_role():
    model = build()
    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2, 2)))
    with pytest.raises(ValueError, match="parameter extra .* has no μP role"):
        parameter_roles(model)


def test_parameter_roles_under_fsdp2():
    """FSDP2 on a one-process gloo group: the parameters become DTensors of the full shape, names unchanged."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from maester.parallel.parallelize import apply_activation_checkpointing, apply_fsdp

    bare = parameter_roles(build())
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = build()
        apply_activation_checkpointing(model, "selective-op", every=1)
        apply_fsdp(model, init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",)), ParallelConfig(), CPU)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert parameter_roles(model) == bare
    finally:
        dist.destroy_process_group()


def test_mup_multipliers_under_tensor_parallel():
    """The output multiplier acts on the sequence-sharded hidden state that feeds the vocabulary-sharded head: a
    one-process TP mesh runs that DTensor path and must give the unsharded model's logits."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from maester.parallel.parallelize import apply_tensor_parallel, uses_loss_parallel

    settings = dict(width=128, mup=mup(output_alpha=3.0, input_alpha=0.5, base_head_dim=8), seed=5)
    reference = build(**settings)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = build(**settings)
        apply_tensor_parallel(model, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        assert uses_loss_parallel(model)
        out = logits(model)
        assert isinstance(out, DTensor)
        torch.testing.assert_close(out.full_tensor(), logits(reference), rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()
