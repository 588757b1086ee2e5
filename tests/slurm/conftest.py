"""Real SLURM clusters for the tests in this directory, started by scripts/slurm/local-cluster.sh.

- `slurm_cluster`: the one-node cluster (the script's default directory, reached through /etc/slurm/slurm.conf);
- `slurm_nodes`: a second cluster of two nodes (`_MAESTER_SLURM_MULTINODE_DIR`, default
  /var/lib/maester-slurm-multinode, slurmctld on port 6917), reached with SLURM_CONF, for tests/slurm/test_multinode.py.
  Its nodes do not share this host's /tmp, so its jobs live in its `scratch` directory.

Each fixture starts its cluster once per test run, however many pytest-xdist workers ask at once. When it cannot
start, the tests skip with the script's reason, or fail when `_MAESTER_REQUIRE_SLURM=1` (as in CI).
The functions below submit jobs and read their state back from slurmctld (the one SLURM_CONF names, else the
one-node cluster).
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


def _start_once(shared: Path, name: str = "slurm-cluster", args: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> tuple[bool, str]:
    """Run `SCRIPT start ARGS` unless another worker of this test run already did; (started, its output)."""
    result = shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not result.exists():
            try:
                out = subprocess.run([str(SCRIPT), "start", *args], capture_output=True, text=True, timeout=900,
                                     stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})
                started, output = out.returncode == 0, (out.stdout + out.stderr).strip()
            except (OSError, subprocess.TimeoutExpired) as e:
                started, output = False, f"{SCRIPT}: {e}"
            result.write_text(json.dumps({"started": started, "output": output}))
        record = json.loads(result.read_text())
    return record["started"], record["output"]


def _shared_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker has its own basetemp inside the run's directory, which they share.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def _started_or_skip(started: bool, output: str, what: str) -> None:
    if not started:
        message = f"{what} did not start ({SCRIPT.relative_to(REPO)}):\n{output}"
        if _require_slurm():
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    started, output = _start_once(_shared_basetemp(tmp_path_factory))
    _started_or_skip(started, output, "the local SLURM cluster")
    node = subprocess.run(["scontrol", "show", "node", "-o"], capture_output=True, text=True, check=True).stdout
    partition = subprocess.run(["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, check=True).stdout
    yield SlurmCluster(node=_field(node, "NodeName"), partition=partition.strip(),
                       cpus=int(_field(node, "CPUTot")))


MULTINODE_ENV = "_MAESTER_SLURM_MULTINODE_DIR"
MULTINODE_PORT = "6917"
"""slurmctld's port of the two-node cluster (its nodes' slurmd: the next two), beside the one-node cluster's 6817."""


@dataclass(frozen=True)
class SlurmNodes:
    """The two-node cluster: its directory, config, node names, and the scratch directory its nodes share."""
    dir: Path
    nodes: tuple[str, ...]

    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def scratch(self) -> Path:
        return self.dir / "scratch"

    def script(self, *args: str) -> subprocess.CompletedProcess:
        """`local-cluster.sh ARGS` on this cluster (start --nodes 2, kill-node NODE)."""
        return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL, env={**os.environ, **self.script_env()})

    def script_env(self) -> dict[str, str]:
        return {"_MAESTER_SLURM_DIR": str(self.dir), "_MAESTER_SLURM_PORT": MULTINODE_PORT}

    def pids(self, node: str) -> list[int]:
        """The processes running on `node`: those in its namespaces, which the script recorded at its start."""
        ns = (self.dir / "run" / f"{node}.uts").read_text().strip()
        found = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and os.readlink(proc / "ns" / "uts") == ns:
                    found.append(int(proc.name))
            except OSError:
                continue  # a process that ended meanwhile
        return found


def multinode_dir() -> Path:
    return Path(os.environ.get(MULTINODE_ENV, "/var/lib/maester-slurm-multinode"))


@pytest.fixture(scope="session")
def slurm_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmNodes]:
    cluster = SlurmNodes(dir=multinode_dir(), nodes=("node1", "node2"))
    started, output = _start_once(_shared_basetemp(tmp_path_factory), "slurm-nodes", ("--nodes", "2"),
                                  cluster.script_env())
    _started_or_skip(started, output, f"the two-node SLURM cluster in {cluster.dir}")
    cluster.scratch.mkdir(exist_ok=True)
    yield cluster


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
