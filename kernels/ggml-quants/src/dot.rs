//! The q8 dot-product driver: rows of packed weights against q8_1 activation columns.
//!
//! Every format describes a "dot unit" (one block for quantised types, 32 values for the
//! float types): how to unpack it into small fixed-size integer (or f32) arrays, and how
//! to dot that unpacked unit with the q8_1 blocks of one activation column. The driver
//! unpacks each unit once per group of up to [`COL_GROUP`] columns, so batch-1 decode
//! streams the weights exactly once and small batches reuse the unpacked unit from L1.
//!
//! Accumulation is in eight f32 lanes per output ([`Acc`]), reduced once per row: the
//! per-block work is "integer partial sums in 8 i32 lanes, times one f32 scale, added".
//!
//! The driver is compiled three times (portable, AVX2+FMA+F16C, AVX-512BW/VL+VNNI) and
//! picked at run time, because a plugin cdylib cannot assume the host CPU. Unpacking
//! (nibbles, bit planes, scales) is plain loops over fixed-size arrays that LLVM
//! vectorises in every variant. The few primitives in [`Ops`] are spelled out with x86
//! intrinsics because measurement showed LLVM does not vectorise them well: it emits
//! `pmaddwd` only for an i8 dot reduced to one scalar (a horizontal add per block) and
//! falls back to `pmulld` for the 8-lane form; it split the 8-lane f32 accumulator into
//! shuffled halves; and `half`/portable f16 widening per block cost more than the dot
//! itself. The portable variant uses the scalar-reduced forms, which LLVM does turn into
//! `pmaddwd` on plain SSE2 (and are the natural shape for other architectures).
//!
//! Results: the AVX2 and AVX-512 variants share one lane layout and agree bit for bit;
//! the portable one sums in another order (differences ~1e-7 relative). No variant uses
//! FMA, so results do not depend on contraction choices.

use moe_plugin_api::BlockQ8_1;

/// How many activation columns share one unpacked weight unit.
pub const COL_GROUP: usize = 8;

/// The integer dot primitives, one implementation per instruction set.
pub trait Ops: 'static {
    /// Eight i32 partial sums of the 32 products `a[i] * b[i]` (which lane holds which
    /// products is the implementation's business; only their total is meaningful). `b`
    /// (the activations: q8_1 codes, within +-127) must not hold -128.
    fn dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8];
    /// The same for weights known to lie in 0..=127 (the codes of an unsigned format):
    /// no sign handling needed, so one instruction fewer on x86.
    fn dot32u(w: &[i8; 32], a: &[i8; 32]) -> [i32; 8] {
        Self::dot32(w, a)
    }
    /// The same for i16 weights (K-quant codes pre-multiplied by their sub-block scale,
    /// |w| <= 4096) against i8 activations.
    fn dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8];
    /// `acc += scale * lanes` (multiply, then add: no FMA).
    fn axpy(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]);
    /// The same with f32 lanes.
    fn axpy_f(acc: &mut [f32; 8], scale: f32, lanes: &[f32; 8]);
    /// f16 bits to f32 (exact; F16C's `vcvtph2ps` where the variant has it).
    fn f16(h: u16) -> f32;
    /// Eight little-endian f16 (16 bytes) to f32.
    fn f16x8(b: &[u8; 16]) -> [f32; 8];
    /// Two little-endian f16 (a block's scale and offset) to f32.
    fn f16x2(b: &[u8; 4]) -> [f32; 2] {
        [
            Self::f16(u16::from_le_bytes([b[0], b[1]])),
            Self::f16(u16::from_le_bytes([b[2], b[3]])),
        ]
    }
    /// `table[idx[i]]` for 32 indices below 16 (`pshufb` on x86).
    fn lut16(table: &[i8; 16], idx: &[u8; 32]) -> [i8; 32];
}

/// Portable lanes: lane j sums the products j, j+8 (, j+16, j+24).
pub struct Portable;

