#!/usr/bin/env bash
# The switches staged on 2026-12-01 without a device, checked in one device call before
# any A/B (docs/notes/ds4-gpu-h200.md, top section): the kernels against f64
# (`gpu_kernels --quick` with MOE_GPU_IDX_TC=1 and MOE_GPU_FP4_PIPE=4: the tensor-core
# index product, the pipelined ROCmFP4 runs kernels), the DeepSeek-V4 fixtures with
# MOE_GPU_ATT_TC=1 and with MOE_DS4_IDX_SHORT=1 against a default run of the same
# build, and the pipelined kernel's rows of the mat-vec bench. Carry .dev/ds4 and
# .dev/gpu. Prints a table; $OUT gets the logs and the fixture JSONs.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/staged-checks}
mkdir -p "$OUT"
date -u +"run: %Y-%m-%d %H:%M UTC"
MOE_GPU_IDX_TC=1 MOE_GPU_FP4_PIPE=4 OUT="$OUT" bash scripts/device/gpu_kernels.sh --quick \
    > "$OUT/gpu_kernels_staged.log" 2>&1 || true
grep -E "rows visible|matmul .* x |id .* slots|parity:" "$OUT/gpu_kernels_staged.log" || true
for s in base MOE_GPU_ATT_TC=1 MOE_DS4_IDX_SHORT=1; do
    mkdir -p "$OUT/$s"
    env $([ "$s" = base ] || echo "$s") OUT="$OUT/$s" bash scripts/device/ds4_gpu.sh \
        > "$OUT/$s/ds4_gpu.log" 2>&1 || echo "$s: ds4_gpu.sh failed (see $OUT/$s/ds4_gpu.log)"
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
cols = ["gpu_vs_cpu", "gpu_prefill_vs_decode", "split_decode_vs_decode"]
def rows(s):
    try:
        return {(r["fixture"], r["type"]): r for r in json.load(open(f"{out}/{s}/ds4_gpu.json"))}
    except (OSError, ValueError):
        return {}
base = rows("base")
print("| setting | fixture | type | gpu vs cpu | pre vs dec | split vs dec | greedy | vs base |")
print("|---|---|---|---|---|---|---|---|")
for s in ["MOE_GPU_ATT_TC=1", "MOE_DS4_IDX_SHORT=1"]:
    for key, r in rows(s).items():
        b = base.get(key, {})
        # f32 / f16 / bf16 weights: the CPU's sums up to order (tolerance 1e-5).
        exact = key[1] in ("f32", "f16", "bf16")
        ok = all(r[c] <= 1e-5 for c in cols) and r["greedy_equals_oracle"] if exact else True
        moved = max(abs(r[c] - b.get(c, r[c])) for c in cols)
        print(f"| {s} | {key[0]} | {key[1]} | {r['gpu_vs_cpu']:.3g} | {r['gpu_prefill_vs_decode']:.3g} | "
              f"{r['split_decode_vs_decode']:.3g} | {r['greedy_equals_oracle']} | "
              f"{moved:.2g}{'' if ok else ' FAIL'} |")
PY
ONLY=fp4 bash scripts/device/dense_matvec_bench.sh > "$OUT/dense_fp4.log" 2>&1 || true
grep -E "matvec_fp4_runs_q8" "$OUT/dense_fp4.log" | head -40 || true
