"""`maester status JOB` and `maester cancel JOB`: where a job stands (its SLURM jobs and their states, the step,
the loss, the time left, the latest checkpoint, the stops for a time limit or a preemption and the requeues they
led to, the restarts after failures, the post-processing job) and stopping it.

Status reads the job directory and asks SLURM once per command (squeue, then sacct, for all of the job's SLURM
jobs together); it imports no torch, so it answers in about a second."""

from __future__ import annotations

import time
from pathlib import Path

from maester.config import Config
from maester.jobs.job_dir import refuse_checkpoint
from maester.jobs.slurm import (ACTIVE_STATES, cancel_jobs, describe_restarts, recorded_jobs, slurm_states,
                                training_jobs)
from maester.parallel.hosts import describe_hosts
from maester.train.checkpoint_dirs import newest_complete
from maester.train.metrics_file import read_events, read_metrics
from maester.train.preemption import REQUEUE_FILE, STOP_FILE, read_marker
from maester.tools.report import duration, job_status, seconds_per_step

# Why a run stopped on request, as `maester status` says it.
STOP_CAUSES = {STOP_FILE: "time limit", "SIGUSR1": "time limit", "SIGTERM": "SIGTERM: preemption, requeue or scancel"}


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
    """(label, text) pairs: SLURM, status, step, loss, remaining, nodes, checkpoint, stops, restarts,
    post-processing."""
    job_dir = _job_dir(job_dir, "status")
    cfg = Config.from_json_file(job_dir / "config.json")
    now = time.time() if now is None else now
    records = recorded_jobs(job_dir)
    training = training_jobs(records)
    metrics = job_dir / "metrics.jsonl"
    train = [r for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []
    events = read_events(job_dir)
    stops = [e for e in events if e["event"] == "stop"]
    hosts = [e for e in events if e["event"] == "hosts"]
    after = [r for r in records if r.get("event") == "after"]
    states = slurm_states(job_ids(training) + job_ids(after))
    items = [("slurm", ", ".join(_describe_job(j, states[j], training, stops, cfg.slurm.requeue)
                                 for j in job_ids(training))
              or "not submitted (no slurm_jobs.jsonl)")]
    checkpoint = newest_complete(job_dir / "checkpoints")
    total = cfg.training.steps
    if train:
        items += _progress(job_dir, cfg, train, now)
    else:
        step = int(checkpoint.name.split("-")[1]) if checkpoint else 0
        requeue = read_marker(job_dir / REQUEUE_FILE)
        items.append(("step", f"{step} of {total}: " + (f"stopped for requeue at step {requeue['step']}, no step "
                                                         f"logged yet" if requeue else "no step logged yet")))
    if hosts:  # the nodes of the newest run
        items.append(("nodes", describe_hosts(hosts[-1]["hosts"])
                      + (f" (SLURM job {hosts[-1]['slurm_job_id']})" if hosts[-1].get("slurm_job_id") else "")))
    items.append(("checkpoint", f"{checkpoint.name}, {duration(now - checkpoint.stat().st_mtime)} ago"
                  if checkpoint else "none yet"))
    items.append(("stops", f"{len(stops)} for a time limit or a preemption, each with a checkpoint to resume from"
                  if stops else "none"))
    items += [("", f"step {e['step']} ({STOP_CAUSES.get(e['reason'], e['reason'])})"
                   + (f", SLURM job {e['slurm_job_id']}" if e.get("slurm_job_id") else "")
                   + (f" after {e['slurm_restart_count']} requeue(s)" if e.get("slurm_restart_count") else "")
                   + f", {e['time']}") for e in stops]
    restarts = describe_restarts(records)
    items.append(("restarts", f"{len(restarts)} after failures (slurm.max_restarts = {cfg.slurm.max_restarts})"))
    items += [("", line) for line in restarts]
    if after:
        items.append(("post-processing", ", ".join(f"{r['job_id']} {states[r['job_id']]} (after step "
                                                    f"{r['step']})" for r in after)))
    elif cfg.slurm.after:
        items.append(("post-processing", f"{len(cfg.slurm.after)} command(s), submitted when training completes"))
    return items


def _progress(job_dir: Path, cfg: Config, train: list[dict], now: float) -> list[tuple[str, str]]:
    """Status, step, loss and remaining time from the logged steps."""
    total = cfg.training.steps
    status = job_status(job_dir, cfg, train, now)
    items = [("status", status.line), ("step", f"{status.step} of {total} ({100 * status.step / total:.0f}%)")]
    last = train[-1]
    items.append(("loss", ("non-finite" if last["loss"] is None else f"{last['loss']:.4f}") + f" at step {last['step']}"))
    pace = seconds_per_step(train)
    if status.step < total:
        items.append(("remaining", f"{total - status.step} steps, about {duration((total - status.step) * pace)}"
                      f" at {pace:.3g} s/step" if pace else f"{total - status.step} steps (no pace yet)"))
    return items


def _describe_job(job_id: str, state: str, training: list[dict], stops: list[dict], requeue: bool) -> str:
    """A SLURM job with its state, its link of a chain, and its stops on request. With `slurm.requeue` the job
    requeued itself after each stop; without, a stop ended it, and SLURM's final state (COMPLETED: the script exits 0
    after a stop) is shown as STOPPED: the next link (or a resubmission) resumes from the checkpoint."""
    record = next(r for r in training if r["job_id"] == job_id)
    link = f" (link {record['link']} of {record['chain']})" if record.get("chain", 1) > 1 else ""
    own = [e for e in stops if e.get("slurm_job_id") == job_id]
    if not own:
        return f"{job_id} {state}{link}"
    at = ", ".join(f"{STOP_CAUSES.get(e['reason'], e['reason']).split(':')[0]} at step {e['step']}" for e in own)
    if requeue:
        return f"{job_id} {state}{link}, requeued {len(own)} time(s): {at}"
    shown = state if state in ACTIVE_STATES else "STOPPED"  # the stop ended it, whatever SLURM calls it
    return f"{job_id} {shown}{link}: {at}, checkpointed (SLURM: {state})"


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
