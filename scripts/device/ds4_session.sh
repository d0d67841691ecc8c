#!/usr/bin/env bash
# One device call for a build's issue-#6 checks and numbers, when machines are scarce: each
# step below in turn, each under its own time limit, the whole within BUDGET seconds (570,
# under the device tool's 10 minutes), a short report on stdout and the steps' files under
# $OUT. Layers: 43 on an H200 (the issue's benchmark), 20 on an H100 (80 GB; the same
# widths). Steps (STEPS, in this order; default "kernels fixtures bench ab timeline"):
#   kernels   gpu_kernels --quick (parity, ALL OK or FAILURES; carry .dev/gpu)
#   attention gpu_kernels --attention (SPARSE_ATTENTION's and INDEX_SCORES' cases alone,
#             with the streamed index kernel's bit checks against the plain tiled one,
#             its bf16 form's cases, and their 128K timings; not in the default list)
#   fixtures  spec_gpu.sh STEPS=fixtures (the tiny fixtures against the CPU and the oracle)
#   bench     NOFILE=1 ds4_bench.sh (the table at depths 0, 4K, 32K, 128K)
#   ab        ds4_ab.sh $AB (default "base base"; e.g. AB="base MOE_DS4_XQ=0 base
#             MOE_DS4_XQ=0"), depths AB_DEPTHS (0; "0,131072" or "0 131072"), pp512,
#             tg32, REPS=2
#   routed    gpu_kernels --routed (ROUTER's and MOE_ROUTED's cases alone), then again
#             with the fused kernel's A/B switches on (not in the default list)
#   timeline  ds4_timeline.sh, then timeline_layer.py (one decode layer's kernels in order);
#             TL_SET=VAR=VALUE[,VAR=VALUE...] applies to this step only
#   site      hc_site_bench.sh (the MoE site after a product, its phases, the router
#             after it and the routing in the site; not in the default list)
#   profile   ds4_bench.sh PROFILE=1: per-kernel GPU time of a decode step and of a
#             prefill pass (serve's chunk: 2048 tokens, 1024 from 32768) at each depth
#             of PROFILE_DEPTHS (default "0 32768 131072"), on one stream
#             (MOE_DS4_BRANCHES=0 unless set; not in the default list)
#   peak      vendor_peak.py: cuBLAS bf16 GEMM TFLOP/s and the runtime's copy GB/s, the
#             yardsticks for bench's own matrix rate and bandwidth (not in the default list)
#   llamacpp  ds4_llamacpp_gpu.sh: llama.cpp built here for CUDA, its llama-bench against
#             ours on a LAYERS_LL-layer (4) Q8_0 file; carry .dev/llama.cpp.tar.xz (not in
#             the default list)
# A step starts only with at least its minimum time left (see `need`), so a slow
# machine skips the last ones rather than cutting one short. Carry .dev/ds4 (and
# .dev/gpu for kernels). Built here first: scripts/device/carry_ds4.sh and
# scripts/device/gpu_kernels.sh --prepare; scripts/device/kernel_cache.sh then fills
# .dev/kc (carry it, MOE_KERNEL_CACHE=$PWD/.dev/kc: no NVRTC compile on the device).
set -uo pipefail
cd "$(dirname "$0")/../.."
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-session}
mkdir -p "$OUT"
t0=$(date +%s)
budget=${BUDGET:-570}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$name"
date -u +"run: %Y-%m-%d %H:%M:%S UTC"
layers=43
case "$name" in *H100*) layers=20 ;; esac
export LAYERS=${LAYERS:-$layers}
left() { echo $((budget - $(date +%s) + t0)); }
# need MIN NAME: true when at least MIN seconds are left (else says the step is skipped).
need() {
    if [ "$(left)" -lt "$1" ]; then
        echo "== $2 skipped: $(left) s left, it needs $1"
        return 1
    fi
    echo "== $2 ($(($(date +%s) - t0)) s in, $(left) s left)"
}
for step in ${STEPS:-kernels fixtures bench ab timeline}; do
    case "$step" in
        kernels | attention | routed)
            need 60 "$step" || continue
            flag=--quick pat="FAIL|parity" cap=180
            [ "$step" = attention ] && flag=--attention pat="FAIL|parity|128K|same bits|launches" cap=200
            [ "$step" = routed ] && flag=--routed pat="FAIL|parity|same bits" cap=120
            OUT="$OUT" timeout "$(( $(left) < cap ? $(left) : cap ))" \
                bash scripts/device/gpu_kernels.sh "$flag" > /dev/null 2>&1
            echo "rc=$?"
            grep -E "$pat" "$OUT/gpu_kernels.log" | cut -c1-230 | head -40
            if [ "$step" = routed ] && [ "$(left)" -gt 40 ]; then
                # (again under the fused kernel's A/B switches, read once a process)
                echo "-- with MOE_GPU_MOER_Q8=block MOE_GPU_MOER_PF=2 MOE_GPU_MOER_BLOCKS=1"
                mkdir -p "$OUT/alt"
                MOE_GPU_MOER_Q8=block MOE_GPU_MOER_PF=2 MOE_GPU_MOER_BLOCKS=1 OUT="$OUT/alt" \
                    timeout "$(( $(left) < cap ? $(left) : cap ))" \
                    bash scripts/device/gpu_kernels.sh --routed > /dev/null 2>&1
                echo "rc=$?"
                grep -E "$pat" "$OUT/alt/gpu_kernels.log" | cut -c1-230 | head -20
            fi
            ;;
        fixtures)
            need 60 fixtures || continue
            STEPS=fixtures OUT="$OUT/spec" timeout "$(( $(left) < 200 ? $(left) : 200 ))" \
                bash scripts/device/spec_gpu.sh 2>&1 | cut -c1-230 | tail -16
            ;;
        bench)
            need 40 bench || continue
            OUT="$OUT/bench" NOFILE=1 timeout "$(( $(left) < 360 ? $(left) : 360 ))" \
                bash scripts/device/ds4_bench.sh > "$OUT/bench.log" 2>&1
            echo "rc=$?"
            grep -E "^\||^device|tg32" "$OUT/bench.log" | cut -c1-250 | head -14
            ;;
        ab)
            need 40 ab || continue
            # shellcheck disable=SC2086 # the settings are words
            # (depths by commas or spaces: "0,131072" or "0 131072")
            depths=${AB_DEPTHS:-0}
            OUT="$OUT/ab" DEPTHS="${depths// /,}" PP=512 REPS=2 timeout "$(left)" \
                bash scripts/device/ds4_ab.sh ${AB:-base base} > "$OUT/ab.log" 2>&1
            echo "rc=$?"
            grep -E '^\||: [0-9]+ s' "$OUT/ab.log"
            ;;
        timeline)
            need 60 timeline || continue
            tl_env=()
            [ -z "${TL_SET:-}" ] || IFS=, read -r -a tl_env <<< "$TL_SET"
            env "${tl_env[@]}" W=/tmp/ds4-session-tl OUT=/tmp/ds4-session-tlo timeout "$(left)" \
                bash scripts/device/ds4_timeline.sh > "$OUT/timeline.log" 2>&1
            echo "rc=$?"
            grep -E "^graph" "$OUT/timeline.log"
            python3 scripts/device/timeline_layer.py /tmp/ds4-session-tl/trace.tsv "$LAYERS" 2 \
                | tee "$OUT/layer.md"
            ;;
        site)
            need 90 site || continue
            timeout "$(left)" bash scripts/device/hc_site_bench.sh > "$OUT/site.md" 2>&1
            echo "rc=$?"
            grep -E "^\||^routing|^device|^##|phase end|timer" "$OUT/site.md"
            ;;
        profile)
            for d in ${PROFILE_DEPTHS:-0 32768 131072}; do
                need 60 "profile at depth $d" || break
                pp=2048
                [ "$d" -lt 32768 ] || pp=1024
                # (one stream: no kernel timed while a side stream's shares the device)
                MOE_DS4_BRANCHES=${MOE_DS4_BRANCHES:-0} OUT="$OUT/profile$d" NOFILE=1 PROFILE=1 \
                    PROFILE_ONLY=1 PROFILE_AT="$d" PP=$pp \
                    timeout "$(( $(left) < 150 ? $(left) : 150 ))" \
                    bash scripts/device/ds4_bench.sh > "$OUT/profile$d.log" 2>&1
                echo "rc=$?"
                # (rows under 0.5% of the time left out)
                grep -E "^pp|^\|" "$OUT/profile$d.log" | grep -vE "\| 0\.[0-4]%" | head -40
            done
            ;;
        peak)
            need 30 peak || continue
            timeout "$(( $(left) < 90 ? $(left) : 90 ))" \
                python3 scripts/device/vendor_peak.py --json "$OUT/peak.json" 2>&1 | tail -8
            ;;
        llamacpp)
            need 150 llamacpp || continue
            LAYERS=${LAYERS_LL:-4} OUT="$OUT/llamacpp" timeout "$(left)" \
                bash scripts/device/ds4_llamacpp_gpu.sh > "$OUT/llamacpp.log" 2>&1
            echo "rc=$?"
            grep -E "^\||built in|llama.cpp:|failed" "$OUT/llamacpp.log"
            ;;
        *)
            echo "unknown step '$step' (kernels, attention, fixtures, bench, ab, timeline, site, profile, peak, llamacpp)" >&2
            exit 2
            ;;
    esac
done
echo "== done ($(($(date +%s) - t0)) s)"
