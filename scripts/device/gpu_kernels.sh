#!/usr/bin/env bash
# ROCmFP2 GPU kernels on an NVIDIA device: parity vs the CPU reference, which kernel
# ran, and the microbenchmark table (backends/cuda/examples/gpu_kernels.rs).
#
# Here (has Rust):   scripts/device/gpu_kernels.sh --prepare   # builds .dev/gpu/gpu_kernels
# There (no Rust):   scripts/device/gpu_kernels.sh [--quick]   # carry .dev/gpu
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "${1:-}" = "--prepare" ]; then
    cargo build --release -p moe-backend-cuda --example gpu_kernels -p moe-quant-rocmfpx
    mkdir -p .dev/gpu
    # The quant plugin's cdylib: the example checks its CPU reference against its dot_q8.
    cp target/release/examples/gpu_kernels target/release/libmoe_quant_rocmfpx.so .dev/gpu/
    strip .dev/gpu/gpu_kernels .dev/gpu/libmoe_quant_rocmfpx.so
    exit 0
fi
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-$PWD/.dev/gpu/cache}
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
out=${OUT:-/tmp}
set -o pipefail
.dev/gpu/gpu_kernels "$@" 2>&1 | tee "$out/gpu_kernels.log"
