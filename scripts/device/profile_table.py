#!/usr/bin/env python3
"""Per-kernel table of a `moeserve bench --json` run made with MOE_GPU_PROFILE=1 (every
launch event-timed; the `<kernel>.ns` counters): launches and GPU time per unit of work.

    profile_table.py JSON UNITS WHAT [TOP]

UNITS: how many units the run did (decode steps, or prefill passes), WHAT: their name
("step" -> microseconds per step, "pass" -> milliseconds per pass); TOP: rows shown."""
import json
import sys

path, units, what = sys.argv[1], int(sys.argv[2]), sys.argv[3]
top = int(sys.argv[4]) if len(sys.argv) > 4 else None
b = json.load(open(path))
k = dict(b["kernels"])
ns = {n[:-3]: v for n, v in k.items() if n.endswith(".ns")}
tot = sum(ns.values())
scale, unit, digits = (1e3, "us", 0) if what == "step" else (1e6, "ms", 1)
print(f"pp {b['pp_tok_s']:.1f} tok/s, tg {b['tg_tok_s']:.1f} tok/s; GPU kernel time "
      f"{tot / units / 1e6:.2f} ms per {what} (over {units})")
print(f"| kernel | launches per {what} | GPU {unit} per {what} | share |")
print("| --- | --- | --- | --- |")
for n, v in sorted(ns.items(), key=lambda x: -x[1])[:top]:
    print(f"| {n} | {k.get(n, 0) / units:.0f} | {v / units / scale:.{digits}f} | {100 * v / tot:.1f}% |")
