"""GPU acceptance check: one command for the first run on a CUDA or ROCm machine.

    scripts/gpu-check.sh [--out DIR]                   # every stage, report in DIR/gpu-check.json
    uv run python benchmarks/gpu_check.py --dry-run    # list the stages' commands (no GPU needed)

Stages (each records pass, fail or skip with the reason; a failure does not stop the next stage):
environment (torch, CUDA/HIP, driver, GPUs, NCCL/RCCL), the tests marked `cuda`, a 2-rank tiny run, 3 training
steps under `torch.cuda.set_sync_debug_mode("warn")` counting synchronisations, a Gemma 3 1B SFT memory snapshot
at the shipped micro-batch (random init), FlexAttention + selective AC + compile, and train_throughput.py.
Without a usable GPU it refuses (exit 2) rather than checking the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GEMMA_CONFIG = "configs/gemma3/1b-sft.toml"
DEMO_CONFIG = "configs/demo.toml"

# A tiny pretraining run of the demo config: a few steps, every step logged, no checkpoints.
TINY = ["--model.flavor=tiny", "--data.seq_len=128", "--training.steps=3", "--training.global_batch_size=4",
        "--training.micro_batch_size=2", "--schedule.warmup_steps=1", "--logging.interval=1",
        "--checkpoint.interval=0", "--checkpoint.save_final=false", "--training.device=cuda"]

# The shipped Gemma 3 1B SFT config, trained from random weights with the byte tokenizer on the built-in chat
# corpus: the model, vocabulary, seq_len, micro-batch, precision, AC and compile stay as shipped.
GEMMA = ["--tokenizer.kind=byte", "--tokenizer.path=null", '--data.sources=[{"path": "builtin:pydoc-chat"}]',
         "--data.sft.template=chatml", "--checkpoint.init_from=null", "--training.steps=5",
         "--schedule.warmup_steps=1", "--training.global_batch_size=4", "--checkpoint.interval=0",
         "--checkpoint.save_final=false", "--logging.interval=1", "--logging.eval_interval=0",
         "--training.device=cuda"]

FLEX_SAC_COMPILE = ["--model.attention=flex", "--parallel.activation_checkpointing=selective-op",
                    "--parallel.compile=true"]

SYNC_DEBUG = """
import sys, warnings, torch
from maester.config import load_config
from maester.train.trainer import Trainer
cfg = load_config(sys.argv[1], sys.argv[2:], environ={})
trainer = Trainer(cfg, cfg.job_dir)
torch.cuda.set_sync_debug_mode("warn")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trainer.train()
torch.cuda.set_sync_debug_mode("default")
syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
print("SYNC_WARNINGS", len(syncs))
for line in sorted(set(syncs))[:20]:
    print("  ", line.splitlines()[0])
