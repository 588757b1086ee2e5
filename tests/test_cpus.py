"""The CPUs a process may use (affinity and cgroup quota, read from cgroup trees written here as the kernel lays
them out) and the passive waiting of OpenMP threads that the command asks for before torch loads."""

from __future__ import annotations

import os

from maester.cpus import cgroup_cpu_quota, prefer_passive_waiting, usable_cpus
from tests.helpers import DEMO_CONFIG, REPO, clean_env, run_maester, tiny_overrides, write_corpus


def cgroup_v2(tmp_path, limits: dict[str, str], member: str = "/job/step"):
    """A cgroup v2 tree whose directories (relative paths) hold `cpu.max`, and the membership file of a process
    in `member`."""
    root = tmp_path / "cgroup"
    for directory, cpu_max in limits.items():
        (root / directory).mkdir(parents=True, exist_ok=True)
        (root / directory / "cpu.max").write_text(cpu_max + "\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text(f"0::{member}\n")
    return root, membership


def test_a_cgroup_v2_quota_limits_the_usable_cpus(tmp_path):
    root, membership = cgroup_v2(tmp_path, {"": "max 100000", "job": "max 100000", "job/step": "150000 100000"})
    assert cgroup_cpu_quota(root, membership) == 1.5
    assert usable_cpus(root, membership) == min(len(os.sched_getaffinity(0)), 2)  # 1.5 CPUs keep 2 threads busy
    # the tightest limit on the way up counts: a job's quota holds for its steps
    root, membership = cgroup_v2(tmp_path / "nested", {"job": "50000 100000", "job/step": "max 100000"})
    assert cgroup_cpu_quota(root, membership) == 0.5 and usable_cpus(root, membership) == 1
    root, membership = cgroup_v2(tmp_path / "none", {"": "max 100000"})
    assert cgroup_cpu_quota(root, membership) is None
    assert usable_cpus(root, membership) == len(os.sched_getaffinity(0))


def test_a_cgroup_v1_quota_limits_the_usable_cpus(tmp_path):
    directory = tmp_path / "cgroup" / "cpu,cpuacct" / "docker" / "abc"
    directory.mkdir(parents=True)
    (directory / "cpu.cfs_quota_us").write_text("100000\n")
    (directory / "cpu.cfs_period_us").write_text("100000\n")
    membership = tmp_path / "self-cgroup"
    membership.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(tmp_path / "cgroup", membership) == 1.0
    assert usable_cpus(tmp_path / "cgroup", membership) == 1
    (directory / "cpu.cfs_quota_us").write_text("-1\n")  # no quota
    assert cgroup_cpu_quota(tmp_path / "cgroup", membership) is None


def test_passive_waiting_unless_the_environment_says_how_threads_wait():
    env: dict[str, str] = {}
    assert prefer_passive_waiting(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    for name, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "0")):
        env = {name: value}
        assert not prefer_passive_waiting(env) and env == {name: value}


def test_maester_train_waits_passively(tmp_path):
    """The command sets the variable before torch loads; the trainer's first line says what holds (the variables
    that keep libgomp's spinning are checked above)."""
    corpus = write_corpus(tmp_path / "corpus.parquet", n_docs=20)
    env = {k: v for k, v in clean_env().items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    result = run_maester(["train", str(DEMO_CONFIG), *tiny_overrides(corpus, tmp_path / "jobs", training__steps=1)],
                         cwd=REPO, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "usable CPU(s) by affinity and cgroup quota; idle threads: passive)" in result.stderr
