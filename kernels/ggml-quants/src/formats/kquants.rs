//! ggml's K-quants: 256-weight super-blocks with quantised sub-block scales.
//!
//! Layouts (f16 `d`/`dmin`, little-endian), weight index j in 0..256:
//! * Q2_K `scales[16], qs[64], d, dmin`: sub-block j/16 of 16 has scale `scales & 15` and
//!   min `scales >> 4`; q = (qs[32*(j/128) + j%32] >> 2*((j%128)/32)) & 3;
//!   w = (d*sc) * q - (dmin*m).
//! * Q3_K `hmask[32], qs[64], scales[12], d`: 6-bit signed scales (see [`q3k_scales`]);
//!   low 2 bits as Q2_K, high bit = (hmask[j%32] >> j/32) & 1, q = low - 4*(1 - high);
//!   w = (d*sc) * q.
//! * Q4_K `d, dmin, scales[12], qs[128]`: 8 sub-blocks of 32 with 6-bit scale and min
//!   (see [`q4k_scale_min`]); q = (qs[32*(s/2) + l] >> 4*(s%2)) & 15;
//!   w = (d*sc) * q - (dmin*m).
//! * Q5_K `d, dmin, scales[12], qh[32], qs[128]`: Q4_K plus bit s of qh[l] as bit 4.
//! * Q6_K `ql[128], qh[64], scales[16] (i8), d`: 16 sub-blocks of 16;
//!   q = (4 bits of ql | 2 bits of qh << 4) - 32; w = (d*sc) * q.
//!
//! Encoders: a straightforward per-sub-block scale (abs-max for the symmetric Q3_K/Q6_K,
//! min/max with the min clamped to <= 0 for the affine types), then the sub-block scales
//! (and mins) quantised against the super-block's largest one, then round-to-nearest
//! codes against the quantised scales. Not ggml's iterative search: lower quality, simple.

use moe_plugin_api::BlockQ8_1;

use super::{min_max, signed_absmax, Block};
use crate::dot::{sub, sub16, Acc, DotUnit, Ops, Portable};
use crate::fp::{check_f16, f16_at, f16_checked, round_clamp};

/// Unpacked super-block: codes, integer sub-block scales (and mins), f32 d (and dmin).
pub struct UnpackedK<const NS: usize> {
    pub q: [i8; 256],
    pub sc: [i8; NS],
    pub mn: [i8; NS],
    pub d: f32,
    pub dmin: f32,
}

/// Q3_K's sixteen 6-bit scales minus 32. Byte i < 8 holds the low nibbles of scales i
/// (bits 0-3) and i + 8 (bits 4-7); bytes 8..12 hold the top two bits, scale i at bits
/// 2*(i/4) of byte 8 + i%4.
#[inline(always)]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut sc = [0i8; 16];
    for (i, v) in sc.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0x0f } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *v = (low | (high << 4)) as i8 - 32;
    }
    sc
}

/// Q4_K/Q5_K's eight 6-bit scales and mins. Sub-blocks 0..4 keep their 6 bits in the
/// low bits of bytes 0..4 (scales) and 4..8 (mins); sub-blocks 4..8 keep their low 4 bits
/// in bytes 8..12 (scale low nibble, min high nibble) and their top 2 bits in the top
/// bits of bytes 0..4 (scales) and 4..8 (mins).
#[inline(always)]
pub fn q4k_scale_min(s: &[u8]) -> ([i8; 8], [i8; 8]) {
    let mut sc = [0i8; 8];
    let mut mn = [0i8; 8];
    for i in 0..4 {
        sc[i] = (s[i] & 0x3f) as i8;
        mn[i] = (s[i + 4] & 0x3f) as i8;
        sc[i + 4] = ((s[i + 8] & 0x0f) | ((s[i] >> 6) << 4)) as i8;
        mn[i + 4] = ((s[i + 8] >> 4) | ((s[i + 4] >> 6) << 4)) as i8;
    }
    (sc, mn)
}

