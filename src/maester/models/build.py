"""Turn a `model` config section into a module: resolve the vocabulary, build on meta, materialise, init."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from maester.models.args import MupConfig
from maester.models.config import ModelConfig
from maester.models.registry import ARCHITECTURES


def resolve_args(cfg: ModelConfig, tokenizer_vocab: int, mup: MupConfig | None = None) -> BaseModel:
    """Architecture args with `vocab_size` fixed (the flavor's own, or the tokenizer's rounded up to 64) and μP's
    multipliers from `mup` (the run config's `mup` section) where it is enabled."""
    args = cfg.architecture()
    if mup is not None and mup.enabled:
        try:
            args = args.model_validate({**args.model_dump(), "mup": mup})
        except ValidationError as e:  # one line naming the sections, not pydantic's report
            raise ValueError(f"mup with model {cfg.name}/{cfg.flavor}: " + "; ".join(
                err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
    if args.vocab_size is None:
        return args.model_copy(update={"vocab_size": -(-tokenizer_vocab // 64) * 64})
    if args.vocab_size < tokenizer_vocab:
        raise ValueError(f"model vocab_size {args.vocab_size} (flavor {cfg.flavor!r}) is smaller than the "
                         f"tokenizer's vocabulary {tokenizer_vocab}: set model.overrides.vocab_size")
    return args


def build_on_meta(cfg: ModelConfig, args: BaseModel, param_dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model on the meta device, its parameters in `param_dtype` (buffers such as RoPE frequencies stay
    float32)."""
    with torch.device("meta"):
        model = ARCHITECTURES[cfg.name].model_class()(args)
    if param_dtype != torch.float32:
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(p.detach().to(param_dtype), p.requires_grad))
    return model


def materialize(model: nn.Module, device: torch.device, seed: int,
                buffer_device: torch.device | None = None) -> nn.Module:
    """Allocate a meta-built model on `device` and initialise it from `seed`, identically on every rank. Buffers
    (RoPE frequencies) go to `buffer_device` when given: with FSDP's CPU offload the parameters live on the CPU
    while the forward runs on the GPU (torchtitan's buffer_device)."""
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        model.init_weights()
    return _buffers_to(model, device, buffer_device)


def _buffers_to(model: nn.Module, device: torch.device, buffer_device: torch.device | None) -> nn.Module:
    if buffer_device is not None and buffer_device != device:
        for module in model.modules():
            for name, b in list(module.named_buffers(recurse=False)):
                module.register_buffer(name, b.to(buffer_device),
                                       persistent=name not in module._non_persistent_buffers_set)
    return model


def materialize_for_loading(model: nn.Module, device: torch.device,
                            buffer_device: torch.device | None = None) -> nn.Module:
    """Allocate a meta-built model on `device` for weights that are loaded next, strictly (a checkpoint's, an HF
    directory's): the parameters stay as allocated, in the dtype they were built in, and only the buffers no
    checkpoint holds are set: RoPE frequencies, and MoE load counters at zero (with the selection bias, which a
    checkpoint overwrites where balancing uses it), on `buffer_device` where given (as `materialize`). No random
    init: the load overwrites every parameter."""
    from maester.models.layers import RotaryEmbedding
    from maester.models.moe import MoEFeedForward

    model.to_empty(device=device)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_parameters()
            elif isinstance(module, MoEFeedForward):
                module.reset_state()
    return _buffers_to(model, device, buffer_device)


def build_model(cfg: ModelConfig, tokenizer_vocab: int, device: torch.device, seed: int,
                mup: MupConfig | None = None) -> nn.Module:
    """The whole model on one device, in float32, initialised from `seed`: for tools, tests and the seed
    checkpoint. A training run builds on meta, shards, then materialises (`train.setup.build_training_model`)."""
    return materialize(build_on_meta(cfg, resolve_args(cfg, tokenizer_vocab, mup)), device, seed)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
