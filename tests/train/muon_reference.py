"""The Muon tests' oracle: one Muon step of one whole matrix on one process, written to be obviously right."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from maester.train.muon import NORMUON_EPS, momentum_at, newton_schulz, shape_scale


def reference_muon_step(param: Tensor, grad: Tensor, state: dict, *, lr: float, weight_decay: float = 0.0,
                        momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                        lr_scaling: str = "spectral", coefficients: str = "quintic",
                        momentum_warmup_steps: int = 0, momentum_warmup_start: float = 0.85,
                        normuon: bool = False, normuon_beta2: float = 0.95,
                        split: Sequence[int] | None = None, ns_dtype: torch.dtype = torch.float32) -> None:
    """One Muon step of `param`, in place. `state` is a plain dict this function owns; `split` lists the row
    counts of fused matrices."""
    state["step"] = state.get("step", 0) + 1
    mu = momentum_at(state["step"], momentum, momentum_warmup_steps, momentum_warmup_start)
    buf = state.setdefault("momentum_buffer", torch.zeros_like(grad))
    buf.mul_(mu).add_(grad)
    update = grad + mu * buf if nesterov else buf.clone()
    rows, cols = param.shape
    v = state.setdefault("normuon_v", torch.zeros(rows, device=param.device)) if normuon else None
    pieces, start = [], 0
    for size in split or [rows]:
        O = newton_schulz(update[start:start + size], ns_steps, coefficients, ns_dtype).float()
        if v is not None:
            block_v = v[start:start + size]
            block_v.mul_(normuon_beta2).add_((1 - normuon_beta2) * O.square().mean(dim=1))
            normalised = O / (block_v.sqrt() + NORMUON_EPS)[:, None]
            O = normalised * (O.norm() / normalised.norm().clamp_min(NORMUON_EPS))
        pieces.append(shape_scale(size, cols, lr_scaling) * O)
        start += size
    param.mul_(1 - lr * weight_decay)
    param.sub_(lr * torch.cat(pieces).to(param.dtype))
