"""`maester report JOB`: a one-page PNG dashboard of a job's metrics and a short text summary.

Everything comes from the job directory: `config.json` (model, training.steps), `metrics.jsonl` (a row per logged
step: training and evaluation), `events.jsonl` (the checkpoint saves; a running job's half-written last line is
ignored in both), the
`COMPLETED` and `requeue-requested`
markers (the status), `checkpoints/latest` and `slurm_jobs.jsonl` (the restarts after failures). Nothing is
written into the job directory except the PNG and the summary beside it, so a report can be drawn while the job
trains.

The "recent window" is the last `RECENT` logged training steps, leaving out the first logged step (its time
includes start-up); throughput, MFU, data-loading share, the smoothed loss and the pace of the ETA are taken
over it.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from maester.config import Config
from maester.durations import format_duration
from maester.jobs.slurm import describe_restarts, recorded_jobs
from maester.plan.record import compared_with_plan
from maester.train.checkpoint_dirs import newest_complete
from maester.train.metrics_file import read_events, read_metrics
from maester.train.preemption import COMPLETED_FILE, REQUEUE_FILE, read_marker

RECENT = 5
"""Logged training steps in the recent window."""
LOG_SCALE_SPAN = 100.0
"""Grad norm is drawn on a log axis when its largest value is at least this many times its smallest."""
STATUS_TITLES = {"completed": "completed", "requeue": "stopped for requeue", "running": "in progress or interrupted"}


@dataclass(frozen=True)
class Status:
    kind: str  # a key of STATUS_TITLES; "running" is a job without a marker: in progress, or interrupted
    step: int  # the step the job has reached
    line: str


@dataclass(frozen=True)
class JobReport:
    png: Path
    text: Path
    summary: str


def write_report(job_dir: Path, out: Path | None = None, now: float | None = None) -> JobReport:
    """Draw the dashboard to `out` (default `<job>/report.png`) and write the summary beside it (`.txt`)."""
    from maester.files import AtomicOutputs

    job_dir = Path(job_dir)
    now = time.time() if now is None else now
    cfg, train, evals, downstream = load_job(job_dir)
    status = job_status(job_dir, cfg, train, now)
    summary = format_summary(job_dir, summary_items(job_dir, cfg, train, evals, status, downstream))
    out = Path(out) if out else job_dir / "report.png"
    if out.parent.is_dir() and not os.access(out.parent, os.W_OK):
        why = "Read-only file system" if os.statvfs(out.parent).f_flag & os.ST_RDONLY else "no permission"
        raise ValueError(f"{out.parent} cannot be written ({why}): write the report elsewhere with --out FILE.png")
    text = out.with_suffix(".txt")
    with AtomicOutputs() as outputs:
        draw_dashboard(job_dir, cfg, train, evals, status, outputs.temp_for(out), downstream)
        outputs.temp_for(text).write_text(summary + "\n")
    return JobReport(out, text, summary)


def load_job(job_dir: Path) -> tuple[Config, list[dict], list[dict], list[dict]]:
    """The job's config, its training records, its validation records and its downstream evaluation records
    (`eval/<task>/<metric>`), in step order."""
    config_file = job_dir / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist: {job_dir} is not a job directory")
    metrics_file = job_dir / "metrics.jsonl"
    if not metrics_file.is_file():
        raise FileNotFoundError(f"{metrics_file} does not exist: the job has logged no step yet")
    records = read_metrics(metrics_file)
    train = [r for r in records if "loss" in r]
    if not train:
        raise ValueError(f"{metrics_file} holds no logged training step yet")
    evals = [r for r in records if r.get("val_loss") is not None]
    downstream = [r for r in records if downstream_metrics(r)]
    return Config.from_json_file(config_file), train, evals, downstream


def downstream_metrics(record: dict) -> dict[str, dict[str, float]]:
    """A record's downstream evaluation results by task and metric (`eval/<task>/<metric>`; not `eval/seconds`)."""
    out: dict[str, dict[str, float]] = {}
    for key, value in record.items():
        task, _, metric = key.removeprefix("eval/").rpartition("/")
        if key.startswith("eval/") and task and value is not None:
            out.setdefault(task, {})[metric] = value
    return out


def job_status(job_dir: Path, cfg: Config, train: list[dict], now: float) -> Status:
    """Completed (the COMPLETED marker), stopped for a requeue (requeue-requested), or neither: in progress or
    interrupted, judged by when metrics.jsonl last changed."""
    total = cfg.training.steps
    done = read_marker(job_dir / COMPLETED_FILE)
    if done is not None:
        line = f"completed at step {done['step']}, {_age(done, now)}"
        if done["step"] < total:
            line += f" (training.steps is now {total}: train it again to continue)"
        return Status("completed", done["step"], line)
    requeue = read_marker(job_dir / REQUEUE_FILE)
    if requeue is not None:
        reason = f" ({requeue['reason']})" if requeue.get("reason") else ""
        return Status("requeue", requeue["step"],
                      f"stopped for requeue at step {requeue['step']}{reason}, {_age(requeue, now)}")
    last = train[-1]["step"]
    ago = format_duration(now - (job_dir / "metrics.jsonl").stat().st_mtime, digits=0)
    return Status("running", last, f"in progress or interrupted: last logged step {last}, {ago} ago")


