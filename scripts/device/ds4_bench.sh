#!/usr/bin/env bash
# The issue-#6 benchmark on one H200: a V4-Flash-shaped DeepSeek-V4 (Strix-Lean type mix,
# 4096 hidden, 256 experts top-6, vocabulary 129280) of LAYERS (43) layers, built from a
# TEMPLATE-layer synthetic file (`moeserve synth`; layers past the file's repeat its last
# two, each as its own device copy: the real 43-layer memory and traffic), then
# `moeserve bench --limits` at context depths DEPTHS: decode tok/s vs bytes per token /
# bandwidth (the faster of the runtime's device-to-device copy and our streaming add),
# prefill (in serve's GPU chunks: PP 2048 tokens, PP_LONG 1024 from
# depth 32768) vs the ROCmFP2 matrix rate, all measured in this run.
# With PARITY=1 it first runs scripts/device/ds4_gpu.sh (the fixtures) while the file is
# written, then decodes 8 tokens of the full-width file twice (bit-identical?) and with
# each kernel A/B switch (the list `switches` below) and compares (NO_FULLWIDTH=1 skips
# that part).
# PROFILE=1 adds the per-kernel tables of a decode step and of a prefill pass, both at
# depth PROFILE_AT (0; PROFILE_ONLY=1 stops there; MOE_DS4_BRANCHES=0 keeps every kernel
# on one stream, so none is timed while another shares the device); PDL_AB=1 reruns depth 0 with
# MOE_GPU_PDL=0; REUSE=1 keeps a synth file a warm machine still has; NOFILE=1 writes
# none (each bench builds the layers in memory: `bench --synth`); BENCH_ARGS adds
# arguments to the table's bench (e.g. `--more-drafts 3,7`). Carry .dev/ds4. $OUT
# gets bench.json (+ parity.log, profile*.json).
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-bench}
W=${W:-${TMPDIR:-/tmp}/ds4-synth}
mkdir -p "$OUT" "$W"
cuda_plugins "$W/plugins.toml"
date -u +"run: %Y-%m-%d %H:%M UTC"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
t0=$(date +%s)
# NOFILE=1: no file at all; every bench builds the TEMPLATE layers in memory
# (`bench --synth`); the full-width A/B of PARITY=1 needs the file and is skipped.
SRC=(--model "$W/synth.gguf")
if [ -n "${NOFILE:-}" ]; then
    SRC=(--synth "${TEMPLATE:-6}")
    true &
elif [ -n "${REUSE:-}" ] && [ -s "$W/synth.gguf" ]; then
    true &  # REUSE=1: a warm machine keeps the last run's file
else
    .dev/ds4/moeserve --config "$W/plugins.toml" synth --out "$W/synth.gguf" --layers "${TEMPLATE:-6}" \
        > "$W/synth.log" 2>&1 &
