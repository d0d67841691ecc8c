#!/usr/bin/env bash
# Full-width logits of kernel switches without a model file: the 43-layer V4-Flash-shaped
# benchmark model built in memory (`logits --synth`), TOKS decoded one at a time (graph
# replay; MODE=prefill: as one prefill pass, logits of every position), once with the
# defaults and once per setting (VAR=VALUE[,VAR=VALUE...]);
# prints each setting against the defaults: bit-identical, max |diff| over the largest
# |logit|, top-1 agreement. Carry .dev/ds4. E.g.
#   bash scripts/device/ds4_switch_logits.sh MOE_GPU_HC_GSYNC=0 MOE_DS4_HC_FUSED=0
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
W=${W:-${TMPDIR:-/tmp}/ds4-switch}
mkdir -p "$W"
date -u +"run: %Y-%m-%d %H:%M UTC"
cuda_plugins "$W/plugins.toml"
toks=${TOKS:-5,17,301,4000,77,129000,42,9}
for s in base "$@"; do
    envs=()
    [ "$s" = base ] || IFS=, read -r -a envs <<< "$s"
    env "${envs[@]}" RUST_LOG=warn .dev/ds4/moeserve --config "$W/plugins.toml" logits \
        --synth "${TEMPLATE:-6}" --layers "${LAYERS:-43}" --tokens "$toks" --mode "${MODE:-decode}" \
        --out "$W/logits_${s//[=,]/_}.npy"
done
python3 - "$W" "$@" <<'PY'
import sys, numpy as np
w = sys.argv[1]
a = np.load(f"{w}/logits_base.npy")
for s in sys.argv[2:]:
    b = np.load(f"{w}/logits_{s.replace('=', '_').replace(',', '_')}.npy")
    rel = float(np.abs(a - b).max() / np.abs(a).max())
    top = float((a.argmax(1) == b.argmax(1)).mean())
    print(f"full width ({a.shape[0]} positions): base vs {s}: bit-identical {np.array_equal(a, b)}, "
          f"max rel diff {rel:.2e}, top-1 agree {top:.0%}")
PY