def _age(marker: dict, now: float) -> str:
    return f"{format_duration(now - datetime.fromisoformat(marker['time']).timestamp(), digits=0)} ago"


def recent_window(train: list[dict]) -> list[dict]:
    """The last RECENT training records, without the first logged step unless it is the only one."""
    return (train[1:] if len(train) > 1 else train)[-RECENT:]


def seconds_per_step(train: list[dict]) -> float | None:
    """The pace over the recent window: each logged record covers the tokens since the record before it, at its own
    tokens/s. None when it cannot be told (one logged step, or no throughput)."""
    seconds = steps = 0.0
    for prev, r in list(zip(train, train[1:]))[-RECENT:]:  # the records of recent_window(train), each with its prev
        if r.get("tokens_per_second") and r.get("tokens_seen") is not None and prev.get("tokens_seen") is not None:
            seconds += (r["tokens_seen"] - prev["tokens_seen"]) / r["tokens_per_second"]
            steps += r["step"] - prev["step"]
    return seconds / steps if steps > 0 and seconds > 0 else None


def _steps_span(window: list[dict]) -> str:
    first, last = window[0]["step"], window[-1]["step"]
    return f"step {last}" if first == last else f"steps {first}-{last}"


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if r.get(key) is not None]


def _perplexity(record: dict) -> float:
    # Older jobs logged only val_loss; perplexity is exp(loss) by definition.
    ppl = record.get("val_perplexity")
    return ppl if ppl is not None else math.exp(record["val_loss"])


def _count(n: int) -> str:
    for size, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n:,} ({n / size:.2f} {unit})"
    return f"{n:,}"


def _validation_sources(evals: list[dict]) -> list[str]:
    """The names of the `data.validation` sources the records hold (`val/<name>/loss`), in first-seen order."""
    names: dict[str, None] = {}
    for r in evals:
        names.update({k[4:-5]: None for k in r if k.startswith("val/") and k.endswith("/loss")})
    return list(names)


def summary_items(job_dir: Path, cfg: Config, train: list[dict], evals: list[dict],
                  status: Status, downstream: list[dict] = ()) -> list[tuple[str, str]]:
    """The summary as (label, text) pairs, one line each."""
    total = cfg.training.steps
    window = recent_window(train)
    span = _steps_span(window)
    items = [("status", status.line), ("steps", f"{status.step} of {total} ({100 * status.step / total:.0f}%)")]
    if status.step < total:
        pace = seconds_per_step(train)
        left = total - status.step
        if pace:
            about = format_duration(left * pace, digits=0)
            items.append(("remaining", f"{left} steps, about {about} at {pace:.3g} s/step ({span})"))
        else:
            why = "one logged step" if len(train) == 1 else "no tokens/s logged"
            items.append(("remaining", f"{left} steps (no pace yet: {why})"))

    last = train[-1]
    finite = [r for r in train if r["loss"] is not None]
    if last["loss"] is not None:
        loss = f"{last['loss']:.4f} at step {last['step']}"
    elif finite:
        loss = f"non-finite at step {last['step']}; last finite {finite[-1]['loss']:.4f} at step {finite[-1]['step']}"
    else:
        loss = "non-finite at every logged step"
    recent_losses = _values(window, "loss")
    if recent_losses and len(window) > 1:
        of = f"the {len(recent_losses)} finite of " if len(recent_losses) < len(window) else ""
        loss += f"; mean {statistics.fmean(recent_losses):.4f} over {of}{span}"
    items.append(("loss", loss))

    if evals:
        best = min(evals, key=lambda r: r["val_loss"])
        latest = evals[-1]
        text = f"last {latest['val_loss']:.4f} (ppl {_perplexity(latest):,.2f}) at step {latest['step']}"
        text += (f"; best {best['val_loss']:.4f} (ppl {_perplexity(best):,.2f}) at step {best['step']}"
                 if best is not latest else ", the best")
        items.append(("validation loss", text))
        for name in _validation_sources(evals):
            last = next(r for r in reversed(evals) if r.get(f"val/{name}/loss") is not None)
            items.append((f"  {name}", f"{last[f'val/{name}/loss']:.4f} (ppl "
                                       f"{math.exp(min(last[f'val/{name}/loss'], 700.0)):,.2f}) at step {last['step']}"))

    if downstream:
        items.append(("downstream eval", f"at step {downstream[-1]['step']}"))
        items += [(f"  {task}", ", ".join(f"{metric} {value:.4g}" for metric, value in metrics.items()))
                  for task, metrics in downstream_metrics(downstream[-1]).items()]

    tokens = [r for r in train if r.get("tokens_seen") is not None]
    if tokens:
        items.append(("tokens seen", _count(tokens[-1]["tokens_seen"])))
    tps = _values(window, "tokens_per_second")
    if tps:
        items.append(("tokens/s", f"{statistics.median(tps):,.0f} (median of {span})"))
    mfu = _values(window, "mfu")
    items.append(("MFU", f"{100 * statistics.median(mfu):.1f}% (median of {span})" if mfu
                  else "not measured (CPU, or a device without a peak-FLOPs figure)"))
    memory = _values(train, "peak_memory_gib")
    if memory:
        items.append(("peak memory", f"{max(memory):.2f} GiB"))
    share = _values(window, "data_loading_share")
    if share:
        items.append(("data loading", f"{100 * statistics.median(share):.1f}% of step time (median of {span})"))
    skipped = _values(train, "skipped_steps")
    if skipped and skipped[-1]:
        items.append(("skipped steps", f"{skipped[-1]} (non-finite loss or gradients)"))

    items += compared_with_plan(job_dir, max(memory) if memory else None,
                                statistics.median(tps) if tps else None)
    restarts = describe_restarts(recorded_jobs(job_dir))
    if restarts:
        items.append(("restarts", f"{len(restarts)} after failures (slurm.max_restarts = {cfg.slurm.max_restarts})"))
        items += [("", line) for line in restarts]

    checkpoint = newest_complete(job_dir / "checkpoints")
    items.append(("checkpoint", os.path.relpath(checkpoint, job_dir) if checkpoint else "none yet"))
    items += checkpoint_save_items(job_dir)
    return items


