"""Optimizer construction: AdamW with weight decay on matrices only."""

from __future__ import annotations

import torch
from torch import nn

from maester.config import OptimizerConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: `decay` (2-D+ weights) and `no_decay` (embeddings, norms, biases)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embeddings" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, device: torch.device) -> torch.optim.Optimizer:
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    kwargs = {"fused": impl == "fused", "foreach": impl == "foreach"}
    return torch.optim.AdamW(parameter_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                             eps=cfg.eps, **kwargs)
