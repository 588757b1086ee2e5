"""Every published flavor has the published parameter count, the same count transformers builds from the
flavor's HF config, and FLOPs that count sliding windows with their window."""

from __future__ import annotations

import pytest
import torch

from maester.config import ModelConfig
from maester.models.build import build_on_meta, count_parameters, resolve_args
from maester.models.hf import hf_config
from maester.models.registry import ARCHITECTURES
from maester.train.metrics import matmul_parameters, model_flops_per_token

# Exact totals from the model cards / safetensors metadata; (total, non-embedding) in millions from papers
# and cards that publish rounded figures (Gemma 3 technical report table 1, Qwen 3 model cards, OLMo 2 cards).
EXACT = {
    ("llama", "1B"): 1_235_814_400, ("llama", "3B"): 3_212_749_824, ("llama", "8B"): 8_030_261_248,
    ("llama", "70B"): 70_553_706_496, ("llama", "405B"): 405_853_388_800,
    ("gemma3", "270M"): 268_098_176, ("gemma3", "1B"): 999_885_952,
    ("qwen3", "8B"): 8_190_735_360,
    ("gpt_neox", "pythia-70m"): 70_426_624, ("gpt_neox", "pythia-160m"): 162_322_944,
    ("gpt_neox", "pythia-410m"): 405_334_016, ("gpt_neox", "pythia-1b"): 1_011_781_632,
    ("gpt_neox", "pythia-1.4b"): 1_414_647_808, ("gpt_neox", "pythia-2.8b"): 2_775_208_960,
    ("gpt_neox", "pythia-6.9b"): 6_857_302_016, ("gpt_neox", "pythia-12b"): 11_846_072_320,
    ("gpt_neox", "20B"): 20_554_567_680,
    ("llama", "llama2-7B"): 6_738_415_616, ("llama", "llama2-13B"): 13_015_864_320,
    ("llama", "llama2-70B"): 68_976_648_192, ("llama", "smollm2-135M"): 134_515_008,
    ("llama", "smollm2-360M"): 361_821_120, ("llama", "smollm2-1.7B"): 1_711_376_384,
    ("mistral", "7B-v0.1"): 7_241_732_096, ("mistral", "7B-v0.3"): 7_248_023_552,
    ("mistral", "nemo-12B"): 12_247_782_400,
    ("gemma2", "2B"): 2_614_341_888, ("gemma2", "9B"): 9_241_705_984, ("gemma2", "27B"): 27_227_128_320,
    ("qwen2", "0.5B"): 494_032_768, ("qwen2", "7B"): 7_615_616_512,
    ("phi3", "mini-4k"): 3_821_079_552, ("phi3", "medium-4k"): 13_960_238_080,
    ("olmoe", "1B-7B"): 6_919_161_856, ("qwen3_moe", "30B-A3B"): 30_532_122_624,
    ("qwen3_moe", "235B-A22B"): 235_093_634_560, ("mixtral", "8x7B"): 46_702_792_704,
    ("mixtral", "8x22B"): 140_630_071_296,
}
# Non-embedding parameters as published, rounded to the figure's last digit.
NON_EMBEDDING = {
    ("gemma3", "4B"): "3209M", ("gemma3", "12B"): "10759M", ("gemma3", "27B"): "25600M",
    ("qwen3", "0.6B"): "0.44B", ("qwen3", "1.7B"): "1.4B", ("qwen3", "4B"): "3.6B", ("qwen3", "8B"): "6.95B",
    ("qwen3", "14B"): "13.2B", ("qwen3", "32B"): "31.2B",
    ("qwen2", "0.5B"): "0.36B", ("qwen2", "1.5B"): "1.31B", ("qwen2", "3B"): "2.77B", ("qwen2", "7B"): "6.53B",
}
TOTAL_ROUNDED = {
    ("qwen3", "0.6B"): "0.6B", ("qwen3", "1.7B"): "1.7B", ("qwen3", "4B"): "4.0B", ("qwen3", "14B"): "14.8B",
    ("qwen3", "32B"): "32.8B", ("olmo2", "1B"): "1.48B", ("olmo2", "7B"): "7.30B", ("olmo2", "13B"): "13.7B",
    ("olmo2", "32B"): "32.2B",
    # Qwen 2.5 cards; for 14B and 32B the Hub's safetensors totals (the cards round to 14.7B and 32.5B).
    ("qwen2", "1.5B"): "1.54B", ("qwen2", "3B"): "3.09B", ("qwen2", "14B"): "14.8B", ("qwen2", "32B"): "32.8B",
    ("qwen2", "72B"): "72.7B",
}
PUBLISHED = [(name, flavor) for name, arch in ARCHITECTURES.items() for flavor in arch.flavors
             if flavor not in ("tiny", "demo")]


