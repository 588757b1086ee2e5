"""Run under torchrun (2 ranks): for each layout, a tiny run of one step, then the state a background save stages
(`state_to_save` through the checkpointer's own stager) compared bit for bit with the live state
(`tests/train/staging.py`); one background save with the fp16 loss scaler, changed after the save, whose checkpoint
must hold the scaler of its step; `staged_bytes` before step 1 and after it, beside the stager's own buffers.
Writes `<out>/rank-<R>.json`: per layout, the tensors compared, the kinds seen (the local tensor's type, and the
mesh dimensions of the DTensors) and the sizes.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed/staged_state.py OUT CORPUS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.helpers
from tests.helpers import tiny_overrides  # noqa: E402
from tests.train.staging import assert_staged_equals_live  # noqa: E402

ONE_STEP = dict(training__steps=1, schedule__warmup_steps=1, checkpoint__interval=0, checkpoint__save_final="false",
                checkpoint__async_mode="async", training__global_batch_size=4)
LAYOUTS = {
    "fsdp_float8": dict(parallel__dp_shard=2, training__precision="bf16", training__float8__enabled="true",
                        training__float8__emulate="true"),
    "tp": dict(parallel__tp=2, parallel__dp_shard=1),
    "ep": dict(model__name="olmoe", parallel__ep=2, parallel__dp_shard=2),
    "fsdp_muon_fp16": dict(parallel__dp_shard=2, optimizer__name="muon", training__precision="fp16"),
}


def kinds(state) -> list[str]:
    """The distinct kinds of tensor in a state dict: the local tensor's type, with the DTensor's mesh dimensions."""
    from torch.distributed.tensor import DTensor

    found = set()

    def walk(value):
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, DTensor):
            found.add(f"DTensor[{','.join(value.device_mesh.mesh_dim_names)}] of {type(value._local_tensor).__name__}")
        elif isinstance(value, torch.Tensor):
            found.add(type(value).__name__)

    walk(state)
    return sorted(found)


def scaler_checkpoint(trainer, root: Path) -> dict:
    """A background save with the loss scaler's state, the scaler changed while it is written: the scaler saved."""
    scaler = trainer.scaler
    before = scaler.state_dict()
    trainer.checkpointer.save(7, trainer.model, trainer.optimizer, {"grad_scaler": before}, "{}", background=True)
    scaler.update(torch.ones((), device=scaler.scale.device))  # an overflow: the scale halves
    assert scaler.state_dict() != before
    trainer.checkpointer.wait()
    saved = json.loads((trainer.checkpointer.dir / "step-7" / "trainer_state.json").read_text())["grad_scaler"]
    assert saved == before, (saved, before)
    return saved


def main(out: Path, corpus: Path) -> None:
    import torch.distributed as dist

    from maester.config import load_config
    from maester.train.checkpoint_memory import staged_bytes
    from maester.train.checkpoint_tensors import state_to_save
    from maester.train.trainer import Trainer

    report = {}
    for name, extra in LAYOUTS.items():
        cfg = load_config(None, tiny_overrides(corpus, out / "jobs", name, **ONE_STEP, **extra), environ={})
        trainer = Trainer(cfg, cfg.job_dir)
        estimate = staged_bytes(trainer.model, trainer.optimizer)  # before the first step made the optimizer state
        trainer.train()
        state = state_to_save(trainer.model, trainer.optimizer)
        compared = assert_staged_equals_live(trainer.checkpointer._stage(state), trainer.model, trainer.optimizer)
        copies = trainer.checkpointer._stager._state_dict_stager._cached_storage_mapping.values()  # host buffers
        report[name] = {"compared": compared, "kinds": kinds(live_state(trainer)),
                        "optimizer_keys": sorted({k for s in state["optimizer"]["state"].values() for k in s}),
                        "staged_bytes": {"before_step_1": estimate,
                                         "now": staged_bytes(trainer.model, trainer.optimizer),
                                         "stager": sum(c.nbytes() for c in copies),
                                         "parameters": sum(1 for _ in trainer.model.parameters())}}
        if trainer.scaler is not None:
            report[name]["grad_scaler"] = scaler_checkpoint(trainer, out)
        trainer.checkpointer.close()
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))


def live_state(trainer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
