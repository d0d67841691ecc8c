#!/usr/bin/env bash
# A decode step's MoE mHC site timed after a streaming product, and where its time goes
# (scripts/device/hc_site_bench.cu). Needs nvcc (the device machine); prints markdown.
# REPS: launches a graph; HOG_MB: the product's bytes (default 18.9, wo_b's). DEFINES:
# extra compile options (A/B builds of the kernel).
set -euo pipefail
cd "$(dirname "$0")/../.."
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
bin=${TMPDIR:-/tmp}/hc_site_bench
date -u +"run: %Y-%m-%d %H:%M UTC"
# The backend's default defines (kernels/gpu/default_options), as it compiles the kernels.
defs=$(grep -v '^#' kernels/gpu/default_options | sed 's/^/-D/' | tr '\n' ' ')
for stamps in 0 1; do
    extra=""
    [ "$stamps" = 1 ] && extra="-DHCF_STAMPS=1"
    # shellcheck disable=SC2086
    "$NVCC" -O3 -std=c++17 -arch=sm_90 $defs $extra ${DEFINES:-} -o "$bin$stamps" scripts/device/hc_site_bench.cu
done
echo "## plain build"
"${bin}0" "${REPS:-200}" "${HOG_MB:-18.9}"
echo
echo "## with the phase stamps (their stores add a little)"
"${bin}1" "${REPS:-200}" "${HOG_MB:-18.9}"
