//! ggml's original 32-weight types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! Layouts (little-endian, f16 scales):
//! * Q4_0 `d, qs[16]`: w = d * (q - 8), q = nibbles, low nibbles are weights 0..16;
//! * Q4_1 `d, m, qs[16]`: w = d * q + m;
//! * Q5_0 `d, qh[4], qs[16]`: q = nibble | bit j of qh (u32) << 4, w = d * (q - 16);
//! * Q5_1 `d, m, qh[4], qs[16]`: w = d * q + m;
//! * Q8_0 `d, qs[32] (i8)`: w = d * q.
//!
//! Encoders are round-to-nearest with the block's abs-max (symmetric types) or min/max
//! (affine types) scale, using the f16-rounded scale for the codes.

use moe_plugin_api::BlockQ8_1;

use super::{min_max, signed_absmax, Block};
use crate::dot::{Acc, DotUnit, Ops, Portable};
use crate::fp::{check_f16, f16_at, f16_checked, round_clamp};

/// An unpacked 32-weight block: integer codes and the f32 scale (and offset).
pub struct Unpacked32 {
    pub q: [i8; 32],
    pub d: f32,
    pub m: f32,
}

#[inline(always)]
fn nibbles(qs: &[u8]) -> [i8; 32] {
    let mut q = [0i8; 32];
    for i in 0..16 {
        q[i] = (qs[i] & 0x0f) as i8;
        q[i + 16] = (qs[i] >> 4) as i8;
    }
    q
}

#[inline(always)]
fn with_high_bits(qs: &[u8], qh: &[u8]) -> [i8; 32] {
    // Bit j of the little-endian u32 is bit j % 8 of byte j / 8: spread each byte over
    // its 8 weights and test one bit per lane (a byte shuffle, an and, a compare:
    // vectorises without per-lane shifts or branches).
    let mut q = nibbles(qs);
    for (j, v) in q.iter_mut().enumerate() {
        let bit = 1u8 << (j % 8);
        *v |= ((((qh[j / 8] & bit) == bit) as u8) << 4) as i8;
    }
    q
}

fn pack_nibbles(q: &[i32; 32], qs: &mut [u8]) {
    for i in 0..16 {
        qs[i] = (q[i] as u8 & 0x0f) | ((q[i + 16] as u8 & 0x0f) << 4);
    }
}

fn pack_high_bits(q: &[i32; 32], qh: &mut [u8]) {
    let mut h = 0u32;
    for (j, v) in q.iter().enumerate() {
        h |= (((*v as u32) >> 4) & 1) << j;
    }
    qh.copy_from_slice(&h.to_le_bytes());
}

/// Symmetric codes: the largest-magnitude value maps to `-half` (ggml's convention, which
/// uses the full negative end of the code range).
fn encode_symmetric(x: &[f32], half: i32, max: i32) -> Result<(u16, [i32; 32]), String> {
    let (bits, d) = f16_checked(signed_absmax(x) / -(half as f32), "d")?;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i32; 32];
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_clamp(v * id + half as f32, 0, max);
    }
    Ok((bits, q))
}

/// Affine codes from the block's min/max.
fn encode_affine(x: &[f32], max: i32) -> Result<(u16, u16, [i32; 32]), String> {
    let (lo, hi) = min_max(x);
    let (dbits, d) = f16_checked((hi - lo) / max as f32, "d")?;
    let (mbits, m) = f16_checked(lo, "m")?;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i32; 32];
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_clamp((v - m) * id, 0, max);
    }
    Ok((dbits, mbits, q))
}

// ---------------------------------------------------------------- Q4_0

pub struct Q4_0;

impl DotUnit for Q4_0 {
    const DW: usize = 32;
    const DB: usize = 18;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let mut q = nibbles(&b[2..18]);
        for v in q.iter_mut() {
            *v -= 8;
        }
        Unpacked32 {
            q,
            d: f16_at::<O>(b, 0),
            m: 0.0,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32(&u.q, &a[0].qs));
    }
}

