"""The parallel layout: degrees from the config and the world size, checked before any work, as a named DeviceMesh."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from maester.config import Config
from maester.data.batch import BatchPlan
from maester.parallel.pipeline import check_pipeline


FLATTENED = {
    "dp_shard": ("dp_shard_mod_ep", "ep"),
    "dp_shard_cp": ("dp_shard_mod_ep", "ep", "cp"),
    "dp": ("dp_replicate", "dp_shard_mod_ep", "ep"),
    "dp_cp": ("dp_replicate", "dp_shard_mod_ep", "ep", "cp"),
}
"""The mesh's flattened dimensions and the dimensions each spans."""


@dataclass(frozen=True)
class ParallelDims:
    """world = pp x dp_replicate x dp_shard x cp x tp; ep (expert parallel) divides dp_shard and has no ranks of its
    own, as in torchtitan: the experts of a MoE layer are split over ep of the dp_shard ranks."""

    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int
    cp: int = 1
    pp: int = 1
    ep: int = 1
    force_fsdp: bool = False

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ParallelDims":
        """Resolve `dp_shard = -1` and refuse layouts that cannot work, saying what to change."""
        p = cfg.parallel
        others = p.pp * p.dp_replicate * p.cp * p.tp
        fixed = others * (p.dp_shard if p.dp_shard != -1 else 1)
        layout = (f"pp={p.pp} x dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x cp={p.cp} x tp={p.tp}"
                  if p.pp > 1 or p.cp > 1 else
                  f"dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x tp={p.tp}")
        if world_size % fixed:
            raise ValueError(f"parallel layout {layout} does not divide the {world_size} process(es): make the "
                             f"product of the degrees {'divide' if p.dp_shard == -1 else 'equal'} the world size")
        shard = world_size // fixed if p.dp_shard == -1 else p.dp_shard
        dims = cls(p.dp_replicate, shard, p.tp, world_size, cp=p.cp, pp=p.pp, ep=p.ep, force_fsdp=p.force_fsdp)
        if others * shard != world_size:
            raise ValueError(f"parallel layout {layout} = {others * shard} processes, but {world_size} "
                             f"were launched: set parallel.dp_shard = -1 or launch that many")
        dims._check_model_and_batch(cfg)
        return dims

    def _check_model_and_batch(self, cfg: Config) -> None:
        p, args = cfg.parallel, cfg.model.architecture()
        if self.tp > 1:
            for name in ("n_heads", "n_kv_heads", "ffn_hidden_dim"):
                if getattr(args, name) % self.tp:
                    raise ValueError(f"parallel.tp = {self.tp} does not divide the model's {name} "
                                     f"({getattr(args, name)}): choose a tp that divides it")
            if args.moe is not None and args.moe.expert_hidden_dim % self.tp:
                raise ValueError(f"parallel.tp = {self.tp} does not divide the model's moe.expert_hidden_dim "
                                 f"({args.moe.expert_hidden_dim}): choose a tp that divides it")
            if cfg.data.seq_len % self.tp:
                raise ValueError(f"parallel.tp = {self.tp} does not divide data.seq_len = {cfg.data.seq_len} "
                                 f"(sequence parallel splits the sequence)")
            if self.dp_shard == 1 and self.dp_replicate > 1:
                raise ValueError("DDP (dp_replicate > 1 with dp_shard = 1) cannot be combined with tp: "
                                 "use dp_shard (FSDP) or dp_replicate x dp_shard (HSDP) with tp")
        if self.cp > 1 and cfg.data.seq_len % (2 * self.cp):
            raise ValueError(f"parallel.cp = {self.cp} needs data.seq_len divisible by 2 x cp = {2 * self.cp} "
                             f"(each rank takes two chunks, one early and one late, to even out the causal mask); "
                             f"data.seq_len is {cfg.data.seq_len}: make it a multiple of {2 * self.cp}")
        if self.cp > 1 and args.moe is not None:
            raise ValueError(f"parallel.cp = {self.cp} with a mixture of experts ({cfg.model.name}/"
                             f"{cfg.model.flavor}) is not supported: its load-balancing loss and expert bias "
                             f"would see one cp rank's tokens only; set parallel.cp = 1")
        if self.cp > 1 and args.attention == "varlen":
            raise ValueError(f"parallel.cp = {self.cp} cannot use model.attention = 'varlen' (its documents would "
                             f"span ranks): use 'auto', 'flex' or 'sdpa'")
        if self.cp > 1 and self.pp > 1:
            raise ValueError(f"parallel.cp = {self.cp} with parallel.pp = {self.pp} is not supported yet (the "
                             f"pipeline stages would need each rank's share of the sequence): set one of them to 1")
        if self.ep > 1:
            if args.moe is None:
                raise ValueError(f"parallel.ep = {self.ep} splits a mixture of experts' experts, but "
                                 f"{cfg.model.name}/{cfg.model.flavor} is a dense model: set parallel.ep = 1")
            if args.moe.n_experts % self.ep:
                raise ValueError(f"parallel.ep = {self.ep} does not divide the model's moe.n_experts "
                                 f"({args.moe.n_experts}): choose an ep that divides it")
            if self.dp_shard % self.ep:
                raise ValueError(f"parallel.ep = {self.ep} must divide parallel.dp_shard = {self.dp_shard} "
                                 f"(expert parallel borrows dp_shard ranks): make dp_shard a multiple of ep")
            for other in ("cp", "pp"):
                if getattr(self, other) > 1:
                    raise ValueError(f"parallel.ep = {self.ep} with parallel.{other} = {getattr(self, other)} is not "
                                     f"supported yet: set parallel.{other} = 1, or parallel.ep = 1")
            if p.activation_checkpointing == "selective-op":
                raise ValueError(f"parallel.ep = {self.ep} gives the experts an FSDP unit of their own inside each "
                                 f"block, whose hooks selective checkpointing cannot replay (torch's selective "
                                 f"checkpointing matches every profiler marker of the recompute to the forward's): "
                                 f"set parallel.activation_checkpointing = \"full\"")
        on_gpu = cfg.training.device == "cuda" or (cfg.training.device == "auto" and torch.cuda.is_available())
        check_pipeline(cfg, args.n_layers, self.batch_plan(cfg, dp_rank=0).accumulation_steps, on_gpu)
        if p.cpu_offload and not on_gpu:
            raise ValueError("parallel.cpu_offload moves FSDP shards from GPU to CPU memory; this run is on the CPU "
                             "already: set parallel.cpu_offload = false")
        if not self.fsdp_enabled:
            for key, default in (("param_dtype", "auto"), ("cpu_offload", False)):
                if getattr(p, key) != default:
                    raise ValueError(f"parallel.{key} applies to FSDP only, but dp_shard = {self.dp_shard}: set "
                                     f"parallel.force_fsdp = true for FSDP on dp_shard = 1 (one GPU)")
        self.batch_plan(cfg, dp_rank=0)  # refuses a global batch that does not split

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1 or self.force_fsdp

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and self.dp_shard == 1 and self.cp == 1 and not self.force_fsdp

    @property
    def mesh(self):
        """The mesh ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp"), every dimension kept (size 1
        where unused). Its flattened views (`FLATTENED`, taken with `submesh`):
        - "dp_shard" = dp_shard_mod_ep x ep: FSDP of the dense parameters without CP;
        - "dp_shard_cp" = dp_shard x cp: FSDP of the dense parameters (the cp ranks hold the same weights);
        - "dp" = dp_replicate x dp_shard: the data-parallel ranks, one batch each (the cp and tp ranks of one dp
          rank read the same batch);
        - "dp_cp" = dp x cp: where the step's label tokens and loss are summed.
        Experts are split over "ep" and FSDP-sharded over "dp_shard_mod_ep"."""
        return self._meshes[0]

    @property
    def _flattened(self) -> dict:
        return self._meshes[1]

    @cached_property
    def _meshes(self) -> tuple:
        """The mesh and its flattened views, made together (every rank creates their process groups in the same
        order). The views are kept as `_flatten` returns them: torch deprecates slicing a flattened name from the
        root mesh ("users need to bookkeep the flattened mesh directly")."""
        from torch.distributed.device_mesh import init_device_mesh

        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"  # "cpu:gloo,cuda:nccl" on GPUs
        mesh = init_device_mesh(device_type,
                                (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp"))
        return mesh, {name: mesh[dims]._flatten(name) for name, dims in FLATTENED.items()}

    def submesh(self, *names: str):
        """The mesh of the dimensions `names`, in mesh order: the mesh's own or flattened ones (`FLATTENED`), such
        as ("dp_replicate", "dp_shard") for HSDP. Flattened ones are the kept meshes, joined to the others with
        DeviceMesh._concatenate (no new process groups); a torch without it slices the root as before."""
        flat = self._flattened
        if not any(name in flat for name in names):
            return self.mesh[names[0] if len(names) == 1 else names]
        if len(names) == 1:
            return flat[names[0]]
        from torch.distributed.device_mesh import DeviceMesh

        concatenate = getattr(DeviceMesh, "_concatenate", None)
        if concatenate is None:
            return self.mesh[names]
        return concatenate([flat[name] if name in flat else self.mesh[name] for name in names])

    def process_groups(self) -> list:
        """Every process group of the mesh, the flattened views' too (`DeviceMesh.get_all_groups` leaves those
        out), each once."""
        groups: list = []
        for group in [*self.mesh.get_all_groups(), *(m.get_group() for m in self._flattened.values())]:
            if not any(group is g for g in groups):
                groups.append(group)
        return groups

    @property
    def dp_rank(self) -> int:
        return self.submesh("dp").get_local_rank()

    def batch_plan(self, cfg: Config, dp_rank: int | None = None) -> BatchPlan:
        """How a step's batch splits over the data-parallel ranks; `dp_rank` None: this process's."""
        t = cfg.training
        if dp_rank is None:
            dp_rank = self.dp_rank if self.world_size > 1 else 0
        return BatchPlan(cfg.sequences(t.global_batch_size), cfg.sequences(t.micro_batch_size), self.dp_size, dp_rank)


def init_distributed(device_choice: str = "auto", timeout_s: float | None = None,
                     precision: str = "auto", one_rank_group: bool = False) -> tuple[int, int, torch.device]:
    """Join the process group when launched by torchrun: on GPUs NCCL/RCCL for device tensors and gloo for host
    tensors (`devices.process_group_backend`), on CPU gloo.

    `device_choice` is `training.device` (`auto` refuses the CPU where a GPU was meant: `devices.choose_device_type`),
    `timeout_s` the collective timeout (None: torch's default), `precision` is `training.precision`;
    `one_rank_group`: a single process gets a process group of its own too (FSDP on one rank needs a mesh).
    Returns the rank, the world size and this rank's device.
    """
    from maester.parallel.devices import choose_device_type, process_group_backend

    world = int(os.environ.get("WORLD_SIZE", "1"))
    device_type = choose_device_type(device_choice, precision, world_size=world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        # Before the first CUDA allocation; the user's own setting wins (torchtitan sets the same).
        if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device(device_type)
    if world == 1 and not dist.is_initialized() and not one_rank_group:
        return 0, 1, device
    if not dist.is_initialized():
        from datetime import timedelta

        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else None
        if "MASTER_ADDR" in os.environ:  # torchrun, or a launcher that sets its variables
            dist.init_process_group(process_group_backend(device_type), timeout=timeout)
        else:  # one process on its own: a store in this process
            dist.init_process_group(process_group_backend(device_type), timeout=timeout, store=dist.HashStore(),
                                    rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def set_cpu_threads(setting: int | None, device: torch.device) -> str | None:
    """Intra-op threads of this process on a CPU run (`training.cpu_threads`): the setting, else the CPUs it may use
    (`maester.cpus.usable_cpus`: affinity and cgroup quota) shared out between the local processes of a torchrun
    (LOCAL_WORLD_SIZE), and for one process at most torch's default (its physical cores). Returns a description for
    the log; None on a GPU run, which keeps torch's setting. Inter-op threads stay as they are: training runs no
    inter-op work on the CPU (autograd runs it on the calling thread)."""
    from maester.cpus import usable_cpus

    if device.type != "cpu":
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    usable = usable_cpus()
    if setting is not None:
        threads = setting
    elif local > 1:
        threads = max(1, usable // local)
    else:
        threads = min(torch.get_num_threads(), usable)
    torch.set_num_threads(threads)
    wait = os.environ.get("OMP_WAIT_POLICY", "spinning first (libgomp's default)").lower()
    return (f"{threads} CPU thread(s) per process ({usable} usable CPU(s) by affinity and cgroup quota"
            f"{f', {local} local processes' if local > 1 else ''}; idle threads: {wait})")


def set_collective_timeout(seconds: float, groups=(), device: torch.device | None = None) -> None:
    """Give the default process group and `groups` (a layout's: `ParallelDims.process_groups`) a new collective
    timeout.

    Every rank first finishes its queued work and meets the others at a barrier: a rank that shortened its timeout
    while another was still compiling would time out waiting for it (torchtitan's set_pg_timeouts does the same).
    """
    from datetime import timedelta

    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    for group in [dist.group.WORLD, *groups]:
        if hasattr(group, "set_timeout"):
            group.set_timeout(timedelta(seconds=seconds))
        else:  # torch releases before ProcessGroup.set_timeout
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