fn pack_q4k_scale_min(sc: &[i32; 8], mn: &[i32; 8], s: &mut [u8]) {
    for i in 0..4 {
        let (a, b, c, d) = (sc[i] as u8, mn[i] as u8, sc[i + 4] as u8, mn[i + 4] as u8);
        s[i] = a | ((c >> 4) << 6);
        s[i + 4] = b | ((d >> 4) << 6);
        s[i + 8] = (c & 0x0f) | ((d & 0x0f) << 4);
    }
}

/// Codes of the 2-bit planes shared by Q2_K and the low bits of Q3_K.
#[inline(always)]
fn two_bit_planes(qs: &[u8], q: &mut [i8; 256]) {
    for half in 0..2 {
        for sh in 0..4 {
            for l in 0..32 {
                q[half * 128 + sh * 32 + l] = ((qs[half * 32 + l] >> (2 * sh)) & 3) as i8;
            }
        }
    }
}

fn pack_two_bit_planes(u: &[i32; 256], qs: &mut [u8]) {
    qs.fill(0);
    for (j, v) in u.iter().enumerate() {
        qs[(j / 128) * 32 + j % 32] |= ((*v as u8) & 3) << (2 * ((j % 128) / 32));
    }
}

/// Affine sub-block parameters: (scale, -min) with min clamped to <= 0 because the
/// K-quant formats only subtract a non-negative `dmin * m`.
fn affine_params(x: &[f32], levels: f32) -> (f32, f32) {
    let (lo, hi) = min_max(x);
    let lo = lo.min(0.0);
    ((hi - lo) / levels, -lo)
}

/// Quantises non-negative per-sub-block values to `0..=max` against their largest one.
fn quantise_scales<const N: usize>(
    v: &[f32; N],
    max: i32,
    what: &str,
) -> Result<(u16, f32, [i32; N]), String> {
    let top = v.iter().fold(0f32, |m, s| m.max(*s));
    let (mut bits, mut d) = f16_checked(top / max as f32, what)?;
    if d == 0.0 && top > 0.0 {
        // `top / max` underflowed f16: use its smallest subnormal, 2^-24, so that tiny
        // sub-blocks keep some resolution (the codes then stay below `max`).
        (bits, d) = (1, f32::from_bits(0x3380_0000));
    }
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i32; N];
    for (q, s) in q.iter_mut().zip(v) {
        *q = round_clamp(s * id, 0, max);
    }
    Ok((bits, d, q))
}

/// Quantises signed per-sub-block scales to `-2^(b-1)..2^(b-1)` with the largest
/// magnitude one at the negative end (ggml's convention).
fn quantise_signed_scales<const N: usize>(
    v: &[f32; N],
    half: i32,
) -> Result<(u16, f32, [i32; N]), String> {
    let top = signed_absmax(v);
    let (mut bits, mut d) = f16_checked(top / -(half as f32), "d")?;
    if d == 0.0 && top != 0.0 {
        // Underflowed f16: the smallest subnormal, signed like `top / -half`.
        (bits, d) = if top > 0.0 {
            (0x8001, -f32::from_bits(0x3380_0000))
        } else {
            (0x0001, f32::from_bits(0x3380_0000))
        };
    }
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i32; N];
    for (q, s) in q.iter_mut().zip(v) {
        *q = round_clamp(s * id, -half, half - 1);
    }
    Ok((bits, d, q))
}

