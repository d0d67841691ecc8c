# Sourced by the device scripts: cudarc opens libcuda / libnvrtc at run time, so put
# the toolkit's library folders on the loader path.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/nvidia/lib64; do
    [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
if ! ls /usr/local/cuda/lib64/libnvrtc.so* >/dev/null 2>&1; then
    d=$(dirname "$(find / -xdev -name 'libnvrtc.so*' 2>/dev/null | head -1)" 2>/dev/null || true)
    [ -n "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
fi
export LD_LIBRARY_PATH

# cuda_plugins FILE [EXTRA]: a plugins.toml selecting the CUDA backend with the plugins
# carried in $DS4_DIR (default .dev/ds4: ggml and ROCmFPx quants, basic placement);
# EXTRA is appended.
cuda_plugins() {
    printf 'plugin_dir = "%s"\n[[plugin]]\nlibrary = "moe_backend_cuda"\n[[plugin]]\nlibrary = "moe_quant_ggml"\n[[plugin]]\nlibrary = "moe_quant_rocmfpx"\n[plugin.settings]\nfp2 = "affine"\n[[plugin]]\nlibrary = "moe_policy_basic"\n[devices]\nbackend = "cuda"\n%s' \
        "$(cd "${DS4_DIR:-.dev/ds4}" && pwd)" "${2:-}" > "$1"
}

# cpu_plugins FILE: a plugins.toml for the CPU backend with the plugins carried in
# $DS4_DIR (default .dev/ds4).
cpu_plugins() {
    printf 'plugin_dir = "%s"\n[[plugin]]\nlibrary = "moe_backend_cpu"\n[[plugin]]\nlibrary = "moe_quant_ggml"\n[[plugin]]\nlibrary = "moe_policy_basic"\n' \
        "$(cd "${DS4_DIR:-.dev/ds4}" && pwd)" > "$1"
}

# ncu_path: Nsight Compute's ncu (PATH, /opt/nvidia/nsight-compute, the toolkit), or a
# message and failure.
ncu_path() {
    local n
    n=$(command -v ncu || { ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null || true; } | head -1)
    [ -n "$n" ] || { echo "ncu (Nsight Compute) not found on PATH, in /opt/nvidia/nsight-compute or /usr/local/cuda/bin" >&2; return 1; }
    echo "$n"
}