impl Block for Q4_0 {
    const ID: u32 = 2;
    const NAME: &'static str = "Q4_0";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = u.d * q as f32;
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, q) = encode_symmetric(x, 8, 15)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        pack_nibbles(&q, &mut out[2..18]);
        Ok(())
    }
}

// ---------------------------------------------------------------- Q4_1

pub struct Q4_1;

impl DotUnit for Q4_1 {
    const DW: usize = 32;
    const DB: usize = 20;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let [d, m] = O::f16x2(b[0..4].try_into().unwrap());
        Unpacked32 {
            q: nibbles(&b[4..20]),
            d,
            m,
        }
    }
    /// `d_w d_a sum(q_w q_a) + m_w sum(x)`: the offset uses the activation block's exact
    /// sum of the original values (the q8_1 contract), not `d_a sum(q_a)`.
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32u(&u.q, &a[0].qs));
        acc.s += u.m * a[0].sum;
    }
}

impl Block for Q4_1 {
    const ID: u32 = 3;
    const NAME: &'static str = "Q4_1";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")?;
        check_f16(b, 2, "m")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = u.d * q as f32 + u.m;
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, m, q) = encode_affine(x, 15)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        out[2..4].copy_from_slice(&m.to_le_bytes());
        pack_nibbles(&q, &mut out[4..20]);
        Ok(())
    }
}

// ---------------------------------------------------------------- Q5_0

pub struct Q5_0;

impl DotUnit for Q5_0 {
    const DW: usize = 32;
    const DB: usize = 22;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let mut q = with_high_bits(&b[6..22], &b[2..6]);
        for v in q.iter_mut() {
            *v -= 16;
        }
        Unpacked32 {
            q,
            d: f16_at::<O>(b, 0),
            m: 0.0,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32(&u.q, &a[0].qs));
    }
}

impl Block for Q5_0 {
    const ID: u32 = 6;
    const NAME: &'static str = "Q5_0";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = u.d * q as f32;
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, q) = encode_symmetric(x, 16, 31)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        pack_high_bits(&q, &mut out[2..6]);
        pack_nibbles(&q, &mut out[6..22]);
        Ok(())
    }
}

// ---------------------------------------------------------------- Q5_1

pub struct Q5_1;

impl DotUnit for Q5_1 {
    const DW: usize = 32;
    const DB: usize = 24;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let [d, m] = O::f16x2(b[0..4].try_into().unwrap());
        Unpacked32 {
            q: with_high_bits(&b[8..24], &b[4..8]),
            d,
            m,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32u(&u.q, &a[0].qs));
        acc.s += u.m * a[0].sum;
    }
}

impl Block for Q5_1 {
    const ID: u32 = 7;
    const NAME: &'static str = "Q5_1";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")?;
        check_f16(b, 2, "m")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = u.d * q as f32 + u.m;
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let (d, m, q) = encode_affine(x, 31)?;
        out[0..2].copy_from_slice(&d.to_le_bytes());
        out[2..4].copy_from_slice(&m.to_le_bytes());
        pack_high_bits(&q, &mut out[4..8]);
        pack_nibbles(&q, &mut out[8..24]);
        Ok(())
    }
}

// ---------------------------------------------------------------- Q8_0

pub struct Q8_0;

impl DotUnit for Q8_0 {
    const DW: usize = 32;
    const DB: usize = 34;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let mut q = [0i8; 32];
        for (q, v) in q.iter_mut().zip(&b[2..34]) {
            *q = *v as i8;
        }
        Unpacked32 {
            q,
            d: f16_at::<O>(b, 0),
            m: 0.0,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32(&u.q, &a[0].qs));
    }
}

impl Block for Q8_0 {
    const ID: u32 = 8;
    const NAME: &'static str = "Q8_0";
    fn check(b: &[u8]) -> Result<(), String> {
        check_f16(b, 0, "d")
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = q as f32 * u.d;
        }
    }
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (bits, d) = f16_checked(amax / 127.0, "d")?;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out[0..2].copy_from_slice(&bits.to_le_bytes());
        for (o, v) in out[2..34].iter_mut().zip(x) {
            *o = round_clamp(v * id, -127, 127) as i8 as u8;
        }
        Ok(())
    }
}