fi
synth=$!
if [ -n "${PARITY:-}" ]; then bash scripts/device/ds4_gpu.sh 2>&1 | tee "$OUT/parity.log"; fi
wait $synth
[ -n "${NOFILE:-}" ] || tail -1 "$W/synth.log"
echo "synth: $(( $(date +%s) - t0 )) s"
if [ -n "${PARITY:-}" ] && [ -z "${NOFILE:-}" ] && [ -z "${NO_FULLWIDTH:-}" ]; then
    # Full width: 8 decoded tokens (graph replay) with the default kernels, twice (the run
    # must repeat bit for bit), then with each A/B switch: MOE_GPU_DENSE_ROWS=0
    # (matvec_dense only), MOE_GPU_HC_FAST=0 (mHC pre's general path): summation order
    # only; MOE_GPU_HC_SPLIT=0 (mHC pre's Sinkhorn on the collapsing block) and
    # MOE_GPU_ID_NOSORT=0 (sorted grouped kernel): the same sums, bit-identical;
    # MOE_GPU_FP4_RUNS=0 (the runs kernel's ROCmFP4 products with f32 activations);
    # MOE_DS4_BRANCHES=0 (one stream: the same ops in another order), MOE_DS4_SWIGLU_ID=0
    # (SWIGLU before the routed and the shared expert's down), MOE_DS4_SHEXP_SWIGLU=0
    # (SWIGLU before the shared expert's down only), MOE_GPU_STREAM_PRIO=0 (every stream
    # at the default priority) and MOE_DS4_POST_COMBINE=0 (MOE_COMBINE before mHC
    # post): the same sums, bit-identical; MOE_DS4_HC_FUSED=0 (mHC post, the mix product and
    # pre as three ops, not HC_POST_PRE): summation order only; MOE_DS4_HC_DEFER=0 (the
    # Sinkhorn inside mHC pre, not HC_SINKHORN on a side stream): bit-identical;
    # MOE_DS4_ATT_ROPE=1 (q's norm + rotary and the output's inverse rotary inside the
    # attention): summation order only (q's norm); MOE_DS4_IDX_ROPE=1 (the indexer queries'
    # rotary inside the scores): bit-identical; MOE_GPU_IDX_GROUPS=4 (the scores' heads in
    # 4 groups, not 8 while few rows are visible): the scores' summation order only (at 8
    # decoded tokens the top-k takes every visible row: bit-identical logits);
    # MOE_GPU_ATT_STORE=0 (a decode step's window store as its own launch, not inside
    # the attention kernel): the same values, bit-identical; MOE_GPU_ATT_SPLIT=0 (a decode step's attention a
    # block a head, not the heads kernel over key splits + merge) and MOE_GPU_ATT_HEADS=0
    # (neither heads kernel form): summation order only; MOE_GPU_IDX_MM=1 (decode steps'
    # index scores through the tiled kernel too): bit-identical at 8 decoded tokens (the
    # top-k takes every visible row); MOE_DS4_IDX_SHORT=0 (indexer layers score and take
    # their top-k even while it would take every visible row): summation order only;
    # MOE_GPU_HC_GSYNC=0 (a decode step's mHC site finished by its last block, x's norm
    # summed from x, not from the streams' Gram matrix): summation order only;
    # MOE_GPU_ATT_SPLIT=1,MOE_GPU_ATT_DEC=1 (the split attention merged in the same launch,
    # ds4_attention_dec): summation order only; MOE_GPU_STREAM_HINT=0 (the decode
    # products' weights read plainly, not evict-first in L2): only the loads differ, so
    # bit-identical is expected (not run at full width yet); MOE_GPU_FP4_BULK=0 (the
    # ROCmFP4 runs kernels' rows loaded into registers, not bulk-copied into shared
    # memory): the same sums, bit-identical (not run at full width yet). The
    # indexer's switches run with MOE_DS4_IDX_SHORT=0 (8 tokens never score otherwise) and
    # are compared with the MOE_DS4_IDX_SHORT=0 run; a setting's comma-joined variables are
    # set together.
    toks=5,17,301,4000,77,129000,42,9
    switches=(MOE_GPU_DENSE_ROWS=0 MOE_GPU_HC_FAST=0 MOE_GPU_HC_SPLIT=0 MOE_GPU_ID_NOSORT=0
        MOE_GPU_FP4_RUNS=0 MOE_DS4_BRANCHES=0 MOE_DS4_SWIGLU_ID=0 MOE_DS4_POST_COMBINE=0
        MOE_DS4_HC_FUSED=0 MOE_DS4_HC_DEFER=0 MOE_DS4_ATT_ROPE=1 MOE_DS4_IDX_ROPE=1,MOE_DS4_IDX_SHORT=0
        MOE_GPU_IDX_GROUPS=4,MOE_DS4_IDX_SHORT=0 MOE_GPU_ATT_STORE=0
        MOE_GPU_ATT_SPLIT=0 MOE_GPU_ATT_HEADS=0 MOE_GPU_IDX_MM=1,MOE_DS4_IDX_SHORT=0
        MOE_DS4_IDX_SHORT=0 MOE_GPU_HC_GSYNC=0 MOE_GPU_ATT_SPLIT=1,MOE_GPU_ATT_DEC=1
        MOE_GPU_STREAM_HINT=0 MOE_DS4_SHEXP_SWIGLU=0 MOE_GPU_STREAM_PRIO=0 MOE_GPU_FP4_BULK=0)
    for v in base repeat "${switches[@]}"; do
        env $([[ $v == *=* ]] && echo "${v//,/ }") RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" \
            logits --model "$W/synth.gguf" --tokens $toks --mode decode --out "$W/full_${v//[=,]/_}.npy"
    done
    python3 - "$W" repeat "${switches[@]}" <<'PY' | tee -a "$OUT/parity.log"
import sys, numpy as np
w = sys.argv[1]
for v in sys.argv[2:]:
    # Settings with the indexer's scoring forced on: against that run, not the default.
    ref = "MOE_DS4_IDX_SHORT=0" if v.endswith(",MOE_DS4_IDX_SHORT=0") else "base"
    name = lambda s: s.replace("=", "_").replace(",", "_")
    a = np.load(f"{w}/full_{name(ref)}.npy")
    b = np.load(f"{w}/full_{name(v)}.npy")
    rel = float((np.abs(a - b).max(1) / np.abs(b).max()).max())
    top = float((a.argmax(1) == b.argmax(1)).mean())
    print(f"full width ({a.shape[0]} decoded tokens): {ref} vs {v}: bit-identical {np.array_equal(a, b)}, "
          f"max rel diff {rel:.2e}, top-1 agree {top:.0%}")
PY
fi
if [ -n "${PROFILE:-}" ]; then
    # GPU time per kernel over single-token steps (no graphs: each launch timed by events).
    MOE_GPU_PROFILE=1 MOE_DS4_NO_GRAPH=1 RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" \
        bench "${SRC[@]}" --layers "${LAYERS:-43}" --depths "${PROFILE_AT:-0}" \
        --prompt-tokens 1 --gen-tokens 16 \
        --repetitions 1 --json > "$OUT/profile.json"
    # 2 runs (warm-up + measured) of 1 prompt token + 16 decoded: 34 steps.
    python3 scripts/device/profile_table.py "$OUT/profile.json" 34 step
    # The same over prefill: one pass of PP prompt tokens (+ 1 decoded), twice (warm-up + run).
    MOE_GPU_PROFILE=1 RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" \
        bench "${SRC[@]}" --layers "${LAYERS:-43}" --depths "${PROFILE_AT:-0}" \
        --prompt-tokens "${PP:-512}" --gen-tokens 1 \
        --repetitions 1 --json > "$OUT/profile_pp.json"
    python3 scripts/device/profile_table.py "$OUT/profile_pp.json" 2 pass 16
    [ -n "${PROFILE_ONLY:-}" ] && exit 0
fi
# Prefill as serve runs it on a GPU: 2048-token chunks, 1024 from position 32768
# (PP / PP_LONG; PP_LONG=0 keeps PP at every depth).
RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench "${SRC[@]}" \
    --layers "${LAYERS:-43}" --depths "${DEPTHS:-0,4096,32768,131072}" --limits \
    --prompt-tokens "${PP:-2048}" --long-prompt-tokens "${PP_LONG:-1024}" --long-from 32768 \
    --gen-tokens "${TG:-32}" --repetitions "${REPS:-1}" ${BENCH_ARGS:-} --json \
    > "$OUT/bench.json"
python3 - "$OUT/bench.json" <<'PY'
import json, sys
b = json.load(open(sys.argv[1]))
gb = lambda k: f"{b[k]/1e9:.0f} GB/s" if b.get(k) else "-"
print(f"device {b['device']}, {b['layers']} layers, device-to-device copy {gb('copy_bandwidth_bytes_s')}, "
      f"stream add {gb('stream_bandwidth_bytes_s')} (the limit: the faster), "
      f"ROCmFP2 matrix rate {b['matrix_rate_flop_s']/1e12:.0f} TFLOP/s")
print("| depth | pp chunk | pp tok/s | pp / matrix rate | tg tok/s | MiB read per token (weights + cache) | tg limit tok/s | tg / limit | tg / add-only limit |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for d in b["depths"]:
    mib = (d["weight_bytes_per_token"] + d["cache_bytes_per_token"]) / 2**20
    add = d.get("tg_fraction_of_stream_limit")
    print(f"| {d['depth']} | {d['pp_tokens']} | {d['pp_tok_s']:.1f} | {100*d['pp_fraction_of_matrix_rate']:.1f}% | {d['tg_tok_s']:.1f} | "
          f"{mib:.0f} ({d['weight_bytes_per_token']/2**20:.0f} + {d['cache_bytes_per_token']/2**20:.1f}) | "
          f"{d['tg_limit_tok_s']:.0f} | {100*d['tg_fraction_of_limit']:.1f}% | "
          f"{'-' if add is None else f'{100*add:.1f}%'} |")
k = dict(b["kernels"])
print("device launches:", {n: v for n, v in k.items() if n.endswith(".device")})
PY
# PDL_AB=1: depth 0 again without programmatic dependent launch (MOE_GPU_PDL=0).
if [ -n "${PDL_AB:-}" ]; then
    MOE_GPU_PDL=0 RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" bench "${SRC[@]}" \
        --layers "${LAYERS:-43}" --depths 0 --prompt-tokens "${PP:-512}" --gen-tokens "${TG:-32}" \
        --repetitions "${REPS:-1}" --json > "$OUT/bench_nopdl.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1]))['depths'][0]; print(f\"without PDL, depth 0: pp {d['pp_tok_s']:.1f} tok/s, tg {d['tg_tok_s']:.1f} tok/s\")" "$OUT/bench_nopdl.json"
fi
# Where the decode time goes (NSYS=1 and Nsight Systems installed): GPU time per kernel
# over a short run at depth 0.
if [ -n "${NSYS:-}" ]; then
    NSYS_BIN=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1 || true)
    if [ -n "$NSYS_BIN" ]; then
        RUST_LOG=warn "$NSYS_BIN" profile -o "$W/prof" --force-overwrite true \
            .dev/ds4/moeserve --config "$W/plugins.toml" bench "${SRC[@]}" \
            --layers "${LAYERS:-43}" --prompt-tokens 64 --gen-tokens 16 --repetitions 1 > /dev/null 2>&1 || true
        "$NSYS_BIN" stats --report cuda_gpu_kern_sum --format csv "$W/prof.nsys-rep" 2>/dev/null \
            | head -30 | tee "$OUT/kernels.csv"
    else
        echo "nsys not found"
    fi
fi
