#!/usr/bin/env python3
"""Table + JSON for ds4_llamacpp.sh: each engine on each GGUF, batched and one token at a
time, against the transformers oracle; and ours vs llama.cpp on the same file.
Error = max over positions of max|diff| / max|ref|; top-1 = share of positions with the
oracle's argmax."""
import json
import sys
from pathlib import Path

import numpy as np

out, json_path = Path(sys.argv[1]), Path(sys.argv[2])
ref = np.load(out / "tiny_release.npz")["logits"]
T, V = ref.shape
runs = {}
for engine in ("llama", "ours"):
    for f in ("llamacpp", "ours"):
        for mode in ("prefill", "prefill64", "decode"):
            p = out / (f"llama.{f}.{mode}.f32" if engine == "llama" else f"ours.{f}.{mode}.npy")
            if p.exists():
                runs[(engine, f, mode)] = (np.fromfile(p, np.float32).reshape(T, V)
                                           if engine == "llama" else np.load(p))


def err(a, b, how=np.max):
    return float(how(np.abs(a - b).max(1) / np.abs(b).max()))


rows = []
print(f"{'engine':10} {'file':14} {'mode':9} {'max vs oracle':>13} {'median':>9} {'top-1':>6} {'max vs other':>13}")
for (engine, f, mode), a in sorted(runs.items()):
    other = runs.get(("ours" if engine == "llama" else "llama", f, mode))
    row = dict(engine="llama.cpp" if engine == "llama" else "ours", file=f + ".gguf", mode=mode,
               rel_err_vs_oracle=err(a, ref), median_rel_err_vs_oracle=err(a, ref, np.median),
               top1_vs_oracle=float((a.argmax(1) == ref.argmax(1)).mean()),
               rel_err_vs_other_engine=err(a, other) if other is not None else None)
    rows.append(row)
    o = f"{row['rel_err_vs_other_engine']:.3g}" if other is not None else "-"
    print(f"{row['engine']:10} {row['file']:14} {mode:9} {row['rel_err_vs_oracle']:13.3g} "
          f"{row['median_rel_err_vs_oracle']:9.3g} {row['top1_vs_oracle']:6.3f} {o:>13}")
json_path.write_text(json.dumps(rows, indent=1))
