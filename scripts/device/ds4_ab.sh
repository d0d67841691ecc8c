#!/usr/bin/env bash
# A/B of kernel switches on the issue-#6 benchmark model (43-layer V4-Flash shape built in
# memory, `bench --synth`): pp / tg at DEPTHS (0) once per setting, all in one run.
# Settings are arguments: "base" (the defaults) or VAR=VALUE[,VAR=VALUE...], e.g.
#   bash scripts/device/ds4_ab.sh base MOE_GPU_FP4_RUNS=0 MOE_GPU_PDL_EARLY=1
# DS4_DIR=DIR in a setting runs the build carried in DIR instead of .dev/ds4 (two builds
# side by side: DS4_DIR=.dev/ds4_old); DRAFT=N decodes in passes of a token and N drafts,
# all taken (`bench --draft`: speculative decoding at full acceptance, at most 7);
# MORE=1:3:7 measures those draft counts too on the same model build (`--more-drafts`,
# printed by bench, in the JSON's tg_drafted); CTX=N sizes the caches for N positions
# (`bench --ctx-size`, as `serve --ctx-size`: the kernels a served context runs); MTP=1
# loads the model's MTP drafter (`synth --mtp`, written once into $W): every pass then
# runs the block's catch-up, and with DRAFT=N the block's N-step chain before each pass.
# Carry .dev/ds4 (and any such DIR). $OUT gets
# ab_<n>.json per setting; prints a markdown table.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-ab}
W=${W:-${TMPDIR:-/tmp}/ds4-ab}
mkdir -p "$OUT" "$W"
date -u +"run: %Y-%m-%d %H:%M UTC"
[ $# -gt 0 ] || set -- base
i=0
for s in "$@"; do
    i=$((i + 1))
    envs=()
    [ "$s" = base ] || IFS=, read -r -a envs <<< "$s"
    dir=.dev/ds4
    draft=0
    more=()
    mtp=()
    for e in "${envs[@]}"; do
        case "${e%%=*}" in
            DS4_DIR) dir=${e#*=} ;;
            DRAFT) draft=${e#*=} ;;
            MORE) more=(--more-drafts "$(tr : , <<< "${e#*=}")") ;;
            MTP) [ "${e#*=}" = 1 ] && mtp=(--mtp "$W/mtp.gguf") ;;
        esac
    done
    DS4_DIR=$dir cuda_plugins "$W/plugins.toml"
    if [ ${#mtp[@]} -gt 0 ] && [ ! -f "$W/mtp.gguf" ]; then
        "$dir/moeserve" --config "$W/plugins.toml" synth --mtp --layers "${TEMPLATE:-6}" \
            --out "$W/mtp.gguf" 2>&1 | tail -1
    fi
    t0=$(date +%s)
    env "${envs[@]}" RUST_LOG=warn "$dir/moeserve" --config "$W/plugins.toml" bench \
        --synth "${TEMPLATE:-6}" --layers "${LAYERS:-43}" --depths "${DEPTHS:-0}" \
        --prompt-tokens "${PP:-512}" --gen-tokens "${TG:-32}" --repetitions "${REPS:-1}" ${CTX:+--ctx-size "$CTX"} \
        --draft "$draft" "${more[@]}" "${mtp[@]}" --json > "$OUT/ab_$i.json"
    echo "$s: $(( $(date +%s) - t0 )) s"
done
python3 - "$OUT" "$@" <<'PY'
import json, sys
out, names = sys.argv[1], sys.argv[2:]
print("| setting | depth | pp tok/s | tg tok/s | tg vs first |")
print("|---|---|---|---|---|")
first = None
for i, n in enumerate(names, 1):
    b = json.load(open(f"{out}/ab_{i}.json"))
    for d in b["depths"]:
        first = first or {}
        f = first.setdefault(d["depth"], d["tg_tok_s"])
        print(f"| {n} | {d['depth']} | {d['pp_tok_s']:.1f} | {d['tg_tok_s']:.1f} | {d['tg_tok_s'] / f:.3f} |")
PY
