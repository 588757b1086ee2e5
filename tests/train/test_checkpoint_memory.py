"""Host memory of background saves: the available memory read from /proc/meminfo and the cgroup's limit (v1 and
v2 files as the kernel writes them), the size of a rank's staged copy before the first step, and the decision: the
copies of a node's ranks must fit 3/4 of its available memory, else `auto` saves synchronously, saying so, and an
explicit `async` is refused. The size against DCP's own stager, in every layout: tests/distributed/
test_staged_state.py."""

from __future__ import annotations

import pytest
import torch

from maester.train.checkpoint_memory import GIB, available_host_memory, fit_async_mode, staged_bytes

MEMINFO = "MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n"


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_available_memory_is_meminfo_within_the_cgroup_limit(tmp_path):
    meminfo = write(tmp_path / "meminfo", MEMINFO)
    root = tmp_path / "cgroup"
    # v2: a SLURM step's limit (6 GB, 2 used) under a parent without one
    v2 = write(tmp_path / "v2", "0::/slurm/job_1/step_0\n")
    write(root / "slurm/job_1/step_0/memory.max", "6000000000\n")
    write(root / "slurm/job_1/step_0/memory.current", "2000000000\n")
    write(root / "slurm/memory.max", "max\n")
    write(root / "slurm/memory.current", "9000000000\n")
    assert available_host_memory(meminfo, root, v2) == 4_000_000_000
    # v1: no limit (the kernel's huge number): MemAvailable alone
    v1 = write(tmp_path / "v1", "4:memory:/process_api/x\n3:cpuset:/\n")
    write(root / "memory/process_api/x/memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory/process_api/x/memory.usage_in_bytes", "123\n")
    assert available_host_memory(meminfo, root, v1) == 8_000_000 * 1024
    write(root / "memory/process_api/memory.limit_in_bytes", "3000000000\n")  # a parent's limit applies too
    write(root / "memory/process_api/memory.usage_in_bytes", "1000000000\n")
    assert available_host_memory(meminfo, root, v1) == 2_000_000_000
    assert available_host_memory(tmp_path / "none", root, tmp_path / "none") is None


def test_staged_bytes_before_the_first_step_counts_the_optimizer_state_to_come():
    """Llama 3 8B with AdamW, one rank holding it all (on the meta device): 4 bytes a parameter for the fp32
    weights and 8 for Adam's moments, 96 GB; an FSDP rank of 8 holds an eighth (12 GB, the review's figure)."""
    from maester.config import ModelConfig, OptimizerConfig
    from maester.models.build import build_on_meta, resolve_args
    from maester.train.optim import build_optimizer

    cfg = ModelConfig(flavor="8B")
    model = build_on_meta(cfg, resolve_args(cfg, 128256), torch.float32)
    optimizer = build_optimizer(model, OptimizerConfig(), torch.device("meta"))
    parameters = sum(p.numel() for p in model.parameters())
    assert 8.0e9 < parameters < 8.1e9
    assert staged_bytes(model, optimizer) == 12 * parameters
    muon = build_optimizer(model, OptimizerConfig(name="muon"), torch.device("meta"))
    matrices = sum(p.numel() for group in muon.param_groups if group["muon"] for p in group["params"])
    assert staged_bytes(model, muon) == 12 * parameters - 4 * matrices  # one momentum, not two moments


def node(ranks: int, staged_gib: float, available_gib: float | None) -> dict:
    return {"ranks": ranks, "staged": int(staged_gib * GIB),
            "available": None if available_gib is None else int(available_gib * GIB)}


def test_auto_saves_synchronously_where_the_copies_do_not_fit(caplog):
    nodes = {"gpu-a": node(8, 60, 200), "gpu-b": node(8, 96, 120)}  # 96 > 3/4 of 120
    with caplog.at_level("WARNING", logger="maester"):
        assert fit_async_mode("auto", "async", nodes) == "off"
    assert caplog.messages == ["checkpoint.async_mode = 'auto' saves synchronously: the background saves' host copy "
                               "of each rank's state takes 96.0 GiB on gpu-b (8 rank(s)), more than 75% of its "
                               "120.0 GiB available"]
    assert fit_async_mode("auto", "async", {"gpu-a": node(8, 60, 200)}) == "async"
    assert fit_async_mode("auto", "off", nodes) == "off"  # the CPU's auto: nothing to fit


@pytest.mark.parametrize("setting", ["async", "pinned"])
def test_an_explicit_background_mode_that_cannot_fit_is_refused(setting):
    with pytest.raises(ValueError, match=rf"checkpoint.async_mode = '{setting}': the background saves' host copy .* "
                                         r"takes 96.0 GiB on gpu-b \(8 rank\(s\)\), more than 75% of its 120.0 GiB "
                                         r"available; set checkpoint.async_mode = 'off'"):
        fit_async_mode(setting, setting, {"gpu-b": node(8, 96, 120)})
    assert fit_async_mode(setting, setting, {"gpu-b": node(8, 96, 200)}) == setting


def test_unknown_memory_is_said_not_checked(caplog):
    with caplog.at_level("WARNING", logger="maester"):
        assert fit_async_mode("async", "async", {"mac": node(1, 1, None)}) == "async"
    assert "the available host memory of mac cannot be read" in caplog.text


@pytest.mark.cuda
def test_auto_keeps_background_saves_on_a_gpu_where_the_copies_fit(tmp_path):  # pragma: no cover - GPU check
    """On a GPU `auto` is `async` once the tiny model's copies are sized against the node's memory, and its
    interval save is written in the background."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist

    from maester.config import load_config
    from maester.train.metrics_file import read_events
    from maester.train.trainer import Trainer
    from tests.helpers import tiny_overrides, write_corpus

    corpus = write_corpus(tmp_path / "corpus.parquet")
    cfg = load_config(None, tiny_overrides(corpus, tmp_path / "jobs", "auto", training__device="cuda",
                                           training__steps=2, checkpoint__interval=1), environ={})
    try:
        trainer = Trainer(cfg, cfg.job_dir)
        assert trainer.checkpointer.async_mode == "async"
        trainer.train()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    saves = [e for e in read_events(cfg.job_dir) if e["event"] == "checkpoint"]
    assert [(e["step"], e["background"]) for e in saves] == [(1, True), (2, False)]
