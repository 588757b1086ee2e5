"""The job directory runs under torchrun as it does under `maester train`."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import DEMO_CONFIG, clean_env, run_maester, tiny_overrides


def torchrun(nproc: int, job, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", "-m", "maester", "train", str(job)],
                          cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)


def test_submit_then_torchrun_trains_the_job(corpus, tmp_path):
    submit = run_maester(["submit", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "tr",
                                                                      training__steps=3)], tmp_path)
    assert submit.returncode == 0, submit.stderr
    job = tmp_path / "jobs" / "tr"
    run = torchrun(1, job, tmp_path)
    assert run.returncode == 0, run.stderr
    assert (job / "checkpoints" / "step-3" / ".metadata").is_file()


def test_more_processes_than_the_trainer_supports_fail_clearly(corpus, tmp_path):
    run_maester(["submit", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", "tr2")], tmp_path)
    run = torchrun(2, tmp_path / "jobs" / "tr2", tmp_path)
    assert run.returncode != 0
    assert "WORLD_SIZE=2" in run.stderr
    assert not (tmp_path / "jobs" / "tr2" / "checkpoints" / "latest").exists()
