"""How far emulated float8 training's losses stray from bf16's on the demo, on the CPU: the evidence for the tolerance
of tests/distributed/test_float8.py. Every run starts from the same seed checkpoint and reads the same batches; the
float8 runs emulate torchao's rounding (`training.float8.emulate`), on 2 gloo ranks (FSDP2 with float8 all-gather, or
TP). For scale it also runs fp32 against bf16: the gap that bf16's rounding alone makes.

    python benchmarks/float8_losses.py [--steps 20] [--recipes tensorwise,rowwise,rowwise_with_gw_hp] [--out DIR]

Prints one JSON object: per run, the losses and the largest relative difference from the bf16 run at any step.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# The demo (its model, data and sequence length) with a small batch, so that 20 steps take seconds per layout.
DEMO_STEPS = dict(training__global_batch_size=2, training__micro_batch_size=1, schedule__warmup_steps=2,
                  logging__interval=1, checkpoint__interval=0, checkpoint__save_final="true",
                  training__device="cpu", training__precision="bf16")
LAYOUTS = {"fsdp2": {"parallel__dp_shard": 2}, "tp2": {"parallel__tp": 2, "parallel__dp_shard": 1}}


def overrides(root: Path, name: str, steps: int, **extra) -> list[str]:
    values = {"job.name": name, "job.dump_dir": str(root / "jobs"), "training.steps": str(steps),
              **{k.replace("__", "."): str(v) for k, v in {**DEMO_STEPS, **extra}.items()}}
    return [f"--{k}={v}" for k, v in values.items()]


def float8(recipe: str) -> dict:
    return {"training__float8__enabled": "true", "training__float8__recipe": recipe,
            "training__float8__emulate": "true"}


def write_seed(root: Path, steps: int) -> Path:
    """The demo's initial weights, saved once (step 0) for every run to start from; returns its checkpoints folder."""
    from maester.config import load_config
    from maester.train.trainer import write_seed_checkpoint
    from tests.helpers import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, overrides(root, "seed", steps), environ={})
    write_seed_checkpoint(cfg, cfg.job_dir)
    return cfg.job_dir / "checkpoints"


def run_job(root: Path, seed: Path, name: str, nproc: int, steps: int, **extra) -> list[float]:
    """A job of the demo from the seed checkpoint `seed`, trained by `nproc` processes; its losses."""
    from maester.train.metrics import read_metrics
    from tests.helpers import DEMO_CONFIG, clean_env, run_maester, torchrun

    out = run_maester(["submit", "--no-submit", str(DEMO_CONFIG), *overrides(root, name, steps, **extra)], root)
    if out.returncode:
        raise SystemExit(out.stderr)
    job = root / "jobs" / name
    shutil.rmtree(job / "checkpoints")
    shutil.copytree(seed, job / "checkpoints", symlinks=True)
    if nproc == 1:
        run = run_maester(["train", str(job)], root, env=clean_env(OMP_NUM_THREADS="1"), timeout=3600)
    else:
        run = torchrun(nproc, ["train", str(job)], root, timeout=3600)
    if run.returncode:
        raise SystemExit(f"{name}: {run.stderr[-3000:]}")
    return [r["loss"] for r in read_metrics(job / "metrics.jsonl")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--recipes", default="tensorwise,rowwise,rowwise_with_gw_hp")
    parser.add_argument("--out", type=Path, default=None, help="keep the jobs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    root = args.out or Path(tempfile.mkdtemp(prefix="float8-losses-"))
    root.mkdir(parents=True, exist_ok=True)

    seed = write_seed(root, args.steps)
    runs = {"bf16": run_job(root, seed, "bf16", 1, args.steps),
            "fp32": run_job(root, seed, "fp32", 1, args.steps, training__precision="fp32")}
    for recipe in args.recipes.split(","):
        for layout, extra in LAYOUTS.items():
            runs[f"float8-{recipe}-{layout}"] = run_job(root, seed, f"{recipe}-{layout}", 2, args.steps,
                                                        **extra, **float8(recipe))
    reference = runs["bf16"]
    result = {"steps": args.steps, "batch": "2 sequences x 256 tokens", "runs": {}}
    for name, losses in runs.items():
        worst = max(abs(a - b) / b for a, b in zip(losses, reference))
        result["runs"][name] = {"max_rel_diff_vs_bf16": round(worst, 5), "first": losses[0], "last": losses[-1],
                                "losses": [round(x, 5) for x in losses]}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
