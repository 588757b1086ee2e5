"""When a plan does not fit: the changes that would, each planned again, with what it costs. Four kinds, in the
order a user reaches for them (the issue's list): activation checkpointing, a smaller micro-batch, tensor parallel,
FSDP's CPU offload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from maester.config import Config

COSTS = {
    "selective-op": "a few % more compute: the elementwise ops of each block run again in backward",
    "full": "about a third more compute: every block's forward runs again in backward",
    "micro_batch_size": "the same global batch in more accumulation steps: smaller matmuls, a little slower",
    "tp": "two all-reduces per block in forward and backward: keep tp within a node's fast links (<= 8)",
    "cpu_offload": "parameters cross PCIe every step and the optimizer steps on the CPU: often several times slower",
}


@dataclass(frozen=True)
class Alternative:
    override: str
    """The change, as a config override."""
    peak_gib: float
    fits: bool
    cost: str

    def to_json(self) -> dict:
        return asdict(self)


def _updated(cfg: Config, **parallel) -> Config:
    return cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=parallel)})


def candidates(cfg: Config, gpus: int) -> list[list[tuple[str, Config, str]]]:
    """Per kind of change, its steps in order of cost (the first that fits is the one to take): (override, config,
    cost)."""
    p, out = cfg.parallel, []
    modes = [m for m in ("selective-op", "full") if p.activation_checkpointing != "full"
             and (m == "full" or (p.activation_checkpointing == "none" and p.ep == 1))]
    if modes:
        out.append([(f"--parallel.activation_checkpointing={m}", _updated(cfg, activation_checkpointing=m), COSTS[m])
                    for m in modes])
    micro, steps = cfg.training.micro_batch_size, []
    unit = cfg.data.seq_len if cfg.training.batch_unit == "tokens" else 1
    while micro // 2 >= unit and (micro // 2) % unit == 0:
        micro //= 2
        training = cfg.training.model_copy(update={"micro_batch_size": micro})
        steps.append((f"--training.micro_batch_size={micro}", cfg.model_copy(update={"training": training}),
                      COSTS["micro_batch_size"]))
    if steps:
        out.append(steps)
    tps = [t for t in (2, 4, 8) if t > p.tp and gpus % t == 0]
    if tps:
        out.append([(f"--parallel.tp={t}", _updated(cfg, tp=t), COSTS["tp"]) for t in tps])
    if not p.cpu_offload:
        out.append([("--parallel.cpu_offload=true", _updated(cfg, cpu_offload=True), COSTS["cpu_offload"])])
    return out


def alternatives(cfg: Config, gpus: int, limit_gib: float,
                 peak_of: Callable[[Config], float]) -> list[Alternative]:
    """For each kind of change, the first step whose plan (`peak_of`, in GiB) fits: a peak of at most `limit_gib`;
    or its last step when none does; steps the layout refuses (e.g. a tp that does not divide the heads) are passed
    over."""
    found = []
    for steps in candidates(cfg, gpus):
        last = None
        for override, changed, cost in steps:
            try:
                peak = peak_of(changed)
            except ValueError:  # this layout cannot run at all
                continue
            last = Alternative(override, peak, peak <= limit_gib, cost)
            if last.fits:
                break
        if last is not None:
            found.append(last)
    return found
