"""Jobs that survive crashes, on the local SLURM: a rank killed mid-run restarts from `latest` and ends with the
losses of an uninterrupted run; a config error is not retried; the post-processing job runs once; status and
cancel on a running job."""

from __future__ import annotations

import json

import pytest

from maester.jobs.slurm import recorded_jobs
from maester.train.metrics import read_metrics
from tests.helpers import clean_env, run_maester
from tests.slurm.conftest import job_restarts, wait_for_job
from tests.slurm.test_jobs_on_slurm import TIMEOUT, corpus_here, reference, submit, wait_for_step  # noqa: F401

pytestmark = pytest.mark.usefixtures("slurm_cluster")


def test_a_killed_rank_restarts_and_the_after_job_runs_once(corpus_here):
    steps = 8
    expected = reference(corpus_here, steps)
    env = clean_env(_MAESTER_FAULT="after_step:5", _MAESTER_FAULT_ONCE=str(corpus_here / "crashed-once"))
    out = run_maester(["submit", *submit_args(corpus_here, "crash", training__steps=steps, slurm__max_restarts=2),
                       "--chain", "2", "--then", 'echo "post-processing of $JOB_DIR" >> "$JOB_DIR/after.log"'],
                      corpus_here, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    job = corpus_here / "jobs" / "crash"
    first, second = [r["job_id"] for r in recorded_jobs(job)]
    assert wait_for_job(first, TIMEOUT, restarts=1) == "COMPLETED"
    assert wait_for_job(second, TIMEOUT) == "COMPLETED"
    after = [r for r in recorded_jobs(job) if r.get("event") == "after"]
    assert len(after) == 1 and after[0]["after"] == first
    assert wait_for_job(after[0]["job_id"], TIMEOUT) == "COMPLETED"
    assert (corpus_here / "crashed-once").exists()  # the fault did happen
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert [got[s] for s in range(1, steps + 1)] == expected
    (restart,) = [r for r in recorded_jobs(job) if r.get("event") == "restart"]
    assert (restart["exit_code"], restart["cause"], restart["step"], restart["job_id"]) == (137, "SIGKILL", 4, first)
    assert job_restarts(first) == 1
    assert (job / "after.log").read_text() == f"post-processing of {job.resolve()}\n"
    err = (job / "logs" / f"{first}.err").read_text()
    assert "Traceback" not in err and "FAILED" not in err and "failed with exit code 137 (SIGKILL)" in err
    report = run_maester(["report", str(job)], corpus_here)
    assert report.returncode == 0, report.stderr
    assert f"job {first} failed with exit code 137 (SIGKILL)" in report.stdout


def test_a_job_slurm_will_not_requeue_is_submitted_again(corpus_here):
    """slurm.requeue = false (`--no-requeue`, as on partitions that forbid it): `scontrol requeue` fails, and the
    restart submits the job script again as a new job, which resumes from `latest`."""
    steps = 8
    expected = reference(corpus_here, steps)
    env = clean_env(_MAESTER_FAULT="after_step:5", _MAESTER_FAULT_ONCE=str(corpus_here / "crashed-once"))
    out = run_maester(["submit", *submit_args(corpus_here, "resubmit", training__steps=steps, slurm__max_restarts=1,
                                              slurm__requeue="false")], corpus_here, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    job = corpus_here / "jobs" / "resubmit"
    first = recorded_jobs(job)[0]["job_id"]
    assert wait_for_job(first, TIMEOUT) == "COMPLETED"  # its script ended by submitting the restart
    (restart,) = [r for r in recorded_jobs(job) if r.get("event") == "restart"]
    assert restart["job_id"] != first and restart["failed_job"] == first and restart["exit_code"] == 137
    assert wait_for_job(restart["job_id"], TIMEOUT) == "COMPLETED"
    assert job_restarts(first) == 0  # not requeued: a new job
    out_log = (job / "logs" / f"{first}.out").read_text()
    assert f"scontrol requeue {first} failed" in out_log and f"resubmitted as job {restart['job_id']}" in out_log
    got = {r["step"]: r["loss"] for r in read_metrics(job / "metrics.jsonl")}
    assert [got[s] for s in range(1, steps + 1)] == expected


def test_a_config_error_is_not_retried(corpus_here):
    # init_from is a directory but not a checkpoint: the trainer exits with 2 on every try
    job = submit(corpus_here, "bad", training__steps=3, slurm__max_restarts=2, checkpoint__init_from=str(corpus_here))
    (record,) = recorded_jobs(job)
    assert wait_for_job(record["job_id"], TIMEOUT) == "FAILED"
    assert job_restarts(record["job_id"]) == 0 and recorded_jobs(job) == [record]
    assert json.loads((job / "failure").read_text())["cause"] == "BAD_INPUT"
    assert "exit code 2 (BAD_INPUT): not restarted" in (job / "logs" / f"{record['job_id']}.out").read_text()


def test_status_and_cancel_of_a_running_job(corpus_here):
    job = submit(corpus_here, "long", training__steps=100000)
    (record,) = recorded_jobs(job)
    wait_for_step(job, 2)
    status = run_maester(["status", str(job)], corpus_here)
    assert status.returncode == 0, status.stderr
    lines = status.stdout.splitlines()
    assert f"{record['job_id']} RUNNING" in lines[1]
    step = next(line for line in lines if line.split()[0] == "step")
    assert int(step.split()[1]) >= 2 and "of 100000" in step
    assert any(line.split()[0] == "remaining" and "s/step" in line for line in lines)
    cancelled = run_maester(["cancel", str(job)], corpus_here)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == f"cancelled {record['job_id']}"
    assert wait_for_job(record["job_id"], TIMEOUT) == "CANCELLED"
    after = run_maester(["status", str(job)], corpus_here)
    assert f"{record['job_id']} CANCELLED" in after.stdout.splitlines()[1]


def submit_args(tmp_path, name, **extra) -> list[str]:
    from tests.helpers import DEMO_CONFIG, tiny_overrides
    from tests.slurm.test_jobs_on_slurm import CPU_JOB

    return [str(DEMO_CONFIG), *tiny_overrides(tmp_path / "corpus.parquet", tmp_path / "jobs", name,
                                              **{**CPU_JOB, **extra})]
