"""`python -m maester.jobs.job_end JOB_DIR STATUS`: what the job script does once training has ended with STATUS
(not for a stop for a requeue, which the script handles itself). Prints one line; exits with the status the job
should end with.

- A failure (STATUS not 0): restart the job (`scontrol requeue`; nothing more when SLURM already requeued it after a
  node failed; else `sbatch` of the script again), resuming from
  `latest`, while `slurm.max_restarts` allows, unless the cause is never retried (`exit_codes.NOT_RETRIED`: a bad
  config or input, a non-finite loss, Ctrl-C). The cause is the first failed rank's exit code from `<job>/failure`
  (written by `maester.jobs.torchrun`), else STATUS. Each restart is a line of `slurm_jobs.jsonl`.
- Success: when the job's COMPLETED marker covers `training.steps` and `slurm.after` has commands, submit the
  post-processing job `after.sh` to start once this job has ended. The marker `after-submitted` (created
  exclusively, holding the step) makes that happen once per completion, however many links or requeues end after.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from maester import exit_codes
from maester.config import Config
from maester.files import create_new, write_atomically
from maester.jobs.slurm import (AFTER_SCRIPT, SubmitError, recorded_jobs, record_job, restarts_since_submission,
                                sbatch, slurm_state)
from maester.jobs.torchrun import FAILURE_FILE
from maester.train.metrics_file import append_event

AFTER_MARKER = "after-submitted"
REQUEUED_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
"""The states of a job that SLURM has put back in the queue: after a node of a `--requeue` job failed, SLURM requeues
it while its script still runs on the nodes that are left, and `scontrol requeue` then fails with "Job is pending
execution"."""


def job_end(job_dir: Path, status: int, job_id: str) -> int:
    cfg = Config.from_json_file(job_dir / "config.json")
    if status == 0:
        return submit_after(job_dir, cfg, job_id)
    return restart(job_dir, cfg, status, job_id)


def failure_cause(job_dir: Path, status: int) -> dict:
    """{"exit_code", "cause", ...} of the failure: `<job>/failure` when a launcher wrote it, else the status."""
    path = job_dir / FAILURE_FILE
    if path.is_file():
        try:
            record = json.loads(path.read_text())
            if isinstance(record, dict) and isinstance(record.get("exit_code"), int):
                return record
        except json.JSONDecodeError:
            pass
        print(f"{path} is not a failure record; taking the cause from the exit status {status}")
    return {"exit_code": status, "cause": exit_codes.name_of(status)}


def latest_step(job_dir: Path) -> int | None:
    """The step of `checkpoints/latest` (what a restart resumes from), None without one."""
    try:
        name = os.readlink(job_dir / "checkpoints" / "latest")
    except OSError:
        return None
    step = Path(name).name.removeprefix("step-")
    return int(step) if step.isdigit() else None


def restart(job_dir: Path, cfg: Config, status: int, job_id: str) -> int:
    cause = failure_cause(job_dir, status)
    code, name = cause["exit_code"], cause["cause"]
    done = len(restarts_since_submission(recorded_jobs(job_dir)))
    allowed = cfg.slurm.max_restarts
    if code in exit_codes.NOT_RETRIED:
        print(f"training failed with exit code {code} ({name}): not restarted, as a restart would fail the same way")
        return status
    if done >= allowed:
        print(f"training failed with exit code {code} ({name}); restarts used: {done} of slurm.max_restarts = "
              f"{allowed}: not restarted")
        return status
    record = {"event": "restart", "restart": done + 1, "max_restarts": allowed, "failed_job": job_id,
              "exit_code": code, "cause": name, "rank": cause.get("rank"), "host": cause.get("host"),
              "step": latest_step(job_dir)}
    # `scontrol requeue` of this job ends it (SIGTERM to this script and to us): the record comes after it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    requeue = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if requeue.returncode == 0:
        new_id, how = job_id, "requeued"
    elif "pending" in requeue.stderr.lower() or slurm_state(job_id) in REQUEUED_STATES:
        # SLURM requeued it itself (a node failed): no second job
        new_id, how = job_id, "requeued by SLURM"
    else:
        new_id, how = sbatch(job_dir / "slurm.sh"), "resubmitted"
        print(f"scontrol requeue {job_id} failed ({requeue.stderr.strip()}): submitted job {new_id} instead")
    record_job(job_dir, {"job_id": new_id, **record})
    append_event(job_dir, {**{k: v for k, v in record.items() if v is not None}, "step": record["step"] or 0,
                           "job_id": new_id, "how": how})
    print(f"training failed with exit code {code} ({name}) on rank {cause.get('rank', '?')}: restart {done + 1} of "
          f"{allowed}, {how} as job {new_id}, resuming from step {record['step'] or 0}")
    return 0


def submit_after(job_dir: Path, cfg: Config, job_id: str) -> int:
    from maester.train.preemption import completed_marker

    done = completed_marker(job_dir, cfg.training.steps)
    if not cfg.slurm.after or done is None:
        return 0
    if not claim_after(job_dir, done["step"]):
        return 0
    try:
        after_id = sbatch(job_dir / AFTER_SCRIPT, f"afterany:{job_id}")
    except SubmitError as e:
        (job_dir / AFTER_MARKER).unlink()
        print(f"post-processing not submitted: {e}")
        return 1
    write_atomically(job_dir / AFTER_MARKER, json.dumps({"step": done["step"], "job_id": after_id}) + "\n")
    record_job(job_dir, {"job_id": after_id, "event": "after", "after": job_id, "step": done["step"]})
    print(f"training completed at step {done['step']}: post-processing job {after_id} submitted "
          f"({len(cfg.slurm.after)} command(s), logs/after-{after_id}.out)")
    return 0


def claim_after(job_dir: Path, step: int) -> bool:
    """True for the one caller that is to submit the post-processing of the completion at `step`: it created the
    marker (exclusively), or replaced one of an earlier completion, below `step` (training.steps was raised)."""
    path = job_dir / AFTER_MARKER
    for _ in range(2):
        if create_new(path):
            return True
        try:
            earlier = json.loads(path.read_text() or "{}").get("step")
        except (OSError, json.JSONDecodeError):
            return False  # another caller is writing it
        if not isinstance(earlier, int) or earlier >= step:
            return False
        path.unlink(missing_ok=True)
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].lstrip("-").isdigit():
        print("usage: python -m maester.jobs.job_end JOB_DIR STATUS", file=sys.stderr)
        return 2
    return job_end(Path(argv[0]), int(argv[1]), os.environ.get("SLURM_JOB_ID", "?"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
