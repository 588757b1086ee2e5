"""training.float8 on a GPU with float8 matmuls (run by the GPU check's cuda-tests stage): compiled blocks under
one-rank FSDP2 (float8 all-gather for tensorwise) train close to bf16, and torchao's float8 TP styles on a one-rank
TP mesh run the real float8 matmul (`_scaled_mm`) and give the plain float8 model's logits. Skipped, with the
reason, on a GPU without float8 (an A100, an MI250X). The CPU tests of the same code are tests/parallel/
test_float8.py and tests/distributed/test_float8.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from maester.config import load_config
from maester.train.metrics import read_metrics
from tests.helpers import tiny_overrides, write_corpus


def _gpu_problem() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    from maester.parallel.float8 import _device_facts, hardware_problem

    return hardware_problem("cuda", False, **_device_facts(torch.device("cuda")))


PROBLEM = _gpu_problem()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or ""),
              pytest.mark.skipif(__import__("importlib.util").util.find_spec("torchao") is None,
                                 reason="needs torchao (the float8 extra)")]


def train(tmp_path, name: str, **extra) -> list[float]:
    from maester.train.trainer import Trainer

    corpus = write_corpus(tmp_path / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", name, training__device="cuda",
                                           training__precision="bf16", parallel__force_fsdp="true",
                                           parallel__compile="true", training__steps=8, checkpoint__interval=0,
                                           **extra), environ={})
    try:
        Trainer(cfg, cfg.job_dir).train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return [r["loss"] for r in read_metrics(cfg.job_dir / "metrics.jsonl")]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_float8_under_fsdp_tracks_bf16(tmp_path, recipe):  # pragma: no cover - GPU check
    bf16 = train(tmp_path, "bf16")
    float8 = train(tmp_path, recipe, training__float8__enabled="true", training__float8__recipe=recipe)
    assert len(float8) == len(bf16) == 8 and float8 != bf16
    assert max(abs(a - b) / b for a, b in zip(float8, bf16)) < 0.03, (float8, bf16)


def test_cpu_offload_trains_float8_without_the_scale_precompute(tmp_path):  # pragma: no cover - GPU check
    """G14: FSDP2's copies of offloaded shards to the GPU drop torchao's precomputed scales, so the run skips the
    precompute, says so, and each all-gather computes its scale."""
    bf16 = train(tmp_path, "offload-bf16", parallel__cpu_offload="true")
    float8 = train(tmp_path, "offload", parallel__cpu_offload="true", training__float8__enabled="true")
    log = (tmp_path / "jobs" / "offload" / "logs" / "train.log").read_text()
    assert "scales are not precomputed after the optimizer step under parallel.cpu_offload" in log
    assert len(float8) == 8 and max(abs(a - b) / b for a, b in zip(float8, bf16)) < 0.03, (float8, bf16)


def test_float8_tensor_parallel_styles_run_scaled_mm(tmp_path):  # pragma: no cover - GPU check
    from torch.distributed.device_mesh import init_device_mesh

    from maester.config import Float8Config, ModelConfig
    from maester.models.build import build_model
    from maester.parallel.float8 import convert_to_float8
    from maester.parallel.parallelize import apply_tensor_parallel

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(ModelConfig(name="llama", flavor="tiny"), 256, torch.device("cpu"), seed=0)
        convert_to_float8(model, Float8Config(enabled=True), fsdp=False)
        model = model.cuda()
        plain = copy.deepcopy(model)
        apply_tensor_parallel(model, init_device_mesh("cuda", (1,), mesh_dim_names=("tp",)), float8_comms=True)
        assert type(model.layers["0"].attention.q_proj.weight).__name__ == "DTensor"
        ids = torch.randint(0, 256, (2, 64), device="cuda")
        with torch.autocast("cuda", torch.bfloat16), torch.profiler.profile() as prof:
            sharded = model(ids).full_tensor()
            expected = plain(ids)
        assert any("_scaled_mm" in e.name for e in prof.events())
        torch.testing.assert_close(sharded.float(), expected.float(), rtol=2e-2, atol=2e-2)
        sharded.float().square().mean().backward()
        assert model.layers["0"].feed_forward.down_proj.weight.grad is not None
    finally:
        dist.destroy_process_group()
