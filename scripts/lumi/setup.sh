#!/usr/bin/env bash
# maester inside LUMI's AI container, on top of the container's ROCm PyTorch.
#
#   singularity exec "$SIF" bash scripts/lumi/setup.sh [VENV]     # default VENV: .venv-lumi
#
# `pip install maester` (or `uv sync`) there would replace the container's ROCm torch with PyPI's CUDA wheel.
# Instead: a virtual environment that sees the container's packages (--system-site-packages), maester installed
# with --no-deps, and only maester's other dependencies added. Then it checks that torch is still the ROCm build.
# Point slurm.python at VENV/bin/python (and slurm.container.image at the same image) to train with it.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv-lumi}
PYTHON=${PYTHON:-python3}

"$PYTHON" - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("scripts/lumi/setup.sh: this Python has no torch: run the script inside the container "
             "(singularity exec IMAGE bash scripts/lumi/setup.sh)")
version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if torch.version.hip is None:
    sys.exit(f"scripts/lumi/setup.sh: torch {torch.__version__} here is not a ROCm build (torch.version.hip is "
             f"None): use LUMI's AI container, whose torch is built for the MI250X")
if version < (2, 10):
    sys.exit(f"scripts/lumi/setup.sh: torch {torch.__version__} is older than 2.10, the oldest maester supports")
PY

"$PYTHON" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install --quiet --no-deps -e .
# maester's dependencies except torch, straight from pyproject.toml.
mapfile -t DEPS < <("$VENV/bin/python" -c '
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[<>=!~ \[]", d)[0] != "torch"))')
"$VENV/bin/python" -m pip install --quiet "${DEPS[@]}"

"$VENV/bin/python" - <<'PY'
import sys
import torch
import maester  # noqa: F401

print(f"torch {torch.__version__}, HIP {torch.version.hip}, GPU available: {torch.cuda.is_available()}")
if torch.version.hip is None:
    sys.exit("scripts/lumi/setup.sh: the venv's torch is no longer the ROCm build: a dependency replaced it")
if not torch.cuda.is_available():
    print("no GPU visible here (a login node?): on a GPU node, this check must print 'GPU available: True'")
PY
