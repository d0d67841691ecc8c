//! The block layouts: unpacking to integer levels and scales, decoding, encoding.
//!
//! Every ROCmFPx block holds 32 weights. Each type here turns one block into an
//! [`Unpacked`]: 32 small integer levels `q`, the scale of each 16-weight half and an
//! offset, such that weight `i` is `q[i] * s[i / 16] - o` (`o` is 0 except for affine
//! ROCmFP2). `decode` and the q8 dot product both start from that one unpacking, so the
//! hand-built-block tests of `decode` also pin down what the dot kernels read.
//!
//! Layouts (byte offsets inside the block):
//!
//! | type | qs | scales | code of weight i |
//! |---|---|---|---|
//! | 100 Q4_0_ROCMFP4 | 0..16 | e[0]=16 (w 0..16), e[1]=17 (w 16..32) | low nibble of qs[i] (i < 16), high nibble of qs[i-16] |
//! | 101 Q4_0_ROCMFP4_FAST | 0..16 | e=16 | as 100 |
//! | 102 Q6_0_ROCMFPX | 0..24 | e[0]=24, e[1]=25 | bits 6i..6i+6 of qs, LSB first |
//! | 103 Q8_0_ROCMFPX | 0..32 | e=32 | qs[i] as i8 |
//! | 104 Q3_0_ROCMFPX | 0..12 | e[0]=12, e[1]=13 | bits 3i..3i+3 of qs, LSB first |
//! | 107 Q2_0_ROCMFP2 | 0..8 | e[0]=8, e[1]=9 | bits 2i..2i+2 of qs, LSB first |
//!
//! "Bits n..m of qs, LSB first": bit n of the stream is bit `n % 8` of byte `n / 8`, and a
//! code's bit 0 is its lowest stream bit (so 3- and 6-bit codes cross byte boundaries).
//!
//! Levels: ROCmFP4 "codebook10" (bit 3 sign, bits 0..2 index 0,1,2,3,4,6,8,10); FP6
//! sign-magnitude (bit 5 sign, magnitude 0..31); FP8 two's-complement i8; FP3 (bit 2 sign,
//! bits 0..1 index 0,1,2,4); FP2 two-scale: code c is the level c - 1 (-1,0,1,2) times
//! the half's scale; FP2 affine: `c * S - O` with `S = e[0]`, `O = e[1]` for all 32.
//! A sign bit on magnitude 0 is "-0", i.e. 0.

use crate::ue4m3;

/// Weights per block (every ROCmFPx type).
pub const QK: usize = 32;

/// One block as integer levels and f32 scales: weight `i` is `q[i] * s[i / 16] - o`.
#[derive(Clone, Copy, Debug)]
pub struct Unpacked {
    pub q: [i8; QK],
    pub s: [f32; 2],
    pub o: f32,
}

/// One ROCmFPx block type (one meaning of one type id).
pub trait Format: 'static {
    const ID: u32;
    const NAME: &'static str;
    /// Bytes per 32-weight block.
    const BB: usize;
    /// The scale bytes: (offset in the block, name in messages).
    const SCALES: &'static [(usize, &'static str)];
    /// Whether the two halves have their own scales (else `s[0] == s[1]`).
    const SPLIT: bool;
    /// `value = q * S - O`: the dot product needs the activations' sum.
    const AFFINE: bool = false;
    fn unpack(b: &[u8]) -> Unpacked;
    /// Reference quantiser for one block of finite values (`out.len() == BB`, zeroed).
    fn encode_block(x: &[f32; QK], out: &mut [u8]);
}

/// Checks one block's scale bytes.
#[inline]
pub fn check_block<F: Format>(b: &[u8]) -> Result<(), String> {
    ue4m3::check(b, F::SCALES)
}

/// Decodes one block (`out.len() == 32`): `q * s - o` in f32, in that order.
#[inline(always)]
pub fn decode_block<F: Format>(b: &[u8], out: &mut [f32]) {
    let u = F::unpack(b);
    for (h, (o, q)) in out
        .chunks_exact_mut(16)
        .zip(u.q.chunks_exact(16))
        .enumerate()
    {
        let s = u.s[h];
        for (o, q) in o.iter_mut().zip(q) {
            *o = *q as f32 * s - u.o;
        }
    }
}

// ------------------------------------------------------------- level helpers

/// `mag` with the sign applied when `neg` is 1 (branch-free, vectorises).
#[inline(always)]
fn signed(mag: i8, neg: u8) -> i8 {
    let n = neg as i8;
    (mag ^ -n) + n
}

