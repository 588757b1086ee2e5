"""What `checkpoint.verify = "full"` costs: the XXH3-128 of every file of a real checkpoint, per GB, against the size
check and against the resume's own read of the checkpoint (`Checkpointer.load`, without and with its checksums in
the same pass), in one process.

    uv run python benchmarks/checkpoint_verify.py              # a checkpoint of about 1 GB, median of 3
    uv run python benchmarks/checkpoint_verify.py --gb 4       # larger
    uv run python benchmarks/checkpoint_verify.py --smoke      # a few MB (run by the tests)

It builds a Llama whose weights and AdamW moments (float32) come to about `--gb`, takes one optimizer step so that
the moments exist, saves it with `Checkpointer.save` (which writes the manifest), then times, `--repeats` times in
turn: `verify_checkpoint(..., "size")`, `verify_checkpoint(..., "full")` and a `continue` load into the same model
and optimizer, without and with `verify=True`. The files were just written, so the page cache holds them ("warm"): the figures are the CPU cost.
As root, `--cold` also drops the page cache before each timing (then the disk's speed is in every figure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def build(gb: float):
    import torch

    from maester.config import load_config
    from maester.models.build import build_model

    # a checkpoint holds each float32 parameter three times (weight, exp_avg, exp_avg_sq): 12 bytes
    params = gb * 1e9 / 12
    dim = 512 if gb >= 0.1 else 128
    layers = max(1, round(params / (12 * dim * dim)))
    cfg = load_config(None, ["--model.flavor=tiny", f'--model.overrides={{"dim": {dim}, "n_heads": 8, '
                             f'"n_kv_heads": 8, "ffn_hidden_dim": {4 * dim}, "n_layers": {layers}}}'], environ={})
    model = build_model(cfg.model, 256, torch.device("cpu"), 0, cfg.mup)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return cfg, model, optimizer


def drop_caches() -> None:
    import os

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size to build, in GB (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timings of each (median; default 3)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each timing (needs root)")
    parser.add_argument("--smoke", action="store_true", help="a checkpoint of a few MB, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.gb, args.repeats = 0.005, 1

    from maester.train.checkpoint import Checkpointer
    from maester.train.checkpoint_files import verify_checkpoint

    cfg, model, optimizer = build(args.gb)
    with tempfile.TemporaryDirectory() as tmp:
        checkpointer = Checkpointer(Path(tmp), cfg.checkpoint)
        path = checkpointer.save(1, model, optimizer, {"tokens_seen": 0, "data": {}}, cfg.to_json())
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e9
        work = {"size check": lambda: verify_checkpoint(path, "size"),
                "full check (XXH3-128)": lambda: verify_checkpoint(path, "full"),
                "resume load": lambda: checkpointer.load(path, model, optimizer, "continue"),
                "resume load, checksums in the pass": lambda: checkpointer.load(path, model, optimizer, "continue",
                                                                               verify=True)}
        timings: dict[str, list[float]] = {name: [] for name in work}
        for _ in range(args.repeats):
            for name, run in work.items():
                if args.cold:
                    drop_caches()
                start = time.perf_counter()
                result = run()
                timings[name].append(time.perf_counter() - start)
                if not name.startswith("resume load") and result:
                    raise RuntimeError(f"the fresh checkpoint fails its check: {result}")
    median = {k: statistics.median(v) for k, v in timings.items()}
    cache = "cold" if args.cold else "warm"
    print(f"checkpoint of {size:.3f} GB ({sum(p.numel() for p in model.parameters()):,} float32 parameters with "
          f"AdamW moments), page cache {cache}, median of {args.repeats}")
    print("| check | seconds | seconds per GB | vs the resume's load |")
    print("|---|---|---|---|")
    for name, seconds in median.items():
        print(f"| {name} | {seconds:.3f} | {seconds / size:.3f} | {seconds / median['resume load']:.2f}x |")
    print(json.dumps({"gb": round(size, 4), "cache": cache, "repeats": args.repeats,
                      **{f"{k} s/GB": round(v / size, 4) for k, v in median.items()}}))


if __name__ == "__main__":
    main()
