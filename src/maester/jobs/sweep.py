"""Sweeps: one job directory per point of a parameter grid, submitted, watched, cancelled, retried and
reported from one command.

A sweep file (TOML/YAML/JSON):

    name = "lr"                            # the points go to <dump_dir>/lr/p000, p001, ...
    base = "demo.toml"                     # the base config, relative to the sweep file
    mode = "product"                       # every combination, or "zip" (the i-th value of each list)
    [fixed]                                # overrides of every point
    "training.steps" = 200
    [parameters]                           # a list, {linspace = [lo, hi, n]} or {logspace = [lo_exp, hi_exp, n]}
    "optimizer.lr" = { logspace = [-4, -2, 3] }
    "model.overrides.n_layers" = [2, 4]

`<dump_dir>/<name>/sweep.json` records the points (job name and parameter values), so `status`, `cancel`,
`retry` and `report` need only that directory.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

from maester.config import ConfigError, load_config
from maester.config.job import check_name
from maester.config.sources import read_config_file
from maester.files import AtomicOutputs
from maester.jobs.job_dir import write_job_dir
from maester.jobs.slurm import (ACTIVE_STATES, SubmitError, cancel_jobs, check_inputs, recorded_jobs, slurm_state,
                                submit_job, training_jobs)
from maester.progress import progress_bar

SWEEP_FILE = "sweep.json"
FAILED_STATES = {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                 "PREEMPTED"}
_KEYS = {"name", "base", "mode", "fixed", "parameters", "dump_dir"}


def _values(key: str, spec: Any, where: str) -> list:
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where}: parameters.{key} is an empty list")
        return spec
    if isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in ("linspace", "logspace"):
        kind, args = next(iter(spec.items()))
        if not (isinstance(args, list) and len(args) == 3 and isinstance(args[2], int) and args[2] >= 1):
            raise ConfigError(f"{where}: parameters.{key}.{kind} must be [start, stop, count]")
        lo, hi, n = args
        points = [lo + (hi - lo) * i / (n - 1) for i in range(n)] if n > 1 else [lo]
        return [10 ** p for p in points] if kind == "logspace" else points
    raise ConfigError(f"{where}: parameters.{key} must be a list, {{linspace = [lo, hi, n]}} or "
                      f"{{logspace = [lo_exp, hi_exp, n]}}")


def _format(value: Any) -> str:
    if isinstance(value, float):
        return repr(float(f"{value:.6g}"))
    return value if isinstance(value, str) else json.dumps(value)


def expand(sweep_path: Path) -> tuple[dict, list[dict]]:
    """(the sweep file, its points): each point is {"name", "params": {key: value}, "overrides": [...]}."""
    spec = read_config_file(sweep_path)
    where = str(sweep_path)
    unknown = set(spec) - _KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown keys {', '.join(sorted(unknown))} (allowed: {', '.join(sorted(_KEYS))})")
    for key in ("name", "base", "parameters"):
        if key not in spec:
            raise ConfigError(f"{where}: `{key}` is required")
    try:
        check_name(spec["name"], "name")
    except ValueError as e:
        raise ConfigError(f"{where}: {e} (it names the sweep's directory)") from None
    if not isinstance(spec["base"], str) or not spec["base"]:
        raise ConfigError(f"{where}: base {spec['base']!r} must be the path of the base config (a string)")
    if "dump_dir" in spec and (not isinstance(spec["dump_dir"], str) or not spec["dump_dir"]):
        raise ConfigError(f"{where}: dump_dir {spec['dump_dir']!r} must be a directory path (a string)")
    for key in ("parameters", "fixed"):
        if not isinstance(spec.get(key, {}), dict):
            raise ConfigError(f"{where}: {key} must be a table of config keys, got {spec[key]!r}")
    mode = spec.get("mode", "product")
    if mode not in ("product", "zip"):
        raise ConfigError(f"{where}: mode {mode!r} is not 'product' or 'zip'")
    params = {key: _values(key, value, where) for key, value in spec["parameters"].items()}
    if not params:
        raise ConfigError(f"{where}: parameters is empty")
    if mode == "zip":
        lengths = {len(v) for v in params.values()}
        if len(lengths) > 1:
            raise ConfigError(f"{where}: mode 'zip' needs lists of one length, got "
                              f"{', '.join(f'{k}: {len(v)}' for k, v in params.items())}")
        combos = list(zip(*params.values()))
    else:
        combos = list(itertools.product(*params.values()))
    fixed = [f"--{k}={_format(v)}" for k, v in spec.get("fixed", {}).items()]
    points = []
    for i, combo in enumerate(combos):
        values = dict(zip(params, combo))
        overrides = fixed + [f"--{k}={_format(v)}" for k, v in values.items()]
        points.append({"name": f"p{i:03d}", "params": values, "overrides": overrides})
    return spec, points


def sweep_dir_of(spec: dict, sweep_path: Path, extra: list[str]) -> Path:
    base = load_config(sweep_path.parent / spec["base"], extra)
    return Path(spec.get("dump_dir", base.job.dump_dir)) / spec["name"]


def submit_sweep(sweep_path: Path, extra: list[str], no_submit: bool = False) -> Path:
    """Write every point's job directory (all validated first) and submit each; returns the sweep directory."""
    spec, points = expand(sweep_path)
    root = sweep_dir_of(spec, sweep_path, extra)
    if (root / SWEEP_FILE).exists():
        raise SubmitError(f"{root / SWEEP_FILE} exists: this sweep was submitted already (use `maester sweep "
                          f"retry {root}`, or another name)")
    base = sweep_path.parent / spec["base"]
    configs = []
    for p in progress_bar("sweep check", points, unit=" points"):
        cfg = load_config(base, [*p["overrides"], *extra, f"--job.dump_dir={root}", f"--job.name={p['name']}"])
        problems = check_inputs(cfg)
        if problems:
            raise SubmitError(f"point {p['name']} would fail: " + "; ".join(problems))
        configs.append(cfg)
    root.mkdir(parents=True, exist_ok=True)
    record = {"name": spec["name"], "sweep_file": str(sweep_path.resolve()), "base": str(base.resolve()),
              "mode": spec.get("mode", "product"), "points": [{"name": p["name"], "params": p["params"]}
                                                              for p in points]}
    with AtomicOutputs() as outputs:
        outputs.temp_for(root / SWEEP_FILE).write_text(json.dumps(record, indent=2) + "\n")
    for cfg in progress_bar("sweep submit", configs, unit=" jobs"):
        job_dir = write_job_dir(cfg)
        if not no_submit:
            submit_job(job_dir)
    return root


