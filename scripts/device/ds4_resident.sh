#!/usr/bin/env bash
# The device-resident DeepSeek-V4 forward on one H200: parity on the tiny fixtures
# (scripts/device/ds4_gpu.sh: GPU vs CPU vs oracle, prefill vs decode, device glue vs
# host glue, greedy, the API), then the V4-Flash-width synthetic model (LAYERS layers)
# benchmarked with the device glue and, for comparison, the host glue. Carry .dev/ds4.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ds4-resident}
mkdir -p "$OUT"
bash scripts/device/ds4_gpu.sh 2>&1 | tee "$OUT/parity.log"
W=${W:-/tmp/ds4-synth} LAYERS=${LAYERS:-4} bash scripts/device/ds4_synth_gpu.sh 2>&1 | tee "$OUT/synth-device.log"
if [ -n "${HOST_GLUE_TOO:-}" ]; then
    MOE_DS4_HOST_GLUE=1 RUST_LOG=warn .dev/ds4/moeserve --config /tmp/ds4-synth/plugins.toml bench \
        --model /tmp/ds4-synth/synth.gguf --prompt-tokens "${PP:-128}" --gen-tokens "${TG:-16}" \
        --repetitions 1 --json 2>&1 | tee "$OUT/synth-hostglue.log"
fi
