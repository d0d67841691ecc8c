//! 8-bit activation blocks: the shape CPU dot products and GPU kernels consume.

use abi_stable::StableAbi;

/// Weights (and activations) per block.
pub const QK8_1: usize = 32;

/// 32 activations quantised to int8 with one scale, plus the sum of the ORIGINAL values
/// (not `d * sum(q)`): affine weight formats need `sum(x)` to apply their offset.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq)]
pub struct BlockQ8_1 {
    pub d: f32,
    pub sum: f32,
    pub qs: [i8; QK8_1],
}

impl BlockQ8_1 {
    /// Quantises 32 values: `d = max|x| / 127`, `q = round(x / d)`. A NaN among them
    /// makes `d` NaN, so every product with the block is NaN, as in f32 (`f32::max`
    /// alone would skip it and quietly give a finite result).
    pub fn quantize(x: &[f32]) -> BlockQ8_1 {
        debug_assert_eq!(x.len(), QK8_1);
        let amax = x.iter().fold(0f32, |m, v| {
            if m.is_nan() || v.is_nan() {
                f32::NAN
            } else {
                m.max(v.abs())
            }
        });
        let sum: f32 = x.iter().sum();
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0i8; QK8_1];
        for (q, v) in qs.iter_mut().zip(x) {
            // Within +-127 even when inv overflows (a block of subnormal values): the
            // dot kernels' sign trick needs no -128.
            *q = (v * inv).round().clamp(-127.0, 127.0) as i8;
        }
        BlockQ8_1 { d, sum, qs }
    }
}

/// Quantises a row whose length is a multiple of 32.
pub fn quantize_row(x: &[f32], out: &mut Vec<BlockQ8_1>) {
    assert!(
        x.len().is_multiple_of(QK8_1),
        "row length {} is not a multiple of 32",
        x.len()
    );
    out.extend(x.chunks_exact(QK8_1).map(BlockQ8_1::quantize));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 13.5) * 0.37).collect();
        let b = BlockQ8_1::quantize(&x);
        for (q, v) in b.qs.iter().zip(&x) {
            assert!((*q as f32 * b.d - v).abs() <= b.d * 0.5 + 1e-6);
        }
        assert!((b.sum - x.iter().sum::<f32>()).abs() < 1e-4);
        assert_eq!(BlockQ8_1::quantize(&[0.0; 32]).qs, [0; 32]);
        // a NaN anywhere poisons the block's scale (first, middle, last)
        for at in [0, 13, 31] {
            let mut y = x.clone();
            y[at] = f32::NAN;
            let b = BlockQ8_1::quantize(&y);
            assert!(b.d.is_nan() && b.sum.is_nan(), "NaN at {at}: {b:?}");
        }
    }
}
