"""What the job script decides after training, without SLURM: the cause of a failure, which failures are never
retried, the restart budget per submission, the post-processing claimed once per completion, a fault once."""

from __future__ import annotations

import json
import signal
from types import SimpleNamespace

import pytest

from maester import exit_codes
from maester.config import load_config
from maester.jobs.job_dir import write_job_dir
from maester.jobs.job_end import claim_after, job_end
from maester.jobs.slurm import record_job, restarts_since_submission
from maester.jobs.torchrun import FAILURE_FILE, root_cause, shell_status
from maester.train.faults import fault_at
from tests.helpers import DEMO_CONFIG


def test_exit_codes_are_named_as_the_job_records_them():
    assert [exit_codes.name_of(c) for c in (1, 2, 3, 5, 6, -9, 137, 143, 77)] == [
        "ERROR", "BAD_INPUT", "REQUEUE", "OUT_OF_MEMORY", "COLLECTIVE", "SIGKILL", "SIGKILL", "SIGTERM", "EXIT_77"]
    assert shell_status(-9) == 137 and shell_status(2) == 2


def test_the_root_cause_is_the_first_failure_and_not_the_ranks_torchrun_ended():
    def failure(code, when):
        return SimpleNamespace(exitcode=code, timestamp=when)

    # rank 1 was killed; torchrun then ended rank 0 with SIGTERM in the same second
    assert root_cause({0: failure(-signal.SIGTERM, 100), 1: failure(-9, 100)})[0] == 1
    # a rank that exited on its own with 2 comes before one killed in the same second
    assert root_cause({0: failure(-9, 100), 1: failure(2, 100)})[0] == 1
    assert root_cause({0: failure(6, 105), 1: failure(-9, 100)})[0] == 1


@pytest.fixture
def job(tmp_path):
    cfg = load_config(DEMO_CONFIG, [f"--job.dump_dir={tmp_path}", "--slurm.max_restarts=1",
                                    '--slurm.after=["true"]'], environ={})
    job_dir = write_job_dir(cfg)
    record_job(job_dir, {"job_id": "10", "event": "submit", "link": 1, "chain": 1})
    return job_dir


@pytest.mark.parametrize("code", sorted(exit_codes.NOT_RETRIED))
def test_a_failure_a_restart_would_repeat_is_not_retried(job, code, capsys):
    (job / FAILURE_FILE).write_text(json.dumps({"exit_code": code, "cause": exit_codes.name_of(code)}))
    assert job_end(job, 1, "10") == 1  # the job ends with the script's status; nothing is requeued
    assert f"exit code {code} ({exit_codes.name_of(code)}): not restarted" in capsys.readouterr().out
    assert restarts_since_submission([json.loads(line) for line in (job / "slurm_jobs.jsonl").open()]) == []


def test_the_restart_budget_counts_since_the_last_submission(job, capsys):
    record_job(job, {"job_id": "10", "event": "restart", "restart": 1, "exit_code": 137, "cause": "SIGKILL"})
    assert job_end(job, 137, "10") == 137
    assert "restarts used: 1 of slurm.max_restarts = 1: not restarted" in capsys.readouterr().out
    record_job(job, {"job_id": "11", "event": "submit", "link": 1, "chain": 1})  # a new submission: a new budget
    records = [json.loads(line) for line in (job / "slurm_jobs.jsonl").open()]
    assert restarts_since_submission(records) == []
    assert len(restarts_since_submission(records[:2])) == 1


def test_post_processing_is_claimed_once_per_completed_step(job):
    assert job_end(job, 0, "10") == 0  # no COMPLETED marker: nothing to submit
    assert not (job / "after-submitted").exists()
    assert claim_after(job, 8) and not claim_after(job, 8)
    (job / "after-submitted").write_text(json.dumps({"step": 8, "job_id": "12"}))
    assert not claim_after(job, 8) and claim_after(job, 16)  # training.steps raised: the new completion's


def test_a_fault_once_happens_in_the_first_run_only(tmp_path, monkeypatch):
    monkeypatch.setenv("_MAESTER_FAULT", "after_step:5")
    monkeypatch.setenv("_MAESTER_FAULT_ONCE", str(tmp_path / "once"))
    assert not fault_at("after_step", 4)
    assert fault_at("after_step", 5) and not fault_at("after_step", 5)