/// Affine K-quant encoding shared by Q2_K (16 x 16), Q4_K and Q5_K (8 x 32).
/// Returns (d bits, dmin bits, scales, mins, codes).
#[allow(clippy::type_complexity)]
fn encode_affine_k<const NS: usize>(
    x: &[f32],
    levels: i32,
    scale_max: i32,
) -> Result<(u16, u16, [i32; NS], [i32; NS], [i32; 256]), String> {
    let len = 256 / NS;
    let mut scales = [0f32; NS];
    let mut mins = [0f32; NS];
    for s in 0..NS {
        (scales[s], mins[s]) = affine_params(&x[s * len..(s + 1) * len], levels as f32);
    }
    let (dbits, d, sc) = quantise_scales(&scales, scale_max, "d")?;
    let (mbits, dmin, mn) = quantise_scales(&mins, scale_max, "dmin")?;
    let mut q = [0i32; 256];
    for s in 0..NS {
        let ds = d * sc[s] as f32;
        let dm = dmin * mn[s] as f32;
        let id = if ds > 0.0 { 1.0 / ds } else { 0.0 };
        for l in 0..len {
            q[s * len + l] = round_clamp((x[s * len + l] + dm) * id, 0, levels);
        }
    }
    Ok((dbits, mbits, sc, mn, q))
}

/// Symmetric K-quant encoding (Q3_K: 16 x 16, codes -4..4; Q6_K: 16 x 16, codes -32..32).
/// Returns (d bits, scales, codes + half).
fn encode_symmetric_k(
    x: &[f32],
    half: i32,
    scale_half: i32,
) -> Result<(u16, [i32; 16], [i32; 256]), String> {
    let mut scales = [0f32; 16];
    for (s, v) in scales.iter_mut().enumerate() {
        *v = signed_absmax(&x[s * 16..(s + 1) * 16]) / -(half as f32);
    }
    let (bits, d, sc) = quantise_signed_scales(&scales, scale_half)?;
    let mut q = [0i32; 256];
    for s in 0..16 {
        let ds = d * sc[s] as f32;
        let id = if ds != 0.0 { 1.0 / ds } else { 0.0 };
        for l in 0..16 {
            q[s * 16 + l] = round_clamp(x[s * 16 + l] * id, -half, half - 1) + half;
        }
    }
    Ok((bits, sc, q))
}

/// The dot form of Q2_K: codes pre-multiplied by their sub-block scale in i16, so one
/// `pmaddwd` per 16 weights applies both, and the mins spread over their weights.
pub struct KDot16 {
    pub w: [i16; 256],
    pub m: [i16; 256],
    pub d: f32,
    pub dmin: f32,
}

/// The dot form of Q3_K/Q6_K: codes times sub-block scale (|q * sc| <= 32 * 128).
pub struct KSym16 {
    pub w: [i16; 256],
    pub d: f32,
}

#[inline(always)]
fn prescale16(q: &[i8; 256], sc: &[i8; 16]) -> [i16; 256] {
    let mut w = [0i16; 256];
    for s in 0..16 {
        for l in 0..16 {
            w[s * 16 + l] = q[s * 16 + l] as i16 * sc[s] as i16;
        }
    }
    w
}

/// `sum_b d_a sum(w q_a)` over the eight q8_1 blocks of a super-block.
#[inline(always)]
fn dot_w16<O: Ops>(w: &[i16; 256], a: &[BlockQ8_1]) -> [f32; 8] {
    let mut l = Acc::default();
    for (b, a) in a.iter().enumerate().take(8) {
        l.add_scaled::<O>(a.d, &O::dot32w(sub16::<32>(w, 32 * b), &a.qs));
    }
    l.v
}

// ---------------------------------------------------------------- Q2_K

pub struct Q2K;

impl Q2K {
    #[inline(always)]
    fn parts<O: Ops>(b: &[u8]) -> UnpackedK<16> {
        let mut q = [0i8; 256];
        two_bit_planes(&b[16..80], &mut q);
        let mut sc = [0i8; 16];
        let mut mn = [0i8; 16];
        for i in 0..16 {
            sc[i] = (b[i] & 0x0f) as i8;
            mn[i] = (b[i] >> 4) as i8;
        }
        UnpackedK {
            q,
            sc,
            mn,
            d: f16_at::<O>(b, 80),
            dmin: f16_at::<O>(b, 82),
        }
    }
}

