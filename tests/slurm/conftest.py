"""A real single-node SLURM cluster for the tests in this directory, started by scripts/slurm/local-cluster.sh.

The `slurm_cluster` fixture starts it once per test run, however many pytest-xdist workers ask at once.
When it cannot start, the tests skip with the script's reason, or fail when `_MAESTER_REQUIRE_SLURM=1` (as in CI).
The functions below submit jobs and read their state back from slurmctld.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "local-cluster.sh"
REQUIRE_ENV = "_MAESTER_REQUIRE_SLURM"
# States a job does not leave (a requeued job goes back to PENDING instead).
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                          "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


@dataclass(frozen=True)
class SlurmCluster:
    node: str
    partition: str
    cpus: int


def _require_slurm() -> bool:
    value = os.environ.get(REQUIRE_ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{REQUIRE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _start_once(shared: Path) -> tuple[bool, str]:
    """Run the script unless another worker of this test run already did; (started, its output)."""
    result = shared / "slurm-cluster.json"
    with open(shared / "slurm-cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            try:
                out = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True, timeout=900,
                                     stdin=subprocess.DEVNULL)
                started, output = out.returncode == 0, (out.stdout + out.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                started, output = False, f"{SCRIPT}: {e}"
            result.write_text(json.dumps({"started": started, "output": output}))
        record = json.loads(result.read_text())
    return record["started"], record["output"]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker has its own basetemp inside the run's directory, which they share.
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    started, output = _start_once(shared)
    if not started:
        message = f"the local SLURM cluster did not start ({SCRIPT.relative_to(REPO)}):\n{output}"
        if _require_slurm():
            pytest.fail(message)
        pytest.skip(message)
    node = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, check=True).stdout
    partition = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, check=True).stdout
    yield SlurmCluster(node=_field(node, "NodeName"), partition=partition.strip(),
                       cpus=int(_field(node, "CPUTot")))


def _field(record: str, key: str) -> str:
    """The value of `key=value` in one line of `scontrol show ... -o`."""
    match = re.search(rf"(?:^| ){re.escape(key)}=(\S*)", record)
    if match is None:
        raise KeyError(f"no {key}= in scontrol output: {record.strip()}")
    return match.group(1)


def sbatch(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> int:
    """Submit with `sbatch --parsable ARGS` from `cwd` (the job's working directory); the job id."""
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"sbatch {' '.join(args)} failed: {out.stderr.strip()}"
    return int(out.stdout.strip().split(";")[0])


def job_record(job_id: int | str) -> str:
    """`scontrol show job -o ID`: one line of key=value fields; slurmctld keeps finished jobs for an hour."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, f"scontrol show job {job_id} failed: {out.stderr.strip()}"
    return out.stdout


def job_state(job_id: int | str) -> str:
    """PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ..."""
    return _field(job_record(job_id), "JobState")


def job_restarts(job_id: int | str) -> int:
    """How many times the job was requeued (the job sees it as SLURM_RESTART_COUNT)."""
    return int(_field(job_record(job_id), "Restarts"))


def wait_for_job(job_id: int | str, timeout: float, restarts: int = 0) -> str:
    """Poll until the job is in a final state after at least `restarts` requeues; that state."""
    deadline = time.monotonic() + timeout
    while True:
        record = job_record(job_id)
        state, done = _field(record, "JobState"), int(_field(record, "Restarts"))
        if state in FINAL_STATES and done >= restarts:
            return state
        if time.monotonic() > deadline:
            queue = subprocess.run(["squeue"], capture_output=True, text=True).stdout
            raise TimeoutError(f"job {job_id} is {state} after {done} restart(s) and {timeout:.0f} s; waited for a "
                               f"final state after {restarts}; squeue:\n{queue}")
        time.sleep(0.5)
