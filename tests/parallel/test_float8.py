"""training.float8 (torchao) on one process: what is refused and why, which layers convert, the float8 TP styles
chosen for GPUs, and emulated float8 numerics under CPU autocast. Two-rank training is in
tests/distributed/test_float8.py; the GPU run in tests/train/test_float8_cuda.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from maester.config import ConfigError, ModelConfig, load_config
from maester.models.build import build_on_meta, resolve_args
from maester.parallel.dims import ParallelDims
from maester.parallel.float8 import (
    Float8Training,
    Float8Unsupported,
    check_float8,
    convert_to_float8,
    float8_linear_class,
    hardware_problem,
    installed_torchao,
    is_float8,
    version_problem,
)
from maester.parallel.parallelize import _block_plan
from tests.helpers import tiny_overrides, write_corpus

pytest.importorskip("torchao", reason="the float8 extra (torchao) is part of the dev group")

FLOAT8 = ["--training.float8.enabled=true", "--training.precision=bf16", "--parallel.compile=true"]


def config(tmp_path, *extra: str):
    corpus = tmp_path / "c.parquet"
    return load_config(None, [*tiny_overrides(corpus, tmp_path), *FLOAT8, *extra], environ={})


@pytest.mark.parametrize("extra, message", [
    (["--training.precision=fp16"], "training.float8 with training.precision = 'fp16': fp16 is for GPUs without bf16"),
    (["--training.precision=bf16-pure"], "'bf16-pure': it keeps no fp32 master weights"),
    (["--parallel.compile=false"], "training.float8 needs parallel.compile = true: torch.compile fuses torchao's"),
    (["--training.float8.experts=true"], "float8 grouped GEMMs for the routed experts are not supported with the "
                                         "pinned torchao"),
    (['--training.float8.filter=["k_proj", " "]'], "training.float8.filter has an empty entry"),
])
def test_config_refuses(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(tmp_path, *extra)


def test_config_accepts_emulation_without_compile_and_fp32(tmp_path):
    cfg = config(tmp_path, "--parallel.compile=false", "--training.float8.emulate=true", "--training.precision=fp32")
    assert cfg.training.float8.emulate and not cfg.parallel.compile


@pytest.mark.parametrize("device, emulate, facts, message", [
    ("cuda", False, dict(capability=(8, 0), name="NVIDIA A100-SXM4-80GB"),
     "compute capability 8.9 or later .*this GPU \\(NVIDIA A100-SXM4-80GB\\) is sm_80"),
    ("cuda", False, dict(capability=(8, 6)), "is sm_86"),
    ("cuda", False, dict(capability=(9, 0), arch="gfx90a:sramecc+:xnack-", hip="6.2.41133", name="AMD Instinct MI250X"),
     "AMD GPU with float8 matmuls, gfx942 \\(MI300\\).*is gfx90a.*MI250X"),
    ("cuda", False, dict(capability=(9, 5), arch="gfx950", hip="6.4.0"), "gfx950 \\(MI350\\) needs ROCm 6.5"),
    ("cuda", False, dict(capability=(11, 0), arch="gfx1100", hip="6.5.0"), "is gfx1100"),
    ("cuda", True, dict(capability=(9, 0)), "training.float8.emulate is for tests on the CPU"),
    ("cpu", False, {}, "the CPU has no float8 matmuls; training.float8.emulate = true emulates them"),
    ("mps", True, {}, "not on 'mps'"),
])
def test_hardware_refused(device, emulate, facts, message):
    problem = hardware_problem(device, emulate, **facts)
    assert problem is not None
    assert __import__("re").search(message, problem), problem


@pytest.mark.parametrize("device, emulate, facts", [
    ("cuda", False, dict(capability=(8, 9), name="NVIDIA L4")),
    ("cuda", False, dict(capability=(9, 0), name="NVIDIA H100 80GB HBM3")),
    ("cuda", False, dict(capability=(10, 0))),
    ("cuda", False, dict(capability=(9, 4), arch="gfx942:sramecc+:xnack-", hip="6.2.41133")),
    ("cuda", False, dict(capability=(9, 5), arch="gfx950", hip="6.5.0")),
    ("cpu", True, {}),
])
def test_hardware_accepted(device, emulate, facts):
    assert hardware_problem(device, emulate, **facts) is None


@pytest.mark.parametrize("torch_version, torchao_version, message", [
    ("2.15.0+cu132", None, "needs torchao, which is not installed: install maester's float8 extra"),
    ("2.15.0+cu132", "0.16.0", "torchao 0.16.0 does not match torch 2.15.0\\+cu132: it serves torch 2.10 \\(.*"
                               "install torchao 0.17 or 0.18"),
    ("2.10.0", "0.15.0", "torchao 0.15.0 is not a release maester's float8 has been checked with"),
    ("2.16.0", "0.18.0", "torchao 0.18.0 does not match torch 2.16.0: it serves torch 2.10 to 2.15 .*no checked "
                         "torchao serves this torch"),
    ("2.15.0", "0.19.0+git1234", "torchao 0.19.0\\+git1234 is not a release maester's float8 has been checked"),
])
def test_mismatched_versions_refused(torch_version, torchao_version, message):
    problem = version_problem(torch_version, torchao_version)
    assert problem is not None and __import__("re").search(message, problem), problem


@pytest.mark.parametrize("torch_version, torchao_version", [
    ("2.10.0+cu128", "0.16.0"), ("2.10.0", "0.18.0"), ("2.11.0", "0.17.0"), ("2.15.0+cu132", "0.18.0"),
])
def test_matching_versions_accepted(torch_version, torchao_version):
    assert version_problem(torch_version, torchao_version) is None


def test_installed_pair_is_accepted():
    """The lock's pair (and CI's torch 2.10 environment's) is one of the checked ones."""
    assert version_problem(torch.__version__, installed_torchao()) is None


