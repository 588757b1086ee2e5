"""The suite's time as README.md gives it: runs a command (default `uv run pytest`, README's test command) and
reports its wall seconds, the CPU seconds of its process tree, and how busy the machine's CPUs were meanwhile
(from /proc/stat every few seconds). The last two differ: SLURM runs a job's processes under its own daemons, not
as children of pytest, so only the machine's figure counts them. A machine busy near 100% of its CPUs all run long
can go faster only by doing less.

    python benchmarks/suite_time.py [--every 5] [--json FILE] [-- COMMAND ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time


def cpu_jiffies() -> tuple[int, int]:
    """(busy, idle) jiffies of the whole machine since boot; iowait counts as idle."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, idle + iowait


def busy_shares(samples: list[tuple[int, int]]) -> list[float]:
    """The machine's share busy (0-1 of all CPUs) between consecutive samples."""
    out = []
    for (b0, i0), (b1, i1) in zip(samples, samples[1:]):
        total = (b1 - b0) + (i1 - i0)
        out.append((b1 - b0) / total if total else 0.0)
    return out


def minutes_and_seconds(seconds: float) -> str:
    """`seconds` as "M min S s", rounded to the second."""
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=5.0, help="seconds between samples of /proc/stat")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("command", nargs="*", default=["uv", "run", "pytest"])
    args = parser.parse_args(argv)

    tick = os.sysconf("SC_CLK_TCK")
    samples = [cpu_jiffies()]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(args.every):
            samples.append(cpu_jiffies())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.monotonic()
    code = subprocess.call(args.command)
    wall = time.monotonic() - start
    done.set()
    sampler.join()
    samples.append(cpu_jiffies())

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree_cpu = children.ru_utime + children.ru_stime
    busy, idle = samples[-1][0] - samples[0][0], samples[-1][1] - samples[0][1]
    cpus = os.cpu_count() or 1
    shares = busy_shares(samples)
    figures = {
        "command": " ".join(args.command), "exit_code": code, "wall_s": round(wall, 1),
        "command_cpu_s": round(tree_cpu, 1), "command_cpu_percent": round(100 * tree_cpu / wall),
        "machine_cpus": cpus, "machine_busy_cpu_s": round(busy / tick, 1),
        "machine_busy_percent_of_all_cpus": round(100 * busy / max(1, busy + idle), 1),
        "stretches_below_90_percent": sum(1 for s in shares if s < 0.9), "stretches": len(shares),
    }
    print(f"suite time: {minutes_and_seconds(wall)} wall, exit {code}; the command's processes "
          f"{tree_cpu:,.0f} CPU s ({figures['command_cpu_percent']}% of one CPU); the machine's {cpus} CPUs "
          f"{figures['machine_busy_percent_of_all_cpus']}% busy ({busy / tick:,.0f} CPU s), "
          f"{figures['stretches_below_90_percent']} of {len(shares)} stretches of {args.every:.0f} s below 90%",
          flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(main())
