"""Training throughput of a real job: tokens/s, MFU and peak memory, from the job's own metrics.

    uv run python benchmarks/train_throughput.py                 # GPU: Llama 1B, seq 2048, bf16, compile, SAC
    uv run python benchmarks/train_throughput.py --nproc 8       # the same under torchrun (FSDP2 over 8 GPUs)
    uv run python benchmarks/train_throughput.py --smoke         # CPU: tiny model, a few steps (run by the tests)

It trains through `maester train` (under torchrun when --nproc > 1) on the built-in corpus with the byte
tokenizer, logs every step, and reports the median over the steps after the warm-up (compilation, allocator).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from maester.train.metrics_file import read_metrics

REPO = Path(__file__).resolve().parents[1]


def overrides(args, dump_dir: str) -> list[str]:
    if args.smoke:
        return [f"--job.dump_dir={dump_dir}", "--job.name=smoke", "--model.flavor=tiny", "--data.seq_len=64",
                "--training.steps=4", "--training.global_batch_size=4", "--training.micro_batch_size=2",
                "--training.device=cpu", "--schedule.warmup_steps=1", "--logging.interval=1",
                "--checkpoint.interval=0", "--checkpoint.save_final=false",
                "--parallel.activation_checkpointing=selective-op"]
    global_batch = args.micro_batch * args.nproc * args.accumulation
    return [f"--job.dump_dir={dump_dir}", "--job.name=throughput", f"--model.flavor={args.flavor}",
            f"--data.seq_len={args.seq_len}", f"--training.steps={args.steps}",
            f"--training.global_batch_size={global_batch}", f"--training.micro_batch_size={args.micro_batch}",
            "--training.precision=bf16", "--training.device=cuda", f"--schedule.warmup_steps={min(10, args.steps)}",
            "--logging.interval=1", "--checkpoint.interval=0", "--checkpoint.save_final=false",
            "--parallel.compile=true", "--parallel.activation_checkpointing=selective-op"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run that checks the harness itself")
    parser.add_argument("--flavor", default="1B")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per forward/backward")
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs) on this node")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MAESTER_")}
        env.setdefault("XDG_CACHE_HOME", str(Path(tmp) / "cache"))
        launch = [sys.executable, "-m", "maester"] if args.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            "-m", "maester"]
        subprocess.run([*launch, "train", str(REPO / "configs" / "demo.toml"), *overrides(args, f"{tmp}/jobs")],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        job = next((Path(tmp) / "jobs").iterdir())
        records = read_metrics(job / "metrics.jsonl")  # the step rows
    skip = 1 if args.smoke else args.warmup_steps
    steady = records[skip:] or records
    tps = statistics.median(r["tokens_per_second"] for r in steady)
    mfus = [r["mfu"] for r in steady if r["mfu"] is not None]
    what = "smoke (CPU, tiny)" if args.smoke else f"{args.flavor}, seq {args.seq_len}, micro-batch {args.micro_batch}"
    print("| run | processes | steps measured | tokens/s (all devices) | MFU | peak memory |")
    print("|---|---|---|---|---|---|")
    mfu = f"{100 * statistics.median(mfus):.1f}%" if mfus else "n/a"
    print(f"| {what} | {args.nproc} | {len(steady)} | {tps:,.0f} | {mfu} | "
          f"{max(r['peak_memory_gib'] for r in records):.2f} GiB |")


if __name__ == "__main__":
    main()
