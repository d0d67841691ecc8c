#!/usr/bin/env python3
"""Dumps tensors of a GGUF file for moe-quant-ggml's real-model test (kept out of git).

    dump_gguf_tensors.py MODEL.gguf OUT_DIR NAME[:ROWS] ...

For each tensor (its first ROWS rows when given) writes to OUT_DIR:
    <NAME>.blocks  the raw stored bytes, as gguf's GGUFReader finds them
    <NAME>.f32     gguf.quants.dequantize() of those bytes, float32 little-endian
    <NAME>.type    "<ggml type name> <ggml type id> <row length>"
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def main():
    model, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(model)
    by_name = {t.name: t for t in reader.tensors}
    for spec in sys.argv[3:]:
        name, _, rows = spec.partition(":")
        t = by_name[name]
        data = t.data
        if rows:
            data = data[: int(rows)]
        raw = np.ascontiguousarray(data).view(np.uint8)
        values = dequantize(raw, t.tensor_type)
        (out / f"{name}.blocks").write_bytes(raw.tobytes())
        (out / f"{name}.f32").write_bytes(np.asarray(values, dtype="<f4").tobytes())
        row_len = int(t.shape[0])  # GGUF shapes list the fastest-varying dimension first
        (out / f"{name}.type").write_text(f"{t.tensor_type.name} {int(t.tensor_type)} {row_len}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