/// ROCmFP4 "codebook10" level of a 4-bit code.
#[inline(always)]
pub fn fp4_level(c: u8) -> i8 {
    let m = (c & 7) as i8;
    // 0..4 stay, 5, 6, 7 become 6, 8, 10.
    signed(m + (m - 4).max(0), (c >> 3) & 1)
}

/// FP6 sign-magnitude level.
#[inline(always)]
pub fn fp6_level(c: u8) -> i8 {
    signed((c & 31) as i8, (c >> 5) & 1)
}

/// FP3 level: magnitudes 0, 1, 2, 4.
#[inline(always)]
pub fn fp3_level(c: u8) -> i8 {
    let m = (c & 3) as i8;
    signed(m + ((m >> 1) & m & 1), (c >> 2) & 1)
}

/// Two-scale FP2 level: -1, 0, 1, 2.
#[inline(always)]
pub fn fp2_level(c: u8) -> i8 {
    (c & 3) as i8 - 1
}

// ------------------------------------------------------------- bit packing

/// Spreads the 8 consecutive `N`-bit fields (N = 2, 3 or 6) in the low `8 N` bits of
/// `x` into the 8 bytes of the result, field 0 in the lowest byte (SWAR: three
/// shift-and-mask steps, 4 fields per 32-bit lane, then 2 per 16-bit lane, then 1 per
/// byte; no carries cross lanes because every step only moves bits up into zeros).
#[inline(always)]
const fn spread8<const N: usize>(x: u64) -> u64 {
    // Fields 0..4 stay, fields 4..8 move to bit 32.
    let m4 = (1u64 << (4 * N)) - 1;
    let x = (x & m4) | ((x & (m4 << (4 * N))) << (32 - 4 * N));
    // In each 32-bit lane: fields 0..2 stay, fields 2..4 move to bit 16.
    let m2 = ((1u64 << (2 * N)) - 1) * 0x0000_0001_0000_0001;
    let x = (x & m2) | ((x & (m2 << (2 * N))) << (16 - 2 * N));
    // In each 16-bit lane: field 0 stays, field 1 moves to bit 8.
    let m1 = ((1u64 << N) - 1) * 0x0001_0001_0001_0001;
    (x & m1) | ((x & (m1 << N)) << (8 - N))
}

/// The 32 codes of `N` bits (2, 3 or 6) of an LSB-first stream: bits `N i .. N i + N`
/// are code `i`. Each group of 8 codes is `N` whole bytes.
#[inline(always)]
fn unpack_stream<const N: usize>(qs: &[u8]) -> [u8; QK] {
    let n = N;
    let mut c = [0u8; QK];
    for (g, c) in qs[..4 * n].chunks_exact(n).zip(c.chunks_exact_mut(8)) {
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(g);
        c.copy_from_slice(&spread8::<N>(u64::from_le_bytes(b)).to_le_bytes());
    }
    c
}

/// The inverse of [`unpack_stream`] for 3- and 6-bit codes (`qs` is overwritten).
fn pack24<const N: usize>(codes: &[u8; QK], qs: &mut [u8]) {
    let per = 24 / N;
    for (b, c) in qs.chunks_exact_mut(3).zip(codes.chunks_exact(per)) {
        let mut v = 0u32;
        for (j, c) in c.iter().enumerate() {
            v |= ((*c as u32) & ((1 << N) - 1)) << (N * j);
        }
        b.copy_from_slice(&v.to_le_bytes()[..3]);
    }
}

#[inline(always)]
fn unpack_nibbles(qs: &[u8]) -> [u8; QK] {
    let mut c = [0u8; QK];
    for i in 0..16 {
        c[i] = qs[i] & 15;
        c[i + 16] = qs[i] >> 4;
    }
    c
}

fn pack_nibbles(codes: &[u8; QK], qs: &mut [u8]) {
    for i in 0..16 {
        qs[i] = (codes[i] & 15) | (codes[i + 16] << 4);
    }
}

#[inline(always)]
fn unpack2(qs: &[u8]) -> [u8; QK] {
    let mut c = [0u8; QK];
    for (i, c) in c.iter_mut().enumerate() {
        *c = (qs[i >> 2] >> (2 * (i & 3))) & 3;
    }
    c
}

fn pack2(codes: &[u8; QK], qs: &mut [u8]) {
    qs[..8].fill(0);
    for (i, c) in codes.iter().enumerate() {
        qs[i >> 2] |= (c & 3) << (2 * (i & 3));
    }
}

