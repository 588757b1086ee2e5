"""Checkpoint I/O against the disk: how long a save blocks the training loop with `checkpoint.async_mode` off and
async, how close saving and loading come to the disk's own bandwidth, what the full verification costs, and the
per-rank load time at 1, 2 and 4 ranks, measured in one run.

    uv run python benchmarks/checkpoint_io.py                  # a ~300M-parameter Llama with AdamW, on the CPU
    uv run python benchmarks/checkpoint_io.py --dir /scratch   # on the disk under test (default: this directory)
    uv run python benchmarks/checkpoint_io.py --smoke          # the tiny model (run by the tests)

One process saves through maester's own Checkpointer (DCP files hashed as written, RNG, trainer state, manifest,
rename, `latest`, retention) in `--saves` rounds, each of a synchronous save, a raw write of as many bytes in the
same directory (64 MiB blocks, then fsync, as `dd conv=fsync`), a synchronous save with 2 write threads and an
asynchronous save: on a shared machine the disk's speed drifts, so each ratio compares measurements taken moments
apart. After each save the loop changes every parameter and moment in place (as an optimizer step does), then waits
for the background write. A copy of the state into touched host buffers gives the memory's own bound.

The raw read reads the checkpoint's own files; it and the load at resume (`resume_point` + `resume`: the size check,
then one pass that copies every tensor into the model and optimizer and checks every file's XXH3-128) start from a
cold page cache (posix_fadvise DONTNEED on every file, which drops their clean pages). With the files in the page
cache: the load with and without the checksums, and `verify_checkpoint(..., "full")` alone (s/GB).

Last, `--ranks` gloo process groups (1, 2, 4) each save and load a model of `--rank-mb` per rank (sharded weights,
the same shard size at every count), the load with full verification, page cache warm: the per-rank seconds and
the bytes each rank checks.
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
from maester.train import checkpoint as checkpoint_module
from maester.train.checkpoint import Checkpointer
from maester.train.checkpoint_files import verify_checkpoint
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


SAVE_PARTS = {"fsync": ("self", "posix.fsync"), "file writes": ("self", "posix.write"),
              "hashing": ("self", "xxh3_128"), "torch.save": ("total", "torch/serialization.py:save")}
LOAD_PARTS = {"copy into the model": ("self", "<method 'copy_' of 'torch._C.TensorBase' objects>"),
              "set_state_dict": ("total", "state_dict.py:set_state_dict"),
              "waiting for the checksum": ("self", "<method 'acquire' of '_thread.lock' objects>")}


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def save_once(checkpointer: Checkpointer, step: int, model, optimizer, profile: cProfile.Profile | None = None):
    """One save (async_mode off: written while the loop waits; async: staged, then written in the background while
    the loop changes the state) and how it went; `profile` records the loop's part."""
    if profile is not None:
        profile.enable()
    checkpointer.save(step, model, optimizer, {"tokens_seen": step, "data": {}}, "{}", background=True)
    if profile is not None:
        profile.disable()
    change_in_place(model, optimizer)  # training goes on
    (result,) = checkpointer.collect(wait=True)
    if result.error:
        raise SystemExit(f"a save failed: {result.error}")
    return result


def memory_copy(model, optimizer) -> float:
    """Seconds to copy every parameter and moment into host buffers touched before (the memory's bound)."""
    tensors = [p.detach() for p in model.parameters()] + [v for s in optimizer.state.values() for v in s.values()
                                                          if torch.is_tensor(v) and v.dim()]
    buffers = [torch.empty_like(t) for t in tensors]
    for b, t in zip(buffers, tensors):
        b.copy_(t)
    start = time.perf_counter()
    for b, t in zip(buffers, tensors):
        b.copy_(t)
    return time.perf_counter() - start


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def saves(root: Path, count: int, model, optimizer, profile) -> dict:
    """The rounds of saves and raw writes; their records and seconds."""
    sync = Checkpointer(root / "off", CheckpointConfig(keep_last=1), async_mode="off")
    threads = Checkpointer(root / "threads", CheckpointConfig(keep_last=1), async_mode="off")
    background = Checkpointer(root / "async", CheckpointConfig(keep_last=1), async_mode="async")
    out: dict = {"off": [], "threads": [], "async": [], "raw": [], "copy": []}
    for step in range(1, count + 1):  # rounds: sync save, raw write of its bytes, 2-thread sync save, async save
        out["off"].append(save_once(sync, step, model, optimizer, profile if step == 1 else None))
        files = checkpoint_files(root / "off" / "checkpoints" / f"step-{step}")
        out["bytes"], out["files"] = sum(p.stat().st_size for p in files), len(files)
        out["raw"].append(raw_write(root, out["bytes"]))
        checkpoint_module.WRITE_THREADS = 2
        try:
            out["threads"].append(save_once(threads, step, model, optimizer))
        finally:
            checkpoint_module.WRITE_THREADS = 1
        out["async"].append(save_once(background, step, model, optimizer))
        out["copy"].append(memory_copy(model, optimizer))
    for checkpointer in (sync, threads, background):
        checkpointer.close()
    return out


