"""Checkpoint I/O against the disk: how long a save blocks the training loop with `checkpoint.async_mode` off and
async, and how close saving and loading come to the disk's own bandwidth, measured in the same run.

    uv run python benchmarks/checkpoint_io.py                  # a ~300M-parameter Llama with AdamW, on the CPU
    uv run python benchmarks/checkpoint_io.py --dir /scratch   # on the disk under test (default: this directory)
    uv run python benchmarks/checkpoint_io.py --smoke          # the tiny model (run by the tests)

One process saves through maester's own Checkpointer (DCP files, RNG, trainer state, manifest with CRC-32s,
rename, `latest`, retention) in `--saves` rounds, each of a synchronous save, a raw write of as many bytes in the
same directory (64 MiB blocks, then fsync, as `dd conv=fsync`) and an asynchronous save: on a shared machine the
disk's speed drifts, so each ratio compares measurements taken moments apart. After each save the loop changes every
parameter and moment in place (as an optimizer step does), then waits for the background write. The raw read reads
the checkpoint's own files. Both reads, raw and the load at resume,
start from a cold page cache (posix_fadvise DONTNEED on every file, which drops their clean pages).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from maester.config import CheckpointConfig, ModelConfig, OptimizerConfig
from maester.models.build import build_model, count_parameters
from maester.train.checkpoint import Checkpointer
from maester.train.optim import build_optimizer

BLOCK = 64 << 20
# ~300M parameters: 20 Llama blocks of width 1024 (GQA 16/8 heads, FFN 2816) and a 32k vocabulary, untied.
LARGE = {"dim": 1024, "n_layers": 20, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden_dim": 2816}
VOCAB = 32000


def model_and_optimizer(smoke: bool):
    """The model and AdamW with its moments (one step on random gradients)."""
    cfg = ModelConfig(flavor="tiny") if smoke else ModelConfig(flavor="demo", overrides=LARGE)
    model = build_model(cfg, 269 if smoke else VOCAB, torch.device("cpu"), 0)
    optimizer = build_optimizer(model, OptimizerConfig(), torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def change_in_place(model, optimizer) -> None:
    """What an optimizer step does to the state a background save is writing: every tensor changes in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.999)
        for state in optimizer.state.values():
            state["exp_avg"].mul_(0.9)


def drop_from_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(directory: Path, nbytes: int) -> float:
    """Seconds to write `nbytes` in 64 MiB blocks to one new file and fsync it."""
    block = os.urandom(1 << 20) * 64  # not zeros: no filesystem gets to skip them
    path = directory / "raw-write.bin"
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left > 0:
            left -= f.write(memoryview(block)[:min(left, BLOCK)])
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def raw_read(paths) -> float:
    """Seconds to read `paths` whole from a cold cache, 64 MiB at a time."""
    drop_from_cache(paths)
    buffer = bytearray(BLOCK)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass
    return time.perf_counter() - start


