#!/usr/bin/env bash
# The indexer's top-k timed alone on the device (scripts/device/topk_bench.cu), for the
# committed kernels/gpu/ds4.cu and, with OLD=folder (relative to the repo root, holding
# an older ds4.cu and its common.cuh, e.g. from git show), for that one too. Needs nvcc (the device machine); prints markdown
# tables. REPS: launches per graph; NVFLAGS: more nvcc flags (-D of the kernel's sizes).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/topk_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
build() {
    "$NVCC" -O3 -std=c++17 -arch=sm_90 -Xptxas -v ${NVFLAGS:-} -DDS4_SRC="\"$1\"" -o "$2" scripts/device/topk_bench.cu 2>&1 |
        grep -A3 -E "Compiling entry function .ds4_topk_rows(_wide)?." | grep -E "entry|stack|registers" || true
}
if [ -n "${OLD:-}" ]; then
    echo "## $OLD"
    build "$PWD/$OLD/ds4.cu" "$bin-old"
    "$bin-old" "${REPS:-200}" || true
fi
echo "## kernels/gpu/ds4.cu"
build "$PWD/kernels/gpu/ds4.cu" "$bin"
"$bin" "${REPS:-200}"
