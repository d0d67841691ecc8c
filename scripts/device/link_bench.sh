#!/usr/bin/env bash
# What a kernel-to-kernel dependency costs in a graph, kept four ways (plain launches,
# programmatic serialisation with the grid wait, the same with early launch, and a
# counter the next kernel spins on): scripts/device/link_bench.cu. Needs nvcc (the
# device machine); prints markdown. REPS: replays; HOG_MB: the streaming kernel's bytes.
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/link_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
"$NVCC" -O3 -std=c++17 -arch=sm_90 -o "$bin" scripts/device/link_bench.cu
"$bin" "${REPS:-200}" "${HOG_MB:-18.9}"
