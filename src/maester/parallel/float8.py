"""Float8 training through torchao (`training.float8`), after torchtitan's Float8LinearConverter
(torchtitan/components/quantization/float8.py) and its float8 tensor-parallel plan (models/llama3/infra/
parallelize.py, before the config refactor):

- `check_float8` refuses, before any work, what cannot run: a GPU without float8 matmuls, DDP, a torchao that
  does not match the installed torch (`version_problem`), emulation on a GPU;
- `convert_to_float8` swaps the `nn.Linear` layers of the transformer blocks for `Float8Linear` on the meta model,
  before `parallelize`: the output layer, MoE routers and experts, `filter`ed layers, layers whose dims are not
  multiples of 16 and, under the float8 all-gather, layers whose rows do not divide over the FSDP shards
  (`uneven_rows`) keep their precision. Tensorwise scaling under FSDP all-gathers the weights in float8;
- `tensor_parallel_style` gives torchao's float8 TP styles for those layers under tensorwise scaling on GPUs;
- `Float8Training.after_optimizer_step` computes the float8 weight scales of all layers in one all-reduce
  (`precompute_float8_dynamic_scale_for_fsdp`), as torchtitan's post-optimizer hook does.

The weights stay high-precision parameters (torchao casts them at each matmul; under the float8 all-gather each is
wrapped in torchao's WeightWithDynamicFloat8CastTensor, which checkpoints unwrap: train/checkpoint_tensors.py), so
checkpoints are the same as without float8 and load into a model with or without it. torchao is imported only when
float8 is enabled.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from functools import cache

import torch
from torch import nn

from maester.config import Config, Float8Config
from maester.models.moe import MoEFeedForward

log = logging.getLogger("maester")

# torchao releases whose float8 training maester runs, with the oldest and newest torch each was checked on. From
# torchao's compatibility table (pytorch/ao#2919): 0.16 is built against torch 2.10 with a torch-version-specific C++
# ABI and supports its Python API up to 2.10; from 0.17 its kernels use torch's stable ABI (torch 2.11 and later)
# and its Python API also serves 2.10 (the C++ extensions, which float8 training does not use, are skipped there).
# tests/parallel/test_float8.py passed on the CPU with torchao 0.16 + torch 2.10, 0.17 + 2.10 and 2.15, 0.18 + 2.10
# (CI's floor environment) and 2.15 (the lock, which also runs the two-rank tests); a newer torch or torchao is
# refused until it has been checked and added here. pyproject.toml's torchao bound moves with it (torchao_requirement).
TORCHAO_TORCH = {
    (0, 16): ((2, 10), (2, 10)),
    (0, 17): ((2, 10), (2, 15)),
    (0, 18): ((2, 10), (2, 15)),
}


def torchao_requirement() -> str:
    """The requirement of maester's float8 extra (pyproject.toml) from `TORCHAO_TORCH`: its oldest release up to,
    not including, the minor release after its newest, so that an install never fetches a torchao maester refuses.
    A test holds pyproject.toml to it: adding a release to the table moves the bound."""
    newest = max(TORCHAO_TORCH)
    return f"torchao>={_dotted(min(TORCHAO_TORCH))},<{newest[0]}.{newest[1] + 1}"


class Float8Unsupported(ValueError):
    """float8 cannot run with these settings, devices or packages: one line saying why and what to change."""


def _minor(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def installed_torchao() -> str | None:
    """The installed torchao's version, read from its metadata without importing it; None when absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchao")
    except PackageNotFoundError:
        return None


def version_problem(torch_version: str, torchao_version: str | None) -> str | None:
    """Why this torch/torchao pair cannot train float8 (`TORCHAO_TORCH`), or None when it can."""
    if torchao_version is None:
        return ("training.float8 needs torchao, which is not installed: install maester's float8 extra "
                "(`pip install 'maester[float8]'`, or `uv sync --extra float8`)")
    ao, pt = _minor(torchao_version), _minor(torch_version)
    known = ", ".join(f"torchao {_dotted(a)} with torch {_dotted(lo)}"
                      + (f"-{_dotted(hi)}" if hi != lo else "") for a, (lo, hi) in TORCHAO_TORCH.items())
    if ao not in TORCHAO_TORCH:
        return (f"torchao {torchao_version} is not a release maester's float8 has been checked with ({known}): "
                f"install one of these for torch {torch_version}")
    low, high = TORCHAO_TORCH[ao]
    if not low <= pt <= high:
        fits = [_dotted(a) for a, (lo, hi) in TORCHAO_TORCH.items() if lo <= pt <= hi]
        hint = f"install torchao {' or '.join(fits)}" if fits else "no checked torchao serves this torch"
        return (f"torchao {torchao_version} does not match torch {torch_version}: it serves torch "
                f"{_dotted(low)}" + (f" to {_dotted(high)}" if high != low else "") + f" (checked pairs: {known}); "
                f"{hint}")
    return None