def checkpoint_save_items(job_dir: Path) -> list[tuple[str, str]]:
    """The saves' lines of the summary, from the `checkpoint` and `checkpoint_failed` events: how many, how long
    the loop was blocked per save and how long the writes took; the newest failure."""
    events = read_events(job_dir)
    saved = [r for r in events if r["event"] == "checkpoint"]
    failed = [r for r in events if r["event"] == "checkpoint_failed"]
    if not saved and not failed:
        return []
    background = sum(1 for r in saved if r.get("background"))
    text = f"{len(saved)} written ({background} in the background)" + (f", {len(failed)} failed" if failed else "")
    items = [("checkpoint saves", text)]
    times = [f"{name} {statistics.median(values):.2f} s median ({max(values):.2f} s max)"
             for name, values in (("loop blocked", _values(saved, "checkpoint_blocked_seconds")),
                                  ("write", _values(saved, "checkpoint_write_seconds"))) if values]
    if times:
        items.append(("save times", "; ".join(times)))
    if failed:
        items.append(("save failure", f"step {failed[-1]['step']}: {failed[-1].get('error')}"))
    return items


def format_summary(job_dir: Path, items: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in items)
    return "\n".join([f"report of {job_dir}"] + [f"  {label:<{width}}  {text}" for label, text in items])


