"""Device choice: `training.device = "auto"` trains on the CPU only where nothing says a GPU was meant, and says
why the GPU cannot be used (no GPU needed: the cases come from the environment)."""

from __future__ import annotations

import pytest
import torch

from maester.parallel import devices
from maester.parallel.devices import choose_device_type, describe_environment, gpu_intent

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback needs a machine without GPUs")


@no_gpu
def test_auto_takes_the_cpu_when_nothing_says_gpu():
    assert choose_device_type("auto", "auto", env={}) == "cpu"
    assert choose_device_type("auto", "fp32", env={"SLURM_GPUS_ON_NODE": "0", "CUDA_VISIBLE_DEVICES": ""}) == "cpu"
    assert choose_device_type("cpu", "bf16", env={"CUDA_VISIBLE_DEVICES": "0"}) == "cpu"  # asked for: fine


@no_gpu
@pytest.mark.parametrize("env, precision, named", [
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "auto", "CUDA_VISIBLE_DEVICES=0,1"),
    ({"ROCR_VISIBLE_DEVICES": "0"}, "auto", "ROCR_VISIBLE_DEVICES=0"),
    ({"HIP_VISIBLE_DEVICES": "3"}, "auto", "HIP_VISIBLE_DEVICES=3"),
    ({"SLURM_GPUS_ON_NODE": "8"}, "auto", "SLURM_GPUS_ON_NODE=8"),
    ({"SLURM_JOB_GPUS": "0,1,2,3"}, "auto", "SLURM_JOB_GPUS=0,1,2,3"),
    ({"SLURM_GPUS_PER_NODE": "4"}, "auto", "SLURM_GPUS_PER_NODE=4"),
    ({}, "bf16", "training.precision = 'bf16'"),
])
def test_auto_refuses_the_cpu_when_a_gpu_was_meant(env, precision, named):
    with pytest.raises(RuntimeError) as e:
        choose_device_type("auto", precision, env=env)
    message = str(e.value)
    assert named in message and "training.device = 'cpu'" in message
    assert devices.why_no_gpu() in message  # and why the GPU cannot be used


@no_gpu
def test_explicit_cuda_says_why_it_is_unavailable():
    with pytest.raises(RuntimeError, match="training.device = 'cuda', but torch .* cannot use a GPU|CPU-only build"):
        choose_device_type("cuda", "auto", env={})


def test_why_no_gpu_names_the_build(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    assert "CPU-only build" in devices.why_no_gpu()
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    reason = devices.why_no_gpu()
    assert "CUDA 12.8" in reason and "cannot use a GPU" in reason


def test_gpu_intent_ignores_hidden_devices():
    assert gpu_intent("auto", {"CUDA_VISIBLE_DEVICES": "-1", "SLURM_GPUS_ON_NODE": "0",
                               "SLURM_JOB_GPUS": "(null)"}) == []


@pytest.mark.parametrize("precision", ["bf16", "bf16-pure", "fp16"])
def test_every_gpu_precision_means_a_gpu_was_meant(precision):
    # A half-precision run with no GPU variables set (a workstation whose driver broke) must not fall back to the
    # CPU: bf16-pure and fp16 count as GPU intent as bf16 does.
    assert gpu_intent(precision, {}) == [f"training.precision = {precision!r}"]
    assert gpu_intent("fp32", {}) == gpu_intent("auto", {}) == []
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=f"training.precision = '{precision}'"):
            choose_device_type("auto", precision, env={})


@no_gpu
def test_trainer_refuses_auto_on_cpu_in_a_gpu_job(tmp_path, monkeypatch):
    from maester.config import load_config
    from maester.train.trainer import Trainer
    from tests.helpers import tiny_overrides, write_corpus

    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "8")
    cfg = load_config(None, tiny_overrides(write_corpus(tmp_path / "c.parquet"), tmp_path / "jobs",
                                           training__device="auto"), environ={})
    with pytest.raises(RuntimeError, match="SLURM_GPUS_ON_NODE=8"):
        Trainer(cfg, cfg.job_dir)


def test_environment_line_names_torch_and_device():
    line = describe_environment(torch.device("cpu"))
    assert line.startswith(f"torch {torch.__version__}") and "device cpu" in line
    if torch.version.cuda:
        assert f"CUDA {torch.version.cuda}" in line


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_environment_line_names_the_gpu():  # pragma: no cover - GPU check
    line = describe_environment(torch.device("cuda", 0))
    assert torch.cuda.get_device_name(0) in line and ("NCCL" in line or "RCCL" in line)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="the refusal needs a machine without MPS")
def test_mps_where_it_is_absent_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="training.device = 'mps', but this torch build .* has no MPS support"
                                           "|training.device = 'mps', but torch has MPS support but no MPS device"):
        choose_device_type("mps", "auto", env={})


def test_mps_is_one_process_on_the_mps_device(monkeypatch):
    """Where MPS is usable (shown by saying so to torch: this machine has none), the run gets the mps device in one
    process, and a multi-process launch is refused before any process group exists."""
    from maester.parallel.dims import init_distributed

    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed("mps") == (0, 1, torch.device("mps"))
    with pytest.raises(RuntimeError, match="'mps' trains in one process, but 2 were started"):
        choose_device_type("mps", "auto", env={}, world_size=2)
    assert choose_device_type("auto", "auto", env={}) in ("cpu", "cuda")  # auto never picks MPS


def test_cpu_threads_are_shared_out_between_the_local_processes(monkeypatch):
    from maester.cpus import usable_cpus
    from maester.parallel.dims import set_cpu_threads

    before = torch.get_num_threads()
    cores = usable_cpus()
    try:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        line = set_cpu_threads(None, torch.device("cpu"))
        assert line.startswith(f"{min(before, cores)} CPU thread(s) per process ({cores} usable CPU(s) by affinity "
                               f"and cgroup quota; idle threads: ")
        assert torch.get_num_threads() == min(before, cores)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        assert set_cpu_threads(None, torch.device("cpu")).startswith(f"{max(1, cores // 2)} CPU thread(s) per process")
        assert torch.get_num_threads() == max(1, cores // 2)
        assert set_cpu_threads(3, torch.device("cpu")).startswith("3 CPU thread(s)")  # the setting wins
        assert torch.get_num_threads() == 3
        assert set_cpu_threads(3, torch.device("cuda")) is None  # a GPU run keeps torch's setting
    finally:
        torch.set_num_threads(before)