def hardware_problem(device_type: str, emulate: bool, capability: tuple[int, int] | None = None,
                     arch: str | None = None, hip: str | None = None, name: str = "") -> str | None:
    """Why float8 cannot train on this device, or None when it can. `capability`: CUDA's (major, minor); `arch`:
    ROCm's gcnArchName (e.g. "gfx942:sramecc+:xnack-"); `hip`: torch.version.hip on ROCm, else None.

    NVIDIA: compute capability 8.9 or later (Ada, Hopper, Blackwell: torch's `_scaled_mm`). AMD, as torch's own
    test gate for float8 (`evaluate_platform_supports_fp8` in torch/testing/_internal/common_cuda.py): gfx94x (MI300);
    with ROCm 6.5 or later also gfx95x (MI350) and gfx120x; not gfx90a (MI250X) and older."""
    if device_type == "cpu":
        if emulate:
            return None
        return ("the CPU has no float8 matmuls; training.float8.emulate = true emulates them in high precision "
                "(for tests: slow, and no speed-up)")
    if device_type != "cuda":
        return f"float8 training runs on CUDA or ROCm GPUs, not on {device_type!r}"
    if emulate:
        return ("training.float8.emulate is for tests on the CPU; on a GPU float8 runs the real float8 matmuls: "
                "set training.float8.emulate = false")
    label = f"this GPU{f' ({name})' if name else ''}"
    if hip is not None:
        gfx = (arch or "").split(":")[0]
        rocm = _minor(hip)
        if gfx.startswith("gfx94") or (rocm >= (6, 5) and gfx.startswith(("gfx95", "gfx120"))):
            return None
        later = "" if rocm >= (6, 5) else f"; gfx950 (MI350) needs ROCm 6.5 or later, this is {hip}"
        return (f"training.float8 needs an AMD GPU with float8 matmuls, gfx942 (MI300) or gfx950 (MI350); {label} is "
                f"{gfx or 'of an unknown architecture'}{later} (MI250X, gfx90a, has none): set "
                f"training.float8.enabled = false")
    if capability is None or tuple(capability) < (8, 9):
        sm = f"sm_{capability[0]}{capability[1]}" if capability else "of an unknown compute capability"
        return (f"training.float8 needs an NVIDIA GPU of compute capability 8.9 or later (L4, L40, H100, H200, "
                f"B200); {label} is {sm} (an A100 is sm_80): set training.float8.enabled = false")
    return None


def _device_facts(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    props = torch.cuda.get_device_properties(device)
    return {"capability": (props.major, props.minor), "arch": getattr(props, "gcnArchName", None),
            "hip": torch.version.hip, "name": props.name}


def check_float8(cfg: Config, dims, device: torch.device, torchao_version: str | None = None) -> None:
    """Refuse float8 where it cannot run, before anything is built (the config itself refuses fp16, bf16-pure, no
    compile and float8 experts: `Config._check_float8`). `dims`: the run's ParallelDims; `torchao_version`: None
    reads the installed one."""
    f8 = cfg.training.float8
    if not f8.enabled:
        return
    if dims.ddp_enabled:
        raise Float8Unsupported(
            f"training.float8 with DDP (parallel.dp_replicate = {dims.dp_replicate}, dp_shard = 1) is not supported: "
            f"torchao's float8 composes with FSDP2 (float8 weight all-gather) and tensor parallel, as torchtitan "
            f"uses it; shard instead: parallel.dp_shard = {dims.dp_replicate}, dp_replicate = 1 (or HSDP)")
    problem = hardware_problem(device.type, f8.emulate, **_device_facts(device))
    if problem:
        raise Float8Unsupported(problem)
    problem = version_problem(torch.__version__, torchao_version or installed_torchao())
    if problem:
        raise Float8Unsupported(problem)


# ---------------------------------------------------------------- conversion


@cache
def float8_linear_class() -> type:
    """torchao's Float8Linear, with autocast followed on the input's own device: torchao's follows CUDA's autocast
    only, so on the CPU (emulation) its input would skip autocast's bf16 cast while the layers around it compute in
    bf16 (and `rowwise_with_gw_hp` would multiply a bf16 gradient by an fp32 input)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear

    class Float8Linear(TorchaoFloat8Linear):
        converted_by_maester = True

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            device = input.device.type
            if device != "cuda" and torch.is_autocast_enabled(device):
                input = input.to(torch.get_autocast_dtype(device))
            return super().forward(input)

        @property
        def tensorwise(self) -> bool:
            """Every cast scaled per tensor: torchao's float8 TP styles apply (they assume it)."""
            c = self.config
            return all(cast.scaling_granularity is ScalingGranularity.TENSORWISE
                       for cast in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output))

    return Float8Linear


