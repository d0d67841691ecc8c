//! ROCmFP2 (type 107) GPU kernels: parity against a CPU reference on fresh random data,
//! proof of which kernel ran, and a microbenchmark against the device's copy bandwidth.
//!
//! Runs through the backend's plugin table (the same calls the host makes), plus the
//! rlib's event timing. Prints a table and, at the end, one JSON line.
//!
//!   cargo run --release -p moe-backend-cuda --example gpu_kernels [-- --quick | --bench | --grouped]
//!   ... --example gpu_kernels -- --compile sm_90   (the kernel cache alone, no device)
//!
//! The CPU reference is the q8 dot product written out from the spec
//! (../shared/spec/rocmfpx.md): per 16-weight half, d * (A * sum c*q - B * sum q) with
//! A = B = E[h] (two-scale) or A = S, B = O (affine), summed in f64; activations are
//! quantised with plugin-api's `BlockQ8_1::quantize`.

// Table headers are written as literals next to the formats of their rows.
#![allow(clippy::print_literal)]

use std::time::Instant;

use std::sync::atomic::{AtomicBool, Ordering};

use moe_backend_cuda::{
    ops::{
        fp4_b2, id_nosort, mmq_kernel, FORCE_ATT_BF16, FORCE_ATT_DEC, FORCE_ATT_GRP,
        FORCE_ATT_HPW4, FORCE_ATT_TC, FORCE_FP4_MMA, FORCE_FP4_REGS, FORCE_HC_GSYNC,
        FORCE_IDX_BF16, FORCE_IDX_TCS, FORCE_MMB, FORCE_MMQ_DP4A, FORCE_MMW, FORCE_MMW_NARROW,
        FORCE_MMW_ROWS, FORCE_Q8_DECODE, FP2_AFFINE, FP2_TWO_SCALE, OP_MATMUL_ID,
    },
    rt,
};
use moe_plugin_api::{into_result, ops, types, Backend, BlockQ8_1, OpParams, TensorRef};

/// Whether prefill products of type 107 / ROCmFP4 take the bf16 tiles (`mmb_dense`,
/// `mmb_id`) on a device of compute capability `cc`: sm_80 on, with MOE_GPU_MMB=1 or
/// forced by a test. (`main` sets MOE_GPU_MMB=0 where it is unset, so the int8 cases
/// test the int8 tiles; the streamed tiles, the backend's default, have their own cases.)
fn mmb(cc: (i32, i32)) -> bool {
    cc.0 >= 8
        && (FORCE_MMB.load(Ordering::Relaxed)
            || std::env::var_os("MOE_GPU_MMB").is_some_and(|v| v == "1"))
}

/// Whether two runs' outputs are the same bits, value for value.
/// Each value rounded to bf16 (to nearest even, as the kernels' `cvt.rn.bf16x2` rounds)
/// and back: the operands the bf16 kernels multiply.
fn bf16_rounded(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_f32())
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn ue4m3(b: u8) -> f64 {
    if b >= 0x7f {
        return 0.0;
    }
    let (e, m) = ((b >> 3) & 15, (b & 7) as f64);
    if e == 0 {
        m * 2f64.powi(-10)
    } else {
        (8.0 + m) * 2f64.powi(e as i32 - 11)
    }
}

/// Random valid type-107 rows: any codes, scale bytes in a realistic range.
fn random_weights(rng: &mut Rng, rows: usize, k: usize) -> Vec<u8> {
    let nb = rows * k / 32;
    let mut w = vec![0u8; nb * 10];
    for b in w.chunks_exact_mut(10) {
        for q in &mut b[..8] {
            *q = rng.next() as u8;
        }
        b[8] = 0x28 + rng.below(0x30) as u8;
        b[9] = 0x20 + rng.below(0x30) as u8;
    }
    w
}

/// Reference q8 dot of one row with one column (see the file comment).
fn ref_dot(row: &[u8], col: &[BlockQ8_1], affine: bool) -> f64 {
    let mut acc = 0f64;
    for (b, q) in row.chunks_exact(10).zip(col) {
        for h in 0..2 {
            let (a, bb) = if affine {
                (ue4m3(b[8]), ue4m3(b[9]))
            } else {
                (ue4m3(b[8 + h]), ue4m3(b[8 + h]))
            };
            let (mut cq, mut sq) = (0i64, 0i64);
            for i in 16 * h..16 * h + 16 {
                let c = ((b[i >> 2] >> (2 * (i & 3))) & 3) as i64;
                cq += c * q.qs[i] as i64;
                sq += q.qs[i] as i64;
            }
            acc += q.d as f64 * (a * cq as f64 - bb * sq as f64);
        }
    }
    acc
}

