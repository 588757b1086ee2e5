"""The check that a checkpoint's staged host copy (DCP's stager, as background saves use it) holds the live state
bit for bit: every tensor of the model's and the optimizer's state dicts, each rank its own shards."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s values (of a DTensor: this rank's shard; of torchao's float8 weight: its weight)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    local = getattr(local, "_tensor", local)  # torchao's float8 wrapper holds the weight as `_tensor`
    return torch.Tensor.contiguous(local.detach()).reshape(-1).view(torch.uint8).cpu()


def assert_staged_equals_live(staged: dict, model, optimizer) -> int:
    """Every tensor of `staged` (a staged `state_to_save`) is a plain host tensor, or a DTensor of one, with the
    live value's bytes; the other values are equal. Returns the number of tensors compared."""
    from torch.distributed.tensor import DTensor

    model_sd, optim_sd = get_state_dict(model, optimizer)
    live = {"model": model_sd, "optimizer": optim_sd}
    compared = 0

    def walk(a, b, key):
        nonlocal compared
        if isinstance(b, dict):
            assert isinstance(a, dict) and a.keys() == b.keys(), key
            for k in b:
                walk(a[k], b[k], f"{key}.{k}")
        elif isinstance(b, (list, tuple)):
            assert len(a) == len(b), key
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif isinstance(b, torch.Tensor):
            local = a.to_local() if type(a) is DTensor else a
            assert type(local) is torch.Tensor and local.device.type == "cpu", (key, type(local), local.device)
            assert (a.dtype, a.shape) == (b.dtype, b.shape), key
            assert torch.equal(bits(a), bits(b)), f"{key}: the staged bytes differ from the live ones"
            compared += 1
        else:
            assert a == b, key

    walk(staged, live, "state")
    assert compared > 0
    return compared
