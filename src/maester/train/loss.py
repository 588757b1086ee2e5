"""Token-level cross-entropy, summed, so the step can divide by the label count of the whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from maester.data.loader import IGNORE_INDEX


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the per-token losses in float32; positions labelled IGNORE_INDEX contribute nothing."""
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
