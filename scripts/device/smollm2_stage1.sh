#!/usr/bin/env bash
# Device session, stage 1 of 2 (the model is larger than one call may carry):
# stash the first half of the SmolLM2 GGUF and start building llama.cpp (CPU) from the
# pruned llama-cpp-python 0.3.36 sources in the background. Needs .dev/part1 and
# .dev/llama.cpp.tar.xz (made by scripts/device/prepare.sh).
set -euo pipefail
mkdir -p /root/w
cp .dev/part1 /root/w/part1
[ -n "${NO_LLAMA:-}" ] && { echo "stage 1 ok (model only)"; exit 0; }
tar xJf .dev/llama.cpp.tar.xz -C /root/w
setsid nohup bash -c '
  cd /root/w/llama.cpp &&
  cmake -B build -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF >/root/w/build.log 2>&1 &&
  cmake --build build -j 14 --target llama-bench >>/root/w/build.log 2>&1
  echo $? > /root/w/build.rc' >/dev/null 2>&1 < /dev/null &
echo "stage 1 ok: $(du -h /root/w/part1 | cut -f1) stashed, llama.cpp build started"
