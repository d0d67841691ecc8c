#!/usr/bin/env bash
# The output projection's two ROCmFP4 products (wo_a's 8 groups, then wo_b) as the
# committed two launches, with and without dependent launch, against one launch with a
# group barrier between them (scripts/device/chain_bench.cu), each replayed from a CUDA
# graph and checked bit for bit against the two launches. Needs nvcc (the device
# machine); prints a markdown table and the kernels' registers. REPS: launches a graph.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/chain_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
"$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread -Xptxas -v -o "$bin" \
    scripts/device/chain_bench.cu 2>&1 |
    grep -A3 -E "Compiling entry function .(_Z13chain_variant|matvec_fp4_runs_q8(_id)?')" |
    grep -E "entry|registers" || true
"$bin" "${REPS:-50}"
