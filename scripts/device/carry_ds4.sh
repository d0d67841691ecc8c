#!/usr/bin/env bash
# Build (release) and strip what the DeepSeek-V4 device scripts carry in .dev/ds4:
# moeserve and the cpu, cuda, ggml-quants, rocmfpx and policy plugins. The kernels'
# sources are compiled into the cuda plugin, so rerun this after editing kernels/gpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -q -p moe-host -p moe-backend-cpu -p moe-backend-cuda \
    -p moe-quant-ggml -p moe-quant-rocmfpx -p moe-policy-basic
mkdir -p .dev/ds4
for f in moeserve libmoe_backend_cpu.so libmoe_backend_cuda.so libmoe_quant_ggml.so \
    libmoe_quant_rocmfpx.so libmoe_policy_basic.so; do
    strip -o ".dev/ds4/$f" "target/release/$f"
done
ls -la .dev/ds4
