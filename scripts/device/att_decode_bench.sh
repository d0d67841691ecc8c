#!/usr/bin/env bash
# A decode step's attention timed alone on the device (scripts/device/att_decode_bench.cu),
# once a build for each BATCHES value (keys a warp of ds4_attention has in flight; the
# committed default is DS4_ATT_BATCH in kernels/gpu/ds4.cu). Needs nvcc (the device
# machine); prints markdown tables. REPS: launches per graph.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/att_decode_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
for b in ${BATCHES:-4}; do
    echo "## DS4_ATT_BATCH=$b"
    "$NVCC" -O3 -std=c++17 -arch=sm_90 -DDS4_ATT_BATCH="$b" -o "$bin-$b" scripts/device/att_decode_bench.cu
    "$bin-$b" "${REPS:-50}"
done
