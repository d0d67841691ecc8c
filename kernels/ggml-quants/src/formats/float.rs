//! The plain float types F32, F16 and BF16 (block = one value).
//!
//! Validation accepts every bit pattern: NaN or infinite weights are the model's business,
//! not a sign of a damaged file, and refusing them would make such a model unloadable.
//! Decoding is exact widening (gguf-py: `view(np.float32)`, `astype(np.float32)`,
//! `<< 16`). Encoding rounds to nearest even (`half`), quieting NaNs.

use moe_plugin_api::BlockQ8_1;

use super::Format;
use crate::dot::{self, Acc, DotUnit, Isa, Ops, Shape};
use crate::fp::bf16_to_f32;

/// `sum(w * q)` over 32 values into 8 f32 lanes (lane j: values j, j+8, j+16, j+24).
#[inline(always)]
fn fdot8(w: &[f32; 32], q: &[i8; 32]) -> [f32; 8] {
    let mut lanes = [0f32; 8];
    for m in 0..4 {
        for (j, l) in lanes.iter_mut().enumerate() {
            *l += w[8 * m + j] * q[8 * m + j] as f32;
        }
    }
    lanes
}

pub struct F16;

impl DotUnit for F16 {
    const DW: usize = 32;
    const DB: usize = 64;
    type U = [f32; 32];
    #[inline(always)]
    fn unpack<O: Ops>(b: &[u8]) -> [f32; 32] {
        let mut w = [0f32; 32];
        for (w, c) in w.chunks_exact_mut(8).zip(b.chunks_exact(16)) {
            w.copy_from_slice(&O::f16x8(c.try_into().unwrap()));
        }
        w
    }
    #[inline(always)]
    fn dot<O: Ops>(u: &[f32; 32], a: &[BlockQ8_1], acc: &mut Acc) {
        acc.add_scaled_f::<O>(a[0].d, &fdot8(u, &a[0].qs));
    }
}

macro_rules! float_unit {
    ($ty:ident, $bytes:expr, $widen:expr) => {
        pub struct $ty;

        impl DotUnit for $ty {
            const DW: usize = 32;
            const DB: usize = 32 * $bytes;
            type U = [f32; 32];
            #[inline(always)]
            fn unpack<O: Ops>(b: &[u8]) -> [f32; 32] {
                let mut w = [0f32; 32];
                for (w, c) in w.iter_mut().zip(b.chunks_exact($bytes)) {
                    *w = $widen(c);
                }
                w
            }
            #[inline(always)]
            fn dot<O: Ops>(u: &[f32; 32], a: &[BlockQ8_1], acc: &mut Acc) {
                acc.add_scaled_f::<O>(a[0].d, &fdot8(u, &a[0].qs));
            }
        }
    };
}

float_unit!(F32, 4, |c: &[u8]| f32::from_le_bytes([
    c[0], c[1], c[2], c[3]
]));
float_unit!(BF16, 2, |c: &[u8]| bf16_to_f32(u16::from_le_bytes([
    c[0], c[1]
])));

impl Format for F32 {
    const ID: u32 = 0;
    const NAME: &'static str = "F32";
    const BW: usize = 1;
    const BB: usize = 4;
    fn validate(_blocks: &[u8]) -> Result<(), String> {
        Ok(())
    }
    fn decode(blocks: &[u8], out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(blocks.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
    fn encode(input: &[f32], out: &mut [u8]) -> Result<(), String> {
        for (o, v) in out.chunks_exact_mut(4).zip(input) {
            o.copy_from_slice(&v.to_le_bytes());
        }
        Ok(())
    }
    fn dot(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
        dot::run::<F32>(isa, rows, s, act, out)
    }
}

impl Format for F16 {
    const ID: u32 = 1;
    const NAME: &'static str = "F16";
    const BW: usize = 1;
    const BB: usize = 2;
    fn validate(_blocks: &[u8]) -> Result<(), String> {
        Ok(())
    }
    fn decode(blocks: &[u8], out: &mut [f32]) {
        use half::slice::HalfFloatSliceExt;
        let mut tmp = [half::f16::ZERO; 256];
        for (o, c) in out.chunks_mut(256).zip(blocks.chunks(512)) {
            let n = o.len();
            for (t, b) in tmp.iter_mut().zip(c.chunks_exact(2)) {
                *t = half::f16::from_le_bytes([b[0], b[1]]);
            }
            tmp[..n].convert_to_f32_slice(o);
        }
    }
    fn encode(input: &[f32], out: &mut [u8]) -> Result<(), String> {
        for (o, v) in out.chunks_exact_mut(2).zip(input) {
            o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
        }
        Ok(())
    }
    fn dot(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
        dot::run::<F16>(isa, rows, s, act, out)
    }
}

impl Format for BF16 {
    const ID: u32 = 30;
    const NAME: &'static str = "BF16";
    const BW: usize = 1;
    const BB: usize = 2;
    fn validate(_blocks: &[u8]) -> Result<(), String> {
        Ok(())
    }
    fn decode(blocks: &[u8], out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(blocks.chunks_exact(2)) {
            *o = bf16_to_f32(u16::from_le_bytes([c[0], c[1]]));
        }
    }
    fn encode(input: &[f32], out: &mut [u8]) -> Result<(), String> {
        for (o, v) in out.chunks_exact_mut(2).zip(input) {
            o.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
        }
        Ok(())
    }
    fn dot(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
        dot::run::<BF16>(isa, rows, s, act, out)
    }
}
