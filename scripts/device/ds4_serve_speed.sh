#!/usr/bin/env bash
# Served decode speed against the benchmark's, on one H200 (written 2026-12-01, first run
# pending): a V4-Flash-shaped synthetic file of LAYERS (6) layers, `moeserve bench` on it
# (depth 0, PP prompt tokens, TG decoded, argmax on the host), then `moeserve serve` on
# the same file and /v1/completions with the same prompt length as token ids, TG tokens,
# at temperature 0 and at the API's default 1.0 (the host sampler on every token); the
# server's own usage.timings.decode_tokens_per_sec and the client's wall time. Prints a
# table of tok/s and served / bench. Carry .dev/ds4; $OUT gets the JSONs.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-serve-speed}
W=${W:-${TMPDIR:-/tmp}/ds4-serve-speed}
LAYERS=${LAYERS:-6} PP=${PP:-512} TG=${TG:-128} PORT=${PORT:-8097}
mkdir -p "$OUT" "$W"
cuda_plugins "$W/plugins.toml"
date -u +"run: %Y-%m-%d %H:%M UTC"
[ -s "$W/synth.gguf" ] || .dev/ds4/moeserve --config "$W/plugins.toml" synth --out "$W/synth.gguf" \
    --layers "$LAYERS" > "$W/synth.log" 2>&1
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench --model "$W/synth.gguf" \
    --depths 0 --prompt-tokens "$PP" --gen-tokens "$TG" --json > "$OUT/bench.json"
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" serve --model "$W/synth.gguf" \
    --port "$PORT" --parallel 1 --batch-tokens "$PP" > "$W/serve.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.5; done
python3 - "$PORT" "$PP" "$TG" "$OUT" <<'PY'
import json, random, sys, time, urllib.request
port, pp, tg, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
bench = json.load(open(f"{out}/bench.json"))
rows = [("bench (argmax on the host)", bench["tg_tok_s"], None)]
def complete(temperature):
    # Fresh prompt ids each request (no prefix-cache hit); ids below the control tokens.
    body = {"prompt": [random.randrange(300, 120000) for _ in range(pp)], "max_tokens": tg,
            "temperature": temperature, "seed": 1}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    r = json.load(urllib.request.urlopen(req, timeout=600))
    return r, time.time() - t0
complete(0)  # warm-up: records the decode graph
for t in (0, 1.0):
    r, wall = complete(t)
    u = r["usage"]
    rows.append((f"served, temperature {t}", u["timings"]["decode_tokens_per_sec"],
                 f"{u['completion_tokens']} tokens, {wall:.2f} s wall"))
    json.dump(r, open(f"{out}/served_t{t}.json", "w"))
print("| path | decode tok/s | / bench | note |")
print("|---|---|---|---|")
for name, tps, note in rows:
    print(f"| {name} | {tps:.1f} | {tps / rows[0][1]:.3f} | {note or ''} |")
PY
