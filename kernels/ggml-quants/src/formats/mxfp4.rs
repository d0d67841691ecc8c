//! MXFP4 (OCP microscaling FP4) as ggml stores it: `e (u8, e8m0), qs[16]`; code j is the
//! low nibble of qs[j] for j < 16 and the high nibble of qs[j - 16] otherwise, an e2m1
//! value that ggml keeps DOUBLED as an integer (`KVALUES`), so the scale is the e8m0 value
//! halved: w = 2^(e-128) * KVALUES[code].

use moe_plugin_api::BlockQ8_1;

use super::{legacy::Unpacked32, Block};
use crate::dot::{Acc, DotUnit, Ops, Portable};
use crate::fp::e8m0_half_to_f32;

/// e2m1 values times two: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
pub const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

pub struct Mxfp4;

impl DotUnit for Mxfp4 {
    const DW: usize = 32;
    const DB: usize = 17;
    type U = Unpacked32;
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> Unpacked32 {
        let mut c = [0u8; 32];
        for i in 0..16 {
            c[i] = b[1 + i] & 0x0f;
            c[i + 16] = b[1 + i] >> 4;
        }
        Unpacked32 {
            q: O::lut16(&KVALUES, &c),
            d: e8m0_half_to_f32(b[0]),
            m: 0.0,
        }
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &Unpacked32, a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled::<O>(u.d * a[0].d, &O::dot32(&u.q, &a[0].qs));
    }
}

/// floor(log2(v)) for a finite v > 0, from the bits (exact, subnormals included).
fn floor_log2(v: f32) -> i32 {
    let bits = v.to_bits() & 0x7fff_ffff;
    let exp = (bits >> 23) as i32;
    if exp != 0 {
        exp - 127
    } else {
        (31 - bits.leading_zeros() as i32) - 149
    }
}

/// Nearest doubled-e2m1 code for `x` at scale `d` (the first on ties) and its error.
fn nearest(x: f32, d: f32) -> (u8, f32) {
    let mut best = (0u8, f32::INFINITY);
    for (i, k) in KVALUES.iter().enumerate() {
        let err = (d * *k as f32 - x).abs();
        if err < best.1 {
            best = (i as u8, err);
        }
    }
    best
}

impl Block for Mxfp4 {
    const ID: u32 = 39;
    const NAME: &'static str = "MXFP4";
    /// Every e8m0 byte decodes to a finite power of two in ggml/gguf-py (they do not
    /// special-case 0xFF, which comes out as 2^127), but 0xFF is the NaN encoding of the
    /// OCP MX spec and no quantiser (ggml's or ours) ever writes it, so a block carrying
    /// it is treated as corrupt. The codes are 4-bit table indices: all valid.
    fn check(b: &[u8]) -> Result<(), String> {
        if b[0] == 0xff {
            return Err("scale byte is 0xFF, the e8m0 NaN encoding".into());
        }
        Ok(())
    }
    fn decode_block(b: &[u8], out: &mut [f32]) {
        let u = Self::unpack::<Portable>(b);
        for (o, q) in out.iter_mut().zip(u.q) {
            *o = u.d * q as f32;
        }
    }
    /// Scale search over two exponents: 2^(E-3) (ggml's choice, E = floor(log2 max|x|),
    /// largest code 1.5 * 2^E so the top values may clip) and 2^(E-2) (no clipping,
    /// coarser steps); keeps the one with the smaller squared error.
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String> {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let mut best: (f32, u8, [u8; 32]) = (f32::INFINITY, 0, [0; 32]);
        if amax == 0.0 {
            best.1 = 0;
        } else {
            let base = floor_log2(amax) + 125;
            for e in [base, base + 1] {
                let e = e.clamp(0, 254) as u8;
                let d = e8m0_half_to_f32(e);
                let mut codes = [0u8; 32];
                let mut sse = 0f32;
                for (c, v) in codes.iter_mut().zip(x) {
                    let (code, err) = nearest(*v, d);
                    *c = code;
                    sse += err * err;
                }
                if sse < best.0 {
                    best = (sse, e, codes);
                }
            }
        }
        let (_, e, codes) = best;
        out[0] = e;
        for i in 0..16 {
            out[1 + i] = codes[i] | (codes[i + 16] << 4);
        }
        Ok(())
    }
}
