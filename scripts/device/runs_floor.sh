#!/usr/bin/env bash
# The ROCmFP4 runs kernel's register and bulk paths on the decode shapes against a plain
# read of the same bytes in one launch (scripts/device/runs_floor.cu): builds in seconds
# with nvcc (the device machine), prints a markdown table. REPS: launches a graph.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/runs_floor
date -u +"run: %Y-%m-%d %H:%M UTC"
"$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread -o "$bin" scripts/device/runs_floor.cu
"$bin" "${REPS:-100}"