def test_ddp_refused_before_any_work(tmp_path):
    cfg = config(tmp_path, "--parallel.dp_replicate=2", "--parallel.dp_shard=1", "--training.float8.emulate=true")
    dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, world_size=2)
    with pytest.raises(Float8Unsupported, match="training.float8 with DDP .* torchao's float8 composes with FSDP2"):
        check_float8(cfg, dims, torch.device("cpu"))
    fsdp = ParallelDims(dp_replicate=1, dp_shard=2, tp=1, world_size=2)
    check_float8(cfg, fsdp, torch.device("cpu"))  # the same on FSDP runs (emulated, with the installed torchao)
    with pytest.raises(Float8Unsupported, match="torchao 0.15.0 is not a release maester's float8 has been checked"):
        check_float8(cfg, fsdp, torch.device("cpu"), torchao_version="0.15.0")


def test_trainer_refuses_float8_on_the_cpu_without_emulation(tmp_path):
    """Before any work: the message, and no job output beyond the log."""
    from maester.train.trainer import Trainer

    corpus = write_corpus(tmp_path / "c.parquet")
    cfg = load_config(None, [*tiny_overrides(corpus, tmp_path), *FLOAT8], environ={})
    with pytest.raises(Float8Unsupported, match="the CPU has no float8 matmuls"):
        Trainer(cfg, cfg.job_dir)
    assert not (cfg.job_dir / "checkpoints").exists()


def model_of(flavor="tiny", name="llama", **overrides):
    cfg = ModelConfig(name=name, flavor=flavor, overrides=overrides)
    return build_on_meta(cfg, resolve_args(cfg, 256))


def f8(**kw):
    from maester.config import Float8Config

    return Float8Config(enabled=True, emulate=True, **kw)


def converted(model) -> set[str]:
    return {name for name, m in model.named_modules() if is_float8(m)}


def test_blocks_convert_and_the_head_stays():
    model = model_of()
    names = convert_to_float8(model, f8(), fsdp=False)
    assert set(names) == converted(model) == {f"layers.{i}.{p}" for i in range(2) for p in (
        "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj", "feed_forward.gate_proj",
        "feed_forward.up_proj", "feed_forward.down_proj")}
    assert type(model.output) is nn.Linear
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in model_of().named_parameters()]