def seconds_in(profile: cProfile.Profile, parts: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Seconds spent per part, from a profile: each part is (`self` or `total`, a substring of the function's
    name as cProfile prints it, e.g. "posix.fsync" or "torch/serialization.py:save")."""
    stats = pstats.Stats(profile).stats
    out = {}
    for part, (kind, name) in parts.items():
        out[part] = sum(tt if kind == "self" else ct for (file, line, func), (_, _, tt, ct, _) in stats.items()
                        if name in f"{file}:{func}" or name in func)
    return out


SAVE_PARTS = {"fsync": ("self", "posix.fsync"), "file writes": ("self", "of '_io.BufferedWriter'"),
              "torch.save": ("total", "torch/serialization.py:save")}
LOAD_PARTS = {"file reads": ("self", "_io.BufferedReader"), "torch.load": ("total", "torch/serialization.py:load"),
              "copy into the model": ("self", "<method 'copy_' of 'torch._C.TensorBase' objects>"),
              "set_state_dict": ("total", "state_dict.py:set_state_dict")}


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def save_once(checkpointer: Checkpointer, step: int, model, optimizer, profile: cProfile.Profile | None = None):
    """One save (async_mode off: written while the loop waits; async: staged, then written in the background while
    the loop changes the state) and how it went; `profile` records the loop's part."""
    if profile is not None:
        profile.enable()
    checkpointer.save(step, model, optimizer, {"tokens_seen": step}, "{}", background=True)
    if profile is not None:
        profile.disable()
    change_in_place(model, optimizer)  # training goes on
    (result,) = checkpointer.collect(wait=True)
    if result.error:
        raise SystemExit(f"a save failed: {result.error}")
    return result


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, one round")
    parser.add_argument("--dir", default=".", help="where to write (a temporary directory is made inside)")
    parser.add_argument("--saves", type=int, default=3, help="rounds (a save per mode in each)")
    args = parser.parse_args()
    count = 1 if args.smoke else args.saves
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer(args.smoke)
    n_params = count_parameters(model)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-io-") as tmp:
        root = Path(tmp)
        save_profile, load_profile = cProfile.Profile(), cProfile.Profile()
        sync = Checkpointer(root / "off", CheckpointConfig(keep_last=1), async_mode="off")
        background = Checkpointer(root / "async", CheckpointConfig(keep_last=1), async_mode="async")
        off, background_saves, write_seconds = [], [], []
        for step in range(1, count + 1):  # rounds: a sync save, a raw write of its bytes, an async save
            off.append(save_once(sync, step, model, optimizer, save_profile if step == 1 else None))
            files = checkpoint_files(root / "off" / "checkpoints" / f"step-{step}")
            nbytes = sum(p.stat().st_size for p in files)
            write_seconds.append(raw_write(root, nbytes))
            background_saves.append(save_once(background, step, model, optimizer))
        sync.close()
        background.close()
        files = checkpoint_files((root / "async" / "checkpoints" / "latest").resolve())
        read_seconds = raw_read(files)

        del model, optimizer
        gc.collect()
        fresh_model, fresh_optimizer = model_and_optimizer(args.smoke)
        drop_from_cache(files)
        checkpointer = Checkpointer(root / "async", CheckpointConfig(keep_last=1))
        start = time.perf_counter()
        load_profile.enable()
        found, _ = checkpointer.resume_point()
        checkpointer.load(found, fresh_model, fresh_optimizer, "transfer")
        load_profile.disable()
        load_seconds = time.perf_counter() - start

    median = statistics.median
    sync_blocked = [r.blocked_seconds for r in off]
    async_blocked = [r.blocked_seconds for r in background_saves]
    steady = async_blocked[1:] or async_blocked  # the first async save also makes its host buffers
    sync_vs_raw = [w / r.blocked_seconds for w, r in zip(write_seconds, off)]  # bandwidth ratios, per round
    async_vs_raw = [w / r.write_seconds for w, r in zip(write_seconds, background_saves)]
    blocked_ratio = median(steady) / median(sync_blocked)
    phases = {k: median(r.phases[k] for r in off) for k in off[0].phases}
    raw_write_bw, raw_read_bw = nbytes / median(write_seconds), nbytes / read_seconds

    print(f"{'tiny Llama' if args.smoke else 'Llama'}, {n_params / 1e6:.1f}M parameters, AdamW; checkpoint of "
          f"{gb(nbytes)} in {len(files)} files; {count} round(s) of: a sync save, a raw write of its bytes, an "
          f"async save (medians; vs raw: the median of each round's ratio); torch {torch.__version__}, "
          f"{os.cpu_count()} CPU(s)")
    print()
    print("| what | seconds | GB/s | vs raw |")
    print("|---|---|---|---|")
    print(f"| raw write, 64 MiB blocks + fsync | {median(write_seconds):.3f} | {raw_write_bw / 1e9:.3f} | 1.00 |")
    for name, seconds, ratio in (
            ("save, off: loop blocked (= the whole save)", median(sync_blocked), median(sync_vs_raw)),
            ("save, async: background write", median(r.write_seconds for r in background_saves),
             median(async_vs_raw))):
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e9:.3f} | {ratio:.2f} |")
    print(f"| raw read, cold cache | {read_seconds:.3f} | {raw_read_bw / 1e9:.3f} | 1.00 |")
    print(f"| load at resume (manifest check + DCP load), cold cache | {load_seconds:.3f} | "
          f"{nbytes / load_seconds / 1e9:.3f} | {read_seconds / load_seconds:.2f} |")
    print()
    print(f"loop blocked per save: off {median(sync_blocked):.2f} s; async {median(steady):.2f} s "
          f"({100 * blocked_ratio:.1f}% of off), its first save {async_blocked[0]:.2f} s (its host buffers made)")
    save_parts, load_parts = seconds_in(save_profile, SAVE_PARTS), seconds_in(load_profile, LOAD_PARTS)
    print("where a synchronous save's time goes: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
          + "; the first save profiled: " + ", ".join(f"{k} {v:.2f} s" for k, v in save_parts.items())
          + " (torch.save includes its file writes, not the fsync)")
    print(f"where the load's time goes (profiled, {load_seconds:.2f} s): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in load_parts.items())
          + " (torch.load includes its file reads)")
    print("JSON " + json.dumps({
        "parameters": n_params, "bytes": nbytes, "raw_write_seconds": write_seconds,
        "raw_read_seconds": read_seconds, "sync_blocked_seconds": sync_blocked,
        "async_blocked_seconds": async_blocked, "async_write_seconds": [r.write_seconds for r in background_saves],
        "sync_vs_raw_write": sync_vs_raw, "async_vs_raw_write": async_vs_raw, "sync_phases": phases,
        "sync_profile": save_parts, "load_seconds": load_seconds, "load_vs_raw_read": read_seconds / load_seconds,
        "load_profile": load_parts, "blocked_ratio": blocked_ratio}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