impl Ops for Portable {
    #[inline(always)]
    fn axpy(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]) {
        for (v, l) in acc.iter_mut().zip(lanes) {
            *v += scale * *l as f32;
        }
    }
    #[inline(always)]
    fn axpy_f(acc: &mut [f32; 8], scale: f32, lanes: &[f32; 8]) {
        for (v, l) in acc.iter_mut().zip(lanes) {
            *v += scale * *l;
        }
    }
    /// Reduced to one scalar in lane 0: the form LLVM turns into `pmaddwd` + a short
    /// horizontal add on SSE2 (the lane-shaped form becomes scalar code there).
    #[inline(always)]
    fn dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
        let mut s = 0i32;
        for i in 0..32 {
            s += a[i] as i32 * b[i] as i32;
        }
        [s, 0, 0, 0, 0, 0, 0, 0]
    }
    #[inline(always)]
    fn dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8] {
        let mut s = 0i32;
        for i in 0..32 {
            s += w[i] as i32 * a[i] as i32;
        }
        [s, 0, 0, 0, 0, 0, 0, 0]
    }
    #[inline(always)]
    fn f16(h: u16) -> f32 {
        crate::fp::f16_to_f32(h)
    }
    #[inline(always)]
    fn lut16(table: &[i8; 16], idx: &[u8; 32]) -> [i8; 32] {
        let mut v = [0i8; 32];
        for (v, i) in v.iter_mut().zip(idx) {
            *v = table[(*i & 15) as usize];
        }
        v
    }
    #[inline(always)]
    fn f16x8(b: &[u8; 16]) -> [f32; 8] {
        let mut v = [0f32; 8];
        for (v, c) in v.iter_mut().zip(b.chunks_exact(2)) {
            *v = crate::fp::f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
        }
        v
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// i8 dots by `pmaddubsw` + `pmaddwd` (i16 weights by `pmaddwd`).
    pub struct Avx2;
    /// The same lanes by AVX-512 VNNI's `vpdpbusd` (`vpdpwssd` for i16 weights).
    pub struct Avx512;

    #[inline]
    #[target_feature(enable = "avx2")]
    fn widen16(p: &[i8; 16]) -> __m256i {
        // SAFETY: 16 readable bytes; unaligned load.
        _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.as_ptr().cast()) })
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn lanes(v: __m256i) -> [i32; 8] {
        // SAFETY: same size, any bit pattern is a valid [i32; 8].
        unsafe { std::mem::transmute::<__m256i, [i32; 8]>(v) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load16(p: &[i16]) -> __m256i {
        assert!(p.len() >= 16);
        // SAFETY: 16 readable i16 (checked above); unaligned load.
        unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx2_dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8] {
        let (a0, a1) = a.split_at(16);
        let lo = _mm256_madd_epi16(load16(&w[..16]), widen16(a0.try_into().unwrap()));
        let hi = _mm256_madd_epi16(load16(&w[16..]), widen16(a1.try_into().unwrap()));
        lanes(_mm256_add_epi32(lo, hi))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn vnni_dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8] {
        let (a0, a1) = a.split_at(16);
        let lo = _mm256_madd_epi16(load16(&w[..16]), widen16(a0.try_into().unwrap()));
        lanes(_mm256_dpwssd_epi32(
            lo,
            load16(&w[16..]),
            widen16(a1.try_into().unwrap()),
        ))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn load32(p: &[i8; 32]) -> __m256i {
        // SAFETY: 32 readable bytes; unaligned load.
        unsafe { _mm256_loadu_si256(p.as_ptr().cast()) }
    }

    /// The unsigned-times-signed form of `w . a`: |w| (as u8, so |-128| = 128 is exact)
    /// against a with w's sign. Exact while a has no -128 (q8_1 codes are within +-127).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sign_split(w: __m256i, a: __m256i) -> (__m256i, __m256i) {
        (_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w))
    }

    /// Lane j = u[4j..4j+4] . s[4j..4j+4] for u8 `u` and i8 `s`: `pmaddubsw` (sums of
    /// pairs in i16, saturating: exact for any s while u <= 128, which every caller
    /// keeps: 2 * 128 * 128 = 2^15 fits below, 2 * 128 * 127 above) then `pmaddwd` by ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx2_dpbusd(u: __m256i, s: __m256i) -> [i32; 8] {
        lanes(_mm256_madd_epi16(
            _mm256_maddubs_epi16(u, s),
            _mm256_set1_epi16(1),
        ))
    }

    /// The same lanes in one VNNI instruction (`vpdpbusd`), with no saturation.
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn vnni_dpbusd(u: __m256i, s: __m256i) -> [i32; 8] {
        lanes(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx2_dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
        let (u, s) = sign_split(load32(a), load32(b));
        avx2_dpbusd(u, s)
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn vnni_dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
        let (u, s) = sign_split(load32(a), load32(b));
        vnni_dpbusd(u, s)
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx2_dot32u(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
        avx2_dpbusd(load32(a), load32(b))
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw,avx512vl,avx512vnni")]
    fn vnni_dot32u(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
        vnni_dpbusd(load32(a), load32(b))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx_axpy(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]) {
        // SAFETY: [f32; 8] / [i32; 8] are 32 readable/writable bytes; unaligned access.
        unsafe {
            let l = _mm256_cvtepi32_ps(_mm256_loadu_si256(lanes.as_ptr().cast()));
            let a = _mm256_loadu_ps(acc.as_ptr());
            let r = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(scale), l));
            _mm256_storeu_ps(acc.as_mut_ptr(), r);
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn avx_axpy_f(acc: &mut [f32; 8], scale: f32, lanes: &[f32; 8]) {
        // SAFETY: as above.
        unsafe {
            let l = _mm256_loadu_ps(lanes.as_ptr());
            let a = _mm256_loadu_ps(acc.as_ptr());
            let r = _mm256_add_ps(a, _mm256_mul_ps(_mm256_set1_ps(scale), l));
            _mm256_storeu_ps(acc.as_mut_ptr(), r);
        }
    }

    #[inline]
    #[target_feature(enable = "f16c")]
    fn f16c(h: u16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
    }

    #[inline]
    #[target_feature(enable = "f16c")]
    fn f16c_x2(b: &[u8; 4]) -> [f32; 2] {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from_le_bytes(*b)));
        // SAFETY: any bits are a valid [f32; 4].
        let l = unsafe { std::mem::transmute::<__m128, [f32; 4]>(v) };
        [l[0], l[1]]
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn f16c_x8(b: &[u8; 16]) -> [f32; 8] {
        // SAFETY: 16 readable bytes; unaligned load; any bits are a valid [f32; 8].
        unsafe {
            std::mem::transmute::<__m256, [f32; 8]>(_mm256_cvtph_ps(_mm_loadu_si128(
                b.as_ptr().cast(),
            )))
        }
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    fn pshufb_lut16(table: &[i8; 16], idx: &[u8; 32]) -> [i8; 32] {
        // SAFETY: 16 and 32 readable bytes; unaligned loads; any bits are a valid [i8; 32].
        unsafe {
            let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr().cast()));
            let i = _mm256_and_si256(
                _mm256_loadu_si256(idx.as_ptr().cast()),
                _mm256_set1_epi8(15),
            );
            std::mem::transmute::<__m256i, [i8; 32]>(_mm256_shuffle_epi8(t, i))
        }
    }

    macro_rules! axpy_impls {
        () => {
            #[inline(always)]
            fn lut16(table: &[i8; 16], idx: &[u8; 32]) -> [i8; 32] {
                // SAFETY: both x86 drivers enable (and `best_isa` checks) AVX2.
                unsafe { pshufb_lut16(table, idx) }
            }
            #[inline(always)]
            fn f16x8(b: &[u8; 16]) -> [f32; 8] {
                // SAFETY: both x86 drivers enable (and `best_isa` checks) AVX2 and F16C.
                unsafe { f16c_x8(b) }
            }
            #[inline(always)]
            fn f16(h: u16) -> f32 {
                // SAFETY: both x86 drivers enable (and `best_isa` checks) F16C.
                unsafe { f16c(h) }
            }
            #[inline(always)]
            fn f16x2(b: &[u8; 4]) -> [f32; 2] {
                // SAFETY: as above.
                unsafe { f16c_x2(b) }
            }
            #[inline(always)]
            fn axpy(acc: &mut [f32; 8], scale: f32, lanes: &[i32; 8]) {
                // SAFETY: only reached from the AVX2/AVX-512 drivers (AVX2 checked).
                unsafe { avx_axpy(acc, scale, lanes) }
            }
            #[inline(always)]
            fn axpy_f(acc: &mut [f32; 8], scale: f32, lanes: &[f32; 8]) {
                // SAFETY: as above.
                unsafe { avx_axpy_f(acc, scale, lanes) }
            }
        };
    }

    impl super::Ops for Avx2 {
        axpy_impls!();
        #[inline(always)]
        fn dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
            // SAFETY: only reached from `driver_avx2`/`driver_avx512`, which run after
            // `best_isa` checked AVX2.
            unsafe { avx2_dot32(a, b) }
        }
        #[inline(always)]
        fn dot32u(w: &[i8; 32], a: &[i8; 32]) -> [i32; 8] {
            // SAFETY: as above.
            unsafe { avx2_dot32u(w, a) }
        }
        #[inline(always)]
        fn dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8] {
            // SAFETY: as above.
            unsafe { avx2_dot32w(w, a) }
        }
    }

    impl super::Ops for Avx512 {
        axpy_impls!();
        #[inline(always)]
        fn dot32(a: &[i8; 32], b: &[i8; 32]) -> [i32; 8] {
            // SAFETY: only reached from `driver_avx512`, run after `best_isa` checked
            // every feature enabled here.
            unsafe { vnni_dot32(a, b) }
        }
        #[inline(always)]
        fn dot32u(w: &[i8; 32], a: &[i8; 32]) -> [i32; 8] {
            // SAFETY: as above.
            unsafe { vnni_dot32u(w, a) }
        }
        #[inline(always)]
        fn dot32w(w: &[i16; 32], a: &[i8; 32]) -> [i32; 8] {
            // SAFETY: as above.
            unsafe { vnni_dot32w(w, a) }
        }
    }
}

