"""CPU training with another process competing for the cores: OpenMP threads that spin while they wait (libgomp's
default, what maester did before) against threads that sleep (`OMP_WAIT_POLICY=PASSIVE`, what `maester` sets
before torch loads unless the environment says otherwise).

    uv run python benchmarks/cpu_threads.py [--rounds 3] [--steps 10] [--no-compete] [--smoke]

Each round trains the demo model (`configs/demo.toml`, 8 x 256 tokens per step) for `--steps` steps once each way,
in turn, while one busy-looping process (one core's worth of work, like one other user's job) runs beside them;
both ways run with the same thread count (maester's: the CPUs the process may use). Reported per way: the median
step time over the rounds (from metrics.jsonl, the first two steps left out), the wall time of the command and the
CPU time it burnt, and the ratio spinning / passive. `--no-compete` measures the same without the busy loop (the
cost of sleeping threads on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# libgomp's documented wait when OMP_WAIT_POLICY is unset: spin 300,000 times, then sleep. Setting it keeps
# maester from choosing the passive policy, so this way runs as before.
WAYS = {"spinning (before)": {"GOMP_SPINCOUNT": "300000"}, "passive (after)": {}}


def train(env_extra: dict, steps: int, cache: str) -> tuple[float, float, float]:
    """(median step seconds, wall seconds, CPU seconds of the command)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("MAESTER_") and k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
        env.update(XDG_CACHE_HOME=cache, **env_extra)
        before, start = os.times(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "maester", "train", str(REPO / "configs" / "demo.toml"),
                        f"--job.dump_dir={tmp}/jobs", f"--training.steps={steps}", "--logging.interval=1",
                        "--checkpoint.interval=0", "--checkpoint.save_final=false",
                        "--training.global_batch_size=8", "--training.micro_batch_size=8"],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp)
        wall, after = time.perf_counter() - start, os.times()
        records = [json.loads(line) for line in open(Path(tmp) / "jobs" / "demo" / "metrics.jsonl")]
        step_seconds = [r["step_seconds"] for r in records if "loss" in r][2:]
    cpu = after.children_user + after.children_system - before.children_user - before.children_system
    return statistics.median(step_seconds), wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--no-compete", action="store_true", help="no busy-looping process beside the runs")
    parser.add_argument("--smoke", action="store_true", help="one round of 4 steps")
    args = parser.parse_args()
    rounds, steps = (1, 4) if args.smoke else (args.rounds, args.steps)
    results: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as cache:
        train({}, 3, cache)  # writes the built-in corpus once, outside the measurement
        competitor = None if args.no_compete else subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(rounds):
                for way, env in WAYS.items():
                    results[way].append(train(env, steps, cache))
        finally:
            if competitor is not None:
                competitor.kill()
                competitor.wait()
    print(f"\ndemo model, 8 x 256 tokens per step, {steps} steps, {rounds} round(s), "
          f"{'one competing busy process' if not args.no_compete else 'no competing process'}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| idle OpenMP threads | median step | median wall | median CPU time |\n|---|---|---|---|")
    medians = {}
    for way, runs in results.items():
        medians[way] = [statistics.median(r[i] for r in runs) for i in range(3)]
        step, wall, cpu = medians[way]
        print(f"| {way} | {step:.3f} s | {wall:.1f} s | {cpu:.1f} s |")
    (spin, passive) = (medians[w] for w in WAYS)
    print(f"\nspinning / passive: step time {spin[0] / passive[0]:.2f}x, wall {spin[1] / passive[1]:.2f}x, "
          f"CPU time {spin[2] / passive[2]:.2f}x")


if __name__ == "__main__":
    main()
