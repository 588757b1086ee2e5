"""Logits parity with Hugging Face `transformers` for every architecture, both directions, on tiny random
models built locally (float32, no downloads)."""

from __future__ import annotations

import pytest
import torch

from maester.models.args import MoEArgs, RopeScaling, TransformerArgs
from maester.models.hf import args_from_hf, hf_config, read_hf_config
from maester.models.hf_tensors import read_hf_tensors, state_dict_from_hf, state_dict_to_hf, write_hf_tensors
from maester.models.registry import ARCHITECTURES
from maester.models.transformer import Transformer

transformers = pytest.importorskip("transformers")

VOCAB = 320
# (architecture, overrides of its tiny flavor): each switch of each architecture at least once.
CASES = {
    "llama": ("llama", {}),
    "llama-tied-rope-scaled": ("llama", dict(tie_embeddings=True, rope_scaling=RopeScaling(
        factor=4.0, original_max_position_embeddings=16))),
    "gemma3": ("gemma3", {}),
    "gemma3-linear-rope": ("gemma3", dict(rope_scaling=RopeScaling(rope_type="linear", factor=8.0),
                                          sliding_window_pattern=3, n_layers=4)),
    "mistral": ("mistral", {}),  # v0.1: every layer slides
    "mistral-full": ("mistral", dict(sliding_window=None, rope_theta=1e6)),
    "qwen2": ("qwen2", {}),  # tied, as Qwen 2.5 up to 3B
    "gemma2": ("gemma2", {}),
    # Caps low enough to bind on random weights: ignoring either would show.
    "gemma2-tight-caps": ("gemma2", dict(attn_logit_softcap=2.0, final_logit_softcap=3.0, n_layers=4)),
    "phi3": ("phi3", {}),
    "phi3-window-partial-rotary": ("phi3", dict(sliding_window=8, rotary_fraction=0.5)),
    "qwen3": ("qwen3", {}),
    "qwen3-tied": ("qwen3", dict(tie_embeddings=True)),
    "olmo2": ("olmo2", {}),
    "olmo2-gqa": ("olmo2", dict(n_kv_heads=2)),
    "gpt_neox": ("gpt_neox", {}),
    "gpt_neox-sequential": ("gpt_neox", dict(parallel_residual=False, rotary_fraction=0.5)),
    "olmoe": ("olmoe", {}),  # top-2 of 8 experts, scores not renormalised
    "qwen3_moe": ("qwen3_moe", {}),  # renormalised top-2
    "qwen3_moe-top4-tied": ("qwen3_moe", dict(tie_embeddings=True, moe=MoEArgs(
        n_experts=8, top_k=4, expert_hidden_dim=16, norm_topk_prob=True))),
    "mixtral": ("mixtral", {}),
    "mixtral-window": ("mixtral", dict(sliding_window=8)),
}


def tiny_args(case: str) -> tuple[str, TransformerArgs]:
    name, overrides = CASES[case]
    base = ARCHITECTURES[name].flavors["tiny"].model_dump()
    return name, TransformerArgs(**{**base, "vocab_size": VOCAB, **overrides})


def random_hf_model(name: str, args: TransformerArgs, seed: int = 0):
    """A transformers model of `args` with every parameter random (norm weights included, so a wrong
    (1 + w) or a swapped norm shows)."""
    config = transformers.AutoConfig.for_model(**hf_config(name, args))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def maester_model(args: TransformerArgs, state: dict | None = None) -> Transformer:
    model = Transformer(args.model_copy(update={"attention": "sdpa"}))
    model.init_weights()
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.eval()


def ids(batch: int = 2, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=sorted(CASES))
def hf_dir(request, tmp_path):
    name, args = tiny_args(request.param)
    hf = random_hf_model(name, args)
    hf.save_pretrained(tmp_path / "hf")
    return request.param, name, args, hf, tmp_path / "hf"


def test_hf_to_maester_logits_match(hf_dir):
    case, name, args, hf, path = hf_dir
    read_name, fields = args_from_hf(read_hf_config(path))
    assert read_name == name
    read_args = TransformerArgs(**fields)
    model = maester_model(read_args, state_dict_from_hf(name, read_args, read_hf_tensors(path)))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-4)


def test_maester_to_hf_loads_in_transformers_with_the_same_logits(tmp_path):
    for case in sorted(CASES):
        name, args = tiny_args(case)
        model = maester_model(args)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        out = tmp_path / case
        out.mkdir()
        (out / "config.json").write_text(__import__("json").dumps(hf_config(name, args)))
        write_hf_tensors(out, state_dict_to_hf(name, args, model.state_dict()), max_shard_bytes=10**9)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        x = ids(seed=2)
        with torch.no_grad():
            torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=1e-4, msg=case)


