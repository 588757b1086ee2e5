"""Which device a run trains on, which collective backend serves which device, and what the GPU stack is.

`training.device = "auto"` takes the GPU when torch can use one. When it cannot, it trains on the CPU only if
nothing says a GPU was meant: a GPU job whose torch cannot see its GPUs (a driver older than the CUDA build needs, a
CUDA wheel on an AMD node) must fail at start, not train for hours on the host.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

GPU_VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
SLURM_GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS",
                       "SLURM_GPUS", "SLURM_GPUS_PER_TASK")


def process_group_backend(device_type: str) -> str:
    """The backend string for `init_process_group`: on a GPU, NCCL (RCCL on ROCm) for device tensors and gloo for
    host tensors, so a statistic or a flag that lives on the host never reaches NCCL, which serves CUDA tensors
    only (OLMo-core's default, "cpu:gloo,cuda:nccl"); on the CPU, gloo."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def gpu_intent(precision: str, env: Mapping[str, str] | None = None) -> list[str]:
    """What says this run was meant for GPUs: the reasons, each naming its source; empty: nothing does."""
    env = os.environ if env is None else env
    reasons = []
    for name in GPU_VISIBILITY_VARIABLES:
        value = env.get(name, "").strip()
        if value and value not in ("-1", "none", "NoDevFiles"):
            reasons.append(f"{name}={value}")
    for name in SLURM_GPU_VARIABLES:
        value = env.get(name, "").strip()
        if value and value not in ("0", "(null)"):
            reasons.append(f"{name}={value} (a SLURM job with GPUs; a GPU template sets it)")
    if precision not in ("auto", "fp32"):  # bf16, bf16-pure and fp16 are GPU precisions
        reasons.append(f"training.precision = {precision!r}")
    return reasons


def why_no_gpu() -> str:
    """Why torch cannot use a GPU here, in words a user can act on."""
    build = f"torch {torch.__version__}"
    if torch.version.cuda is None and torch.version.hip is None:
        return f"{build} is a CPU-only build (no CUDA or ROCm support): install a GPU build (docs/install.md)"
    try:
        torch.cuda.init()
    except Exception as e:  # torch's own reason: no driver, a driver too old for this build, no device
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        reason = f"torch sees {torch.cuda.device_count()} device(s)"
    stack = f"CUDA {torch.version.cuda}" if torch.version.cuda else f"ROCm/HIP {torch.version.hip}"
    hint = ""
    if torch.version.cuda and Path("/dev/kfd").exists():
        hint = "; this node has AMD GPUs (/dev/kfd) but torch is a CUDA build: use a ROCm build (docs/install.md)"
    return f"{build} ({stack}) cannot use a GPU: {reason}{hint}"


class DeviceUnavailable(RuntimeError, ValueError):
    """The run asks for a GPU that cannot be used: a one-line error of the run's settings, not a crash."""


def why_no_mps() -> str | None:
    """Why this process cannot use Apple's MPS device, or None if it can."""
    if torch.backends.mps.is_available():
        return None
    if not torch.backends.mps.is_built():
        return f"this torch build ({torch.__version__}) has no MPS support (MPS needs a macOS build on Apple Silicon)"
    return "torch has MPS support but no MPS device is usable here (it needs Apple Silicon and macOS 12.3 or later)"


def choose_device_type(choice: str, precision: str, env: Mapping[str, str] | None = None,
                       world_size: int = 1) -> str:
    """"cuda", "mps" or "cpu" for `training.device` = `choice` ("auto", "cuda", "mps" or "cpu"); raises where the
    device was meant and cannot be used, saying why."""
    if choice == "cpu":
        return "cpu"
    if choice == "mps":
        reason = why_no_mps()
        if reason:
            raise DeviceUnavailable(f"training.device = 'mps', but {reason}")
        if world_size > 1:
            raise DeviceUnavailable(f"training.device = 'mps' trains in one process, but {world_size} were started "
                                    f"(no distributed backend serves MPS): run it without torchrun, or nproc 1")
        return "mps"
    if torch.cuda.is_available():
        return "cuda"
    if choice == "cuda":
        raise DeviceUnavailable(f"training.device = 'cuda', but {why_no_gpu()}")
    reasons = gpu_intent(precision, env)
    if reasons:
        raise DeviceUnavailable(f"training.device = 'auto' found no usable GPU, but this run was meant for GPUs "
                           f"({'; '.join(reasons)}): {why_no_gpu()}. To train on the CPU on purpose, set "
                           f"training.device = 'cpu'")
    return "cpu"


def choose_inference_device(choice: str, local_rank: int = 0, env: Mapping[str, str] | None = None) -> torch.device:
    """The device of `--device` for generate and chat: `cpu`; `cuda` (the GPU of this process, LOCAL_RANK under
    torchrun); `cuda:N`; or `auto`, the GPU where torch can use one and the CPU only where nothing says a GPU was
    meant (as `training.device = "auto"`). A GPU asked for and unusable is an error, never a CPU run."""
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        reasons = gpu_intent("auto", env)
        if reasons:
            raise DeviceUnavailable(f"--device auto found no usable GPU, but a GPU was meant ({'; '.join(reasons)}): "
                                    f"{why_no_gpu()}. To run on the CPU on purpose, pass --device cpu")
        return torch.device("cpu")
    kind, _, index = choice.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device {choice!r} is not one of auto, cpu, cuda, cuda:N")
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"--device {choice}, but {why_no_gpu()}")
    n = int(index) if index else local_rank
    if n >= torch.cuda.device_count():
        raise DeviceUnavailable(f"--device {choice}: torch sees {torch.cuda.device_count()} GPU(s), "
                                f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return torch.device("cuda", n)


def describe_environment(device: torch.device) -> str:
    """torch, CUDA/HIP and driver versions, the collective library and the GPU: one line for the start of a log."""
    parts = [f"torch {torch.__version__}"]
    if torch.version.cuda:
        parts.append(f"CUDA {torch.version.cuda}")
    if torch.version.hip:
        parts.append(f"HIP {torch.version.hip}")
    if device.type != "cuda":
        return ", ".join(parts + [f"device {device}"])
    props = torch.cuda.get_device_properties(device)
    driver = _driver_version()
    if driver:
        parts.append(f"driver {driver}")
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        parts.append(f"{'RCCL' if torch.version.hip else 'NCCL'} {nccl}")
    except Exception:  # a build without NCCL
        pass
    arch = getattr(props, "gcnArchName", "") if torch.version.hip else f"sm_{props.major}{props.minor}"
    parts.append(f"{torch.cuda.device_count()} x {props.name} ({arch}, "
                 f"{props.total_memory / 2**30:.0f} GiB); device {device}")
    return ", ".join(parts)


def _driver_version() -> str | None:
    """The kernel driver's version where the system says it (NVIDIA's /proc entry, AMD's amdgpu module)."""
    for path in (Path("/proc/driver/nvidia/version"), Path("/sys/module/amdgpu/version")):
        try:
            text = path.read_text()
        except OSError:
            continue
        for word in text.split():
            if word[:1].isdigit() and "." in word:
                return word
    return None
