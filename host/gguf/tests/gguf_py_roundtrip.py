#!/usr/bin/env python3
"""Parity helper for host/gguf/tests/gguf_py.rs, using the PyPI `gguf` package (not our code).

  gguf_py_roundtrip.py write OUT_DIR   writes OUT_DIR/py.gguf with gguf.GGUFWriter, and
                                        OUT_DIR/py.json describing what it wrote
  gguf_py_roundtrip.py read FILE       reads FILE with gguf.GGUFReader, prints JSON of what it saw
  gguf_py_roundtrip.py sizes -         prints GGML_QUANT_SIZES as JSON {id: [name, block, bytes]}

JSON shape (both modes): {"metadata": [{"key", "types", "value"}], "tensors": [{"name", "dims",
"type", "hex"}]}. "types" is the value type id followed, for arrays, by the element type ids (as
GGUFReader reports them); "dims" are in ggml order (innermost first). Nested array values are
flattened, because that is all GGUFReader.contents() can give.
"""
import json
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType as VT, GGMLQuantizationType as QT


def flatten(v):
    if isinstance(v, list):
        return [x for item in v for x in flatten(item)]
    return [v]


def write(out_dir: Path) -> None:
    path = out_dir / "py.gguf"
    w = gguf.GGUFWriter(path, "llama")  # also writes general.architecture = "llama"
    w.add_custom_alignment(64)  # general.alignment (u32)
    meta = []

    def kv(key, value, vtype, sub=None, types=None):
        w.add_key_value(key, value, vtype, sub_type=sub)
        meta.append({"key": key, "types": types or [int(vtype)], "value": value})

    kv("test.u8", 200, VT.UINT8)
    kv("test.i8", -100, VT.INT8)
    kv("test.u16", 60000, VT.UINT16)
    kv("test.i16", -30000, VT.INT16)
    kv("test.u32", 4000000000, VT.UINT32)
    kv("test.i32", -2000000000, VT.INT32)
    kv("test.f32", 0.1, VT.FLOAT32)
    kv("test.bool_t", True, VT.BOOL)
    kv("test.bool_f", False, VT.BOOL)
    kv("test.string", "héllo, wörld ✓", VT.STRING)
    kv("test.u64", 2**64 - 1, VT.UINT64)
    kv("test.i64", -(2**63), VT.INT64)
    kv("test.f64", 2.718281828459045, VT.FLOAT64)
    kv("test.arr_str", ["a", "", "ünï", "<0x0A>"], VT.ARRAY, VT.STRING, [9, 8])
    kv("test.arr_i32", [1, -2, 3, 2**31 - 1], VT.ARRAY, VT.INT32, [9, 5])
    kv("test.arr_u8", [0, 1, 255], VT.ARRAY, VT.UINT8, [9, 0])
    kv("test.arr_i64", [-(2**63), 0, 2**63 - 1], VT.ARRAY, VT.INT64, [9, 11])
    kv("test.arr_f32", [0.5, -1.25, 1e-3], VT.ARRAY, VT.FLOAT32, [9, 6])
    kv("test.arr_f64", [1e300, -0.0, 3.5], VT.ARRAY, VT.FLOAT64, [9, 12])
    kv("test.arr_bool", [True, False, True], VT.ARRAY, VT.BOOL, [9, 7])
    # Nested: the writer infers the inner element type from Python ints -> INT32.
    kv("test.nested", [[1, 2, 3], [4, 5]], VT.ARRAY, None, [9, 9, 5])

    rng = np.random.default_rng(1234)
    tensors = []

    def tensor(name, array, raw_dtype=None, type_id=None, dims=None):
        w.add_tensor(name, array, raw_dtype=raw_dtype)
        tensors.append({
            "name": name,
            "dims": dims if dims is not None else list(reversed(array.shape)),
            "type": type_id,
            "hex": array.tobytes().hex(),
        })

    tensor("t.f32", np.arange(12, dtype=np.float32).reshape(3, 4) / 7, type_id=0)
    tensor("t.f16", rng.standard_normal((2, 8)).astype(np.float16), type_id=1)
    # Q8_0: 2 rows of 64 weights = 2 blocks of 34 bytes per row; gguf turns the byte shape into
    # the weight shape (2, 64).
    q8 = rng.integers(0, 256, size=(2, 68), dtype=np.uint8)
    tensor("t.q8_0", q8, raw_dtype=QT.Q8_0, type_id=8, dims=[64, 2])
    tensor("t.i32", np.array([7, -7, 1 << 30], dtype=np.int32), type_id=26)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    meta.insert(0, {"key": "general.architecture", "types": [8], "value": "llama"})
    meta.insert(1, {"key": "general.alignment", "types": [4], "value": 64})
    for m in meta:
        if isinstance(m["value"], list):
            m["value"] = flatten(m["value"])
    (out_dir / "py.json").write_text(json.dumps({"metadata": meta, "tensors": tensors}))


def read(path: Path) -> None:
    r = gguf.GGUFReader(path)
    meta = []
    for name, field in r.fields.items():
        if name.startswith("GGUF."):  # the reader's pseudo-fields for the header
            continue
        value = field.contents()
        meta.append({"key": name, "types": [int(t) for t in field.types], "value": value})
    tensors = [{
        "name": t.name,
        "dims": [int(d) for d in t.shape],
        "type": int(t.tensor_type),
        "hex": t.data.tobytes().hex(),
    } for t in r.tensors]
    json.dump({"metadata": meta, "tensors": tensors, "alignment": int(r.alignment)}, sys.stdout)


def sizes() -> None:
    table = {int(t): [t.name, *gguf.GGML_QUANT_SIZES[t]] for t in gguf.GGML_QUANT_SIZES}
    json.dump(table, sys.stdout)


if __name__ == "__main__":
    mode, arg = sys.argv[1], Path(sys.argv[2])
    {"write": write, "read": read, "sizes": lambda _: sizes()}[mode](arg)