def meta_model(name: str, flavor: str):
    cfg = ModelConfig(name=name, flavor=flavor)
    return build_on_meta(cfg, resolve_args(cfg, 256))


def rounds_to(value: int, published: str) -> bool:
    """Whether `value` rounds to a figure such as "6.95B" or "3209M" (half a unit of its last digit)."""
    number, unit = published[:-1], {"M": 10**6, "B": 10**9}[published[-1]]
    decimals = len(number.split(".")[1]) if "." in number else 0
    return abs(value - float(number) * unit) <= unit * 10**-decimals / 2


def test_every_published_flavor_has_a_published_count():
    for key in PUBLISHED:
        assert key in EXACT or key in NON_EMBEDDING or key in TOTAL_ROUNDED, key


@pytest.mark.parametrize("name,flavor", PUBLISHED, ids=[f"{n}-{f}" for n, f in PUBLISHED])
def test_published_parameter_counts(name, flavor):
    model = meta_model(name, flavor)
    total = count_parameters(model)
    embedding = model.tok_embeddings.weight.numel() * (1 if model.args.tie_embeddings else 2)
    if (name, flavor) in EXACT:
        assert total == EXACT[name, flavor]
    if (name, flavor) in NON_EMBEDDING:
        assert rounds_to(total - embedding, NON_EMBEDDING[name, flavor]), total - embedding
    if (name, flavor) in TOTAL_ROUNDED:
        assert rounds_to(total, TOTAL_ROUNDED[name, flavor]), total


SMALLEST = ("1B", "270M", "0.6B", "pythia-160m", "smollm2-135M", "7B-v0.1", "2B", "0.5B", "mini-4k", "1B-7B",
            "30B-A3B", "8x7B")


@pytest.mark.parametrize("name,flavor", [k for k in PUBLISHED if k[1] in SMALLEST])
def test_transformers_builds_the_same_count_from_the_exported_config(name, flavor):
    transformers = pytest.importorskip("transformers")
    model = meta_model(name, flavor)
    config = transformers.AutoConfig.for_model(**hf_config(name, model.args))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in hf.parameters()) == count_parameters(model)


@pytest.mark.parametrize("name,flavor", PUBLISHED, ids=[f"{n}-{f}" for n, f in PUBLISHED])
def test_published_flavors_read_back_from_their_hf_config(name, flavor):
    from maester.models.args import TransformerArgs
    from maester.models.hf import args_from_hf, check_convertible

    args = ARCHITECTURES[name].flavors[flavor]
    check_convertible(name, args)
    read_name, fields = args_from_hf(hf_config(name, args))
    assert read_name == name and TransformerArgs(**fields) == args


def test_flops_count_sliding_windows_with_their_window_and_a_tied_head_once():
    model = meta_model("gemma3", "1B")  # 26 layers: every 6th global, the others see 512 tokens
    a = model.args
    windows = [a.layer_window(i) for i in range(a.n_layers)]
    assert windows.count(None) == 4 and set(windows) == {None, 512}
    assert matmul_parameters(model) == count_parameters(model)  # tied: the one matrix is the head
    seq = 4096
    attended = 4 * seq + 22 * 512
    assert model_flops_per_token(model, seq) == 6 * count_parameters(model) + 12 * 4 * 256 * attended
    # Below the window every layer attends to the whole sequence.
    assert model_flops_per_token(model, 256) == 6 * count_parameters(model) + 12 * 4 * 256 * 26 * 256
