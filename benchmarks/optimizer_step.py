"""Time of one optimizer step, Muon and AdamW's other implementations against AdamW as `auto` builds it (the
baseline: fused), on one process.

    uv run python benchmarks/optimizer_step.py                  # the demo Llama on this machine's device
    uv run python benchmarks/optimizer_step.py --flavor 1B      # on a GPU
    uv run python benchmarks/optimizer_step.py --smoke          # tiny, for the tests

Every optimizer steps the same model with the same fixed gradients; the median over `--steps` timed steps (after
warmup) is reported, with the ratio to AdamW measured in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from maester.config import ModelConfig, OptimizerConfig
from maester.models.build import build_model
from maester.train.optim import build_optimizer

CASES = {
    "adamw (baseline)": dict(name="adamw"),  # implementation auto: torch's fused kernel, on CPU too
    "adamw, foreach": dict(name="adamw", implementation="foreach"),
    "adamw, for-loop": dict(name="adamw", implementation="for-loop"),
    "muon, quintic, 5 steps": dict(name="muon"),
    "muon, polar express": dict(name="muon", muon={"coefficients": "polar_express"}),
    "muon, NorMuon": dict(name="muon", muon={"normuon": True}),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(model, cfg: OptimizerConfig, device: torch.device, warmup: int, steps: int) -> float:
    optimizer = build_optimizer(model, cfg, device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-3).to(device)
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        optimizer.step()
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="demo")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    flavor, steps, warmup = ("tiny", 2, 1) if args.smoke else (args.flavor, args.steps, 3)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(flavor=flavor)
    model = build_model(cfg, 32000, device, 0)
    n = sum(p.numel() for p in model.parameters())
    print(f"llama {flavor}: {n:,} parameters on {device}, median of {steps} steps")
    print("| optimizer | ms per step | vs AdamW |")
    print("|---|---|---|")
    base = None
    for label, kw in CASES.items():
        seconds = time_steps(model, OptimizerConfig(**kw), device, warmup, steps)
        base = base or seconds
        print(f"| {label} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
