#!/usr/bin/env bash
# GPU check: a verdict on a GPU machine within a time budget, also on a bare one (its own python3 and torch, no uv,
# no network). docs/gpu-first-run.md says what to run and how to read the report (gpu-check/gpu-check.json).
#
#   PYTHON=python3 scripts/gpu-check.sh --prepare      where the package index is (a Python with pip): the wheels
#                                                      the GPU image lacks, for Python 3.11 and 3.12, and the plan's
#                                                      peaks of the memory stages, into gpu-check/wheels/ (28 MB)
#   scripts/gpu-check.sh [--out DIR] [--stages a,b] [--budget SECONDS] [--dry-run]
#
# Python: $PYTHON, else the python3 on PATH (with uv: `uv run --no-sync scripts/gpu-check.sh`, which never
# re-syncs the environment). It must have torch >= 2.10; maester runs from src/, and the prepared wheels this
# Python lacks are installed offline into gpu-check/site-cpXY.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "gpu-check: no $PY on PATH: set PYTHON to a Python that has torch" >&2
  exit 2
fi
exec "$PY" benchmarks/gpu_check.py "$@"
