"""Run under torchrun: a short training run (pretraining or SFT, with logging, evaluation and checkpoint steps)
that records every c10d collective and point-to-point op (as torch's pipelining and maester's call them) and every
functional collective (`torch.ops._c10d_functional`, context parallel's custom ops, expert parallel's
all_to_all_single_autograd): its op, the device of each tensor handed to it, the device->backend map of its group,
and the maester function that called it (in backward: the one that called backward). Writes `<out>/rank-<R>.json`,
and the host reads of tensors and ops that read a device value back on CUDA, by step, to `<out>/reads-<R>.json`.

On the CPU every tensor is a host tensor, so `unserved` cannot flag one here: the CPU runs check that every group
kept the map and that each path's callers took part, and the records show which tensors each call site hands over.

The process group is initialised as on a GPU, a map from device type to backend ("cpu:gloo,cuda:gloo" here,
since gloo stands in for NCCL on this machine), before the trainer starts, so every group the run creates
(DeviceMesh dimensions, the flattened data-parallel group, checkpoint groups) shows whether it kept the map.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/collective_audit.py \\
        OUT_DIR maester-overrides...
"""

from __future__ import annotations

import functools
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers import reads_device_value  # noqa: E402

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "broadcast",
       "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "all_gather_object",
       "broadcast_object_list", "gather_object", "scatter_object_list",
       "send", "recv", "isend", "irecv", "batch_isend_irecv",  # point-to-point: pipelining and maester's own
       "send_object_list", "recv_object_list", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
       "gather_into_tensor",
       # newer torch (FSDP2 calls these in 2.15), absent from older releases
       "all_gather_single", "reduce_scatter_single", "gather_single")


def tensors_of(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(t for t in v if isinstance(t, torch.Tensor))
    return out


def caller() -> str:
    """The innermost maester function on the stack (file:function)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/maester/" in frame.filename:
            return f"{Path(frame.filename).name}:{frame.name}"
    return "?"


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")
"""Tensor methods that read a value on the host: on a GPU each waits for the queued kernels."""


def collective(op: str, values, group) -> dict:
    """The record of one collective: its op, the devices of its tensors, its group's device->backend map, and
    the maester function that called it."""
    return {"op": op, "devices": sorted({t.device.type for t in tensors_of(values)}),
            "backends": str(dist.get_backend_config(group)), "caller": caller()}


def record_read(reads: list[dict], what: str, step: int) -> None:
    """A host read at `step`, unless under maester.data (the loader and `Batch` work on host tensors by design:
    `Batch` counts documents only off the GPU) or torch's optimizer step count."""
    stack = traceback.extract_stack()[:-2]
    frames = [f for f in stack if "/maester/" in f.filename]
    if frames and not any("/maester/data/" in f.filename for f in frames) \
            and "/torch/optim/" not in stack[-1].filename:
        reads.append({"read": what, "step": step, "caller": f"{Path(frames[-1].filename).name}:{frames[-1].name}"})


class FunctionalCollectives(TorchDispatchMode):
    """Records every op that names its process group (`group_name`): the functional collectives
    (torch.ops._c10d_functional, their autograd variants, maester's custom ops over them), which run in C++ and
    bypass the c10d Python functions patched above. Ops dispatched inside another op (a DTensor op's own
    redistribution) are not seen: the mode is off while it handles one. Also records in `reads` the ops that
    read a device value back on CUDA (`tests.helpers.reads_device_value`) at `trainer.step`."""

    def __init__(self, records: list[dict], reads: list[dict], trainer):
        super().__init__()
        self.records, self.reads, self.trainer = records, reads, trainer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if reads_device_value(func, kwargs):
            record_read(self.reads, str(func), self.trainer.step)
        names = [a.name for a in func._schema.arguments]
        if "group_name" in names:
            bound = {**dict(zip(names, args)), **kwargs}
            group = c10d._resolve_process_group(bound["group_name"])
            self.records.append(collective(str(func.overloadpacket), list(args) + list(kwargs.values()), group))
        return func(*args, **kwargs)


def main() -> None:
    out_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("cpu:gloo,cuda:gloo")
    records: list[dict] = []
    depth = [0]

    def wrap(name, fn):
        @functools.wraps(fn)
        def audited(*args, **kwargs):
            if depth[0] == 0:  # object and batched p2p calls call the others: record the outer call only
                values = list(args) + list(kwargs.values())
                if name == "batch_isend_irecv":  # its P2POps' tensors and group
                    values = [op.tensor for op in args[0]]
                    group = args[0][0].group if args[0] else None
                else:
                    group = kwargs.get("group")
                    if group is None:
                        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                group = group or dist.group.WORLD
                records.append(collective(name, values, group))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return audited

    for name in OPS:
        original = getattr(c10d, name, None)
        if original is None:
            continue
        audited = wrap(name, original)
        setattr(c10d, name, audited)
        setattr(dist, name, audited)

    from maester.config import load_config
    from maester.train.trainer import Trainer

    cfg = load_config(None, overrides, environ={})
    trainer = Trainer(cfg, cfg.job_dir)
    ddp_sync: list[bool] = []  # under DDP: whether each forward's backward all-reduces the gradients
    if trainer.dims.ddp_enabled:
        from torch.distributed._composable import replicate

        trainer.model.register_forward_pre_hook(
            lambda module, args: ddp_sync.append(not replicate.state(module)._no_sync) if module.training else None)
    reads: list[dict] = []  # host reads of tensors and device-read ops, with their step
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _name=name, _original=original, **kwargs):
            record_read(reads, _name, trainer.step)
            return _original(self, *args, **kwargs)
        setattr(torch.Tensor, name, read)
    with FunctionalCollectives(records, reads, trainer):
        trainer.train()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"reads-{dist.get_rank()}.json").write_text(json.dumps(reads))
    (out_dir / f"rank-{dist.get_rank()}.json").write_text(json.dumps(records))
    (out_dir / f"ddp-sync-{dist.get_rank()}.json").write_text(json.dumps(ddp_sync))
    dist.destroy_process_group()


def unserved(records: list[dict]) -> list[dict]:
    """The recorded collectives whose group has no backend for one of their tensors' devices."""
    bad = []
    for r in records:
        served = {part.split(":")[0] for part in r["backends"].split(",")}
        if any(d not in served for d in r["devices"]):
            bad.append(r)
    return bad


if __name__ == "__main__":
    main()
