#!/usr/bin/env bash
# The device's limits as `moeserve bench --limits` measures them (streaming bandwidth,
# ROCmFP2 matrix rate, the dense mat-vec's read rate on decode shapes), with a tiny
# committed fixture as the loaded model. Carry .dev/ds4.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
W=${W:-/tmp/ds4-limits}
mkdir -p "$W"
cuda_plugins "$W/plugins.toml"
.dev/ds4/moeserve --config "$W/plugins.toml" convert tests/fixtures/deepseek4/tiny_trained --out "$W/t.gguf" >/dev/null 2>&1
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench --model "$W/t.gguf" --prompt-tokens 8 \
    --gen-tokens 4 --repetitions 1 --limits --json > "$W/limits.json"
python3 - "$W/limits.json" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
print(f"stream {b['stream_bandwidth_bytes_s']/1e9:.0f} GB/s, copy {(b.get('copy_bandwidth_bytes_s') or 0)/1e9:.0f} GB/s, matrix {b['matrix_rate_flop_s']/1e12:.0f} TFLOP/s")
for d in b["dense_matvec"]:
    print(f"dense mat-vec {d['shape']}: {d['bytes_s']/1e9:.0f} GB/s")
PY
