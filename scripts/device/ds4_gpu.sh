#!/usr/bin/env bash
# DeepSeek-V4 tiny fixtures on the CUDA backend vs the CPU backend and the oracle, and the
# served API on the GPU. Here: build, then `strip -o .dev/ds4/...` moeserve and the cpu,
# cuda, ggml-quants and policy plugins (see the device notes). There: run with .dev/ds4
# carried. Prints a table; $OUT gets ds4_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 scripts/device/ds4_gpu.py
# The API on the GPU: serve the converted release-format model and ask for a completion.
W=${W:-/tmp/ds4gpu-work}
.dev/ds4/moeserve --config "$W/plugins-cuda.toml" serve --model "$W/tiny_release.f32.gguf" --port 8099 \
    > "$W/serve.log" 2>&1 &
pid=$!
for _ in $(seq 60); do curl -sf http://127.0.0.1:8099/health >/dev/null && break; sleep 0.5; done
curl -s http://127.0.0.1:8099/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt":"The router scores","max_tokens":12,"temperature":0}' | head -c 600; echo
# The prefix cache on the GPU path: a prompt that extends all a slot holds continues its
# state; its answer must be a full prefill's (the same text, logprobs within 1e-4).
python3 - <<'PY' || echo "prefix cache on CUDA: FAILED"
import json, urllib.request
def post(path, body):
    r = urllib.request.Request("http://127.0.0.1:8099" + path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=120))
ids = post("/tokenize", {"content": "The router scores the experts and"})["tokens"]
post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
body = {"prompt": ids + ids[:5], "max_tokens": 6, "temperature": 0, "logprobs": 2}
hit, full = post("/v1/completions", body), post("/v1/completions", {**body, "cache_prompt": False})
n = hit["usage"]["timings"]["cached_prefix_tokens"]
again = post("/v1/completions", {**body, "cache_prompt": False})
def lp(r):
    return r["choices"][0]["logprobs"]["token_logprobs"]
def gap(a, b):
    return max(abs(x - y) for x, y in zip(lp(a), lp(b)))
# The cached start's last chunk (5 tokens) runs the decode-width kernels where the full
# prompt's runs the matrix-unit tiles: the same text, logprobs within 1e-4 (a sum-order gap).
text = hit["choices"][0]["text"] == full["choices"][0]["text"]
ok = text and gap(hit, full) <= 1e-4
print(f"prefix cache on CUDA: cached {n} of {len(ids) + 5}, the answer of a full prefill: {'yes' if ok else 'NO'}"
      f" (text {'same' if text else 'DIFFERS'}, logprobs differ by {gap(hit, full):.3g};"
      f" two full prefills differ by {gap(full, again):.3g})")
if not text:
    print("  cached:", repr(hit["choices"][0]["text"]), "full:", repr(full["choices"][0]["text"]))
PY
kill $pid; wait $pid 2>/dev/null || true
