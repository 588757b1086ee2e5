"""Throughput, model FLOPs utilisation (MFU) and the writer of the metrics: console, metrics.jsonl and the sinks
(TensorBoard, W&B) of `maester.train.sinks`.

MFU follows PaLM (Chowdhery et al. 2022, appendix B):

    MFU = tokens_per_second_per_device * (6 * N + 12 * H * Q * sum over layers of min(W, T)) / peak_flops_per_device

N counts the parameters that take part in a token's matrix multiplies: every parameter except the
input-embedding table, whose lookup is not a matmul, and, in a mixture of experts, the routed experts a token
does not go through (top_k of n_experts are active); a tied embedding is counted once, because it is the output
head. H is
the number of attention heads, Q the head dimension, T the sequence length and W a layer's sliding window
(T for a global layer), so a model without windows gets the usual 12 * L * H * Q * T. Causal sparsity is not
discounted and recomputation (activation checkpointing) is not counted.

It is nominal, as torchtitan's and OLMo-core's (`num_flops_per_token(seq_len)`, "idealized"): T is
`data.seq_len` whatever the batch holds. Where documents are masked apart (packed SFT, document masking) a token
attends within its document only and the kernels do 12 * H * Q * sum(d^2) / T per layer and token for documents
of length d, so MFU then overstates the work done by the attention term's share (docs/observability.md, MFU).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from maester.files import write_atomically
from maester.train.metrics_file import EVENTS, METRICS, check_event, check_row, checked
from maester.train.metrics_file import read_metrics  # noqa: F401 (the reader, without torch; importable here too)
from maester.models.loss import IGNORE_INDEX
from maester.models.moe import moe_layers
from maester.train.sinks import Sink, open_sinks, scalars

log = logging.getLogger("maester")

# Dense (non-sparse) BF16 peak FLOP/s per device, one GCD for MI250X/MI250. The longest key contained in the device
# name wins ("H200 NVL" over "H200", "GB200" over "B200"). Figures from the vendors' datasheets (sparse figures
# halved): NVIDIA H100, H200, GH200 Grace Hopper, HGX B200 and GB200 NVL72 datasheets; AMD Instinct MI210, MI250,
# MI250X, MI300A, MI300X, MI325X and MI355X datasheets; the Blackwell figures agree with torchtitan's get_peak_flops.
PEAK_FLOPS: list[tuple[str, float]] = [
    ("H100", 989e12),  # SXM
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H200", 989e12),  # SXM
    ("H200 NVL", 835e12),
    ("GH200", 989e12),
    ("B200", 2250e12),  # HGX B200: 18 PFLOPS sparse per 8 GPUs
    ("GB200", 2500e12),  # GB200 NVL72: 360 PFLOPS sparse per 72 GPUs
    ("B300", 2250e12),
    ("GB300", 2500e12),
    ("A100", 312e12),
    ("MI210", 181e12),
    ("MI250", 181e12),  # per GCD
    ("MI250X", 191.5e12),  # per GCD
    ("MI300A", 980.6e12),
    ("MI300X", 1307.4e12),
    ("MI325X", 1307.4e12),
    ("MI355X", 2500e12),
]

# Memory per device in GiB, for the same keys (one GCD for MI250X/MI250), from the same datasheets: their "GB" of HBM
# are GiB (torch reports a little less as usable, e.g. 79.2 of an 80 GB H100). A100: the 80 GB model.
DEVICE_MEMORY_GIB: dict[str, float] = {
    "H100": 80, "H100 NVL": 94, "H100 PCIe": 80, "H200": 141, "H200 NVL": 141, "GH200": 96, "B200": 180,
    "GB200": 186, "B300": 288, "GB300": 288, "A100": 80, "MI210": 64, "MI250": 64, "MI250X": 64, "MI300A": 128,
    "MI300X": 192, "MI325X": 256, "MI355X": 288,
}


def gpu_names() -> list[str]:
    """The names `gpu_named` takes: the keys of PEAK_FLOPS in lower case, spaces written as '-'."""
    return [key.lower().replace(" ", "-") for key, _ in PEAK_FLOPS]


def gpu_named(name: str, what: str = "--gpu") -> tuple[str, float, float]:
    """(table key, peak FLOP/s, memory GiB) of a GPU named as `maester plan --gpu` takes it (`gpu_names`, in any
    case); `what` names the setting in the error."""
    keys = dict(zip(gpu_names(), (key for key, _ in PEAK_FLOPS)))
    key = keys.get(name.lower().replace(" ", "-"))
    if key is None:
        raise ValueError(f"{what} {name!r} is not one of {', '.join(keys)}")
    return key, dict(PEAK_FLOPS)[key], DEVICE_MEMORY_GIB[key]


# ROCm architecture (`gcnArchName`) to peak, for devices whose name is empty or unknown (some containers report "").
# gfx90a is MI250X per GCD (MI210/MI250 are 181e12); gfx942 is MI300X/MI325X (MI300A is 980.6e12).
PEAK_FLOPS_BY_ARCH: dict[str, float] = {
    "gfx90a": 191.5e12,
    "gfx942": 1307.4e12,
}


def peak_flops(device_name: str, arch: str = "") -> float | None:
    """Peak of the longest table key in `device_name`, else of the ROCm architecture `arch` (such as
    "gfx90a:sramecc+:xnack-"), else None."""
    matches = [(len(key), flops) for key, flops in PEAK_FLOPS if key in device_name]
    if matches:
        return max(matches)[1]
    return PEAK_FLOPS_BY_ARCH.get(arch.split(":")[0])


def matmul_parameters(model: nn.Module) -> int:
    """Parameters in a token's matmuls: all but an untied input-embedding table, and of a mixture of experts only
    the top_k of n_experts routed experts a token goes through (active parameters)."""
    total = sum(p.numel() for p in model.parameters())
    for layer in moe_layers(model):
        routed = sum(p.numel() for p in layer.experts.parameters())
        total -= routed - routed * layer.moe.top_k // layer.moe.n_experts
    embedding = getattr(model, "tok_embeddings", None)
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    if embedding is not None and not tied:
        total -= embedding.weight.numel()
    return total


def flops_per_token(n_matmul_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int,
                    windows: list[int | None] | None = None) -> int:
    """Training FLOPs (forward and backward) per token: 6N + 12·H·Q·Σ_layers min(W, T); `windows` gives each
    layer's sliding window (None: global), all global when omitted."""
    windows = windows if windows is not None else [None] * n_layers
    attended = sum(seq_len if w is None else min(w, seq_len) for w in windows)
    return 6 * n_matmul_params + 12 * n_heads * head_dim * attended


