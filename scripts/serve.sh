#!/usr/bin/env bash
# The main job: fetch the default model if needed, build (release), and serve it on the
# CPU through the OpenAI-compatible API at http://127.0.0.1:8016. Extra arguments go to
# `moeserve serve` (e.g. --port 9000, --model other.gguf, --api-key KEY).
set -euo pipefail
cd "$(dirname "$0")/.."
model=$(scripts/fetch-model.sh)
echo "building moeserve and its plugins (release; the first build takes a few minutes)..." >&2
cargo build --release --workspace --quiet
has_model=0
for a in "$@"; do [ "$a" = "--model" ] && has_model=1; done
if [ $has_model = 1 ]; then
  exec target/release/moeserve --config plugins.toml serve "$@"
fi
exec target/release/moeserve --config plugins.toml serve --model "$model" "$@"
