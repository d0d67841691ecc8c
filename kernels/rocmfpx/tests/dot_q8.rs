//! `dot_q8` against decode-then-dot in f64, for every decodable type and variant, several
//! k and shapes, every compiled instruction-set variant.

mod common;

use common::*;
use moe_plugin_api::BlockQ8_1;
use moe_quant_rocmfpx::{dot::best_isa, dot_q8_with_isa, Isa};

const KS: [usize; 5] = [32, 64, 96, 2048, 4096];
/// (rows, columns): batch-1 decode, a few columns, more than one group of 8 columns.
const SHAPES: [(usize, usize); 3] = [(1, 1), (7, 3), (3, 11)];

fn weights(
    f: &moe_plugin_api::QuantFormat,
    v: u64,
    n: usize,
    rng: &mut Rng,
    real: bool,
) -> Vec<u8> {
    if real {
        let s = 0.02 + rng.uniform() as f32;
        let x: Vec<f32> = (0..n).map(|_| rng.normal() * s).collect();
        encode(f, v, &x).unwrap()
    } else {
        random_valid_blocks(f, n / 32, rng)
    }
}

fn activations(n: usize, rng: &mut Rng, real: bool) -> Vec<BlockQ8_1> {
    if real {
        let x: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
        x.chunks_exact(32).map(BlockQ8_1::quantize).collect()
    } else {
        // Any i8 (-128 included) and any scale; `sum` is irrelevant to the kernels.
        (0..n / 32)
            .map(|_| BlockQ8_1 {
                d: rng.uniform() as f32 * 0.1,
                sum: f32::NAN,
                qs: std::array::from_fn(|_| rng.next_u64() as i8),
            })
            .collect()
    }
}

#[test]
fn dot_matches_f64_reference() {
    let seed = seed_from_clock();
    let mut rng = Rng(seed);
    println!("seed {seed}, best isa {:?}", best_isa());
    for (id, variant, label) in DECODABLE {
        let f = format(id);
        let mut worst = 0f64;
        for k in KS {
            for (n_rows, n_cols) in SHAPES {
                for real in [true, false] {
                    let rows = weights(&f, variant, n_rows * k, &mut rng, real);
                    let w = decode(&f, variant, &rows).unwrap();
                    let act = activations(n_cols * k, &mut rng, real);
                    let n = n_rows * n_cols;
                    let mut table = vec![f32::NAN; n];
                    dot_q8(&f, variant, &rows, k, &act, &mut table).unwrap();
                    let mut results = vec![("table".to_string(), table.clone())];
                    for isa in Isa::ALL.into_iter().filter(|i| *i <= best_isa()) {
                        let mut o = vec![f32::NAN; n];
                        dot_q8_with_isa(id, variant, isa, &rows, k as u64, &act, &mut o).unwrap();
                        // No FMA, same scalar float order: every variant is bit-identical.
                        for (a, b) in table.iter().zip(&o) {
                            assert_eq!(a.to_bits(), b.to_bits(), "{label} {isa:?} k={k}");
                        }
                        results.push((format!("{isa:?}"), o));
                    }
                    for (who, out) in results {
                        for c in 0..n_cols {
                            for r in 0..n_rows {
                                let (mut exact, mut mag) = (0f64, 0f64);
                                for i in 0..k {
                                    let a = &act[c * k / 32 + i / 32];
                                    let t =
                                        w[r * k + i] as f64 * (a.d as f64 * a.qs[i % 32] as f64);
                                    exact += t;
                                    mag += t.abs();
                                }
                                let got = out[c * n_rows + r] as f64;
                                let rel = (got - exact).abs() / mag.max(f64::MIN_POSITIVE);
                                worst = worst.max(rel);
                                assert!(
                                    rel <= 1e-6,
                                    "{label} {who} k={k} {n_rows}x{n_cols} real={real} [{c},{r}]: \
                                     {got} vs {exact} (error / sum|terms| = {rel:e}), seed {seed}"
                                );
                            }
                        }
                    }
                }
            }
        }
        println!("{label:<24} worst |error| / sum|terms| = {worst:.2e}");
    }
}

/// A column gives the same bits whether it is computed alone or in a batch.
#[test]
fn batching_does_not_change_results() {
    let mut rng = Rng(3);
    let k = 2048;
    for (id, variant, label) in DECODABLE {
        let f = format(id);
        let rows = weights(&f, variant, 5 * k, &mut rng, true);
        let act = activations(13 * k, &mut rng, true);
        let mut all = vec![0f32; 5 * 13];
        dot_q8(&f, variant, &rows, k, &act, &mut all).unwrap();
        for c in 0..13 {
            let mut one = vec![0f32; 5];
            dot_q8(
                &f,
                variant,
                &rows,
                k,
                &act[c * k / 32..(c + 1) * k / 32],
                &mut one,
            )
            .unwrap();
            for r in 0..5 {
                assert_eq!(
                    one[r].to_bits(),
                    all[c * 5 + r].to_bits(),
                    "{label} [{c},{r}]"
                );
            }
        }
    }
}

/// Affine ROCmFP2 follows upstream's mat-vec form: per half,
/// d * (S * sum (c - 1) q + (S - O) * sum q), which is d * (S * sum c q - O * sum q).
#[test]
fn affine_fp2_matches_upstream_mmvq_formula() {
    let f = format(107);
    let mut rng = Rng(11);
    for _ in 0..200 {
        let mut blk = rng.bytes(10);
        blk[8] = (rng.next_u64() % 0x7f) as u8;
        blk[9] = (rng.next_u64() % 0x7f) as u8;
        let a = activations(32, &mut rng, false)[0];
        let s = moe_quant_rocmfpx::ue4m3::decode(blk[8]) as f64;
        let o = moe_quant_rocmfpx::ue4m3::decode(blk[9]) as f64;
        let mut want = 0f64;
        for h in 0..2 {
            let (mut sumi, mut sumq) = (0i64, 0i64);
            for i in 16 * h..16 * h + 16 {
                let c = ((blk[i / 4] >> (2 * (i % 4))) & 3) as i64;
                sumi += (c - 1) * a.qs[i] as i64;
                sumq += a.qs[i] as i64;
            }
            want += a.d as f64 * (s * sumi as f64 + (s - o) * sumq as f64);
        }
        let mut got = [0f32];
        dot_q8(&f, 2, &blk, 32, &[a], &mut got).unwrap();
        let tol = 1e-6 * (a.d as f64 * (3.0 * s + o) * 32.0 * 128.0);
        assert!(
            (got[0] as f64 - want).abs() <= tol,
            "{blk:?}: {} vs {want}",
            got[0]
        );
    }
}