def loads(root: Path, smoke: bool, profile: cProfile.Profile) -> dict:
    """The cold raw read and the cold load at resume (full verification), then warm: the load without and with
    the checksums, and the full check alone."""
    path = (root / "async" / "checkpoints" / "latest").resolve()
    files = checkpoint_files(path)
    out = {"raw_read": raw_read(files)}
    model, optimizer = model_and_optimizer(smoke)
    drop_from_cache(files)
    checkpointer = Checkpointer(root / "async", CheckpointConfig(keep_last=1))
    start = time.perf_counter()
    profile.enable()
    found, _ = checkpointer.resume_point()
    checkpointer.resume(found, model, optimizer, None)
    profile.disable()
    out["load"] = time.perf_counter() - start
    out["load_warm_unverified"] = timed(lambda: checkpointer.load(path, model, optimizer, "continue"))
    out["load_warm_verified"] = timed(lambda: checkpointer.load(path, model, optimizer, "continue", verify=True))
    out["verify_warm"] = timed(lambda: verify_checkpoint(path, "full"))
    return out


def per_rank_load(world: int, rank_mb: int, root: Path, port: int) -> dict:
    """Spawn `world` gloo processes that save and load a model of `rank_mb` per rank; each rank's figures (written
    by each as rank<R>.json)."""
    import torch.multiprocessing as mp

    where = root / f"ranks-{world}"
    mp.start_processes(_rank_load, args=(world, rank_mb, str(where), port), nprocs=world, start_method="spawn")
    return {str(r): json.loads((where / f"rank{r}.json").read_text()) for r in range(world)}


