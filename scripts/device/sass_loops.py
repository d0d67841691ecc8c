#!/usr/bin/env python3
"""The loops of chosen kernels in a `cuobjdump -sass` listing: for each kernel whose name
holds one of the given words, the four largest backward-branch bodies (target .. branch)
with their instruction counts and opcode histograms. Shows where a kernel's
instructions go (address arithmetic, conversions, loads) without Nsight Compute.
`--inner N` lists the smallest loops of at least N instructions instead (the hot inner
loops, where the largest are the outer ones around them). Each loop also counts two
kinds of instruction that do no work of the kernel's: R2UR (a register copied into a
uniform register, e.g. a cache policy before each hinted load) and copies of a uniform
register into a register (`IMAD.U32 R, RZ, RZ, UR` / `MOV R, UR`: a constant ptxas
rematerialises instead of keeping it live).

    cuobjdump -sass kernels.cubin | python3 sass_loops.py [--inner 300] matvec_dense_rows mmvq_id_107
"""
import collections
import re
import sys

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
FUNC = re.compile(r"Function : (\S+)")
# A uniform register copied into a register: IMAD.U32 R, RZ, RZ, URn or MOV R, URn.
UR_COPY = re.compile(r"(IMAD\.U32\s+R\d+, RZ, RZ, UR\d+|MOV\s+R\d+, UR\d+)\s*$")


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
    args = sys.argv[1:]
    inner = None
    if args[:1] == ["--inner"]:
        inner, args = int(args[1]), args[2:]
    words = args
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
        found = loops(code)
        if inner is None:
            chosen = sorted(found, key=lambda p: p[0] - p[1])[:4]
        else:
            chosen = sorted((p for p in found if p[1] - p[0] + 1 >= inner), key=lambda p: p[1] - p[0])[:4]
        for s, e in chosen:
            body = code[s : e + 1]
            hist = collections.Counter(op.split(".")[0] for _, op, _ in body)
            top = ", ".join(f"{k} {v}" for k, v in hist.most_common(14))
            copies = sum(1 for _, op, rest in body if UR_COPY.match(op + rest))
            print(f"  loop {body[0][0]:#x}..{body[-1][0]:#x}: {len(body)} instr: {top}"
                  f" [R2UR {hist['R2UR']}, uniform copies {copies}]")


if __name__ == "__main__":
    main()
