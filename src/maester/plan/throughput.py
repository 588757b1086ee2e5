"""Step time, tokens per second and the time to `training.steps`, from the model's FLOPs per token (the MFU formula
of `maester.train.metrics`) at a model FLOPs utilisation: the one given, or a default from published runs
(`default_mfu`, which says which run), times the config's `throughput_factor`.

    tokens/s over all GPUs = MFU x GPUs x peak FLOP/s / FLOPs per token x throughput_factor
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from maester.config import Config

# Published MFU of runs like maester's (FSDP2, bf16, selective activation checkpointing, compiled blocks), each with its
# source; MFU counted as maester counts it (PaLM: 6N + 12 L H Q T, no recompute).
HOPPER = (0.39, "torchtitan's benchmarks/llama3_h100_202412_torchtitan.md: Llama 3.1 8B on 8 H100, FSDP, bf16, "
                "selective-op AC, compiled: 6,667 tokens/s per GPU, 39.0% MFU")
AMPERE = (0.58, "torchtitan, Llama 3 8B on 64 A100 80GB (FSDP2, selective-op AC; compile not stated): 58.2% MFU "
                "(its former docs/performance.md)")
MIXTURE = (0.21, "torchtitan, DeepSeek-V3 16B (a mixture of experts) on 8 B200, tuned: about 21% MFU "
                 "(pytorch/torchtitan#1993)")
ANCHORS = {"A100": AMPERE}
"""GPU keys (`maester.train.metrics.PEAK_FLOPS`) with an anchor of their own; the others take HOPPER's."""
EAGER = 5762 / 6667
"""Uncompiled blocks against compiled: the same torchtitan benchmark, 5,762 against 6,667 tokens/s per GPU."""
FULL_RECOMPUTE = 6 / 8
"""Full activation checkpointing runs each block's forward again: 8 N FLOPs per token where 6 N count."""
SMALL_MODEL = 20e6
"""Parameters in a token's matmuls below which a step is bound by kernel launches, the Python loop and the data
loader rather than by FLOPs, so the anchors' MFU (models of billions of parameters) does not carry over."""


@dataclass(frozen=True)
class Throughput:
    flops_per_token: float
    mfu: float
    mfu_source: str
    factor: float
    factor_reasons: list[str]
    caveats: list[str]
    tokens_per_second: float  # over all GPUs
    tokens_per_second_per_gpu: float
    tokens_per_step: int
    step_seconds: float
    steps: int
    total_seconds: float
    gpu_hours: float

    def to_json(self) -> dict:
        return asdict(self)


def default_mfu(gpu_key: str, mixture_of_experts: bool) -> tuple[float, str]:
    """The anchor MFU for `gpu_key` (a key of the peak-FLOPs table) and its source."""
    if mixture_of_experts:
        return MIXTURE
    if gpu_key in ANCHORS:
        return ANCHORS[gpu_key]
    value, source = HOPPER
    if gpu_key not in ("H100", "H200", "GH200", "H100 NVL", "H100 PCIe", "H200 NVL"):
        source = f"no published anchor for {gpu_key}; the H100 one: {source}"
    return value, source


def throughput_factor(cfg: Config, accumulation_steps: int) -> tuple[float, list[str]]:
    """What the config's own choices do to throughput against the anchors' runs (bf16, selective-op AC, compiled),
    with the reason for each factor. The hook for settings that change speed, not the model's FLOPs: a float8 recipe
    will multiply its measured speed-up in here; until it is measured, a float8 run is estimated as bf16."""
    factor, reasons = 1.0, []
    p = cfg.parallel
    if cfg.training.float8.enabled:
        reasons.append(f"x 1.00: float8 ({cfg.training.float8.recipe}) estimated as bf16: its speed-up is not "
                       f"measured here (torchtitan reports 1.25-1.5x on H100s; the GPU check's "
                       f"float8-8b-width stage measures it on your GPU)")
    if not p.compile:
        factor *= EAGER
        reasons.append(f"x {EAGER:.2f}: blocks not compiled (torchtitan's 8B: eager 5,762 vs compiled 6,667 tokens/s)")
    if p.activation_checkpointing == "full":
        factor *= FULL_RECOMPUTE
        reasons.append(f"x {FULL_RECOMPUTE:.2f}: full activation checkpointing runs each forward twice")
    if p.pp > 1:
        bubble = accumulation_steps / (accumulation_steps + p.pp - 1)
        factor *= bubble
        reasons.append(f"x {bubble:.2f}: pipeline bubble, (pp - 1) / (micro-batches + pp - 1) of each step idle")
    return factor, reasons


def whole_model_flops_per_token(cfg: Config, vocab: int) -> tuple[float, int]:
    """The MFU formula's FLOPs per token of the whole model (built on the meta device), and the parameters in a
    token's matmuls."""
    from maester.models.build import build_on_meta, resolve_args
    from maester.train.metrics import matmul_parameters, model_flops_per_token

    model = build_on_meta(cfg.model, resolve_args(cfg.model, vocab, cfg.mup))
    return float(model_flops_per_token(model, cfg.data.seq_len)), matmul_parameters(model)


def small_model_caveat(parameters: int) -> list[str]:
    if parameters >= SMALL_MODEL:
        return []
    return [f"a small model ({parameters / 1e6:,.1f}M parameters in a token's matmuls): its steps are bound by "
            f"kernel launches, the Python loop and the data loader, not by FLOPs, so the MFU of a model of "
            f"billions does not carry over: the figures below are a bound it will not reach, by far"]


def predict_throughput(cfg: Config, gpus: int, gpu_key: str, peak_flops: float, vocab: int,
                       accumulation_steps: int, mfu: float | None = None) -> Throughput:
    """Tokens per second and time to `training.steps` of `cfg` on `gpus` GPUs of `gpu_key`."""
    moe = cfg.model.architecture().moe is not None
    if mfu is None:
        mfu, source = default_mfu(gpu_key, moe)
    else:
        source = "given (--mfu)"
    factor, reasons = throughput_factor(cfg, accumulation_steps)
    flops, parameters = whole_model_flops_per_token(cfg, vocab)
    tps = mfu * gpus * peak_flops / flops * factor
    tokens = cfg.sequences(cfg.training.global_batch_size) * cfg.data.seq_len
    step = tokens / tps
    total = step * cfg.training.steps
    return Throughput(flops, mfu, source, factor, reasons, small_model_caveat(parameters), tps, tps / gpus, tokens,
                      step, cfg.training.steps, total, gpus * total / 3600)
