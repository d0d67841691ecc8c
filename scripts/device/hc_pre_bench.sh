#!/usr/bin/env bash
# mHC pre and its Sinkhorn timed alone on the device (scripts/device/hc_pre_bench.cu).
# Needs nvcc (the device machine); prints a markdown table. REPS: launches per graph.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/hc_pre_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
"$NVCC" -O3 -std=c++17 -arch=sm_90 -o "$bin" scripts/device/hc_pre_bench.cu
"$bin" "${REPS:-200}"