def model_flops_per_token(model: nn.Module, seq_len: int) -> int:
    args = model.args
    windows = [args.layer_window(i) for i in range(args.n_layers)]
    return flops_per_token(matmul_parameters(model), args.n_layers, args.n_heads, args.resolved_head_dim, seq_len,
                           windows)


def device_peak_flops(device: torch.device) -> float | None:
    """Peak FLOP/s of the device, or None (CPU, or a GPU not in the table: MFU is then not reported, with a
    warning)."""
    if device.type != "cuda":
        log.warning("MFU is not reported on %s: there is no peak-FLOPs figure for it (maester.train.metrics."
                    "PEAK_FLOPS lists GPUs); mfu is null in metrics.jsonl", device.type)
        return None
    name = torch.cuda.get_device_name(device)
    arch = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "") or ""
    peak = peak_flops(name, arch)
    if peak is None:
        log.warning("no peak-FLOPs figure for %r (arch %r): MFU is not reported (add it to PEAK_FLOPS)", name, arch)
    return peak


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or on CPU the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """Writes a run's records: one row per logged step to metrics.jsonl (the training metrics, and the evaluations of
    that step merged in: written when the step ends), events to events.jsonl, console lines, and the numbers to
    the sinks."""

    def __init__(self, job_dir: Path, progress=None, sinks: Sequence[Sink] = ()):
        self.progress = progress
        self.sinks = list(sinks)
        job_dir.mkdir(parents=True, exist_ok=True)
        self._files = {}
        for name in (METRICS, EVENTS):
            _drop_partial_last_line(job_dir / name)
            self._files[name] = open(job_dir / name, "a", buffering=1)
        self._row: dict | None = None  # the logged step's row, until the step ends

    def write(self, record: dict) -> None:
        """The training metrics of a logged step: a new row."""
        self.end_step()
        self._row = dict(record)
        self._show(record, format_console_line(record))

    def write_eval(self, record: dict) -> None:
        line = f"step {record['step']} | val_loss {record['val_loss']:.4f}"
        if record.get("val_perplexity") is not None:
            line += f" | val_perplexity {record['val_perplexity']:.2f}"
        self._merge(record, line)

    def write_downstream(self, record: dict) -> None:
        """The downstream evaluation's record of a step (`eval/<task>/<metric>`, `eval/seconds`)."""
        shown = [f"{k[5:]} {v:.4f}" for k, v in record.items() if k.startswith("eval/") and k != "eval/seconds"]
        self._merge(record, f"step {record['step']} | " + (" | ".join(shown) or "no downstream metric") +
                    f" | {record.get('eval/seconds', 0.0):.1f}s")

    def end_step(self) -> None:
        """Write the row of the step that ends (if it was logged)."""
        if self._row is not None:
            row, self._row = _finite_or_none(self._row), None
            self._files[METRICS].write(json.dumps(checked(row, check_row)) + "\n")

    def write_event(self, record: dict, sink_step: int | None = None) -> None:
        """A line of events.jsonl ({"event": ..., "step": ...}). `sink_step`: the sinks also get the record's
        numbers, at that step (a checkpoint's are known steps after its own, and W&B takes no step twice)."""
        self._files[EVENTS].write(json.dumps(checked(_finite_or_none(record), check_event)) + "\n")
        if sink_step is not None:
            self._to_sinks(record, sink_step)

    def _merge(self, record: dict, line: str) -> None:
        if self._row is None or self._row["step"] != record["step"]:
            raise ValueError(f"step {record['step']}'s evaluation has no training row to join: an evaluation step "
                             f"is a logged step")
        self._row.update(record)
        self._show(record, line)

    def _show(self, record: dict, line: str) -> None:
        self._to_sinks(record, record["step"])
        if self.progress is not None and not self.progress.disable:
            self.progress.write(line)
        else:
            log.info(line)

    def _to_sinks(self, record: dict, step: int) -> None:
        values = scalars(record)
        for sink in self.sinks:
            sink.log(step, values)

    def close(self) -> None:
        """Writes the last row, closes the files and every sink, even when one of them fails."""
        with ExitStack() as stack:
            for f in self._files.values():
                stack.callback(f.close)
            for sink in self.sinks:
                stack.callback(sink.close)
            self.end_step()


