"""What a training process sets up before its first step: logging, seeds, and the model built on meta, sharded
from outside and materialised with the weights one process would initialise."""

from __future__ import annotations

import logging
import random
import sys
from pathlib import Path

import numpy as np
import torch

from maester.config import Config
from maester.models.build import build_on_meta, materialize, materialize_for_loading, resolve_args
from maester.models.transformer import canonical_parameter_name
from maester.parallel.dims import ParallelDims
from maester.parallel.parallelize import parallelize, selective_checkpointing_needs_compile
from maester.parallel.precision import Precision

log = logging.getLogger("maester")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def setup_logging(job_dir: Path | None = None, rank: int = 0, per_rank_file: bool = False) -> None:
    """Console (and logs/train.log) on rank 0; other ranks report warnings and errors only. `per_rank_file`: every
    rank also writes its whole log to logs/rank-<R>.log."""
    root = logging.getLogger("maester")
    if not root.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(logging.INFO if rank == 0 or (per_rank_file and job_dir is not None) else logging.WARNING)
    if job_dir is None:
        return
    names = (["train.log"] if rank == 0 else []) + ([f"rank-{rank}.log"] if per_rank_file else [])
    (job_dir / "logs").mkdir(parents=True, exist_ok=True)
    for name in names:
        path = (job_dir / "logs" / name).resolve()
        if not any(getattr(h, "baseFilename", None) == str(path) for h in root.handlers):
            fh = logging.FileHandler(path)
            fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            root.addHandler(fh)


def copy_single_process_init(model: torch.nn.Module, cfg: Config, args, param_dtype: torch.dtype) -> None:
    """Give a sharded CPU model exactly the weights one process would initialise.

    DTensor random ops on CPU draw the same numbers on every rank, so shards would repeat each other; on CPU
    (small models, tests, debugging) each rank instead builds the whole model and keeps its own shards.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    full = materialize(build_on_meta(cfg.model, args, param_dtype), torch.device("cpu"), cfg.training.seed)
    own = {canonical_parameter_name(name) for name in model.state_dict()}  # a pipeline rank's stages: some
    set_model_state_dict(model, {k: v for k, v in full.state_dict().items() if k in own},
                         options=StateDictOptions(full_state_dict=True))


def seed_dtensor_rng_per_rank(seed: int, mesh, device: torch.device) -> None:
    """Make DTensor's random ops on GPUs draw from each rank's own generator state, so that a pipeline stage
    initialised after `torch.manual_seed(seed + stage)` gets that stream. Left to itself, the first DTensor random
    op creates torch's RNG tracker with run_state_sync=True, which broadcasts rank 0's CUDA RNG state over the
    world: every pp rank's first stage would then draw stage 0's numbers. torch's own `manual_seed(seed, mesh)`
    creates the tracker without that broadcast (torch/distributed/tensor/_random.py: "we still need to ensure
    setting `run_state_sync=False` to support the pp case"; torchtitan's set_determinism with
    distinct_seed_mesh_dims=["pp"] calls it for PP). On CPU DTensor has no RNG tracker; the ranks copy one
    process's init instead (`copy_single_process_init`)."""
    if device.type != "cuda":
        return
    from torch.distributed.tensor import _random

    _random.manual_seed(seed, mesh)


def build_training_model(cfg: Config, tokenizer_vocab: int, dims: ParallelDims, device: torch.device,
                         precision: Precision, initialise: bool = True) -> torch.nn.Module:
    """The run's model: built on meta in the parameter dtype, parallelised (FSDP2/TP/DDP, activation
    checkpointing, compile) and then materialised, on the CPU first under `parallel.cpu_offload`. Not
    `initialise`: the parameters are allocated only, for a checkpoint that overwrites every one of them."""
    args = resolve_args(cfg.model, tokenizer_vocab, cfg.mup)
    if cfg.data.seq_len > args.max_seq_len:
        raise ValueError(f"data.seq_len = {cfg.data.seq_len} exceeds the model's context, max_seq_len = "
                         f"{args.max_seq_len} ({cfg.model.name}/{cfg.model.flavor}); set "
                         f"model.overrides.max_seq_len to train at longer sequences")
    parallel = cfg.parallel
    documents = cfg.data.document_masking or cfg.data.mode == "sft"
    if selective_checkpointing_needs_compile(parallel, args, documents, cfg.data.seq_len, device.type):
        log.warning("parallel.activation_checkpointing = 'selective-op' with FlexAttention needs the blocks "
                    "compiled (eager selective checkpointing around compiled flex fails or recomputes it): "
                    "compiling them although parallel.compile = false")
        parallel = parallel.model_copy(update={"compile": True})
    init_device = torch.device("cpu") if cfg.parallel.cpu_offload else device

    def allocate(module: torch.nn.Module, seed: int) -> torch.nn.Module:
        if not initialise:
            return materialize_for_loading(module, init_device, buffer_device=device)
        return materialize(module, init_device, seed, buffer_device=device)

    meta = build_on_meta(cfg.model, args, precision.param_dtype)
    if cfg.training.float8.enabled:  # before parallelize, as torchtitan converts
        from maester.parallel.float8 import convert_to_float8

        convert_to_float8(meta, cfg.training.float8, fsdp=dims.fsdp_enabled, tp=dims.tp,
                          fsdp_shards=dims.dp_shard * dims.cp)
    if dims.pp > 1:  # each pipeline stage parallelised and initialised on its own, from its own seed
        from maester.parallel.pipeline import build_pipeline_model

        if initialise:
            seed_dtensor_rng_per_rank(cfg.training.seed, dims.mesh, device)

        model = build_pipeline_model(meta, dims, cfg,
                                     lambda stage: parallelize(stage, dims, parallel, device, precision),
                                     lambda stage, index: allocate(stage, cfg.training.seed + index), device)
    else:
        model = allocate(parallelize(meta, dims, parallel, device, precision), cfg.training.seed)
    if not initialise:
        return model
    if (dims.world_size > 1 or dims.fsdp_enabled) and device.type == "cpu":
        copy_single_process_init(model, cfg, args, precision.param_dtype)
    return model
