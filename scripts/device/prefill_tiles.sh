#!/usr/bin/env bash
# The prefill tile kinds in two device calls (each step under its own time limit, so a
# hang in one still returns the others): the parity cases of the bf16 tiles and their
# streamed form (`gpu_kernels --quick`, then again with VARIANT: VAR=VALUE[,VAR=VALUE...],
# default MOE_GPU_MMW_ISSUE=fast,MOE_GPU_MMW_E4=lut,MOE_GPU_MMW_AFF=template), the
# microbenchmark's prefill rows (int8 / bf16 / streamed bf16; again with VARIANT), then
# `ds4_ab.sh` of the 43-layer model at DEPTHS (0,32768) for each of SETTINGS (default:
# the defaults, the copy-address option alone and VARIANT, twice). Prints each step's
# table; full logs in $OUT.
# STEPS picks steps (default "quick variant bench bench-variant": one 10-minute device
# call; then STEPS=ab in another).
#
# Here (has Rust):  bash scripts/device/carry_ds4.sh && bash scripts/device/gpu_kernels.sh --prepare
# There:            bash scripts/device/prefill_tiles.sh     # carry .dev/ds4 and .dev/gpu
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/prefill-tiles}
mkdir -p "$OUT"
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
t0=$(date +%s)
STEPS=${STEPS:-quick variant bench bench-variant}
step() { echo "== $1 ($(($(date +%s) - t0)) s in)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want quick; then
    step "gpu_kernels --quick"
    OUT=$OUT timeout 150 bash scripts/device/gpu_kernels.sh --quick > "$OUT/gk_quick.log" 2>&1
    echo "rc=$?"
    grep -E "^(mmw_|streamed tiles)" "$OUT/gk_quick.log"
    sed -n '/streamed bf16 tiles/,/^$/p' "$OUT/gk_quick.log"
    grep -E "FAIL|^parity:" "$OUT/gk_quick.log" | tail -12
fi
VARIANT=${VARIANT:-MOE_GPU_MMW_ISSUE=fast,MOE_GPU_MMW_E4=lut,MOE_GPU_MMW_AFF=template}
IFS=, read -r -a VENV <<< "$VARIANT"
if want variant; then
    # (staged.sh's parity step with VARIANT as the staged set)
    STAGED=$VARIANT OUT=$OUT/variant STEPS=quick bash scripts/device/staged.sh | grep -v '^staged: '
fi
if want bench; then
    step "gpu_kernels microbenchmark"
    mkdir -p "$OUT/bench"
    OUT=$OUT/bench timeout 240 bash scripts/device/gpu_kernels.sh --bench > "$OUT/gk_bench.log" 2>&1
    echo "rc=$?"
    grep -E "^(device-to-device|kernel |mmq_|mmb_|mmw_|grouped)" "$OUT/gk_bench.log"
fi
if want bench-variant; then
    step "gpu_kernels microbenchmark, $VARIANT"
    mkdir -p "$OUT/bench_variant"
    env "${VENV[@]}" OUT="$OUT/bench_variant" timeout 240 bash scripts/device/gpu_kernels.sh --bench \
        > "$OUT/gk_bench_variant.log" 2>&1
    echo "rc=$?"
    grep -E "^(mmw_|mmb_)" "$OUT/gk_bench_variant.log"
fi
if want ab; then
    # (staged.sh's A/B step: one ds4_ab.sh run a setting, each under its own limit)
    SETTINGS=${SETTINGS:-base MOE_GPU_MMW_ISSUE=fast $VARIANT base MOE_GPU_MMW_ISSUE=fast $VARIANT} \
        OUT=$OUT STEPS=ab bash scripts/device/staged.sh | grep -v '^staged: '
fi
step "done"
