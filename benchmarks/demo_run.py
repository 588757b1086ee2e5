"""Time the Quick start's demo run end to end and report its loss curve endpoints (and, with overrides that set
`evaluation.tasks`, the downstream results of its last evaluation); with --sft, then fine-tune it with
configs/demo-sft.toml and report that run too.

    uv run python benchmarks/demo_run.py [--sft] [extra overrides of the demo...]

Runs `maester train configs/demo.toml` in a fresh temporary job directory (with a fresh corpus cache, so
the first-use cost of writing the built-in corpus is included) and prints one table per run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(config: str, tmp: str, env: dict, extra: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "maester", "train", str(REPO / "configs" / config),
                    f"--job.dump_dir={tmp}/jobs", *extra], env=env, check=True, stdout=subprocess.DEVNULL, cwd=tmp)
    return time.perf_counter() - start


def table(title: str, wall: float, records: list[dict]) -> None:
    import torch

    all_records = records
    evals = [r for r in records if "val_loss" in r]
    records = [r for r in records if "loss" in r]  # steps with a training line (an evaluation may fall between)
    steady = [r["tokens_per_second"] for r in records[1:]]
    print(f"\n{title}\n\n| metric | value |\n|---|---|")
    print(f"| wall time, process start to exit | {wall:.1f} s |")
    print(f"| CPU threads | {torch.get_num_threads()} |")
    print(f"| steps | {records[-1]['step']} |")
    print(f"| loss at step 1 | {records[0]['loss']:.3f} |")
    print(f"| loss at the last step | {records[-1]['loss']:.3f} |")
    if evals:
        print(f"| validation loss, first / last evaluation | {evals[0]['val_loss']:.3f} (step {evals[0]['step']}) / "
              f"{evals[-1]['val_loss']:.3f} (step {evals[-1]['step']}) |")
    if records[0].get("padding_efficiency", 1.0) < 1.0:
        pads = sorted(r["padding_efficiency"] for r in records)
        print(f"| median padding efficiency | {100 * pads[len(pads) // 2]:.1f}% |")
        print(f"| median label tokens per step | {sorted(r['label_tokens_per_step'] for r in records)[len(records) // 2]:,.0f} |")
    print(f"| median tokens/s | {sorted(steady)[len(steady) // 2]:,.0f} |")
    downstream = [r for r in all_records if "eval/seconds" in r]  # with --evaluation.tasks=...
    for r in downstream[-1:]:
        for key, value in r.items():
            if key.startswith("eval/") and key != "eval/seconds":
                print(f"| {key[5:]} at step {r['step']} | {value:.3f} |")
        print(f"| downstream evaluation time, each of {len(downstream)} | "
              f"{sum(d['eval/seconds'] for d in downstream) / len(downstream):.1f} s |")


def main() -> None:
    from maester.train.metrics import read_metrics

    args = sys.argv[1:]
    sft = "--sft" in args
    extra = [a for a in args if a != "--sft"]
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
        env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        wall = train("demo.toml", tmp, env, extra)
        table("configs/demo.toml", wall, read_metrics(Path(tmp) / "jobs" / "demo" / "metrics.jsonl"))
        if sft:
            wall = train("demo-sft.toml", tmp, env, [f"--checkpoint.init_from={tmp}/jobs/demo"])
            table("configs/demo-sft.toml", wall, read_metrics(Path(tmp) / "jobs" / "demo-sft" / "metrics.jsonl"))


if __name__ == "__main__":
    main()
