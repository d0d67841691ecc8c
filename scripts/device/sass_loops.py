#!/usr/bin/env python3
"""The loops of chosen kernels in a `cuobjdump -sass` listing: for each kernel whose name
holds one of the given words, the four largest backward-branch bodies (target .. branch)
with their instruction counts and opcode histograms. Shows where a kernel's
instructions go (address arithmetic, conversions, loads) without Nsight Compute.

    cuobjdump -sass kernels.cubin | python3 sass_loops.py matvec_dense_rows mmvq_id_107
"""
import collections
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
FUNC = re.compile(r"Function : (\S+)")


def loops(code):
    """(start, end) index pairs of backward branches in code = [(addr, op, operands)]."""
    at = {a: i for i, (a, _, _) in enumerate(code)}
    out = []
    for i, (a, op, rest) in enumerate(code):
        if op.startswith("BRA"):
            m = re.search(r"0x([0-9a-f]+)", rest)
            if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
                out.append((at[int(m.group(1), 16)], i))
    return out


def main():
    words = sys.argv[1:]
    funcs, name = {}, None
    for line in sys.stdin:
        m = FUNC.search(line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = LINE.search(line)
        if m and name:
            funcs[name].append((int(m.group(1), 16), m.group(3), m.group(4)))
    for name, code in funcs.items():
        if words and not any(w in name for w in words):
            continue
        print(f"== {name}: {len(code)} instructions")
        for s, e in sorted(loops(code), key=lambda p: p[0] - p[1])[:4]:
            body = code[s : e + 1]
            hist = collections.Counter(op.split(".")[0] for _, op, _ in body)
            top = ", ".join(f"{k} {v}" for k, v in hist.most_common(14))
            print(f"  loop {body[0][0]:#x}..{body[-1][0]:#x}: {len(body)} instr: {top}")


if __name__ == "__main__":
    main()
