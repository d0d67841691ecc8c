#!/usr/bin/env bash
# Fill a kernel cache here, without a GPU, so that a device call skips NVRTC's compile of
# the CUDA kernels (~76 s on a fresh device machine: a fifth of a short call). The cache
# key is the source, the options and NVRTC's major.minor version, so this compiles with
# the device's NVRTC release (CUDA 13.0, from NVIDIA's PyPI wheel, fetched once into
# .dev/cuda) and the same options the backend uses (the A/B switches read from the
# environment, as there). Needs .dev/gpu/gpu_kernels (scripts/device/gpu_kernels.sh
# --prepare). Carry .dev/kc and set MOE_KERNEL_CACHE=$PWD/.dev/kc on the device.
#   scripts/device/kernel_cache.sh [ARCH]   # default sm_90 (H100 and H200)
set -euo pipefail
cd "$(dirname "$0")/../.."
wheel=nvidia-cuda-nvrtc==13.0.88
dir=.dev/cuda/nvrtc13
if ! ls "$dir"/nvidia/cu13/lib/libnvrtc.so* > /dev/null 2>&1; then
    mkdir -p .dev/cuda/whl13 "$dir"
    echo "kernel_cache: fetching $wheel into .dev/cuda..." >&2
    python3 -m pip download -q --no-deps -d .dev/cuda/whl13 "$wheel"
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        .dev/cuda/whl13/nvidia_cuda_nvrtc-*.whl "$dir"
fi
lib=$(dirname "$(ls "$dir"/nvidia/*/lib/libnvrtc.so* | head -1)")
[ -x .dev/gpu/gpu_kernels ] || { echo "kernel_cache: run scripts/device/gpu_kernels.sh --prepare first" >&2; exit 1; }
MOE_KERNEL_CACHE=$PWD/.dev/kc LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" \
    .dev/gpu/gpu_kernels --compile "${1:-sm_90}"
ls -la .dev/kc
