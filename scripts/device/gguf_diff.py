#!/usr/bin/env python3
"""Two GGUF files side by side (gguf-py's reader): tensors only one has, type or dims that
differ, the largest value difference of float tensors (decoded as the reader gives them),
and the deepseek4 metadata keys that differ. Exit status 1 when anything differs beyond
float rounding (relative 1e-6) or a key differs.

Usage: gguf_diff.py A.gguf B.gguf
"""
import sys

import numpy as np
from gguf import GGUFReader


def kv(r):
    out = {}
    for k, f in r.fields.items():
        if not k.startswith("deepseek4."):
            continue
        v = [f.parts[i].tolist() for i in f.data]
        out[k] = v[0] if len(v) == 1 else v
    return out


def main():
    a, b = GGUFReader(sys.argv[1]), GGUFReader(sys.argv[2])
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    bad = 0
    for n in sorted(set(ta) ^ set(tb)):
        print(f"only in {'A' if n in ta else 'B'}: {n}")
        bad += 1
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            print(f"{n}: A {x.tensor_type.name} {list(x.shape)}, B {y.tensor_type.name} {list(y.shape)}")
            bad += 1
            continue
        if x.data.dtype.kind == "f":
            xa, ya = np.asarray(x.data, np.float64), np.asarray(y.data, np.float64)
            d = np.abs(xa - ya).max() / max(np.abs(xa).max(), 1e-30)
            if d > 1e-6:
                print(f"{n}: values differ (relative {d:.2e})")
                bad += 1
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            print(f"{n}: bytes differ")
            bad += 1
    ka, kb = kv(a), kv(b)
    for k in sorted(set(ka) | set(kb)):
        if ka.get(k) != kb.get(k):
            print(f"{k}: A {ka.get(k)} B {kb.get(k)}")
            bad += 1
    print(f"{len(set(ta) & set(tb))} tensors in both, {bad} differences")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
