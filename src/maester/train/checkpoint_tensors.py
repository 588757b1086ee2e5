"""What a checkpoint may hold: plain tensors, DTensors of plain tensors, and plain values (numbers, strings, None,
in dicts, lists and tuples). `plain_state` turns a state dict into that before it is staged or written, and before
a load reads into it, so that a checkpoint never pickles a class and loads in a process that never imported the
library a tensor subclass came from.

A tensor subclass is unwrapped by its rule in `UNWRAP` (keyed by the class's qualified name, so the library is
never imported here) to a plain tensor that shares its storage: no copy is made, and a load into the unwrapped
tensor writes the live one. Any other subclass is refused, naming the entry and its type.

Why a rule and not DCP's own handling: DCP's stager copies a wrapper subclass with `new_empty` and then its
`__dict__`; torchao's float8 weight does not keep its class under `new_empty`, so the staged copy was a plain,
uninitialised tensor (a background save wrote garbage), while a synchronous save pickled torchao's class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
PLAIN_VALUES = (int, float, bool, str, bytes, type(None))

UNWRAP: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # torchao's float8 weight under FSDP2's float8 all-gather: the high-precision weight is its `_tensor`
    "torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor": lambda t: t._tensor,
}


def register_unwrap(cls: type | str, unwrap: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Let checkpoints hold tensors of subclass `cls` (a class or its qualified name) as `unwrap(t)`: a plain
    tensor with the same values, sharing `t`'s storage."""
    UNWRAP[cls if isinstance(cls, str) else qualified_name(cls)] = unwrap


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def state_to_save(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """What a checkpoint holds of `model` and `optimizer` (None: the model only): their state dicts, sharded as
    they are, with plain tensors only (`plain_state`), sharing storage with the live tensors."""
    if optimizer is None:
        return plain_state({"model": get_model_state_dict(model)})
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return plain_state({"model": model_sd, "optimizer": optim_sd})


def plain_state(state, key: str = ""):
    """`state` (a state dict: nested dicts, lists and tuples) with every tensor plain or a DTensor of a plain local
    tensor, sharing storage with the original; a value of any other type is a ValueError naming its key."""
    if isinstance(state, dict):
        return {k: plain_state(v, f"{key}.{k}" if key else str(k)) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(plain_state(v, f"{key}[{i}]") for i, v in enumerate(state))
    if isinstance(state, torch.Tensor):
        return plain_tensor(state, key)
    if isinstance(state, PLAIN_VALUES):
        return state
    raise ValueError(f"checkpoint entry {key} is a {qualified_name(type(state))}, which a checkpoint cannot hold "
                     f"without pickling its class: only tensors, numbers, strings and None")


def plain_tensor(t: torch.Tensor, key: str) -> torch.Tensor:
    """`t` as a plain tensor (or a DTensor of one) sharing its storage, by the `UNWRAP` rule of its class."""
    from torch.distributed.tensor import DTensor

    if type(t) is DTensor:
        local = t._local_tensor
        if type(local) in PLAIN_TENSORS:
            return t
        with torch.no_grad():
            return DTensor.from_local(_unwrapped(local, key), t.device_mesh, t.placements, run_check=False,
                                      shape=t.shape, stride=t.stride())
    return t if type(t) in PLAIN_TENSORS else _unwrapped(t, key)


def _unwrapped(t: torch.Tensor, key: str) -> torch.Tensor:
    name = qualified_name(type(t))
    rule = UNWRAP.get(name)
    if rule is None:
        raise ValueError(f"checkpoint entry {key} is a tensor of type {name}, which a checkpoint cannot hold "
                         f"without pickling its class, and no rule unwraps it to a plain tensor "
                         f"(maester.train.checkpoint_tensors.register_unwrap)")
    inner = rule(t)
    if type(inner) not in PLAIN_TENSORS or inner.shape != t.shape or inner.dtype != t.dtype:
        raise ValueError(f"checkpoint entry {key}: the unwrap rule of {name} gave a {qualified_name(type(inner))} "
                         f"of {inner.dtype} {tuple(inner.shape)} for a tensor of {t.dtype} {tuple(t.shape)}")
    return inner
