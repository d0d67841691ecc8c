#!/usr/bin/env bash
# The default model on this machine's CPU: ours (release build) against llama.cpp's
# llama-bench built here for the CPU (GGML_NATIVE) from the llama-cpp-python 0.3.36
# sources (.dev/llama.cpp.tar.xz when scripts/device/prepare.sh made it, else the sdist
# from PyPI). Needs cmake (`pip install cmake`); the first build takes ~5 min on 2 cores
# and is kept in $W. Prints cpu_vs_llamacpp.py's table; JSON to $OUT_JSON.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${W:-${TMPDIR:-/tmp}/cpu-llamacpp}
THREADS=${THREADS:-1,$(nproc)}
OUT_JSON=${OUT_JSON:-$W/cpu_bench.json}
mkdir -p "$W"
if [ ! -x "$W/build/bin/llama-bench" ]; then
  if [ -s .dev/llama.cpp.tar.xz ]; then
    tar xJf .dev/llama.cpp.tar.xz -C "$W"
  else
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$W" llama-cpp-python==0.3.36
    tar xzf "$W"/llama_cpp_python-0.3.36.tar.gz -C "$W"
    mv "$W"/llama_cpp_python-0.3.36/vendor/llama.cpp "$W/llama.cpp"
  fi
  echo "building llama-bench (CPU) in $W ..." >&2
  cmake -S "$W/llama.cpp" -B "$W/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_CUDA=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      > "$W/cmake.log" 2>&1
  cmake --build "$W/build" -j "$(nproc)" --target llama-bench > "$W/build.log" 2>&1
fi
model=$(scripts/fetch-model.sh)
cargo build --release --workspace --quiet
python3 scripts/bench/cpu_vs_llamacpp.py --moeserve target/release/moeserve --config plugins.toml \
    --llama-bench "$W/build/bin/llama-bench" --model "$model" --threads "$THREADS" \
    --reps "${REPS:-3}" --out "$OUT_JSON"
