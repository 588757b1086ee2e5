"""Host memory of background checkpoints (`checkpoint.async_mode`): at its first interval save each rank copies its
sharded model and optimizer state into host buffers (DCP's stager) and keeps them for the run, so a node holds that
copy once for each of its ranks. Set beside the node's memory (`slurm.mem`) where the config says it."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from maester.config import Config
from maester.plan.device import gib_text

ASSUMED_RANKS_PER_NODE = 8
SLURM_MEM_UNITS = {"": 2**-10, "K": 2**-20, "M": 2**-10, "G": 1, "T": 2**10}
"""GiB per unit of sbatch's --mem (binary multiples; no unit: megabytes)."""


@dataclass(frozen=True)
class CheckpointHost:
    mode: str
    """`checkpoint.async_mode` as a GPU run resolves it: "async", "pinned" or "off"."""
    setting: str
    per_rank_gib: float
    ranks_per_node: int
    ranks_from: str
    node_memory_gib: float | None
    node_memory_from: str
    off_because: str = ""

    @property
    def per_node_gib(self) -> float:
        return self.per_rank_gib * self.ranks_per_node

    @property
    def exceeds(self) -> bool:
        return self.node_memory_gib is not None and self.per_node_gib > self.node_memory_gib

    def lines(self) -> list[str]:
        if self.mode == "off":
            return [f"host memory for background checkpoints: none ({self.off_because})"]
        how = f"checkpoint.async_mode {self.setting}" + (f" = {self.mode} on GPUs" if self.setting == "auto" else "")
        ranks = f"{self.ranks_per_node} rank{'s' if self.ranks_per_node != 1 else ''}"
        lines = [f"host memory per node for background checkpoints ({how}): {gib_text(self.per_node_gib)} GiB, "
                 f"{ranks} ({self.ranks_from}) x {gib_text(self.per_rank_gib)} GiB (each rank's "
                 f"sharded model and optimizer state, copied at the first save and kept)"]
        if self.node_memory_gib is None:
            lines.append(f"  the nodes' memory: {self.node_memory_from}; set slurm.mem (e.g. --slurm.mem=480G) to "
                         f"check it")
        elif self.exceeds:
            then = ("`auto` saves synchronously instead" if self.setting == "auto" else
                    f"async_mode = '{self.setting}' is refused before step 1")
            lines.append(f"  EXCEEDS the node's {self.node_memory_gib:g} GiB ({self.node_memory_from}): {then}")
        else:
            lines.append(f"  within the node's {self.node_memory_gib:g} GiB ({self.node_memory_from})")
        return lines

    def to_json(self) -> dict:
        return {**asdict(self), "per_node_gib": self.per_node_gib, "exceeds": self.exceeds}


def slurm_mem_gib(text: str | None) -> tuple[float | None, str]:
    """sbatch's --mem per node in GiB, and what it is; None where it does not give a size."""
    if text is None:
        return None, "slurm.mem not set (the cluster's default)"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]?)B?", text.strip().upper())
    if match is None:
        return None, f"slurm.mem {text!r} is not a size sbatch reads"
    if float(match.group(1)) == 0:
        return None, "slurm.mem 0: all of a node's memory, whose size the config does not say"
    return float(match.group(1)) * SLURM_MEM_UNITS[match.group(2)], f"slurm.mem {text}"


def checkpoint_host(cfg: Config, gpus: int, per_rank_bytes: float) -> CheckpointHost:
    """The host copy of background checkpoints of `cfg` on `gpus` GPUs, whose ranks each hold `per_rank_bytes` of
    sharded model and optimizer state."""
    c, s = cfg.checkpoint, cfg.slurm
    mode = "async" if c.async_mode == "auto" else c.async_mode
    per_node = s.nproc_per_node or s.gpus_per_node
    if per_node:
        ranks, ranks_from = min(per_node, gpus), "slurm"
    else:
        ranks, ranks_from = min(gpus, ASSUMED_RANKS_PER_NODE), f"assumed: up to {ASSUMED_RANKS_PER_NODE} GPUs a node"
    memory, memory_from = slurm_mem_gib(s.mem)
    if mode == "off" or not c.interval:
        why = "checkpoint.async_mode = 'off'" if mode == "off" else "checkpoint.interval = 0: only synchronous saves"
        return CheckpointHost("off", c.async_mode, 0.0, ranks, ranks_from, memory, memory_from, why)
    return CheckpointHost(mode, c.async_mode, per_rank_bytes / 2**30, ranks, ranks_from, memory, memory_from)
