"""training.precision: one mechanism per run (F15), pure bf16 and fp16 with loss scaling, and the buffers of a
CPU-offloaded model on the GPU (F7)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from maester.config import load_config
from maester.parallel.precision import resolve_precision
from maester.train.metrics import read_metrics
from maester.train.trainer import Trainer
from tests.helpers import tiny_overrides, write_corpus

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("precision, device, fsdp, stored, autocast, fsdp_dtype", [
    ("fp32", "cuda", True, F32, None, F32),      # F15: fp32 under FSDP computes in fp32
    ("bf16", "cuda", True, F32, None, BF16),     # FSDP: the policy casts, no autocast on top
    ("bf16", "cuda", False, F32, BF16, None),    # one GPU, DDP, TP: autocast
    ("auto", "cuda", True, F32, None, BF16),
    ("auto", "cpu", False, F32, None, None),
    ("bf16-pure", "cuda", True, BF16, None, BF16),
    ("bf16-pure", "cpu", False, BF16, None, None),
    ("fp16", "cuda", True, F32, None, F16),
    ("fp16", "cpu", False, F32, F16, None),
])
def test_one_mechanism_per_precision(precision, device, fsdp, stored, autocast, fsdp_dtype):
    p = resolve_precision(precision, "auto", device, fsdp)
    assert (p.param_dtype, p.autocast_dtype, p.fsdp_param_dtype) == (stored, autocast, fsdp_dtype)
    assert p.loss_scaling == (precision == "fp16")


def test_param_dtype_that_disagrees_is_refused():
    with pytest.raises(ValueError, match="parallel.param_dtype = 'bfloat16' disagrees with training.precision = "
                                         "'fp32'"):
        resolve_precision("fp32", "bfloat16", "cuda", True)
    assert resolve_precision("bf16", "bfloat16", "cuda", True).fsdp_param_dtype == BF16


def test_fsdp_policy_follows_the_precision():
    from torch.distributed.device_mesh import init_device_mesh

    from maester.models.build import build_on_meta, resolve_args
    from maester.parallel.parallelize import apply_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = load_config(None, ["--model.flavor=tiny"], environ={})
        for precision, expected in (("fp32", F32), ("bf16", BF16), ("fp16", F16)):
            model = build_on_meta(cfg.model, resolve_args(cfg.model, 256, cfg.mup))
            # the GPU's resolution: before, `auto` param_dtype computed fp32 runs in bf16 under FSDP
            apply_fsdp(model, init_device_mesh("cpu", (1,)), cfg.parallel, torch.device("cpu"),
                       resolve_precision(precision, "auto", "cuda", fsdp=True))
            assert model._get_fsdp_state()._fsdp_param_group.fsdp_params[0].mp_policy.param_dtype == expected
    finally:
        dist.destroy_process_group()


def run(tmp_path, name, **extra):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    values = {"training__steps": 6, "checkpoint__interval": 3, **extra}
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", name, **values), environ={})
    return cfg, Trainer(cfg, cfg.job_dir)


def test_pure_bf16_trains_with_bf16_weights_and_optimizer_state(tmp_path):
    cfg, trainer = run(tmp_path, "pure", training__precision="bf16-pure")
    assert all(p.dtype == BF16 for p in trainer.model.parameters())
    assert all(b.dtype == F32 for b in trainer.model.buffers())  # RoPE frequencies stay float32
    trainer.train()
    states = [s for s in trainer.optimizer.state.values()]
    assert states and all(s["exp_avg"].dtype == BF16 for s in states)
    losses = [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3


def test_fp16_trains_with_a_loss_scale_that_resumes(tmp_path):
    cfg, trainer = run(tmp_path, "fp16", training__precision="fp16")
    assert trainer.precision.autocast_dtype == F16 and trainer.scaler is not None
    trainer.train()
    records = read_metrics(cfg.job_dir / "metrics.jsonl")
    assert records[-1]["loss"] < records[0]["loss"] - 0.3
    assert all(r["grad_scale"] == 2.0**16 for r in records)  # no overflow, fewer than 2000 steps
    import json

    state = json.loads((cfg.job_dir / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    assert state["grad_scaler"] == {"scale": 2.0**16, "growth_tracker": 6}


def test_fp16_overflow_skips_the_update_and_halves_the_scale(tmp_path):
    cfg, trainer = run(tmp_path, "overflow", training__precision="fp16", training__steps=1, schedule__warmup_steps=0, schedule__name="constant",
                       checkpoint__interval=0, checkpoint__save_final="false")
    trainer.scaler.scale.fill_(2.0**60)  # fp16 gradients overflow at this scale
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert float(trainer.scaler.scale) == 2.0**59


def test_buffers_go_to_the_buffer_device():
    from maester.models.build import build_on_meta, materialize, resolve_args

    cfg = load_config(None, ["--model.flavor=tiny"], environ={})
    model = materialize(build_on_meta(cfg.model, resolve_args(cfg.model, 256, cfg.mup)), torch.device("cpu"), 0,
                        buffer_device=torch.device("meta"))  # any other device: the GPU under cpu_offload
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert [b.device.type for b in model.buffers()] and all(b.device.type == "meta" for b in model.buffers())
    assert "rotary.inv_freq" not in model.state_dict()  # still a non-persistent buffer


# CPU offload on one GPU: FSDP2 on a one-rank mesh (F7; the check's cuda tests must not be refused by the config)
OFFLOAD_ON_ONE_GPU = dict(training__device="cuda", parallel__cpu_offload="true", parallel__force_fsdp="true")


def test_the_one_gpu_offload_layout_is_accepted_and_offload_without_fsdp_says_how(tmp_path):
    from maester.parallel.dims import ParallelDims

    corpus = tmp_path / "corpus.parquet"
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", **OFFLOAD_ON_ONE_GPU), environ={})
    dims = ParallelDims.from_config(cfg, 1)
    assert dims.fsdp_enabled and dims.dp_shard == 1 and not dims.ddp_enabled
    without = {**OFFLOAD_ON_ONE_GPU, "parallel__force_fsdp": "false"}
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", **without), environ={})
    with pytest.raises(ValueError, match="cpu_offload applies to FSDP only.*set parallel.force_fsdp = true"):
        ParallelDims.from_config(cfg, 1)


def test_fsdp_on_one_rank_trains_exactly_like_one_process_and_resumes(tmp_path):
    """parallel.force_fsdp: FSDP2 on a one-rank mesh in a single process (its own process group), the same numbers
    as the plain model on the CPU, DCP checkpoints of DTensors that resume."""
    losses = {}
    for name, extra in (("plain", {}), ("fsdp", {"parallel__force_fsdp": "true"})):
        cfg, trainer = run(tmp_path, name, **extra)
        try:
            assert (type(trainer.model).__name__ == "FSDPTransformer") == bool(extra)
            assert dist.is_initialized() == bool(extra)
            trainer.train()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        losses[name] = [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]
    assert losses["fsdp"] == losses["plain"] and len(losses["plain"]) == 6
    cfg = load_config(None, tiny_overrides(tmp_path / "corpus.parquet", tmp_path / "jobs", "fsdp",
                                           training__steps=6, checkpoint__interval=3,
                                           parallel__force_fsdp="true"), environ={})
    (cfg.job_dir / "checkpoints" / "step-6").rename(cfg.job_dir / "step-6-moved")  # resume from step 3
    trainer = Trainer(cfg, cfg.job_dir)
    try:
        assert trainer.step == 3
        trainer.train()
    finally:
        dist.destroy_process_group()
    resumed = [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")][-3:]
    assert resumed == losses["fsdp"][3:]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cpu_offload_trains_on_one_gpu(tmp_path):  # pragma: no cover - GPU check
    cfg, trainer = run(tmp_path, "offload", **OFFLOAD_ON_ONE_GPU)
    try:
        assert all(b.is_cuda for b in trainer.model.buffers())
        assert all(p.device.type == "cpu" for p in trainer.model.parameters())
        trainer.train()
    finally:
        dist.destroy_process_group()
    losses = [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]
    assert len(losses) == 6 and losses[-1] < losses[0]
