#!/usr/bin/env bash
# DeepSeek-V4 interop with llama.cpp's deepseek4 (the llama.cpp vendored in the
# llama-cpp-python 0.3.36 sources), run on the device machine (CPU side), one table out:
#   1. the release-format tiny checkpoint + transformers oracle (make_release_fixture.py);
#   2. llama.cpp's convert_hf_to_gguf.py on it (llamacpp_convert.py) and ours (moeserve convert);
#   3. llama.cpp (llama_logits.cpp against libllama) and ours (moeserve logits) on BOTH files,
#      batched and one token at a time;
#   4. ds4_compare.py: every engine x file x mode vs the oracle, and ours vs llama.cpp.
# Carry: .dev/llama.cpp.tar.xz (scripts/device/prepare.sh) and .dev/ds4 (stripped moeserve +
# CPU plugins built here). $OUT gets the JSON and fixture.tar (the fixture and llama.cpp's
# GGUF of it, as committed under tests/fixtures/deepseek4).
set -euo pipefail
W=${W:-${TMPDIR:-/tmp}/ds4-llamacpp}
mkdir -p "$W" "$OUT"
t0=$(date +%s)
tar xJf .dev/llama.cpp.tar.xz -C "$W"
cmake -S "$W/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \
  > "$W/cmake.log" 2>&1 || { tail -20 "$W/cmake.log"; exit 1; }
cmake --build "$W/build" -j "$(nproc)" --target llama > "$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
LIBDIR=$(dirname "$(find "$W/build" -name 'libllama.so*' | head -1)")
g++ -O2 -std=c++17 scripts/device/llama_logits.cpp -I "$W/llama.cpp/include" -I "$W/llama.cpp/ggml/include" \
  -L "$LIBDIR" -lllama -Wl,-rpath,"$LIBDIR" -o "$W/llama_logits"
echo "llama.cpp built in $(( $(date +%s) - t0 )) s" >&2

FX="$W/fx"
mkdir -p "$FX"
python3 tests/fixtures/deepseek4/make_release_fixture.py --out "$FX" 2>&1 | grep -v Warn | tail -2
CK="$FX/tiny_release"
python3 scripts/device/llamacpp_convert.py "$W/llama.cpp" "$CK" "$FX/tiny_release.llamacpp.gguf" > "$W/convert.log" 2>&1 \
  || { tail -20 "$W/convert.log"; exit 1; }
cat > "$W/plugins.toml" <<TOML
plugin_dir = "$PWD/.dev/ds4"
[[plugin]]
library = "moe_backend_cpu"
[plugin.settings]
activation = "f32"
[[plugin]]
library = "moe_quant_ggml"
[[plugin]]
library = "moe_policy_basic"
TOML
M=".dev/ds4/moeserve --config $W/plugins.toml"
$M convert "$CK" --out "$W/ours.gguf" 2>&1 | tail -1
cp "$FX/tiny_release.llamacpp.gguf" "$W/llamacpp.gguf"
TOKS=$(python3 -c "import numpy as np; print(','.join(map(str, np.load('$FX/tiny_release.npz')['tokens'])))")
for f in llamacpp ours; do
  # llama.cpp's batched path, also split into ubatches of 64 (a diagnostic: does the
  # batched result depend on how the batch is cut?).
  "$W/llama_logits" "$W/$f.gguf" "$TOKS" prefill "$W/llama.$f.prefill64.f32" 64 2>"$W/ll.$f.u64.log" || true
  for mode in prefill decode; do
    "$W/llama_logits" "$W/$f.gguf" "$TOKS" $mode "$W/llama.$f.$mode.f32" 2>"$W/ll.$f.$mode.log" \
      || { echo "llama.cpp on $f.gguf ($mode) failed:"; grep -v "^llama_model_loader\|^print_info\|^load" "$W/ll.$f.$mode.log" | tail -8; }
    RUST_LOG=warn $M logits --model "$W/$f.gguf" --tokens "$TOKS" --mode $mode --out "$W/ours.$f.$mode.npy" \
      2>"$W/ours.$f.$mode.log" || { echo "ours on $f.gguf ($mode) failed:"; tail -3 "$W/ours.$f.$mode.log"; }
  done
done
cp "$FX/tiny_release.npz" "$W/"
python3 scripts/device/ds4_compare.py "$W" "$OUT/ds4_llamacpp.json"
# The fixture as made here (transformers of this machine) + llama.cpp's GGUF of it.
tar cf "$OUT/fixture.tar" -C "$FX" .