def open_metrics(cfg, job_dir: Path, progress=None, resume_step: int = 0) -> MetricsWriter:
    """Rank 0's metrics writer for a run of `cfg` in `job_dir` that starts after step `resume_step`, with the sinks
    `cfg.logging` enables."""
    sinks = open_sinks(cfg, job_dir, resume_step)
    try:
        _drop_lines_after(job_dir / METRICS, resume_step)
        return MetricsWriter(job_dir, progress, sinks)
    except BaseException:
        for sink in sinks:
            sink.close()
        raise


def _drop_lines_after(path: Path, step: int) -> None:
    """Lines of steps after `step`, logged by an earlier attempt that died before its next checkpoint: the run that
    resumes at `step` logs them again, so that every step is in the file once. Replaced atomically."""
    if not path.is_file():
        return
    lines = path.read_bytes().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) is None or _step_of(line) <= step]
    if len(kept) < len(lines):
        write_atomically(path, b"".join(kept))


def _step_of(line: bytes) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _drop_partial_last_line(path: Path) -> None:
    """A process killed mid-write leaves a line without its newline; the resumed run logs that step again."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        with open(path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def _finite_or_none(record: dict) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def format_console_line(r: dict) -> str:
    muon = [v for k, v in r.items() if k.startswith("lr/") and "/muon" in k]  # Muon's matrices: optimizer.muon.lr
    lr = f"lr {r['lr']:.3g}" + (f" (muon {max(muon):.3g})" if muon else "")
    parts = [f"step {r['step']}", f"loss {r['loss']:.4f}", lr, f"grad_norm {r['grad_norm']:.3f}",
             f"tok/s {r['tokens_per_second']:,.0f}"]
    if r.get("mfu") is not None:
        parts.append(f"mfu {100 * r['mfu']:.1f}%")
    if r.get("padding_efficiency", 1.0) < 1.0:
        parts.append(f"pad_eff {100 * r['padding_efficiency']:.1f}%")
    if r.get("skipped_steps"):
        parts.append(f"skipped {r['skipped_steps']}")
    parts.append(f"data {r['data_loading_seconds']:.3f}s")
    parts.append(f"mem {r['peak_memory_gib']:.2f}GiB")
    return " | ".join(parts)


BATCH_STATISTICS = ("labels", "real", "tokens", "documents", "document_tokens", "document_tokens_max")


def batch_statistics(batches, device: torch.device) -> torch.Tensor:
    """Counts of one step's micro-batches, as tensor ops on `device` (no host read): label tokens, tokens that are
    not padding, all tokens, packed documents, their tokens, and the longest of them."""
    out = torch.zeros(len(BATCH_STATISTICS), dtype=torch.float64, device=device)
    for b in batches:
        out[0] += (b.labels != IGNORE_INDEX).sum()
        out[1] += (b.document_ids >= 0).sum() if b.document_ids is not None else b.input_ids.numel()
        out[2] += b.input_ids.numel()
        if b.document_lengths is not None and len(b.document_lengths):
            out[3] += len(b.document_lengths)
            out[4] += b.document_lengths.sum()
            out[5] = torch.maximum(out[5], b.document_lengths.max())
    return out


class MetricsWindow:
    """What the steps since the last logged one add up to: tokens, seconds spent waiting for data, and the batch
    statistics (a tensor on the device, read on logging steps only)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.tokens, self.data_seconds, self.steps = 0, 0.0, 0
        self.start = time.perf_counter()
        self.batches = torch.zeros(len(BATCH_STATISTICS), dtype=torch.float64, device=self.device)

    def add_batches(self, stats: torch.Tensor) -> None:
        self.batches[:-1] += stats[:-1]
        self.batches[-1] = torch.maximum(self.batches[-1], stats[-1])

    def exclude(self, seconds: float) -> None:
        """Time spent on something other than the steps (evaluation): the window's throughput leaves it out."""
        self.start += seconds

    def add_step(self, tokens: int) -> None:
        self.tokens += tokens
        self.steps += 1

    def throughput(self) -> tuple[float, float]:
        """(seconds since the window began, tokens per second over all ranks)."""
        elapsed = time.perf_counter() - self.start
        return elapsed, self.tokens / elapsed

    def batch_metrics(self, dp_group) -> dict:
        """Label tokens per step, padding efficiency and document (conversation) lengths over the window, summed
        over the data-parallel ranks (a collective when `dp_group` is set)."""
        import torch.distributed as dist

        totals = self.batches
        if dp_group is not None:
            maxima = totals[-1:].clone()
            dist.all_reduce(totals, group=dp_group)
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=dp_group)
            totals[-1:] = maxima
        t = dict(zip(BATCH_STATISTICS, totals.tolist()))
        out = {"label_tokens_per_step": t["labels"] / max(self.steps, 1),
               "padding_efficiency": t["real"] / max(t["tokens"], 1)}
        if t["documents"]:
            out.update({"documents_per_step": t["documents"] / max(self.steps, 1),
                        "document_tokens_mean": t["document_tokens"] / t["documents"],
                        "document_tokens_max": int(t["document_tokens_max"])})
        return out

