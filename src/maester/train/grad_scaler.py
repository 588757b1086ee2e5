"""Dynamic loss scaling for `training.precision = "fp16"` (GPUs without bf16: V100, T4).

torch.amp.GradScaler's algorithm, kept on the device: the backward loss is multiplied by `scale`; an overflow
(an inf or NaN in any gradient) shows as a non-finite global gradient norm, which the step computes anyway and
which is the same on every rank (FSDP, DDP and TP reduce it), so all ranks skip together without another
collective; `torch._amp_update_scale_` then halves the scale, or doubles it after `growth_interval` clean steps.
"""

from __future__ import annotations

import torch


class LossScaler:
    def __init__(self, device: torch.device, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale = torch.full((), init_scale, dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval

    def unscale(self, grads: list[torch.Tensor], scaled_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Divide the gradients by the scale in place; returns the true gradient norm and the overflow flag
        (1.0: this step's gradients are not finite and its update must be skipped)."""
        inv = self.scale.double().reciprocal().float()
        if grads:
            torch._foreach_mul_(grads, inv)
        overflow = (~torch.isfinite(scaled_norm)).float()
        return scaled_norm * inv, overflow

    def update(self, overflow: torch.Tensor) -> None:
        torch._amp_update_scale_(self.scale, self.growth_tracker, overflow, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)

    def state_dict(self) -> dict:
        """For the checkpoint's trainer state (reads the device: only at checkpoints)."""
        return {"scale": float(self.scale), "growth_tracker": int(self.growth_tracker)}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self.growth_tracker.fill_(int(state["growth_tracker"]))
