//! Rows of ROCmFPx blocks against q8_1 activation columns.
//!
//! Per 32-weight block and activation block `(d, q)` (integer sums are exact i32):
//!
//! * split-scale types (100, 102, 104, 107 two-scale):
//!   `d * (s0 * sum_{i<16} l_i q_i + s1 * sum_{i>=16} l_i q_i)`;
//! * single-scale types (101, 103): `d * s * sum l_i q_i`;
//! * affine 107: `d * (S * sum c_i q_i - O * sum q_i)`. This equals upstream's MMVQ form
//!   `d * (S * sum (c_i - 1) q_i + (S - O) * sum q_i)` taken per half and added, since both
//!   halves share S and O and the integer sums are exact. Like upstream's mat-vec kernel it
//!   uses `d * sum q` for the offset term, not the block's float `sum` of the original
//!   activations, so every type computes exactly `sum_i w_i * (d q_i)` up to f32 rounding.
//!
//! Blocks are added to one f32 accumulator per output in order, so the result does not
//! depend on how many columns are computed together. Unpacking happens once per block
//! for up to [`COL_GROUP`] columns.
//!
//! The code is plain Rust that LLVM vectorises (the integer sums become `pmaddwd`-style
//! code); the driver is compiled twice, for the baseline target and for AVX2, and the
//! best one this CPU has is picked at run time. No variant uses FMA and the float
//! operations are the same scalar ones in the same order, so every variant gives
//! bit-identical results.

use moe_plugin_api::BlockQ8_1;

use crate::formats::{Format, Unpacked};

/// How many activation columns share one unpacked block.
pub const COL_GROUP: usize = 8;

/// Shape of one call, already checked by `moe_plugin_api::dot_shape`.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    pub row_bytes: usize,
    pub n_rows: usize,
    pub n_cols: usize,
    /// Activation blocks per column (`k / 32`).
    pub per_col: usize,
}

#[inline(always)]
fn dot16(w: &[i8], a: &[i8]) -> i32 {
    let mut s = 0i32;
    for (w, a) in w[..16].iter().zip(&a[..16]) {
        s += *w as i32 * *a as i32;
    }
    s
}

#[inline(always)]
fn sum32(a: &[i8; 32]) -> i32 {
    a.iter().map(|v| *v as i32).sum()
}

/// One weight block dotted with one activation block.
#[inline(always)]
pub fn block_dot<F: Format>(u: &Unpacked, a: &BlockQ8_1) -> f32 {
    let lo = dot16(&u.q[..16], &a.qs[..16]);
    let hi = dot16(&u.q[16..], &a.qs[16..]);
    if F::AFFINE {
        a.d * (u.s[0] * (lo + hi) as f32 - u.o * sum32(&a.qs) as f32)
    } else if F::SPLIT {
        a.d * (u.s[0] * lo as f32 + u.s[1] * hi as f32)
    } else {
        a.d * (u.s[0] * (lo + hi) as f32)
    }
}

#[inline(always)]
fn driver<F: Format>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    if s.n_cols == 1 {
        let act = &act[..s.per_col];
        for (row, o) in rows.chunks_exact(s.row_bytes).zip(out.iter_mut()) {
            let mut acc = 0f32;
            for (blk, a) in row.chunks_exact(F::BB).zip(act) {
                acc += block_dot::<F>(&F::unpack(blk), a);
            }
            *o = acc;
        }
        return;
    }
    for (r, row) in rows.chunks_exact(s.row_bytes).enumerate().take(s.n_rows) {
        let mut c0 = 0;
        while c0 < s.n_cols {
            let cn = (s.n_cols - c0).min(COL_GROUP);
            let mut acc = [0f32; COL_GROUP];
            for (b, blk) in row.chunks_exact(F::BB).enumerate() {
                let u = F::unpack(blk);
                for (c, acc) in acc.iter_mut().enumerate().take(cn) {
                    *acc += block_dot::<F>(&u, &act[(c0 + c) * s.per_col + b]);
                }
            }
            for (c, acc) in acc.iter().enumerate().take(cn) {
                out[(c0 + c) * s.n_rows + r] = *acc;
            }
            c0 += cn;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn driver_avx2<F: Format>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    driver::<F>(rows, s, act, out)
}

/// Instruction sets the driver is compiled for, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Baseline,
    Avx2,
}

impl Isa {
    pub const ALL: [Isa; 2] = [Isa::Baseline, Isa::Avx2];
}

/// The best variant this CPU runs (detected once).
pub fn best_isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return Isa::Avx2;
        }
        Isa::Baseline
    })
}

/// Runs the driver for `F` compiled for `isa`, clamped to what this CPU has.
pub fn run<F: Format>(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    let isa = isa.min(best_isa());
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: `isa <= best_isa()`, which checked AVX2.
        return unsafe { driver_avx2::<F>(rows, s, act, out) };
    }
    let _ = isa;
    driver::<F>(rows, s, act, out)
}