impl DotUnit for Q2K {
    const DW: usize = 256;
    const DB: usize = 84;
    type U = KDot16;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> KDot16 {
        let p = Self::parts::<O>(b);
        let mut m = [0i16; 256];
        for s in 0..16 {
            for l in 0..16 {
                m[s * 16 + l] = p.mn[s] as i16;
            }
        }
        KDot16 {
            w: prescale16(&p.q, &p.sc),
            m,
            d: p.d,
            dmin: p.dmin,
        }
    }
    /// The mins cover 16 weights but a q8_1 block's `sum` covers 32, so the min term
    /// uses the activation codes: `dmin * sum_b d_a sum(m q_a)`.
    #[inline(always)]
    fn dot<O: Ops>(u: &KDot16, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled_f::<O>(u.d, &dot_w16::<O>(&u.w, a));
        acc.add_scaled_f::<O>(-u.dmin, &dot_w16::<O>(&u.m, a));
    }
}

impl Block for Q2K {
    const ID: u32 = 10;
    const NAME: &'static str = "Q2_K";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 80, "d")?;
        check_f16(b, 82, "dmin")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::parts::<Portable>(b);
        for s in 0..16 {
            let dl = u.d * u.sc[s] as f32;
            let ml = u.dmin * u.mn[s] as f32;
            for l in 0..16 {
                out[s * 16 + l] = dl * u.q[s * 16 + l] as f32 - ml;
            }
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, dmin, sc, mn, q) = encode_affine_k::<16>(x, 3, 15)?;
        for i in 0..16 {
            out[i] = sc[i] as u8 | ((mn[i] as u8) << 4);
        }
        pack_two_bit_planes(&q, &mut out[16..80]);
        out[80..82].copy_from_slice(&d.to_le_bytes());
        out[82..84].copy_from_slice(&dmin.to_le_bytes());
        Ok(())
    }
}

// ---------------------------------------------------------------- Q3_K

pub struct Q3K;

impl Q3K {
    #[inline(always)]
    fn parts<O: Ops>(b: &[u8]) -> UnpackedK<16> {
        let mut q = [0i8; 256];
        two_bit_planes(&b[32..96], &mut q);
        let hm = &b[0..32];
        for bit in 0..8 {
            for l in 0..32 {
                q[bit * 32 + l] -= ((((hm[l] >> bit) & 1) ^ 1) << 2) as i8;
            }
        }
        UnpackedK {
            q,
            sc: q3k_scales(&b[96..108]),
            mn: [0; 16],
            d: f16_at::<O>(b, 108),
            dmin: 0.0,
        }
    }
}

impl DotUnit for Q3K {
    const DW: usize = 256;
    const DB: usize = 110;
    type U = KSym16;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> KSym16 {
        let p = Self::parts::<O>(b);
        KSym16 {
            w: prescale16(&p.q, &p.sc),
            d: p.d,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &KSym16, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled_f::<O>(u.d, &dot_w16::<O>(&u.w, a));
    }
}

impl Block for Q3K {
    const ID: u32 = 11;
    const NAME: &'static str = "Q3_K";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 108, "d")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        symmetric_decode16(&Self::parts::<Portable>(b), out)
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, sc, q) = encode_symmetric_k(x, 4, 32)?;
        // q + 4 in 0..8: low 2 bits in the planes, bit 2 in hmask.
        let hm = &mut out[0..32];
        hm.fill(0);
        for (j, v) in q.iter().enumerate() {
            hm[j % 32] |= (((*v as u8) >> 2) & 1) << (j / 32);
        }
        pack_two_bit_planes(&q, &mut out[32..96]);
        let s = &mut out[96..108];
        s.fill(0);
        for (i, v) in sc.iter().enumerate() {
            let u = (v + 32) as u8;
            if i < 8 {
                s[i] |= u & 0x0f;
            } else {
                s[i - 8] |= (u & 0x0f) << 4;
            }
            s[8 + i % 4] |= (u >> 4) << (2 * (i / 4));
        }
        out[108..110].copy_from_slice(&d.to_le_bytes());
        Ok(())
    }
}

