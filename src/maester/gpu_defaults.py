"""What the `auto` settings resolve for, and the test switch that makes a CPU run take a GPU run's choices.

A setting left at `auto` is resolved by the device the run is on: `training.precision` is bf16 on a GPU and fp32 on
the CPU, `checkpoint.async_mode` is `async` on a GPU and `off` on the CPU, and so on. Tests on the CPU then never meet
the combinations that every GPU run meets by default (float8 with background saves was one: a GPU run wrote garbage
into every interval checkpoint, and no CPU test ever saved in the background). With `_MAESTER_GPU_DEFAULTS=1` in the
environment, a CPU run resolves each `auto` that the CPU can honour as a CUDA run does (`resolves_as`):

- `training.precision`: bf16 (autocast, or FSDP's mixed precision);
- `checkpoint.async_mode`: `async` (staged into host buffers, written by a thread);
- `optimizer.muon.ns_dtype`: bfloat16 Newton-Schulz iterations;
- `maester generate --dtype` and `maester chat --dtype`: bfloat16.

`optimizer.implementation = "auto"` needs no switch: torch's fused kernels exist on the CPU too, and `auto` takes
them there as on a GPU. `NOT_ON_THE_CPU` names the GPU choices the switch cannot make, and why. The switch is for
tests (tests/combinations); users never need it. No torch here: precision, checkpoints and the models import it.
"""

from __future__ import annotations

import os

GPU_DEFAULTS_ENV = "_MAESTER_GPU_DEFAULTS"

NOT_ON_THE_CPU: dict[str, str] = {
    "training.device = auto": "takes a GPU where torch can use one; there is none, and the switch does not pretend "
                              "one (the run says it is on the CPU)",
    "model.attention = auto": "takes FlexAttention on CUDA wherever a mask is needed (documents, sliding windows, "
                              "context parallel, soft-capped scores); FlexAttention has no backward on the CPU "
                              "(torch 2.15), so a CPU run trains with SDPA or plain attention and a dense mask",
    "MoE experts (auto dispatch)": "run as one torch._grouped_mm per projection on GPUs with a grouped kernel "
                                   "(SM90/SM100, gfx942/gfx950); the CPU has no such kernel and _grouped_mm no "
                                   "backward there, so the experts run one by one",
    "checkpoint.async_mode = pinned": "page-locked host buffers need CUDA; refused on the CPU (use async)",
    "training.float8": "real float8 matmuls need a GPU with them (SM 8.9+, gfx942/gfx950); the CPU emulates their "
                       "rounding (training.float8.emulate = true, which a GPU refuses)",
    "float8 tensor-parallel styles": "torchao's float8 all-gathers of activations under TP are taken on CUDA only; "
                                     "a CPU run's TP gathers in high precision",
    "SDPA kernel order": "cuDNN, then Flash first on Hopper: CUDA kernels that the CPU does not have",
    "parallel.compile kernels": "Inductor writes Triton kernels for a GPU and C++ for the CPU: a compiled CPU run "
                                "traces and lowers the same graphs, but runs other kernels",
}
"""The GPU choices a CPU run cannot make under the switch, and why (the switch leaves these as the CPU has them)."""


def resolves_as(device_type: str) -> str:
    """The device type whose defaults an `auto` setting of a run on `device_type` takes: `device_type` itself, or
    `cuda` for a CPU run under `_MAESTER_GPU_DEFAULTS=1`."""
    if device_type == "cpu" and os.environ.get(GPU_DEFAULTS_ENV) == "1":
        return "cuda"
    return device_type
