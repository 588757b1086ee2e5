"""Float8 against bf16 on one GPU, in one command: the GPU check's float8 stage (benchmarks/gpu_check.py). It trains
the same config twice through benchmarks/gpu_check_train.py (one-rank FSDP2, the synchronisation count and the
figures of every training stage), first without float8, then with it, and prints one line
`GPU_CHECK_RESULT {json}`: both runs' tokens/s, peak memory and losses, and `speedup` = float8 / bf16 tokens/s.

    python benchmarks/float8_speedup.py CONFIG [overrides...]   # a config that enables training.float8

The stage passes when both runs pass; the speed-up is reported, not judged (a GPU check must not fail on a slow
shared node), and goes into benchmarks/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "benchmarks" / "gpu_check_train.py"
RESULT = "GPU_CHECK_RESULT"


def run_variant(argv: list[str], name: str, float8: bool) -> dict:
    job = [a for a in argv if a.startswith("--job.name=")]
    base = job[-1].split("=", 1)[1] if job else "float8-speedup"
    command = [sys.executable, str(HARNESS), *argv, f"--training.float8.enabled={str(float8).lower()}",
               f"--job.name={base}-{name}"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
    found = [line for line in run.stdout.splitlines() if line.startswith(RESULT)]
    if not found:
        return {"ok": False, "reason": f"{name}: exit code {run.returncode}, no result line"}
    verdict = json.loads(found[-1][len(RESULT):])
    if verdict.get("reason"):
        verdict["reason"] = f"{name}: {verdict['reason']}"
    return verdict


def compare(bf16: dict, float8: dict) -> dict:
    figures = {}
    for name, verdict in (("bf16", bf16), ("float8", float8)):
        for key in ("tokens_per_second", "mfu", "max_memory_allocated_gib", "loss", "syncs_per_step",
                    "train_seconds"):
            figures[f"{name}_{key}"] = verdict.get("figures", {}).get(key)
    fast, slow = figures["float8_tokens_per_second"], figures["bf16_tokens_per_second"]
    figures["speedup"] = round(fast / slow, 3) if fast and slow else None
    reasons = [v["reason"] for v in (bf16, float8) if v.get("reason")]
    return {"ok": bf16["ok"] and float8["ok"], "reason": "; ".join(reasons), "figures": figures}


def main(argv: list[str]) -> int:
    bf16 = run_variant(argv, "bf16", float8=False)
    float8 = run_variant(argv, "float8", float8=True)
    result = compare(bf16, float8)
    print(RESULT, json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
