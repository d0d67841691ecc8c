#!/usr/bin/env bash
# Where a replayed decode step's time goes, as the GPU ran it (written 2026-12-01): the
# 43-layer benchmark model (`bench --synth`, depth DEPTH, TG decoded tokens) under the
# CUPTI injection library scripts/device/cupti_trace.cpp, then per kernel name over the
# decode replays: launches a step, replayed us a step, us a step it ran alone (nothing
# else on the GPU), us it was the earliest-started kernel running (roughly what the
# step waits on), and the idle gaps before it. CTX=N sizes the caches for N positions
# (`bench --ctx-size`, as `serve --ctx-size`). Carry .dev/ds4. $OUT gets the table.
# One layer's kernels in order, from the same trace: scripts/device/timeline_layer.py
# "$W/trace.tsv" [AT [SITES]].
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/device/cuda_env.sh
export MOE_KERNEL_CACHE=${MOE_KERNEL_CACHE:-/tmp/moe-kernel-cache}
OUT=${OUT:-/tmp/ds4-timeline}
W=${W:-${TMPDIR:-/tmp}/ds4-timeline}
mkdir -p "$OUT" "$W"
date -u +"run: %Y-%m-%d %H:%M UTC"
C=/usr/local/cuda
hdr=$(find "$C/" -name cupti_activity.h 2>/dev/null | head -1 || true)
[ -n "$hdr" ] || { echo "cupti_activity.h not found under $C" >&2; exit 1; }
v=$(grep -o 'CUpti_ActivityKernel[0-9]\+' "$hdr" | sed 's/.*Kernel//' | sort -n | tail -1 || true)
[ -n "$v" ] || { echo "no CUpti_ActivityKernelN record in $hdr" >&2; exit 1; }
krec=CUpti_ActivityKernel$v
lib=$(dirname "$(find "$C/" -name 'libcupti.so*' 2>/dev/null | head -1 || true)")
g++ -std=c++17 -O2 -shared -fPIC -DKREC="$krec" -I"$(dirname "$hdr")" -I"$C/include" \
    -o "$W/libcupti_trace.so" scripts/device/cupti_trace.cpp -L"$lib" -lcupti -Wl,-rpath,"$lib"
echo "record: $krec"
cuda_plugins "$W/plugins.toml"
CUDA_INJECTION64_PATH="$W/libcupti_trace.so" CUPTI_TRACE_OUT="$W/trace.tsv" RUST_LOG=warn \
    .dev/ds4/moeserve --config "$W/plugins.toml" bench --synth "${TEMPLATE:-6}" --layers "${LAYERS:-43}" \
    --depths "${DEPTH:-0}" --prompt-tokens "${PP:-512}" --gen-tokens "${TG:-32}" ${CTX:+--ctx-size "$CTX"} --json > "$OUT/bench.json"
python3 - "$W/trace.tsv" <<'PY' | tee "$OUT/timeline.md"
import collections, sys
rows = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])]
by = collections.defaultdict(list)
for s, e, st, g, c, n in rows:
    if g != "0":
        by[(g, c)].append((int(s), int(e), n.split("(")[0]))
# The decode step graph: the graph id with the most replays; drop its first two.
cnt = collections.Counter(g for g, _ in by)
gid = cnt.most_common(1)[0][0]
reps = sorted((v for (g, _), v in by.items() if g == gid), key=lambda v: min(x[0] for x in v))[2:]
if not reps:
    sys.exit("no decode graph replays in the trace")
tot = collections.defaultdict(float); alone = collections.defaultdict(float)
# "first": each busy instant credited to the running kernel that started first: with
# dependent launch the later ones mostly sit in their wait for it, so this is roughly
# what the step waits on (overlap that is real work, side streams, is credited too).
first = collections.defaultdict(float)
gapb = collections.defaultdict(float); num = collections.Counter()
wall = busy = 0.0
for ks in reps:
    ks.sort()
    t0, t1 = ks[0][0], max(e for _, e, _ in ks)
    wall += t1 - t0
    ev = sorted([(s, 1, i) for i, (s, e, n) in enumerate(ks)] + [(e, -1, i) for i, (s, e, n) in enumerate(ks)])
    live = set(); last = t0
    for t, d, i in ev:
        if len(live) == 1:
            alone[ks[next(iter(live))][2]] += t - last
        if live:
            first[ks[min(live)][2]] += t - last
            busy += t - last
        elif d == 1 and t > last:
            gapb[ks[i][2]] += t - last
        last = t
        live.add(i) if d == 1 else live.discard(i)
    for s, e, n in ks:
        tot[n] += e - s; num[n] += 1
R = len(reps)
print(f"graph {gid}: {R} replays, {len(reps[0])} kernels a step, step {wall / R / 1e3:.1f} us, "
      f"GPU busy {busy / R / 1e3:.1f} us, idle {(wall - busy) / R / 1e3:.1f} us")
print("\n| kernel | launches a step | us a step (sum of durations) | us alone | us first running | us idle before |\n|---|---|---|---|---|---|")
for n in sorted(tot, key=lambda n: -first[n] - gapb[n]):
    print(f"| {n} | {num[n] / R:.0f} | {tot[n] / R / 1e3:.1f} | {alone[n] / R / 1e3:.1f} | "
          f"{first[n] / R / 1e3:.1f} | {gapb[n] / R / 1e3:.1f} |")
PY
gzip -c "$W/trace.tsv" > "$OUT/trace.tsv.gz"
