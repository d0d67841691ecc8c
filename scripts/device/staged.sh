#!/usr/bin/env bash
# A set of kernel options checked and measured together in as few device calls as
# possible (each step under its own time limit, so a hang in one still returns the
# others). STAGED (VAR=VALUE[,VAR=VALUE...]) is the set under test; by default the
# options made the CUDA backend's default on 2026-12-05 turned off (the streamed tiles'
# MOE_GPU_MMW_ISSUE / _E4 / _AFF, MOE_GPU_RF2_ID, MOE_GPU_FP4_LOOP, MOE_GPU_POLICY,
# MOE_GPU_HCF_SUM and MOE_GPU_PDL_EARLY), so the earlier paths stay checked. Each option
# gives the same sums either way by construction, so the fixtures must give the
# committed digits.
#
# Steps (STEPS, default "policy quick fixtures": one device call of under 10 minutes):
#   policy    nvcc: the value `createpolicy.fractional.L2::evict_first` gives on this
#             device against the immediate the kernels name (GPU_POLICY_IMM) (they must be equal)
#   quick     gpu_kernels --quick with STAGED (parity: every case ALL OK)
#   fixtures  ds4_gpu.sh with STAGED (GPU vs CPU vs oracle, prefill vs decode, the API)
#   ab        ds4_ab.sh at DEPTHS (0,32768) for SETTINGS (default: base and STAGED, twice)
#             - a second call: STEPS=ab
#
# Here (has Rust):  bash scripts/device/carry_ds4.sh && bash scripts/device/gpu_kernels.sh --prepare
# There:            bash scripts/device/staged.sh     # carry .dev/ds4 and .dev/gpu
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
OUT=${OUT:-/tmp/staged}
mkdir -p "$OUT"
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
t0=$(date +%s)
STEPS=${STEPS:-policy quick fixtures}
STAGED=${STAGED:-MOE_GPU_MMW_ISSUE=0,MOE_GPU_MMW_E4=0,MOE_GPU_MMW_AFF=0,MOE_GPU_RF2_ID=0,MOE_GPU_FP4_LOOP=0,MOE_GPU_POLICY=0,MOE_GPU_HCF_SUM=0,MOE_GPU_PDL_EARLY=0}
IFS=, read -r -a SENV <<< "$STAGED"
step() { echo "== $1 ($(($(date +%s) - t0)) s in)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }
echo "staged: $STAGED"

if want policy; then
    step "policy value"
    # (the immediate is GPU_EF_POLICY in kernels/gpu/common.cuh)
    imm=$(sed -n 's/^#define GPU_EF_POLICY "\(0x[0-9A-Fa-f]*\)"/\1/p' kernels/gpu/common.cuh)
    cat > "$OUT/policy.cu" <<'CU'
#include <cstdio>
__global__ void k(unsigned long long* o) {
    unsigned long long p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    *o = p;
}
int main() {
    unsigned long long *d, h = 0;
    cudaMalloc(&d, 8);
    k<<<1, 1>>>(d);
    cudaMemcpy(&h, d, 8, cudaMemcpyDeviceToHost);
    printf("0x%016llX\n", h);
    return cudaGetLastError() != cudaSuccess;
}
CU
    NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    if "$NVCC" -arch=sm_90 -o "$OUT/policy" "$OUT/policy.cu" > "$OUT/policy.log" 2>&1; then
        got=$("$OUT/policy")
        if [ "${got,,}" = "${imm,,}" ]; then echo "policy: $got = the immediate (ok)"
        else echo "policy: MISMATCH: createpolicy gives $got, the kernels name $imm"; fi
    else
        echo "policy: nvcc failed"; tail -5 "$OUT/policy.log"
    fi
fi
if want quick; then
    step "gpu_kernels --quick, staged"
    mkdir -p "$OUT/quick"
    env "${SENV[@]}" OUT="$OUT/quick" timeout 170 bash scripts/device/gpu_kernels.sh --quick \
        > "$OUT/gk_quick.log" 2>&1
    echo "rc=$?"
    grep -E "^mmw_" "$OUT/gk_quick.log"
    sed -n '/streamed bf16 tiles/,/^$/p' "$OUT/gk_quick.log"
    grep -E "FAIL|^parity:" "$OUT/gk_quick.log" | tail -12 || tail -3 "$OUT/gk_quick.log"
fi
if want fixtures; then
    step "fixtures (ds4_gpu.sh), staged"
    env "${SENV[@]}" OUT="$OUT" timeout 200 bash scripts/device/ds4_gpu.sh > "$OUT/fixtures.log" 2>&1
    echo "rc=$?"
    grep -E "^(fixture|tiny|prefix cache)" "$OUT/fixtures.log"
    tail -c 300 "$OUT/fixtures.log"; echo
    # The staged options change no sum: every number of every row as committed.
    python3 - "$OUT/ds4_gpu.json" docs/notes/ds4-gpu-h200.json <<'PY'
import json, os, sys
if not os.path.exists(sys.argv[1]):
    sys.exit("fixtures: no ds4_gpu.json (the run failed; see fixtures.log)")
new, old = (json.load(open(p)) for p in sys.argv[1:])
key = lambda r: (r["fixture"], r["type"])
ref = {key(r): r for r in old}
for r in new:
    o = ref.get(key(r))
    diff = [k for k in r if k != "gpu_seconds" and o is not None and k in o and r[k] != o[k]]
    new_cols = [f"{k} {r[k]}" for k in r if o is not None and k not in o]
    print(f"{key(r)}: " + ("no committed row" if o is None else
                          "the committed numbers" if not diff else
                          "DIFFERS: " + ", ".join(f"{k} {o.get(k)} -> {r[k]}" for k in diff))
          + (f" (new: {', '.join(new_cols)})" if new_cols else ""))
PY
fi
if want ab; then
    # One ds4_ab.sh run a setting (each builds the model again), so a setting that fails
    # leaves the others' rows.
    n=0
    for setting in ${SETTINGS:-base $STAGED base $STAGED}; do
        n=$((n + 1))
        step "ds4_ab $setting"
        OUT=$OUT/ab$n DEPTHS=${DEPTHS:-0,32768} timeout 140 bash scripts/device/ds4_ab.sh "$setting" \
            > "$OUT/ab$n.log" 2>&1 || echo "setting $setting failed (rc=$?)"
        grep "^| $setting " "$OUT/ab$n.log" || tail -3 "$OUT/ab$n.log"
    done
fi
step "done"