"""


def maester(*args: str) -> list[str]:
    return [sys.executable, "-m", "maester", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
            "maester", *args]


def jobs(out: Path, name: str) -> list[str]:
    return [f"--job.dump_dir={out / 'jobs'}", f"--job.name={name}"]


def stages(out: Path, n_gpus: int) -> list[dict]:
    """Each stage: name, command, the repository files it needs, and why it is skipped (None: it runs)."""
    two = min(2, n_gpus)
    return [
        dict(name="cuda-tests", command=[sys.executable, "-m", "pytest", "-m", "cuda", "-n0", "-q", "tests"],
             needs=["tests"], skip=None),
        dict(name="two-rank-run", command=torchrun(two, "train", DEMO_CONFIG, *TINY, *jobs(out, "two-rank")),
             needs=[DEMO_CONFIG], config=[DEMO_CONFIG, *TINY], metrics=out / "jobs" / "two-rank",
             skip=None if n_gpus >= 2 else "one GPU: NCCL refuses two ranks on one device (duplicate GPU), so the "
                                           "2-rank run needs two GPUs"),
        dict(name="sync-debug-3-steps", command=[sys.executable, "-c", SYNC_DEBUG, DEMO_CONFIG, *TINY,
                                                  *jobs(out, "sync-debug")],
             needs=[DEMO_CONFIG], config=[DEMO_CONFIG, *TINY], skip=None),
        dict(name="gemma3-1b-sft-memory", command=maester("train", GEMMA_CONFIG, *GEMMA, *jobs(out, "gemma3-sft")),
             needs=[GEMMA_CONFIG], config=[GEMMA_CONFIG, *GEMMA], metrics=out / "jobs" / "gemma3-sft", skip=None),
        dict(name="flex-sac-compile", command=maester("train", DEMO_CONFIG, *TINY, *FLEX_SAC_COMPILE,
                                                      *jobs(out, "flex-sac-compile")),
             needs=[DEMO_CONFIG], config=[DEMO_CONFIG, *TINY, *FLEX_SAC_COMPILE],
             metrics=out / "jobs" / "flex-sac-compile", skip=None),
        dict(name="train-throughput", command=[sys.executable, "benchmarks/train_throughput.py"],
             needs=["benchmarks/train_throughput.py"], skip=None),
    ]


def environment() -> dict:
    import torch

    env = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
           "hip": getattr(torch.version, "hip", None), "cuda_available": torch.cuda.is_available(),
           "gpus": [], "nccl": None, "driver": None}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
        try:
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # reported, not fatal
            env["nccl"] = f"unknown ({e})"
    env["driver"] = _driver()
    return env


def _driver() -> str | None:
    for cmd in (["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                ["rocm-smi", "--showdriverversion"]):
        if shutil.which(cmd[0]):
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode == 0:
                return run.stdout.strip().splitlines()[0] if cmd[0] == "nvidia-smi" else run.stdout.strip()[-200:]
    return None


def last_metrics(job_dir: Path) -> dict | None:
    path = job_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in lines if "peak_memory_gib" in r]
    return steps[-1] if steps else None


def run_stage(stage: dict, timeout: float) -> dict:
    result = {"name": stage["name"], "command": " ".join(stage["command"][:3] + ["..."])
              if stage["name"] == "sync-debug-3-steps" else " ".join(stage["command"])}
    if stage["skip"]:
        return {**result, "status": "skip", "reason": stage["skip"]}
    start = time.monotonic()
    try:
        run = subprocess.run(stage["command"], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {**result, "status": "fail", "reason": f"timed out after {timeout:.0f} s",
                "seconds": round(time.monotonic() - start, 1)}
    result.update(seconds=round(time.monotonic() - start, 1), returncode=run.returncode,
                  output_tail=(run.stdout + run.stderr)[-3000:])
    if run.returncode != 0:
        return {**result, "status": "fail", "reason": f"exit code {run.returncode}"}
    if "metrics" in stage:
        last = last_metrics(stage["metrics"])
        if last is None:
            return {**result, "status": "fail", "reason": "no step in metrics.jsonl"}
        result["figures"] = {k: last.get(k) for k in ("step", "loss", "peak_memory_gib", "tokens_per_second",
                                                      "mfu")}
    if stage["name"] == "sync-debug-3-steps":
        count = [line for line in run.stdout.splitlines() if line.startswith("SYNC_WARNINGS")]
        result["figures"] = {"sync_warnings": int(count[0].split()[1]) if count else None}
    return {**result, "status": "pass", "reason": ""}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="directory of the report and the jobs")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each stage's command and check that the files it uses exist; needs no GPU")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per stage")
    args = parser.parse_args(argv)
    out = args.out.resolve()

    if args.dry_run:
        missing = 0
        for stage in stages(out, n_gpus=2):
            print(f"[{stage['name']}] {' '.join(stage['command'])}")
            for need in stage["needs"]:
                ok = (REPO / need).exists()
                missing += not ok
                print(f"    {'ok' if ok else 'MISSING'} {need}")
            if "config" in stage:  # the config and its overrides load as they are
                from maester.config import load_config

                try:
                    load_config(REPO / stage["config"][0], [*stage["config"][1:], *jobs(out, "dry-run")], environ={})
                    print(f"    ok config {stage['config'][0]} with the overrides")
                except Exception as e:
                    missing += 1
                    print(f"    INVALID config {stage['config'][0]}: {e}")
        return 1 if missing else 0

    import torch

    if not torch.cuda.is_available():
        hip = getattr(torch.version, "hip", None)
        print(f"gpu-check needs a CUDA or ROCm GPU, and torch.cuda.is_available() is False here (torch "
              f"{torch.__version__}, built for CUDA {torch.version.cuda}, HIP {hip}; CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}). Nothing was checked: the check never falls back to "
              f"the CPU.", file=sys.stderr)
        return 2

    out.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "environment": environment(),
              "stages": []}
    print(json.dumps(report["environment"], indent=2))
    report_path = out / "gpu-check.json"
    for stage in stages(out, torch.cuda.device_count()):
        print(f"[{stage['name']}] ...", flush=True)
        result = run_stage(stage, args.timeout)
        report["stages"].append(result)
        print(f"[{stage['name']}] {result['status']} {result.get('reason', '')} {result.get('figures', '')}",
              flush=True)
        report_path.write_text(json.dumps(report, indent=2))  # written after every stage
    print(f"report: {report_path}")
    return 1 if any(s["status"] == "fail" for s in report["stages"]) else 0


if __name__ == "__main__":
    sys.exit(main())
