"""scripts/lumi/setup.sh refuses a Python whose torch is not the container's ROCm build, before creating
anything (on LUMI the script runs inside the AI container; here the cases it must refuse)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "lumi" / "setup.sh"


def run(tmp_path, python: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(tmp_path / "venv")], env={"PYTHON": python, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)


def test_refuses_a_cuda_build_of_torch(tmp_path):
    import torch

    out = run(tmp_path, sys.executable)  # the project's own environment: PyPI's CUDA (or CPU) wheel
    if torch.version.hip is None:
        assert out.returncode != 0 and "not a ROCm build" in out.stderr, out.stderr
        assert not (tmp_path / "venv").exists()


def test_refuses_a_python_without_torch(tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = run(tmp_path, str(bare / "bin" / "python"))
    assert out.returncode != 0 and "has no torch" in out.stderr, out.stderr
    assert not (tmp_path / "venv").exists()
