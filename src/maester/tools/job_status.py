"""`maester status JOB` and `maester cancel JOB`: where a job stands (its SLURM jobs and their states, the step,
the loss, the time left, the restarts after failures, the post-processing job) and stopping it."""

from __future__ import annotations

import time
from pathlib import Path

from maester.config import Config
from maester.jobs.job_dir import refuse_checkpoint
from maester.jobs.slurm import (cancel_jobs, describe_restarts, recorded_jobs, slurm_state, training_jobs)
from maester.train.metrics import read_metrics
from maester.tools.report import duration, job_status, seconds_per_step


def job_ids(records: list[dict]) -> list[str]:
    """The job's SLURM job ids, each once, in the order they were first recorded."""
    return list(dict.fromkeys(r["job_id"] for r in records))


def _job_dir(job_dir: Path, command: str) -> Path:
    """`job_dir` as a Path; FileNotFoundError unless it holds a job's config.json, ValueError for a checkpoint."""
    job_dir = Path(job_dir)
    refuse_checkpoint(job_dir, command)
    if not (job_dir / "config.json").is_file():
        raise FileNotFoundError(f"{job_dir / 'config.json'} does not exist: {job_dir} is not a job directory")
    return job_dir


def status_items(job_dir: Path, now: float | None = None) -> list[tuple[str, str]]:
    """(label, text) pairs: SLURM, status, step, loss, remaining, restarts, post-processing."""
    job_dir = _job_dir(job_dir, "status")
    cfg = Config.from_json_file(job_dir / "config.json")
    now = time.time() if now is None else now
    records = recorded_jobs(job_dir)
    training = training_jobs(records)
    links = {r["job_id"]: f" (link {r['link']} of {r['chain']})" for r in training if r.get("chain", 1) > 1}
    items = [("slurm", ", ".join(f"{j} {slurm_state(j)}{links.get(j, '')}" for j in job_ids(training))
              or "not submitted (no slurm_jobs.jsonl)")]
    metrics = job_dir / "metrics.jsonl"
    train = [r for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []
    total = cfg.training.steps
    if train:
        status = job_status(job_dir, cfg, train, now)
        items.append(("status", status.line))
        items.append(("step", f"{status.step} of {total} ({100 * status.step / total:.0f}%)"))
        last = train[-1]
        items.append(("loss", "non-finite" if last["loss"] is None else f"{last['loss']:.4f}"
                      + f" at step {last['step']}"))
        pace = seconds_per_step(train)
        if status.step < total:
            items.append(("remaining", f"{total - status.step} steps, about {duration((total - status.step) * pace)}"
                          f" at {pace:.3g} s/step" if pace else f"{total - status.step} steps (no pace yet)"))
    else:
        items.append(("step", f"0 of {total}: no step logged yet"))
    restarts = describe_restarts(records)
    items.append(("restarts", f"{len(restarts)} after failures (slurm.max_restarts = {cfg.slurm.max_restarts})"))
    items += [("", line) for line in restarts]
    after = [r for r in records if r.get("event") == "after"]
    if after:
        items.append(("post-processing", ", ".join(f"{r['job_id']} {slurm_state(r['job_id'])} (after step "
                                                    f"{r['step']})" for r in after)))
    elif cfg.slurm.after:
        items.append(("post-processing", f"{len(cfg.slurm.after)} command(s), submitted when training completes"))
    return items


def format_status(job_dir: Path, items: list[tuple[str, str]]) -> str:
    width = max(len(label) for label, _ in items)
    return "\n".join([f"job {job_dir}"] + [f"  {label:<{width}}  {text}" for label, text in items])


def cancel(job_dir: Path) -> list[str]:
    """`scancel` the job's SLURM jobs still queued or running (links of a chain, a restart, the post-processing
    job); returns their ids. The trainer takes the SIGTERM to save a checkpoint first, as on a preemption."""
    job_dir = _job_dir(job_dir, "cancel")
    records = recorded_jobs(job_dir)
    if not records:
        raise FileNotFoundError(f"{job_dir / 'slurm_jobs.jsonl'} does not exist: the job was never submitted")
    return cancel_jobs(job_ids(records))
