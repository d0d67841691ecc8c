#!/usr/bin/env python3
"""The streamed bf16 tiles' data flow (kernels/gpu/rocmfpx.cu, mmw_tile) emulated on the
CPU, for working on them without a device: the stages filled as the cp.async pieces
fill them, each lane's A and B fragment words read as the kernel reads them (the scalar
loads and MMW_LDSM's ldmatrix), the mma.sync m16n8k16 fragment layout, the epilogue's
mapping, for both warp layouts and tile widths, against a direct product of the same
bf16 values (float64); and MMW_FAST_ISSUE's per-thread copy addresses against the
stage loop's (the same pieces to the same places). It mirrors the kernel by reading, so
a change to one needs the same change here; it checks the design's indexing, not the
compiled code (the device's `gpu_kernels` does that). Prints the relative error (0
expected) and unwritten outputs.

  python3 scripts/device/mmw_emulate.py
"""
import numpy as np, struct, random
f32 = np.float32
def bf(x):  # f32 -> bf16 bits (RNE)
    b = struct.unpack('<I', struct.pack('<f', float(f32(x))))[0]
    return ((b + 0x7fff + ((b >> 16) & 1)) >> 16) & 0xffff
def bf2f(h): return struct.unpack('<f', struct.pack('<I', (h & 0xffff) << 16))[0]
def bf16x2(lo, hi): return bf(lo) | (bf(hi) << 16)
def ue4m3(b):
    b &= 0xff
    if b >= 0x7f: return f32(0)
    e, m = (b >> 3) & 15, b & 7
    return f32(m * 2.0**-10 if e == 0 else (8 + m) * 2.0**(e - 11))
def perm(a, b, sel):
    by = struct.pack('<II', a & 0xffffffff, b & 0xffffffff); out = 0
    for i in range(4): out |= by[(sel >> (4 * i)) & 7] << (8 * i)
    return out
def mag(c):
    m = c & 7; a = m if m <= 4 else 2 * m - 4
    return -a if c & 8 else a
LUT107 = [0x1010 + 34 * (i & 3) + 8704 * (i >> 2) for i in range(16)]
LUTFP4 = [bf16x2(mag(t & 15), mag(t >> 4)) for t in range(256)]
def bfmul(a, b): return bf16x2(f32(bf2f(a)) * f32(bf2f(b)), f32(bf2f(a >> 16)) * f32(bf2f(b >> 16)))
u16 = lambda buf, o: buf[o] | buf[o + 1] << 8
u32 = lambda buf, o: u16(buf, o) | u16(buf, o + 2) << 16
BM, KS, STAGES = 128, 128, 4
ALD = KS // 2 + 4

def tables(TY, row, BLK, affine, sm):
    BB = 10 if TY == 107 else 18
    sc = u16(sm, row + BLK * BB + (8 if TY == 107 else 16))
    e0, e1 = ue4m3(sc), ue4m3(sc >> 8)
    if TY == 107:
        o0 = e1 if affine else e0
        t0 = [bf16x2(-o0, e0 - o0)]; t1 = [bf16x2(f32(2) * e0 - o0, f32(3) * e0 - o0)]
        if affine: t0.append(t0[0]); t1.append(t1[0])
        else: t0.append(bf16x2(-e1, e1 - e1)); t1.append(bf16x2(f32(2) * e1 - e1, f32(3) * e1 - e1))
        return t0, t1
    return [bf16x2(e0, e0), bf16x2(e1, e1)], None

def frag(TY, row, tb, BLK, h, q, sm):
    BB = 10 if TY == 107 else 18
    b = row + BLK * BB
    if TY == 107:
        w = u32(sm, b + 4 * h)
        t0, t1 = tb
        return perm(t0[h], t1[h], LUT107[(w >> (4 * q)) & 15]), perm(t0[h], t1[h], LUT107[(w >> (4 * q + 16)) & 15])
    t0, _ = tb
    x0 = u16(sm, b + 2 * q) >> (4 * h); x1 = u16(sm, b + 2 * q + 8) >> (4 * h)
    return bfmul(LUTFP4[(x0 & 0xf) | ((x0 >> 4) & 0xf0)], t0[h]), bfmul(LUTFP4[(x1 & 0xf) | ((x1 >> 4) & 0xf0)], t0[h])