def load_sweep(root: Path) -> dict:
    file = Path(root) / SWEEP_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist: not a sweep directory (made by `maester sweep submit`)")
    return json.loads(file.read_text())


def point_status(root: Path, point: dict) -> dict:
    from maester.train.metrics import read_metrics

    job_dir = Path(root) / point["name"]
    jobs = training_jobs(recorded_jobs(job_dir))
    job_id = jobs[-1]["job_id"] if jobs else None
    state = slurm_state(job_id) if job_id else "NOT SUBMITTED"
    if (job_dir / "COMPLETED").exists():
        state = "COMPLETED" if state in ("UNKNOWN", "COMPLETED", "NOT SUBMITTED") else state
    metrics = job_dir / "metrics.jsonl"
    records = [r for r in read_metrics(metrics) if r.get("loss") is not None] if metrics.is_file() else []
    return {"job": point["name"], "job_id": job_id, "state": state, "params": point["params"],
            "step": records[-1]["step"] if records else None, "loss": records[-1]["loss"] if records else None,
            "submissions": len(jobs)}


def status(root: Path) -> list[dict]:
    sweep = load_sweep(root)
    return [point_status(root, p) for p in sweep["points"]]


def format_status(rows: list[dict]) -> str:
    keys = list(rows[0]["params"]) if rows else []
    header = ["job", "slurm id", "state", *keys, "step", "loss"]
    lines = [header] + [[r["job"], r["job_id"] or "-", r["state"], *(_format(r["params"][k]) for k in keys),
                         "-" if r["step"] is None else str(r["step"]),
                         "-" if r["loss"] is None else f"{r['loss']:.4f}"] for r in rows]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def cancel(root: Path) -> list[str]:
    """scancel every point's latest job that is still queued or running; returns the ids cancelled."""
    return cancel_jobs([r["job_id"] for r in status(root) if r["job_id"] and r["state"] in ACTIVE_STATES])


