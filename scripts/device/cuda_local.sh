#!/usr/bin/env bash
# CUDA checks on a machine without a GPU or a CUDA install (the 2-core dev box): clang-19
# compiles a .cu for sm_90 against NVIDIA's PyPI wheels (headers, libdevice, ptxas),
# unpacked once into .dev/cuda (git-ignored; ~200 MB). Written 2026-12-04.
#   bash scripts/device/cuda_local.sh syntax FILE.cu     host + device compile check (a
#                                                        bench harness with its host code)
#   bash scripts/device/cuda_local.sh regs FILE.cu [RE]  ptxas registers / spills / shared
#                                                        memory of the kernels matching RE
# clang's PTX is not NVRTC's or nvcc's: register counts are indicative, not the device's.
# The device machine (nvcc, NVRTC) stays the reference; this saves its minutes.
set -euo pipefail
cd "$(dirname "$0")/../.."
CXX=${CLANGXX:-clang++-19}
ROOT=.dev/cuda/root
if [ ! -x "$ROOT/bin/ptxas" ]; then
    echo "cuda_local: fetching the CUDA 12.9 compiler and runtime wheels into .dev/cuda..." >&2
    mkdir -p .dev/cuda/whl .dev/cuda/unz "$ROOT"/{bin,include,nvvm} .dev/cuda/stub
    python3 -m pip download -q --no-deps -d .dev/cuda/whl \
        nvidia-cuda-nvcc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79
    for w in .dev/cuda/whl/*.whl; do python3 -m zipfile -e "$w" .dev/cuda/unz; done
    cp -r .dev/cuda/unz/nvidia/cuda_runtime/include/. .dev/cuda/unz/nvidia/cuda_nvcc/include/. "$ROOT/include/"
    cp -r .dev/cuda/unz/nvidia/cuda_nvcc/nvvm/. "$ROOT/nvvm/"
    cp .dev/cuda/unz/nvidia/cuda_nvcc/bin/ptxas "$ROOT/bin/" && chmod +x "$ROOT/bin/ptxas"
    # clang 19 knows CUDA up to 12.5: declare that (the launch syntax needs a version),
    # and give its runtime wrapper the one curand header it includes.
    echo "CUDA Version 12.5.0" > "$ROOT/version.txt"
    touch .dev/cuda/stub/curand_mtgp32_kernel.h
fi
what=${1:?syntax or regs}
src=${2:?a .cu file}
flags=(-x cuda --cuda-path="$ROOT" --cuda-gpu-arch=sm_90 -Wno-unknown-cuda-version -std=c++17
    -I.dev/cuda/stub -Xclang -target-sdk-version=12.5)
case "$what" in
syntax)
    "$CXX" "${flags[@]}" -fsyntax-only "$src"
    echo "cuda_local: $src compiles for the host and sm_90"
    ;;
regs)
    ptx=$(mktemp --suffix=.ptx)
    trap 'rm -f "$ptx" "$ptx.cubin"' EXIT
    "$CXX" "${flags[@]}" -O3 --cuda-device-only -S -o "$ptx" "$src"
    "$ROOT/bin/ptxas" -arch=sm_90 -v "$ptx" -o "$ptx.cubin" 2>&1 |
        awk -v re="${3:-.}" '/Compiling entry/ { name = $0; sub(/.*function .\x27?/, "", name);
            sub(/\x27.*/, "", name); keep = name ~ re; next }
            keep && /spill|Used/ { sub(/^ptxas info *: */, ""); sub(/^ */, ""); print name ": " $0 }'
    ;;
*)
    echo "cuda_local: unknown command $what (syntax or regs)" >&2
    exit 1
    ;;
esac
