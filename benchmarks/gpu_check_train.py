"""One training stage of the GPU check, in this process: maester's real Trainer on the GPU process-group backend map
("cpu:gloo,cuda:nccl") with FSDP2 on a one-rank mesh (`parallel.force_fsdp`), so that one GPU runs the code path of
multi-GPU jobs (DeviceMesh on CUDA, FSDP2 mixed precision, DTensor initialisation, DCP on device tensors).

    python benchmarks/gpu_check_train.py CONFIG [overrides...] [--allow-syncs] [--dry-run [--world-size=N]]
                                         [--inject-host-read]
    python benchmarks/gpu_check_train.py --write-data DIR   # the stages' corpora as JSONL (no pyarrow needed)
    python benchmarks/gpu_check_train.py --dry-run-stages FILE  # the dry run of each [{name, args, world}] in FILE
    python benchmarks/gpu_check_train.py --plan-stages FILE     # maester plan's peak of each [{name, args}] in FILE

It counts synchronisations by training step: on CUDA the warnings of `torch.cuda.set_sync_debug_mode("warn")`,
on the CPU the host reads of tensors (`item`, `tolist`, `cpu`, ...: what waits for a GPU), as
tests/train/test_host_reads.py does. Logging and checkpoint steps read on purpose; any synchronisation on another
step after the first fails the stage, unless `--allow-syncs` (the optimizer of `cpu_offload` runs on the host). A
mixture of experts on a device without the grouped-GEMM fast path (A100, MI250X, MI300X without torch's CK path, the
CPU) reads its group sizes on the host by design, once per MoE layer and forward (docs/moe.md): those reads are
allowed, counted apart, and said in the figures.
It prints one line `GPU_CHECK_RESULT {json}` with the figures and exits 1 when the stage fails.

`--dry-run` does everything up to the first use of the device: the config and its layout, the tokenizer, the
data's first step and the model on the meta device. `--inject-host-read` reads the loss on every step (a test's
proof that the sync count can fail).
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import traceback
import warnings

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

RESULT = "GPU_CHECK_RESULT"
PEAKS = "GPU_CHECK_PEAKS"
MOE_READ_SITE = os.path.join("models", "moe.py")
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write-data"]:
        write_data(argv[1])
        return 0
    if argv[:1] == ["--dry-run-stages"]:
        return dry_run_stages(argv[1])
    if argv[:1] == ["--plan-stages"]:
        return plan_stages(argv[1])
    flags = {a for a in argv if a in ("--dry-run", "--inject-host-read", "--allow-syncs")}
    world = [int(a.split("=", 1)[1]) for a in argv if a.startswith("--world-size=")]
    argv = [a for a in argv if a not in flags and not a.startswith("--world-size=")]
    import torch

    from maester.config import load_config

    cfg = load_config(argv[0], argv[1:], environ={})
    if "--dry-run" in flags:
        return report(dry_run(cfg, world[0] if world else 1))
    return report(train(cfg, inject="--inject-host-read" in flags, allow_syncs="--allow-syncs" in flags,
                        torch=torch))


def plan_stages(path: str) -> int:
    """`maester plan`'s per-rank peak of each stage in FILE on one GPU (fake tensors in a fake process group, on the
    CPU; torch >= 2.15), in one line `GPU_CHECK_PEAKS {"torch": ..., "stages": {name: {args, planned_peak_gib}}}`:
    what the check sets beside torch.cuda.max_memory_allocated (`--prepare` runs it)."""
    import torch

    from maester.config import load_config
    from maester.plan.make import predicted_peak_gib

    stages = {}
    for stage in json.loads(open(path).read()):
        args = [a.replace("{data}", "data") for a in stage["args"]]
        cfg = load_config(args[0], args[1:], environ={})
        stages[stage["name"]] = {"args": stage["args"], "planned_peak_gib": round(predicted_peak_gib(cfg, 1), 3)}
    print(PEAKS, json.dumps({"torch": torch.__version__, "stages": stages}), flush=True)
    return 0


def report(result: dict) -> int:
    print(RESULT, json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


def dry_run_stages(path: str) -> int:
    """The dry run of several stages in this one process (the check's --dry-run: one start-up, not one each);
    a result line per stage, naming it."""
    from maester.config import load_config

    failed = 0
    for stage in json.loads(open(path).read()):
        try:
            cfg = load_config(stage["args"][0], stage["args"][1:], environ={})
            result = dry_run(cfg, stage["world"])
        except Exception as e:  # reported as the stage's failure; the next stage still sets up
            result = {"ok": False, "reason": f"{type(e).__name__}: {e}"}
        failed += not result["ok"]
        print(RESULT, json.dumps({"stage": stage["name"], **result}), flush=True)
    return 1 if failed else 0


def write_data(folder: str) -> None:
    """The built-in corpora as JSONL files in `folder` (`pydoc.jsonl`: text; `pydoc-chat.jsonl`: messages)."""
    from pathlib import Path

    from maester.config import JobConfig, load_config  # noqa: F401  (what every stage imports first: the package is
    # lazy, so name what needs pydantic; a missing package shows here)
    from maester.data.builtin_corpora import pydoc_conversations, pydoc_documents
    from maester.files import write_atomically

    Path(folder).mkdir(parents=True, exist_ok=True)
    for name, lines in (("pydoc", (json.dumps({"text": t}) for t in pydoc_documents())),
                        ("pydoc-chat", (json.dumps({"messages": json.loads(c)}) for c in pydoc_conversations()))):
        path = Path(folder) / f"{name}.jsonl"
        if not path.is_file():
            write_atomically(path, "".join(line + "\n" for line in lines))


def dry_run(cfg, world_size: int) -> dict:
    """The stage's setup without a device: layout, tokenizer, one step of data, the model on meta."""
    import torch

    from maester.data.loader import build_loader
    from maester.data.tokenizers import build_tokenizer
    from maester.models.build import build_on_meta, resolve_args
    from maester.parallel.dims import ParallelDims
    from maester.train.metrics import model_flops_per_token

    dims = ParallelDims.from_config(cfg, world_size)
    tokenizer = build_tokenizer(cfg.tokenizer)
    args = resolve_args(cfg.model, tokenizer.vocab_size, cfg.mup)
    model = build_on_meta(cfg.model, args, torch.bfloat16)
    loader = build_loader(cfg.data, cfg.tokenizer, tokenizer, seed=cfg.training.seed,
                          batch=dims.batch_plan(cfg, dp_rank=0), group=None)
    try:
        batches = loader.next_step()
    finally:
        loader.close()
    return {"ok": True, "dry_run": True, "parameters": sum(p.numel() for p in model.parameters()),
            "flops_per_token": model_flops_per_token(model, cfg.data.seq_len),
            "micro_batches": len(batches), "tokens_per_micro_batch": int(batches[0].num_tokens)}


def train(cfg, inject: bool, allow_syncs: bool, torch) -> dict:
    import torch.distributed as dist

    from maester.train.trainer import Trainer

    if not cfg.parallel.force_fsdp:
        raise SystemExit("gpu_check_train.py runs FSDP on one rank: pass --parallel.force_fsdp=true")
    start = time.monotonic()
    trainer = Trainer(cfg, cfg.job_dir)
    cuda = trainer.device.type == "cuda"
    backend = str(dist.get_backend())
    for t in [torch.ones(3, dtype=torch.float64)] + ([torch.ones(3, device=trainer.device)] if cuda else []):
        dist.all_reduce(t)  # a host tensor goes to gloo, a device tensor to NCCL/RCCL
    if inject:
        forward_backward = trainer._forward_backward

        def reading(*args, **kwargs):
            loss = forward_backward(*args, **kwargs)
            loss.detach().float().item()
            return loss

        trainer._forward_backward = reading
    syncs: collections.Counter = collections.Counter()
    where: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with count_syncs(trainer, syncs, where, cuda, torch):
        t0 = time.monotonic()
        result = trainer.train()
        train_seconds = time.monotonic() - t0
    total, interval = cfg.training.steps, cfg.checkpoint.interval
    reading_steps = {1, total} | ({s for s in range(interval, total + 1, interval)} if interval else set())
    moe_reads = expert_loop_reads(trainer, syncs, where, reading_steps)
    unexpected = {s: n for s, n in sorted(syncs.items()) if s not in reading_steps and s > 0}
    last = last_metrics(cfg.job_dir)
    figures = {
        "backend": backend, "model_type": type(trainer.model).__name__,
        "parameter_type": type(next(trainer.model.parameters())).__name__, "step": result.step,
        "loss": result.loss, "tokens_per_second": last.get("tokens_per_second"), "mfu": last.get("mfu"),
        "mfu_nominal": True, "peak_memory_gib": last.get("peak_memory_gib"),
        "syncs_by_step": {str(s): n for s, n in sorted(syncs.items())},
        "syncs_per_step": round(sum(unexpected.values()) / max(total - len(reading_steps), 1), 2),
        "sync_counter": "cuda sync debug mode" if cuda else "host reads of tensors",
        "train_seconds": round(train_seconds, 1), "seconds": round(time.monotonic() - start, 1),
    }
    if cuda:
        figures["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        figures["max_memory_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
    figures.update(moe_reads)
    problems = []
    if unexpected and not allow_syncs:
        first = min(unexpected)
        problems.append(f"synchronisations on steps that do not log or save: {unexpected}; at step {first}: "
                        f"{sorted(where[first])[:5]}")
    if result.loss is None or not (result.loss == result.loss) or result.step != total:
        problems.append(f"trained to step {result.step} of {total} with loss {result.loss}")
    if figures["model_type"].startswith("FSDP") is False:
        problems.append(f"the model is {figures['model_type']}, not FSDP-wrapped")
    dist.destroy_process_group()
    return {"ok": not problems, "reason": "; ".join(problems), "figures": figures}


def expert_loop_reads(trainer, syncs, where, reading_steps: set) -> dict:
    """Where the experts run as a loop (no grouped-GEMM fast path on this device: `moe.grouped_mm_supported`), the
    loop's documented host reads of the group sizes, at most one per MoE layer and forward (activation
    checkpointing runs a forward again) of each micro-batch: taken out of `syncs` on the steps between logging
    steps, and described for the figures. {} for a dense model or the fast path."""
    from maester.models.moe import _fast_path_on, moe_layers

    layers = len(moe_layers(trainer.model))
    if not layers or (trainer.device.type == "cuda" and _fast_path_on(trainer.device)):
        return {}
    micro_batches = trainer.loader.batch.accumulation_steps
    bound = 2 * layers * micro_batches
    per_step = {}
    for step in [s for s in syncs if s not in reading_steps and s > 0]:
        reads = min(sum(n for site, n in where[step].items() if MOE_READ_SITE in site), bound)
        per_step[step] = reads
        syncs[step] -= reads
        if not syncs[step]:
            del syncs[step]
    return {"expert_loop": f"no grouped-GEMM fast path on {trainer.device.type}: the experts run as a loop that "
                           f"reads its group sizes on the host, once per MoE layer and forward (docs/moe.md); up to "
                           f"{bound} such reads a step allowed ({layers} MoE layers x {micro_batches} micro-batches "
                           f"x 2 with recomputation)",
            "expert_loop_reads_by_step": {str(s): n for s, n in sorted(per_step.items())}}


class count_syncs:
    """Counts what waits for the device, by `trainer.step`, while the block runs."""

    def __init__(self, trainer, syncs, where, cuda: bool, torch):
        self.trainer, self.syncs, self.where, self.cuda, self.torch = trainer, syncs, where, cuda, torch
        self.restore: list = []

    def __enter__(self):
        if self.cuda:
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message).lower():
                    self._count(f"{filename}:{lineno}")
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            self.restore.append(lambda: setattr(warnings, "showwarning", shown))
            filters = warnings.filters[:]
            warnings.simplefilter("always")
            self.restore.append(lambda: warnings.filters.__setitem__(slice(None), filters))
            self.torch.cuda.set_sync_debug_mode("warn")
            self.restore.append(lambda: self.torch.cuda.set_sync_debug_mode("default"))
        else:
            for name in HOST_READS:
                original = getattr(self.torch.Tensor, name)
                setattr(self.torch.Tensor, name, self._counted(name, original))
                self.restore.append(lambda name=name, original=original: setattr(self.torch.Tensor, name, original))
        return self

    def _counted(self, name, original):
        import maester

        package = os.path.dirname(maester.__file__) + os.sep
        data = os.path.join(package, "data") + os.sep

        def counted(tensor, *args, **kwargs):
            stack = traceback.extract_stack()[:-1]
            frames = [f for f in stack if f.filename.startswith(package)]
            optimizer_step_count = "/torch/optim/" in stack[-1].filename and tensor.dim() == 0
            if frames and not frames[-1].filename.startswith(data) and not optimizer_step_count:
                self._count(f"{name} at {frames[-1].filename[len(package):]}:{frames[-1].lineno}")
            return original(tensor, *args, **kwargs)
        return counted

    def _count(self, site: str) -> None:
        self.syncs[self.trainer.step] += 1
        self.where[self.trainer.step][site] += 1

    def __exit__(self, *exc):
        for undo in reversed(self.restore):
            undo()
        return False


def last_metrics(job_dir) -> dict:
    path = job_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    steps = [r for r in records if "tokens_per_second" in r]
    return steps[-1] if steps else {}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