def draw_dashboard(job_dir: Path, cfg: Config, train: list[dict], evals: list[dict], status: Status,
                   out: Path, downstream: list[dict] = ()) -> None:
    """A 2 x 3 grid over steps: loss with validation loss, learning rate, grad norm, tokens/s, MFU, data loading;
    below them a row of the downstream tasks' metrics, where the job has any."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator

    steps = [r["step"] for r in train]
    style = {"lw": 1.4, "marker": "o" if len(train) <= 30 else None, "ms": 3}

    def series(key: str) -> list[float]:
        return [math.nan if r.get(key) is None else r[key] for r in train]  # NaN leaves a gap in the line

    rows = 3 if downstream else 2
    fig, axes = plt.subplots(rows, 3, figsize=(15, 4 * rows), dpi=100, sharex=True)
    (loss_ax, lr_ax, grad_ax), (tps_ax, mfu_ax, data_ax) = axes[:2]
    if downstream:
        _draw_downstream(axes[2], downstream)

    _draw_loss(loss_ax, train, evals, steps, series("loss"), style)

    for label, values in _lr_curves(train).items():
        lr_ax.plot(steps, values, label=label, **style)
    if lr_ax.get_legend_handles_labels()[1] != ["lr"]:
        lr_ax.legend(title="param group", loc="center")  # warmup, decay and floor fill the edges
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    lr_ax.set_title("learning rate")

    grad = series("grad_norm")
    grad_ax.plot(steps, grad, **style)
    finite_grad = [g for g in grad if g > 0]
    if finite_grad and max(finite_grad) >= LOG_SCALE_SPAN * min(finite_grad):
        grad_ax.set_yscale("log")
    if cfg.training.max_grad_norm is not None:
        grad_ax.axhline(cfg.training.max_grad_norm, color="C3", ls="--", lw=1,
                        label=f"clipped above {cfg.training.max_grad_norm:g}")
        grad_ax.legend()
    grad_ax.set_title("grad norm")

    tps_ax.plot(steps, series("tokens_per_second"), **style)
    tps_ax.yaxis.set_major_formatter(EngFormatter())
    tps_ax.set_ylim(bottom=0)
    tps_ax.set_title("tokens / s")

    mfu = [100 * v for v in series("mfu")]
    if all(math.isnan(v) for v in mfu):
        mfu_ax.text(0.5, 0.5, "not measured\n(CPU, or a device without a peak-FLOPs figure)", ha="center",
                    va="center", transform=mfu_ax.transAxes, color="0.4", fontsize=11)
        mfu_ax.set_yticks([])
    else:
        mfu_ax.plot(steps, mfu, **style)
        mfu_ax.set_ylim(bottom=0)
    mfu_ax.set_title("MFU (%)")

    data_ax.plot(steps, [100 * v for v in series("data_loading_share")], **style)
    data_ax.set_ylim(bottom=0)
    data_ax.set_title("data loading (% of step time)")

    for ax in axes.flat:
        if ax.has_data():
            ax.grid(alpha=0.3)
    loss_ax.set_xlim(0, max(steps[-1], status.step) * 1.03)  # shared by all panels: from the start to now
    loss_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for column in axes.T:  # the lowest panel shown in each column labels the steps
        bottom = [ax for ax in column if ax.get_visible()][-1]
        bottom.tick_params(labelbottom=True)
        bottom.set_xlabel("step")
    model = cfg.model.name + (f" {cfg.model.flavor}" if cfg.model.hf_config is None else f" ({cfg.model.hf_config})")
    fig.suptitle(f"{job_dir.name}  ·  {model}  ·  step {status.step} of {cfg.training.steps}  ·  "
                 f"{STATUS_TITLES[status.kind]}", fontsize=14)
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)


def _draw_loss(loss_ax, train: list[dict], evals: list[dict], steps: list[int], loss: list[float], style: dict) -> None:
    """The loss panel: training, validation (overall and per source), and a line at each non-finite step."""
    loss_ax.plot(steps, loss, label="training", **style)
    if evals:
        loss_ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", color="C1", lw=1.4, ms=5,
                     label="validation")
        for i, name in enumerate(_validation_sources(evals)):
            points = [(r["step"], r[f"val/{name}/loss"]) for r in evals if r.get(f"val/{name}/loss") is not None]
            loss_ax.plot(*zip(*points), "s--", color=f"C{i + 4}", lw=1.0, ms=3, label=f"validation: {name}")
    nonfinite = [r["step"] for r in train if r["loss"] is None]
    for i, step in enumerate(nonfinite):
        loss_ax.axvline(step, color="C3", lw=0.8, alpha=0.6, label="non-finite loss" if i == 0 else None)
    if evals or nonfinite:
        loss_ax.legend()
    loss_ax.set_title("loss")


def _draw_downstream(axes, downstream: list[dict]) -> None:
    """One panel per task (the first three; the summary lists them all), a line per metric over the steps."""
    tasks = list(dict.fromkeys(task for r in downstream for task in downstream_metrics(r)))
    for ax, task in zip(axes, tasks):
        metrics = list(dict.fromkeys(m for r in downstream for m in downstream_metrics(r).get(task, {})))
        for metric in metrics:
            points = [(r["step"], downstream_metrics(r)[task][metric]) for r in downstream
                      if metric in downstream_metrics(r).get(task, {})]
            ax.plot(*zip(*points), "o-", lw=1.4, ms=4, label=metric)
        ax.legend()
        ax.set_title(f"eval: {task}" + (f" (+{len(tasks) - 3} more tasks in the summary)"
                                        if ax is axes[-1] and len(tasks) > 3 else ""))
    for ax in axes[len(tasks):]:
        ax.set_visible(False)


def _lr_curves(train: list[dict]) -> dict[str, list[float]]:
    """The learning rate of each parameter group (`lr/<group>`), groups with the same curve drawn once; the base
    `lr` when the job logged no groups."""
    groups = sorted({k.removeprefix("lr/") for r in train for k in r if k.startswith("lr/")})
    if not groups:
        return {"lr": [math.nan if r.get("lr") is None else r["lr"] for r in train]}
    curves: dict[tuple, list[str]] = {}
    for g in groups:
        values = tuple(math.nan if r.get(f"lr/{g}") is None else r[f"lr/{g}"] for r in train)
        curves.setdefault(values, []).append(g)  # math.nan is one object, so equal gaps compare equal
    return {", ".join(names): list(values) for values, names in curves.items()}
