//! `dot_q8` against decode-then-dot in f64, for every type, several shapes, every
//! compiled instruction-set variant.

mod common;

use common::*;
use moe_plugin_api::BlockQ8_1;
use moe_quant_ggml::{dot_q8_with_isa, Isa};

const KS: [usize; 5] = [32, 256, 576, 1536, 4096];
/// (rows, columns): batch-1 decode, a few columns, more columns than one group of 8,
/// and rows in groups of eight (the 32-weight formats' eight-row kernel) with a rest.
const SHAPES: [(usize, usize); 5] = [(1, 1), (7, 3), (3, 11), (8, 2), (19, 5)];

fn weights(
    f: &moe_plugin_api::QuantFormat,
    n_rows: usize,
    k: usize,
    rng: &mut Rng,
    realistic: bool,
) -> Vec<u8> {
    let bw = f.block_weights as usize;
    if realistic {
        // Output of our encoder on Gaussian weights with a per-row scale.
        let mut x = Vec::with_capacity(n_rows * k);
        for _ in 0..n_rows {
            let s = 0.02 + rng.uniform() as f32;
            x.extend((0..k).map(|_| rng.normal() * s));
        }
        encode(f, &x).unwrap()
    } else {
        random_valid_blocks(f, n_rows * k / bw, rng)
    }
}

fn activations(n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<BlockQ8_1>) {
    let x: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
    let act = x.chunks_exact(32).map(BlockQ8_1::quantize).collect();
    (x, act)
}

/// Runs the plugin table's dot and every ISA variant this CPU has, returning each
/// result (the caller checks every one against the reference). The x86 variants share one
/// lane layout, so they must agree bit for bit with each other (and the table uses the
/// best of them); the portable variant sums in a different order.
fn run_all(
    f: &moe_plugin_api::QuantFormat,
    rows: &[u8],
    k: usize,
    act: &[BlockQ8_1],
    n: usize,
) -> Vec<(String, Vec<f32>)> {
    let mut table = vec![f32::NAN; n];
    dot_q8(f, rows, k, act, &mut table).unwrap();
    let mut all = vec![];
    for isa in Isa::ALL
        .into_iter()
        .filter(|i| *i <= moe_quant_ggml::dot::best_isa())
    {
        let mut o = vec![f32::NAN; n];
        dot_q8_with_isa(f.type_id, isa, rows, k as u64, act, &mut o).unwrap();
        if isa > Isa::Baseline {
            for (i, (a, b)) in table.iter().zip(&o).enumerate() {
                assert!(
                    same(*a, *b),
                    "{} k={k} isa {isa:?} [{i}]: {b} vs table {a}",
                    f.name
                );
            }
        }
        all.push((isa.name().to_string(), o));
    }
    all.push(("table".into(), table));
    all
}

#[test]
fn dot_matches_f64_reference_on_quantised_activations() {
    let seed = seed_from_clock();
    let mut rng = Rng(seed);
    println!(
        "seed {seed}, best isa {:?}",
        moe_quant_ggml::dot::best_isa()
    );
    for f in formats() {
        let bw = f.block_weights as usize;
        let mut worst = 0f64;
        for k in KS.into_iter().filter(|k| k % bw == 0) {
            for (n_rows, n_cols) in SHAPES {
                for realistic in [true, false] {
                    let rows = weights(&f, n_rows, k, &mut rng, realistic);
                    let w = decode(&f, &rows).unwrap();
                    let (_, mut act) = activations(n_cols * k, &mut rng);
                    // Make `sum` agree with the codes, so the reference below is the
                    // exact value of what the kernel computes (see the next test for
                    // the real q8_1 sums).
                    for a in act.iter_mut() {
                        let s: i32 = a.qs.iter().map(|&q| q as i32).sum();
                        a.sum = (a.d as f64 * s as f64) as f32;
                    }
                    for (isa, out) in run_all(&f, &rows, k, &act, n_rows * n_cols) {
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
                                rel <= 1e-5,
                                "{} {isa} k={k} rows={n_rows} cols={n_cols} realistic={realistic} \
                                 [{c},{r}]: {got} vs {exact} (relative to sum|terms| {rel:e})",
                                f.name
                            );
                            }
                        }
                    }
                }
            }
        }
        println!(
            "{:>5}: worst |dot - f64 ref| / sum|w*a| = {worst:.2e}",
            f.name.as_str()
        );
    }
}

/// With the real q8_1 blocks (`sum` = sum of the original x), the result is within the
/// activation quantisation error of the exact f32 dot: |sum v (x - d q)| <= sum |v| d / 2,
/// v being what multiplies the codes: the weight, or for the formats with a block offset
/// (Q4_1, Q5_1, the K-quants' mins; the offset times the exact `sum`) the weight less the
/// offset, which our encoder puts at the block's smallest weight (code 0). |v| is taken
/// as the largest of |w| and |w - min| over its 16 and its 32 weights.
#[test]
fn dot_is_within_q8_error_of_exact_dot() {
    let mut rng = Rng(seed_from_clock());
    for f in formats() {
        let bw = f.block_weights as usize;
        for k in KS.into_iter().filter(|k| k % bw == 0) {
            let (n_rows, n_cols) = (4, 2);
            let rows = weights(&f, n_rows, k, &mut rng, true);
            let w = decode(&f, &rows).unwrap();
            let (x, act) = activations(n_cols * k, &mut rng);
            for (isa, out) in run_all(&f, &rows, k, &act, n_rows * n_cols) {
                for c in 0..n_cols {
                    for r in 0..n_rows {
                        let (mut exact, mut mag, mut bound) = (0f64, 0f64, 0f64);
                        let row = &w[r * k..(r + 1) * k];
                        let low = |i: usize, g: usize| {
                            row[i / g * g..][..g]
                                .iter()
                                .fold(f64::INFINITY, |a, &b| a.min(b as f64))
                        };
                        for i in 0..k {
                            let (wi, xi) = (row[i] as f64, x[c * k + i] as f64);
                            exact += wi * xi;
                            mag += (wi * xi).abs();
                            let v = wi
                                .abs()
                                .max((wi - low(i, 16)).abs())
                                .max((wi - low(i, 32)).abs());
                            bound += v * act[c * k / 32 + i / 32].d as f64 * 0.5;
                        }
                        let got = out[c * n_rows + r] as f64;
                        assert!(
                            (got - exact).abs() <= bound + 1e-5 * mag,
                            "{} {isa} k={k} [{c},{r}]: {got} vs exact {exact}, bound {bound}",
                            f.name
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn zero_rows_and_empty_calls() {
    for f in formats() {
        let k = 256.max(f.block_weights as usize);
        let act = vec![BlockQ8_1::default(); k / 32];
        let mut out: Vec<f32> = vec![];
        dot_q8(&f, &[], k, &act, &mut out).unwrap();
        let rows = encode(&f, &vec![0.0; k]).unwrap();
        let mut out = vec![1f32];
        dot_q8(&f, &rows, k, &act, &mut out).unwrap();
        assert_eq!(out[0], 0.0, "{}", f.name);
    }
}