def retry(root: Path) -> list[str]:
    """Submit again the points whose latest job failed or was cancelled (they resume from their checkpoints);
    returns their names."""
    names = []
    for r in status(root):
        if r["state"] in FAILED_STATES:
            submit_job(Path(root) / r["job"])
            names.append(r["job"])
    return names


def run_here(root: Path) -> list[str]:
    """Train the points that have not completed, one after another in this machine (no SLURM), each with
    `maester train` in its own process, its output in <point>/logs/local.out|err; returns the names trained."""
    names = []
    todo = [p for p in load_sweep(root)["points"] if not (Path(root) / p["name"] / "COMPLETED").exists()]
    bar = progress_bar("sweep run", todo, unit=" points")
    for point in bar:
        job_dir = Path(root) / point["name"]
        (job_dir / "logs").mkdir(parents=True, exist_ok=True)
        bar.write(f"{point['name']}: {' '.join(f'{k}={_format(v)}' for k, v in point['params'].items())}",
                  file=sys.stdout)
        # appended: the logs of an earlier failed attempt stay, the reason it failed among them
        with open(job_dir / "logs" / "local.out", "a") as out, open(job_dir / "logs" / "local.err", "a") as err:
            code = subprocess.run([sys.executable, "-m", "maester", "train", str(job_dir)], stdout=out,
                                  stderr=err).returncode
        if code != 0:
            raise SubmitError(f"point {point['name']} failed (exit code {code}): see {job_dir}/logs/local.err")
        names.append(point["name"])
    return names


