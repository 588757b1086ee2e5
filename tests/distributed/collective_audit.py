"""Run under torchrun: a short training run (pretraining or SFT, with logging, evaluation and checkpoint steps)
that records every c10d collective: its op, the device of each tensor handed to it, the device->backend map of its
group, and the maester function that called it. Writes `<out>/rank-<R>.json`.

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

OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "broadcast",
       "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier", "all_gather_object",
       "broadcast_object_list", "gather_object", "scatter_object_list")


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


def main() -> None:
    out_dir, overrides = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("cpu:gloo,cuda:gloo")
    records: list[dict] = []
    depth = [0]

    def wrap(name, fn):
        @functools.wraps(fn)
        def audited(*args, **kwargs):
            if depth[0] == 0:  # object collectives call tensor collectives: record the outer call only
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                group = group or dist.group.WORLD
                records.append({"op": name, "devices": sorted({t.device.type for t in tensors_of(
                    list(args) + list(kwargs.values()))}), "backends": str(dist.get_backend_config(group)),
                    "caller": caller()})
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return audited

    for name in OPS:
        original = getattr(c10d, name)
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
    trainer.train()
    out_dir.mkdir(parents=True, exist_ok=True)
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
