#!/usr/bin/env bash
# GPU acceptance check: environment, CUDA-only tests, 2-rank run, sync count, Gemma 3 1B SFT memory,
# flex + selective AC + compile, throughput. Writes <out>/gpu-check.json. Usage: scripts/gpu-check.sh [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
exec uv run python benchmarks/gpu_check.py "$@"
