"""Small host values the ranks agree on, each a collective on the default group; one process reads its own."""

from __future__ import annotations

import torch
import torch.distributed as dist


def max_over_ranks(value: int) -> int:
    """The largest `value` of all ranks (a host collective; every rank must call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    most = torch.tensor([int(value)], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most)
