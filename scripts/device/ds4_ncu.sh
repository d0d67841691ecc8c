#!/usr/bin/env bash
# Where a decode step's GPU time goes, from Nsight Compute's kernel durations (each kernel
# timed alone, caches and clocks left as they are) rather than CUDA events: STEPS decode
# steps of the LAYERS-layer V4-Flash-shaped model built in memory (`bench --synth`),
# summed per kernel name and set against the graph-replayed step time of the same build
# (`bench`, same run). The difference is the launch gaps a graph still pays. Carry
# .dev/ds4; needs ncu (Nsight Compute) on the device machine. $OUT gets ncu.csv and
# ncu_steps.json.
# DETAIL=1 instead: ncu's detail pages (throughput, occupancy, registers, warp stalls)
# for COUNT (80) launches of the kernels matching KERNELS (a regex) after SKIP (400) of
# them (the prompt pass and first steps), LAYERS (8) layers, op by op; $OUT gets
# ncu_detail.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-ncu}
W=${W:-${TMPDIR:-/tmp}/ds4-ncu}
mkdir -p "$OUT" "$W"
cuda_plugins "$W/plugins.toml"
NCU=$(ncu_path)
date -u +"run: %Y-%m-%d %H:%M UTC"
if [ -n "${DETAIL:-}" ]; then
    KERNELS=${KERNELS:-mmvq_id_107|matvec_fp4_runs_q8|matvec_dense_rows|matvec_dense_rows_id|matvec_dense_rows_multi|ds4_hc_pre}
    RUST_LOG=warn MOE_DS4_NO_GRAPH=1 "$NCU" --clock-control none \
        --kernel-name "regex:^(${KERNELS})\$" --launch-skip "${SKIP:-400}" \
        --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --launch-count "${COUNT:-80}" \
        .dev/ds4/moeserve --config "$W/plugins.toml" bench --synth "${TEMPLATE:-6}" \
        --layers "${LAYERS:-8}" --depths 0 --prompt-tokens 1 --gen-tokens 4 --repetitions 1 --json \
        > "$OUT/ncu_detail.txt" 2> "$W/ncu.err" || { tail -20 "$W/ncu.err"; exit 1; }
    grep -E "^  [a-z_0-9]+ \(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued" \
        "$OUT/ncu_detail.txt" | tail -60
    exit 0
fi
LAYERS=${LAYERS:-43}
STEPS=${STEPS:-2}
# 1 prompt token + 8 decoded, warm-up and measured run: 18 single-token steps; skip about
# the first 6 (kernel compilation, warm-up), time STEPS whole steps (get_rows_dense, the
# embedding lookup, starts each). PER_STEP estimates a step's launches (~25 a layer
# since the fused mHC sites; the margin of steps absorbs the estimate's error).
PER_STEP=$((LAYERS * 25 + 20))
RUST_LOG=warn MOE_DS4_NO_GRAPH=1 "$NCU" --clock-control none --cache-control none \
    --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    --launch-skip $((6 * PER_STEP)) --launch-count $(((STEPS + 1) * PER_STEP)) \
    .dev/ds4/moeserve --config "$W/plugins.toml" bench --synth "${TEMPLATE:-6}" \
    --layers "$LAYERS" --depths 0 --prompt-tokens 1 --gen-tokens 8 --repetitions 1 --json \
    > "$W/ncu.out" 2> "$W/ncu.err" || { tail -20 "$W/ncu.err"; exit 1; }
grep '^"' "$W/ncu.out" > "$OUT/ncu.csv"
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench --synth "${TEMPLATE:-6}" \
    --layers "$LAYERS" --depths 0 --prompt-tokens 1 --gen-tokens 32 --repetitions 1 --json \
    > "$W/graph.json"
python3 - "$OUT/ncu.csv" "$W/graph.json" "$STEPS" "$OUT/ncu_steps.json" <<'PY'
import csv, json, sys
rows = list(csv.DictReader(open(sys.argv[1])))
# Durations in ns, printed with thousands separators; the first row holds the units.
for r in rows:
    r["gpu__time_duration.sum"] = r.get("gpu__time_duration.sum", "").replace(",", "")
rows = [r for r in rows if r["gpu__time_duration.sum"].replace(".", "").isdigit()]
steps, cur = [], None
for r in rows:
    name = r["Kernel Name"].split("(")[0]
    if name == "get_rows_dense":
        cur = {}
        steps.append(cur)
    if cur is not None:
        k = cur.setdefault(name, [0, 0.0])
        k[0] += 1
        k[1] += float(r["gpu__time_duration.sum"]) / 1e3
want = int(sys.argv[3])
whole = steps[:-1][:want]  # the last one may be cut short
if not whole:
    sys.exit("no whole decode step in the profile")
tot = {}
for s in whole:
    for n, (c, us) in s.items():
        t = tot.setdefault(n, [0, 0.0])
        t[0] += c
        t[1] += us
g = json.load(open(sys.argv[2]))["depths"][0]
step_us = 1e6 / g["tg_tok_s"]
ns = len(whole)
ksum = sum(us for _, us in tot.values()) / ns
launches = sum(c for c, _ in tot.values()) / ns
print(f"{ns} decode steps timed by ncu: {launches:.0f} launches, {ksum:.0f} us of kernel time per step; "
      f"graph-replayed step {step_us:.0f} us ({g['tg_tok_s']:.1f} tok/s): "
      f"{step_us - ksum:.0f} us ({100 * (step_us - ksum) / step_us:.0f}%) between kernels")
print("| kernel | launches per step | us per step | us per launch | share of kernel time |")
print("|---|---|---|---|---|")
for n, (c, us) in sorted(tot.items(), key=lambda kv: -kv[1][1]):
    print(f"| {n} | {c / ns:.0f} | {us / ns:.1f} | {us / c:.2f} | {100 * us / ns / ksum:.1f}% |")
json.dump({"steps": ns, "launches_per_step": launches, "kernel_us_per_step": ksum,
           "graph_step_us": step_us, "kernels": {n: {"launches": c / ns, "us": us / ns}
                                                 for n, (c, us) in tot.items()}},
          open(sys.argv[4], "w"), indent=1)
PY