def torchao_config(f8: Float8Config, fsdp: bool):
    """torchao's Float8LinearConfig for the recipe: float8 all-gather under FSDP with tensorwise scaling (torchao
    supports it for tensorwise only), and emulation where asked."""
    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(f8.recipe)
    return dataclasses.replace(config, emulate=f8.emulate,
                               enable_fsdp_float8_all_gather=fsdp and f8.recipe == "tensorwise")


def convertible_linears(model: nn.Module, f8: Float8Config, tp: int = 1,
                        gather_shards: int = 1) -> tuple[dict[str, nn.Linear], dict[str, str]]:
    """(name -> layer to convert, name -> why a block linear stays in high precision). Only the blocks' layers are
    candidates (the output layer is outside them); routers stay (their logits choose experts), as do the `filter`ed
    layers, those whose dims, per tensor-parallel shard, are not multiples of 16 (float8 matmuls need them), and,
    under FSDP's float8 all-gather over `gather_shards` ranks, those whose rows per tensor-parallel shard do not
    divide over them (`uneven_rows`)."""
    convert, keep = {}, {}
    for block_name, block in model.layers.named_children():
        routers = {id(m.router.gate) for m in block.modules() if isinstance(m, MoEFeedForward)}
        for name, module in block.named_modules():
            if type(module) is not nn.Linear:
                continue
            full = f"layers.{block_name}.{name}"
            if id(module) in routers:
                keep[full] = "MoE router"
            elif any(entry in full for entry in f8.filter):
                keep[full] = "training.float8.filter"
            elif module.in_features % (16 * tp) or module.out_features % (16 * tp):
                keep[full] = f"dims {module.in_features} x {module.out_features} not multiples of {16 * tp}"
            elif uneven_rows(module.out_features, tp, gather_shards):
                keep[full] = (f"{module.out_features // tp} rows per tensor-parallel shard do not divide over the "
                              f"{gather_shards} FSDP shards of the float8 all-gather")
            else:
                convert[full] = module
    unused = [entry for entry in f8.filter if not any(entry in name for name in [*convert, *keep])]
    if unused:
        raise Float8Unsupported(f"training.float8.filter: {', '.join(map(repr, unused))} names no linear layer of the "
                                f"transformer blocks (e.g. {next(iter({**convert, **keep}), 'none')})")
    return convert, keep