#[inline(always)]
fn map<const N: usize>(c: [u8; N], f: impl Fn(u8) -> i8) -> [i8; N] {
    let mut q = [0i8; N];
    for (q, c) in q.iter_mut().zip(c) {
        *q = f(c);
    }
    q
}

#[inline(always)]
fn scales2(b: &[u8], off: usize) -> [f32; 2] {
    [ue4m3::decode(b[off]), ue4m3::decode(b[off + 1])]
}

#[inline(always)]
fn scales1(b: &[u8], off: usize) -> [f32; 2] {
    let s = ue4m3::decode(b[off]);
    [s, s]
}

// ------------------------------------------------------------- quantisation grids

/// A symmetric-ish level grid for the scale-search encoder.
pub trait Grid {
    /// The largest positive level (the scale search starts at `max|x| / TOP`).
    const TOP: f32;
    /// The code of the level nearest to `v = x / scale`, saturating at the ends (ties
    /// go to the smaller magnitude, except FP6/FP8 which round half away from zero).
    fn code(v: f32) -> u8;
    /// The level of a code.
    fn level(c: u8) -> i8;
}

pub struct Fp4Grid;
impl Grid for Fp4Grid {
    const TOP: f32 = 10.0;
    fn code(v: f32) -> u8 {
        // Midpoints between 0,1,2,3,4,6,8,10.
        const MID: [f32; 7] = [0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 9.0];
        let m = MID.iter().filter(|t| v.abs() > **t).count() as u8;
        m | if v < 0.0 && m > 0 { 8 } else { 0 }
    }
    fn level(c: u8) -> i8 {
        fp4_level(c)
    }
}

pub struct Fp6Grid;
impl Grid for Fp6Grid {
    const TOP: f32 = 31.0;
    fn code(v: f32) -> u8 {
        let m = v.abs().min(31.0).round() as u8;
        m | if v < 0.0 && m > 0 { 32 } else { 0 }
    }
    fn level(c: u8) -> i8 {
        fp6_level(c)
    }
}

pub struct Fp8Grid;
impl Grid for Fp8Grid {
    const TOP: f32 = 127.0;
    fn code(v: f32) -> u8 {
        v.clamp(-127.0, 127.0).round() as i8 as u8
    }
    fn level(c: u8) -> i8 {
        c as i8
    }
}

pub struct Fp3Grid;
impl Grid for Fp3Grid {
    const TOP: f32 = 4.0;
    fn code(v: f32) -> u8 {
        // Midpoints between 0,1,2,4.
        const MID: [f32; 3] = [0.5, 1.5, 3.0];
        let m = MID.iter().filter(|t| v.abs() > **t).count() as u8;
        m | if v < 0.0 && m > 0 { 4 } else { 0 }
    }
    fn level(c: u8) -> i8 {
        fp3_level(c)
    }
}

pub struct Fp2Grid;
impl Grid for Fp2Grid {
    const TOP: f32 = 2.0;
    fn code(v: f32) -> u8 {
        // Levels -1,0,1,2 are codes 0..3; ties go to the lower level.
        const MID: [f32; 3] = [-0.5, 0.5, 1.5];
        MID.iter().filter(|t| v > **t).count() as u8
    }
    fn level(c: u8) -> i8 {
        fp2_level(c)
    }
}

/// Squared error of `x` on grid `G` at scale byte `e`, stopping early once above `stop`
/// (in f64: huge finite inputs must not make every candidate score infinity).
fn grid_error<G: Grid>(x: &[f32], e: u8, stop: f64) -> f64 {
    let s = ue4m3::decode(e);
    let inv = 1.0 / s;
    let mut err = 0f64;
    for v in x {
        let d = *v as f64 - (G::level(G::code(v * inv)) as f32 * s) as f64;
        err += d * d;
        if err > stop {
            break;
        }
    }
    err
}

/// Scale byte for `x` on grid `G`: the smallest squared error among the bytes within
/// two octaves (16 bytes) of `max|x| / TOP`; ties go to the smaller byte. An all-zero
/// `x` gives 0.
pub fn choose_scale<G: Grid>(x: &[f32]) -> u8 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 {
        return 0;
    }
    let start = ue4m3::nearest(amax / G::TOP) as i32;
    let lo = (start - 16).max(1) as u8;
    let hi = (start + 16).min(ue4m3::MAX_BYTE as i32) as u8;
    let mut best = (f64::INFINITY, start as u8);
    for e in lo..=hi {
        let err = grid_error::<G>(x, e, best.0);
        if err < best.0 {
            best = (err, e);
        }
    }
    best.1
}