def tile(TY, BN, MT, w, row_bytes, nb, m, r0, xb, kw, acol, ocol, affine, out, ldsm):
    BB = 10 if TY == 107 else 18
    WRB = 4 * BB; G = WRB // 8; NT = BN // 8; NTH = 256 // MT
    SB = BM * WRB + BN * ALD * 4; AOFF = BM * WRB
    sm = bytearray(STAGES * SB)
    acc = {}  # (warp, lane) -> list
    for t in range(NTH): acc[t] = [0.0] * (MT * NT * 4)
    stages = nb // 4
    def issue(s):
        st = (s % STAGES) * SB; off = s * WRB
        for t in range(NTH):
            i = t
            while i < BM * G:
                row, part = divmod(i, G); gr = r0 + row
                src = gr * row_bytes + off + 8 * part
                sm[st + row * WRB + 8 * part: st + row * WRB + 8 * part + 8] = w[src:src + 8] if gr < m else bytes(8)
                i += NTH
            i = t
            while i < BN * 16:
                col, part = i >> 4, i & 15; gc = acol[col]
                d = st + AOFF + 4 * (col * ALD + 4 * part)
                if gc >= 0:
                    words = xb[gc * kw + 64 * s + 4 * part: gc * kw + 64 * s + 4 * part + 4]
                    sm[d:d + 16] = struct.pack('<4I', *words)
                else: sm[d:d + 16] = bytes(16)
                i += NTH
    for s in range(min(STAGES - 1, stages)): issue(s)
    for s in range(stages):
        if s + STAGES - 1 < stages: issue(s + STAGES - 1)  # (after the barrier: buffer s-1 is free)
        st = (s % STAGES) * SB
        for warp in range(NTH // 32):
            wr = warp * 16 * MT
            rows = st + wr * WRB; as_ = st + AOFF
            for BLK in range(4):
                for h in range(2):
                    ks = 2 * BLK + h
                    # per lane fragments -> matrices
                    A = np.zeros((MT, 16, 16)); B = np.zeros((NT, 16, 8))
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        for mt in range(MT):
                            ra = rows + (16 * mt + g) * WRB; rb = rows + (16 * mt + 8 + g) * WRB
                            a0, a2 = frag(TY, ra, tables(TY, ra, BLK, affine, sm), BLK, h, q, sm)
                            a1, a3 = frag(TY, rb, tables(TY, rb, BLK, affine, sm), BLK, h, q, sm)
                            for reg, (r, c) in zip((a0, a1, a2, a3), ((g, 2*q), (g+8, 2*q), (g, 2*q+8), (g+8, 2*q+8))):
                                A[mt, r, c] = bf2f(reg); A[mt, r, c + 1] = bf2f(reg >> 16)
                        for nt in range(NT):
                            if ldsm:
                                continue
                            o = as_ + 4 * ((nt * 8 + g) * ALD + 8 * ks + q)
                            b0, b1 = u32(sm, o), u32(sm, o + 16)
                            B[nt, 2*q, g] = bf2f(b0); B[nt, 2*q+1, g] = bf2f(b0 >> 16)
                            B[nt, 2*q+8, g] = bf2f(b1); B[nt, 2*q+9, g] = bf2f(b1 >> 16)
                    if ldsm:
                        for nt in range(0, NT, 2):
                            addrs = [as_ + 4 * (((l >> 4) * 8 + (l & 7)) * ALD + 4 * ((l >> 3) & 1) + 8 * ks + nt * 8 * ALD) for l in range(32)]
                            for L in range(32):
                                g, q = L >> 2, L & 3
                                d = [u32(sm, addrs[8 * i + g] + 4 * q) for i in range(4)]
                                for (tnt, reg, kb) in ((nt, d[0], 0), (nt, d[1], 8), (nt + 1, d[2], 0), (nt + 1, d[3], 8)):
                                    B[tnt, kb + 2*q, g] = bf2f(reg); B[tnt, kb + 2*q + 1, g] = bf2f(reg >> 16)
                    for mt in range(MT):
                        for nt in range(NT):
                            C = A[mt] @ B[nt]
                            for lane in range(32):
                                g, q = lane >> 2, lane & 3
                                base = (mt * NT + nt) * 4
                                t = warp * 32 + lane
                                acc[t][base + 0] += C[g, 2*q]; acc[t][base + 1] += C[g, 2*q+1]
                                acc[t][base + 2] += C[g+8, 2*q]; acc[t][base + 3] += C[g+8, 2*q+1]
    for t in range(NTH):
        lane, warp = t & 31, t >> 5; g, q = lane >> 2, lane & 3; wr = warp * 16 * MT
        for i in range(MT * NT * 4):
            mrow = ((i >> 2) // NT) * 16 + g + ((i & 2) << 2); mcol = ((i >> 2) % NT) * 8 + 2 * q + (i & 1)
            gr = r0 + wr + mrow; oc = ocol[mcol]
            if gr < m and oc >= 0: out[oc, gr] = acc[t][i]

def run(TY, affine, BN, MT, ldsm, m=200, k=256, n=None, seed=0):
    random.seed(seed); n = n or BN
    BB = 10 if TY == 107 else 18; nb = k // 32; row_bytes = nb * BB
    w = bytearray(random.getrandbits(8) for _ in range(m * row_bytes))
    for r in range(m):
        for b in range(nb):
            o = r * row_bytes + b * BB + (8 if TY == 107 else 16)
            w[o] = 0x28 + random.randrange(0x30); w[o + 1] = 0x20 + random.randrange(0x30)
    x = np.random.RandomState(seed).randn(n, k).astype(np.float32)
    xb = [bf16x2(x[c, 2*i], x[c, 2*i+1]) for c in range(n) for i in range(k // 2)]
    kw = k // 2
    # reference: the bf16 weight values (mmb_decode's), the bf16 activations
    W = np.zeros((m, k))
    for r in range(m):
        for b in range(nb):
            o = r * row_bytes + b * BB
            for h in range(2):
                tb = tables(TY, o - b * BB, b, affine, w)  # (row base, block b)
                for q in range(4):
                    lo, hi = frag(TY, o - b * BB, tb, b, h, q, w)
                    base = b * 32 + 16 * h
                    W[r, base + 2*q] = bf2f(lo); W[r, base + 2*q + 1] = bf2f(lo >> 16)
                    W[r, base + 2*q + 8] = bf2f(hi); W[r, base + 2*q + 9] = bf2f(hi >> 16)
    X = np.array([[bf2f(v) for p in xb[c*kw:(c+1)*kw] for v in (p, p >> 16)] for c in range(n)])
    want = X @ W.T
    out = np.full((n, m), np.nan)
    for r0 in range(0, m, BM):
        acol = list(range(n)) + [-1] * (BN - n); ocol = acol[:]
        tile(TY, BN, MT, bytes(w), row_bytes, nb, m, r0, xb, kw, acol, ocol, affine, out, ldsm)
    err = np.nanmax(np.abs(out - want)) / np.abs(want).max()
    return err, np.isnan(out).sum()

for TY, aff in ((107, 1), (107, 0), (100, 0)):
    for BN, MT, ldsm in ((16, 1, False), (16, 2, True), (64, 1, True), (64, 2, False)):
        e, nans = run(TY, aff, BN, MT, ldsm, n=BN - 3 if BN == 16 else 40)
        print(TY, 'affine' if aff else '', 'BN', BN, 'MT', MT, 'ldsm' if ldsm else '', 'rel err %.2e' % e, 'unwritten', nans)

def copies(TY, BN, MT, s, r0, m, acol, fast):
    """Stage s's cp.async pieces as (dst offset in the stage, source, bytes, zero-fill):
    the stage loop's (i = t, t + NTH, ...) or MMW_FAST_ISSUE's per-thread layout."""
    BB = 10 if TY == 107 else 18
    WRB = 4 * BB; G = WRB // 8; NTH = 256 // MT; AOFF = BM * WRB; row_bytes = 4096
    out = []
    for t in range(NTH):
        if not fast:
            for i in range(t, BM * G, NTH):
                row, part = divmod(i, G); on = r0 + row < m
                out.append((row * WRB + 8 * part, ('w', (r0 + row) * row_bytes + s * WRB + 8 * part if on else 0), 8, not on))
            for i in range(t, BN * 16, NTH):
                col, part = i >> 4, i & 15; gc = acol[col]
                out.append((AOFF + 4 * (col * ALD + 4 * part), ('x', gc * 4096 + 64 * s + 4 * part if gc >= 0 else 0), 16, gc < 0))
            continue
        TPR = NTH // BM; WCP = -(-G // TPR); ACP = BN * 16 // NTH
        wrow, wk = t // TPR, t % TPR; won = r0 + wrow < m
        wsrc = (r0 + wrow) * row_bytes + 8 * wk if won else 0; wdst = wrow * WRB + 8 * wk
        for j in range(WCP):
            if wk + TPR * j < G:
                out.append((wdst + 8 * TPR * j, ('w', wsrc + s * WRB + 8 * TPR * j if won else 0), 8, not won))
        adst = AOFF + 4 * ((t >> 4) * ALD + 4 * (t & 15))
        for j in range(ACP):
            gc = acol[(t >> 4) + j * (NTH >> 4)]
            aoff = gc * 4096 + 4 * (t & 15) if gc >= 0 else -1
            out.append((adst + j * (NTH >> 4) * ALD * 4, ('x', aoff + 64 * s if aoff >= 0 else 0), 16, aoff < 0))
    return sorted(out)

bad = 0
for TY in (107, 100):
    for BN, MT in ((16, 1), (16, 2), (64, 1), (64, 2)):
        acol = [c if c % 5 else -1 for c in range(BN)]
        for s, r0, m in ((0, 0, 300), (3, 128, 200), (7, 256, 300)):
            a, b = copies(TY, BN, MT, s, r0, m, acol, False), copies(TY, BN, MT, s, r0, m, acol, True)
            bad += a != b
print('MMW_FAST_ISSUE copies: the same pieces as the stage loop' if not bad else f'MMW_FAST_ISSUE copies: {bad} cases differ')
