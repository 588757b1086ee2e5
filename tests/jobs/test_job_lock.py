"""One run per job directory: a second `maester train` of a running job is refused at once and names the holder;
a requeued SLURM job waits for its predecessor; a killed holder's lock is released by the kernel. A failed resume
leaves config.json as it was, and a run started from elsewhere keeps the job script's directory."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time

import pytest

from maester.jobs.job_dir import LOCK_FILE
from tests.helpers import DEMO_CONFIG, clean_env, run_maester, start_maester, tiny_overrides, write_corpus


@pytest.fixture
def job(tmp_path):
    corpus = write_corpus(tmp_path / "corpus.parquet")
    args = tiny_overrides(corpus, tmp_path / "jobs", "x", training__steps=2, checkpoint__interval=2)
    first = run_maester(["train", str(DEMO_CONFIG), *args], cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    return tmp_path / "jobs" / "x"


def hold_lock(job, pid: int):
    """Hold the job's lock from this (the test's) process, as a running rank 0 would."""
    fd = os.open(job / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"host": "node7", "pid": pid, "slurm_job_id": "4242", "since": "now"}).encode(), 0)
    return fd


def test_second_run_is_refused_with_the_holder(job, tmp_path):
    fd = hold_lock(job, 31337)
    try:
        started = time.monotonic()
        out = run_maester(["train", str(job), "--training.steps=4"], cwd=tmp_path)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "is in use by another run (host node7, pid 31337, SLURM job 4242" in out.stderr
        assert time.monotonic() - started < 60
        assert not (job / "checkpoints" / "step-4").exists()
        assert '"step": 3' not in (job / "metrics.jsonl").read_text()
    finally:
        os.close(fd)
    again = run_maester(["train", str(job), "--training.steps=4"], cwd=tmp_path)  # released: it runs
    assert again.returncode == 0, again.stderr[-2000:]


def test_requeued_job_waits_for_its_predecessor(job, tmp_path):
    fd = hold_lock(job, 31337)
    proc = start_maester(["train", str(job), "--training.steps=4", "--training.requeue_lock_wait_seconds=120"],
                         tmp_path, clean_env(SLURM_RESTART_COUNT="1"))
    try:
        deadline = time.monotonic() + 120
        while "waiting up to 120 s for the previous run" not in "".join(proc.output()):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(proc.output())[-2000:]
            time.sleep(0.1)
        time.sleep(2)
        assert proc.poll() is None  # still waiting
    finally:
        os.close(fd)  # the predecessor ends
    log = "".join(proc.communicate(timeout=240))
    assert proc.returncode == 0, log[-2000:]
    assert "resumed from" in log


def test_requeued_job_gives_up_after_its_wait(job, tmp_path):
    fd = hold_lock(job, 31337)
    try:
        out = run_maester(["train", str(job), "--training.steps=4", "--training.requeue_lock_wait_seconds=3"],
                          cwd=tmp_path, env=clean_env(SLURM_RESTART_COUNT="2"))
        assert out.returncode == 2 and "waited 3 s for it" in out.stderr, out.stderr[-2000:]
    finally:
        os.close(fd)


def test_two_real_runs_and_a_killed_holder(job, tmp_path):
    holder = start_maester(["train", str(job), "--training.steps=100000"], tmp_path)
    try:
        deadline = time.monotonic() + 120
        while str(holder.pid) not in (job / LOCK_FILE).read_text():
            assert time.monotonic() < deadline and holder.poll() is None, "the first run never took the lock"
            time.sleep(0.2)
        second = run_maester(["train", str(job), "--training.steps=4"], cwd=tmp_path)
        assert second.returncode == 2 and f"pid {holder.pid}" in second.stderr, second.stderr[-2000:]
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    after = run_maester(["train", str(job), "--training.steps=4"], cwd=tmp_path)  # the kernel released it
    assert after.returncode == 0, after.stderr[-2000:]


def test_failed_resume_keeps_config_json(job, tmp_path):
    before = (job / "config.json").read_text()
    out = run_maester(["train", str(job), "--training.steps=4", "--model.flavor=nope"], cwd=tmp_path)
    assert out.returncode == 2
    bad_batch = run_maester(["train", str(job), "--training.steps=4", "--training.global_batch_size=8"],
                            cwd=tmp_path)
    assert bad_batch.returncode == 2, bad_batch.stderr[-2000:]
    assert (job / "config.json").read_text() == before
    plain = run_maester(["train", str(job), "--training.steps=4"], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]


def test_training_from_another_directory_keeps_the_scripts_workdir(job, tmp_path):
    script = (job / "slurm.sh").read_text()
    assert f"cd {tmp_path}" in script
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = run_maester(["train", str(job), "--training.steps=4"], cwd=elsewhere)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (job / "slurm.sh").read_text().count(f"cd {elsewhere}") == 0
    assert f"cd {tmp_path}\n" in (job / "slurm.sh").read_text()