/// `(d * sc) * q` per sub-block of 16 (Q3_K, Q6_K).
fn symmetric_decode16(u: &UnpackedK<16>, out: &mut [f32]) {
    for s in 0..16 {
        let dl = u.d * u.sc[s] as f32;
        for l in 0..16 {
            out[s * 16 + l] = dl * u.q[s * 16 + l] as f32;
        }
    }
}

// ---------------------------------------------------------------- Q4_K / Q5_K

/// `d * sum_b (d_a sc_b) sum(q q_a) - dmin * sum_b m_b sum(x)`: Q4_K/Q5_K sub-blocks
/// are 32 wide, aligned with q8_1 blocks, so the min term uses the exact activation sums.
#[inline(always)]
fn dot_q4k_like<O: Ops>(u: &UnpackedK<8>, a: &[BlockQ8_1], acc: &mut Acc) {
    let mut l = Acc::default();
    let mut mins = 0f32;
    for (b, a) in a.iter().enumerate().take(8) {
        l.add_scaled::<O>(
            a.d * u.sc[b] as f32,
            &O::dot32(sub::<32>(&u.q, 32 * b), &a.qs),
        );
        mins += u.mn[b] as f32 * a.sum;
    }
    acc.add_scaled_f::<O>(u.d, &l.v);
    acc.s -= u.dmin * mins;
}

fn decode_q4k_like(u: &UnpackedK<8>, out: &mut [f32]) {
    for s in 0..8 {
        let dl = u.d * u.sc[s] as f32;
        let ml = u.dmin * u.mn[s] as f32;
        for l in 0..32 {
            out[s * 32 + l] = dl * u.q[s * 32 + l] as f32 - ml;
        }
    }
}

pub struct Q4K;

impl DotUnit for Q4K {
    const DW: usize = 256;
    const DB: usize = 144;
    type U = UnpackedK<8>;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> UnpackedK<8> {
        let mut q = [0i8; 256];
        let qs = &b[16..144];
        for c in 0..4 {
            for l in 0..32 {
                let v = qs[c * 32 + l];
                q[c * 64 + l] = (v & 0x0f) as i8;
                q[c * 64 + 32 + l] = (v >> 4) as i8;
            }
        }
        let (sc, mn) = q4k_scale_min(&b[4..16]);
        UnpackedK {
            q,
            sc,
            mn,
            d: f16_at::<O>(b, 0),
            dmin: f16_at::<O>(b, 2),
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &UnpackedK<8>, a: &[BlockQ8_1], acc: &mut Acc) {
        dot_q4k_like::<O>(u, a, acc)
    }
}

impl Block for Q4K {
    const ID: u32 = 12;
    const NAME: &'static str = "Q4_K";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")?;
        check_f16(b, 2, "dmin")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        decode_q4k_like(&Self::unpack::<Portable>(b), out)
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, dmin, sc, mn, q) = encode_affine_k::<8>(x, 15, 63)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        out[2..4].copy_from_slice(&dmin.to_le_bytes());
        pack_q4k_scale_min(&sc, &mn, &mut out[4..16]);
        let qs = &mut out[16..144];
        for c in 0..4 {
            for l in 0..32 {
                qs[c * 32 + l] = q[c * 64 + l] as u8 | ((q[c * 64 + 32 + l] as u8) << 4);
            }
        }
        Ok(())
    }
}

pub struct Q5K;

