#!/usr/bin/env bash
# Issue #6, point 5: ours vs llama.cpp on the GPU, same file. A V4-Flash-width DeepSeek-V4
# with every matrix Q8_0 (`moeserve synth --mix q8_0`, LAYERS layers: a type llama.cpp's
# deepseek4 runs), then llama.cpp's llama-bench (built here for CUDA sm_90 from the
# vendored sources of llama-cpp-python, .dev/llama.cpp.tar.xz) and `moeserve bench` on
# the CUDA backend with the same prompt / generation lengths. Prints a table of tok/s and
# ours / llama.cpp; $OUT gets both JSONs. Carry .dev/ds4 and .dev/llama.cpp.tar.xz.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-llamacpp-gpu}
W=${W:-${TMPDIR:-/tmp}/ds4-llamacpp-gpu}
PP=${PP:-512}
TG=${TG:-32}
mkdir -p "$OUT" "$W"
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
.dev/ds4/moeserve synth --out "$W/q8.gguf" --layers "${LAYERS:-4}" --mix q8_0 > "$W/synth.log" 2>&1 &
synth=$!
t0=$(date +%s)
tar xJf .dev/llama.cpp.tar.xz -C "$W"
cmake -S "$W/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
    > "$W/cmake.log" 2>&1 || { tail -20 "$W/cmake.log"; exit 1; }
cmake --build "$W/build" -j "$(nproc)" --target llama-bench > "$W/build.log" 2>&1 \
    || { tail -30 "$W/build.log"; exit 1; }
echo "llama.cpp (CUDA) built in $(( $(date +%s) - t0 )) s"
wait $synth
tail -1 "$W/synth.log"
cuda_plugins "$W/plugins.toml"
"$(find "$W/build" -name llama-bench -type f | head -1)" -m "$W/q8.gguf" -p "$PP" -n "$TG" -ngl 99 \
    -r 2 -o json > "$OUT/llamacpp.json" 2> "$W/llama-bench.log" \
    || { echo "llama-bench failed:"; tail -15 "$W/llama-bench.log"; }
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench --model "$W/q8.gguf" \
    --prompt-tokens "$PP" --gen-tokens "$TG" --repetitions 2 --json > "$OUT/ours.json"
python3 - "$OUT/llamacpp.json" "$OUT/ours.json" "$PP" "$TG" <<'PY'
import json, sys
ours = json.load(open(sys.argv[2]))
try:
    ll = json.load(open(sys.argv[1]))
    pp = next(r["avg_ts"] for r in ll if r["n_prompt"] > 0 and r["n_gen"] == 0)
    tg = next(r["avg_ts"] for r in ll if r["n_gen"] > 0 and r["n_prompt"] == 0)
except Exception as e:  # llama-bench failed: say so, keep ours
    print(f"llama.cpp: no result ({e})")
    pp = tg = float("nan")
print("| test | llama.cpp tok/s | ours tok/s | ours / llama.cpp |")
print("| --- | --- | --- | --- |")
for name, l, o in ((f"pp{sys.argv[3]}", pp, ours["pp_tok_s"]), (f"tg{sys.argv[4]}", tg, ours["tg_tok_s"])):
    print(f"| {name} | {l:.1f} | {o:.1f} | {o / l:.2f} |")
PY
