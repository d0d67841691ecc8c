#!/usr/bin/env bash
# Full-width DeepSeek-V4 (hidden 4096, 64 heads x 512, V4-Flash's attention / mHC /
# indexer shapes; EXPERTS experts, VOCAB tokens, 4 layers) with random Q8_0 weights
# (`moeserve synth --mix q8_0`), evaluated by llama.cpp's deepseek4 (libllama built on
# the CPU from the vendored llama-cpp-python sources, .dev/llama.cpp.tar.xz; needs cmake,
# e.g. `pip install cmake`) and by ours on the CPU backend, token by token; prints the
# per-position relative difference, top-1 agreement and correlation. Both engines
# quantise activations to 8 bits in their Q8_0 products, so they agree closely, not
# exactly. Takes ~15 min on 2 cores the first time (the libllama build is kept in $W).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${W:-${TMPDIR:-/tmp}/ds4-synth-llamacpp}
TOKS=${TOKS:-5,17,300,42,7,99,123,8}
mkdir -p "$W"
if [ ! -x "$W/llama_logits" ]; then
    tar xJf .dev/llama.cpp.tar.xz -C "$W"
    cmake -S "$W/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
        > "$W/cmake.log" 2>&1
    cmake --build "$W/build" -j "$(nproc)" --target llama > "$W/build.log" 2>&1
    LIBDIR=$(dirname "$(find "$W/build" -name 'libllama.so*' | head -1)")
    g++ -O2 -std=c++17 scripts/device/llama_logits.cpp -I "$W/llama.cpp/include" \
        -I "$W/llama.cpp/ggml/include" -L "$LIBDIR" -lllama -Wl,-rpath,"$LIBDIR" -o "$W/llama_logits"
fi
M=target/debug/moeserve
$M synth --out "$W/q8.gguf" --layers 4 --experts "${EXPERTS:-8}" --vocab "${VOCAB:-1000}" --mix q8_0 2>&1 | tail -1
"$W/llama_logits" "$W/q8.gguf" "$TOKS" decode "$W/llama.f32" 2> "$W/llama.log"
RUST_LOG=warn $M logits --model "$W/q8.gguf" --tokens "$TOKS" --mode decode --out "$W/ours.npy"
python3 - "$W" <<'PY'
import sys
import numpy as np
w = sys.argv[1]
ours = np.load(f"{w}/ours.npy")
ll = np.fromfile(f"{w}/llama.f32", dtype=np.float32).reshape(ours.shape)
rel = np.abs(ll - ours).max(1) / np.abs(ours).max(1)
corr = [float(np.corrcoef(a, b)[0, 1]) for a, b in zip(ll, ours)]
print(f"max|diff|/max|ours| per position: {np.round(rel, 4).tolist()}")
print(f"top-1 agreement {100 * (ll.argmax(1) == ours.argmax(1)).mean():.0f}%, correlation min {min(corr):.4f}")
PY
