#!/usr/bin/env bash
# Dense decode mat-vec layouts on the device (scripts/device/dense_matvec_bench.cu):
# candidates vs the committed matvec_dense vs a streaming read, on the V4-Flash shapes.
# Needs nvcc (the device machine); prints a markdown table. REPS: timed launches each.
# DEFINES: extra compile options, e.g. DEFINES=-DGPU_NO_STREAM_HINT=1 (the committed
# kernels' weights read plainly, not evict-first in L2).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/dense_matvec_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread ${DEFINES:-} -o "$bin" scripts/device/dense_matvec_bench.cu
"$bin" "${REPS:-50}"
