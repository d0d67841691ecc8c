#!/usr/bin/env python3
"""Random-block fixtures for moe-quant-ggml's bit-exact decode tests.

The committed files in tests/fixtures/ were produced by this script with
    PyPI gguf 0.19.0, numpy 2.4.6, CPython 3.11.7 (x86_64), --seed 20240611
(`python3 tests/make_fixtures.py --out tests/fixtures --seed 20240611`); manifest.json
there records the same. The Rust test `gguf_py_exact` also re-runs this script with a
fresh seed into a temporary directory whenever `import gguf, numpy` works.

For every type it writes
    <NAME>.blocks  random but VALID blocks (raw bytes): random bytes with every scale
                   field replaced by a finite random f16 (or, for MXFP4, an e8m0 byte
                   other than 0xFF); float types are fully random bit patterns (NaN and
                   infinities included: validation accepts them)
    <NAME>.f32     gguf.quants.dequantize() of those bytes, float32 little-endian
and manifest.json (versions, seed, counts).
"""

import argparse
import json
import platform
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

# name -> (qtype, byte offsets of f16 scale fields in a block)
QUANT = {
    "Q4_0": (T.Q4_0, [0]),
    "Q4_1": (T.Q4_1, [0, 2]),
    "Q5_0": (T.Q5_0, [0]),
    "Q5_1": (T.Q5_1, [0, 2]),
    "Q8_0": (T.Q8_0, [0]),
    "Q2_K": (T.Q2_K, [80, 82]),
    "Q3_K": (T.Q3_K, [108]),
    "Q4_K": (T.Q4_K, [0, 2]),
    "Q5_K": (T.Q5_K, [0, 2]),
    "Q6_K": (T.Q6_K, [208]),
    "MXFP4": (T.MXFP4, []),
}
FLOAT = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16}


def random_finite_f16(rng, n):
    """Half of them any finite bit pattern (subnormals, huge, negative), half realistic."""
    bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
    bad = (bits & 0x7C00) == 0x7C00
    while bad.any():
        bits[bad] = rng.integers(0, 1 << 16, size=int(bad.sum()), dtype=np.uint32)
        bad = (bits & 0x7C00) == 0x7C00
    realistic = (rng.standard_normal(n) * 0.02).astype(np.float16).view(np.uint16)
    pick = rng.random(n) < 0.5
    return np.where(pick, bits, realistic).astype("<u2")


def version_of(mod_name):
    try:
        from importlib.metadata import version

        return version(mod_name)
    except Exception:
        return "unknown"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--blocks32", type=int, default=192, help="blocks per 32-weight type")
    ap.add_argument("--blocks256", type=int, default=32, help="blocks per K-quant type")
    ap.add_argument("--floats", type=int, default=4096, help="values per float type")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    counts = {}

    for name, (qtype, scale_offsets) in QUANT.items():
        block_weights, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = args.blocks256 if block_weights == 256 else args.blocks32
        blocks = rng.integers(0, 256, size=(n, type_size), dtype=np.uint16).astype(np.uint8)
        for off in scale_offsets:
            blocks[:, off : off + 2] = random_finite_f16(rng, n).view(np.uint8).reshape(n, 2)
        if qtype == T.MXFP4:
            blocks[:, 0] = rng.integers(0, 255, size=n, dtype=np.uint16).astype(np.uint8)
        with np.errstate(over="ignore"):  # MXFP4: 2^126 * 12 overflows to inf, as in ggml
            values = dequantize(blocks.reshape(1, -1), qtype)
        assert values.dtype == np.float32 and values.size == n * block_weights
        (out / f"{name}.blocks").write_bytes(blocks.tobytes())
        (out / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())
        counts[name] = n

    for name, qtype in FLOAT.items():
        _, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = args.floats
        raw = rng.integers(0, 256, size=(1, n * type_size), dtype=np.uint16).astype(np.uint8)
        values = dequantize(raw, qtype)
        assert values.dtype == np.float32 and values.size == n
        (out / f"{name}.blocks").write_bytes(raw.tobytes())
        (out / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())
        counts[name] = n

    manifest = {
        "generator": "kernels/ggml-quants/tests/make_fixtures.py",
        "seed": args.seed,
        "gguf": version_of("gguf"),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "blocks": counts,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
