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
"$bin" "${REPS:-100}" "$bin.out"
# VARIANTS: compile-option sets separated by ';' (e.g. "-DFP4_BULK_INFLIGHT=2;
# -DFP4_BULK_CHUNKS=8 -DFP4_BULK_INFLIGHT=4"), each built, timed and its outputs compared
# with the default build's; SERIAL=1 adds x staged one chunk at a time (FP4_STAGE_SERIAL).
VARIANTS=${VARIANTS:-}
[ -n "${SERIAL:-}" ] && VARIANTS="-DFP4_STAGE_SERIAL=1${VARIANTS:+;$VARIANTS}"
i=0
IFS=';' read -r -a sets <<< "$VARIANTS"
for defs in "${sets[@]}"; do
    [ -n "${defs// /}" ] || continue
    i=$((i + 1))
    echo "with $defs:"
    # shellcheck disable=SC2086 # one option set, split into its options
    "$NVCC" -O3 -std=c++17 -arch=sm_90 --default-stream per-thread $defs -o "$bin.$i" scripts/device/runs_floor.cu
    "$bin.$i" "${REPS:-100}" "$bin.$i.out"
    cmp -s "$bin.out" "$bin.$i.out" && echo "outputs: the same bits" || echo "outputs: DIFFERENT bits"
done