/// Codes of `x` on grid `G` at scale byte `e` (all 0 for a zero scale).
fn grid_codes<G: Grid>(x: &[f32], e: u8, codes: &mut [u8]) {
    let s = ue4m3::decode(e);
    if s == 0.0 {
        // Code 0 is level 0 on every symmetric grid; FP2's zero level is code 1.
        let zero = (0..=u8::MAX).find(|c| G::level(*c) == 0).unwrap_or(0);
        codes.fill(zero);
        return;
    }
    let inv = 1.0 / s;
    for (c, v) in codes.iter_mut().zip(x) {
        *c = G::code(v * inv);
    }
}

/// Per-half (split) or whole-block scale and codes on grid `G`.
fn encode_grid<G: Grid>(x: &[f32; QK], split: bool) -> ([u8; 2], [u8; QK]) {
    let mut codes = [0u8; QK];
    if split {
        let mut e = [0u8; 2];
        for h in 0..2 {
            let xs = &x[16 * h..16 * h + 16];
            e[h] = choose_scale::<G>(xs);
            grid_codes::<G>(xs, e[h], &mut codes[16 * h..16 * h + 16]);
        }
        (e, codes)
    } else {
        let e = choose_scale::<G>(x);
        grid_codes::<G>(x, e, &mut codes);
        ([e, e], codes)
    }
}

// ------------------------------------------------------------- the types

/// 100: ROCmFP4, one scale per 16-weight half.
pub struct Fp4;
impl Format for Fp4 {
    const ID: u32 = 100;
    const NAME: &'static str = "Q4_0_ROCMFP4";
    const BB: usize = 18;
    const SCALES: &'static [(usize, &'static str)] = &[(16, "e[0]"), (17, "e[1]")];
    const SPLIT: bool = true;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack_nibbles(&b[..16]), fp4_level),
            s: scales2(b, 16),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp4Grid>(x, true);
        pack_nibbles(&codes, &mut out[..16]);
        out[16..18].copy_from_slice(&e);
    }
}

/// 101: ROCmFP4 with one scale for the whole block.
pub struct Fp4Fast;
impl Format for Fp4Fast {
    const ID: u32 = 101;
    const NAME: &'static str = "Q4_0_ROCMFP4_FAST";
    const BB: usize = 17;
    const SCALES: &'static [(usize, &'static str)] = &[(16, "e")];
    const SPLIT: bool = false;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack_nibbles(&b[..16]), fp4_level),
            s: scales1(b, 16),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp4Grid>(x, false);
        pack_nibbles(&codes, &mut out[..16]);
        out[16] = e[0];
    }
}

/// 102: 6-bit sign-magnitude, one scale per half.
pub struct Fp6;
impl Format for Fp6 {
    const ID: u32 = 102;
    const NAME: &'static str = "Q6_0_ROCMFPX";
    const BB: usize = 26;
    const SCALES: &'static [(usize, &'static str)] = &[(24, "e[0]"), (25, "e[1]")];
    const SPLIT: bool = true;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack_stream::<6>(&b[..24]), fp6_level),
            s: scales2(b, 24),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp6Grid>(x, true);
        pack24::<6>(&codes, &mut out[..24]);
        out[24..26].copy_from_slice(&e);
    }
}

/// 103: int8 levels, one scale.
pub struct Fp8;
impl Format for Fp8 {
    const ID: u32 = 103;
    const NAME: &'static str = "Q8_0_ROCMFPX";
    const BB: usize = 33;
    const SCALES: &'static [(usize, &'static str)] = &[(32, "e")];
    const SPLIT: bool = false;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        let mut q = [0i8; QK];
        for (q, b) in q.iter_mut().zip(&b[..32]) {
            *q = *b as i8;
        }
        Unpacked {
            q,
            s: scales1(b, 32),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp8Grid>(x, false);
        out[..32].copy_from_slice(&codes);
        out[32] = e[0];
    }
}

/// 104: 3-bit, magnitudes 0,1,2,4, one scale per half.
pub struct Fp3;
impl Format for Fp3 {
    const ID: u32 = 104;
    const NAME: &'static str = "Q3_0_ROCMFPX";
    const BB: usize = 14;
    const SCALES: &'static [(usize, &'static str)] = &[(12, "e[0]"), (13, "e[1]")];
    const SPLIT: bool = true;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack_stream::<3>(&b[..12]), fp3_level),
            s: scales2(b, 12),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp3Grid>(x, true);
        pack24::<3>(&codes, &mut out[..12]);
        out[12..14].copy_from_slice(&e);
    }
}