def transfer_plot(root: Path, rows: list[dict], lr_key: str, width_key: str) -> tuple[Path, dict[str, dict]]:
    """<root>/transfer.png: final loss against LR (log axis), a line per width, a panel per value of the other
    parameters (e.g. μP on and off); each line's best LR is marked. With μP the minima line up across widths.
    Returns the path and {panel: {width: best LR}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(rows[0]["params"]) if rows else []
    for key in (lr_key, width_key):
        if key not in keys:
            raise ValueError(f"--transfer: the sweep has no parameter {key!r} (its parameters: {', '.join(keys)})")
    others = [k for k in keys if k not in (lr_key, width_key)]
    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        panels.setdefault(tuple(r["params"][k] for k in others), []).append(r)
    finite = [r["loss"] for r in rows if r["loss"] is not None and math.isfinite(r["loss"])]
    if not finite:
        raise ValueError(f"--transfer: no point of {root} has logged a finite loss yet")
    ceiling = min(finite) + 1.5 * (sorted(finite)[len(finite) // 2] - min(finite)) + 0.5  # diverged runs: clipped
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), dpi=120, sharey=True, squeeze=False)
    widths = sorted({r["params"][width_key] for r in rows})
    colors = plt.cm.viridis([i / max(1, len(widths) - 1) for i in range(len(widths))])
    best_lrs: dict[str, dict] = {}
    for ax, (values, panel) in zip(axes[0], sorted(panels.items(), key=lambda kv: str(kv[0]))):
        title = ", ".join(f"{k}={_format(v)}" for k, v in zip(others, values)) or "all points"
        for width, color in zip(widths, colors):
            points = sorted((r["params"][lr_key], r["loss"]) for r in panel
                            if r["params"][width_key] == width and r["loss"] is not None)
            if not points:
                continue
            xs = [x for x, _ in points]
            ys = [min(y, ceiling) if math.isfinite(y) else ceiling for _, y in points]
            ax.plot(xs, ys, marker="o", ms=3, color=color, label=f"{width_key.split('.')[-1]} {width}")
            best = min(range(len(ys)), key=ys.__getitem__)
            ax.plot([xs[best]], [ys[best]], marker="*", ms=11, color=color, markeredgecolor="black")
            best_lrs.setdefault(title, {})[width] = xs[best]
        ax.set_xscale("log", base=2)
        ax.set_xlabel(lr_key)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final training loss")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"sweep {load_sweep(root)['name']}: LR transfer across widths (star: best LR of each width)")
    fig.tight_layout()
    path = Path(root) / "transfer.png"
    with AtomicOutputs() as outputs:
        fig.savefig(outputs.temp_for(path), format="png")
    plt.close(fig)
    return path, best_lrs


def parameter_axis(ax, values: list[float]) -> None:
    """A numeric parameter's x axis: a tick at each swept value, labelled compactly (`0.003`, `1e-05`); on a log
    scale when the values are positive and span a factor of 2 or more (LR grids are spaced by factors)."""
    from matplotlib.ticker import NullFormatter, NullLocator

    ticks = sorted(set(values))
    if ticks[0] > 0 and ticks[-1] / ticks[0] >= 2:
        ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{v:.3g}" for v in ticks], rotation=45 if len(ticks) > 4 else 0)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def report(root: Path) -> tuple[Path, Path]:
    """Write <root>/report.csv and <root>/report.png (final loss against each parameter; loss curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from maester.train.metrics import read_metrics

    root = Path(root)
    rows = status(root)
    keys = list(rows[0]["params"]) if rows else []
    csv_path, png_path = root / "report.csv", root / "report.png"
    with AtomicOutputs() as outputs:  # both files appear together, each whole
        with open(outputs.temp_for(csv_path), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["job", "slurm_id", "state", *keys, "last_step", "last_loss"])
            for r in rows:
                writer.writerow([r["job"], r["job_id"] or "", r["state"], *(r["params"][k] for k in keys),
                                 "" if r["step"] is None else r["step"], "" if r["loss"] is None else r["loss"]])
        fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5 * (len(keys) + 1), 4), dpi=110, squeeze=False)
        done = [r for r in rows if r["loss"] is not None]
        for ax, key in zip(axes[0], keys):
            numeric = all(isinstance(r["params"][key], (int, float)) for r in done)
            xs = [r["params"][key] if numeric else str(r["params"][key]) for r in done]
            ax.scatter(xs, [r["loss"] for r in done])
            if numeric and done:
                parameter_axis(ax, xs)
            ax.set_xlabel(key)
            ax.set_ylabel("last logged loss")
            ax.grid(alpha=0.3)
        curves = axes[0][-1]
        for r in rows:
            metrics = root / r["job"] / "metrics.jsonl"
            records = [m for m in read_metrics(metrics) if m.get("loss") is not None] if metrics.is_file() else []
            if records:
                label = r["job"] + ": " + ", ".join(f"{k.rsplit('.', 1)[-1]} {_format(v)}" for k, v in r["params"].items())
                curves.plot([m["step"] for m in records], [m["loss"] for m in records], lw=1.2, label=label)
        curves.set_xlabel("step")
        curves.set_ylabel("training loss")
        if any(math.isfinite(r["loss"]) for r in done):
            curves.legend(fontsize=7)
        curves.grid(alpha=0.3)
        fig.suptitle(f"sweep {load_sweep(root)['name']}")
        fig.tight_layout()
        fig.savefig(outputs.temp_for(png_path), format="png")
    plt.close(fig)
    return csv_path, png_path