def test_filter_and_dims_keep_layers():
    # ffn 200: gate/up out and down in are not multiples of 16; the filter keeps every k_proj
    model = model_of(ffn_hidden_dim=200)
    convert_to_float8(model, f8(filter=["attention.k_proj"]), fsdp=False)
    assert converted(model) == {f"layers.{i}.attention.{p}_proj" for i in range(2) for p in "qvo"}
    with pytest.raises(Float8Unsupported, match="'atention.k_proj' names no linear layer"):
        convert_to_float8(model_of(), f8(filter=["atention.k_proj"]), fsdp=False)


def test_tensor_parallel_shards_must_keep_multiples_of_16():
    # k_proj: 64 -> 32 outputs (tp 2) still fine, 16 (tp 4) not: kept
    model = model_of()
    convert_to_float8(model, f8(), fsdp=False, tp=4)
    assert "layers.0.attention.k_proj" not in converted(model)
    assert "layers.0.attention.q_proj" in converted(model)


def test_rows_that_do_not_divide_over_the_float8_all_gather_stay():
    """Llama 3 8B's rows (q/o/down 4096, k/v 1024, gate/up 14336) per TP shard over the FSDP shards: even at 8 and 64
    ranks, uneven at 24 and 48 (4096 % 24 = 16); under TP each column-parallel layer holds rows / tp."""
    from maester.parallel.float8 import uneven_rows

    rows = (4096, 1024, 14336)
    assert not any(uneven_rows(r, 1, shards) for r in rows for shards in (8, 16, 64))
    assert [uneven_rows(r, 1, 24) for r in rows] == [True, True, True]
    assert [uneven_rows(r, 1, 48) for r in rows] == [True, True, True]
    assert not uneven_rows(1024, 1, 512) and uneven_rows(1024, 4, 512)  # tp 4: 256 rows per TP shard
    model = model_of()  # q/o/down 64 rows, k/v 32, gate/up 192: only gate/up divide over 3
    names = convert_to_float8(model, f8(), fsdp=True, fsdp_shards=3)
    assert set(names) == {f"layers.{i}.feed_forward.{p}_proj" for i in range(2) for p in ("gate", "up")}
    rowwise = model_of()  # rowwise all-gathers in bf16: no rows to divide
    assert len(convert_to_float8(rowwise, f8(recipe="rowwise"), fsdp=True, fsdp_shards=3)) == 14


def test_moe_router_and_experts_stay():
    model = model_of(name="olmoe")
    convert_to_float8(model, f8(), fsdp=False)
    assert converted(model) == {f"layers.{i}.attention.{p}_proj" for i in range(2) for p in "qkvo"}
    assert type(model.layers["0"].feed_forward.router.gate) is nn.Linear


def test_fsdp_float8_all_gather_for_tensorwise_only():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for recipe, fsdp, all_gather in [("tensorwise", True, True), ("tensorwise", False, False),
                                     ("rowwise", True, False), ("rowwise_with_gw_hp", True, False)]:
        model = model_of()
        convert_to_float8(model, f8(recipe=recipe), fsdp=fsdp)
        q = model.layers["0"].attention.q_proj
        assert q.config.enable_fsdp_float8_all_gather == all_gather
        assert isinstance(q.weight.data, WeightWithDynamicFloat8CastTensor) == all_gather
        assert Float8Training(model).precompute == all_gather


def test_cpu_offload_skips_the_scale_precompute(caplog):
    """G14: under parallel.cpu_offload FSDP2 copies each shard to the GPU with .to(), which torchao rewraps without
    the precomputed scale, so the precompute (an all-reduce a step) would be lost: it is skipped, and the log says so
    (the GPU run: tests/train/test_float8_gpu.py)."""
    model = model_of()
    convert_to_float8(model, f8(), fsdp=True)
    assert Float8Training(model).precompute
    with caplog.at_level("INFO", logger="maester"):
        assert not Float8Training(model, cpu_offload=True).precompute
    assert "scales are not precomputed after the optimizer step under parallel.cpu_offload" in caplog.text


