"""Learning-rate schedules as pure functions of the step: nothing to checkpoint but the step itself."""

from __future__ import annotations

import math

from maester.config import ScheduleConfig


def warmup_steps(cfg: ScheduleConfig, total_steps: int) -> int:
    """The warmup of a schedule of `total_steps`: `warmup_fraction` of them (rounded), else `warmup_steps`, at most
    `total_steps` (a shortened run warms up over all of its steps rather than failing)."""
    if cfg.warmup_fraction is not None:
        return min(round(cfg.warmup_fraction * total_steps), total_steps)
    return min(cfg.warmup_steps, max(total_steps, 0))


def warmup_clamped(cfg: ScheduleConfig, total_steps: int) -> str | None:
    """The warning for a `warmup_steps` longer than the schedule of `total_steps`, else None."""
    if cfg.warmup_fraction is not None or cfg.warmup_steps <= total_steps:
        return None
    return (f"schedule.warmup_steps = {cfg.warmup_steps} is longer than the {total_steps} step(s) this run schedules: "
            f"warming up over all {total_steps} (set schedule.warmup_steps, or schedule.warmup_fraction for a share "
            f"of the run)")


def lr_multiplier(cfg: ScheduleConfig, step: int, total_steps: int) -> float:
    """Multiplier of the base LR for optimizer step `step` (1-based) of `total_steps`."""
    warmup = warmup_steps(cfg, total_steps)
    if step <= warmup:
        return step / warmup
    floor = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "step":
        return cfg.step_gamma ** sum(step > m for m in cfg.step_milestones)
    if cfg.name == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * total_steps))
        decay_start = max(warmup, total_steps - decay_steps)
        if step <= decay_start:
            return 1.0
        p = min(1.0, (step - decay_start) / max(1, total_steps - decay_start))
        shape = {"linear": 1 - p, "1-sqrt": 1 - math.sqrt(p), "cosine": 0.5 * (1 + math.cos(math.pi * p))}
        return floor + (1 - floor) * shape[cfg.decay_shape]
    p = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if cfg.name == "linear":
        return floor + (1 - floor) * (1 - p)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))  # cosine
