#!/usr/bin/env python3
"""One decode replay's kernels in launch order, from ds4_timeline.sh's trace (the CUPTI
rows: start, end, stream, graph, correlation id, name): each kernel's start and end in
us from the replay's first kernel, its duration, its stream, and the gap since the last
kernel before it on the same stream ended. Prints the kernels between the AT-th and the
(AT + SITES)-th `ds4_hc_post_pre` of the middle replay of the most-replayed graph (the
decode step): with AT = 20 and SITES = 2 one middle layer, attention site then MoE site.

  python3 scripts/device/timeline_layer.py TRACE.tsv[.gz] [AT] [SITES]
"""
import collections
import gzip
import sys


def main():
    path = sys.argv[1]
    at = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    sites = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    opener = gzip.open if path.endswith(".gz") else open
    by = collections.defaultdict(list)
    with opener(path, "rt") as f:
        for line in f:
            s, e, st, g, c, n = line.rstrip("\n").split("\t")
            if g != "0":
                by[(g, c)].append((int(s), int(e), int(st), n.split("(")[0]))
    gid = collections.Counter(g for g, _ in by).most_common(1)[0][0]
    reps = sorted((v for (g, _), v in by.items() if g == gid), key=lambda v: min(x[0] for x in v))
    if not reps:
        sys.exit("no graph replays in the trace")
    ks = sorted(reps[len(reps) // 2])
    t0 = ks[0][0]
    hc = [i for i, k in enumerate(ks) if k[3] == "ds4_hc_post_pre"]
    if len(hc) <= at:
        sys.exit(f"the replay has {len(hc)} ds4_hc_post_pre launches, none at {at}")
    lo = hc[at]
    hi = hc[at + sites] if at + sites < len(hc) else len(ks)
    last_end = {}
    for s, e, st, n in ks[:lo]:
        last_end[st] = max(last_end.get(st, 0), e)
    print(f"graph {gid}, replay {len(reps) // 2} of {len(reps)}, kernels {lo}..{hi - 1} of {len(ks)}")
    print("| kernel | stream | start us | end us | us | gap on its stream us |")
    print("|---|---|---|---|---|---|")
    base = ks[lo][0]
    for s, e, st, n in ks[lo:hi]:
        gap = (s - last_end[st]) / 1e3 if st in last_end else float("nan")
        last_end[st] = max(last_end.get(st, 0), e)
        print(f"| {n} | {st} | {(s - base) / 1e3:.1f} | {(e - base) / 1e3:.1f} | "
              f"{(e - s) / 1e3:.1f} | {gap:.1f} |")
    print(f"(replay start to this layer's first kernel: {(base - t0) / 1e3:.1f} us)")


if __name__ == "__main__":
    main()