def _rank_load(rank: int, world: int, rank_mb: int, root: str, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from maester.train import checkpoint_reader

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Module()
    rows = max(1, rank_mb * (1 << 20) // (4 * 4096 * 8))  # 8 weights of (world x rows) x 4096 float32
    for i in range(8):
        model.register_parameter(f"w{i}", torch.nn.Parameter(distribute_tensor(
            torch.randn(world * rows, 4096), mesh, [Shard(0)])))
    checkpointer = Checkpointer(Path(root), CheckpointConfig(), rank=rank)
    path = checkpointer.save(1, model, None, {}, "{}")
    hashed = []
    real = checkpoint_reader.checksum_of_buffer
    checkpoint_reader.checksum_of_buffer = lambda buffer, kind: (hashed.append(len(buffer)), real(buffer, kind))[1]
    dist.barrier()
    seconds = []
    for _ in range(3):
        dist.barrier()
        seconds.append(timed(lambda: checkpointer.load(path, model, None, "model_only", verify=True)))
    (Path(root) / f"rank{rank}.json").write_text(json.dumps({
        "seconds": statistics.median(seconds), "hashed_bytes": sum(hashed) / 3,
        "shard_bytes": sum(p.to_local().nbytes for p in model.parameters())}))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="the tiny model, one round, small ranks")
    parser.add_argument("--dir", default=".", help="where to write (a temporary directory is made inside)")
    parser.add_argument("--saves", type=int, default=3, help="rounds (a save per mode in each)")
    parser.add_argument("--ranks", help="process counts of the per-rank load (default 1,2,4; --smoke: 2)")
    parser.add_argument("--rank-mb", type=int, default=256, help="MB of weights per rank in the per-rank load")
    parser.add_argument("--port", type=int, default=29517, help="the gloo rendezvous port of the per-rank load")
    args = parser.parse_args()
    count = 1 if args.smoke else args.saves
    torch.manual_seed(0)
    model, optimizer = model_and_optimizer(args.smoke)
    n_params = count_parameters(model)

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-io-") as tmp:
        root = Path(tmp)
        save_profile, load_profile = cProfile.Profile(), cProfile.Profile()
        s = saves(root, count, model, optimizer, save_profile)
        del model, optimizer
        gc.collect()
        loaded = loads(root, args.smoke, load_profile)
        ranks = {w: per_rank_load(w, 4 if args.smoke else args.rank_mb, root, args.port + w)
                 for w in map(int, (args.ranks or ("2" if args.smoke else "1,2,4")).split(","))}
    report(args, n_params, count, s, loaded, ranks, seconds_in(save_profile, SAVE_PARTS),
           seconds_in(load_profile, LOAD_PARTS))


def report(args, n_params: int, count: int, s: dict, loaded: dict, ranks: dict, save_parts: dict,
           load_parts: dict) -> None:
    median, nbytes = statistics.median, s["bytes"]
    sync_blocked = [r.blocked_seconds for r in s["off"]]
    async_blocked = [r.blocked_seconds for r in s["async"]]
    steady = async_blocked[1:] or async_blocked  # the first async save also makes its host buffers
    ratio = {name: [w / (r.blocked_seconds if name != "async" else r.write_seconds) for w, r in zip(s["raw"], s[name])]
             for name in ("off", "threads", "async")}  # bandwidth ratios, per round
    blocked_ratio = median(steady) / median(sync_blocked)
    phases = {k: median(r.phases[k] for r in s["off"]) for k in s["off"][0].phases}
    print(f"{'tiny Llama' if args.smoke else 'Llama'}, {n_params / 1e6:.1f}M parameters, AdamW; checkpoint of "
          f"{gb(nbytes)} in {s['files']} files; {count} round(s) of: a sync save, a raw write of its bytes, a sync "
          f"save with 2 write threads, an async save (medians; vs raw: the median of each round's ratio); torch "
          f"{torch.__version__}, {os.cpu_count()} CPU(s)")
    print()
    print("| what | seconds | GB/s | vs raw |")
    print("|---|---|---|---|")
    raw = median(s["raw"])
    print(f"| raw write, 64 MiB blocks + fsync | {raw:.3f} | {nbytes / raw / 1e9:.3f} | 1.00 |")
    for name, seconds, key in (
            ("save, off: loop blocked (= the whole save)", median(sync_blocked), "off"),
            ("save, off, 2 write threads", median(r.blocked_seconds for r in s["threads"]), "threads"),
            ("save, async: background write", median(r.write_seconds for r in s["async"]), "async")):
        print(f"| {name} | {seconds:.3f} | {nbytes / seconds / 1e9:.3f} | {median(ratio[key]):.2f} |")
    print(f"| memory copy of the state, touched buffers | {median(s['copy']):.3f} | "
          f"{nbytes / median(s['copy']) / 1e9:.3f} | {median(s['raw']) / median(s['copy']):.2f} |")
    read = loaded["raw_read"]
    print(f"| raw read, cold cache | {read:.3f} | {nbytes / read / 1e9:.3f} | 1.00 |")
    for name, key in (("load at resume, full verification, cold cache", "load"),
                      ("load, page cache warm, no checksums", "load_warm_unverified"),
                      ("load, page cache warm, full verification", "load_warm_verified"),
                      ("full check alone (verify_checkpoint), warm", "verify_warm")):
        print(f"| {name} | {loaded[key]:.3f} | {nbytes / loaded[key] / 1e9:.3f} | {read / loaded[key]:.2f} |")
    print()
    print(f"loop blocked per save: off {median(sync_blocked):.2f} s; async {median(steady):.2f} s "
          f"({100 * blocked_ratio:.1f}% of off), its first save {async_blocked[0]:.2f} s (its host buffers made)")
    print(f"verification, page cache warm: {loaded['verify_warm'] / nbytes * 1e9:.3f} s/GB alone; "
          f"{(loaded['load_warm_verified'] - loaded['load_warm_unverified']) / nbytes * 1e9:.3f} s/GB added to a load")
    print("where a synchronous save's time goes: " + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
          + "; the first save profiled: " + ", ".join(f"{k} {v:.2f} s" for k, v in save_parts.items()))
    print(f"where the cold load's time goes (profiled, {loaded['load']:.2f} s): "
          + ", ".join(f"{k} {v:.2f} s" for k, v in load_parts.items()))
    print()
    print("| ranks | per-rank load, full verification, warm (median over ranks) | slowest rank | bytes checked per "
          "rank | shard per rank |")
    print("|---|---|---|---|---|")
    for world, per in ranks.items():
        times = [r["seconds"] for r in per.values()]
        print(f"| {world} | {median(times):.3f} s | {max(times):.3f} s | "
              f"{gb(median(r['hashed_bytes'] for r in per.values()))} | "
              f"{gb(median(r['shard_bytes'] for r in per.values()))} |")
    print("JSON " + json.dumps({
        "parameters": n_params, "bytes": nbytes, "raw_write_seconds": s["raw"], "raw_read_seconds": read,
        "sync_blocked_seconds": sync_blocked, "async_blocked_seconds": async_blocked,
        "async_write_seconds": [r.write_seconds for r in s["async"]],
        "threads_blocked_seconds": [r.blocked_seconds for r in s["threads"]], "memory_copy_seconds": s["copy"],
        "sync_vs_raw_write": ratio["off"], "threads_vs_raw_write": ratio["threads"],
        "async_vs_raw_write": ratio["async"], "sync_phases": phases, "sync_profile": save_parts,
        "blocked_ratio": blocked_ratio, **{k: v for k, v in loaded.items() if k != "raw_read"},
        "load_vs_raw_read": read / loaded["load"], "load_profile": load_parts,
        "verify_seconds_per_gb": loaded["verify_warm"] / nbytes * 1e9,
        "per_rank": {str(w): per for w, per in ranks.items()}}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