def test_float8_tp_styles_on_gpus_only():
    """The GPU branch of the TP plan, shown on the CPU: tensorwise float8 layers take torchao's styles, the
    input of a branch is cast (and gathered) in float8 only where every reader is float8, rowwise keeps torch's."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    model = model_of()
    convert_to_float8(model, f8(filter=["layers.1.attention.k_proj"]), fsdp=False)
    gpu = {i: _block_plan(model.layers[str(i)], True, float8_comms=True) for i in range(2)}
    assert type(gpu[0]["attention"]) is PrepareFloat8ModuleInput
    assert type(gpu[0]["attention.q_proj"]) is Float8ColwiseParallel
    assert type(gpu[0]["attention.o_proj"]) is Float8RowwiseParallel
    assert type(gpu[0]["feed_forward"]) is PrepareFloat8ModuleInput
    assert type(gpu[1]["attention"]).__name__ == "PrepareModuleInput"  # k_proj reads it in high precision
    assert type(gpu[1]["attention.k_proj"]).__name__ == "ColwiseParallel"
    assert type(gpu[1]["attention.q_proj"]) is Float8ColwiseParallel
    cpu = _block_plan(model.layers["0"], True, float8_comms=False)
    assert {type(s).__module__.split(".")[0] for s in cpu.values()} == {"torch"}
    rowwise = model_of()
    convert_to_float8(rowwise, f8(recipe="rowwise"), fsdp=False)
    plan = _block_plan(rowwise.layers["0"], True, float8_comms=True)
    assert {type(s).__module__.split(".")[0] for s in plan.values()} == {"torch"}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulated_float8_follows_cpu_autocast(recipe):
    """torchao's Float8Linear follows CUDA's autocast only; maester's follows the input's device, so emulated float8
    on the CPU computes as a GPU would: bf16 out, float8-rounded (close to, not equal to, the bf16 matmul)."""
    from maester.parallel.float8 import torchao_config

    torch.manual_seed(0)
    plain = nn.Linear(64, 32)
    layer = float8_linear_class().from_float(nn.Linear(64, 32), config=torchao_config(f8(recipe=recipe), False))
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(16, 64, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        y, ref = layer(x), plain(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    assert layer.weight.grad is not None and x.grad.dtype == torch.float32
    error = ((y.float() - ref.float()).norm() / ref.float().norm()).item()
    assert 1e-3 < error < 0.1, error  # e4m3 keeps 3 mantissa bits: a few per cent


def test_one_rank_fsdp_with_selective_checkpointing_and_muon_trains(tmp_path):
    """Float8 (emulated, float8 all-gather) composed with selective activation checkpointing and Muon, under FSDP2
    on a one-rank mesh; the optimizer updates the float8 layers' ordinary weights."""
    import torch.distributed as dist

    from maester.train.metrics import read_metrics
    from maester.train.trainer import Trainer

    corpus = write_corpus(tmp_path / "c.parquet")
    cfg = load_config(None, tiny_overrides(
        corpus, tmp_path, training__steps=3, checkpoint__interval=0, parallel__force_fsdp="true",
        parallel__activation_checkpointing="selective-op", optimizer__name="muon", training__precision="bf16",
        training__float8__enabled="true", training__float8__emulate="true"), environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    try:
        q = trainer.model.layers["0"]._checkpoint_wrapped_module.attention.q_proj
        assert is_float8(q) and q.config.enable_fsdp_float8_all_gather and trainer.float8.precompute
        before = q.weight.full_tensor().clone()
        trainer.train()
        assert not torch.equal(before, q.weight.full_tensor())
        assert q.weight._local_tensor._precomputed_scale is not None  # after each optimizer step
    finally:
        dist.destroy_process_group()
    losses = [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]
    assert len(losses) == 3 and losses[-1] < losses[0]