/// out[c * m + r] = row(r)[c] for all m rows (each giving n values), over all cores.
fn par_rows(m: usize, n: usize, row: impl Fn(usize) -> Vec<f64> + Sync) -> Vec<f64> {
    let threads = std::thread::available_parallelism().map_or(4, |t| t.get());
    let chunk = m.div_ceil(threads);
    let parts: Vec<Vec<f64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let row = &row;
                s.spawn(move || {
                    (t * chunk..((t + 1) * chunk).min(m))
                        .flat_map(row)
                        .collect::<Vec<f64>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut out = vec![0f64; m * n];
    for (t, part) in parts.iter().enumerate() {
        for (i, v) in part.iter().enumerate() {
            out[(i % n) * m + t * chunk + i / n] = *v;
        }
    }
    out
}

/// ref[c * m + r] for all rows of `w` and columns of `act`.
fn ref_matmul(w: &[u8], m: usize, k: usize, act: &[Vec<BlockQ8_1>], affine: bool) -> Vec<f64> {
    let rb = k / 32 * 10;
    par_rows(m, act.len(), |r| {
        act.iter()
            .map(|col| ref_dot(&w[r * rb..(r + 1) * rb], col, affine))
            .collect()
    })
}

/// f16 bits to f64 (finite values only, as the scales are written).
fn f16_value(h: u16) -> f64 {
    let (e, m) = ((h >> 10) & 31, (h & 1023) as f64);
    let mag = if e == 0 {
        m * 2f64.powi(-24)
    } else {
        (1024.0 + m) * 2f64.powi(e as i32 - 25)
    };
    if h & 0x8000 != 0 {
        -mag
    } else {
        mag
    }
}

/// Random valid rows of Q8_0 (ty 8: f16 scale, 32 int8) or ROCmFP4 (ty 100: 16 code
/// bytes, two UE4M3 half scales), and their values (from the spec, in f64).
fn random_dense(rng: &mut Rng, ty: u32, rows: usize, k: usize) -> (Vec<u8>, Vec<f64>) {
    let nb = rows * k / 32;
    let bb = if ty == 8 { 34 } else { 18 };
    let mut w = vec![0u8; nb * bb];
    let mut v = Vec::with_capacity(rows * k);
    for b in w.chunks_exact_mut(bb) {
        for q in b.iter_mut() {
            *q = rng.next() as u8;
        }
        if ty == 8 {
            // exponent 2^-10 .. 2^-6, sign random
            let h = ((rng.below(2) as u16) << 15)
                | ((5 + rng.below(5) as u16) << 10)
                | (rng.next() as u16 & 1023);
            b[..2].copy_from_slice(&h.to_le_bytes());
            let d = f16_value(h);
            v.extend(b[2..].iter().map(|&q| d * q as i8 as f64));
        } else {
            b[16] = 0x28 + rng.below(0x30) as u8;
            b[17] = 0x28 + rng.below(0x30) as u8;
            for j in 0..32 {
                let c = (b[j & 15] >> if j >= 16 { 4 } else { 0 }) & 15;
                let m = (c & 7) as f64;
                let mag = if m <= 4.0 { m } else { 2.0 * m - 4.0 };
                let s = ue4m3(b[16 + (j >= 16) as usize]);
                v.push(if c & 8 != 0 { -mag * s } else { mag * s });
            }
        }
    }
    (w, v)
}

/// ref[c * m + r] = sum_i w[r][i] * d_c q_c[i] (q8_1 activations), in f64 over all cores.
fn ref_values(w: &[f64], m: usize, k: usize, act: &[Vec<BlockQ8_1>]) -> Vec<f64> {
    let xs: Vec<Vec<f64>> = act
        .iter()
        .map(|c| {
            c.iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                .collect()
        })
        .collect();
    par_rows(m, xs.len(), |r| {
        let row = &w[r * k..(r + 1) * k];
        xs.iter()
            .map(|x| row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>())
            .collect()
    })
}

/// MATMUL_ID's i[0] in [`run_dense_id`]: the ids marked fixed (ABI 1.12; the runs
/// kernel then asks for its rows before its dependent-launch wait).
static FIXED_IDS: AtomicBool = AtomicBool::new(false);

/// One MATMUL_ID of dense weights `w` (type `ty`, dequantised values `wv`, [k, m,
/// experts]) on the columns `x` with `ids` (`slots` per token, `n_tok` tokens; one
/// column per token, or per pair when `x` has one for each), the output first filled
/// with NaN; the ids marked fixed as [`FIXED_IDS`] says. Returns the launch counters from before it, the routed pairs' outputs, their
/// reference rows (`act`: each column's q8_1 blocks) and whether every masked pair came
/// out as exact zeros.
#[allow(clippy::too_many_arguments)]
fn run_dense_id(
    g: &Gpu,
    ty: u32,
    (w, wv): (&[u8], &[f64]),
    x: &[f32],
    act: &[Vec<BlockQ8_1>],
    ids: &[i32],
    [k, m, experts, slots, n_tok]: [usize; 5],
) -> (
    std::collections::BTreeMap<String, u64>,
    Vec<f32>,
    Vec<f64>,
    bool,
) {
    let pairs = ids.len();
    let cols = x.len() / k;
    let (bw, bx) = (g.buf(w), g.buf(&f32_bytes(x)));
    let bi = g.buf(
        &ids.iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let bo = g.buf(&f32_bytes(&vec![f32::NAN; m * pairs]));
    let before = g.counters();
    let mut fixed = OpParams::default();
    fixed.i[0] = FIXED_IDS.load(Ordering::Relaxed) as i64;
    g.op_with(
        OP_MATMUL_ID,
        fixed,
        &id_args(
            [bw, bx, bi, bo],
            (ty, 0),
            [k, m, experts, slots, n_tok, cols],
        ),
    );
    let got = g.read_f32(bo, 0, m * pairs);
    let (mut gr, mut wr, mut zeros) = (Vec::new(), Vec::new(), true);
    for (p, &e) in ids.iter().enumerate() {
        let gs = &got[p * m..(p + 1) * m];
        if e < 0 {
            zeros &= gs.iter().all(|v| v.to_bits() == 0);
            continue;
        }
        let c = if cols == pairs { p } else { p / slots };
        let ew = &wv[e as usize * m * k..(e as usize + 1) * m * k];
        wr.extend(ref_values(ew, m, k, &act[c..c + 1]));
        gr.extend_from_slice(gs);
    }
    for b in [bw, bx, bi, bo] {
        into_result((g.be.free)(b)).unwrap();
    }
    (before, gr, wr, zeros)
}

/// Prefill products of Q8_0 / ROCmFP4 weights (MATMUL with 16+ columns, MATMUL_ID with
/// 4+ pairs per expert) on the MMQ tiles vs the CPU reference with the same q8_1
/// activations; which kernel ran is checked too.
fn dense_mmq(g: &Gpu, rng: &mut Rng, cc: (i32, i32), json: &mut Vec<String>) -> bool {
    let tiles = mmq_kernel(cc) == "mmq_mma_107";
    println!("\n== Q8_0 / ROCmFP4 prefill products (q8_1 activations) vs CPU reference ==");
    println!(
        "{:<8} {:<6} {:>5} {:>5} {:>5} {:>12} {:<16} {}",
        "type", "op", "K", "M", "cols", "nmse", "kernel", "ok"
    );
    let mut all_ok = true;
    let quant = |x: &[f32], k: usize| -> Vec<Vec<BlockQ8_1>> {
        x.chunks_exact(k)
            .map(|c| c.chunks_exact(32).map(BlockQ8_1::quantize).collect())
            .collect()
    };
    let mut report = |ty: u32,
                      op: &str,
                      k: usize,
                      m: usize,
                      cols: usize,
                      e: f64,
                      ran: bool,
                      want: &str| {
        let ok = ran && e <= 5e-4;
        all_ok &= ok;
        let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
        println!(
            "{name:<8} {op:<6} {k:>5} {m:>5} {cols:>5} {e:>12.3e} {want:<16} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"dense_mmq\",\"type\":\"{name}\",\"op\":\"{op}\",\"k\":{k},\"m\":{m},\"cols\":{cols},\"nmse\":{e:e},\"kernel\":\"{want}\",\"ok\":{ok}}}"
        ));
    };
    let ran = |before: &std::collections::BTreeMap<String, u64>, name: &str| {
        let key = format!("{name}.device");
        g.counters().get(&key) > before.get(&key)
    };
    // ROCmFP4 twice where the bf16 tiles exist: as configured, then forced onto them.
    let runs: Vec<(u32, bool)> = [(8u32, false), (100, false), (100, true)]
        .into_iter()
        .filter(|&(_, force)| !force || (tiles && cc.0 >= 8))
        .collect();
    for (ty, force) in runs {
        FORCE_MMB.store(force, Ordering::Relaxed);
        // m not a multiple of the 128-row tile: the edge rows are exercised.
        let (k, m) = (4096usize, 1000usize);
        let (w, wv) = random_dense(rng, ty, m, k);
        let bw = g.buf(&w);
        let want_kernel = match (tiles, ty == 100 && mmb(cc)) {
            (true, true) => "mmb_dense",
            (true, false) => "mmq_mma_dense",
            _ => "matvec_dense",
        };
        for n in [16usize, 100] {
            let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let (bx, bo) = (g.buf(&f32_bytes(&x)), g.zeros(m * n * 4));
            let before = g.counters();
            g.op(
                ops::MATMUL,
                &[
                    t(bw, 0, ty, 0, [k as u64, m as u64, 1, 1]),
                    t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                    t(bo, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
                ],
            );
            let got = g.read_f32(bo, 0, m * n);
            let e = nmse(&got, &ref_values(&wv, m, k, &quant(&x, k)));
            report(
                ty,
                "matmul",
                k,
                m,
                n,
                e,
                ran(&before, want_kernel),
                want_kernel,
            );
            for b in [bx, bo] {
                into_result((g.be.free)(b)).unwrap();
            }
        }
        into_result((g.be.free)(bw)).unwrap();
        // Grouped: 8 experts of 300 x 2048, 6 slots; 64 tokens (48 pairs per expert: the
        // wide warp layout) and 16 (12: column tiles of at most 16, the narrow one).
        for n_tok in [64usize, 16] {
            let (k, m, experts, slots) = (2048usize, 300usize, 8usize, 6usize);
            let (w, wv) = random_dense(rng, ty, experts * m, k);
            let pairs = n_tok * slots;
            let x: Vec<f32> = (0..n_tok * k).map(|_| rng.f32()).collect();
            let ids: Vec<i32> = (0..pairs)
                .map(|p| {
                    if rng.below(10) == 0 {
                        -1
                    } else {
                        ((p % slots + rng.below(2) as usize * slots) % experts) as i32
                    }
                })
                .collect();
            let (before, gr, wr, zeros) = run_dense_id(
                g,
                ty,
                (&w, &wv),
                &x,
                &quant(&x, k),
                &ids,
                [k, m, experts, slots, n_tok],
            );
            let want_kernel = match (tiles, ty == 100 && mmb(cc)) {
                (true, true) => "mmb_id",
                (true, false) => "mmq_mma_id",
                _ => "matvec_dense_rows_id",
            };
            let e = if zeros { nmse(&gr, &wr) } else { f64::INFINITY };
            report(
                ty,
                "id",
                k,
                m,
                pairs,
                e,
                ran(&before, want_kernel),
                want_kernel,
            );
        }
        FORCE_MMB.store(false, Ordering::Relaxed);
    }
    all_ok
}

/// Type-107 rows' values from the spec (two-scale: (c - 1) E_h; affine: c S - O), in f64.
fn values_107(w: &[u8], affine: bool) -> Vec<f64> {
    let mut v = Vec::with_capacity(w.len() / 10 * 32);
    for b in w.chunks_exact(10) {
        for i in 0..32 {
            let c = ((b[i >> 2] >> (2 * (i & 3))) & 3) as f64;
            let (a, o) = if affine {
                (ue4m3(b[8]), ue4m3(b[9]))
            } else {
                let e = ue4m3(b[8 + i / 16]);
                (e, e)
            };
            v.push(c * a - o);
        }
    }
    v
}

/// ref[c * m + r] = sum_i w[r][i] * x_c[i] with the f32 activations themselves, in f64.
fn ref_f32(w: &[f64], m: usize, k: usize, x: &[f32]) -> Vec<f64> {
    let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
    par_rows(m, xs.len(), |r| {
        let row = &w[r * k..(r + 1) * k];
        xs.iter()
            .map(|c| row.iter().zip(*c).map(|(a, b)| a * *b as f64).sum::<f64>())
            .collect()
    })
}

/// The streamed bf16 tiles (`mmw_dense` / `mmw_id`, MOE_GPU_MMB=stream; and their 32-row
/// warp layout `mmw_*_m2`, MOE_GPU_MMW_ROWS=32) against the bf16 MMB tiles on the same
/// random inputs: the same weight values, activation rounding and mma sequence a sum, so
/// every routed output is expected to be the same bits (reported; the pass criteria are
/// the f64 reference of the f32 inputs within nmse 5e-4 (bf16 operands), masked routes
/// exact zeros, NaN-poisoned outputs all written, and which kernels ran: a k of whole
/// 128-value stages on mmw, else back on mmb). Shapes: edge rows (m % 128 != 0), one and
/// several column tiles, 16 columns (narrow tiles), grouped experts of ~12 pairs with one
/// expert of 32 on a launch given room for narrow tiles only (that list then runs as two
/// narrow tiles), ~60 pairs (wide).
fn mmw_check(g: &Gpu, rng: &mut Rng, cc: (i32, i32), json: &mut Vec<String>) -> bool {
    if cc.0 < 8 {
        println!("\n== streamed bf16 tiles: skipped (needs sm_80) ==");
        return true;
    }
    println!("\n== streamed bf16 tiles (mmw) vs bf16 tiles (mmb) and the f64 reference ==");
    println!(
        "{:<10} {:<6} {:>5} {:>5} {:>5} {:>9} {:>8} {:>12} {:<16} {}",
        "type", "op", "K", "M", "cols", "same bits", "written", "nmse", "kernel", "ok"
    );
    let mut all_ok = true;
    let kinds: [(&str, u32, u64); 3] = [
        ("two-scale", 107, FP2_TWO_SCALE),
        ("affine", 107, FP2_AFFINE),
        ("rocmfp4", 100, 0),
    ];
    let weights = |rng: &mut Rng, ty: u32, variant: u64, rows: usize, k: usize| {
        if ty == 107 {
            let w = random_weights(rng, rows, k);
            let v = values_107(&w, variant == FP2_AFFINE);
            (w, v)
        } else {
            random_dense(rng, ty, rows, k)
        }
    };
    // Runs `f` on the MMB tiles, then on each streamed layout: the MMB output, and for
    // each layout the kernel expected (`want`, its _m2 form for 32 rows; mmb where the
    // shape does not stream), its output and whether it ran and the other kinds did not.
    // Whether `name` ran between two counter readings and no other tile kernel did.
    let only = |before: &std::collections::BTreeMap<String, u64>,
                after: &std::collections::BTreeMap<String, u64>,
                name: &str| {
        TILE_KERNELS
            .iter()
            .all(|k| (device_launches(before, after, k) > 0) == (*k == name))
    };
    // Runs `f` on the MMB tiles (the streamed form forced off, whatever the environment
    // says), then on each streamed layout (forced on, 16 then 32 rows a warp): the MMB
    // output, whether mmb alone ran (`ref_want`), and for each layout the kernel
    // expected (`want`, its _m2 form for 32 rows; mmb where the shape does not stream),
    // its output and whether it alone ran.
    let runs = |f: &dyn Fn() -> Vec<f32>, want: &str, ref_want: &str| {
        FORCE_MMB.store(true, Ordering::Relaxed);
        FORCE_MMW.store(2, Ordering::Relaxed);
        let before = g.counters();
        let mmb_out = f();
        let ref_ran = only(&before, &g.counters(), ref_want);
        let mut outs = Vec::new();
        for rows in [16u32, 32] {
            FORCE_MMW.store(1, Ordering::Relaxed);
            FORCE_MMW_ROWS.store(rows, Ordering::Relaxed);
            let before = g.counters();
            let out = f();
            let after = g.counters();
            let name = match (want.starts_with("mmw"), rows) {
                (true, 32) => format!("{want}_m2"),
                _ => want.to_string(),
            };
            outs.push((name.clone(), out, ref_ran && only(&before, &after, &name)));
        }
        FORCE_MMW_ROWS.store(0, Ordering::Relaxed);
        FORCE_MMW.store(0, Ordering::Relaxed);
        FORCE_MMB.store(false, Ordering::Relaxed);
        (mmb_out, outs)
    };
    let poisoned = |b: u64, len: usize| {
        let got = g.read_f32(b, 0, len);
        into_result((g.be.upload)(
            b,
            0,
            f32_bytes(&vec![f32::NAN; len]).as_slice().into(),
        ))
        .unwrap();
        got
    };
    let mut report = |vname: &str,
                      op: &str,
                      [k, m, cols]: [usize; 3],
                      row: (&str, bool, bool, bool, f64, bool)| {
        let (name, bits, written, zeros, e, ran) = row;
        let ok = ran && written && zeros && e <= 5e-4;
        all_ok &= ok;
        println!(
            "{vname:<10} {op:<6} {k:>5} {m:>5} {cols:>5} {bits:>9} {written:>8} {e:>12.3e} {name:<16} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"mmw\",\"type\":\"{vname}\",\"op\":\"{op}\",\"k\":{k},\"m\":{m},\"cols\":{cols},\"same_bits\":{bits},\"written\":{written},\"masked_zero\":{zeros},\"nmse\":{e:e},\"kernel\":\"{name}\",\"ok\":{ok}}}"
        ));
    };
    for (vname, ty, variant) in kinds {
        // Dense: (k, m, n); k = 160 is not whole stages (back on mmb_dense).
        for (k, m, n) in [
            (1024usize, 1000usize, 40usize),
            (2048, 512, 16),
            (4096, 384, 130),
            (160, 256, 20),
        ] {
            let (w, wv) = weights(rng, ty, variant, m, k);
            let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
            let (bw, bx) = (g.buf(&w), g.buf(&f32_bytes(&x)));
            let bo = g.buf(&f32_bytes(&vec![f32::NAN; m * n]));
            let want = if k % 128 == 0 {
                "mmw_dense"
            } else {
                "mmb_dense"
            };
            let run = || {
                g.op(
                    ops::MATMUL,
                    &[
                        t(bw, 0, ty, variant, [k as u64, m as u64, 1, 1]),
                        t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                        t(bo, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
                    ],
                );
                poisoned(bo, m * n)
            };
            let (ref_out, outs) = runs(&run, want, "mmb_dense");
            let want_ref = ref_f32(&wv, m, k, &x);
            for (name, got, ran) in outs {
                let written = got.iter().all(|v| !v.is_nan());
                let bits = same_bits(&got, &ref_out);
                let e = nmse(&got, &want_ref);
                report(
                    vname,
                    "matmul",
                    [k, m, n],
                    (&name, bits, written, true, e, ran),
                );
            }
            for b in [bw, bx, bo] {
                into_result((g.be.free)(b)).unwrap();
            }
        }
        // Grouped: 16 experts of 300 x 1024, 6 slots.
        for (n_tok, skew, per_pair) in [
            (32usize, false, false),
            (32, true, true),
            (160, false, false),
        ] {
            let (k, m, experts, slots) = (1024usize, 300usize, 16usize, 6usize);
            let (w, wv) = weights(rng, ty, variant, experts * m, k);
            let pairs = n_tok * slots;
            let cols = if per_pair { pairs } else { n_tok };
            let x: Vec<f32> = (0..cols * k).map(|_| rng.f32()).collect();
            let mut ids = vec![0i32; pairs];
            for tok in 0..n_tok {
                let mut used = Vec::new();
                for s in 0..slots {
                    // skew: expert 0 in every token's first slot (32 pairs on a launch
                    // planned for ~12); about one route in ten masked otherwise.
                    let e = if skew && s == 0 {
                        0
                    } else {
                        loop {
                            let e = rng.below(experts as u64) as i32;
                            if !(used.contains(&e) || (skew && e == 0)) {
                                break e;
                            }
                        }
                    };
                    used.push(e);
                    let masked = !(skew && s == 0) && rng.below(10) == 0;
                    ids[tok * slots + s] = if masked { -1 } else { e };
                }
            }
            let (bw, bx) = (g.buf(&w), g.buf(&f32_bytes(&x)));
            let bi = g.buf(
                &ids.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
            let bo = g.buf(&f32_bytes(&vec![f32::NAN; m * pairs]));
            let run = || {
                g.op(
                    OP_MATMUL_ID,
                    &id_args(
                        [bw, bx, bi, bo],
                        (ty, variant),
                        [k, m, experts, slots, n_tok, cols],
                    ),
                );
                poisoned(bo, m * pairs)
            };
            // skew: a launch with room for narrow tiles only (expert 0's list of 32 as two)
            FORCE_MMW_NARROW.store(skew, Ordering::Relaxed);
            let (ref_out, outs) = runs(&run, "mmw_id", "mmb_id");
            FORCE_MMW_NARROW.store(false, Ordering::Relaxed);
            let mut want_ref = Vec::new();
            for (p, &e) in ids.iter().enumerate() {
                if e >= 0 {
                    let c = if per_pair { p } else { p / slots };
                    let ew = &wv[e as usize * m * k..(e as usize + 1) * m * k];
                    want_ref.extend(ref_f32(ew, m, k, &x[c * k..(c + 1) * k]));
                }
            }
            for (name, got, ran) in outs {
                let (mut gr, mut zeros, mut written, mut bits) = (Vec::new(), true, true, true);
                for (p, &e) in ids.iter().enumerate() {
                    let gs = &got[p * m..(p + 1) * m];
                    if e < 0 {
                        zeros &= gs.iter().all(|v| v.to_bits() == 0);
                        continue;
                    }
                    written &= gs.iter().all(|v| !v.is_nan());
                    bits &= same_bits(gs, &ref_out[p * m..(p + 1) * m]);
                    gr.extend_from_slice(gs);
                }
                let e = nmse(&gr, &want_ref);
                let op = if skew { "id/skw" } else { "id" };
                report(
                    vname,
                    op,
                    [k, m, pairs],
                    (&name, bits, written, zeros, e, ran),
                );
            }
            for b in [bw, bx, bi, bo] {
                into_result((g.be.free)(b)).unwrap();
            }
        }
    }
    all_ok
}

/// Type-107 MATMUL of 1 - 33 columns against the CPU reference (normalised MSE <= 5e-4),
/// each on the kernel its width plans: MMVQ up to 8 columns, then every tile kernel the
/// device has.
fn mmvq_parity(g: &Gpu, rng: &mut Rng, cc: (i32, i32), json: &mut Vec<String>) -> bool {
    let mut all = true;
    println!("\n== parity vs CPU reference (normalised MSE; limit 5e-4) ==");
    println!(
        "{:<10} {:>5} {:>5} {:>4} {:>12} {:<18} {}",
        "variant", "K", "M", "n", "nmse", "kernel", "ok"
    );
    let m = 4096usize;
    let ns: Vec<usize> = (1..=8).chain([16, 31, 33]).collect();
    for (variant, vname) in [(FP2_TWO_SCALE, "two-scale"), (FP2_AFFINE, "affine")] {
        for k in [4096usize, 2048] {
            let w = random_weights(rng, m, k);
            let nmax = 33;
            let x: Vec<f32> = (0..nmax * k).map(|_| rng.f32()).collect();
            let act: Vec<Vec<BlockQ8_1>> = x
                .chunks_exact(k)
                .map(|c| c.chunks_exact(32).map(BlockQ8_1::quantize).collect())
                .collect();
            let want = ref_matmul(&w, m, k, &act, variant == FP2_AFFINE);
            let (bw, bx, bo) = (g.buf(&w), g.buf(&f32_bytes(&x)), g.zeros(m * nmax * 4));
            // n > 8 runs each tile kernel the device has: as configured (the int8
            // tensor-core one from sm_80), the bf16 one, then the dp4a one (mode 0, 1, 2).
            let runs: Vec<(usize, u8)> = ns
                .iter()
                .flat_map(|&n| {
                    let modes: &[u8] = match (n > 8, mmq_kernel(cc) != "mmq_dp4a_107") {
                        (false, _) => &[0],
                        (true, true) if cc.0 >= 8 => &[0, 1, 2],
                        (true, true) => &[0, 2],
                        (true, false) => &[0],
                    };
                    modes.iter().map(move |&mode| (n, mode))
                })
                .collect();
            for &(n, mode) in &runs {
                FORCE_MMB.store(mode == 1, Ordering::Relaxed);
                FORCE_MMQ_DP4A.store(mode == 2, Ordering::Relaxed);
                let before = g.counters();
                g.op(
                    ops::MATMUL,
                    &[
                        t(bw, 0, 107, variant, [k as u64, m as u64, 1, 1]),
                        t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                        t(bo, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
                    ],
                );
                let got = g.read_f32(bo, 0, m * n);
                let after = g.counters();
                let ran: Vec<String> = after
                    .iter()
                    .filter(|(k, v)| k.ends_with(".device") && before.get(*k) != Some(v))
                    .map(|(k, _)| k.trim_end_matches(".device").to_string())
                    .filter(|k| k != "quantize_q8_1")
                    .collect();
                let expect_kernel = if n <= 8 {
                    format!("mmvq_107_n{n}")
                } else if mmb(cc) {
                    "mmb_dense".to_string()
                } else {
                    mmq_kernel(cc).to_string()
                };
                FORCE_MMQ_DP4A.store(false, Ordering::Relaxed);
                FORCE_MMB.store(false, Ordering::Relaxed);
                let e = nmse(&got, &want[..m * n]);
                let ok = e <= 5e-4 && ran == [expect_kernel.clone()];
                all &= ok;
                println!(
                    "{:<10} {:>5} {:>5} {:>4} {:>12.3e} {:<18} {}",
                    vname,
                    k,
                    m,
                    n,
                    e,
                    ran.join(","),
                    if ok { "ok" } else { "FAIL" }
                );
                json.push(format!(
                "{{\"test\":\"parity\",\"variant\":\"{vname}\",\"k\":{k},\"m\":{m},\"n\":{n},\"nmse\":{e:e},\"kernel\":\"{}\",\"ok\":{ok}}}",
                ran.join(",")
            ));
            }
            for b in [bw, bx, bo] {
                into_result((g.be.free)(b)).unwrap();
            }
        }
    }
    all
}

/// MATMUL_ID_MULTI for one token (the routed experts' gate and up): two type-107
/// products of one input and routing (one slot masked) must equal their own MATMUL_IDs
/// bit for bit, from one quantisation of the input and one grouped launch.
fn id_multi(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== MATMUL_ID_MULTI (one token, two products) vs two MATMUL_IDs ==");
    let (k, m, experts, slots) = (4096usize, 2048usize, 16usize, 6usize);
    let (w1, w2) = (
        random_weights(rng, experts * m, k),
        random_weights(rng, experts * m, k),
    );
    let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
    let ids: Vec<i32> = [3, 11, -1, 0, 15, 7].to_vec();
    let (bw1, bw2, bx) = (g.buf(&w1), g.buf(&w2), g.buf(&f32_bytes(&x)));
    let bi = g.buf(
        &ids.iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let nan = f32_bytes(&vec![f32::NAN; m * slots]);
    let outs: Vec<u64> = (0..4).map(|_| g.buf(&nan)).collect();
    let shape = [k, m, experts, slots, 1, 1];
    for (i, bw) in [bw1, bw2].into_iter().enumerate() {
        g.op(
            OP_MATMUL_ID,
            &id_args([bw, bx, bi, outs[i]], (107, FP2_AFFINE), shape),
        );
    }
    let [a1, x1, i1, o1] = id_args([bw1, bx, bi, outs[2]], (107, FP2_AFFINE), shape);
    let [a2, _, _, o2] = id_args([bw2, bx, bi, outs[3]], (107, FP2_AFFINE), shape);
    let before = g.counters();
    g.op(ops::MATMUL_ID_MULTI, &[x1, i1, a1, o1, a2, o2]);
    let after = g.counters();
    let delta = |n: &str| device_launches(&before, &after, n);
    let launches = (delta("quantize_q8_1"), delta("mmvq_id_107"));
    let same = (0..2).all(|i| {
        let (a, b) = (
            g.read_f32(outs[i], 0, m * slots),
            g.read_f32(outs[2 + i], 0, m * slots),
        );
        same_bits(&a, &b)
    });
    let ok = same && launches == (1, 1);
    println!(
        "affine {k} x {m}, {slots} slots: bit-identical {same}, launches (quantize, grouped) {launches:?} {}",
        if ok { "ok" } else { "FAIL" }
    );
    json.push(format!(
        "{{\"test\":\"id_multi\",\"bit_identical\":{same},\"quantize\":{},\"grouped\":{},\"ok\":{ok}}}",
        launches.0, launches.1
    ));
    for b in [bw1, bw2, bx, bi].into_iter().chain(outs) {
        into_result((g.be.free)(b)).unwrap();
    }
    ok
}

/// Decode products (one f32 column) of Q8_0 / ROCmFP4 weights vs the f64 dot of the
/// same weights and activations (max error / max |ref| <= 1e-5), with the kernel that
/// ran: ROCmFP4 in whole 256-value runs with 4096+ rows (k >= 2048 under 16384 rows;
/// see `ops::fp4_runs`) on `matvec_fp4_runs_q8` (its
/// activations rounded to q8_1 in the kernel, so the reference takes them as
/// `BlockQ8_1::quantize` rounds them; `_id` for one token's grouped product, a masked
/// slot giving exact zeros), the rest on `matvec_dense_rows` (f32 activations).
/// Largest |got - want| over the largest |want|.
fn rel(got: &[f32], want: &[f64]) -> f64 {
    let top = want.iter().fold(0f64, |a, v| a.max(v.abs()));
    let e = got
        .iter()
        .zip(want)
        .fold(0f64, |a, (&g, w)| a.max((g as f64 - w).abs()));
    e / top
}

/// A drafted pass's products: 2 - 15 f32 columns of Q8_0 / ROCmFP4 weights against the
/// f64 dot (max error / max |ref| <= 1e-5; activations as `BlockQ8_1::quantize` rounds
/// them where the kernel quantises), on the kernel the plan names: the large ROCmFP4
/// shapes whose one column takes the runs kernel on `matvec_fp4_runs_q8_cols`, the rest
/// on `matvec_dense_cols`. Each column must be the same bits as that column's own
/// product where the two kernels are a pair (`matvec_dense_rows` / `matvec_dense_cols`,
/// `matvec_fp4_runs_q8` / `matvec_fp4_runs_q8_cols`). Also prints each product's time on
/// the drafted width against one column's (the mean of 20 launches back to back by CUDA
/// events, so weights under L2's size stay there; a figure, not a check).
fn dense_cols(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== Q8_0 / ROCmFP4 products of 2 - 15 columns vs f64 reference ==");
    let mut all_ok = true;
    let (cols_f32, cols_runs) = ("matvec_dense_cols", "matvec_fp4_runs_q8_cols");
    let cases = [
        (8u32, 4096usize, 1024usize, 4usize, cols_f32),
        (8, 2048, 37, 11, cols_f32),
        (8, 4096, 8192, 2, cols_f32),
        (100, 4000, 700, 8, cols_f32),
        (100, 4096, 2048, 3, cols_f32),
        (100, 4096, 512, 15, cols_f32),
        // 12 runs a row: one column on the runs kernel, several on the f32 one.
        (100, 3072, 16384, 4, cols_f32),
        (100, 1024, 32768, 4, cols_runs),
        (100, 8192, 4100, 4, cols_runs),
        (100, 8192, 4100, 5, cols_runs),
        (100, 2048, 4096, 2, cols_runs),
        (100, 4096, 8192, 8, cols_runs),
        (100, 1024, 16384, 15, cols_runs),
    ];
    let ran = |before: &std::collections::BTreeMap<String, u64>, name: &str| {
        let key = format!("{name}.device");
        g.counters().get(&key) > before.get(&key)
    };
    for (ty, k, m, n, kernel) in cases {
        let (w, wv) = random_dense(rng, ty, m, k);
        let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let (bw, bx) = (g.buf(&w), g.buf(&f32_bytes(&x)));
        let (bo, b1) = (g.zeros(m * n * 4), g.zeros(m * 4));
        let matmul = |xo: u64, cols: usize, o: u64| {
            g.op(
                ops::MATMUL,
                &[
                    t(bw, 0, ty, 0, [k as u64, m as u64, 1, 1]),
                    t(bx, xo, types::F32, 0, [k as u64, cols as u64, 1, 1]),
                    t(o, 0, types::F32, 0, [m as u64, cols as u64, 1, 1]),
                ],
            )
        };
        let before = g.counters();
        matmul(0, n, bo);
        let ran_cols = ran(&before, kernel);
        let got = g.read_f32(bo, 0, m * n);
        let want = if kernel == cols_runs {
            let act: Vec<Vec<BlockQ8_1>> = x
                .chunks_exact(k)
                .map(|c| c.chunks_exact(32).map(BlockQ8_1::quantize).collect())
                .collect();
            ref_values(&wv, m, k, &act)
        } else {
            (0..n)
                .flat_map(|c| ref_f32(&wv[..], m, k, &x[c * k..(c + 1) * k]))
                .collect()
        };
        let e = rel(&got, &want);
        // Each column alone: the same bits where its kernel is the pair's one-column form.
        let one = if kernel == cols_runs {
            "matvec_fp4_runs_q8"
        } else {
            "matvec_dense_rows"
        };
        let (mut same, mut paired) = (true, true);
        for c in 0..n {
            let before = g.counters();
            matmul((c * k * 4) as u64, 1, b1);
            paired &= ran(&before, one);
            same &= same_bits(&g.read_f32(b1, 0, m), &got[c * m..(c + 1) * m]);
        }
        let time = |cols: usize, o: u64| 1e3 * g.time(20, || matmul(0, cols, o));
        let (t1, tn) = (time(1, b1), time(n, bo));
        let ok = ran_cols && e <= 1e-5 && (same || !paired);
        all_ok &= ok;
        let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
        let bits = match (paired, same) {
            (false, _) => "(other kernel)",
            (true, true) => "yes",
            (true, false) => "NO",
        };
        println!(
            "{name:<8} {k:>5} x {m:>6}, {n:>2} columns {kernel:<24} {e:>10.2e} bits as one column: {bits:<14} | {t1:>6.1} us one column, {tn:>6.1} us {n} ({:.2}x) {}",
            tn / t1,
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"dense_cols\",\"ty\":{ty},\"k\":{k},\"m\":{m},\"n\":{n},\"kernel\":\"{kernel}\",\"rel\":{e:e},\"same_bits\":{same},\"paired\":{paired},\"one_col_us\":{t1:.2},\"cols_us\":{tn:.2},\"ok\":{ok}}}"
        ));
        for b in [bw, bx, bo, b1] {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    all_ok
}

fn dense_decode(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== Q8_0 / ROCmFP4 decode products (f32 activations) vs f64 reference ==");
    let mut all_ok = true;
    // (`MOE_GPU_FP4_B2=1` runs the runs kernels' 512-thread plans as their `_b2` forms)
    let ran = |before: &std::collections::BTreeMap<String, u64>, name: &str| {
        let after = g.counters();
        let grew = |n: &str| {
            let key = format!("{n}.device");
            after.get(&key) > before.get(&key)
        };
        grew(name)
            || (fp4_b2() && name.starts_with("matvec_fp4_runs_q8") && grew(&format!("{name}_b2")))
    };
    let mut report = |what: String, e: f64, ran: bool, want: &str| {
        let ok = ran && e <= 1e-5;
        all_ok &= ok;
        println!(
            "{what:<34} {e:>10.2e} {want:<20} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"dense_decode\",\"case\":\"{what}\",\"rel\":{e:e},\"kernel\":\"{want}\",\"ok\":{ok}}}"
        ));
    };
    let cases = [
        (100u32, 1024usize, 32768usize, "matvec_fp4_runs_q8"),
        (100, 2048, 16400, "matvec_fp4_runs_q8"),
        (100, 8192, 16384, "matvec_fp4_runs_q8"),
        // wo_b (512-thread blocks; 4100 rows: not a multiple of the block's 32) and the
        // shared expert's down (one row a thread, 256 threads).
        (100, 8192, 4100, "matvec_fp4_runs_q8"),
        (100, 2048, 4096, "matvec_fp4_runs_q8"),
        (100, 4096, 1000, "matvec_dense_rows"),
        (100, 4000, 700, "matvec_dense_rows"),
        (8, 4096, 1000, "matvec_dense_rows"),
        (8, 4096, 64, "matvec_dense_rows"),
        // MOE_GPU_Q8_DECODE=1 (forced for these): 8-bit activations, one quantisation.
        (100, 4096, 1000, "matvec_dense_q8_multi"),
        (8, 4096, 1000, "matvec_dense_q8_multi"),
        (100, 4096, 2048, "matvec_dense_q8_multi"),
        (8, 2048, 37, "matvec_dense_q8_multi"),
    ];
    for (ty, k, m, want) in cases {
        let q8 = want == "matvec_dense_q8_multi";
        FORCE_Q8_DECODE.store(q8, Ordering::Relaxed);
        let (w, wv) = random_dense(rng, ty, m, k);
        let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
        let (bw, bx, bo) = (g.buf(&w), g.buf(&f32_bytes(&x)), g.zeros(m * 4));
        // The product into output buffer o.
        let matmul = |o| {
            g.op(
                ops::MATMUL,
                &[
                    t(bw, 0, ty, 0, [k as u64, m as u64, 1, 1]),
                    t(bx, 0, types::F32, 0, [k as u64, 1, 1, 1]),
                    t(o, 0, types::F32, 0, [m as u64, 1, 1, 1]),
                ],
            )
        };
        let before = g.counters();
        matmul(bo);
        let want_v = if want.ends_with("_q8") || q8 {
            ref_values(
                &wv,
                m,
                k,
                &[x.chunks_exact(32).map(BlockQ8_1::quantize).collect()],
            )
        } else {
            par_rows(m, 1, |r| {
                vec![wv[r * k..(r + 1) * k]
                    .iter()
                    .zip(&x)
                    .map(|(a, &b)| a * b as f64)
                    .sum::<f64>()]
            })
        };
        let got = g.read_f32(bo, 0, m);
        let e = rel(&got, &want_v);
        let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
        report(
            format!("{name} matmul {k} x {m}"),
            e,
            ran(&before, want),
            want,
        );
        // The runs kernel's register path (its loads into registers) where the device
        // gave it the bulk path (its rows copied into shared memory): the same bits.
        if want == "matvec_fp4_runs_q8" {
            let br = g.zeros(m * 4);
            FORCE_FP4_REGS.store(true, Ordering::Relaxed);
            let before = g.counters();
            matmul(br);
            FORCE_FP4_REGS.store(false, Ordering::Relaxed);
            let regs = g.read_f32(br, 0, m);
            let e = match same_bits(&regs, &got) {
                true => rel(&regs, &want_v),
                false => f64::INFINITY,
            };
            report(
                format!("{name} matmul {k} x {m}, register path"),
                e,
                ran(&before, want),
                want,
            );
            into_result((g.be.free)(br)).unwrap();
        }
        // The runs kernel's products on the matrix units (matvec_fp4_mma, forced at both
        // block widths): within the tolerance of the reference and the runs kernel's
        // bits exactly (the same integer sums, scales and order of additions).
        if want == "matvec_fp4_runs_q8" && k % 1024 == 0 {
            for threads in [256u64, 512] {
                FORCE_FP4_MMA.store(threads, Ordering::Relaxed);
                let bm = g.zeros(m * 4);
                let before = g.counters();
                matmul(bm);
                let mma = g.read_f32(bm, 0, m);
                let e = if same_bits(&mma, &got) {
                    rel(&mma, &want_v)
                } else {
                    f64::INFINITY
                };
                report(
                    format!("{name} matmul {k} x {m}, mma {threads}"),
                    e,
                    ran(&before, "matvec_fp4_mma"),
                    "matvec_fp4_mma",
                );
                into_result((g.be.free)(bm)).unwrap();
            }
            FORCE_FP4_MMA.store(0, Ordering::Relaxed);
        }
        for b in [bw, bx, bo] {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    FORCE_Q8_DECODE.store(false, Ordering::Relaxed);
    // One token's grouped product (each slot its own expert and column), slot 2 masked:
    // 16384 ROCmFP4 rows a slot, and the output projection's 8 groups, on the runs
    // kernel; under 4096 rows in all, with MOE_GPU_Q8_DECODE (forced), the 8-bit grouped
    // rows kernel.
    let id_cases = [
        (
            100u32,
            1024usize,
            16384usize,
            4usize,
            "matvec_fp4_runs_q8_id",
        ),
        // The output projection's 8 groups: the runs kernel, 512-thread blocks.
        (100, 4096, 1024, 8, "matvec_fp4_runs_q8_id"),
        (100, 4096, 256, 8, "matvec_dense_q8_id"),
        (8, 4096, 300, 4, "matvec_dense_q8_id"),
    ];
    for (ty, k, m, slots, want) in id_cases {
        FORCE_Q8_DECODE.store(want == "matvec_dense_q8_id", Ordering::Relaxed);
        let experts = slots;
        let (w, wv) = random_dense(rng, ty, experts * m, k);
        let x: Vec<f32> = (0..slots * k).map(|_| rng.f32()).collect();
        let ids: Vec<i32> = (0..slots as i32)
            .map(|s| if s == 2 { -1 } else { (s * 3) % experts as i32 })
            .collect();
        let act: Vec<Vec<BlockQ8_1>> = x
            .chunks_exact(k)
            .map(|c| c.chunks_exact(32).map(BlockQ8_1::quantize).collect())
            .collect();
        let (before, gr, wr, zeros) =
            run_dense_id(g, ty, (&w, &wv), &x, &act, &ids, [k, m, experts, slots, 1]);
        let e = if zeros { rel(&gr, &wr) } else { f64::INFINITY };
        let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
        report(
            format!("{name} id {k} x {m}, {slots} slots"),
            e,
            ran(&before, want),
            want,
        );
        // Variants that must give the same bits, the masked slot zeros: the ids marked
        // fixed (the rows asked for before the wait; the masked slot's block waits
        // first) and the register path (see the dense case above).
        if want == "matvec_fp4_runs_q8_id" {
            for (flag, how) in [
                (&FIXED_IDS, "fixed ids"),
                (&FORCE_FP4_REGS, "register path"),
            ] {
                flag.store(true, Ordering::Relaxed);
                let (before, gv, _, zeros) =
                    run_dense_id(g, ty, (&w, &wv), &x, &act, &ids, [k, m, experts, slots, 1]);
                flag.store(false, Ordering::Relaxed);
                let e = if zeros && same_bits(&gv, &gr) {
                    rel(&gv, &wr)
                } else {
                    f64::INFINITY
                };
                report(
                    format!("{name} id {k} x {m}, {slots} slots, {how}"),
                    e,
                    ran(&before, want),
                    want,
                );
            }
        }
        // Its matrix-unit form: zeros for the masked slot, the runs kernel's bits.
        if want == "matvec_fp4_runs_q8_id" {
            for threads in [256u64, 512] {
                FORCE_FP4_MMA.store(threads, Ordering::Relaxed);
                let (before, gm, _, zeros) =
                    run_dense_id(g, ty, (&w, &wv), &x, &act, &ids, [k, m, experts, slots, 1]);
                let same = same_bits(&gm, &gr);
                let e = if zeros && same {
                    rel(&gm, &wr)
                } else {
                    f64::INFINITY
                };
                report(
                    format!("{name} id {k} x {m}, {slots} slots, mma {threads}"),
                    e,
                    ran(&before, "matvec_fp4_mma_id"),
                    "matvec_fp4_mma_id",
                );
            }
            FORCE_FP4_MMA.store(0, Ordering::Relaxed);
        }
    }
    FORCE_Q8_DECODE.store(false, Ordering::Relaxed);
    // MATMUL_MULTI: four products of one input (two ROCmFP4, two Q8_0, row counts not
    // multiples of the rows a block) in two fused launches, of one column (decode) and of
    // three (a drafted pass: the columns' kernel); each output must equal its own MATMUL's
    // bit for bit and the f64 dot within the tolerance above.
    for (n, kernel) in [
        (1usize, "matvec_dense_rows_multi"),
        (3, "matvec_dense_cols_multi"),
    ] {
        let k = 4096usize;
        let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let bx = g.buf(&f32_bytes(&x));
        let mut args = vec![t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1])];
        let mut held = vec![bx];
        let mut parts = Vec::new();
        for (ty, m) in [(100u32, 1000usize), (8, 1025), (100, 37), (8, 64)] {
            let (w, wv) = random_dense(rng, ty, m, k);
            let (bw, bo, bs) = (g.buf(&w), g.zeros(m * n * 4), g.zeros(m * n * 4));
            let wt = t(bw, 0, ty, 0, [k as u64, m as u64, 1, 1]);
            let ot = |b| t(b, 0, types::F32, 0, [m as u64, n as u64, 1, 1]);
            g.op(ops::MATMUL, &[wt, args[0], ot(bs)]);
            args.extend([wt, ot(bo)]);
            held.extend([bw, bo, bs]);
            parts.push((ty, m, wv, bo, bs));
        }
        let before = g.counters();
        g.op(ops::MATMUL_MULTI, &args);
        // One launch per weight type, none falling back to single products.
        let key = format!("{kernel}.device");
        let fused = g.counters().get(&key).copied().unwrap_or(0)
            == before.get(&key).copied().unwrap_or(0) + 2;
        for (ty, m, wv, bo, bs) in parts {
            let got = g.read_f32(bo, 0, m * n);
            let single = g.read_f32(bs, 0, m * n);
            let same = got == single;
            if !same {
                // Which outputs differ, and by how much: a layout bug moves whole rows, a
                // rounding difference (the compiler contracting differently) moves last bits.
                let diff: Vec<(usize, f32)> = (0..m * n)
                    .filter(|&r| got[r] != single[r])
                    .map(|r| (r, (got[r] - single[r]).abs() / single[r].abs().max(1e-30)))
                    .collect();
                let worst = diff.iter().map(|d| d.1).fold(0f32, f32::max);
                eprintln!(
                    "  multi vs matmul: {} of {} outputs differ (first {:?}), worst relative {worst:.2e}",
                    diff.len(),
                    m * n,
                    diff.first().map(|d| d.0)
                );
            }
            let want_v: Vec<f64> = (0..n)
                .flat_map(|c| ref_f32(&wv[..], m, k, &x[c * k..(c + 1) * k]))
                .collect();
            let e = if same {
                rel(&got, &want_v)
            } else {
                f64::INFINITY
            };
            let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
            report(
                format!("{name} multi {k} x {m}, {n} col (= matmul)"),
                e,
                fused,
                kernel,
            );
        }
        for b in held {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    // The 8-bit decode (MOE_GPU_Q8_DECODE=1, forced here): MATMUL_MULTI of two weight
    // types on `matvec_dense_q8_multi`, one quantisation of x for both (single products:
    // the cases above).
    FORCE_Q8_DECODE.store(true, Ordering::Relaxed);
    let want = "matvec_dense_q8_multi";
    // Two types in one MATMUL_MULTI: two launches on one quantisation of x.
    let k = 4096usize;
    let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
    let act = [x.chunks_exact(32).map(BlockQ8_1::quantize).collect()];
    let bx = g.buf(&f32_bytes(&x));
    let mut args = vec![t(bx, 0, types::F32, 0, [k as u64, 1, 1, 1])];
    let mut held = vec![bx];
    let mut parts = Vec::new();
    for (ty, m) in [(100u32, 700usize), (8, 300)] {
        let (w, wv) = random_dense(rng, ty, m, k);
        let (bw, bo) = (g.buf(&w), g.zeros(m * 4));
        args.extend([
            t(bw, 0, ty, 0, [k as u64, m as u64, 1, 1]),
            t(bo, 0, types::F32, 0, [m as u64, 1, 1, 1]),
        ]);
        held.extend([bw, bo]);
        parts.push((ty, m, wv, bo));
    }
    let before = g.counters();
    g.op(ops::MATMUL_MULTI, &args);
    let quantised_once = g
        .counters()
        .get("quantize_q8_1.device")
        .copied()
        .unwrap_or(0)
        == before.get("quantize_q8_1.device").copied().unwrap_or(0) + 1;
    for (ty, m, wv, bo) in parts {
        let e = rel(&g.read_f32(bo, 0, m), &ref_values(&wv, m, k, &act));
        let name = if ty == 8 { "q8_0" } else { "rocmfp4" };
        report(
            format!("{name} q8 multi {k} x {m} (one quantise)"),
            e,
            ran(&before, want) && quantised_once,
            want,
        );
    }
    for b in held {
        into_result((g.be.free)(b)).unwrap();
    }
    FORCE_Q8_DECODE.store(false, Ordering::Relaxed);
    all_ok
}

/// f32 products of many columns (a prefill chunk's mHC mixes and router, and odd shapes:
/// rows and columns past a tile, k not whole steps of 32, one slice of k) on
/// `matmul_f32_tiles` (+ `matmul_f32_reduce`), and 15 columns on `matvec_dense`: within
/// 1e-5 of the largest value of an f64 reference, and a second run bit-identical (the
/// slices are added in order).
/// A NaN activation reaches every output of the products that quantise their input to
/// q8 (its block's scale becomes NaN, as the CPU's `BlockQ8_1::quantize`), rather than a
/// finite answer with the NaN dropped by the block's max. One NaN a column, so every
/// (row, column) sum must be NaN.
fn nan_inputs(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== a NaN activation reaches every output of the q8 products ==");
    let (k, m) = (2048usize, 256usize);
    let mut all_ok = true;
    // (case, type, variant, columns, forced path)
    for (what, ty, variant, n, force) in [
        ("rocmfp2 affine, decode", 107u32, FP2_AFFINE, 1usize, ""),
        ("rocmfp2 two-scale, 8 columns", 107, FP2_TWO_SCALE, 8, ""),
        ("rocmfp2 affine, 64 columns (mmq)", 107, FP2_AFFINE, 64, ""),
        ("rocmfp4, runs kernel", 100, 0, 1, ""),
        ("rocmfp4, mma", 100, 0, 1, "mma"),
        ("q8_0, q8 decode", 8, 0, 1, "q8"),
    ] {
        FORCE_Q8_DECODE.store(force == "q8", Ordering::Relaxed);
        // (1: the runs kernel whatever MOE_GPU_FP4_MMA says)
        FORCE_FP4_MMA.store(if force == "mma" { 256 } else { 1 }, Ordering::Relaxed);
        let w = if ty == 107 {
            random_weights(rng, m, k)
        } else {
            random_dense(rng, ty, m, k).0
        };
        let mut x: Vec<f32> = (0..k * n).map(|_| rng.f32()).collect();
        for c in 0..n {
            x[c * k + rng.below(k as u64) as usize] = f32::NAN;
        }
        let (bw, bx, bo) = (g.buf(&w), g.buf(&f32_bytes(&x)), g.zeros(m * n * 4));
        g.op(
            ops::MATMUL,
            &[
                t(bw, 0, ty, variant, [k as u64, m as u64, 1, 1]),
                t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                t(bo, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
            ],
        );
        let got = g.read_f32(bo, 0, m * n);
        let finite = got.iter().filter(|v| !v.is_nan()).count();
        let ok = finite == 0;
        all_ok &= ok;
        println!(
            "{what:<34} {finite:>6} of {:<6} outputs not NaN {}",
            m * n,
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"nan_inputs\",\"case\":\"{what}\",\"not_nan\":{finite},\"ok\":{ok}}}"
        ));
        for b in [bw, bx, bo] {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    FORCE_Q8_DECODE.store(false, Ordering::Relaxed);
    FORCE_FP4_MMA.store(0, Ordering::Relaxed);
    all_ok
}

/// PREFETCH (ABI 1.9) on this device: one `l2_prefetch` launch over two ranges (one of
/// a size that is no whole chunk), no error, and the stream goes on (a product after it
/// gives the same bits as before it).
fn prefetch_runs(g: &Gpu, rng: &mut Rng, cc: (i32, i32), json: &mut Vec<String>) -> bool {
    println!("\n== PREFETCH: the weights' bytes asked into L2 ==");
    let (k, m) = (8192usize, 4100usize);
    let (w, _) = random_dense(rng, 100, m, k);
    let x: Vec<f32> = (0..k).map(|_| rng.f32()).collect();
    let (bw, bx, b0, b1) = (
        g.buf(&w),
        g.buf(&f32_bytes(&x)),
        g.zeros(m * 4),
        g.zeros(m * 4),
    );
    let wt = t(bw, 0, 100, 0, [k as u64, m as u64, 1, 1]);
    let matmul = |o| {
        g.op(
            ops::MATMUL,
            &[
                wt,
                t(bx, 0, types::F32, 0, [k as u64, 1, 1, 1]),
                t(o, 0, types::F32, 0, [m as u64, 1, 1, 1]),
            ],
        )
    };
    matmul(b0);
    let before = g.counters();
    // (the weights: 1153 chunks and 2 KiB, so a short last chunk; and x: two chunks)
    let pf = [wt, t(bx, 0, types::F32, 0, [k as u64, 1, 1, 1])];
    let r = into_result((g.be.run_op)(
        g.stream,
        ops::PREFETCH,
        OpParams::default(),
        pf[..].into(),
    ));
    matmul(b1);
    let ran = g.counters().get("l2_prefetch.device") > before.get("l2_prefetch.device");
    let same = same_bits(&g.read_f32(b0, 0, m), &g.read_f32(b1, 0, m));
    // (before sm_90 the backend does not offer it)
    let ok = match cc.0 >= 9 {
        true => r.is_ok() && ran && same,
        false => r.as_ref().is_err_and(|e| e.contains("not supported")) && !ran && same,
    };
    println!(
        "prefetch of {} MB: {:?}, ran {ran}, product after it the same bits {same} {}",
        w.len() / 1_000_000,
        r,
        if ok { "ok" } else { "FAIL" }
    );
    json.push(format!(
        "{{\"test\":\"prefetch\",\"ran\":{ran},\"same\":{same},\"ok\":{ok}}}"
    ));
    for b in [bw, bx, b0, b1] {
        into_result((g.be.free)(b)).unwrap();
    }
    ok
}

fn f32_tiles_check(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== f32 products of many columns vs f64 reference ==");
    let mut all_ok = true;
    for (k, m, n, want) in [
        (16384usize, 24usize, 512usize, "matmul_f32_tiles"),
        (4096, 256, 512, "matmul_f32_tiles"),
        (1000, 37, 70, "matmul_f32_tiles"),
        (300, 130, 16, "matmul_f32_tiles"),
        (4096, 24, 15, "matvec_dense"),
    ] {
        let w: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let (bw, bx) = (g.buf(&f32_bytes(&w)), g.buf(&f32_bytes(&x)));
        let run = |o| {
            g.op(
                ops::MATMUL,
                &[
                    t(bw, 0, types::F32, 0, [k as u64, m as u64, 1, 1]),
                    t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                    t(o, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
                ],
            )
        };
        let (b1, b2) = (g.zeros(m * n * 4), g.zeros(m * n * 4));
        let key = format!("{want}.device");
        let before = g.counters().get(&key).copied().unwrap_or(0);
        run(b1);
        let ran = g.counters().get(&key).copied().unwrap_or(0) > before;
        run(b2);
        let (got, again) = (g.read_f32(b1, 0, m * n), g.read_f32(b2, 0, m * n));
        let want_v = par_rows(m, n, |r| {
            (0..n)
                .map(|c| {
                    w[r * k..(r + 1) * k]
                        .iter()
                        .zip(&x[c * k..(c + 1) * k])
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum()
                })
                .collect()
        });
        let e = rel(&got, &want_v);
        let same = same_bits(&got, &again);
        let ok = ran && e <= 1e-5 && same;
        all_ok &= ok;
        println!(
            "f32 matmul {k} x {m}, {n} columns {e:>10.2e} {want:<18} repeat {} {}",
            if same { "same bits" } else { "DIFFERS" },
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"f32_tiles\",\"case\":\"{k}x{m}x{n}\",\"rel\":{e:e},\"kernel\":\"{want}\",\"ran\":{ran},\"same\":{same},\"ok\":{ok}}}"
        ));
    }
    all_ok
}

/// One microbenchmark row: kernel, shape, microseconds, weight GB/s and its share of the
/// copy rate, TFLOP/s.
fn bench_row(name: &str, [k, m, n]: [u64; 3], ms: f64, gbps: f64, copy_bw: f64, tf: f64) {
    println!(
        "{:<26} {:>5} {:>7} {:>5} {:>10.1} {:>9.0} {:>7.0}% {:>9.2}",
        name,
        k,
        m,
        n,
        ms * 1e3,
        gbps,
        100.0 * gbps * 1e9 / copy_bw,
        tf
    );
}

/// The kernels a product's tiles may run on (the prefill tile kinds, and the mat-vecs
/// few columns fall back to), most specific first.
const TILE_KERNELS: [&str; 13] = [
    "mmw_dense_m2",
    "mmw_id_m2",
    "mmw_dense",
    "mmw_id",
    "mmb_dense",
    "mmb_id",
    "mmq_mma_dense",
    "mmq_mma_id",
    "mmq_mma_107",
    "mmq_dp4a_107",
    "mmq_dp4a_id",
    "mmvq_grouped_107",
    "matvec_dense",
];

/// One microbenchmark row of `f` (10 runs after a warm-up) on each prefill tile kind of
/// `modes` (0 as configured, 1 the bf16 tiles, 2 the dp4a ones, 3 / 4 the streamed bf16
/// ones at 16 / 32 rows a warp; 1, 3, 4 whatever MOE_GPU_MMB says): the kernel the
/// counters saw run (+ `what`), the shape, TFLOP/s of `flop` and GB/s of `bytes`; and its
/// JSON (`bench`).
#[allow(clippy::too_many_arguments)]
fn bench_tile_modes(
    g: &Gpu,
    modes: &[u8],
    (what, bench): (&str, &str),
    [k, m, n]: [u64; 3],
    (flop, bytes, copy_bw): (f64, f64, f64),
    json: &mut Vec<String>,
    f: &dyn Fn(),
) {
    for &mode in modes {
        let i = mode as usize;
        FORCE_MMB.store(matches!(mode, 1 | 3 | 4), Ordering::Relaxed);
        FORCE_MMW.store([0, 2, 0, 1, 1][i], Ordering::Relaxed);
        FORCE_MMW_ROWS.store([0, 0, 0, 16, 32][i], Ordering::Relaxed);
        FORCE_MMQ_DP4A.store(mode == 2, Ordering::Relaxed);
        let before = g.counters();
        let ms = g.time(10, f);
        let after = g.counters();
        FORCE_MMQ_DP4A.store(false, Ordering::Relaxed);
        FORCE_MMW_ROWS.store(0, Ordering::Relaxed);
        FORCE_MMW.store(0, Ordering::Relaxed);
        FORCE_MMB.store(false, Ordering::Relaxed);
        let name = TILE_KERNELS
            .into_iter()
            .find(|nm| device_launches(&before, &after, nm) > 0)
            .unwrap_or("?");
        let tf = flop / (ms * 1e-3) / 1e12;
        let gbps = bytes / (ms * 1e-3) / 1e9;
        bench_row(&format!("{name}{what}"), [k, m, n], ms, gbps, copy_bw, tf);
        json.push(format!("{{\"bench\":\"{bench}\",\"kernel\":\"{name}\",\"k\":{k},\"m\":{m},\"n\":{n},\"us\":{:.2},\"tflops\":{tf:.2}}}", ms * 1e3));
    }
}

fn nmse(got: &[f32], want: &[f64]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        e += (*g as f64 - w) * (*g as f64 - w);
        s += w * w;
    }
    e / s.max(1e-30)
}

struct Gpu {
    be: Backend,
    stream: u64,
}

impl Gpu {
    fn buf(&self, bytes: &[u8]) -> u64 {
        let b = into_result((self.be.alloc)(0, bytes.len() as u64)).unwrap();
        into_result((self.be.upload)(b, 0, bytes.into())).unwrap();
        b
    }
    fn zeros(&self, bytes: usize) -> u64 {
        self.buf(&vec![0u8; bytes])
    }
    fn read_f32(&self, b: u64, offset: u64, n: usize) -> Vec<f32> {
        into_result((self.be.synchronize)(self.stream)).unwrap();
        let mut raw = vec![0u8; n * 4];
        into_result((self.be.download)(b, offset, raw.as_mut_slice().into())).unwrap();
        raw.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
    fn op(&self, op: u32, args: &[TensorRef]) {
        self.op_with(op, OpParams::default(), args)
    }

    fn op_with(&self, op: u32, params: OpParams, args: &[TensorRef]) {
        into_result((self.be.run_op)(self.stream, op, params, args.into())).unwrap();
    }
    fn counters(&self) -> std::collections::BTreeMap<String, u64> {
        (self.be.kernel_counters)()
            .into_iter()
            .map(|t| (t.0.into_string(), t.1))
            .collect()
    }
    /// Mean milliseconds of `f` over `reps` runs (after one warm-up), by CUDA events.
    fn time(&self, reps: usize, mut f: impl FnMut()) -> f64 {
        f();
        let e0 = into_result((self.be.event_record)(self.stream)).unwrap();
        for _ in 0..reps {
            f();
        }
        let e1 = into_result((self.be.event_record)(self.stream)).unwrap();
        rt::event_elapsed_ms(e0, e1).unwrap() as f64 / reps as f64
    }
}

/// An F32 tensor of `dims` (the fourth 1) at the start of `buf`.
fn f32_t(buf: u64, dims: [usize; 3]) -> TensorRef {
    t(
        buf,
        0,
        types::F32,
        0,
        [dims[0] as u64, dims[1] as u64, dims[2] as u64, 1],
    )
}

fn t(buffer: u64, offset: u64, type_id: u32, variant: u64, dims: [u64; 4]) -> TensorRef {
    TensorRef {
        buffer,
        offset,
        type_id,
        variant,
        dims,
    }
}

/// One SWIGLU_MATMUL_ID of one token against SWIGLU then MATMUL_ID, on weights `w` of
/// `ty` ([k, m, experts]) and `ids` (a slot each; marked fixed with `fixed`, i[0]):
/// whether the outputs are the same bits, and the device launches of each kernel in
/// `names` the fused op took. Gate and up are scaled so the clamp at 7 cuts some of them.
#[allow(clippy::too_many_arguments)]
fn swiglu_id_case(
    g: &Gpu,
    rng: &mut Rng,
    w: &[u8],
    ty: (u32, u64),
    [k, m, experts]: [usize; 3],
    ids: &[i32],
    names: &[&str],
    fixed: bool,
) -> (bool, Vec<u64>) {
    let slots = ids.len();
    let gate: Vec<f32> = (0..k * slots).map(|_| 12.0 * rng.f32()).collect();
    let up: Vec<f32> = (0..k * slots).map(|_| 12.0 * rng.f32()).collect();
    let (bw, bg, bu) = (g.buf(w), g.buf(&f32_bytes(&gate)), g.buf(&f32_bytes(&up)));
    let bi = g.buf(
        &ids.iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let nan = f32_bytes(&vec![f32::NAN; k.max(m) * slots]);
    let bufs: Vec<u64> = (0..4).map(|_| g.buf(&nan)).collect();
    let (act1, out1, act2, out2) = (bufs[0], bufs[1], bufs[2], bufs[3]);
    let shape = [k, m, experts, slots, 1, slots];
    let f = |b| t(b, 0, types::F32, 0, [k as u64, slots as u64, 1, 1]);
    let mut lim = OpParams::default();
    lim.f[0] = 7.0;
    g.op_with(ops::SWIGLU, lim, &[f(bg), f(bu), f(act1)]);
    g.op(OP_MATMUL_ID, &id_args([bw, act1, bi, out1], ty, shape));
    let [wr, _, ir, or] = id_args([bw, act2, bi, out2], ty, shape);
    let before = g.counters();
    let mut fused = lim;
    fused.i[0] = fixed as i64;
    g.op_with(
        ops::SWIGLU_MATMUL_ID,
        fused,
        &[wr, f(bg), f(bu), ir, or, f(act2)],
    );
    let after = g.counters();
    let launches = names
        .iter()
        .map(|n| device_launches(&before, &after, n))
        .collect();
    let same = same_bits(
        &g.read_f32(out1, 0, m * slots),
        &g.read_f32(out2, 0, m * slots),
    );
    for b in [bw, bg, bu, bi].into_iter().chain(bufs) {
        into_result((g.be.free)(b)).unwrap();
    }
    (same, launches)
}

/// SWIGLU_MATMUL_ID for one token (the routed experts' down product from their gate
/// and up outputs, a slot masked) must equal SWIGLU then MATMUL_ID bit for bit, with
/// the SwiGLU computed by the quantisation (no ds4_swiglu launch).
fn swiglu_id(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== SWIGLU_MATMUL_ID (one token) vs SWIGLU + MATMUL_ID ==");
    let (k, m, experts) = (2048usize, 4096usize, 16usize);
    let w = random_weights(rng, experts * m, k);
    let ids = [5, -1, 9, 0, 15, 2];
    let names = ["quantize_q8_1_swiglu", "ds4_swiglu", "mmvq_id_107"];
    let (same, launches) = swiglu_id_case(
        g,
        rng,
        &w,
        (107, FP2_AFFINE),
        [k, m, experts],
        &ids,
        &names,
        false,
    );
    let ok = same && launches == [1, 0, 1];
    println!(
        "affine {k} x {m}, {} slots, clamp 7: bit-identical {same}, launches (fused quantise, swiglu, grouped) {launches:?} {}",
        ids.len(),
        if ok { "ok" } else { "FAIL" }
    );
    json.push(format!(
        "{{\"test\":\"swiglu_id\",\"bit_identical\":{same},\"launches\":[{},{},{}],\"ok\":{ok}}}",
        launches[0], launches[1], launches[2]
    ));
    ok & swiglu_id_fp4(g, rng, json)
}

/// SWIGLU_MATMUL_ID of ROCmFP4 weights for one token: the shared expert's down as one
/// "expert" (id 0), and three pairs over four experts with one masked, each equal to
/// SWIGLU then MATMUL_ID bit for bit, with the SwiGLU inside the runs kernel (one
/// `matvec_fp4_runs_q8_id_swiglu` launch, no `ds4_swiglu`).
fn swiglu_id_fp4(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    let mut all = true;
    // The runs kernel's plan whatever MOE_GPU_FP4_MMA says (the matrix-unit plans keep
    // the two ops); with MOE_GPU_FP4_RUNS=0 the two ops are what must run.
    FORCE_FP4_MMA.store(1, Ordering::Relaxed);
    let runs = std::env::var_os("MOE_GPU_FP4_RUNS").is_none_or(|v| v != "0");
    let want = if runs { [1, 0] } else { [0, 1] };
    for (name, experts, ids) in [
        ("one expert (the shared down)", 1usize, vec![0i32]),
        ("3 pairs of 4 experts, one masked", 4, vec![2, -1, 0]),
    ] {
        let (k, m) = (2048usize, 4096usize);
        let (w, _) = random_dense(rng, 100, experts * m, k);
        let names = ["matvec_fp4_runs_q8_id_swiglu", "ds4_swiglu"];
        // Marked fixed (i[0], ABI 1.12: the rows asked for before the wait): the same.
        for fixed in [false, true] {
            let (same, launches) =
                swiglu_id_case(g, rng, &w, (100, 0), [k, m, experts], &ids, &names, fixed);
            let ok = same && launches == want;
            all &= ok;
            let how = if fixed { ", fixed ids" } else { "" };
            println!(
                "ROCmFP4 {k} x {m}, {name}{how}: bit-identical {same}, launches (fused runs, swiglu) {launches:?} {}",
                if ok { "ok" } else { "FAIL" }
            );
            json.push(format!(
                "{{\"test\":\"swiglu_id_fp4\",\"case\":\"{name}{how}\",\"bit_identical\":{same},\"ok\":{ok}}}"
            ));
        }
    }
    FORCE_FP4_MMA.store(0, Ordering::Relaxed);
    all
}

/// NORM_ROPE (RMS norm: none, plain or times a weight; rotary on each row's trailing
/// pairs, forward or inverse) against an f64 reference on random rows: within 1e-5 of
/// the largest output (the angle is the kernel's f32 product of position and frequency;
/// the rest f64). Rows of up to 1024 values take the kernel's one-round-trip path, the
/// 2048 and 4096 rows its loop; the decode shapes (q_a's 1024-value norm, a head's 512
/// with rotary, the inverse rotary) in place, as the model runs them.
fn norm_rope(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== NORM_ROPE vs f64 reference ==");
    let mut all = true;
    // (d, heads, tokens, norm mode, rotated pairs, inverse, in place)
    let cases = [
        (1024usize, 1usize, 1usize, 2i64, 0usize, 0i64, true),
        (512, 8, 2, 1, 32, 0, true),
        (512, 8, 1, 0, 32, 1, true),
        (128, 4, 3, 2, 32, 0, false),
        (1000, 3, 2, 1, 10, 0, false),
        (2048, 2, 1, 2, 0, 0, true),
        (4096, 1, 2, 2, 16, 1, false),
    ];
    for (d, heads, n, norm, pairs, inverse, in_place) in cases {
        let x: Vec<f32> = (0..d * heads * n).map(|_| 2.0 * rng.f32()).collect();
        let w: Vec<f32> = (0..d).map(|_| 1.0 + 0.5 * rng.f32()).collect();
        let inv: Vec<f32> = (0..pairs.max(1)).map(|i| 0.9f32.powi(i as i32)).collect();
        let pos: Vec<i32> = (0..n).map(|_| rng.below(4096) as i32).collect();
        let (eps, ms) = (1e-6f32, 0.75f32);
        let mut want = vec![0f64; x.len()];
        for (ri, (row, out)) in x.chunks_exact(d).zip(want.chunks_exact_mut(d)).enumerate() {
            let ss: f64 = row.iter().map(|&v| v as f64 * v as f64).sum();
            let r = match norm {
                0 => 1.0,
                _ => 1.0 / (ss / d as f64 + eps as f64).sqrt(),
            };
            for (i, o) in out.iter_mut().enumerate() {
                *o = row[i] as f64 * r * if norm == 2 { w[i] as f64 } else { 1.0 };
            }
            let tail = d - 2 * pairs;
            let p = pos[ri / heads] as f32;
            for j in 0..pairs {
                let ang = (p * inv[j]) as f64;
                let (c, sn) = (ang.cos() * ms as f64, ang.sin() * ms as f64);
                let sn = if inverse == 1 { -sn } else { sn };
                let (a, b) = (out[tail + 2 * j], out[tail + 2 * j + 1]);
                out[tail + 2 * j] = a * c - b * sn;
                out[tail + 2 * j + 1] = b * c + a * sn;
            }
        }
        let bx = g.buf(&f32_bytes(&x));
        let bo = if in_place { bx } else { g.zeros(x.len() * 4) };
        let (bw, binv) = (g.buf(&f32_bytes(&w)), g.buf(&f32_bytes(&inv)));
        let pos_bytes: Vec<u8> = pos.iter().flat_map(|v| v.to_le_bytes()).collect();
        let bpos = g.buf(&pos_bytes);
        let mut prm = OpParams::default();
        prm.f[0] = eps;
        prm.f[1] = ms;
        prm.i[0] = norm;
        prm.i[1] = pairs as i64;
        prm.i[2] = inverse;
        let before = g.counters();
        g.op_with(
            ops::NORM_ROPE,
            prm,
            &[
                f32_t(bx, [d, heads, n]),
                f32_t(bw, [d, 1, 1]),
                f32_t(binv, [pairs, 1, 1]),
                t(bpos, 0, types::I32, 0, [n as u64, 1, 1, 1]),
                f32_t(bo, [d, heads, n]),
            ],
        );
        let launches = device_launches(&before, &g.counters(), "ds4_norm_rope");
        let e = rel(&g.read_f32(bo, 0, x.len()), &want);
        let ok = e <= 1e-5 && launches == 1;
        all &= ok;
        println!(
            "d {d:>4}, {heads} heads, {n} tokens, norm {norm}, {pairs:>2} pairs, inverse {inverse}, in place {in_place:>5}: {e:.2e} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"norm_rope\",\"d\":{d},\"heads\":{heads},\"n\":{n},\"norm\":{norm},\"pairs\":{pairs},\"inverse\":{inverse},\"err\":{e:e},\"ok\":{ok}}}"
        ));
        let mut bufs = vec![bx, bw, binv, bpos];
        if !in_place {
            bufs.push(bo);
        }
        for b in bufs {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    all
}

/// NORM_MATMUL (ABI 1.8) of ROCmFP4 weights for one token (`matvec_fp4_runs_q8_norm`,
/// launched once, its sum of squares taken in another order) against NORM_ROPE, then
/// MATMUL, on the same random inputs: that pair within 1e-5 of the largest output of an
/// f64 product of the host's q8_1 quantisation of its normed x; the one launch within
/// 1e-3 of both (x's scale may differ in its last bits, so a few 8-bit values can round
/// apart: one such step moves an output by ~3e-4 of the largest at k = 1024), and on the
/// register path the same bits as on the bulk path. Shapes: `wq_b`'s (1024 x 32768),
/// 2048 x 4096 and 8192 x 4096 (512-thread blocks).
fn norm_matmul(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== NORM_MATMUL (the norm inside the ROCmFP4 product) vs NORM_ROPE + MATMUL ==");
    let mut all = true;
    // The runs kernel's plan whatever MOE_GPU_FP4_MMA says; with MOE_GPU_FP4_RUNS=0 or
    // MOE_GPU_NORM_MM=0 the two launches are what must run.
    FORCE_FP4_MMA.store(1, Ordering::Relaxed);
    let on = |v: &str| std::env::var_os(v).is_none_or(|v| v != "0");
    // (`MOE_GPU_FP4_B2=1` does not fuse the norm either)
    let want_launches = (on("MOE_GPU_FP4_RUNS") && on("MOE_GPU_NORM_MM") && !fp4_b2()) as u64;
    for (k, m) in [(1024usize, 32768usize), (2048, 4096), (8192, 4096)] {
        let (w, wv) = random_dense(rng, 100, m, k);
        let x: Vec<f32> = (0..k).map(|_| 3.0 * rng.f32()).collect();
        let gw: Vec<f32> = (0..k).map(|_| 1.0 + 0.5 * rng.f32()).collect();
        let (bw, bx, bg) = (g.buf(&w), g.buf(&f32_bytes(&x)), g.buf(&f32_bytes(&gw)));
        let (bo, bo2, bxn, bxn2) = (
            g.zeros(m * 4),
            g.zeros(m * 4),
            g.zeros(k * 4),
            g.zeros(k * 4),
        );
        let (binv, bpos) = (g.zeros(4), g.zeros(4));
        let wt = t(bw, 0, 100, 0, [k as u64, m as u64, 1, 1]);
        let col = |b, n: usize| f32_t(b, [n, 1, 1]);
        let mut prm = OpParams::default();
        prm.f[0] = 1e-6;
        let before = g.counters();
        g.op_with(
            ops::NORM_MATMUL,
            prm,
            &[wt, col(bx, k), col(bg, k), col(bo, m), col(bxn, k)],
        );
        let launches = device_launches(&before, &g.counters(), "matvec_fp4_runs_q8_norm");
        let fused = g.read_f32(bo, 0, m);
        let mut pn = OpParams::default();
        pn.f[0] = 1e-6;
        pn.f[1] = 1.0;
        pn.i[0] = 2;
        let pos = t(bpos, 0, types::I32, 0, [1, 1, 1, 1]);
        let xk = f32_t(bx, [k, 1, 1]);
        g.op_with(
            ops::NORM_ROPE,
            pn,
            &[xk, col(bg, k), col(binv, 1), pos, f32_t(bxn2, [k, 1, 1])],
        );
        g.op(ops::MATMUL, &[wt, col(bxn2, k), col(bo2, m)]);
        let split = g.read_f32(bo2, 0, m);
        let xn = g.read_f32(bxn2, 0, k);
        let want = ref_values(
            &wv,
            m,
            k,
            &[xn.chunks_exact(32).map(BlockQ8_1::quantize).collect()],
        );
        let (e_split, e_fused) = (rel(&split, &want), rel(&fused, &want));
        let split64: Vec<f64> = split.iter().map(|&v| v as f64).collect();
        let e_pair = rel(&fused, &split64);
        // The register path (HIP's, older NVIDIA devices') where this one took the bulk
        // copies: the same bits.
        let br = g.zeros(m * 4);
        FORCE_FP4_REGS.store(true, Ordering::Relaxed);
        g.op_with(
            ops::NORM_MATMUL,
            prm,
            &[wt, col(bx, k), col(bg, k), col(br, m), col(bxn, k)],
        );
        FORCE_FP4_REGS.store(false, Ordering::Relaxed);
        let regs_same = same_bits(&g.read_f32(br, 0, m), &fused);
        let ok = launches == want_launches
            && e_split <= 1e-5
            && e_fused <= 1e-3
            && e_pair <= 1e-3
            && regs_same;
        all &= ok;
        println!(
            "rocmfp4 {k} x {m}: one launch {launches}, vs f64 {e_fused:.2e} (two launches {e_split:.2e}), vs two launches {e_pair:.2e}, register path same bits {regs_same} {}",
            if ok { "ok" } else { "FAIL" }
        );
        for b in [bw, bx, bg, bo, bo2, bxn, bxn2, binv, bpos, br] {
            into_result((g.be.free)(b)).unwrap();
        }
        json.push(format!(
            "{{\"test\":\"norm_matmul\",\"case\":\"{k}x{m}\",\"rel_fused\":{e_fused:.3e},\"rel_split\":{e_split:.3e},\"ok\":{ok}}}"
        ));
    }
    FORCE_FP4_MMA.store(0, Ordering::Relaxed);
    all
}

/// ROUTER with its product (ABI 1.7: `ds4_router_mm` for one token) against MATMUL, then
/// the 6-argument ROUTER (`ds4_router`, whose ranks are another selection code), on the
/// same random inputs: logits, ids and weights bit for bit; the logits within 1e-5 of
/// the largest of an f64 product on the host; the ids k best of the device's logits
/// under the host's scores (score + bias, NaN last; near-ties within 1e-5 either way),
/// in order, and the weights within 1e-5 of the host's; then 100 more fused runs on
/// outputs overwritten with 0xff bytes, each the same bits with its count back at zero (a
/// count not put back to zero would leave the outputs unselected). Cases:
/// V4-Flash's router (4096 x 256, 6 of them, sqrt-softplus + bias, normalised), sigmoid
/// without bias or normalising, the hash table, twin rows without bias (exact ties: the
/// lower index first), a NaN logit, 200 experts, 1024 of 16, 255 (the last block's
/// one row), and 63 rows of 8200 values.
fn router_mm(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== ROUTER with its product (one launch) vs MATMUL + ROUTER ==");
    let mut all = true;
    for (name, d, e, k, gating, mode, norm, twin, nan) in [
        (
            "4096 x 256, bias",
            4096usize,
            256usize,
            6usize,
            4i64,
            1i64,
            1i64,
            false,
            false,
        ),
        ("4096 x 256, sigmoid", 4096, 256, 6, 2, 0, 0, false, false),
        (
            "4096 x 256, hash table",
            4096,
            256,
            6,
            4,
            2,
            1,
            false,
            false,
        ),
        ("4096 x 256, twin rows", 4096, 256, 6, 4, 0, 1, true, false),
        (
            "4096 x 256, a NaN logit",
            4096,
            256,
            6,
            2,
            1,
            1,
            false,
            true,
        ),
        ("1000 x 200", 1000, 200, 8, 4, 1, 1, false, false),
        ("512 x 1024, 16", 512, 1024, 16, 2, 1, 1, false, false),
        ("4096 x 255", 4096, 255, 6, 4, 1, 1, false, false),
        // rows past 4096 values (the parts summed after the dependent-launch wait),
        // and the last block's one row on that path
        ("8200 x 63", 8200, 63, 6, 4, 1, 1, false, false),
    ] {
        let x: Vec<f32> = (0..d).map(|_| rng.f32()).collect();
        let mut wr: Vec<f32> = (0..d * e).map(|_| 0.05 * rng.f32()).collect();
        if twin {
            for r in (1..e).step_by(2) {
                let (a, b) = wr.split_at_mut(r * d);
                b[..d].copy_from_slice(&a[(r - 1) * d..]);
            }
        }
        let nan_row = e / 3;
        if nan {
            wr[nan_row * d + 7] = f32::NAN;
        }
        let bias: Vec<f32> = (0..e).map(|_| 0.1 * rng.f32()).collect();
        let vocab = 8usize;
        let table: Vec<i32> = (0..vocab * k).map(|_| rng.below(e as u64) as i32).collect();
        let tok = 3i32;
        let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (bx, bwr, bb) = (
            g.buf(&f32_bytes(&x)),
            g.buf(&f32_bytes(&wr)),
            g.buf(&f32_bytes(&bias)),
        );
        let (btab, btok, bsync) = (g.buf(&i32b(&table)), g.buf(&i32b(&[tok])), g.zeros(4));
        let outs = || (g.zeros(e * 4), g.zeros(k * 4), g.zeros(k * 4));
        let ((bl, bi, bw), (bl2, bi2, bw2)) = (outs(), outs());
        let it = |b, n: usize| t(b, 0, types::I32, 0, [n as u64, 1, 1, 1]);
        let head = |bl, bi, bw| {
            [
                f32_t(bl, [e, 1, 1]),
                f32_t(bb, [e, 1, 1]),
                t(btab, 0, types::I32, 0, [k as u64, vocab as u64, 1, 1]),
                it(btok, 1),
                it(bi, k),
                f32_t(bw, [k, 1, 1]),
            ]
        };
        let mut prm = OpParams::default();
        prm.f[0] = 1.5;
        prm.i[..3].copy_from_slice(&[gating, norm, mode]);
        let (xt, wt) = (f32_t(bx, [d, 1, 1]), f32_t(bwr, [d, e, 1]));
        let mut fused = head(bl, bi, bw).to_vec();
        fused.extend([xt, wt, it(bsync, 1)]);
        let read = |bl, bi, bw| {
            let ids: Vec<i32> = g
                .read_f32(bi, 0, k)
                .iter()
                .map(|v| v.to_bits() as i32)
                .collect();
            (g.read_f32(bl, 0, e), ids, g.read_f32(bw, 0, k))
        };
        let c0 = g.counters();
        g.op_with(ops::ROUTER, prm, &fused);
        let c1 = g.counters();
        let got = read(bl, bi, bw);
        g.op(ops::MATMUL, &[wt, xt, f32_t(bl2, [e, 1, 1])]);
        g.op_with(ops::ROUTER, prm, &head(bl2, bi2, bw2));
        let c2 = g.counters();
        let split = read(bl2, bi2, bw2);
        let key_bits = |r: &(Vec<f32>, Vec<i32>, Vec<f32>)| {
            (
                r.0.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                r.1.clone(),
                r.2.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            )
        };
        let same = key_bits(&got) == key_bits(&split);
        let launches = (
            device_launches(&c0, &c1, "ds4_router_mm"),
            device_launches(&c1, &c2, "ds4_router_mm"),
        );
        // The host: logits in f64, then the selection on the device's logits.
        let mut lerr = 0f64;
        let mut lmax = 0f64;
        for r in 0..e {
            if nan && r == nan_row {
                continue;
            }
            let want: f64 = (0..d).map(|i| wr[r * d + i] as f64 * x[i] as f64).sum();
            lerr = lerr.max((got.0[r] as f64 - want).abs());
            lmax = lmax.max(want.abs());
        }
        let score = |v: f32| -> f64 {
            let v = v as f64;
            if gating == 2 {
                1.0 / (1.0 + (-v).exp())
            } else if v > 20.0 {
                v.sqrt()
            } else {
                v.exp().ln_1p().sqrt()
            }
        };
        let key = |c: usize| -> f64 {
            let s = score(got.0[c]) + if mode == 1 { bias[c] as f64 } else { 0.0 };
            if s.is_nan() {
                f64::NEG_INFINITY
            } else {
                s
            }
        };
        let ids: Vec<usize> = got.1.iter().map(|&c| c as usize).collect();
        let mut sel_ok = ids.iter().all(|&c| c < e);
        if sel_ok && mode == 2 {
            let row = &table[tok as usize * k..(tok as usize + 1) * k];
            sel_ok = row.iter().zip(&got.1).all(|(a, b)| a == b);
        } else if sel_ok {
            let tol = |v: f64| 1e-5 * v.abs().max(1.0);
            let mut uniq = ids.clone();
            uniq.sort();
            uniq.dedup();
            sel_ok = uniq.len() == k
                && ids
                    .windows(2)
                    .all(|w| key(w[0]) >= key(w[1]) - tol(key(w[1])))
                && (0..e)
                    .filter(|c| !ids.contains(c))
                    .all(|u| key(u) <= key(ids[k - 1]) + tol(key(u)))
                && !(nan && ids.contains(&nan_row));
            if twin {
                // Exact ties (a row and its copy): the lower index first when both are in.
                sel_ok &= ids
                    .windows(2)
                    .all(|w| got.0[w[0]] != got.0[w[1]] || w[0] < w[1]);
            }
        }
        let sc: Vec<f64> = ids
            .iter()
            .map(|&c| if c < e { score(got.0[c]) } else { 0.0 })
            .collect();
        let sum: f64 = sc.iter().sum();
        let werr = sc
            .iter()
            .zip(&got.2)
            .map(|(s, w)| {
                ((if norm == 1 { s / (sum + 1e-20) } else { *s }) * 1.5 - *w as f64).abs()
            })
            .fold(0f64, f64::max);
        // Each repeat on outputs overwritten with 0xff bytes (NaN logits and weights, id
        // -1), so a run that selected nothing, or too early, cannot pass; the count is
        // back to zero after each.
        let mut repeat_same = true;
        let poison = |b, n: usize| {
            into_result((g.be.upload)(b, 0, vec![0xffu8; n * 4].as_slice().into())).unwrap()
        };
        for _ in 0..100 {
            poison(bl, e);
            poison(bi, k);
            poison(bw, k);
            g.op_with(ops::ROUTER, prm, &fused);
            repeat_same &= key_bits(&read(bl, bi, bw)) == key_bits(&got);
            repeat_same &= g.read_f32(bsync, 0, 1)[0].to_bits() == 0;
        }
        let lrel = lerr / lmax.max(1e-30);
        let ok =
            same && launches == (1, 0) && lrel <= 1e-5 && sel_ok && werr <= 1e-5 && repeat_same;
        all &= ok;
        println!(
            "{name:<28} same bits {same}, launches {launches:?}, logits {lrel:.2e}, selection {sel_ok}, weights {werr:.2e}, 100 repeats {repeat_same} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"router_mm\",\"case\":\"{name}\",\"bit_identical\":{same},\"logits_rel\":{lrel:.3e},\"weights_err\":{werr:.3e},\"ok\":{ok}}}"
        ));
    }
    all
}

/// x's q8_1 blocks as the mHC site stores them for the routed products (HC_POST_PRE's
/// xq: `q8_1_store` with planes = 1): d = amax / 127, q = round(v / d), each half's
/// values plane-ordered (value 4r + s of a half at position 4s + r), the halves' sums
/// of q.
fn xq_bytes(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for blk in x.chunks_exact(32) {
        let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let q: Vec<i32> = blk.iter().map(|v| (v * inv).round() as i32).collect();
        let mut qs = [0u8; 32];
        for (l, &v) in q.iter().enumerate() {
            qs[(l & 16) | ((l & 3) << 2) | ((l >> 2) & 3)] = v as i8 as u8;
        }
        out.extend(d.to_le_bytes());
        for h in 0..2 {
            out.extend((q[16 * h..16 * h + 16].iter().sum::<i32>() as i16).to_le_bytes());
        }
        out.extend(qs);
    }
    out
}

/// MOE_ROUTED (ABI 1.13: `ds4_moe_routed`, one cooperative launch for one token) against
/// the three ops it stands for (ROUTER with its product, MATMUL_ID_MULTI on xq,
/// SWIGLU_MATMUL_ID), from the same random inputs: logits, ids, weights, gate and up
/// and the down outputs bit for bit (the fused kernel runs the same warps); one launch
/// of `ds4_moe_routed` and none of the three ops' kernels; then 50 more fused runs on
/// outputs overwritten with 0xff bytes, alternating with a second input, each the bits
/// of the three ops on its input (a barrier that let a stage read what another block
/// had not yet written, or what the run before left, would not repeat), and nothing
/// written past any output (1024 guard values after each, checked after all runs).
/// Type-107 experts (affine; two-scale in the second case); cases: V4-Flash's widths
/// (4096, ff 2048, 6 of 16 experts, sqrt-softplus + bias, normalised, clamp 7), 1024 /
/// ff 512 with 4 of 40 by the hash table, and the tiny fixtures' 64 / ff 32 with 2 of 8
/// (by the table, and by the bias). `ds4_session.sh`'s step `routed` runs it again under
/// the A/B switches (`MOE_GPU_MOER_*`, read once a process).
fn moe_routed(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== MOE_ROUTED (one launch) vs ROUTER + MATMUL_ID_MULTI + SWIGLU_MATMUL_ID ==");
    let mut all = true;
    for (name, d, ff, e, k, gating, mode, variant) in [
        (
            "4096, ff 2048, 6 of 16, bias",
            4096usize,
            2048usize,
            16usize,
            6usize,
            4i64,
            1i64,
            FP2_AFFINE,
        ),
        (
            "1024, ff 512, 4 of 40, table, two-scale",
            1024,
            512,
            40,
            4,
            2,
            2,
            FP2_TWO_SCALE,
        ),
        // the tiny fixtures' widths: one q8_1 block a down row (the per-half path)
        (
            "64, ff 32, 2 of 8, hash table",
            64,
            32,
            8,
            2,
            4,
            2,
            FP2_AFFINE,
        ),
        ("64, ff 32, 2 of 8, bias", 64, 32, 8, 2, 4, 1, FP2_AFFINE),
    ] {
        // Two inputs: the repeats alternate them, so a stage that read what the run
        // before left in its buffers (the SwiGLU's q8_1 blocks are scratch) would differ.
        let x: Vec<f32> = (0..d).map(|_| rng.f32()).collect();
        let x2: Vec<f32> = (0..d).map(|_| rng.f32()).collect();
        let wr: Vec<f32> = (0..d * e).map(|_| 0.05 * rng.f32()).collect();
        let bias: Vec<f32> = (0..e).map(|_| 0.1 * rng.f32()).collect();
        let vocab = 8usize;
        let table: Vec<i32> = (0..vocab * k).map(|_| rng.below(e as u64) as i32).collect();
        let i32b = |v: &[i32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let (bx, bwr, bb) = (
            g.buf(&f32_bytes(&x)),
            g.buf(&f32_bytes(&wr)),
            g.buf(&f32_bytes(&bias)),
        );
        let (btab, btok, bxq) = (
            g.buf(&i32b(&table)),
            g.buf(&i32b(&[3])),
            g.buf(&xq_bytes(&x)),
        );
        let (bx2, bxq2) = (g.buf(&f32_bytes(&x2)), g.buf(&xq_bytes(&x2)));
        let (bg, bu, bd) = (
            g.buf(&random_weights(rng, e * ff, d)),
            g.buf(&random_weights(rng, e * ff, d)),
            g.buf(&random_weights(rng, e * d, ff)),
        );
        let it = |b, n: usize| t(b, 0, types::I32, 0, [n as u64, 1, 1, 1]);
        // Per run: logits, ids, weights, gate, up, down, act, sync; each with GUARD
        // values of 0xff bytes after it, which no run may touch.
        const GUARD: usize = 1024;
        let sizes = [e, k, k, ff * k, ff * k, d * k, ff * k, 1];
        let outs = || {
            sizes.map(|n| {
                let mut b = vec![0u8; n * 4];
                b.extend(vec![0xffu8; GUARD * 4]);
                g.buf(&b)
            })
        };
        let guards_kept = |o: &[u64; 8]| {
            o.iter().zip(sizes).all(|(&b, n)| {
                g.read_f32(b, (n * 4) as u64, GUARD)
                    .iter()
                    .all(|v| v.to_bits() == u32::MAX)
            })
        };
        let (fo, so, so2) = (outs(), outs(), outs());
        let router = |o: &[u64; 8], bx| {
            [
                f32_t(o[0], [e, 1, 1]),
                f32_t(bb, [e, 1, 1]),
                t(btab, 0, types::I32, 0, [k as u64, vocab as u64, 1, 1]),
                it(btok, 1),
                it(o[1], k),
                f32_t(o[2], [k, 1, 1]),
                f32_t(bx, [d, 1, 1]),
                f32_t(bwr, [d, e, 1]),
                it(o[7], 1),
            ]
        };
        let w107 = |b, k: usize, m: usize| t(b, 0, 107, variant, [k as u64, m as u64, e as u64, 1]);
        let mut prm = OpParams::default();
        prm.f[..2].copy_from_slice(&[1.5, 7.0]);
        prm.i[..3].copy_from_slice(&[gating, 1, mode]);
        let fused_args = |bx, bxq| {
            let mut a = router(&fo, bx).to_vec();
            a.extend([
                it(bxq, d / 32 * 10),
                w107(bg, d, ff),
                f32_t(fo[3], [ff, k, 1]),
                w107(bu, d, ff),
                f32_t(fo[4], [ff, k, 1]),
                w107(bd, ff, d),
                f32_t(fo[5], [d, k, 1]),
                f32_t(fo[6], [ff, k, 1]),
                it(fo[7], 1),
            ]);
            a
        };
        let (fused, fused2) = (fused_args(bx, bxq), fused_args(bx2, bxq2));
        let read = |o: &[u64; 8]| -> Vec<u32> {
            [
                (o[0], e),
                (o[1], k),
                (o[2], k),
                (o[3], ff * k),
                (o[4], ff * k),
                (o[5], d * k),
            ]
            .iter()
            .flat_map(|&(b, n)| g.read_f32(b, 0, n))
            .map(f32::to_bits)
            .collect()
        };
        let c0 = g.counters();
        g.op_with(ops::MOE_ROUTED, prm, &fused);
        let c1 = g.counters();
        let got = read(&fo);
        // The three ops on another set of outputs.
        let three = |o: &[u64; 8], bx, bxq| {
            let mut rp = OpParams::default();
            rp.f[0] = prm.f[0];
            rp.i[..3].copy_from_slice(&prm.i[..3]);
            g.op_with(ops::ROUTER, rp, &router(o, bx));
            let mut mp = OpParams::default();
            mp.i[0] = 1;
            let ids = it(o[1], k);
            let (sg, su) = (f32_t(o[3], [ff, k, 1]), f32_t(o[4], [ff, k, 1]));
            let xq = it(bxq, d / 32 * 10);
            let x = f32_t(bx, [d, 1, 1]);
            let gu = [x, ids, xq, w107(bg, d, ff), sg, w107(bu, d, ff), su];
            g.op_with(ops::MATMUL_ID_MULTI, mp, &gu);
            let mut sp = OpParams::default();
            sp.f[0] = prm.f[1];
            let (y, act) = (f32_t(o[5], [d, k, 1]), f32_t(o[6], [ff, k, 1]));
            g.op_with(
                ops::SWIGLU_MATMUL_ID,
                sp,
                &[w107(bd, ff, d), sg, su, ids, y, act],
            );
            read(o)
        };
        let want = three(&so, bx, bxq);
        let want2 = three(&so2, bx2, bxq2);
        let same = got == want;
        let launches: Vec<u64> = [
            "ds4_moe_routed",
            "ds4_router_mm",
            "mmvq_id_107",
            "quantize_q8_1_swiglu",
        ]
        .iter()
        .map(|n| device_launches(&c0, &c1, n))
        .collect();
        // The chosen experts are distinct and in range (a choice of nothing would repeat).
        let chosen: Vec<i32> = got[e..e + k].iter().map(|&v| v as i32).collect();
        let distinct = chosen.iter().all(|&c| (0..e as i32).contains(&c))
            && (mode == 2 || (1..k).all(|i| !chosen[..i].contains(&chosen[i])));
        let mut repeat_same = true;
        for i in 0..50 {
            for (b, n) in [
                (fo[0], e),
                (fo[1], k),
                (fo[2], k),
                (fo[3], ff * k),
                (fo[4], ff * k),
                (fo[5], d * k),
            ] {
                into_result((g.be.upload)(b, 0, vec![0xffu8; n * 4].as_slice().into())).unwrap();
            }
            let (args, expect) = if i % 2 == 0 {
                (&fused2, &want2)
            } else {
                (&fused, &got)
            };
            g.op_with(ops::MOE_ROUTED, prm, args);
            repeat_same &= read(&fo) == *expect;
        }
        let guards = guards_kept(&fo) && guards_kept(&so) && guards_kept(&so2);
        let ok = same && launches == [1, 0, 0, 0] && distinct && repeat_same && guards;
        all &= ok;
        println!(
            "{name:<36} same bits {same}, launches (fused, router, mmvq_id, swiglu q8) {launches:?}, experts {chosen:?}, 50 repeats {repeat_same}, nothing written past the outputs {guards} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"moe_routed\",\"case\":\"{name}\",\"bit_identical\":{same},\"repeats_same\":{repeat_same},\"guards_kept\":{guards},\"ok\":{ok}}}"
        ));
        for b in [bx, bx2, bwr, bb, btab, btok, bxq, bxq2, bg, bu, bd]
            .into_iter()
            .chain(fo)
            .chain(so)
            .chain(so2)
        {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    all
}

/// HC_POST_PRE for one token with its blocks waiting for each other (gsync) against the
/// last-block form, from the same random inputs: the streams after the post and the
/// weights bit for bit, x within 1e-5 of its largest value (only its norm's sum
/// differs: the Gram matrix against the sum of squares); then the gsync form again 200
/// times, each bit-identical to the first (a barrier that let a block read a share
/// before it was written would not repeat), and the last-block form once more (on a
/// counter whose generation bits are now set): bit-identical to its first run. Each run
/// must launch `ds4_hc_post_pre` once. V4-Flash's width (d 4096, 4 streams: 32 blocks)
/// with no post (the streams kept), a block's output, the MoE's outputs, and the output
/// head (pre only); 1, 2 and 3 streams (8, 4 and 8 blocks; d 1000 ends mid-block).
fn hc_post_pre_gsync(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== HC_POST_PRE, blocks waiting for each other vs the last block ==");
    let k = 6usize;
    let mut all = true;
    for (name, d, hc, head, post) in [
        ("4 x 4096, no post", 4096usize, 4usize, false, 0),
        ("4 x 4096, block post", 4096, 4, false, 1),
        ("4 x 4096, MoE post", 4096, 4, false, 2),
        ("4 x 4096, head", 4096, 4, true, 1),
        ("1 x 4096, MoE post", 4096, 1, false, 2),
        ("2 x 1000, MoE post", 1000, 2, false, 2),
        ("3 x 1000, block post", 1000, 3, false, 1),
    ] {
        let site_nm = 2 * hc + hc * hc;
        let nm = if head { hc } else { site_nm };
        let mut v = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| s * rng.f32()).collect() };
        let streams = v(d * hc, 1.0);
        let fnw = v(hc * d * nm, 0.02);
        let scale = v(if head { 1 } else { 3 }, 1.0);
        let base = v(nm, 1.0);
        let norm_w: Vec<f32> = v(d, 0.5).iter().map(|x| 1.0 + x).collect();
        // The previous site's weights as the post reads them: pre, post, comb >= 0.
        let wts: Vec<f32> = v(site_nm, 1.0).iter().map(|x| x.abs()).collect();
        let (block, y, rw, shared) = (v(d, 1.0), v(d * k, 1.0), v(k, 1.0), v(d, 1.0));
        let b = |x: &[f32]| g.buf(&f32_bytes(x));
        let (bs, bf, bsc, bb, bn) = (b(&streams), b(&fnw), b(&scale), b(&base), b(&norm_w));
        let (bo, bw, bm, by) = (g.zeros(d * 4), b(&wts), g.zeros(nm * 4), g.zeros(4));
        let (bblk, byy, brw, bsh) = (b(&block), b(&y), b(&rw), b(&shared));
        let f = f32_t;
        let mut args = vec![
            f(bs, [d, hc, 1]),
            f(bf, [hc * d, nm, 1]),
            f(bsc, [if head { 1 } else { 3 }, 1, 1]),
            f(bb, [nm, 1, 1]),
            f(bn, [d, 1, 1]),
            f(bo, [d, 1, 1]),
            f(bw, [site_nm, 1, 1]),
            f(bm, [nm, 1, 1]),
            t(by, 0, types::I32, 0, [1, 1, 1, 1]),
        ];
        match post {
            1 => args.push(f(bblk, [d, 1, 1])),
            2 => args.extend([f(byy, [d, k, 1]), f(brw, [k, 1, 1]), f(bsh, [d, 1, 1])]),
            _ => {}
        }
        let mut prm = OpParams::default();
        prm.f[0] = 1e-6;
        prm.f[1] = 1e-6;
        prm.i = [20, head as i64, 0, 0, 0, 0, 0, 0];
        // One run from the inputs above: (streams, x, weights) after it; counts the
        // runs that did not launch `ds4_hc_post_pre` exactly once in `stray`.
        let stray = std::cell::Cell::new(0u32);
        let run = |force: u8| {
            FORCE_HC_GSYNC.store(force, Ordering::Relaxed);
            into_result((g.be.upload)(bs, 0, f32_bytes(&streams).as_slice().into())).unwrap();
            into_result((g.be.upload)(bw, 0, f32_bytes(&wts).as_slice().into())).unwrap();
            let before = g.counters();
            g.op_with(ops::HC_POST_PRE, prm, &args);
            let out = (
                g.read_f32(bs, 0, d * hc),
                g.read_f32(bo, 0, d),
                g.read_f32(bw, 0, nm),
            );
            if device_launches(&before, &g.counters(), "ds4_hc_post_pre") != 1 {
                stray.set(stray.get() + 1);
            }
            FORCE_HC_GSYNC.store(0, Ordering::Relaxed);
            out
        };
        let last = run(2);
        let first = run(1);
        let xmax = last.1.iter().fold(0f32, |m, x| m.max(x.abs()));
        let xdiff = last
            .1
            .iter()
            .zip(&first.1)
            .fold(0f32, |m, (p, q)| m.max((p - q).abs()))
            / xmax;
        let same = same_bits(&last.0, &first.0) && same_bits(&last.2, &first.2);
        let same3 = |a: &(Vec<f32>, Vec<f32>, Vec<f32>), b: &(Vec<f32>, Vec<f32>, Vec<f32>)| {
            same_bits(&a.0, &b.0) && same_bits(&a.1, &b.1) && same_bits(&a.2, &b.2)
        };
        let repeats = (0..200).all(|_| same3(&run(1), &first)) && same3(&run(2), &last);
        let ok = same && xdiff <= 1e-5 && repeats && xmax > 0.0 && stray.get() == 0;
        all &= ok;
        println!(
            "{name:<21}: streams + weights bit-identical {same}, x max rel diff {xdiff:.2e}, 200 repeats bit-identical {repeats} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"hc_post_pre_gsync\",\"case\":\"{name}\",\"same\":{same},\"x_rel\":{xdiff:e},\"repeats\":{repeats},\"ok\":{ok}}}"
        ));
        for buf in [bs, bf, bsc, bb, bn, bo, bw, bm, by, bblk, byy, brw, bsh] {
            into_result((g.be.free)(buf)).unwrap();
        }
    }
    all
}

/// One token's mHC site at V4-Flash's width (d 4096, 4 streams) with a block's output
/// as its post: random inputs, kept on the host to put back between runs (a site
/// updates its streams and weights in place), and their device buffers.
struct SiteInputs {
    d: usize,
    hc: usize,
    nm: usize,
    streams: Vec<f32>,
    wts: Vec<f32>,
    /// streams, fn, scale, base, norm, out, weights, mixes, sync word, block output
    bufs: [u64; 10],
}

impl SiteInputs {
    fn new(g: &Gpu, rng: &mut Rng) -> Self {
        let (d, hc) = (4096usize, 4usize);
        let nm = 2 * hc + hc * hc;
        let mut v = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| s * rng.f32()).collect() };
        let streams = v(d * hc, 1.0);
        let fnw = v(hc * d * nm, 0.02);
        let (scale, base, block) = (v(3, 1.0), v(nm, 1.0), v(d, 1.0));
        let norm_w: Vec<f32> = v(d, 0.5).iter().map(|x| 1.0 + x).collect();
        let wts: Vec<f32> = v(nm, 1.0).iter().map(|x| x.abs()).collect();
        let b = |x: &[f32]| g.buf(&f32_bytes(x));
        let bufs = [
            b(&streams),
            b(&fnw),
            b(&scale),
            b(&base),
            b(&norm_w),
            g.zeros(d * 4),
            b(&wts),
            g.zeros(nm * 4),
            g.zeros(4),
            b(&block),
        ];
        Self {
            d,
            hc,
            nm,
            streams,
            wts,
            bufs,
        }
    }

    /// The site's out (x).
    fn out(&self) -> u64 {
        self.bufs[5]
    }

    /// HC_POST_PRE's ten arguments for a width of `dd` (at most d) values.
    fn args(&self, dd: usize) -> Vec<TensorRef> {
        let (hc, nm, b) = (self.hc, self.nm, &self.bufs);
        let f = f32_t;
        vec![
            f(b[0], [dd, hc, 1]),
            f(b[1], [hc * dd, nm, 1]),
            f(b[2], [3, 1, 1]),
            f(b[3], [nm, 1, 1]),
            f(b[4], [dd, 1, 1]),
            f(b[5], [dd, 1, 1]),
            f(b[6], [nm, 1, 1]),
            f(b[7], [nm, 1, 1]),
            t(b[8], 0, types::I32, 0, [1, 1, 1, 1]),
            f(b[9], [dd, 1, 1]),
        ]
    }

    /// The streams and weights as they were made.
    fn reset(&self, g: &Gpu) {
        into_result((g.be.upload)(
            self.bufs[0],
            0,
            f32_bytes(&self.streams).as_slice().into(),
        ))
        .unwrap();
        into_result((g.be.upload)(
            self.bufs[6],
            0,
            f32_bytes(&self.wts).as_slice().into(),
        ))
        .unwrap();
    }

    fn free(&self, g: &Gpu) {
        for buf in self.bufs {
            into_result((g.be.free)(buf)).unwrap();
        }
    }
}

/// HC_POST_PRE's routing (ABI 1.11) against the same site then ROUTER with its product:
/// one token at V4-Flash's width (d 4096, 4 streams, 256 experts top 6, sqrt-softplus
/// scores with a selection bias). The site's blocks route themselves (gsync: no router
/// launch): x the same bits, the logits within 1e-5 of the largest (another summation
/// order), the same experts, weights within 1e-5. The last-block form runs the router's
/// own launch after the site: its x, logits, experts and weights the same bits as the
/// last-block site then ROUTER.
fn hc_route(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== HC_POST_PRE's routing vs the site, then ROUTER with its product ==");
    let site = SiteInputs::new(g, rng);
    let (d, e, k) = (site.d, 256usize, 6usize);
    let mut v = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| s * rng.f32()).collect() };
    let (wr, bias) = (v(d * e, 0.05), v(e, 0.01));
    let b = |x: &[f32]| g.buf(&f32_bytes(x));
    let bo = site.out();
    let (bwr, bbias, blog, bids, brw, btok, brs) = (
        b(&wr),
        b(&bias),
        g.zeros(e * 4),
        g.zeros(k * 4),
        g.zeros(k * 4),
        g.zeros(4),
        g.zeros(4),
    );
    let f = f32_t;
    let i32t = |buf, n: usize| t(buf, 0, types::I32, 0, [n as u64, 1, 1, 1]);
    let router_args = [
        f(blog, [e, 1, 1]),
        f(bbias, [e, 1, 1]),
        i32t(btok, 1),
        i32t(btok, 1),
        i32t(bids, k),
        f(brw, [k, 1, 1]),
        f(bo, [d, 1, 1]),
        f(bwr, [d, e, 1]),
        i32t(brs, 1),
    ];
    // ROUTER's params: routed scale 1.5; sqrt-softplus, normalised, the bias's selection.
    let (scale_r, router_i) = (1.5f32, [4i64, 1, 1]);
    // One site (and its routing): x, logits, ids, weights and (site, router) launches.
    let run = |force: u8, in_site: bool| {
        FORCE_HC_GSYNC.store(force, Ordering::Relaxed);
        site.reset(g);
        let before = g.counters();
        let mut a = site.args(d);
        let mut prm = OpParams::default();
        prm.f[0] = 1e-6;
        prm.f[1] = 1e-6;
        prm.i[0] = 20;
        if in_site {
            a.extend(router_args);
            prm.i[4] = 1;
            prm.f[2] = scale_r;
            prm.i[5..8].copy_from_slice(&router_i);
            g.op_with(ops::HC_POST_PRE, prm, &a);
        } else {
            g.op_with(ops::HC_POST_PRE, prm, &a);
            let mut rp = OpParams::default();
            rp.f[0] = scale_r;
            rp.i[..3].copy_from_slice(&router_i);
            g.op_with(ops::ROUTER, rp, &router_args);
        }
        let x = g.read_f32(bo, 0, d);
        let logits = g.read_f32(blog, 0, e);
        let ids: Vec<u32> = g.read_f32(bids, 0, k).iter().map(|v| v.to_bits()).collect();
        let w = g.read_f32(brw, 0, k);
        let after = g.counters();
        FORCE_HC_GSYNC.store(0, Ordering::Relaxed);
        let n = |name: &str| device_launches(&before, &after, name);
        (
            x,
            logits,
            ids,
            w,
            (n("ds4_hc_post_pre"), n("ds4_router_mm")),
        )
    };
    let mut all = true;
    for (form, force, want) in [("gsync", 1u8, (1u64, 0u64)), ("last block", 2, (1, 1))] {
        // The reference: the same form of the site, then ROUTER (the two forms' x differ
        // in the last bits: the block post's sums run in another order).
        let (x0, l0, i0, w0, base_launches) = run(force, false);
        all &= base_launches == (1, 1);
        let (x1, l1, i1, w1, launches) = run(force, true);
        let x_same = same_bits(&x0, &x1);
        let big = l0.iter().fold(0f32, |m, v| m.max(v.abs()));
        let dl = l0
            .iter()
            .zip(&l1)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / big;
        let dw = w0
            .iter()
            .zip(&w1)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        let exact = same_bits(&l0, &l1) && same_bits(&w0, &w1);
        // The routing in the site sums in another order; the router's launch is ROUTER.
        let close = if force == 1 {
            dl <= 1e-5 && dw <= 1e-5
        } else {
            exact
        };
        let ok = x_same && close && i0 == i1 && launches == want;
        all &= ok;
        println!(
            "{form:<10}: x bit-identical {x_same}, logits {dl:.2e} of the largest ({big:.3}), experts {i1:?} (ROUTER's {i0:?}), weights {dw:.2e}, launches (site, router) {launches:?} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"hc_route\",\"case\":\"{form}\",\"logits_rel\":{dl:e},\"weights\":{dw:e},\"same_experts\":{},\"ok\":{ok}}}",
            i0 == i1
        ));
    }
    for buf in [bwr, bbias, blog, bids, brw, btok, brs] {
        into_result((g.be.free)(buf)).unwrap();
    }
    site.free(g);
    all
}

/// HC_POST_PRE's xq (ABI 1.10) read by MATMUL_ID_MULTI: one token at V4-Flash's width
/// (d 4096, 4 streams, a block's output as the post), in both forms (gsync: the site's
/// blocks store xq, no quantising launch; the last-block form: one `quantize_q8_1` after
/// it). x must be the same bits as without xq, and the routed gate + up products read
/// from xq (no `quantize_q8_1`, one `mmvq_id_107`) the same bits as those that quantise
/// x themselves. d = 1000 (not whole q8_1 blocks) with xq must fail, naming the width.
fn hc_xq(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== HC_POST_PRE's xq read by MATMUL_ID_MULTI vs its own quantisation ==");
    let inputs = SiteInputs::new(g, rng);
    let (d, m, experts, slots) = (inputs.d, 2048usize, 16usize, 6usize);
    let (bo, bq) = (inputs.out(), g.zeros(d * 2));
    let site = |dd: usize, with_xq: bool| {
        let mut a = inputs.args(dd);
        if with_xq {
            a.push(t(bq, 0, types::I32, 0, [(dd / 2) as u64, 1, 1, 1]));
        }
        let mut prm = OpParams::default();
        prm.f[0] = 1e-6;
        prm.f[1] = 1e-6;
        prm.i = [20, 0, 0, with_xq as i64, 0, 0, 0, 0];
        (prm, a)
    };
    // One site from the inputs above: x and the launches of (the site, quantize_q8_1).
    let run_site = |force: u8, with_xq: bool| {
        FORCE_HC_GSYNC.store(force, Ordering::Relaxed);
        inputs.reset(g);
        let before = g.counters();
        let (prm, a) = site(d, with_xq);
        g.op_with(ops::HC_POST_PRE, prm, &a);
        let x = g.read_f32(bo, 0, d);
        let after = g.counters();
        FORCE_HC_GSYNC.store(0, Ordering::Relaxed);
        let n = |k: &str| device_launches(&before, &after, k);
        (x, (n("ds4_hc_post_pre"), n("quantize_q8_1")))
    };
    let (w1, w2) = (
        random_weights(rng, experts * m, d),
        random_weights(rng, experts * m, d),
    );
    let (bw1, bw2) = (g.buf(&w1), g.buf(&w2));
    let ids: Vec<u8> = [3i32, 11, -1, 0, 15, 7]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bi = g.buf(&ids);
    let outs: Vec<u64> = (0..4).map(|_| g.zeros(m * slots * 4)).collect();
    let shape = [d, m, experts, slots, 1, 1];
    let mut all = true;
    for (form, force, site_quant) in [("gsync", 1u8, 0u64), ("last block", 2, 1)] {
        let (x0, _) = run_site(force, false);
        let (x1, launches) = run_site(force, true);
        let x_same = same_bits(&x0, &x1);
        let [a1, x, i1, o1] = id_args([bw1, bo, bi, outs[0]], (107, FP2_AFFINE), shape);
        let [a2, _, _, o2] = id_args([bw2, bo, bi, outs[1]], (107, FP2_AFFINE), shape);
        g.op(ops::MATMUL_ID_MULTI, &[x, i1, a1, o1, a2, o2]);
        let [_, _, _, o3] = id_args([bw1, bo, bi, outs[2]], (107, FP2_AFFINE), shape);
        let [_, _, _, o4] = id_args([bw2, bo, bi, outs[3]], (107, FP2_AFFINE), shape);
        let xq = t(bq, 0, types::I32, 0, [(d / 2) as u64, 1, 1, 1]);
        let mut prm = OpParams::default();
        prm.i[0] = 1;
        let before = g.counters();
        g.op_with(ops::MATMUL_ID_MULTI, prm, &[x, i1, xq, a1, o3, a2, o4]);
        let after = g.counters();
        let mm = (
            device_launches(&before, &after, "quantize_q8_1"),
            device_launches(&before, &after, "mmvq_id_107"),
        );
        let read = |o: u64| g.read_f32(o, 0, m * slots);
        let same =
            same_bits(&read(outs[0]), &read(outs[2])) && same_bits(&read(outs[1]), &read(outs[3]));
        let ok = x_same && same && launches == (1, site_quant) && mm == (0, 1);
        all &= ok;
        println!(
            "{form:<10}: x bit-identical {x_same}, products bit-identical {same}, launches (site, quantize) {launches:?}, products' (quantize, grouped) {mm:?} {}",
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"hc_xq\",\"case\":\"{form}\",\"x_same\":{x_same},\"same\":{same},\"ok\":{ok}}}"
        ));
    }
    // Not whole q8_1 blocks: a clear error, nothing launched.
    let (prm, a) = site(1000, true);
    let err = into_result((g.be.run_op)(
        g.stream,
        ops::HC_POST_PRE,
        prm,
        a.as_slice().into(),
    ));
    let refused = matches!(&err, Err(e) if e.to_string().contains("multiple of 32"));
    all &= refused;
    println!(
        "d = 1000 with xq: refused {refused} ({}) {}",
        err.err().map(|e| e.to_string()).unwrap_or_default(),
        if refused { "ok" } else { "FAIL" }
    );
    for buf in [bq, bw1, bw2, bi].into_iter().chain(outs) {
        into_result((g.be.free)(buf)).unwrap();
    }
    inputs.free(g);
    all
}

/// One head's attention in f64 into `o` (zeroed): softmax over `keys` (K = V) of the
/// scaled logits of `q` with the sink's logit, the values weighed.
fn attend_f64(q: &[f64], keys: &[&[f32]], sink: f32, scale: f32, o: &mut [f64]) {
    let lg: Vec<f64> = keys
        .iter()
        .map(|k| scale as f64 * q.iter().zip(*k).map(|(a, &b)| a * b as f64).sum::<f64>())
        .collect();
    let mx = lg.iter().fold(sink as f64, |m, &x| m.max(x));
    let den = (sink as f64 - mx).exp() + lg.iter().map(|x| (x - mx).exp()).sum::<f64>();
    for (k, x) in keys.iter().zip(&lg) {
        let e = (x - mx).exp() / den;
        for (oi, &ki) in o.iter_mut().zip(*k) {
            *oi += e * ki as f64;
        }
    }
}

/// One decode step's SPARSE_ATTENTION (DeepSeek-V4's, one shared K=V head, sink logits,
/// q's norm + rotary and the output's inverse rotary inside) against an f64 reference
/// written from the op's definition: with the sync words (ABI 1.5) and the one-launch
/// form forced on (`MOE_GPU_ATT_DEC=1` in the engine) it must launch `ds4_attention_dec`
/// once (keys split over blocks, merged in the same launch), without them
/// `ds4_attention` (a block a head); with the sync words after an inv_freq of no values
/// (no rotary) and not forced, `ds4_attention_heads` over key splits then
/// `ds4_attention_merge` (against the reference without rotaries); with the grouped form
/// forced on and no hint, `ds4_attention_grp` once (four heads a block over key splits,
/// the last block of a group merging; `MOE_GPU_ATT_GRP=1` in the engine). All within
/// 1e-5 of the largest reference value; 50 reruns of the one-launch and grouped forms
/// bit-identical (their words reused); the token's row stored in the ring. Cases: V4-Flash widths (64 heads x 512, window 128,
/// 64 rotated values) at position 520 with every compressed row (258 keys), at 131071
/// with the indexer's 512 selected (some -1 or past the rows), at 131071 with 1024 rows
/// of ratio 128, at position 5 (7 keys), and 20 heads x 128 with the window only.
fn attention_decode(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== SPARSE_ATTENTION, one decode step, vs f64 reference ==");
    let mut all = true;
    for (name, heads, hd, window, pairs, p, mode, ratio, cap, k_sel) in [
        (
            "64 x 512, p 520, rows",
            64usize,
            512usize,
            128usize,
            32usize,
            520usize,
            1i64,
            4usize,
            200usize,
            0usize,
        ),
        (
            "64 x 512, p 131071, 512 selected",
            64,
            512,
            128,
            32,
            131071,
            2,
            4,
            32768,
            512,
        ),
        (
            "64 x 512, p 131071, ratio 128",
            64,
            512,
            128,
            32,
            131071,
            1,
            128,
            1024,
            0,
        ),
        ("64 x 512, p 5", 64, 512, 128, 32, 5, 1, 4, 40, 0),
        ("20 x 128, window only", 20, 128, 16, 8, 100, 0, 4, 1, 0),
    ] {
        let mut v = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.f32()).collect() };
        let (q, kv, ring, rows, sinks) =
            (v(hd * heads), v(hd), v(hd * window), v(hd * cap), v(heads));
        let sel: Vec<i32> = (0..k_sel.max(1))
            .map(|j| match j % 50 {
                7 => -1,
                9 => (cap + 3) as i32, // past the rows: skipped
                _ => rng.below(cap as u64) as i32,
            })
            .collect();
        let inv: Vec<f32> = (0..pairs)
            .map(|k| 10000f32.powf(-(k as f32) / pairs as f32))
            .collect();
        let (scale, eps, mscale) = (1.0 / (hd as f32).sqrt(), 1e-6f32, 0.9f32);
        // Reference: q normed and rotated (the angle p * f rounded to f32, as the kernels
        // take it), softmax over the keys with the sink, the output inverse-rotated.
        let tail = hd - 2 * pairs;
        let rot = |x: &mut [f64], inverse: bool| {
            for k in 0..pairs {
                let ang = (p as f32 * inv[k]) as f64;
                let (c, mut sn) = (ang.cos() * mscale as f64, ang.sin() * mscale as f64);
                if inverse {
                    sn = -sn;
                }
                let (a, b) = (x[tail + 2 * k], x[tail + 2 * k + 1]);
                x[tail + 2 * k] = a * c - b * sn;
                x[tail + 2 * k + 1] = b * c + a * sn;
            }
        };
        let mut keys: Vec<&[f32]> = (p.saturating_sub(window - 1)..=p)
            .map(|qp| {
                if qp == p {
                    &kv[..]
                } else {
                    &ring[(qp % window) * hd..(qp % window + 1) * hd]
                }
            })
            .collect();
        match mode {
            1 => keys.extend((0..((p + 1) / ratio).min(cap)).map(|r| &rows[r * hd..(r + 1) * hd])),
            2 => keys.extend(
                sel.iter()
                    .filter(|&&r| r >= 0 && (r as usize) < cap)
                    .map(|&r| &rows[r as usize * hd..(r as usize + 1) * hd]),
            ),
            _ => {}
        }
        // With `rope` q's norm + rotary and the output's inverse rotary, else neither.
        let reference = |rope: bool| -> Vec<f64> {
            let mut want = vec![0f64; hd * heads];
            for h in 0..heads {
                let qh = &q[h * hd..(h + 1) * hd];
                let ms = qh.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / hd as f64;
                let r = if rope {
                    1.0 / (ms + eps as f64).sqrt()
                } else {
                    1.0
                };
                let mut qn: Vec<f64> = qh.iter().map(|&x| x as f64 * r).collect();
                if rope {
                    rot(&mut qn, false);
                }
                let o = &mut want[h * hd..(h + 1) * hd];
                attend_f64(&qn, &keys, sinks[h], scale, o);
                if rope {
                    rot(o, true);
                }
            }
            want
        };
        let (want, want_plain) = (reference(true), reference(false));
        let b = |x: &[f32]| g.buf(&f32_bytes(x));
        let i32b = |x: &[i32]| g.buf(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let (bq, bkv, bring, brows, bsk, binv) =
            (b(&q), b(&kv), b(&ring), b(&rows), b(&sinks), b(&inv));
        let (bsel, bpos, bout) = (i32b(&sel), i32b(&[p as i32]), g.zeros(hd * heads * 4));
        let words = ops::sparse_attention_sync_words(heads as u64) as usize;
        let bsync = g.zeros(words * 4);
        let f = f32_t;
        let mut args = vec![
            f(bq, [hd, heads, 1]),
            f(bkv, [hd, 1, 1]),
            f(bring, [hd, window, 1]),
            f(brows, [hd, cap, 1]),
            t(bsel, 0, types::I32, 0, [k_sel.max(1) as u64, 1, 1, 1]),
            f(bsk, [heads, 1, 1]),
            t(bpos, 0, types::I32, 0, [1, 1, 1, 1]),
            f(bout, [hd, heads, 1]),
            f(binv, [pairs, 1, 1]),
        ];
        let mut prm = OpParams::default();
        prm.f[..3].copy_from_slice(&[scale, eps, mscale]);
        // (the long-context hint at every position: the one-launch form is the split one)
        prm.i[..4].copy_from_slice(&[ratio as i64, mode, pairs as i64, 1]);
        // The ring as the op leaves it: the token's row at p % window, the rest as given.
        let mut ring_want = ring.clone();
        ring_want[(p % window) * hd..(p % window + 1) * hd].copy_from_slice(&kv);
        let run = |args: &[TensorRef], prm: OpParams| {
            into_result((g.be.upload)(bring, 0, f32_bytes(&ring).as_slice().into())).unwrap();
            let before = g.counters();
            g.op_with(ops::SPARSE_ATTENTION, prm, args);
            let out = g.read_f32(bout, 0, hd * heads);
            let stored = same_bits(&g.read_f32(bring, 0, hd * window), &ring_want);
            let after = g.counters();
            let n = |k: &str| device_launches(&before, &after, k);
            (
                out,
                stored,
                n("ds4_attention_dec"),
                n("ds4_attention") + 100 * n("ds4_attention_grp"),
                (n("ds4_attention_heads"), n("ds4_attention_merge")),
            )
        };
        let head = run(&args, prm);
        args.push(t(bsync, 0, types::I32, 0, [words as u64, 1, 1, 1]));
        FORCE_ATT_DEC.store(true, Ordering::Relaxed); // (opt-in in the engine)
        let dec = run(&args, prm);
        let repeats = (0..50).all(|_| same_bits(&run(&args, prm).0, &dec.0));
        FORCE_ATT_DEC.store(false, Ordering::Relaxed);
        // Four heads a block over key splits (no long-context hint; opt-in in the
        // engine), its counts in the words after the one-launch form's.
        let mut short = prm;
        short.i[3] = 0;
        FORCE_ATT_GRP.store(true, Ordering::Relaxed);
        let grp = run(&args, short);
        let grp_repeats = (0..50).all(|_| same_bits(&run(&args, short).0, &grp.0));
        FORCE_ATT_GRP.store(false, Ordering::Relaxed);
        // Without the rotaries (an inv_freq of no values before the sync words) and not
        // forced: the heads kernel over key splits, then ds4_attention_merge.
        args[8] = t(binv, 0, types::F32, 0, [0, 1, 1, 1]);
        let split = run(&args, prm);
        let (e_dec, e_head) = (rel(&dec.0, &want), rel(&head.0, &want));
        let (e_split, e_grp) = (rel(&split.0, &want_plain), rel(&grp.0, &want));
        let launches = (dec.2, dec.3, dec.4) == (1, 0, (0, 0))
            && (head.2, head.3) == (0, 1)
            && (split.2, split.3, split.4) == (0, 0, (1, 1))
            && (grp.2, grp.3, grp.4) == (0, 100, (0, 0));
        let stored = dec.1 && head.1 && split.1 && grp.1;
        let repeats = repeats && grp_repeats;
        let ok = e_dec.max(e_head).max(e_split).max(e_grp) <= 1e-5 && repeats && stored && launches;
        all &= ok;
        println!(
            "{name:<34}: {:>4} keys, one launch {e_dec:.2e}, block a head {e_head:.2e}, splits + merge (no rotary) {e_split:.2e}, 4 heads a block {e_grp:.2e}, 50 reruns bit-identical {repeats}, ring stored {}, launches {} {}",
            keys.len(),
            stored,
            if launches { "as expected" } else { "WRONG" },
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"attention_decode\",\"case\":\"{name}\",\"keys\":{},\"dec_rel\":{e_dec:e},\"head_rel\":{e_head:e},\"split_rel\":{e_split:e},\"grp_rel\":{e_grp:e},\"repeats\":{repeats},\"launches\":{launches},\"ok\":{ok}}}",
            keys.len()
        ));
        for buf in [bq, bkv, bring, brows, bsk, binv, bsel, bpos, bout, bsync] {
            into_result((g.be.free)(buf)).unwrap();
        }
    }
    all
}

/// SPARSE_ATTENTION for a prefill chunk (no rotaries: the heads kernels) against an f64
/// reference: each token's window (older positions from the ring, the chunk's own from
/// kv), then the compressed rows (all visible ones, or its selection with unused -1s and
/// entries past the rows), softmax with the sink. `ds4_attention_heads` (two heads a
/// warp), `ds4_attention_heads4` (four a warp, its staging a pipeline) and
/// `ds4_attention_tc` (the tensor cores, three TF32 products a pair), each within 1e-5
/// of the largest value, the latter two the same bits over 20 reruns; and
/// `ds4_attention_tc_bf16` (forced) within 2^-8 of a reference of bf16-rounded queries
/// and keys (its softmax weights are rounded too) and 1e-2 of the largest f32 value,
/// the same bits over 20 reruns; where the head width is not a multiple of 32 (the
/// 48-wide case) the forced bf16 form falls back to the f32 kernel.
fn attention_prefill(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== SPARSE_ATTENTION, a prefill chunk, vs f64 reference ==");
    let mut all = true;
    // (name, heads, hd, window, n, p0, mode, ratio, cap, k_sel)
    for (name, heads, hd, window, n, p0, mode, ratio, cap, k_sel) in [
        (
            "64 x 512, 40 tokens at 300, 72 selected",
            64usize,
            512usize,
            128usize,
            40usize,
            300usize,
            2i64,
            4usize,
            200usize,
            72usize,
        ),
        (
            "64 x 512, 24 tokens at 700, ratio 4",
            64,
            512,
            128,
            24,
            700,
            1,
            4,
            150,
            0,
        ),
        (
            "64 x 512, 20 tokens at 131000, 512 of 32768 rows",
            64,
            512,
            128,
            20,
            131000,
            2,
            4,
            32768,
            512,
        ),
        (
            "40 x 256, 33 tokens at 0, window only",
            40,
            256,
            16,
            33,
            0,
            0,
            4,
            1,
            0,
        ),
        // Narrow heads: a key's 12 float4s (fewer than its 16 stagers), and 24 (not a
        // multiple of 16); 48 is not a multiple of 32, so bf16 falls back to f32.
        (
            "16 x 48, 24 tokens at 40, ratio 4",
            16,
            48,
            16,
            24,
            40,
            1,
            4,
            30,
            0,
        ),
        (
            "8 x 96, 20 tokens at 100, 24 selected",
            8,
            96,
            32,
            20,
            100,
            2,
            4,
            60,
            24,
        ),
    ] {
        let mut v = |k: usize| -> Vec<f32> { (0..k).map(|_| rng.f32()).collect() };
        let (q, kv, ring, rows, sinks) = (
            v(hd * heads * n),
            v(hd * n),
            v(hd * window),
            v(hd * cap),
            v(heads),
        );
        // (one entry a token where none is selected: the op's [k, n] shape needs k >= 1)
        let sel: Vec<i32> = (0..k_sel.max(1) * n)
            .map(|j| match j % 37 {
                5 => -1,
                11 => (cap + 2) as i32, // past the rows: skipped
                _ => rng.below(cap as u64) as i32,
            })
            .collect();
        let scale = 1.0 / (hd as f32).sqrt();
        // The f64 reference of (q, kv, ring, rows), closed over the rest.
        let reference = |q: &[f32], kv: &[f32], ring: &[f32], rows: &[f32]| -> Vec<f64> {
            let mut want = vec![0f64; hd * heads * n];
            for t in 0..n {
                let p = p0 + t;
                let mut keys: Vec<&[f32]> = (p.saturating_sub(window - 1)..=p)
                    .map(|qp| {
                        if qp >= p0 {
                            &kv[(qp - p0) * hd..(qp - p0 + 1) * hd]
                        } else {
                            &ring[(qp % window) * hd..(qp % window + 1) * hd]
                        }
                    })
                    .collect();
                match mode {
                    1 => keys.extend(
                        (0..((p + 1) / ratio).min(cap)).map(|r| &rows[r * hd..(r + 1) * hd]),
                    ),
                    2 => keys.extend(
                        sel[t * k_sel..(t + 1) * k_sel]
                            .iter()
                            .filter(|&&r| r >= 0 && (r as usize) < cap)
                            .map(|&r| &rows[r as usize * hd..(r as usize + 1) * hd]),
                    ),
                    _ => {}
                }
                for h in 0..heads {
                    let qh = &q[(t * heads + h) * hd..(t * heads + h + 1) * hd];
                    let qf: Vec<f64> = qh.iter().map(|&x| x as f64).collect();
                    let o = &mut want[(t * heads + h) * hd..(t * heads + h + 1) * hd];
                    attend_f64(&qf, &keys, sinks[h], scale, o);
                }
            }
            want
        };
        let want = reference(&q, &kv, &ring, &rows);
        // The bf16 form's: queries and keys rounded as the kernel rounds them.
        let r16 = bf16_rounded;
        let want16 = reference(&r16(&q), &r16(&kv), &r16(&ring), &r16(&rows));
        let b = |x: &[f32]| g.buf(&f32_bytes(x));
        let i32b = |x: &[i32]| g.buf(&x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>());
        let pos: Vec<i32> = (0..n).map(|t| (p0 + t) as i32).collect();
        let (bq, bkv, bring, brows, bsk) = (b(&q), b(&kv), b(&ring), b(&rows), b(&sinks));
        let (bsel, bpos, bout) = (i32b(&sel), i32b(&pos), g.zeros(hd * heads * n * 4));
        let f = f32_t;
        let args = [
            f(bq, [hd, heads, n]),
            f(bkv, [hd, n, 1]),
            f(bring, [hd, window, 1]),
            f(brows, [hd, cap, 1]),
            t(
                bsel,
                0,
                types::I32,
                0,
                [k_sel.max(1) as u64, n as u64, 1, 1],
            ),
            f(bsk, [heads, 1, 1]),
            t(bpos, 0, types::I32, 0, [n as u64, 1, 1, 1]),
            f(bout, [hd, heads, n]),
        ];
        let mut prm = OpParams::default();
        prm.f[0] = scale;
        prm.i[..2].copy_from_slice(&[ratio as i64, mode]);
        // (the window store after the kernel changes the ring: it goes back each run)
        let run = || {
            into_result((g.be.upload)(bring, 0, f32_bytes(&ring).as_slice().into())).unwrap();
            let before = g.counters();
            g.op_with(ops::SPARSE_ATTENTION, prm, &args);
            let after = g.counters();
            let k = |name: &str| device_launches(&before, &after, name);
            (
                g.read_f32(bout, 0, hd * heads * n),
                [
                    k("ds4_attention_heads"),
                    k("ds4_attention_heads4"),
                    k("ds4_attention_tc"),
                    k("ds4_attention_tc_bf16"),
                ],
            )
        };
        FORCE_ATT_TC.store(2, Ordering::Relaxed);
        let two = run();
        FORCE_ATT_HPW4.store(true, Ordering::Relaxed);
        let four = run();
        let repeats = (0..20).all(|_| same_bits(&run().0, &four.0));
        FORCE_ATT_HPW4.store(false, Ordering::Relaxed);
        FORCE_ATT_TC.store(1, Ordering::Relaxed);
        let tc = run();
        let tc_repeats = (0..20).all(|_| same_bits(&run().0, &tc.0));
        // The bf16 form: the softmax weights rounded too, each by at most 2^-9, so the
        // output moves by at most 2^-9 of the largest |key| (~1) from want16 (the bound
        // below leaves a factor of two for the f32 sums).
        FORCE_ATT_BF16.store(1, Ordering::Relaxed);
        let tc16 = run();
        let tc16_repeats = (0..20).all(|_| same_bits(&run().0, &tc16.0));
        FORCE_ATT_BF16.store(0, Ordering::Relaxed);
        FORCE_ATT_TC.store(0, Ordering::Relaxed);
        let (e2, e4, etc) = (rel(&two.0, &want), rel(&four.0, &want), rel(&tc.0, &want));
        let e16 = tc16
            .0
            .iter()
            .zip(&want16)
            .fold(0f64, |a, (&g, w)| a.max((g as f64 - w).abs()));
        let e16_f32 = rel(&tc16.0, &want);
        let bf16_runs = hd % 32 == 0;
        let launches = (two.1, four.1, tc.1, tc16.1)
            == (
                [1, 0, 0, 0],
                [0, 1, 0, 0],
                [0, 0, 1, 0],
                [0, 0, !bf16_runs as u64, bf16_runs as u64],
            );
        let repeats = repeats && tc_repeats && tc16_repeats;
        // (falling back, the f32 kernel's own bits)
        let bf16_ok = match bf16_runs {
            true => e16 <= 1.0 / 256.0 && e16_f32 <= 1e-2,
            false => same_bits(&tc16.0, &tc.0),
        };
        let ok = e2.max(e4).max(etc) <= 1e-5 && bf16_ok && repeats && launches;
        all &= ok;
        println!(
            "{name:<50}: two heads a warp {e2:.2e}, four {e4:.2e}, tensor cores {etc:.2e}, bf16 {e16:.2e} of bf16 operands ({e16_f32:.2e} of f32's largest), 20 reruns bit-identical {repeats}, launches {} {}",
            if launches { "as expected" } else { "WRONG" },
            if ok { "ok" } else { "FAIL" }
        );
        json.push(format!(
            "{{\"test\":\"attention_prefill\",\"case\":\"{name}\",\"hpw2_rel\":{e2:e},\"hpw4_rel\":{e4:e},\"tc_rel\":{etc:e},\"bf16_abs\":{e16:e},\"bf16_rel_f32\":{e16_f32:e},\"repeats\":{repeats},\"launches\":{launches},\"ok\":{ok}}}"
        ));
        for buf in [bq, bkv, bring, brows, bsk, bsel, bpos, bout] {
            into_result((g.be.free)(buf)).unwrap();
        }
    }
    all
}

/// TOPK_ROWS (DeepSeek-V4's indexer selection) against its definition: the k best
/// visible rows (ties: lower index), as the rows above the k-th score in index order then
/// the rows equal to it in index order; all visible rows and -1s when no more than k are
/// visible. Tokens: a decode step at 128K (32768 of the 40000 rows visible), every row
/// visible with 65 distinct scores (ties at the k-th), fewer visible than k, 1000
/// visible, 25000 visible with ties, and 32768 visible of which all but the last 136 are
/// 0.0 (a cache seeked to depth, as `bench` does: ties by the thousand at the k-th),
/// 5001 visible with ties and 8192 visible.
fn topk_rows(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== TOPK_ROWS vs its definition ==");
    let (cap, k, ratio) = (40000usize, 512usize, 4i64);
    // (1000, 5000 and 8192 rows: the keys held in registers, for the selection too at
    // 1000; 25000 and more: read again each pass)
    let pos: [i32; 8] = [131071, 159999, 2000, 4000, 99999, 131071, 20003, 32767];
    let n = pos.len();
    let mut scores: Vec<f32> = (0..cap * n).map(|_| rng.f32()).collect();
    for t in [1, 4, 6] {
        for s in &mut scores[t * cap..(t + 1) * cap] {
            *s = (*s * 32.0).round() / 32.0; // ties, -0.0 and +0.0 among them
        }
    }
    scores[5 * cap..5 * cap + 32768 - 136].fill(0.0);
    let (bs, bp, bo) = (
        g.buf(&f32_bytes(&scores)),
        g.buf(
            &pos.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        g.zeros(k * n * 4),
    );
    let mut prm = OpParams::default();
    prm.i[0] = ratio;
    g.op_with(
        ops::TOPK_ROWS,
        prm,
        &[
            t(bs, 0, types::F32, 0, [cap as u64, n as u64, 1, 1]),
            t(bp, 0, types::I32, 0, [n as u64, 1, 1, 1]),
            t(bo, 0, types::I32, 0, [k as u64, n as u64, 1, 1]),
        ],
    );
    let read_i32 = |b: u64, offset: u64, n: usize| -> Vec<i32> {
        g.read_f32(b, offset, n)
            .iter()
            .map(|v| v.to_bits() as i32)
            .collect()
    };
    let got = read_i32(bo, 0, k * n);
    // One token at a time with the work words (ABI 1.6: the many-block form), twice:
    // the second run also checks that the first left its words zero.
    let words = ops::TOPK_ROWS_WORK_WORDS as usize;
    let (bw, bo1) = (g.zeros(words * 4), g.zeros(k * 4));
    let mut ok = true;
    for (ti, &p) in pos.iter().enumerate() {
        let visible = ((p as usize + 1) / ratio as usize).min(cap);
        let s = &scores[ti * cap..ti * cap + visible];
        let want: Vec<i32> = if visible <= k {
            (0..k)
                .map(|i| if i < visible { i as i32 } else { -1 })
                .collect()
        } else {
            let mut order: Vec<usize> = (0..visible).collect();
            order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
            let kth = s[order[k - 1]];
            let above = (0..visible).filter(|&i| s[i].total_cmp(&kth).is_gt());
            let equal = (0..visible).filter(|&i| s[i].total_cmp(&kth).is_eq());
            let mut w: Vec<i32> = above.map(|i| i as i32).collect();
            let rest = k - w.len();
            w.extend(equal.take(rest).map(|i| i as i32));
            w
        };
        let same = got[ti * k..(ti + 1) * k] == want[..];
        let mut wide = [false; 2];
        for run in &mut wide {
            // (a sentinel in every slot, so a run that skips one cannot pass on the last)
            into_result((g.be.upload)(bo1, 0, vec![0xfeu8; k * 4].as_slice().into())).unwrap();
            g.op_with(
                ops::TOPK_ROWS,
                prm,
                &[
                    t(
                        bs,
                        (ti * cap * 4) as u64,
                        types::F32,
                        0,
                        [cap as u64, 1, 1, 1],
                    ),
                    t(bp, (ti * 4) as u64, types::I32, 0, [1, 1, 1, 1]),
                    t(bo1, 0, types::I32, 0, [k as u64, 1, 1, 1]),
                    t(bw, 0, types::I32, 0, [words as u64, 1, 1, 1]),
                ],
            );
            *run = read_i32(bo1, 0, k) == want;
        }
        // The words the next call counts on: the barrier's count (its generation above
        // it moves on) and the three histograms after 64 blocks' two counts and a pad
        // (ds4_topk_rows_wide's layout).
        let wv = read_i32(bw, 0, 132 + 4096 + 2 * 1024);
        let clean = wv[0] & 0xffff == 0 && wv[132..].iter().all(|&v| v == 0);
        ok &= same && wide[0] && wide[1] && clean;
        let say = |b: bool| if b { "ok" } else { "FAIL" };
        println!(
            "position {p:>6}: {visible:>5} visible, k {k}: one block a token {}, one token (work words) {} / again {}, words left zero {}",
            say(same),
            say(wide[0]),
            say(wide[1]),
            say(clean)
        );
    }
    json.push(format!("{{\"test\":\"topk_rows\",\"ok\":{ok}}}"));
    for b in [bs, bp, bo, bw, bo1] {
        into_result((g.be.free)(b)).unwrap();
    }
    ok
}

/// INDEX_SCORES against an f64 reference of its definition: score[t][r] = sum_h
/// relu(q_th . row_r) * f[0] * (w_th * f[1]) over the rows visible to t. Prefill chunks
/// (the tiled kernels: on the tensor cores `ds4_index_scores_mm_tcs`, with
/// `MOE_GPU_IDX_PREC=bf16` `_tcs_bf16`, or with `MOE_GPU_IDX_TCS=0`
/// `ds4_index_scores_mm_tc`; with `MOE_GPU_IDX_TC=0`
/// `ds4_index_scores_mm`): 41 tokens, 64 heads x 128, a partial last query tile and a
/// partly visible row tile; 16 tokens over ~2100 rows (two blocks of 16 row tiles, the
/// second partial); 600 tokens from position 0 (each sees its own number of rows, tiles
/// past a block's tokens skipped). Where the streamed kernel runs, each chunk again on
/// `ds4_index_scores_mm_tc`: the same bits; and the bf16 form on three chunks and a
/// long decode step (forced), against the reference of bf16-rounded operands. A decode
/// token over a cache of 4000 rows
/// (3000 visible: `ds4_index_scores_few`, four rows a block, or with
/// `MOE_GPU_IDX_FEW=0` the row-a-lane `ds4_index_scores`), two over 20000 (5000 and
/// 12000 visible) and, with the engine's bound of 6144 rows, one token over 20000 (520
/// visible) and three (~6000 visible) on `ds4_index_scores_few`.
/// Limit: 1e-5 of the largest score. Expects the default kernel choice
/// (`MOE_GPU_IDX_GROUPS` unset; the decode tokens over 20000 cached rows the tiled
/// `ds4_index_scores_mm_tc`, half of its 128-query tile empty, unless
/// `MOE_GPU_IDX_MM=0` or `MOE_GPU_IDX_TC=0`: then a row a lane).
fn index_scores(g: &Gpu, rng: &mut Rng, json: &mut Vec<String>) -> bool {
    println!("\n== INDEX_SCORES vs f64 reference ==");
    let mut ok = true;
    let tc_off = std::env::var("MOE_GPU_IDX_TC").as_deref() == Ok("0");
    let mm = if tc_off {
        "ds4_index_scores_mm"
    } else {
        "ds4_index_scores_mm_tc"
    };
    // Prefill chunks stream their rows past resident queries unless MOE_GPU_IDX_TCS=0,
    // in f32 (bf16 with MOE_GPU_IDX_PREC=bf16; its own cases below either way).
    let tcs = !tc_off && std::env::var("MOE_GPU_IDX_TCS").as_deref() != Ok("0");
    let bf16_name = "ds4_index_scores_mm_tcs_bf16";
    let tcs_name = match std::env::var("MOE_GPU_IDX_PREC").as_deref() {
        Ok("bf16") => bf16_name,
        _ => "ds4_index_scores_mm_tcs",
    };
    // The decode cases' 20000 cached rows take the tiled kernel on the tensor cores
    // (IDX_MM_DECODE_MIN_ROWS), unless MOE_GPU_IDX_MM=0 or MOE_GPU_IDX_TC=0.
    let mm_env = std::env::var("MOE_GPU_IDX_MM");
    let one = match (mm_env.as_deref(), tc_off) {
        (Ok("1"), _) => mm,
        (Ok("0"), _) | (_, true) => "ds4_index_scores",
        _ => mm,
    };
    // Decode steps whose tokens see at most 6144 rows (the cache's size, or the engine's
    // bound in i[2]) take ds4_index_scores_few unless MOE_GPU_IDX_FEW=0.
    let few_on = std::env::var("MOE_GPU_IDX_FEW").as_deref() != Ok("0");
    let small = if few_on {
        "ds4_index_scores_few"
    } else if mm_env.as_deref() == Ok("1") {
        mm
    } else {
        "ds4_index_scores"
    };
    let chunk = match (mm_env.as_deref(), tcs) {
        (Ok("0"), _) => "ds4_index_scores",
        (_, true) => tcs_name,
        _ => mm,
    };
    // The decode steps the tiled kernel takes: the streamed one unless MOE_GPU_IDX_TCS=0.
    let (one, small) = match tcs {
        true => (
            if one == mm { chunk } else { one },
            if small == mm { chunk } else { small },
        ),
        false => (one, small),
    };
    let bounded = if few_on { "ds4_index_scores_few" } else { one };
    for (n, cap, p0, bound, kernel) in [
        (41usize, 3000usize, 9000usize, 0usize, chunk),
        (16, 2500, 4 * 2100, 0, chunk),
        (600, 3000, 0, 0, chunk),
        (1, 4000, 4 * 3000, 0, small),
        (1, 20000, 4 * 5000, 0, one),
        (1, 20000, 4 * 12000, 0, one),
        // A served context's cache, the engine's bound: ~520 rows (a step just past the
        // top-k), and three tokens near the bound (the blocks stride over the rows).
        (1, 20000, 4 * 520 + 3, 6144, bounded),
        (3, 20000, 4 * 6000, 6144, bounded),
    ] {
        let seed = rng.next();
        let (case_ok, got) = index_scores_case(g, seed, json, (n, cap, p0, bound), kernel);
        ok &= case_ok;
        if kernel == bf16_name {
            continue; // (the bf16 cases below)
        }
        if kernel == tcs_name {
            FORCE_IDX_TCS.store(2, Ordering::Relaxed);
            let (tc_ok, tc) = index_scores_case(g, seed, json, (n, cap, p0, bound), mm);
            FORCE_IDX_TCS.store(0, Ordering::Relaxed);
            let same = same_bits(&got, &tc);
            println!(
                "  {n} tokens: {kernel} and ds4_index_scores_mm_tc the same bits: {same} {}",
                if same { "ok" } else { "FAIL" }
            );
            json.push(format!(
                "{{\"test\":\"index_scores_tcs_bits\",\"kernel\":\"{kernel}\",\"tokens\":{n},\"ok\":{same}}}"
            ));
            ok &= tc_ok && same;
        }
    }
    if tcs && mm_env.as_deref() != Ok("0") {
        // The bf16 form on the chunks and a long decode step (forced: it runs where the
        // f32 streamed kernel runs), against the reference of bf16-rounded operands.
        FORCE_IDX_BF16.store(1, Ordering::Relaxed);
        for (n, cap, p0) in [
            (41usize, 3000usize, 9000usize),
            (16, 2500, 4 * 2100),
            (600, 3000, 0),
            (1, 20000, 4 * 12000),
        ] {
            let seed = rng.next();
            ok &= index_scores_case(g, seed, json, (n, cap, p0, 0), bf16_name).0;
        }
        FORCE_IDX_BF16.store(0, Ordering::Relaxed);
        // A 128K prefill chunk and a 128K decode step: the f32 form against the tiled
        // kernel, then the bf16 form against the f32 one (time and top-k agreement).
        ok &= index_scores_tcs_timing(g, rng, json, 1024, "ds4_index_scores_mm_tcs");
        ok &= index_scores_tcs_timing(g, rng, json, 1, "ds4_index_scores_mm_tcs");
        ok &= index_scores_tcs_timing(g, rng, json, 1024, bf16_name);
        ok &= index_scores_tcs_timing(g, rng, json, 1, bf16_name);
    }
    ok
}

/// `n` tokens' scores at 128K (64 heads x 128 over 32768 rows, each token seeing
/// ~32500: a prefill chunk of 1024 or a decode step) on a streamed kernel (`name`) and
/// the kernel it answers to: for `ds4_index_scores_mm_tcs` (f32) the tiled
/// `ds4_index_scores_mm_tc`, whose bits it must give; for `_tcs_bf16` the f32 streamed
/// one, whose top-512 rows a token it should mostly share (at least 98% on average: the
/// engine's top-k over these random scores, whose neighbours near the 512th are far
/// closer than a model's; a wrong product shares ~1.6%). Each kernel's time (CUDA
/// events, 5 runs after a warm-up) with its rate in TFLOP/s (2 flops a product) and in
/// GB/s of rows read. Too large for the f64 reference; the cases above check values.
fn index_scores_tcs_timing(
    g: &Gpu,
    rng: &mut Rng,
    json: &mut Vec<String>,
    n: usize,
    name: &str,
) -> bool {
    let (ih, id, cap, ratio, topk) = (64usize, 128usize, 32768usize, 4usize, 512usize);
    let p0 = ratio * cap - n - 2000;
    let q: Vec<f32> = (0..n * ih * id).map(|_| rng.f32()).collect();
    let w: Vec<f32> = (0..n * ih).map(|_| rng.f32()).collect();
    let rows: Vec<f32> = (0..cap * id).map(|_| rng.f32()).collect();
    let pos: Vec<u8> = (0..n)
        .flat_map(|t| ((p0 + t) as i32).to_le_bytes())
        .collect();
    let (bq, bw, br, bp, bo) = (
        g.buf(&f32_bytes(&q)),
        g.buf(&f32_bytes(&w)),
        g.buf(&f32_bytes(&rows)),
        g.buf(&pos),
        g.zeros(cap * n * 4),
    );
    let mut prm = OpParams::default();
    prm.f[0] = 0.088;
    prm.f[1] = 0.125;
    prm.i[0] = ratio as i64;
    let args = index_args([bq, bw, br, bp, bo], [id, ih, n, cap]);
    // (FORCE_IDX_TCS: 1 streamed, 2 tiled; FORCE_IDX_BF16: 1 bf16, 2 f32)
    let run = |tcs: u8, bf16: u8| {
        FORCE_IDX_TCS.store(tcs, Ordering::Relaxed);
        FORCE_IDX_BF16.store(bf16, Ordering::Relaxed);
        let ms = g.time(5, || g.op_with(ops::INDEX_SCORES, prm, &args));
        FORCE_IDX_TCS.store(0, Ordering::Relaxed);
        FORCE_IDX_BF16.store(0, Ordering::Relaxed);
        (ms, g.read_f32(bo, 0, cap * n))
    };
    let bf16 = name.ends_with("_bf16");
    let (ms_s, got) = run(1, if bf16 { 1 } else { 2 });
    let (other, (ms_t, want)) = match bf16 {
        true => ("ds4_index_scores_mm_tcs", run(1, 2)),
        false => ("ds4_index_scores_mm_tc", run(2, 2)),
    };
    let visible = |t: usize| ((p0 + t + 1) / ratio).min(cap);
    // Each token's top-k rows in both (by score, ties by row), the share in common.
    let top = |s: &[f32], t: usize| {
        let mut r: Vec<usize> = (0..visible(t)).collect();
        let row = &s[t * cap..][..cap];
        r.select_nth_unstable_by(topk - 1, |&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        r.truncate(topk);
        r.sort_unstable();
        r
    };
    let shared: Vec<f64> = (0..n)
        .map(|t| {
            let (a, b) = (top(&got, t), top(&want, t));
            a.iter().filter(|x| b.binary_search(x).is_ok()).count() as f64 / topk as f64
        })
        .collect();
    let mean = shared.iter().sum::<f64>() / n as f64;
    let least = shared.iter().copied().fold(1.0, f64::min);
    let same = same_bits(&got, &want);
    let ok = match bf16 {
        true => mean >= 0.98,
        false => same,
    };
    let flops: f64 = (0..n).map(|t| (visible(t) * ih * id * 2) as f64).sum();
    let rate = |ms: f64| flops / (ms * 1e-3) / 1e12;
    // (the rows each kernel reads at least once: those the last token sees)
    let gbs = |ms: f64| (visible(n - 1) * id * 4) as f64 / (ms * 1e-3) / 1e9;
    println!(
        "  128K, {n} tokens over {cap} rows: {name} {:.1} us ({:.1} TFLOP/s, {:.0} GB/s of rows), {other} {:.1} us ({:.1}, {:.0}), {:.2}x; the same bits: {same}, top-{topk} rows shared {:.4} (least {:.4}) {}",
        1e3 * ms_s,
        rate(ms_s),
        gbs(ms_s),
        1e3 * ms_t,
        rate(ms_t),
        gbs(ms_t),
        ms_t / ms_s,
        mean,
        least,
        if ok { "ok" } else { "FAIL" }
    );
    json.push(format!(
        "{{\"test\":\"index_scores_tcs_128k\",\"kernel\":\"{name}\",\"against\":\"{other}\",\"tokens\":{n},\"ms\":{ms_s},\"against_ms\":{ms_t},\"same_bits\":{same},\"topk_shared_mean\":{mean},\"topk_shared_least\":{least},\"ok\":{ok}}}"
    ));
    for b in [bq, bw, br, bp, bo] {
        into_result((g.be.free)(b)).unwrap();
    }
    ok
}

/// INDEX_SCORES' tensors on buffers [queries, head weights, rows, positions, scores] for
/// `n` tokens of `ih` heads x `id` over `cap` rows; shape = [id, ih, n, cap].
fn index_args(b: [u64; 5], shape: [usize; 4]) -> [TensorRef; 5] {
    let [id, ih, n, cap] = shape.map(|v| v as u64);
    [
        t(b[0], 0, types::F32, 0, [id, ih, n, 1]),
        t(b[1], 0, types::F32, 0, [ih, n, 1, 1]),
        t(b[2], 0, types::F32, 0, [id, cap, 1, 1]),
        t(b[3], 0, types::I32, 0, [n, 1, 1, 1]),
        t(b[4], 0, types::F32, 0, [cap, n, 1, 1]),
    ]
}

/// One INDEX_SCORES case on inputs drawn from `seed` (so a second run can repeat them):
/// whether it held, and the scores.
fn index_scores_case(
    g: &Gpu,
    seed: u64,
    json: &mut Vec<String>,
    (n, cap, p0, bound): (usize, usize, usize, usize),
    kernel: &str,
) -> (bool, Vec<f32>) {
    let rng = &mut Rng(seed);
    let (ih, id, ratio) = (64usize, 128usize, 4usize);
    let (sm, ws) = (0.088f32, 0.125f32);
    let q: Vec<f32> = (0..n * ih * id).map(|_| rng.f32()).collect();
    let w: Vec<f32> = (0..n * ih).map(|_| rng.f32()).collect();
    let rows: Vec<f32> = (0..cap * id).map(|_| rng.f32()).collect();
    // The bf16 form's dot products are those of the operands rounded to bf16: the
    // reference rounds them too.
    let bf16 = kernel == "ds4_index_scores_mm_tcs_bf16";
    let round = |v: &[f32]| if bf16 { bf16_rounded(v) } else { v.to_vec() };
    let (rq, rrows) = (round(&q), round(&rows));
    let pos: Vec<i32> = (0..n).map(|t| (p0 + t) as i32).collect();
    let nan = f32_bytes(&vec![f32::NAN; cap * n]);
    let (bq, bw, br, bp, bo) = (
        g.buf(&f32_bytes(&q)),
        g.buf(&f32_bytes(&w)),
        g.buf(&f32_bytes(&rows)),
        g.buf(
            &pos.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        ),
        g.buf(&nan),
    );
    let mut prm = OpParams::default();
    prm.f[0] = sm;
    prm.f[1] = ws;
    prm.i[0] = ratio as i64;
    prm.i[2] = bound as i64;
    let before = g.counters();
    g.op_with(
        ops::INDEX_SCORES,
        prm,
        &index_args([bq, bw, br, bp, bo], [id, ih, n, cap]),
    );
    let ran = device_launches(&before, &g.counters(), kernel);
    let got = g.read_f32(bo, 0, cap * n);
    let (mut worst, mut top) = (0f64, 0f64);
    for t in 0..n {
        let visible = ((p0 + t + 1) / ratio).min(cap);
        for r in 0..visible {
            let mut want = 0f64;
            for h in 0..ih {
                let qh = &rq[(t * ih + h) * id..][..id];
                let dot: f64 = qh
                    .iter()
                    .zip(&rrows[r * id..][..id])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum();
                want += dot.max(0.0) * sm as f64 * (w[t * ih + h] as f64 * ws as f64);
            }
            worst = worst.max((got[t * cap + r] as f64 - want).abs());
            top = top.max(want.abs());
        }
    }
    let rel = worst / top.max(1e-30);
    let ok = rel <= 1e-5 && ran == 1;
    let visible = ((p0 + n) / ratio).min(cap);
    println!(
        "{n} tokens x {ih} heads x {id}, {visible} rows visible: max rel err {rel:.2e}{}, {kernel} launches {ran} {}",
        if bf16 { " (of bf16 operands)" } else { "" },
        if ok { "ok" } else { "FAIL" }
    );
    json.push(format!(
        "{{\"test\":\"{kernel}\",\"tokens\":{n},\"max_rel_err\":{rel:e},\"ok\":{ok}}}"
    ));
    for b in [bq, bw, br, bp, bo] {
        into_result((g.be.free)(b)).unwrap();
    }
    (ok, got)
}

/// MATMUL_ID's tensors on buffers [w, x, ids, out]: weights of (type, variant) [k, m,
/// experts], `cols` input columns, ids [slots, tokens], out [m, slots, tokens];
/// shape = [k, m, experts, slots, tokens, cols].
fn id_args(b: [u64; 4], (ty, variant): (u32, u64), shape: [usize; 6]) -> [TensorRef; 4] {
    let [k, m, experts, slots, n_tok, cols] = shape.map(|v| v as u64);
    [
        t(b[0], 0, ty, variant, [k, m, experts, 1]),
        t(b[1], 0, types::F32, 0, [k, cols, 1, 1]),
        t(b[2], 0, types::I32, 0, [slots, n_tok, 1, 1]),
        t(b[3], 0, types::F32, 0, [m, slots, n_tok, 1]),
    ]
}

/// Launches of kernel `name` on the device between two [`Gpu::counters`] readings.
fn device_launches(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
    name: &str,
) -> u64 {
    let key = format!("{name}.device");
    after.get(&key).copied().unwrap_or(0) - before.get(&key).copied().unwrap_or(0)
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// This file's reference against moe-quant-rocmfpx's `dot_q8` (the plugin the host
/// uses on CPU), so the GPU parity below is parity with that crate too. Runs on the CPU.
/// The plugin is loaded as the host loads it (its cdylib, found next to this program or
/// one folder up): two plugins' rlibs cannot link into one binary (each exports a root).
fn check_reference(rng: &mut Rng) -> bool {
    use moe_plugin_api::{abi_stable::library::lib_header_from_path, PluginRef};
    let exe = std::env::current_exe().unwrap_or_default();
    let name = "libmoe_quant_rocmfpx.so";
    let Some(path) = exe
        .ancestors()
        .skip(1)
        .take(2)
        .map(|d| d.join(name))
        .find(|p| p.exists())
    else {
        println!("reference check skipped: {name} not found next to this program");
        return true;
    };
    let plugin = match lib_header_from_path(&path).and_then(|h| h.init_root_module::<PluginRef>()) {
        Ok(p) => p,
        Err(e) => {
            println!("reference check FAILED to load {}: {e}", path.display());
            return false;
        }
    };
    let Some(fmt) = (plugin.quant_formats())()
        .into_iter()
        .find(|f| f.type_id == 107)
    else {
        println!("reference check FAILED: {} has no type 107", path.display());
        return false;
    };
    let (m, k, n) = (256usize, 4096usize, 3usize);
    let mut ok = true;
    // The f64 weight values the bf16 tiles' cases compare with (values_107, random_dense's
    // ROCmFP4) against the plugin's decode.
    for (ty, variant, vname) in [
        (107u32, FP2_TWO_SCALE, "107 two-scale"),
        (107, FP2_AFFINE, "107 affine"),
        (100, 0, "rocmfp4"),
    ] {
        let Some(f) = (plugin.quant_formats())()
            .into_iter()
            .find(|f| f.type_id == ty)
        else {
            println!(
                "reference check FAILED: {} has no type {ty}",
                path.display()
            );
            return false;
        };
        let (w, mine) = if ty == 107 {
            let w = random_weights(rng, 64, 1024);
            let v = values_107(&w, variant == FP2_AFFINE);
            (w, v)
        } else {
            random_dense(rng, ty, 64, 1024)
        };
        let mut theirs = vec![0f32; mine.len()];
        into_result((f.decode)(
            variant,
            w.as_slice().into(),
            theirs.as_mut_slice().into(),
        ))
        .unwrap();
        let worst = theirs
            .iter()
            .zip(&mine)
            .map(|(a, b)| (*a as f64 - b).abs() / b.abs().max(1e-30))
            .fold(0f64, f64::max);
        ok &= worst <= 1e-6;
        println!(
            "reference check ({vname}): this file's weight values vs the plugin's decode, worst relative {worst:.3e} {}",
            if worst <= 1e-6 { "ok" } else { "FAIL" }
        );
    }
    for (variant, vname) in [(FP2_TWO_SCALE, "two-scale"), (FP2_AFFINE, "affine")] {
        let w = random_weights(rng, m, k);
        let x: Vec<f32> = (0..n * k).map(|_| rng.f32()).collect();
        let act: Vec<Vec<BlockQ8_1>> = x
            .chunks_exact(k)
            .map(|c| c.chunks_exact(32).map(BlockQ8_1::quantize).collect())
            .collect();
        let flat: Vec<BlockQ8_1> = act.iter().flatten().copied().collect();
        let mut theirs = vec![0f32; m * n];
        into_result((fmt.validate)(variant, w.as_slice().into())).unwrap();
        into_result((fmt.dot_q8)(
            variant,
            w.as_slice().into(),
            k as u64,
            flat.as_slice().into(),
            theirs.as_mut_slice().into(),
        ))
        .unwrap();
        let mine = ref_matmul(&w, m, k, &act, variant == FP2_AFFINE);
        let e = nmse(&theirs, &mine);
        ok &= e <= 1e-10;
        println!(
            "reference check ({vname}): this file's reference vs moe-quant-rocmfpx dot_q8, nmse {e:.3e} {}",
            if e <= 1e-10 { "ok" } else { "FAIL" }
        );
    }
    ok
}

fn main() {
    // --compile ARCH: NVRTC's image for ARCH into the kernel cache and nothing else (no
    // device needed), so that a device call finds the cache filled here.
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--compile") {
        let arch = args.get(i + 1).map_or("sm_90", String::as_str);
        let t0 = Instant::now();
        match moe_backend_cuda::kernels::compile(arch) {
            Ok((img, cached)) => println!(
                "kernels for {arch}: {} bytes, {} in {:.1} s (cache dir {})",
                img.len(),
                if cached { "from the cache" } else { "compiled" },
                t0.elapsed().as_secs_f64(),
                moe_backend_cuda::kernels::cache_dir().display()
            ),
            Err(e) => {
                eprintln!("compiling the kernels for {arch}: {e}");
                std::process::exit(1);
            }
        }
        return;
    }
    if std::env::var_os("MOE_GPU_MMB").is_none() {
        // Before any backend call (the backend reads it once): the MMQ cases run the int8
        // tiles, as they expect; `mmw_check` forces the streamed ones itself.
        std::env::set_var("MOE_GPU_MMB", "0");
    }
    let quick = std::env::args().any(|a| a == "--quick");
    // --bench: the microbenchmark alone (its rows' kernels are the parity cases' ones).
    let bench_only = std::env::args().any(|a| a == "--bench");
    // --grouped: the MoE products' parity alone (grouped, MATMUL_ID_MULTI, SWIGLU_MATMUL_ID),
    // for quick runs under each MOE_GPU_ID_* setting.
    let grouped_only = std::env::args().any(|a| a == "--grouped");
    // --attention: SPARSE_ATTENTION's and INDEX_SCORES' parity alone (decode steps and
    // prefill chunks).
    let attention_only = std::env::args().any(|a| a == "--attention");
    // --routed: the router's and MOE_ROUTED's parity alone.
    let routed_only = std::env::args().any(|a| a == "--routed");
    let ref_ok = check_reference(&mut Rng(0x0123_4567_89ab_cdef));
    let be = moe_backend_cuda::table();
    let devs = match into_result((be.devices)()) {
        Ok(d) if !d.is_empty() => d,
        Ok(_) => {
            println!("no CUDA devices");
            return;
        }
        Err(e) => {
            println!("cuda backend: {e}");
            return;
        }
    };
    let d = &devs[0];
    println!(
        "device 0: {} ({}), {:.1} GiB, copy bandwidth {:.0} GB/s (256 MiB dtod)",
        d.name,
        d.arch,
        d.memory_bytes as f64 / (1u64 << 30) as f64,
        d.bandwidth_bytes_per_s / 1e9
    );
    let t0 = Instant::now();
    let dev = rt::runtime().unwrap().device(0).unwrap();
    let module = dev.module().unwrap();
    println!(
        "kernels: {} in {:.2} s (cache dir {})",
        if module.from_cache {
            "loaded from cache"
        } else {
            "compiled with NVRTC"
        },
        t0.elapsed().as_secs_f64(),
        moe_backend_cuda::kernels::cache_dir().display()
    );
    // Without them the "register path" cases below compare that path with itself.
    // The streamed tiles' resources as NVRTC built them (registers and spills decide
    // their blocks a multiprocessor).
    for name in ["mmw_dense", "mmw_id", "mmw_dense_m2", "mmw_id_m2"] {
        if let Some((regs, local)) = module.resources(name) {
            println!("{name}: {regs} registers, {local} bytes of local memory a thread");
        }
    }
    println!(
        "streamed tiles' shared memory room: {} bytes",
        module.mmw_smem
    );
    match module.bulk_smem {
        0 => println!("bulk copies: off (the register-path cases compare nothing)"),
        n => println!("bulk copies: on, up to {n} bytes of shared memory a block"),
    }
    let stream = into_result((be.stream_create)(0)).unwrap();
    let g = Gpu { be, stream };
    let mut rng =
        Rng(0x9e37_79b9_7f4a_7c15 ^ t0.elapsed().as_nanos() as u64 ^ std::process::id() as u64);
    let mut json = Vec::new();
    let mut all_ok = ref_ok;

    // ---------------------------------------------------------------- parity
    if routed_only {
        all_ok &= router_mm(&g, &mut rng, &mut json);
        all_ok &= moe_routed(&g, &mut rng, &mut json);
        println!(
            "\nparity (routed only): {}",
            if all_ok { "ALL OK" } else { "FAILURES" }
        );
        return;
    }
    if attention_only {
        all_ok &= attention_decode(&g, &mut rng, &mut json);
        all_ok &= attention_prefill(&g, &mut rng, &mut json);
        all_ok &= index_scores(&g, &mut rng, &mut json);
        println!(
            "\nparity (attention only): {}",
            if all_ok { "ALL OK" } else { "FAILURES" }
        );
        return;
    }
    if !bench_only {
        if !grouped_only {
            all_ok &= mmvq_parity(&g, &mut rng, dev.cc, &mut json);
        }
        // ---------------------------------------------------------------- grouped
        println!("\n== grouped MoE mat-vec vs per-pair MMVQ (bit-identical) and CPU reference ==");
        println!(
            "{:<10} {:>5} {:>5} {:>4} {:>5} {:>7} {:>9} {:>8} {:>12} {}",
            "variant", "K", "M", "tok", "slots", "masked", "bitident", "zeros", "nmse", "ok"
        );
        let slots = 6usize;
        for (variant, vname) in [(FP2_TWO_SCALE, "two-scale"), (FP2_AFFINE, "affine")] {
            // 256 experts: a drafted pass's few tokens, whose pairs seldom share an expert,
            // run the unsorted kernel (ops::id_nosort) up to 8 tokens.
            for (k, m, per_pair, experts) in [
                (4096usize, 4096usize, false, 16usize),
                (2048, 4096, true, 16),
                (2048, 512, false, 256),
                // rows not a multiple of a block's 16, and fewer block pairs than a warp
                // has lanes
                (1024, 300, false, 256),
            ] {
                let w = random_weights(&mut rng, experts * m, k);
                let ebytes = m * k / 32 * 10;
                let bw = g.buf(&w);
                // 16 and 256 tokens take the tiles: again forced onto the bf16 ones.
                let counts: &[usize] = match experts {
                    256 => &[1, 4, 8, 9],
                    _ => &[1, 2, 4, 8, 9, 16, 256],
                };
                let runs: Vec<(usize, bool)> = counts
                    .iter()
                    .map(|&n| (n, false))
                    .chain(
                        [(16, true), (256, true)]
                            .into_iter()
                            .filter(|_| dev.cc.0 >= 8 && experts == 16),
                    )
                    .collect();
                for (n_tok, force) in runs {
                    FORCE_MMB.store(force, Ordering::Relaxed);
                    let pairs = n_tok * slots;
                    // From 4 pairs per expert on matrix-unit devices: the MMQ tiles, which sum
                    // in another order than MMVQ (so no bit-identity asked of them).
                    let tiles = pairs >= 4 * experts && mmq_kernel(dev.cc) == "mmq_mma_107";
                    let kernel = if tiles && mmb(dev.cc) {
                        "mmb_id"
                    } else if tiles {
                        "mmq_mma_id"
                    } else if id_nosort(n_tok as u64, pairs as u64, experts as u64) {
                        "mmvq_id_107" // one token, or a few on many experts: no sort
                    } else {
                        "mmvq_grouped_107"
                    };
                    // The CPU reference on at most ~96 of the pairs.
                    let stride = pairs.div_ceil(96);
                    let cols = if per_pair { pairs } else { n_tok };
                    let x: Vec<f32> = (0..cols * k).map(|_| rng.f32()).collect();
                    let mut ids = vec![0i32; pairs];
                    for tok in 0..n_tok {
                        // Distinct experts per token; about one route in eight masked.
                        let mut used = Vec::new();
                        for s in 0..slots {
                            let e = loop {
                                let e = rng.below(experts as u64) as i32;
                                if !used.contains(&e) {
                                    break e;
                                }
                            };
                            used.push(e);
                            ids[tok * slots + s] = if rng.below(8) == 0 { -1 } else { e };
                        }
                    }
                    let masked = ids.iter().filter(|&&e| e < 0).count();
                    let bx = g.buf(&f32_bytes(&x));
                    let bi = g.buf(
                        &ids.iter()
                            .flat_map(|v| v.to_le_bytes())
                            .collect::<Vec<u8>>(),
                    );
                    // NaN-filled outputs: masked routes must be overwritten with exact zeros.
                    let nan = f32_bytes(&vec![f32::NAN; m * pairs]);
                    let (bo, bp) = (g.buf(&nan), g.buf(&nan));
                    let before = g.counters();
                    g.op(
                        OP_MATMUL_ID,
                        &id_args(
                            [bw, bx, bi, bo],
                            (107, variant),
                            [k, m, experts, slots, n_tok, cols],
                        ),
                    );
                    let grouped = g.read_f32(bo, 0, m * pairs);
                    let after = g.counters();
                    let key = format!("{kernel}.device");
                    let ran_grouped = after.get(&key) > before.get(&key);
                    // Per-pair path: one MMVQ (n = 1) per routed pair on the expert's slice.
                    for (p, &e) in ids.iter().enumerate() {
                        if e < 0 {
                            continue;
                        }
                        let col = if per_pair { p } else { p / slots };
                        g.op(
                            ops::MATMUL,
                            &[
                                t(
                                    bw,
                                    (e as usize * ebytes) as u64,
                                    107,
                                    variant,
                                    [k as u64, m as u64, 1, 1],
                                ),
                                t(bx, (col * k * 4) as u64, types::F32, 0, [k as u64, 1, 1, 1]),
                                t(bp, (p * m * 4) as u64, types::F32, 0, [m as u64, 1, 1, 1]),
                            ],
                        );
                    }
                    let per = g.read_f32(bp, 0, m * pairs);
                    let mut bit = true;
                    let mut zeros = true;
                    let mut got_routed = Vec::new();
                    let mut want_routed = Vec::new();
                    for (p, &e) in ids.iter().enumerate() {
                        let gs = &grouped[p * m..(p + 1) * m];
                        if e < 0 {
                            zeros &= gs.iter().all(|v| v.to_bits() == 0);
                            continue;
                        }
                        bit &= same_bits(gs, &per[p * m..(p + 1) * m]);
                        if p % stride != 0 {
                            continue;
                        }
                        let col = if per_pair { p } else { p / slots };
                        let act: Vec<BlockQ8_1> = x[col * k..(col + 1) * k]
                            .chunks_exact(32)
                            .map(BlockQ8_1::quantize)
                            .collect();
                        let ew = &w[e as usize * ebytes..(e as usize + 1) * ebytes];
                        want_routed.extend(ref_matmul(ew, m, k, &[act], variant == FP2_AFFINE));
                        got_routed.extend_from_slice(gs);
                    }
                    let e = nmse(&got_routed, &want_routed);
                    let ok = (bit || tiles) && zeros && e <= 5e-4 && ran_grouped;
                    all_ok &= ok;
                    println!(
                        "{:<10} {:>5} {:>5} {:>4} {:>5} {:>7} {:>9} {:>8} {:>12.3e} {} {kernel}",
                        vname,
                        k,
                        m,
                        n_tok,
                        slots,
                        masked,
                        bit,
                        zeros,
                        e,
                        if ok { "ok" } else { "FAIL" }
                    );
                    json.push(format!(
                    "{{\"test\":\"grouped\",\"variant\":\"{vname}\",\"k\":{k},\"m\":{m},\"tokens\":{n_tok},\"masked\":{masked},\"bit_identical\":{bit},\"masked_zero\":{zeros},\"nmse\":{e:e},\"kernel\":\"{kernel}\",\"ok\":{ok}}}"
                ));
                    for b in [bx, bi, bo, bp] {
                        into_result((g.be.free)(b)).unwrap();
                    }
                    FORCE_MMB.store(false, Ordering::Relaxed);
                }
                into_result((g.be.free)(bw)).unwrap();
            }
        }
        all_ok &= id_multi(&g, &mut rng, &mut json);
        all_ok &= swiglu_id(&g, &mut rng, &mut json);
        all_ok &= moe_routed(&g, &mut rng, &mut json);
        if grouped_only {
            println!(
                "\nparity (grouped only): {}",
                if all_ok { "ALL OK" } else { "FAILURES" }
            );
            return;
        }
        all_ok &= hc_post_pre_gsync(&g, &mut rng, &mut json);
        all_ok &= hc_xq(&g, &mut rng, &mut json);
        all_ok &= hc_route(&g, &mut rng, &mut json);
        all_ok &= router_mm(&g, &mut rng, &mut json);
        all_ok &= norm_rope(&g, &mut rng, &mut json);
        all_ok &= norm_matmul(&g, &mut rng, &mut json);
        all_ok &= attention_decode(&g, &mut rng, &mut json);
        all_ok &= attention_prefill(&g, &mut rng, &mut json);
        all_ok &= topk_rows(&g, &mut rng, &mut json);
        all_ok &= index_scores(&g, &mut rng, &mut json);
        all_ok &= dense_mmq(&g, &mut rng, dev.cc, &mut json);
        all_ok &= mmw_check(&g, &mut rng, dev.cc, &mut json);
        all_ok &= dense_decode(&g, &mut rng, &mut json);
        all_ok &= dense_cols(&g, &mut rng, &mut json);
        all_ok &= nan_inputs(&g, &mut rng, &mut json);
        all_ok &= prefetch_runs(&g, &mut rng, dev.cc, &mut json);
        all_ok &= f32_tiles_check(&g, &mut rng, &mut json);
    }
    if quick {
        println!("\nparity: {}", if all_ok { "ALL OK" } else { "FAILURES" });
        return;
    }

    // ---------------------------------------------------------------- bench
    println!("\n== microbenchmark (V4-Flash expert shapes: 256 experts, top-6) ==");
    let copy_bytes = 1u64 << 30;
    let (ca, cb) = (
        into_result((g.be.alloc)(0, copy_bytes)).unwrap(),
        into_result((g.be.alloc)(0, copy_bytes)).unwrap(),
    );
    let ms = g.time(20, || {
        rt::copy_async(g.stream, (cb, 0), (ca, 0), copy_bytes).unwrap()
    });
    let copy_bw = 2.0 * copy_bytes as f64 / (ms * 1e-3);
    println!(
        "device-to-device copy: {:.0} GB/s (1 GiB, read + write)",
        copy_bw / 1e9
    );
    json.push(format!(
        "{{\"bench\":\"copy\",\"gbps\":{:.1}}}",
        copy_bw / 1e9
    ));
    for b in [ca, cb] {
        into_result((g.be.free)(b)).unwrap();
    }
    println!(
        "{:<26} {:>5} {:>7} {:>5} {:>10} {:>9} {:>8} {:>9}",
        "kernel", "K", "M", "n", "us", "GB/s", "of copy", "TFLOP/s"
    );
    let experts = 256usize;
    // The prefill rows' tile kinds: as configured, bf16, streamed at 16 and 32 rows a warp.
    let prefill_modes: Vec<u8> = [0u8, 1, 3, 4]
        .into_iter()
        .filter(|&md| md == 0 || dev.cc.0 >= 8)
        .collect();
    for (k, m) in [(4096usize, 2048usize), (2048, 4096)] {
        let ebytes = m * k / 32 * 10;
        // Whole expert set as one matrix for plain MMVQ (well past the 60 MB L2).
        let w = random_weights(&mut rng, experts * m, k);
        let bw = g.buf(&w);
        let x: Vec<f32> = (0..512 * k).map(|_| rng.f32()).collect();
        let bx = g.buf(&f32_bytes(&x));
        let bo = g.zeros(experts * m * 512 * 4);
        let rows = (experts * m) as u64;
        for n in [1usize, 2, 4, 8] {
            let ms = g.time(10, || {
                g.op(
                    ops::MATMUL,
                    &[
                        t(bw, 0, 107, FP2_AFFINE, [k as u64, rows, 1, 1]),
                        t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                        t(bo, 0, types::F32, 0, [rows, n as u64, 1, 1]),
                    ],
                )
            });
            let gbps = w.len() as f64 / (ms * 1e-3) / 1e9;
            let tf = 2.0 * rows as f64 * k as f64 * n as f64 / (ms * 1e-3) / 1e12;
            bench_row(
                &format!("mmvq_107_n{n}"),
                [k as u64, rows, n as u64],
                ms,
                gbps,
                copy_bw,
                tf,
            );
            json.push(format!("{{\"bench\":\"mmvq\",\"k\":{k},\"m\":{rows},\"n\":{n},\"us\":{:.2},\"gbps\":{gbps:.1},\"of_copy\":{:.3}}}", ms * 1e3, gbps * 1e9 / copy_bw));
        }
        // MMQ on one expert-sized and on a 16-expert-tall matrix, 512 columns; each tile
        // kernel the device has (as configured, bf16, dp4a, streamed bf16 with 16 and 32
        // rows a warp: mode 0 - 4).
        let modes: Vec<u8> = (0u8..5)
            .filter(|&mode| match mode {
                0 => true,
                1 => dev.cc.0 >= 8 && !mmb(dev.cc),
                2 => mmq_kernel(dev.cc) != "mmq_dp4a_107",
                _ => dev.cc.0 >= 8,
            })
            .collect();
        for mrows in [m as u64, 16 * m as u64] {
            let n = 512usize;
            let run = || {
                g.op(
                    ops::MATMUL,
                    &[
                        t(bw, 0, 107, FP2_AFFINE, [k as u64, mrows, 1, 1]),
                        t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                        t(bo, 0, types::F32, 0, [mrows, n as u64, 1, 1]),
                    ],
                )
            };
            let flop = 2.0 * mrows as f64 * k as f64 * n as f64;
            let bytes = mrows as f64 * k as f64 / 32.0 * 10.0;
            let shape = [k as u64, mrows, n as u64];
            let rates = (flop, bytes, copy_bw);
            bench_tile_modes(&g, &modes, ("", "mmq"), shape, rates, &mut json, &run);
        }
        // Grouped: n tokens, top-6 of 256 experts; bytes = distinct experts touched.
        for n_tok in [1usize, 4, 16, 64] {
            let pairs = n_tok * 6;
            let mut ids = vec![0i32; pairs];
            for tok in 0..n_tok {
                let mut used = Vec::new();
                for s in 0..6 {
                    let e = loop {
                        let e = rng.below(experts as u64) as i32;
                        if !used.contains(&e) {
                            break e;
                        }
                    };
                    used.push(e);
                    ids[tok * 6 + s] = e;
                }
            }
            let mut distinct = ids.clone();
            distinct.sort();
            distinct.dedup();
            let bytes = distinct.len() * ebytes;
            let bi = g.buf(
                &ids.iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect::<Vec<u8>>(),
            );
            // Down-projection style (per-pair columns) when K = 2048.
            let cols = if k == 2048 { pairs } else { n_tok };
            let ms = g.time(20, || {
                g.op(
                    OP_MATMUL_ID,
                    &[
                        t(
                            bw,
                            0,
                            107,
                            FP2_AFFINE,
                            [k as u64, m as u64, experts as u64, 1],
                        ),
                        t(bx, 0, types::F32, 0, [k as u64, cols as u64, 1, 1]),
                        t(bi, 0, types::I32, 0, [6, n_tok as u64, 1, 1]),
                        t(bo, 0, types::F32, 0, [m as u64, 6, n_tok as u64, 1]),
                    ],
                )
            });
            let gbps = bytes as f64 / (ms * 1e-3) / 1e9;
            println!(
                "{:<26} {:>5} {:>7} {:>5} {:>10.1} {:>9.0} {:>7.0}% {:>9}",
                format!("grouped ({} experts)", distinct.len()),
                k,
                m,
                n_tok,
                ms * 1e3,
                gbps,
                100.0 * gbps * 1e9 / copy_bw,
                "-"
            );
            json.push(format!("{{\"bench\":\"grouped\",\"k\":{k},\"m\":{m},\"tokens\":{n_tok},\"experts_touched\":{},\"us\":{:.2},\"gbps\":{gbps:.1},\"of_copy\":{:.3}}}", distinct.len(), ms * 1e3, gbps * 1e9 / copy_bw));
            into_result((g.be.free)(bi)).unwrap();
        }
        // A prefill chunk's routed experts: 512 tokens (~12 pairs an expert) on the tiles
        // as configured, the bf16 ones and the streamed bf16 ones with 16 and 32 rows a
        // warp (mode 0, 1, 3, 4).
        let n_tok = 512usize;
        let ids: Vec<i32> = (0..n_tok)
            .flat_map(|_| {
                let mut used = Vec::new();
                while used.len() < 6 {
                    let e = rng.below(experts as u64) as i32;
                    if !used.contains(&e) {
                        used.push(e);
                    }
                }
                used
            })
            .collect();
        let bi = g.buf(
            &ids.iter()
                .flat_map(|v| v.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let cols = if k == 2048 { 6 * n_tok } else { n_tok };
        let bx2 = g.buf(&f32_bytes(
            &(0..cols * k).map(|_| rng.f32()).collect::<Vec<f32>>(),
        ));
        let bo2 = g.zeros(m * 6 * n_tok * 4);
        let run = || {
            g.op(
                OP_MATMUL_ID,
                &id_args(
                    [bw, bx2, bi, bo2],
                    (107, FP2_AFFINE),
                    [k, m, experts, 6, n_tok, cols],
                ),
            )
        };
        let shape = [k as u64, m as u64, n_tok as u64];
        let rates = (2.0 * (6 * n_tok * m * k) as f64, w.len() as f64, copy_bw);
        let what = (" (prefill)", "grouped_prefill");
        bench_tile_modes(&g, &prefill_modes, what, shape, rates, &mut json, &run);
        for b in [bi, bx2, bo2] {
            into_result((g.be.free)(b)).unwrap();
        }
        for b in [bw, bx, bo] {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    // A prefill chunk's big ROCmFP4 products (wq_b, wo_b) at 512 columns on each tile
    // kind: as configured, bf16, streamed bf16 at 16 and 32 rows a warp (mode 0, 1, 3, 4).
    for (k, m) in [(1024usize, 32768usize), (8192, 4096)] {
        let n = 512usize;
        let (w, _) = random_dense(&mut rng, 100, m, k);
        let bw = g.buf(&w);
        let bx = g.buf(&f32_bytes(
            &(0..n * k).map(|_| rng.f32()).collect::<Vec<f32>>(),
        ));
        let bo = g.zeros(m * n * 4);
        let run = || {
            g.op(
                ops::MATMUL,
                &[
                    t(bw, 0, 100, 0, [k as u64, m as u64, 1, 1]),
                    t(bx, 0, types::F32, 0, [k as u64, n as u64, 1, 1]),
                    t(bo, 0, types::F32, 0, [m as u64, n as u64, 1, 1]),
                ],
            )
        };
        let shape = [k as u64, m as u64, n as u64];
        let rates = (2.0 * (m * k * n) as f64, w.len() as f64, copy_bw);
        let what = (" (rocmfp4)", "prefill_fp4");
        bench_tile_modes(&g, &prefill_modes, what, shape, rates, &mut json, &run);
        for b in [bw, bx, bo] {
            into_result((g.be.free)(b)).unwrap();
        }
    }
    println!("\nkernel counters (host launches / device-counted runs):");
    for (k, v) in g.counters() {
        println!("  {k:<28} {v}");
    }
    println!("\nparity: {}", if all_ok { "ALL OK" } else { "FAILURES" });
    println!("JSON [{}]", json.join(","));
}
