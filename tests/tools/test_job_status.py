"""`maester status` of a job directory as a chain of two links leaves it after each stopped for the time limit
(the seed workflow's `--chain 2` with a short walltime): the step and checkpoint come from the checkpoints when no
step was logged, each link is shown stopped, not COMPLETED, and the stops are counted. The files are the ones the
trainer and `maester submit` write (their writers are called here); the SLURM job ids are ones SLURM does not know.
The same on the local SLURM cluster: tests/slurm/test_jobs_on_slurm.py (the chain)."""

from __future__ import annotations

import json
import sys
import subprocess
import time
from pathlib import Path

from maester.config import Config
from maester.jobs.slurm import record_job
from maester.tools.job_status import status_items
from maester.train.preemption import STOP_FILE
from maester.train.preemption import stop_event

LINKS = ["990001", "990002"]


def chain_job(tmp_path, monkeypatch, requeue: bool):
    job = tmp_path / "lv-sft-chain"
    (job / "checkpoints").mkdir(parents=True)
    cfg = Config.model_validate({"job": {"name": job.name}, "training": {"steps": 262},
                                 "checkpoint": {"init_from": "jobs/demo", "step_offset": 220},
                                 "slurm": {"requeue": requeue}})
    (job / "config.json").write_text(cfg.to_json())
    for step in (221, 223):  # complete checkpoints, as a save leaves them
        (job / "checkpoints" / f"step-{step}").mkdir()
        (job / "checkpoints" / f"step-{step}" / ".metadata").write_bytes(b"")
        (job / "checkpoints" / f"step-{step}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    (job / "checkpoints" / "step-224.tmp").mkdir()  # a save in progress is not a checkpoint
    events = []
    for link, (job_id, step) in enumerate(zip(LINKS, (221, 223)), 1):
        record_job(job, {"job_id": job_id, "event": "submit", "link": link, "chain": 2, "after": None})
        monkeypatch.setenv("SLURM_JOB_ID", job_id)
        monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
        events.append(stop_event(step, STOP_FILE, Path(f"step-{step}")))
    (job / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return job


def test_status_of_stopped_chain_links_without_logged_steps(tmp_path, monkeypatch):
    job = chain_job(tmp_path, monkeypatch, requeue=False)
    start = time.perf_counter()
    items = dict(status_items(job))
    assert time.perf_counter() - start < 5
    assert items["slurm"] == ("990001 STOPPED (link 1 of 2): time limit at step 221, checkpointed (SLURM: UNKNOWN), "
                              "990002 STOPPED (link 2 of 2): time limit at step 223, checkpointed (SLURM: UNKNOWN)")
    assert items["step"] == "223 of 262: no step logged yet"
    assert items["checkpoint"].startswith("step-223, ") and items["checkpoint"].endswith(" ago")
    assert items["stops"] == "2 for a time limit or a preemption, each with a checkpoint to resume from"
    assert items["restarts"] == "0 after failures (slurm.max_restarts = 0)"
    lines = [text for label, text in status_items(job) if label == ""]
    assert lines[0].startswith("step 221 (time limit), SLURM job 990001, ")


def test_status_counts_the_requeues_of_a_job_that_requeues_itself(tmp_path, monkeypatch):
    job = chain_job(tmp_path, monkeypatch, requeue=True)
    items = dict(status_items(job))
    assert items["slurm"].startswith("990001 UNKNOWN (link 1 of 2), requeued 1 time(s): time limit at step 221")


def test_maester_status_imports_no_torch(tmp_path, monkeypatch):
    """What made status take a minute on a busy machine: importing torch (through the metrics writer)."""
    job = chain_job(tmp_path, monkeypatch, requeue=False)
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "maester", "status", str(job)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "990002 STOPPED" in out.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "maester.tools.job_status" in imported and "torch" not in imported