/// 107, variant 1: two-scale ROCmFP2, levels -1,0,1,2 times the half's scale.
pub struct Fp2TwoScale;
impl Format for Fp2TwoScale {
    const ID: u32 = 107;
    const NAME: &'static str = "Q2_0_ROCMFP2";
    const BB: usize = 10;
    const SCALES: &'static [(usize, &'static str)] = &[(8, "e[0]"), (9, "e[1]")];
    const SPLIT: bool = true;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack2(&b[..8]), fp2_level),
            s: scales2(b, 8),
            o: 0.0,
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let (e, codes) = encode_grid::<Fp2Grid>(x, true);
        pack2(&codes, &mut out[..8]);
        out[8..10].copy_from_slice(&e);
    }
}

/// 107, variant 2: affine ROCmFP2, `code * S - O` with `S = e[0]`, `O = e[1]`.
pub struct Fp2Affine;
impl Format for Fp2Affine {
    const ID: u32 = 107;
    const NAME: &'static str = "Q2_0_ROCMFP2";
    const BB: usize = 10;
    const SCALES: &'static [(usize, &'static str)] =
        &[(8, "e[0] (scale S)"), (9, "e[1] (offset O)")];
    const SPLIT: bool = false;
    const AFFINE: bool = true;
    #[inline(always)]
    fn unpack(b: &[u8]) -> Unpacked {
        Unpacked {
            q: map(unpack2(&b[..8]), |c| c as i8),
            s: scales1(b, 8),
            o: ue4m3::decode(b[9]),
        }
    }
    fn encode_block(x: &[f32; QK], out: &mut [u8]) {
        let ones = [1f32; QK];
        let (s, o) = crate::fp2::choose_affine(x, &ones);
        let codes = crate::fp2::affine_codes(x, s, o);
        pack2(&codes, &mut out[..8]);
        out[8] = s;
        out[9] = o;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn level_tables() {
        let fp4: Vec<i8> = (0..16).map(fp4_level).collect();
        assert_eq!(
            fp4,
            [0, 1, 2, 3, 4, 6, 8, 10, 0, -1, -2, -3, -4, -6, -8, -10]
        );
        let fp3: Vec<i8> = (0..8).map(fp3_level).collect();
        assert_eq!(fp3, [0, 1, 2, 4, 0, -1, -2, -4]);
        let fp6: Vec<i8> = (0..64).map(fp6_level).collect();
        for c in 0..32 {
            assert_eq!(fp6[c], c as i8);
            assert_eq!(fp6[c + 32], -(c as i8));
        }
        let fp2: Vec<i8> = (0..4).map(fp2_level).collect();
        assert_eq!(fp2, [-1, 0, 1, 2]);
    }

    #[test]
    fn packing_round_trips() {
        let codes: [u8; QK] = std::array::from_fn(|i| ((i * 37 + 11) % 64) as u8);
        let mut qs = [0u8; 24];
        pack24::<6>(&codes, &mut qs);
        assert_eq!(unpack_stream::<6>(&qs), codes);
        let c3 = codes.map(|c| c & 7);
        let mut qs = [0u8; 12];
        pack24::<3>(&c3, &mut qs);
        assert_eq!(unpack_stream::<3>(&qs), c3);
        let c2 = codes.map(|c| c & 3);
        let mut qs = [0xffu8; 8];
        pack2(&c2, &mut qs);
        assert_eq!(unpack2(&qs), c2);
        assert_eq!(unpack_stream::<2>(&qs), c2);
        let c4 = codes.map(|c| c & 15);
        let mut qs = [0u8; 16];
        pack_nibbles(&c4, &mut qs);
        assert_eq!(unpack_nibbles(&qs), c4);
    }

    #[test]
    fn grid_codes_are_nearest_levels() {
        fn check<G: Grid>(codes: impl Iterator<Item = u8>) {
            let levels: Vec<i8> = codes.map(G::level).collect();
            let mut v = -140.0f32;
            while v <= 140.0 {
                let got = G::level(G::code(v)) as f32;
                let best = levels
                    .iter()
                    .map(|l| (v - *l as f32).abs())
                    .fold(f32::INFINITY, f32::min);
                assert_eq!((v - got).abs(), best, "v = {v}");
                v += 0.125;
            }
        }
        check::<Fp4Grid>(0..=15);
        check::<Fp6Grid>(0..=63);
        // -128 (0x80) is a valid byte but the encoder never writes it.
        check::<Fp8Grid>((0..=255).filter(|c| *c != 0x80));
        check::<Fp3Grid>(0..=7);
        check::<Fp2Grid>(0..=3);
    }
}
