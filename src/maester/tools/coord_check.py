"""μP coordinate check: does the size of every activation stay the same as the model gets wider?

For each width the model of the config is built at that width (`model.width`: the heads and FFN scale, the head
dim stays) and trained a few steps at a large LR, with the config's optimizer and μP settings, on one fixed batch.
Before each update (t = 1 is the model at init) the mean |activation| is recorded for the embedding, the attention
and MLP outputs (averaged over layers) and the logits. Under μP the curves are flat in width; in the standard
parametrization they grow with it (microsoft/mup's `coord_check`, Tensor Programs V).
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from maester.config import Config, ModelConfig

log = logging.getLogger("maester")
MODULES = ("embedding", "attention", "mlp", "output")


@dataclass(frozen=True)
class Record:
    width: int
    seed: int
    step: int
    module: str
    mean_abs: float


def fixed_batch(cfg: Config, tokenizer):
    """The first micro-batch the config's data loader yields, used at every step and width."""
    from maester.data.batch import BatchPlan
    from maester.data.loader import build_loader

    t = cfg.training
    batch = BatchPlan(cfg.sequences(t.global_batch_size), cfg.sequences(t.micro_batch_size))
    loader = build_loader(cfg.data, cfg.tokenizer, tokenizer, seed=t.seed, batch=batch)
    try:
        return loader.next_step()[0]
    finally:
        loader.close()


def run_width(cfg: Config, width: int, seed: int, steps: int, batch, vocab: int) -> list[Record]:
    """Train the config's model at `width` for `steps` steps on `batch`, recording activation sizes."""
    from maester.models.build import build_model
    from maester.models.loss import IGNORE_INDEX, cross_entropy_sum
    from maester.train.optim import build_optimizer

    model_cfg = ModelConfig.model_validate({**cfg.model.model_dump(), "width": width})
    model = build_model(model_cfg, vocab, torch.device("cpu"), seed, cfg.mup)
    optimizer = build_optimizer(model, cfg.optimizer, torch.device("cpu"))
    sums: dict[str, list[torch.Tensor]] = {}

    def record(kind):
        def hook(_module, _inputs, output):
            sums.setdefault(kind, []).append(output.detach().abs().mean())
        return hook

    handles = [model.tok_embeddings.register_forward_hook(record("embedding"))]
    for block in model.layers.values():
        handles.append(block.attention.register_forward_hook(record("attention")))
        handles.append(block.feed_forward.register_forward_hook(record("mlp")))
    labels = batch.labels
    n_labels = (labels != IGNORE_INDEX).sum().clamp(min=1)
    out = []
    try:
        for step in range(1, steps + 1):
            sums.clear()
            logits = model(batch.input_ids, batch.position_ids, batch.document_ids)
            sums["output"] = [logits.detach().abs().mean()]
            for kind in MODULES:
                out.append(Record(width, seed, step, kind, float(torch.stack(sums[kind]).mean())))
            loss = cross_entropy_sum(logits, labels) / n_labels
            if not torch.isfinite(loss):
                raise ValueError(f"width {width}: the loss is {loss.item()} at step {step}; lower --lr")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        for h in handles:
            h.remove()
    return out


def coord_check(cfg: Config, widths: list[int], steps: int = 3, seeds: int = 1) -> list[Record]:
    from maester.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(cfg.tokenizer)
    batch = fixed_batch(cfg, tokenizer)
    records = []
    for width in widths:
        for seed in range(seeds):
            records += run_width(cfg, width, cfg.training.seed + seed, steps, batch, tokenizer.vocab_size)
        log.info("coord check: width %d done", width)
    return records


def mean_by(records: list[Record]) -> dict[tuple[int, int, str], float]:
    """(width, step, module) -> mean |activation| over seeds."""
    acc: dict[tuple[int, int, str], list[float]] = {}
    for r in records:
        acc.setdefault((r.width, r.step, r.module), []).append(r.mean_abs)
    return {k: sum(v) / len(v) for k, v in acc.items()}


def spread(records: list[Record], step: int) -> dict[str, float]:
    """Module -> largest over smallest mean |activation| across the widths at `step` (1.0: perfectly flat)."""
    means = mean_by(records)
    out = {}
    for module in MODULES:
        values = [v for (w, s, m), v in means.items() if s == step and m == module]
        out[module] = max(values) / min(values)
    return out


def write_csv(records: list[Record], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["width", "seed", "step", "module", "mean_abs"])
        for r in records:
            writer.writerow([r.width, r.seed, r.step, r.module, f"{r.mean_abs:.6g}"])
    return path


def plot(records: list[Record], path: Path, title: str) -> Path:
    """One panel per step: mean |activation| against width (log-log), a line per module."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    means = mean_by(records)
    steps = sorted({r.step for r in records})
    widths = sorted({r.width for r in records})
    fig, axes = plt.subplots(1, len(steps), figsize=(3.2 * len(steps), 3.2), dpi=120, sharey=True, squeeze=False)
    for ax, step in zip(axes[0], steps):
        for module in MODULES:
            ax.plot(widths, [means[(w, step, module)] for w in widths], marker="o", ms=3, label=module)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"t = {step}")
        ax.set_xlabel("width")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean |activation|")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run(cfg: Config, widths: list[int], steps: int, seeds: int, out: Path) -> tuple[Path, Path, dict[str, float]]:
    """The coordinate check of `cfg` at `widths`: CSV, PNG, and the spread of each module at the last step."""
    if len(widths) < 2 or sorted(set(widths)) != widths:
        raise ValueError(f"--widths must be at least two increasing widths, got {widths}")
    out.mkdir(parents=True, exist_ok=True)
    records = coord_check(cfg, widths, steps, seeds)
    m = cfg.mup
    title = (f"μP (base width {m.base_width})" if m.enabled else "standard parametrization") + \
        f", {cfg.optimizer.name} lr {cfg.optimizer.muon.lr if cfg.optimizer.name == 'muon' else cfg.optimizer.lr:g}"
    return (write_csv(records, out / "coord_check.csv"), plot(records, out / "coord_check.png", title),
            spread(records, steps))
