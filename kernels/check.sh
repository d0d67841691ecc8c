#!/usr/bin/env bash
# Compile-checks every GPU kernel source in kernels/gpu for the AMD (gfx1100, gfx1151)
# and NVIDIA (sm_90) targets with a bare clang: no CUDA or ROCm install needed. The
# shim header stands in for the device parts of cuda_runtime.h / hip_runtime.h.
# (--cuda-feature=+ptx80: with no CUDA install clang cannot infer a PTX ISA version.)
# Installs nothing; needs clang++-19 (or $CLANGXX) and python3. Fails on any error.
set -euo pipefail
cd "$(dirname "$0")/gpu"
CXX=${CLANGXX:-clang++-19}
if ! command -v "$CXX" >/dev/null 2>&1; then
    echo "kernels/check.sh: $CXX not found (apt-get install clang-19 lld-19 llvm-19)" >&2
    exit 1
fi
SHIM=shim/compile_check.h
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
status=0
for src in *.cu; do
    base=${src%.cu}
    for arch in gfx1100 gfx1151; do
        if "$CXX" -x hip --cuda-device-only --no-gpu-bundle-output --offload-arch=$arch \
            -nogpulib -nogpuinc -include "$SHIM" -Werror -O3 -S "$src" -o "$OUT/$base.$arch.s"; then
            echo "ok   $src $arch"
        else
            echo "FAIL $src $arch"; status=1
        fi
    done
    if "$CXX" -x cuda --cuda-device-only --cuda-gpu-arch=sm_90 -nocudalib -nocudainc \
        --cuda-feature=+ptx80 -include "$SHIM" -Werror -O3 -S "$src" -o "$OUT/$base.sm_90.ptx"; then
        echo "ok   $src sm_90"
    else
        echo "FAIL $src sm_90"; status=1
    fi
done
# Registers spilled to scratch on AMD (the code objects' metadata): none but the ones
# amd_spills lists (kernel, VGPRs it may spill), so a change that starts spilling fails.
if python3 - "$OUT" amd_spills <<'PY'; then echo "ok   AMD spills within amd_spills"; else status=1; fi
import glob, re, sys
out, allow_file = sys.argv[1], sys.argv[2]
allow = {}
for line in open(allow_file):
    line = line.split("#")[0].split()
    if line:
        allow[line[0]] = int(line[1])
bad = 0
for f in sorted(glob.glob(out + "/*.gfx*.s")):
    meta = open(f).read().split("amdhsa.kernels:", 1)[-1]
    for item in meta.split("\n  - ")[1:]:
        name = re.search(r"\.name:\s+(\S+)", item)
        spill = re.search(r"\.vgpr_spill_count:\s+(\d+)", item)
        if name and spill and int(spill.group(1)) > allow.get(name.group(1), 0):
            print(f"FAIL {f.rsplit('/', 1)[-1]}: {name.group(1)} spills {spill.group(1)} VGPRs "
                  f"(amd_spills allows {allow.get(name.group(1), 0)})")
            bad = 1
sys.exit(bad)
PY
# The AMD forms of the byte permutes (gpu_perm_nosign / gpu_perm_pos in rocmfpx.cu) against
# PTX prmt's rule: clang folds the self-test kernel, v_perm_b32 and all, into one constant.
if "$CXX" -x hip --cuda-device-only --no-gpu-bundle-output --offload-arch=gfx1151 -nogpulib \
    -nogpuinc -include "$SHIM" -Werror -O3 -DGPU_PERM_SELFTEST=1 -S rocmfpx.cu -o "$OUT/perm.s" &&
    awk '/^gpu_perm_selftest:/,/s_endpgm/' "$OUT/perm.s" > "$OUT/perm_kernel.s" &&
    grep -q 0x600d600d "$OUT/perm_kernel.s" && ! grep -q 0xbad0bad0 "$OUT/perm_kernel.s"; then
    echo "ok   AMD byte permutes = PTX prmt (gpu_perm_selftest, gfx1151)"
else
    echo "FAIL AMD byte permutes (gpu_perm_selftest: not folded to 0x600d600d)"; status=1
fi
# The A/B compile options (backends/cuda/src/kernels.rs, ab_defines) change code that the
# default build leaves out: every one of them at once (listed in ab_options, one NAME=VALUE
# a line; CI's NVRTC check reads the same list), for one AMD and the NVIDIA target.
mapfile -t OPTS < <(sed 's/^/-D/' ab_options)
for src in *.cu; do
    base=${src%.cu}
    if "$CXX" -x hip --cuda-device-only --no-gpu-bundle-output --offload-arch=gfx1151 \
        -nogpulib -nogpuinc -include "$SHIM" -Werror -O3 "${OPTS[@]}" -c "$src" -o "$OUT/$base.opts.o"; then
        echo "ok   $src gfx1151 (A/B options)"
    else
        echo "FAIL $src gfx1151 (A/B options)"; status=1
    fi
    if "$CXX" -x cuda --cuda-device-only --cuda-gpu-arch=sm_90 -nocudalib -nocudainc \
        --cuda-feature=+ptx80 -include "$SHIM" -Werror -O3 "${OPTS[@]}" -S "$src" -o "$OUT/$base.opts.ptx"; then
        echo "ok   $src sm_90 (A/B options)"
    else
        echo "FAIL $src sm_90 (A/B options)"; status=1
    fi
done
exit $status
