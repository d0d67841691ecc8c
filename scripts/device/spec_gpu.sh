#!/usr/bin/env bash
# Speculative decoding for deepseek4 on the GPU, and prefill chunk sizes, in one device
# call of under 10 minutes (each step under its own time limit, so a hang in one still
# returns the others). Written 2026-12-05 without a device; first run pending.
#   fixtures  ds4_gpu.sh: its "draft vs dec" column (drafted passes, some drafts made up
#             and dropped by restoring the rings, against decode) on every fixture
#   graphs    the same column for two fixtures with MOE_DS4_DRAFT_GRAPH=1 (drafted passes
#             recorded and replayed as graphs)
#   draft     ds4_ab.sh on the 43-layer model at depth 0: base against passes of a
#             token and 3 / 7 drafts, all taken (`bench --draft`), op by op and as graphs
#   chunks    pp at 512 / 1024 / 2048-token chunks, depths 0 and 32768 (serve's GPU batch)
# STEPS picks (default all four). Here: bash scripts/device/carry_ds4.sh. There: carry
# .dev/ds4. $OUT gets the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
OUT=${OUT:-/tmp/spec-gpu}
mkdir -p "$OUT"
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
STEPS=${STEPS:-fixtures graphs draft chunks}
t0=$(date +%s)
step() { echo "== $1 ($(($(date +%s) - t0)) s in)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want fixtures; then
    step "fixtures"
    OUT=$OUT/fixtures timeout 200 bash scripts/device/ds4_gpu.sh > "$OUT/fixtures.log" 2>&1
    echo "rc=$?"
    grep -E "^(fixture|tiny)|prefix cache" "$OUT/fixtures.log"
fi
if want graphs; then
    step "fixtures, drafted passes as graphs"
    MOE_DS4_DRAFT_GRAPH=1 ONLY=tiny_release.f32,tiny_mixed.rocmfpx-mix OUT=$OUT/graphs \
        timeout 120 python3 scripts/device/ds4_gpu.py > "$OUT/graphs.log" 2>&1
    echo "rc=$?"
    grep -E "^(fixture|tiny)" "$OUT/graphs.log" || tail -5 "$OUT/graphs.log"
fi
if want draft; then
    step "drafted passes, all taken (43 layers, depth 0)"
    OUT=$OUT/draft DEPTHS=0 timeout 240 bash scripts/device/ds4_ab.sh base DRAFT=3 DRAFT=7 \
        DRAFT=3,MOE_DS4_DRAFT_GRAPH=1 DRAFT=7,MOE_DS4_DRAFT_GRAPH=1 > "$OUT/draft.log" 2>&1
    echo "rc=$?"
    grep "^|" "$OUT/draft.log" || tail -5 "$OUT/draft.log"
fi
if want chunks; then
    step "prefill chunk sizes"
    for pp in 512 1024 2048; do
        OUT=$OUT/pp$pp PP=$pp TG=8 DEPTHS=0,32768 timeout 90 bash scripts/device/ds4_ab.sh base \
            > "$OUT/pp$pp.log" 2>&1 || echo "pp$pp failed (rc=$?)"
        grep "^| base" "$OUT/pp$pp.log" | sed "s/^| base /| pp$pp /" || tail -3 "$OUT/pp$pp.log"
    done
fi
step "done"