pub trait DotUnit: 'static {
    /// Weights per unit (a multiple of 32).
    const DW: usize;
    /// Bytes per unit.
    const DB: usize;
    type U;
    /// Unpacks one unit (`b.len() == DB`).
    fn unpack<O: Ops>(b: &[u8]) -> Self::U;
    /// Adds the dot of an unpacked unit with `DW / 32` activation blocks to `acc`.
    fn dot<O: Ops>(u: &Self::U, a: &[BlockQ8_1], acc: &mut Acc);
}

/// A dot-product accumulator: eight f32 lanes (summed only once per row, so no
/// horizontal reduction per block) plus one scalar for per-block terms such as mins.
#[derive(Clone, Copy, Default)]
pub struct Acc {
    pub v: [f32; 8],
    pub s: f32,
}

impl Acc {
    /// `v += scale * lanes`.
    #[inline(always)]
    pub fn add_scaled<O: Ops>(&mut self, scale: f32, lanes: &[i32; 8]) {
        O::axpy(&mut self.v, scale, lanes)
    }
    /// `v += scale * lanes` for f32 lanes.
    #[inline(always)]
    pub fn add_scaled_f<O: Ops>(&mut self, scale: f32, lanes: &[f32; 8]) {
        O::axpy_f(&mut self.v, scale, lanes)
    }
    #[inline(always)]
    pub fn total(&self) -> f32 {
        let v = &self.v;
        (((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]))) + self.s
    }
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
fn driver<D: DotUnit, O: Ops>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    let apu = D::DW / 32;
    if s.n_cols == 1 {
        // Batch-1 decode: one pass over the weights, one accumulator, in the order the
        // several-column path below takes too: a prefill's products equal decode's bit
        // for bit (the CPU backend's prefill and token-by-token decode agree exactly, and
        // DeepSeek-V4's top-k choices with them). Two accumulators by unit parity measured
        // +9-14% here from cache but cost the several-column path a quarter.
        let act = &act[..s.per_col];
        for (row, o) in rows.chunks_exact(s.row_bytes).zip(out.iter_mut()) {
            let mut acc = Acc::default();
            for (unit, a) in row.chunks_exact(D::DB).zip(act.chunks_exact(apu)) {
                D::dot::<O>(&D::unpack::<O>(unit), a, &mut acc);
            }
            *o = acc.total();
        }
        return;
    }
    for (r, row) in rows.chunks_exact(s.row_bytes).enumerate().take(s.n_rows) {
        let mut c0 = 0;
        while c0 < s.n_cols {
            let cn = (s.n_cols - c0).min(COL_GROUP);
            let mut acc = [Acc::default(); COL_GROUP];
            for (u, unit) in row.chunks_exact(D::DB).enumerate() {
                let w = D::unpack::<O>(unit);
                for (c, acc) in acc.iter_mut().enumerate().take(cn) {
                    let start = (c0 + c) * s.per_col + u * apu;
                    D::dot::<O>(&w, &act[start..start + apu], acc);
                }
            }
            for (c, acc) in acc.iter().enumerate().take(cn) {
                out[(c0 + c) * s.n_rows + r] = acc.total();
            }
            c0 += cn;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn driver_avx2<D: DotUnit>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    driver::<D, x86::Avx2>(rows, s, act, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
fn driver_avx512<D: DotUnit>(rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
    driver::<D, x86::Avx512>(rows, s, act, out)
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
    driver::<D, Portable>(rows, s, act, out)
}

/// The `N` i8 values starting at `off` as an array reference.
#[inline(always)]
pub fn sub<const N: usize>(a: &[i8], off: usize) -> &[i8; N] {
    a[off..off + N].try_into().unwrap()
}

/// The `N` i16 values starting at `off` as an array reference.
#[inline(always)]
pub fn sub16<const N: usize>(a: &[i16], off: usize) -> &[i16; N] {
    a[off..off + N].try_into().unwrap()
}
