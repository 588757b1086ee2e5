"""The GPU acceptance check: refused without a GPU, and every command it runs refers to files and config keys
that exist."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STAGES = ["cuda-tests", "two-rank-run", "sync-debug-3-steps", "gemma3-1b-sft-memory", "flex-sac-compile",
          "train-throughput"]


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    from tests.helpers import clean_env

    return subprocess.run(args, cwd=REPO, env=clean_env(**env), capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_the_check_refuses_and_writes_nothing(tmp_path):
    out = tmp_path / "report"
    result = run(["bash", "scripts/gpu-check.sh", "--out", str(out)])
    assert result.returncode == 2, result.stderr
    assert "gpu-check needs a CUDA or ROCm GPU" in result.stderr
    assert "torch.cuda.is_available() is False" in result.stderr
    assert not out.exists()


def test_dry_run_lists_every_stage_and_its_files_and_configs_exist(tmp_path):
    result = run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    listed = [line.split("]")[0][1:] for line in result.stdout.splitlines() if line.startswith("[")]
    assert listed == STAGES
    assert "MISSING" not in result.stdout and "INVALID" not in result.stdout
    assert result.stdout.count("with the overrides") == 4  # every `maester train` stage's config loads
    assert (REPO / "scripts" / "gpu-check.sh").stat().st_mode & 0o111


def test_stage_configs_load_and_an_unknown_key_would_be_refused(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from maester.config import load_config

    stage = gpu_check.stages(tmp_path, 2)[3]
    assert stage["name"] == "gemma3-1b-sft-memory"
    load_config(REPO / stage["config"][0], [*stage["config"][1:]], environ={})
    with pytest.raises(Exception, match="no_such_key"):
        load_config(REPO / stage["config"][0], [*stage["config"][1:], "--training.no_such_key=1"], environ={})


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_environment_names_the_gpus_and_collective_library():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    env = gpu_check.environment()
    assert len(env["gpus"]) == torch.cuda.device_count() >= 1
    assert all(g["name"] or g["arch"] for g in env["gpus"])
    assert env["nccl"] and not env["nccl"].startswith("unknown")
    json.dumps(env)