def test_round_trip_gives_identical_tensors(hf_dir):
    case, name, args, hf, path = hf_dir
    original = read_hf_tensors(path)
    back = state_dict_to_hf(name, args, state_dict_from_hf(name, args, dict(original)))
    expected = {k: v for k, v in original.items() if not (args.tie_embeddings and k == "lm_head.weight")}
    assert sorted(back) == sorted(expected)
    for key in expected:
        assert torch.equal(back[key], expected[key]), key


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_generation_with_kv_cache_equals_transformers_generate(case):
    from maester.tools.generate import sample

    name, args = tiny_args(case)
    args = args.model_copy(update={"max_seq_len": 64})
    hf = random_hf_model(name, args, seed=3)
    model = maester_model(args, state_dict_from_hf(name, args, hf.state_dict()))
    prompt = ids(batch=1, seq=12, seed=4)
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                               min_new_tokens=32)[0, 12:].tolist()
    assert len(expected) == 32
    assert sample(model, prompt[0].tolist(), 32) == expected


def test_soft_capped_loss_equals_the_loss_of_transformers_logits():
    """The model's own summed loss (the trainer's path, chunked head) soft-caps its logits as transformers does."""
    import torch.nn.functional as F

    name, args = tiny_args("gemma2-tight-caps")
    hf = random_hf_model(name, args, seed=5)
    model = maester_model(args, state_dict_from_hf(name, args, hf.state_dict()))
    x, labels = ids(seed=6), ids(seed=7)
    labels[0, :5] = -100
    with torch.no_grad():
        expected = F.cross_entropy(hf(x).logits.flatten(0, 1), labels.flatten(), reduction="sum")
        torch.testing.assert_close(model(x, labels=labels), expected, rtol=1e-5, atol=1e-4)


def test_an_unsupported_model_type_lists_the_supported_ones():
    from maester.models.hf import HFFormatError

    with pytest.raises(HFFormatError, match="x/config.json: model_type 'mamba' is not supported") as error:
        args_from_hf({"model_type": "mamba"}, "x/config.json")
    for model_type in ("llama", "mistral", "gemma2", "gemma3_text", "qwen2", "qwen3", "olmo2", "phi3", "gpt_neox"):
        assert f" {model_type}," in str(error.value) or f" {model_type} " in str(error.value), model_type


# case -> (changes to its exported config.json, the refusal naming the key)
REFUSED = {
    "qwen2": (dict(use_sliding_window=True), "use_sliding_window is not supported for qwen2"),
    "mistral": (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types .* every layer"),
    "phi3": (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
             "rope type 'longrope' is not supported"),
    "gemma2": (dict(attn_logit_softcapping=-1.0), "attn_logit_softcapping = -1.0: "),
    "gemma2-tight-caps": (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_config_keys_the_import_cannot_honour_are_refused_by_name(case):
    from maester.models.hf import HFFormatError, transformer_args_from_hf

    name, args = tiny_args(case)
    changes, message = REFUSED[case]
    with pytest.raises(HFFormatError, match=f"^hf/config.json: {message}"):
        transformer_args_from_hf({**hf_config(name, args), **changes}, "hf/config.json")


def test_kv_cache_logits_equal_a_full_forward():
    from maester.models.transformer import KVCache

    name, args = tiny_args("gemma3")  # sliding windows and two RoPE tables
    model = maester_model(args)
    x = ids(batch=2, seq=20, seed=5)
    cache = KVCache(args, 2, 20, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        full = model(x)
        parts = [model(x[:, :7], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(7, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=0, atol=1e-5)
    assert cache.length == 20


def test_model_hf_config_takes_the_architecture_and_overrides(hf_dir, tmp_path):
    from maester.config import Config, ModelConfig
    from maester.models.build import build_on_meta, resolve_args

    case, name, args, hf, path = hf_dir
    cfg = ModelConfig(hf_config=str(path), overrides={"n_layers": 1})
    assert cfg.name == name
    built = resolve_args(cfg, VOCAB)
    assert built == args.model_copy(update={"n_layers": 1, "attention": "auto"})
    assert build_on_meta(cfg, built).args.n_layers == 1
    # The saved config reloads to the same model section.
    full = Config(model=cfg)
    assert Config.model_validate_json(full.to_json()).model == full.model
    with pytest.raises(ValueError, match="model.flavor"):
        ModelConfig(hf_config=str(path), flavor="tiny")


@pytest.mark.parametrize("case", sorted(CASES))
def test_exported_config_reads_back_to_the_same_args(case):
    from maester.models.hf import check_convertible

    name, args = tiny_args(case)
    read_name, fields = args_from_hf(hf_config(name, args))
    assert read_name == name and TransformerArgs(**fields) == args
    check_convertible(name, args)
    # transformers 5 writes rope_parameters per layer type; they read back the same.
    saved = transformers.AutoConfig.for_model(**hf_config(name, args)).to_dict()
    assert TransformerArgs(**args_from_hf(saved)[1]) == args
