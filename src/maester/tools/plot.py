"""Loss curve of a job as a PNG."""

from __future__ import annotations

from pathlib import Path

from maester.files import AtomicOutputs
from maester.train.metrics_file import read_metrics


def plot_loss(job_dir: Path, out: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics_file = job_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{metrics_file} does not exist: has the job logged a step yet?")
    records = [r for r in read_metrics(metrics_file) if r.get("loss") is not None]
    if not records:
        raise ValueError(f"{metrics_file} holds no logged loss")
    out = out or job_dir / "loss.png"
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{job_dir.name}: training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with AtomicOutputs() as outputs:  # a reader never sees half a PNG
        fig.savefig(outputs.temp_for(out), format="png")
    plt.close(fig)
    return out
