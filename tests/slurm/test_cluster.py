"""The local SLURM cluster does what the submit, requeue and sweep tests rely on: job steps with several tasks
started by srun, the submitter's environment and directory, `scontrol requeue` of a running job, and the
warning signal before the time limit."""

from __future__ import annotations

import os
import subprocess
import time

from tests.slurm.conftest import SlurmCluster, job_restarts, job_state, sbatch, wait_for_job

STEP_SCRIPT = """#!/bin/bash
#SBATCH --ntasks=2
#SBATCH --output=step.out
srun bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS in $PWD sees $SUBMITTER_MARK"'
"""

# The first run records itself and waits to be requeued; the second run finishes.
REQUEUE_SCRIPT = """#!/bin/bash
#SBATCH --output=requeue.out
#SBATCH --open-mode=append
trap 'echo "run ${SLURM_RESTART_COUNT:-0} got SIGTERM"; exit 143' TERM
echo "run ${SLURM_RESTART_COUNT:-0} started"
if [[ "${SLURM_RESTART_COUNT:-0}" == 0 ]]; then
  sleep 120 & wait
fi
echo "run ${SLURM_RESTART_COUNT:-0} finished"
"""

# SLURM sends the warning from a periodic check, so it came 0 to 30 s after the start here (nominally 10 s).
SIGNAL_SCRIPT = """#!/bin/bash
#SBATCH --output=signal.out
#SBATCH --time=1
#SBATCH --signal=B:USR1@50
trap 'echo "got SIGUSR1"; exit 0' USR1
sleep 120 & wait
echo "no signal"
"""


def test_srun_starts_two_tasks_with_the_submitters_environment(slurm_cluster: SlurmCluster, tmp_path):
    assert slurm_cluster.cpus >= 2, f"node {slurm_cluster.node} has {slurm_cluster.cpus} CPU(s); the tests need 2"
    (tmp_path / "step.sh").write_text(STEP_SCRIPT)
    job = sbatch(["step.sh"], cwd=tmp_path, env={**os.environ, "SUBMITTER_MARK": "mark-42"})
    assert wait_for_job(job, timeout=120) == "COMPLETED"
    lines = sorted((tmp_path / "step.out").read_text().splitlines())
    assert lines == [f"task 0 of 2 in {tmp_path} sees mark-42", f"task 1 of 2 in {tmp_path} sees mark-42"]


def test_requeue_of_a_running_job_runs_it_again(slurm_cluster: SlurmCluster, tmp_path):
    (tmp_path / "requeue.sh").write_text(REQUEUE_SCRIPT)
    job = sbatch(["requeue.sh"], cwd=tmp_path)
    out = tmp_path / "requeue.out"
    deadline = time.monotonic() + 120
    while "run 0 started" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, f"job {job} did not start within 120 s (state {job_state(job)})"
        time.sleep(0.5)
    requeue = subprocess.run(["scontrol", "requeue", str(job)], capture_output=True, text=True, timeout=60)
    assert requeue.returncode == 0, requeue.stderr
    assert wait_for_job(job, timeout=120, restarts=1) == "COMPLETED"
    runs = [line for line in out.read_text().splitlines() if line.startswith("run ")]
    assert runs == ["run 0 started", "run 0 got SIGTERM", "run 1 started", "run 1 finished"]
    assert job_restarts(job) == 1


def test_the_batch_shell_gets_the_warning_signal_before_the_time_limit(slurm_cluster: SlurmCluster, tmp_path):
    (tmp_path / "signal.sh").write_text(SIGNAL_SCRIPT)
    job = sbatch(["signal.sh"], cwd=tmp_path)
    assert wait_for_job(job, timeout=180) == "COMPLETED"  # by the trap; TIMEOUT had the signal not come
    # slurmstepd may add its own complaint to the output (a SIGCONT to the finished `sleep`): not the script's.
    lines = [line for line in (tmp_path / "signal.out").read_text().splitlines() if not line.startswith("slurmstepd")]
    assert lines == ["got SIGUSR1"]