def uneven_rows(rows: int, tp: int, gather_shards: int) -> bool:
    """Whether a weight of `rows` rows (dim 0) cannot take FSDP's float8 all-gather over `gather_shards` ranks:
    torchao (up to 0.18 at least) has the one-argument `fsdp_pre_all_gather(mesh)`, so FSDP2 cannot pad a last
    shard that is shorter than the others, and the all-gather fails or mixes rows (pytorch/ao#3982). Counted per
    tensor-parallel shard (rows / tp: exact for the column-parallel layers, stricter than needed for the row-parallel
    o_proj and down_proj, which hold every row). Drop this rule once the accepted torchao releases all have the
    padded, five-argument `fsdp_pre_all_gather` (pytorch/ao#3983)."""
    return (rows // tp) % gather_shards != 0


def convert_to_float8(model: nn.Module, f8: Float8Config, fsdp: bool, tp: int = 1, fsdp_shards: int = 1) -> list[str]:
    """Swap the blocks' convertible `nn.Linear` layers (`convertible_linears`) for Float8Linear, in place, keeping
    their parameters (on the meta device before parallelize, as torchtitan converts). `fsdp_shards`: the ranks FSDP
    shards a block's weights over. Returns the converted names."""
    config = torchao_config(f8, fsdp)
    gather_shards = fsdp_shards if config.enable_fsdp_float8_all_gather else 1
    convert, keep = convertible_linears(model, f8, tp, gather_shards)
    if not convert:
        raise Float8Unsupported("training.float8: no linear layer of the transformer blocks can be converted "
                                f"({'; '.join(f'{k}: {v}' for k, v in list(keep.items())[:4])})")
    cls = float8_linear_class()
    for name, module in convert.items():
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, cls.from_float(module, config=config))
    if f8.recipe == "rowwise":
        # torchtitan's short-term fix for pytorch/pytorch#150859 (rowwise scales computed differently when compiled)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    uneven = [name for name, why in keep.items() if "FSDP shards" in why]
    if uneven:
        log.warning("float8: %d layer(s) kept in high precision because their rows do not divide over the %d FSDP "
                    "shards (torchao's float8 all-gather cannot pad a shorter last shard): %s", len(uneven),
                    gather_shards, ", ".join(uneven))
    kept = sorted({why for why in keep.values()})
    log.info("float8 (%s%s%s): %d linear layers converted; kept in high precision: the output layer%s%s",
             f8.recipe, ", float8 all-gather" if config.enable_fsdp_float8_all_gather else "",
             ", emulated" if f8.emulate else "", len(convert),
             f", {len(keep)} block layer(s) ({'; '.join(kept)})" if keep else "",
             ", the MoE routed experts (bf16 grouped GEMM)" if any(isinstance(m, MoEFeedForward)
                                                                     for m in model.modules()) else "")
    return list(convert)


def is_float8(module: nn.Module) -> bool:
    """Whether `module` was converted by `convert_to_float8` (without importing torchao)."""
    return getattr(type(module), "converted_by_maester", False)


def tensor_parallel_style(style: type, modules: list[nn.Module], float8_comms: bool) -> type:
    """torchao's float8 counterpart of the TP style class `style` (ColwiseParallel, RowwiseParallel,
    PrepareModuleInput) where every one of `modules` is a tensorwise Float8Linear and `float8_comms` (GPUs: gloo
    carries no float8 tensors), else `style` itself: activations are then all-gathered in float8 (torchtitan's
    enable_float8_tensorwise_tp; its rowwise recipes keep torch's styles). `modules`: the layer a Colwise or
    Rowwise style shards, or every layer that reads the input a PrepareModuleInput prepares (it casts that input to
    float8 for all of them)."""
    if not (float8_comms and modules and all(is_float8(m) and m.tensorwise for m in modules)):
        return style
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return {"ColwiseParallel": Float8ColwiseParallel, "RowwiseParallel": Float8RowwiseParallel,
            "PrepareModuleInput": PrepareFloat8ModuleInput}[style.__name__]


class Float8Training:
    """The run's float8 work around the optimizer step."""

    def __init__(self, model: nn.Module, cpu_offload: bool = False):
        """Made once the weights are in place (initialised or loaded), on every rank at once: it computes the first
        step's scales (a collective) as `after_optimizer_step` computes every later step's. Without them the first
        step's all-gather computes each weight's scale itself, from its amax over the FSDP shards only: under TP x
        FSDP each TP shard then has a scale of its own, and a run resumed from a checkpoint differed from the run
        it continues at its first step."""
        self.model = model
        # FSDP's float8 all-gather takes each weight's scale from `precompute` when one is set (torchao's
        # WeightWithDynamicFloat8CastTensor); set only where a layer all-gathers in float8.
        self.precompute = any(is_float8(m) and m.config.enable_fsdp_float8_all_gather for m in model.modules())
        if self.precompute and cpu_offload:
            # FSDP2 copies each offloaded shard to the GPU with .to(), which torchao rewraps without the precomputed
            # scale (fsdp_utils.py: _to_copy keeps the class, not _precomputed_scale): the work would be lost
            self.precompute = False
            log.info("float8: scales are not precomputed after the optimizer step under parallel.cpu_offload (the "
                     "shards' copies to the GPU drop them); each layer computes its scale in its all-gather")
        self.after_optimizer_step()

    def after_optimizer_step(self) -> None:
        """The float8 scales of all FSDP-sharded float8 weights from their new values, in one all-reduce for all
        layers instead of one per layer in the next forward (torchtitan's post-optimizer hook). Every rank calls
        it after every step (a skipped step recomputes the same scales)."""
        if self.precompute:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.model)
