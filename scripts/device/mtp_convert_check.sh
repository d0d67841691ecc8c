#!/usr/bin/env bash
# `convert --mtp` against llama.cpp's converter with `--mtp` (the llama-cpp-python 0.3.36
# sources; torch + transformers, as on the device machine): both write tiny_release_mtp's
# MTP block as a drafter file; the check lists every tensor name, type, dims and value
# difference, and the nextn / block-count metadata. Written 2026-12-05 without torch
# here; first run pending. Carry .dev/llama.cpp.tar.xz and .dev/ds4. $OUT gets the log.
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${W:-${TMPDIR:-/tmp}/mtp-convert}
OUT=${OUT:-/tmp/mtp-convert-out}
mkdir -p "$W" "$OUT"
[ -d "$W/llama.cpp" ] || tar xJf .dev/llama.cpp.tar.xz -C "$W"
CK=tests/fixtures/deepseek4/tiny_release_mtp
python3 scripts/device/llamacpp_convert.py "$W/llama.cpp" "$CK" "$W/theirs.gguf" --mtp \
    > "$W/convert.log" 2>&1 || { tail -20 "$W/convert.log"; exit 1; }
# (its converter may name the drafter file itself: take the newest GGUF it wrote)
theirs=$(ls -t "$W"/*.gguf | grep -v ours.gguf | head -1)
. scripts/device/cuda_env.sh
cpu_plugins "$W/plugins.toml"
.dev/ds4/moeserve --config "$W/plugins.toml" convert "$CK" --mtp --type f32 --out "$W/ours.gguf" 2>&1 | tail -1
PYTHONPATH="$W/llama.cpp/gguf-py" python3 scripts/device/gguf_diff.py "$theirs" "$W/ours.gguf" \
    | tee "$OUT/mtp_convert_check.log"
