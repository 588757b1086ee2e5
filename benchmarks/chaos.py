"""Chaos: a run with a checkpoint every few steps is killed with SIGKILL at random moments, resumed, and killed
again, until it finishes; then it is compared with the same run left alone.

    uv run python benchmarks/chaos.py                   # 25 kills, one process, then 10 kills of 2 torchrun ranks
    uv run python benchmarks/chaos.py --kills 6 --nproc 1 --steps 18   # the short form the tests run
    uv run python benchmarks/chaos.py --async-mode async                # interval saves written in the background

Kills come at random moments after a random step has been logged, and inside the checkpoint code through the
project's fault points (`_MAESTER_FAULT`: with the files partly written, before the manifest, between the rename
and the `latest` link; with `--async-mode async` these are inside background writes, while training goes on); with
`--nproc 2` the kill hits one of the two ranks, at random. After every kill it checks
that at most one `.tmp` directory is left and at most `keep_last + 1` checkpoints exist (the newest is renamed
into place before retention deletes the oldest); at the end, that exactly `keep_last` remain, that every logged
step is in metrics.jsonl once, and that the losses equal the undisturbed run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FAULTS = ("during_save", "before_manifest", "before_latest")


def overrides(dump_dir: Path, name: str, steps: int, interval: int, keep_last: int,
              async_mode: str = "off") -> list[str]:
    return [f"--job.dump_dir={dump_dir}", f"--job.name={name}", "--model.flavor=tiny", "--data.seq_len=32",
            f"--training.steps={steps}", "--training.global_batch_size=8", "--training.micro_batch_size=4",
            "--training.device=cpu", "--schedule.warmup_steps=2", "--logging.interval=1",
            f"--checkpoint.interval={interval}", f"--checkpoint.keep_last={keep_last}",
            f"--checkpoint.async_mode={async_mode}", "--data.sources=[{\"path\":\"builtin:pydoc\"}]"]


def command(nproc: int) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "maester", "train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "maester", "train"]


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MAESTER_", "_MAESTER_"))}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def metrics_lines(job: Path) -> list[dict]:
    path = job / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def logged_steps(job: Path) -> list[int]:
    return [r["step"] for r in metrics_lines(job) if "loss" in r]


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid` (the ranks under torchrun, the loader workers of a rank)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                found.append(int(entry))
    return found


def check_directory(job: Path, keep_last: int) -> None:
    checkpoints = job / "checkpoints"
    tmp = [p.name for p in checkpoints.glob("*.tmp")] if checkpoints.is_dir() else []
    steps = [p.name for p in checkpoints.glob("step-*") if p.name.split("-")[1].isdigit()]
    if len(tmp) > 1:
        raise AssertionError(f"{len(tmp)} temporary directories left: {tmp}")
    if len(steps) > keep_last + 1:
        raise AssertionError(f"{len(steps)} checkpoints with keep_last = {keep_last}: {sorted(steps)}")


def start_process(nproc: int, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`maester train ARGS` (under torchrun with `nproc` 2) in a process group of its own; stderr piped."""
    return subprocess.Popen([*command(nproc), *args], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def run_undisturbed(root: Path, nproc: int, steps: int, interval: int, keep_last: int,
                    start=start_process) -> dict[int, float]:
    args = overrides(root / "jobs", "undisturbed", steps, interval, keep_last)
    proc = start(nproc, [str(REPO / "configs" / "demo.toml"), *args], environment(), root)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(f"the undisturbed run ended with {proc.returncode}: {err[-3000:]}")
    return {r["step"]: r["loss"] for r in metrics_lines(root / "jobs" / "undisturbed") if "loss" in r}


def run_chaos(root: Path, *, kills: int, seed: int, nproc: int = 1, steps: int = 24, interval: int = 3,
              keep_last: int = 2, timeout: float = 900, async_mode: str = "off", start=start_process) -> dict:
    """Kill and resume the run until it finishes; returns the figures and raises AssertionError on a broken
    promise. `start` starts each attempt (`start_process`, or one with its methods: pid, poll, returncode,
    communicate; the pid leads a process group of its own)."""
    rng = random.Random(seed)
    job = root / "jobs" / "chaos"
    first = [str(REPO / "configs" / "demo.toml"),
             *overrides(root / "jobs", "chaos", steps, interval, keep_last, async_mode)]
    deadline = time.monotonic() + timeout
    killed, attempts, fault_kills = 0, 0, 0
    while True:
        attempts += 1
        target = first if not (job / "config.json").is_file() else [str(job)]
        extra = {}
        done = max(logged_steps(job), default=0)
        if killed < kills and rng.random() < 0.4:  # a kill inside a save, at the next checkpoint step
            point = rng.choice(FAULTS)
            at = (done // interval + 1) * interval
            if at < steps:
                extra["_MAESTER_FAULT"] = f"{point}:{at}" + (f"@{rng.randrange(nproc)}" if nproc > 1 else "")
        proc = start(nproc, target, environment(**extra), root)
        last = min(steps - 1, done + interval)  # never after the last step: the run would be over
        stop_after = rng.randint(min(done + 1, last), last) if killed < kills and last >= 1 else None
        killed_by_us = False
        while proc.poll() is None:
            if time.monotonic() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                raise AssertionError(f"no end after {timeout} s and {killed} kills")
            if stop_after is not None and max(logged_steps(job), default=0) >= stop_after:
                time.sleep(rng.uniform(0, 0.05))  # somewhere in the next step or two, or a save
                victims = children_of(proc.pid) if nproc > 1 else [proc.pid]
                if victims and proc.poll() is None:
                    os.kill(rng.choice(victims), signal.SIGKILL)
                    killed += 1
                    killed_by_us, stop_after = True, None
            time.sleep(0.01)
        _, err = proc.communicate()
        if proc.returncode == 0:
            break
        if "_MAESTER_FAULT" in extra and not killed_by_us:  # the fault point killed it, inside a save
            fault_kills += 1
        if proc.returncode not in (-signal.SIGKILL, 1) and "Signals.SIGKILL" not in err and "SIGKILL" not in err:
            raise AssertionError(f"attempt {attempts} ended with {proc.returncode}: {err[-3000:]}")
        os.killpg(proc.pid, signal.SIGKILL) if _group_alive(proc.pid) else None
        check_directory(job, keep_last)
    check_directory(job, keep_last)
    lines = [r for r in metrics_lines(job) if "loss" in r]
    steps_logged = [r["step"] for r in lines]
    if steps_logged != list(range(1, steps + 1)):
        raise AssertionError(f"metrics.jsonl steps are not 1..{steps} once each: {steps_logged}")
    left = sorted(int(p.name.split("-")[1]) for p in (job / "checkpoints").glob("step-*")
                  if p.name.split("-")[1].isdigit())
    if len(left) != keep_last:
        raise AssertionError(f"{left} checkpoints left, keep_last = {keep_last}")
    return {"kills": killed + fault_kills, "attempts": attempts, "fault_kills": fault_kills,
            "losses": {r["step"]: r["loss"] for r in lines}}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=25, help="random kills of the one-process run")
    parser.add_argument("--rank-kills", type=int, default=10, help="random kills of one of two torchrun ranks")
    parser.add_argument("--nproc", type=int, default=0, help="run only this layout (1 or 2); 0: both")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=4)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--async-mode", choices=("off", "async"), default="off",
                        help="checkpoint.async_mode of the killed runs (the undisturbed one saves synchronously)")
    args = parser.parse_args()
    layouts = [(1, args.kills), (2, args.rank_kills)] if not args.nproc else [
        (args.nproc, args.kills if args.nproc == 1 else args.rank_kills)]
    print("| processes | kills survived (inside saves) | attempts | steps | losses bit-identical | seconds |")
    print("|---|---|---|---|---|---|")
    for nproc, kills in layouts:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            start = time.monotonic()
            reference = run_undisturbed(root, nproc, args.steps, args.interval, args.keep_last)
            result = run_chaos(root, kills=kills, seed=args.seed, nproc=nproc, steps=args.steps,
                               interval=args.interval, keep_last=args.keep_last, timeout=3600,
                               async_mode=args.async_mode)
            same = result["losses"] == reference
            print(f"| {nproc} | {result['kills']} ({result['fault_kills']}) | {result['attempts']} | {args.steps} | "
                  f"{'yes' if same else 'NO'} | {time.monotonic() - start:.0f} |", flush=True)
            if not same:
                sys.exit(1)


if __name__ == "__main__":
    main()