impl DotUnit for Q5K {
    const DW: usize = 256;
    const DB: usize = 176;
    type U = UnpackedK<8>;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> UnpackedK<8> {
        let mut q = [0i8; 256];
        let qh = &b[16..48];
        let qs = &b[48..176];
        for c in 0..4 {
            for l in 0..32 {
                let v = qs[c * 32 + l];
                let h = qh[l];
                q[c * 64 + l] = ((v & 0x0f) | (((h >> (2 * c)) & 1) << 4)) as i8;
                q[c * 64 + 32 + l] = ((v >> 4) | (((h >> (2 * c + 1)) & 1) << 4)) as i8;
            }
        }
        let (sc, mn) = q4k_scale_min(&b[4..16]);
        UnpackedK {
            q,
            sc,
            mn,
            d: f16_at::<O>(b, 0),
            dmin: f16_at::<O>(b, 2),
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &UnpackedK<8>, a: &[BlockQ8_1], acc: &mut Acc) {
        dot_q4k_like::<O>(u, a, acc)
    }
}

impl Block for Q5K {
    const ID: u32 = 13;
    const NAME: &'static str = "Q5_K";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")?;
        check_f16(b, 2, "dmin")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        decode_q4k_like(&Self::unpack::<Portable>(b), out)
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, dmin, sc, mn, q) = encode_affine_k::<8>(x, 31, 63)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        out[2..4].copy_from_slice(&dmin.to_le_bytes());
        pack_q4k_scale_min(&sc, &mn, &mut out[4..16]);
        let (qh, qs) = out[16..176].split_at_mut(32);
        qh.fill(0);
        for c in 0..4 {
            for l in 0..32 {
                let (a, b) = (q[c * 64 + l] as u8, q[c * 64 + 32 + l] as u8);
                qs[c * 32 + l] = (a & 0x0f) | ((b & 0x0f) << 4);
                qh[l] |= ((a >> 4) << (2 * c)) | ((b >> 4) << (2 * c + 1));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------- Q6_K

pub struct Q6K;

impl Q6K {
    #[inline(always)]
    fn parts<O: Ops>(b: &[u8]) -> UnpackedK<16> {
        let mut q = [0i8; 256];
        let (ql, qh) = (&b[0..128], &b[128..192]);
        for half in 0..2 {
            for l in 0..32 {
                let h = qh[half * 32 + l];
                let (x, y) = (ql[half * 64 + l], ql[half * 64 + 32 + l]);
                let o = half * 128 + l;
                q[o] = ((x & 0x0f) | ((h & 3) << 4)) as i8 - 32;
                q[o + 32] = ((y & 0x0f) | (((h >> 2) & 3) << 4)) as i8 - 32;
                q[o + 64] = ((x >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
                q[o + 96] = ((y >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let mut sc = [0i8; 16];
        for (s, v) in sc.iter_mut().zip(&b[192..208]) {
            *s = *v as i8;
        }
        UnpackedK {
            q,
            sc,
            mn: [0; 16],
            d: f16_at::<O>(b, 208),
            dmin: 0.0,
        }
    }
}

impl DotUnit for Q6K {
    const DW: usize = 256;
    const DB: usize = 210;
    type U = KSym16;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> KSym16 {
        let p = Self::parts::<O>(b);
        KSym16 {
            w: prescale16(&p.q, &p.sc),
            d: p.d,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &KSym16, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled_f::<O>(u.d, &dot_w16::<O>(&u.w, a));
    }
}

impl Block for Q6K {
    const ID: u32 = 14;
    const NAME: &'static str = "Q6_K";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 208, "d")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        symmetric_decode16(&Self::parts::<Portable>(b), out)
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, sc, q) = encode_symmetric_k(x, 32, 128)?;
        let (ql, rest) = out.split_at_mut(128);
        let (qh, rest) = rest.split_at_mut(64);
        ql.fill(0);
        qh.fill(0);
        for (j, v) in q.iter().enumerate() {
            let v = *v as u8;
            let (half, within) = (j / 128, j % 128);
            ql[half * 64 + within % 64] |= (v & 0x0f) << (4 * (within / 64));
            qh[half * 32 + within % 32] |= (v >> 4) << (2 * (within / 32));
        }
        for (o, s) in rest[..16].iter_mut().zip(sc) {
            *o = s as i8 as u8;
        }
        rest[16..18].copy_from_slice(&d.to_le_bytes());
        Ok(())
    }
}
