"""`training.precision` resolved into one mechanism per run.

| precision   | parameters and optimizer state | compute (FSDP)                | compute (one device, DDP, TP) | loss scaling |
|-------------|--------------------------------|-------------------------------|-------------------------------|--------------|
| `fp32`      | float32                        | float32                       | float32                       | no           |
| `bf16`      | float32                        | FSDP mixed precision, bf16    | autocast bf16                 | no           |
| `bf16-pure` | bfloat16 (half the memory)     | bfloat16                      | bfloat16                      | no           |
| `fp16`      | float32                        | FSDP mixed precision, fp16    | autocast fp16                 | dynamic      |

Under FSDP the mixed-precision policy alone casts (no autocast on top), as torchtitan does: two mechanisms
casting the same tensors hid that `fp32` computed in bf16. `auto` is `bf16` on GPUs and `fp32` on CPU (bf16 there too
under the test switch of `maester.gpu_defaults`).
Gradients are reduced in `parallel.reduce_dtype` (float32 by default) in every mode.

Inference (`maester generate`, `maester chat`) stores and computes in one dtype, `inference_dtype`: `auto` is
bfloat16 on GPUs and float32 on CPU, as for training.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maester.gpu_defaults import resolves_as

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_COMPUTE = {"fp32": "float32", "bf16": "bfloat16", "bf16-pure": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Precision:
    mode: str  # fp32, bf16, bf16-pure or fp16
    compute_dtype: torch.dtype
    param_dtype: torch.dtype  # what the parameters (and so the optimizer state) are stored in
    autocast_dtype: torch.dtype | None  # None: no autocast
    fsdp_param_dtype: torch.dtype | None  # the FSDP MixedPrecisionPolicy's param_dtype; None: no FSDP
    loss_scaling: bool  # fp16: dynamic loss scaling (maester.train.grad_scaler)


def resolve_precision(precision: str, param_dtype: str, device_type: str, fsdp: bool) -> Precision:
    """`precision` is `training.precision`, `param_dtype` is `parallel.param_dtype` (`auto` follows the
    precision; another value must agree with it), `fsdp` whether FSDP shards the model."""
    mode = precision if precision != "auto" else ("bf16" if resolves_as(device_type) == "cuda" else "fp32")
    if mode not in _COMPUTE:
        raise ValueError(f"training.precision = {precision!r} is not one of auto, {', '.join(_COMPUTE)}")
    compute = _COMPUTE[mode]
    if param_dtype not in ("auto", compute):
        raise ValueError(f"parallel.param_dtype = {param_dtype!r} disagrees with training.precision = "
                         f"{precision!r} (it computes in {compute}): leave parallel.param_dtype = 'auto' or set "
                         f"the precision instead")
    dtype = DTYPES[compute]
    stored = torch.bfloat16 if mode == "bf16-pure" else torch.float32
    mixed = mode in ("bf16", "fp16")
    return Precision(mode=mode, compute_dtype=dtype, param_dtype=stored,
                     autocast_dtype=dtype if mixed and not fsdp else None,
                     fsdp_param_dtype=dtype if fsdp else None, loss_scaling=mode == "fp16")


def inference_dtype(choice: str, device_type: str) -> torch.dtype:
    """The dtype a model is loaded and run in for generation: `choice` is one of `DTYPES` or `auto`."""
    if choice == "auto":
        return torch.bfloat16 if resolves_as(device_type) == "cuda" else torch.float32
    if choice not in DTYPES:
        raise ValueError(f"--dtype {choice!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[choice]


def autocast(precision: Precision, device: torch.device):
    """The forward's autocast context (a no-op where the precision needs none)."""
    import contextlib

    if precision.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=precision.autocast_dtype)
