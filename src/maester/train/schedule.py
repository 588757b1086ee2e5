"""Learning-rate schedules as pure functions of the step: nothing to checkpoint but the step itself."""

from __future__ import annotations

import math

from maester.config import ScheduleConfig


def lr_multiplier(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base LR for optimizer step `step` (1-based) of `total_steps`."""
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "step":
        return cfg.step_gamma ** sum(step > m for m in cfg.step_milestones)
    if cfg.name == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = max(cfg.warmup_steps, total_steps - decay_steps)
        if step <= decay_start:
            return 1.0
        p = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        shape = {"linear": 1 - p, "1-sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}
        return floor + (1 - floor) * shape[cfg.decay_shape]
    p = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    if cfg.name == "linear":
        return floor + (1 - floor) * (1 - p)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))  # cosine
