#!/usr/bin/env bash
# The ROCmFP4 runs kernel's register and bulk paths on the decode shapes against a plain
# read of the same bytes in one launch (scripts/device/runs_floor.cu): builds in seconds
# with nvcc (the device machine), prints a markdown table. REPS: launches a graph;
# SERIAL=1 also builds the kernels with x staged one chunk at a time and compares.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/runs_floor
date -u +"run: %Y-%m-%d %H:%M UTC"
"$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread -o "$bin" scripts/device/runs_floor.cu
"$bin" "${REPS:-100}" "$bin.out"
if [ -n "${SERIAL:-}" ]; then
    # x staged one chunk at a time (FP4_STAGE_SERIAL): its table, and its outputs
    # against the default build's.
    echo "with FP4_STAGE_SERIAL:"
    "$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread -DFP4_STAGE_SERIAL=1 \
        -o "$bin.serial" scripts/device/runs_floor.cu
    "$bin.serial" "${REPS:-100}" "$bin.serial.out"
    cmp -s "$bin.out" "$bin.serial.out" && echo "outputs: the same bits" || echo "outputs: DIFFERENT bits"
fi
