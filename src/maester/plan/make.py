"""A plan of a config on N GPUs of one kind: the per-rank memory of its step (`memory`) beside the device's, the
verdict, the changes that would fit when it does not (`advice`), and the time to `training.steps`
(`throughput`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from maester.config import Config
from maester.plan.advice import Alternative, alternatives
from maester.plan.checkpoint_host import CheckpointHost, checkpoint_host
from maester.plan.device import TIGHT_GIB, DeviceMemory, Verdict, device_memory, verdict
from maester.plan.memory import GiB, StepMemory, plan_config, predict_rank_memory, vocab_size
from maester.plan.throughput import Throughput, predict_throughput

NOTES = [
    "blocks traced eagerly: compiled blocks can keep less (Inductor recomputes cheap ops), so with parallel.compile "
    "the activations are an upper bound",
    "attention counted as the GPU kernels (flash, cuDNN, flex, varlen) keep it: output and log-sum-exp",
    "a mixture of experts counted with balanced routing: a collapsed router loads one rank's experts with more "
    "tokens",
]
FLOAT8_ROWS = ("float8: torch's memory trackers file the storages of torchao's float8 tensors under the wrong "
               "rows (activations show as gradients), so the rows are approximate; their sum, the peak, still counts "
               "every storage")


def hours_text(value: float) -> str:
    """GPU-hours as the plan prints them: whole above 10, two decimals below."""
    return f"{value:,.{0 if value >= 10 else 2}f}"


@dataclass
class Plan:
    source: str
    gpus: int
    gpu: str
    device: DeviceMemory
    peak_flops: float
    layout: str
    memory: StepMemory
    """Rank 0's: every rank holds the same (FSDP, TP, CP and EP shard evenly)."""
    verdict: Verdict
    throughput: Throughput
    checkpoint_host: CheckpointHost
    alternatives: list[Alternative] = field(default_factory=list)
    notes: list[str] = field(default_factory=lambda: list(NOTES))

    @property
    def peak_gib(self) -> float:
        return self.memory.peak / GiB

    def to_json(self) -> dict:
        return {
            "config": self.source, "torch": torch.__version__, "gpus": self.gpus, "gpu": self.gpu,
            "gpu_memory_gib": self.device.total_gib, "device_memory": self.device.to_json(),
            "peak_flops": self.peak_flops, "layout": self.layout, "memory_gib": self.memory.to_json(),
            "peak_gib": self.peak_gib, "usable_gib": self.device.usable_gib,
            "verdict": {"kind": self.verdict.kind, "line": self.verdict.line},
            "alternatives": [a.to_json() for a in self.alternatives],
            "throughput": self.throughput.to_json(), "checkpoint_host": self.checkpoint_host.to_json(),
            "notes": self.notes,
        }


def describe_layout(cfg: Config, gpus: int) -> tuple[str, int]:
    """The layout in words, and the accumulation steps per step of a rank."""
    from maester.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg, gpus)
    batch = dims.batch_plan(cfg, dp_rank=0)
    shards = "FSDP" if dims.fsdp_enabled else ("DDP" if dims.ddp_enabled else "replicated")
    parts = [f"dp_replicate {dims.dp_replicate} x dp_shard {dims.dp_shard} ({shards})", f"tp {dims.tp}",
             f"cp {dims.cp}", f"pp {dims.pp}" + (f" ({cfg.parallel.pp_schedule})" if dims.pp > 1 else "")]
    if dims.ep > 1:
        parts.append(f"ep {dims.ep} within dp_shard")
    text = (" x ".join(parts) + f"; per data-parallel rank {batch.accumulation_steps} micro-batch(es) of "
            f"{batch.micro_batch} x {cfg.data.seq_len} tokens; activation checkpointing "
            f"{cfg.parallel.activation_checkpointing}, precision {cfg.training.precision}")
    return text, batch.accumulation_steps


def predicted_peak_gib(cfg: Config, gpus: int, device_type: str = "cuda") -> float:
    """The per-rank peak of `cfg`'s step on `gpus` devices, in GiB: what the GPU check compares with
    `torch.cuda.max_memory_allocated` (on `device_type` "cpu", with torch's tracker around a real CPU step)."""
    return predict_rank_memory(cfg, gpus, 0, device_type).peak / GiB


def make_plan(cfg: Config, gpus: int, gpu: str, *, source: str = "", mfu: float | None = None,
              gpu_memory: float | None = None, advise: bool = True, gpu_from: str = "--gpu") -> Plan:
    """Plan `cfg` on `gpus` GPUs named `gpu` (`maester.train.metrics.gpu_named`; `gpu_from` names the setting it
    came from); `gpu_memory` (GiB, as torch's total_memory) overrides the measured one; `advise`: when it does not
    fit comfortably, plan the alternatives too."""
    from maester.train.metrics import gpu_named

    if gpus < 1:
        raise ValueError(f"--gpus {gpus}: give a positive number of GPUs")
    key, peak_flops, datasheet_gib = gpu_named(gpu, gpu_from)
    device = device_memory(key, datasheet_gib, gpus, gpu_memory)
    if mfu is not None and not 0 < mfu <= 1:
        raise ValueError(f"--mfu {mfu} is not a fraction in (0, 1], e.g. 0.4 for 40%")
    layout, accumulation = describe_layout(plan_config(cfg, "cuda"), gpus)
    vocab = vocab_size(cfg)
    memory = predict_rank_memory(cfg, gpus, 0, "cuda", vocab)
    result = verdict(memory.peak / GiB, device)
    throughput = predict_throughput(cfg, gpus, key, peak_flops, vocab, accumulation, mfu)
    notes = list(NOTES) + ([FLOAT8_ROWS] if cfg.training.float8.enabled else [])
    plan = Plan(source, gpus, key, device, peak_flops, layout, memory, result, throughput,
                checkpoint_host(cfg, gpus, memory.state), notes=notes)
    return with_alternatives(plan, cfg, vocab) if advise and result.kind != "fits" else plan


def with_alternatives(plan: Plan, cfg: Config, vocab: int | None = None) -> Plan:
    """`plan` (of `cfg`) with the changes that would fit planned too, each a step of its own."""
    vocab = vocab if vocab is not None else vocab_size(cfg)

    def peak_of(changed: Config) -> float:
        return predict_rank_memory(changed, plan.gpus, 0, "cuda", vocab).peak / GiB

    return replace(plan, alternatives=alternatives(cfg, plan.gpus, plan.device.usable_gib - TIGHT_GIB, peak_of))
