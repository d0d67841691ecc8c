#!/usr/bin/env bash
# Nsight Compute's detail pages (throughput, occupancy, registers, warp stalls) for the
# decode step's heaviest kernels: COUNT launches of each kernel matching KERNELS (a
# regex) in the single-token steps of the LAYERS-layer V4-Flash-shaped model built in
# memory (`bench --synth`, op by op: no graph), after the warm-up steps. Carry .dev/ds4;
# needs ncu on the device machine. $OUT gets ncu_detail.txt.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-ncu}
W=${W:-${TMPDIR:-/tmp}/ds4-ncu}
mkdir -p "$OUT" "$W"
cuda_plugins "$W/plugins.toml"
NCU=$(command -v ncu || { ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null || true; } | head -1)
[ -n "$NCU" ] || { echo "ncu (Nsight Compute) not found on PATH, in /opt/nvidia/nsight-compute or /usr/local/cuda/bin" >&2; exit 1; }
date -u +"run: %Y-%m-%d %H:%M UTC"
LAYERS=${LAYERS:-8}
KERNELS=${KERNELS:-mmvq_id_107|matvec_fp4_runs_q8|matvec_dense_rows|matvec_dense_rows_id|matvec_dense_rows_multi|ds4_hc_pre}
# SKIP matching launches (the prompt pass and the first decode steps: compilation,
# warm-up), then COUNT of them (about one decode step at 8 layers).
RUST_LOG=warn MOE_DS4_NO_GRAPH=1 "$NCU" --clock-control none \
    --kernel-name "regex:^(${KERNELS})\$" --launch-skip "${SKIP:-400}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --launch-count "${COUNT:-80}" \
    .dev/ds4/moeserve --config "$W/plugins.toml" bench --synth "${TEMPLATE:-6}" \
    --layers "$LAYERS" --depths 0 --prompt-tokens 1 --gen-tokens 4 --repetitions 1 --json \
    > "$OUT/ncu_detail.txt" 2> "$W/ncu.err" || { tail -20 "$W/ncu.err"; exit 1; }
grep -E "^  [a-z_0-9]+\(|Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Grid Size|Executed Ipc A|Issue Slots Busy|Waves Per SM|Stall|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Compute \(SM\) Th" \
    "$OUT/ncu_detail.txt" | tail -60
