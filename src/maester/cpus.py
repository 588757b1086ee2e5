"""The CPUs this process may use, and how its CPU threads wait: read before torch loads, so no torch here.

`usable_cpus` is the smaller of the affinity mask (`taskset`, SLURM's `--cpus-per-task` binding) and the cgroup CPU
quota (a container's or a SLURM step's `cpu.max`, or cgroup v1's `cpu.cfs_quota_us`), which torch's default thread
count does not see: in a container limited to 2 CPUs of a 64-core host, torch starts 64 threads on 2 CPUs' time.

`prefer_passive_waiting` makes OpenMP's idle threads sleep instead of spinning (`OMP_WAIT_POLICY=PASSIVE`), unless
the environment already says how they wait. libgomp's default spins for a while at the end of every parallel
region; on a machine whose cores other processes share, a spinning thread takes the core from the thread it waits
for, and training steps take several times as long (`benchmarks/cpu_threads.py`). OpenMP reads the variable once,
when torch loads, so the command sets it first.
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from pathlib import Path

WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables that say how OpenMP threads wait (libgomp's and Intel's); one set by the user is left alone."""


def affinity_cpus() -> int:
    """The CPUs in this process's affinity mask."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) \
        -> float | None:
    """The CPU time this process's cgroup (or an ancestor) may use, in CPUs (`cpu.max` 150000 100000: 1.5); None
    without a quota. Reads cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            for directory in cgroup_dirs(root, path):
                quotas.append(_read_v2(directory / "cpu.max"))
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            for mount in (root / controllers, root / "cpu", root / "cpu,cpuacct"):
                for directory in cgroup_dirs(mount, path):
                    quotas.append(_read_v1(directory))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def usable_cpus(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process can keep busy: its affinity mask, at most its cgroup quota rounded up."""
    quota = cgroup_cpu_quota(root, membership)
    affinity = affinity_cpus()
    return affinity if quota is None else max(1, min(affinity, math.ceil(quota)))


def prefer_passive_waiting(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless one of `WAIT_VARIABLES` is set; returns whether it did. Effective only
    before torch is imported."""
    if any(name in environ for name in WAIT_VARIABLES):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The cgroup directory of `path` under `mount` and its ancestors up to the mount (inside a container the
    mount is the process's own cgroup, so `path` may not exist below it: the mount's files then apply)."""
    parts = [p for p in path.split("/") if p]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_v2(file: Path) -> float | None:
    try:
        quota, period = file.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _read_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period
