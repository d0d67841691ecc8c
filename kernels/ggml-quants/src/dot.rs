//! The q8 dot-product driver: rows of packed weights against q8_1 activation columns.
//!
//! Every format describes a "dot unit" (one block for quantised types, 32 values for the
//! float types): how to unpack it into small integer (or f32) arrays once, and how to dot
//! that unpacked unit with the q8_1 blocks of one activation column. The driver unpacks
//! each unit once per group of up to [`COL_GROUP`] columns, so batch-1 decode streams the
//! weights exactly once and small batches reuse the unpacked unit from L1.
//!
//! The driver is compiled three times (baseline x86-64/other arch, AVX2+FMA, AVX-512BW
//! with VNNI) and picked at run time, because a plugin cdylib cannot assume the host CPU.
//! The per-format code is plain loops over fixed-size arrays with i32 accumulators that
//! LLVM turns into pmaddwd / vpdpwssd; there is no hand-written intrinsic code.

use moe_plugin_api::BlockQ8_1;

/// How many activation columns share one unpacked weight unit.
pub const COL_GROUP: usize = 8;

pub trait DotUnit: 'static {
    /// Weights per unit (a multiple of 32).
    const DW: usize;
    /// Bytes per unit.
    const DB: usize;
    type U;
    /// Unpacks one unit (`b.len() == DB`).
    fn unpack(b: &[u8]) -> Self::U;
    /// Dot of an unpacked unit with `DW / 32` activation blocks.
    fn dot(u: &Self::U, a: &[BlockQ8_1]) -> f32;
}

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
fn driver<D: DotUnit>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    let units = s.row_bytes / D::DB;
    let apu = D::DW / 32;
    for r in 0..s.n_rows {
        let row = &rows[r * s.row_bytes..(r + 1) * s.row_bytes];
        let mut c0 = 0;
        while c0 < s.n_cols {
            let cn = (s.n_cols - c0).min(COL_GROUP);
            let mut acc = [0f32; COL_GROUP];
            for (u, unit) in row.chunks_exact(D::DB).enumerate().take(units) {
                let w = D::unpack(unit);
                for (c, acc) in acc.iter_mut().enumerate().take(cn) {
                    let start = (c0 + c) * s.per_col + u * apu;
                    *acc += D::dot(&w, &act[start..start + apu]);
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
#[target_feature(enable = "avx2,fma,f16c")]
fn driver_avx2<D: DotUnit>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    driver::<D>(rows, s, act, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn driver_avx512<D: DotUnit>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    driver::<D>(rows, s, act, out)
}

/// Instruction sets the driver is compiled for, in increasing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Baseline,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 plus AVX-512 F/BW/VL and VNNI.
    Avx512,
}

impl Isa {
    pub const ALL: [Isa; 3] = [Isa::Baseline, Isa::Avx2, Isa::Avx512];
    pub fn name(self) -> &'static str {
        match self {
            Isa::Baseline => "baseline",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The best variant this CPU runs (detected once).
pub fn best_isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2
                && has!("avx512f")
                && has!("avx512bw")
                && has!("avx512vl")
                && has!("avx512vnni");
            if avx512 {
                Isa::Avx512
            } else if avx2 {
                Isa::Avx2
            } else {
                Isa::Baseline
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Isa::Baseline
        }
    })
}

/// Runs the driver for `D` compiled for `isa`, or for the best this CPU has when `isa`
/// is beyond it (so asking for too much is always safe).
pub fn run<D: DotUnit>(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    let isa = isa.min(best_isa());
    #[cfg(target_arch = "x86_64")]
    match isa {
        // SAFETY: `isa <= best_isa()`, which checked every feature these variants enable.
        Isa::Avx512 => return unsafe { driver_avx512::<D>(rows, s, act, out) },
        Isa::Avx2 => return unsafe { driver_avx2::<D>(rows, s, act, out) },
        Isa::Baseline => {}
    }
    let _ = isa;
    driver::<D>(rows, s, act, out)
}

// ---- integer helpers the formats build their dots from ----

/// Sum of products of `N` i8 pairs in i32 (each product fits in i16, which lets LLVM use
/// pmaddwd / vpdpwssd).
#[inline(always)]
pub fn idot<const N: usize>(a: &[i8; N], b: &[i8; N]) -> i32 {
    let mut s = 0i32;
    for i in 0..N {
        s += (a[i] as i16 * b[i] as i16) as i32;
    }
    s
}

/// Sum of `N` i8 values in i32.
#[inline(always)]
pub fn isum<const N: usize>(a: &[i8; N]) -> i32 {
    let mut s = 0i32;
    for v in a {
        s += *v as i32;
    }
    s
}

/// The `N` i8 values starting at `off` as an array reference.
#[inline(always)]
pub fn sub<const N: usize>(a: &[i8], off: usize) -> &[i8; N] {
    a[off..off + N].try_into().unwrap()
}
