#!/usr/bin/env bash
# DeepSeek-V4 tiny fixtures on the CUDA backend vs the CPU backend and the oracle, and the
# served API on the GPU. Here: build, then `strip -o .dev/ds4/...` moeserve and the cpu,
# cuda, ggml-quants and policy plugins (see the device notes). There: run with .dev/ds4
# carried. Prints a table; $OUT gets ds4_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 scripts/device/ds4_gpu.py
# The API on the GPU: serve the converted release-format model and ask for a completion.
W=${W:-/tmp/ds4gpu-work}
.dev/ds4/moeserve --config "$W/plugins-cuda.toml" serve --model "$W/tiny_release.f32.gguf" --port 8099 \
    > "$W/serve.log" 2>&1 &
pid=$!
for _ in $(seq 60); do curl -sf http://127.0.0.1:8099/health >/dev/null && break; sleep 0.5; done
curl -s http://127.0.0.1:8099/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt":"The router scores","max_tokens":12,"temperature":0}' | head -c 600; echo
kill $pid; wait $pid 2>/dev/null || true
