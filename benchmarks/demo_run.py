"""Time the Quick start's demo run end to end and report its loss curve endpoints.

    uv run python benchmarks/demo_run.py [extra overrides...]

Runs `maester train configs/demo.toml` in a fresh temporary job directory (with a fresh corpus cache, so
the first-use cost of writing the built-in corpus is included) and prints one table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
        env["XDG_CACHE_HOME"] = str(Path(tmp) / "cache")
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "maester", "train", str(REPO / "configs" / "demo.toml"),
                        f"--job.dump_dir={tmp}/jobs", *sys.argv[1:]], env=env, check=True,
                       stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in open(Path(tmp) / "jobs" / "demo" / "metrics.jsonl")]
    steady = [r["tokens_per_second"] for r in records[1:]]
    print("| metric | value |\n|---|---|")
    print(f"| wall time, process start to exit | {wall:.1f} s |")
    print(f"| CPU threads | {__import__('torch').get_num_threads()} |")
    print(f"| steps | {records[-1]['step']} |")
    print(f"| loss at step 1 | {records[0]['loss']:.3f} |")
    print(f"| loss at the last step | {records[-1]['loss']:.3f} |")
    print(f"| median tokens/s | {sorted(steady)[len(steady) // 2]:,.0f} |")


if __name__ == "__main__":
    main()
