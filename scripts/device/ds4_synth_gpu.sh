#!/usr/bin/env bash
# V4-Flash-width synthetic DeepSeek-V4 (real type mix, LAYERS layers, all 256 experts, the
# real vocabulary) written by `moeserve synth`, then `moeserve bench` on the CUDA backend.
# Carry .dev/ds4 (stripped moeserve + cpu/cuda/ggml/rocmfpx/policy plugins). Prints the
# bench JSON and the weight bytes one decoded token reads; the fraction of the bandwidth
# limit is computed in the notes with the copy bandwidth of scripts/device/gpu_kernels.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
W=${W:-${TMPDIR:-/tmp}/ds4-synth}
LAYERS=${LAYERS:-4}
mkdir -p "$W"
cat > "$W/plugins.toml" <<TOML
plugin_dir = "$PWD/.dev/ds4"
[[plugin]]
library = "moe_backend_cuda"
[[plugin]]
library = "moe_quant_ggml"
[[plugin]]
library = "moe_quant_rocmfpx"
[[plugin]]
library = "moe_policy_basic"
[devices]
backend = "cuda"
TOML
date -u +"run: %Y-%m-%d %H:%M UTC"
t0=$(date +%s)
.dev/ds4/moeserve --config "$W/plugins.toml" synth --out "$W/synth.gguf" --layers "$LAYERS" 2>&1 | tail -1
echo "synth: $(( $(date +%s) - t0 )) s"
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench --model "$W/synth.gguf" \
    --prompt-tokens "${PP:-128}" --gen-tokens "${TG:-16}" --repetitions 1 --json
