#!/usr/bin/env bash
# Speculative decoding for deepseek4 on the GPU, and prefill chunk sizes, in one device
# call of under 10 minutes (each step under its own time limit, so a hang in one still
# returns the others). Written 2026-12-05 without a device; first run pending.
#   fixtures  ds4_gpu.sh: its "draft vs dec" column (drafted passes, some drafts made up
#             and dropped by restoring the rings, against decode) on every fixture
#   graphs    the same column for two fixtures with MOE_DS4_DRAFT_GRAPH=1 (drafted passes
#             recorded and replayed as graphs)
#   draft     ds4_ab.sh on the 43-layer model at depth 0: base against passes of a
#             token and 3 / 7 drafts, all taken (`bench --draft`), op by op and as graphs
#   chunks    pp at 512 / 1024 / 2048-token chunks, depths 0 and 32768 (serve's GPU batch)
#   mtp       the MTP drafter (written later the same day): its logits on CUDA against
#             llama.cpp's (tiny_release_mtp.npz, the CPU test's bounds), then ds4_ab.sh at
#             depth 0: base, the block loaded (its per-pass catch-up), and its 3 / 7-step
#             chains before passes of all-taken drafts (3 also with chain steps and
#             passes as graphs)
# STEPS picks (default all five). Here: bash scripts/device/carry_ds4.sh. There: carry
# .dev/ds4. $OUT gets the logs.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
OUT=${OUT:-/tmp/spec-gpu}
mkdir -p "$OUT"
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
STEPS=${STEPS:-fixtures graphs draft chunks mtp}
t0=$(date +%s)
step() { echo "== $1 ($(($(date +%s) - t0)) s in)"; }
want() { [[ " $STEPS " == *" $1 "* ]]; }

if want fixtures; then
    step "fixtures"
    OUT=$OUT/fixtures timeout 200 bash scripts/device/ds4_gpu.sh > "$OUT/fixtures.log" 2>&1
    echo "rc=$?"
    grep -E "^(fixture|tiny)|prefix cache" "$OUT/fixtures.log"
fi
if want graphs; then
    step "fixtures, drafted passes as graphs"
    MOE_DS4_DRAFT_GRAPH=1 ONLY=tiny_release.f32,tiny_mixed.rocmfpx-mix OUT=$OUT/graphs \
        timeout 120 python3 scripts/device/ds4_gpu.py > "$OUT/graphs.log" 2>&1
    echo "rc=$?"
    grep -E "^(fixture|tiny)" "$OUT/graphs.log" || tail -5 "$OUT/graphs.log"
fi
if want draft; then
    step "drafted passes, all taken (43 layers, depth 0)"
    OUT=$OUT/draft DEPTHS=0 timeout 240 bash scripts/device/ds4_ab.sh base DRAFT=3 DRAFT=7 \
        DRAFT=3,MOE_DS4_DRAFT_GRAPH=1 DRAFT=7,MOE_DS4_DRAFT_GRAPH=1 > "$OUT/draft.log" 2>&1
    echo "rc=$?"
    grep "^|" "$OUT/draft.log" || tail -5 "$OUT/draft.log"
fi
if want chunks; then
    step "prefill chunk sizes"
    for pp in 512 1024 2048; do
        OUT=$OUT/pp$pp PP=$pp TG=8 DEPTHS=0,32768 timeout 90 bash scripts/device/ds4_ab.sh base \
            > "$OUT/pp$pp.log" 2>&1 || echo "pp$pp failed (rc=$?)"
        grep "^| base" "$OUT/pp$pp.log" | sed "s/^| base /| pp$pp /" || tail -3 "$OUT/pp$pp.log"
    done
fi
if want mtp; then
    step "MTP drafter: logits against llama.cpp's"
    W=${TMPDIR:-/tmp}/spec-mtp
    mkdir -p "$W"
    cuda_plugins "$W/plugins.toml"
    F=tests/fixtures/deepseek4
    bin=.dev/ds4/moeserve
    $bin --config "$W/plugins.toml" convert $F/tiny_release --out "$W/main.gguf" > /dev/null 2>&1
    $bin --config "$W/plugins.toml" convert $F/tiny_release_mtp --mtp --out "$W/mtp.gguf" > /dev/null 2>&1
    toks=$(python3 -c "import numpy as np; print(','.join(map(str, np.load('$F/tiny_release_mtp.npz')['tokens'])))")
    for mode in mtp mtp-prefill mtp-draft; do
        RUST_LOG=warn timeout 120 $bin --config "$W/plugins.toml" logits --model "$W/main.gguf" \
            --mtp "$W/mtp.gguf" --tokens "$toks" --mode $mode --out "$OUT/$mode.npy" 2>&1 | tail -1
    done
    # chain steps recorded and replayed as graphs
    MOE_DS4_DRAFT_GRAPH=1 RUST_LOG=warn timeout 120 $bin --config "$W/plugins.toml" logits \
        --model "$W/main.gguf" --mtp "$W/mtp.gguf" --tokens "$toks" --mode mtp \
        --out "$OUT/mtp-graph.npy" 2>&1 | tail -1
    python3 - "$F/tiny_release_mtp.npz" "$OUT" <<'PY'
import sys
import numpy as np
ref = np.load(sys.argv[1])
want = np.concatenate([ref["logits"], ref["chain"][1:]])
ours = np.load(sys.argv[2] + "/mtp.npy")
err = np.abs(ours - want).max(axis=1) / np.abs(want).max()
pre = np.load(sys.argv[2] + "/mtp-prefill.npy")
print(f"mtp vs llama.cpp: median {np.median(err):.2e} p99 {np.percentile(err, 99):.2e} "
      f"rows over 3e-2: {(err > 3e-2).sum()} argmax {(ours.argmax(1) == want.argmax(1)).mean():.3f} "
      f"chain {ours[len(ref['tokens']) - 1:].argmax(1).tolist()} (llama.cpp {ref['chain_tokens'].tolist()}) "
      f"prefill chain gap {np.abs(pre - ours[len(ref['tokens']) - 1:]).max():.2e}")
at = np.load(sys.argv[2] + "/mtp-draft.npy")
starts = ~np.isnan(at[:, 0])
print(f"guesses at {starts.sum()} drafted-pass starts vs token by token: "
      f"{np.abs(at[starts] - ours[:len(at)][starts]).max():.2e}")
g = np.load(sys.argv[2] + "/mtp-graph.npy")
print(f"chain steps as graphs vs op by op: {np.abs(g - ours).max():.2e}")
PY
    step "MTP drafter on the 43-layer model (depth 0)"
    OUT=$OUT/mtp DEPTHS=0 timeout 300 bash scripts/device/ds4_ab.sh base MTP=1 DRAFT=3,MTP=1 \
        DRAFT=7,MTP=1 DRAFT=3,MTP=1,MOE_DS4_DRAFT_GRAPH=1 > "$OUT/mtp.log" 2>&1
    echo "rc=$?"
    grep -E "^\||MiB" "$OUT/mtp.log" || tail -5 "$OUT/mtp.log"
fi
step "done"
