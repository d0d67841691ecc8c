#!/usr/bin/env bash
# Prepares .dev/ (git-ignored) for the device sessions: the model split in two halves (a
# call carries at most 64 MiB), the pruned llama.cpp sources from the llama-cpp-python
# sdist, the gguf wheel for transformers, and the release binaries.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .dev/bin .dev/whl
model=$(scripts/fetch-model.sh)
split -n 2 -d "$model" .dev/tmp_part && mv .dev/tmp_part00 .dev/part1 && mv .dev/tmp_part01 .dev/part2
if [ ! -s .dev/llama.cpp.tar.xz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python -d "$tmp" llama-cpp-python==0.3.36
  tar xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
  v="$tmp/llama_cpp_python-0.3.36/vendor"
  rm -rf "$v"/llama.cpp/{models,docs,media,benches,examples,tests,tools/ui} \
         "$v"/llama.cpp/ggml/src/{ggml-et,ggml-metal,ggml-hexagon,ggml-sycl,ggml-vulkan,ggml-opencl}
  tar cJf .dev/llama.cpp.tar.xz -C "$v" llama.cpp
  rm -rf "$tmp"
fi
python3 -m pip download -q --no-deps --only-binary=:all: -d .dev/whl gguf==0.19.0
cargo build --release --workspace --quiet
cp target/release/moeserve target/release/libmoe_*.so .dev/bin/
strip .dev/bin/*  # the device call carries at most 64 MiB
du -sh .dev/*
