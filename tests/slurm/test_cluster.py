"""The local SLURM cluster does what the submit, requeue and sweep tests rely on: job steps with several tasks
started by srun, the submitter's environment and directory, `scontrol requeue` of a running job, and the
warning signal before the time limit."""

from __future__ import annotations

import os
import subprocess
import time

from tests.slurm.conftest import SlurmCluster, job_record, job_restarts, job_state, sbatch, wait_for_job

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


def test_the_lumi_scripts_node_preparation_runs_on_the_nodes(slurm_cluster: SlurmCluster, tmp_path):
    """N10: the LUMI template's preparation step, as rendered (without a container), run in a real job: it makes
    the MIOpen cache directory on the node, and without numactl on the node it stops the job with exit 2 and the
    reason before any training (with numactl, it goes on)."""
    import shutil

    from maester.config import load_config
    from maester.jobs.slurm import render_slurm_script
    from tests.helpers import DEMO_CONFIG

    cfg = load_config(DEMO_CONFIG, ["--slurm.template=lumi", "--slurm.gpus_per_node=0", "--slurm.mem=1G"],
                      environ={})
    lines = render_slurm_script(cfg, tmp_path / "job", tmp_path).splitlines()
    start = lines.index('export MIOPEN_USER_DB_PATH="/tmp/${USER}-miopen-${SLURM_JOB_ID}"')
    (end,) = [i for i, line in enumerate(lines) if line.startswith("srun --ntasks-per-node=1 ")]
    miopen = tmp_path / "miopen"
    script = ["#!/bin/bash", "#SBATCH --output=prepare.out", *lines[start:end + 1],
              'echo "prepared $MIOPEN_USER_DB_PATH"']
    script[2] = f'export MIOPEN_USER_DB_PATH="{miopen}"'
    (tmp_path / "prepare.sh").write_text("\n".join(script) + "\n")
    job = sbatch(["prepare.sh"], cwd=tmp_path)
    state = wait_for_job(job, timeout=120)
    out = (tmp_path / "prepare.out").read_text()
    assert miopen.is_dir()
    if shutil.which("numactl"):
        assert state == "COMPLETED" and f"prepared {miopen}" in out, out
    else:
        assert state == "FAILED" and "ExitCode=2:0" in job_record(job), (state, out)
        assert "numactl is not in the container image" in out and "prepared" not in out, out
