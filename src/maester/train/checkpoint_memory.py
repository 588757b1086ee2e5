"""Host memory of background saves (`checkpoint.async_mode` async or pinned): each rank keeps a host copy of its
sharded model and optimizer state, made by DCP's stager at the first save and refilled at every later one, for the
life of the run. Llama 3 8B with AdamW over 8 GPUs is 12 GB a rank, 96 GB a node; 70B over 8 GPUs is more than a
node's memory.

- `staged_bytes`: one rank's copy, as the stager makes it, before the first step too;
- `available_host_memory`: what this node can still give (MemAvailable, within the cgroup's limit);
- `fit_async_mode`: whether the copies of each node's ranks fit (`HOST_SHARE` of its available memory): `auto` saves
  synchronously where they do not, saying so in one line; an explicit `async` or `pinned` is refused.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import torch
from torch import nn

from maester.cpus import cgroup_dirs
from maester.train.checkpoint_tensors import plain_state

log = logging.getLogger("maester")

HOST_SHARE = 0.75
"""The share of a node's available memory the staged copies of its ranks may take: the rest stays for the data
loaders, the page cache of the writes and the CUDA context."""

GIB = 1 << 30


def staged_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """The host memory DCP's stager takes for this rank's copy of a checkpoint's state (`state_to_save`): every
    storage once and whole (FSDP's padded shards included). Optimizer state that no step has made yet is counted as
    the tensors like each parameter's local shard that the optimizer makes (`state_copies`); per-row and scalar
    state (step counters) is left out."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    storages: dict[int, torch.UntypedStorage] = {}  # by id, as the stager keeps them; held so that no id is reused

    def add(tensor: torch.Tensor) -> None:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        storages.setdefault(id(storage), storage)

    for tensor in _tensors(plain_state(get_model_state_dict(model))):
        add(tensor)
    missing = 0
    for group in (optimizer.param_groups if optimizer is not None else []):
        for param in group["params"]:
            if optimizer.state.get(param):
                for tensor in _tensors(plain_state(dict(optimizer.state[param]))):
                    add(tensor)
            else:
                local = param.to_local() if hasattr(param, "to_local") else param
                missing += state_copies(optimizer, group) * local.numel() * local.element_size()
    return sum(s.nbytes() for s in storages.values()) + missing


def _tensors(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _tensors(value)
    elif isinstance(state, torch.Tensor):
        yield state


def state_copies(optimizer: torch.optim.Optimizer, group: dict) -> int:
    """How many tensors like each parameter of `group` the first step of `optimizer` makes: Adam's two moments
    (three with amsgrad), Muon's momentum (its AdamW groups: two), SGD's momentum buffer, ...; an optimizer not
    listed counts as Adam."""
    name = type(optimizer).__name__
    if name == "Muon":
        return 1 if group.get("muon") else 2
    if name == "SGD":
        return int(bool(group.get("momentum")))
    if name in ("Adagrad", "RMSprop"):
        return 1 + int(bool(group.get("momentum"))) + int(bool(group.get("centered")))
    return 2 + int(bool(group.get("amsgrad")))


def available_host_memory(meminfo: Path = Path("/proc/meminfo"), root: Path = Path("/sys/fs/cgroup"),
                          membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes this node can still give this process: MemAvailable, at most its cgroup's memory limit less its usage
    (a SLURM step's or a container's: cgroup v2 `memory.max`, v1 `memory.limit_in_bytes`, of its cgroup and
    ancestors); None where neither can be read (not Linux)."""
    found = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError):
        pass
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [(d / "memory.max", d / "memory.current") for d in cgroup_dirs(root, path)]
        elif "memory" in controllers.split(","):
            files = [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes")
                     for d in cgroup_dirs(root / controllers, path)]
        else:
            continue
        found += [left for limit, usage in files if (left := _left(limit, usage)) is not None]
    return min(found) if found else None


def _left(limit: Path, usage: Path) -> int | None:
    try:
        cap, used = limit.read_text().strip(), int(usage.read_text())
    except (OSError, ValueError):
        return None
    if cap == "max" or not cap.isdigit() or int(cap) >= 1 << 60:  # v1 writes "no limit" as a huge number
        return None
    return max(0, int(cap) - used)


def node_host_memory(bytes_per_rank: int) -> dict[str, dict]:
    """Per node (host name): its ranks, the bytes of their staged copies together, and its available memory (the
    least any of its ranks read; None: unknown). A collective over the default group where one exists."""
    import torch.distributed as dist

    mine = (socket.gethostname(), bytes_per_rank, available_host_memory())
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    nodes: dict[str, dict] = {}
    for host, staged, available in everyone:
        node = nodes.setdefault(host, {"ranks": 0, "staged": 0, "available": available})
        node["ranks"] += 1
        node["staged"] += staged
        if available is not None and (node["available"] is None or available < node["available"]):
            node["available"] = available
    return nodes


def fit_async_mode(setting: str, mode: str, nodes: dict[str, dict]) -> str:
    """The async mode to run with: `mode` (resolved from `setting`, `checkpoint.async_mode`) where the staged copies
    of every node fit `HOST_SHARE` of its available memory (`node_host_memory`); else `off` for `auto`, logged in
    one line, and a ValueError for an explicit `async` or `pinned`. The same on every rank."""
    if mode == "off":
        return mode
    over = {host: n for host, n in nodes.items() if n["available"] is not None
            and n["staged"] > HOST_SHARE * n["available"]}
    if not over:
        unknown = sorted(host for host, n in nodes.items() if n["available"] is None)
        if unknown:
            log.warning("checkpoint.async_mode = %r: the available host memory of %s cannot be read, so the "
                        "background saves' host copies (%s) are not checked against it", setting,
                        ", ".join(unknown), _sizes(nodes))
        return mode
    host, node = max(over.items(), key=lambda item: item[1]["staged"] / max(item[1]["available"], 1))
    why = (f"the background saves' host copy of each rank's state takes {node['staged'] / GIB:.1f} GiB on {host} "
           f"({node['ranks']} rank(s)), more than {HOST_SHARE:.0%} of its {node['available'] / GIB:.1f} GiB available")
    if setting == "auto":
        log.warning("checkpoint.async_mode = 'auto' saves synchronously: %s", why)
        return "off"
    raise ValueError(f"checkpoint.async_mode = {setting!r}: {why}; set checkpoint.async_mode = 'off' (or 'auto', "
                     f"which saves synchronously where the copies do not fit), or use more nodes")


def _sizes(nodes: dict[str, dict]) -> str:
    return ", ".join(f"{host}: {n['staged'] / GIB:.1f} GiB for {n['ranks']} rank(s)" for host, n in nodes.items())
