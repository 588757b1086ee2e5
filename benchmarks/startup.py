"""Time from `maester train JOB` to the first step of a resume: what every SLURM requeue pays.

    uv run python benchmarks/startup.py              # the demo job, 5 resumes (median), phases from the log
    uv run python benchmarks/startup.py --runs 1     # one resume (run by the tests)

It trains the demo for 2 steps with a checkpoint, then resumes it for one more step `--runs` times (the step's
checkpoint removed each time, so every run resumes from step 2) and reads, from the time each line of the run's
output arrives: start-up to the environment line (imports, distributed init, logging), to "resumed from"
(tokenizer, model build, checkpoint load) and to the first step's line. Python writes its bytecode caches as on a
user's machine (PYTHONDONTWRITEBYTECODE is removed) and the first resume is left out as a warm-up of them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = (("environment", "INFO environment:"), ("resumed", "INFO resumed from"), ("first step", "INFO step 3 "))


def env() -> dict:
    out = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_") and k != "PYTHONDONTWRITEBYTECODE"}
    return out


def resume_once(job: Path) -> dict[str, float]:
    ckpt = job / "checkpoints"
    (ckpt / "latest").unlink()
    os.symlink("step-2", ckpt / "latest")
    shutil.rmtree(ckpt / "step-3", ignore_errors=True)
    (job / "COMPLETED").unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "maester", "train", str(job), "--training.steps=3"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, float] = {}
    for line in proc.stdout:
        for name, marker in PHASES:
            if name not in seen and marker in line:
                seen[name] = time.perf_counter() - start
    if proc.wait() != 0 or len(seen) != len(PHASES):
        raise RuntimeError(f"resume failed or its log lacked a phase (got {sorted(seen)})")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="measured resumes (after one warm-up)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "maester", "train", str(REPO / "configs" / "demo.toml"),
                        f"--job.dump_dir={tmp}", "--training.steps=2", "--schedule.warmup_steps=1",
                        "--checkpoint.interval=2", "--logging.interval=1"], env=env(), check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job = Path(tmp) / "demo"
        resume_once(job)  # warm-up: bytecode caches, page cache
        runs = [resume_once(job) for _ in range(args.runs)]
    median = {name: statistics.median(r[name] for r in runs) for name, _ in PHASES}
    print(f"demo job, resume from step 2 to step 3, median of {args.runs} run(s)")
    print("| to | seconds | of which this phase |")
    print("|---|---|---|")
    before = 0.0
    for name, _ in PHASES:
        print(f"| {name} | {median[name]:.2f} | {median[name] - before:.2f} |")
        before = median[name]


if __name__ == "__main__":
    main()
