//! Encode-then-decode error on Gaussian data, per type, and the garbage-level error of
//! reading ROCmFP2 data with the other meaning (the reason type 107's meaning must be
//! chosen explicitly).

mod common;

use common::*;

/// Gaussian rows with a per-row standard deviation (0.01 .. 3), like weight matrices.
fn gaussian(n_rows: usize, k: usize, rng: &mut Rng) -> Vec<f32> {
    let mut x = Vec::with_capacity(n_rows * k);
    for _ in 0..n_rows {
        let s = 0.01 + 3.0 * rng.uniform() as f32;
        x.extend((0..k).map(|_| rng.normal() * s));
    }
    x
}

/// (type id, variant, label, NRMSE bound, top level). Measured with this encoder on
/// this data (5 seeds, 65,536 values each): FP4 0.0774-0.0780, FP4_FAST 0.0875-0.0883,
/// FP6 0.0194-0.0196, FP8 0.0055-0.0056, FP3 0.1716-0.1725, FP2 two-scale 0.352-0.358,
/// FP2 affine 0.311-0.313. Bounds are ~10-15% above the worst seen.
const BOUNDS: [(u32, u64, &str, f64, f32); 7] = [
    (100, 0, "Q4_0_ROCMFP4", 0.09, 10.0),
    (101, 0, "Q4_0_ROCMFP4_FAST", 0.10, 10.0),
    (102, 0, "Q6_0_ROCMFPX", 0.023, 31.0),
    (103, 0, "Q8_0_ROCMFPX", 0.0065, 127.0),
    (104, 0, "Q3_0_ROCMFPX", 0.19, 4.0),
    (107, 1, "Q2_0_ROCMFP2 two-scale", 0.39, 2.0),
    (107, 2, "Q2_0_ROCMFP2 affine", 0.35, 3.0),
];

#[test]
fn round_trip_nrmse_per_type() {
    let seed = seed_from_clock();
    println!("seed {seed}");
    let mut rng = Rng(seed);
    let x = gaussian(32, 2048, &mut rng);
    println!("{:<24} {:>8} {:>8}", "type", "NRMSE", "bound");
    let mut failures = vec![];
    for (id, variant, label, bound, _) in BOUNDS {
        let f = format(id);
        let blocks = encode(&f, variant, &x).unwrap();
        validate(&f, variant, &blocks).unwrap();
        let y = decode(&f, variant, &blocks).unwrap();
        let e = nrmse(&x, &y);
        println!("{label:<24} {e:>8.4} {bound:>8.4}");
        if e.is_nan() || e >= bound {
            failures.push(format!("{label}: NRMSE {e} >= {bound}"));
        }
    }
    assert!(failures.is_empty(), "seed {seed}: {failures:?}");
}

#[test]
fn fp2_meanings_are_not_interchangeable() {
    let seed = seed_from_clock();
    let mut rng = Rng(seed);
    let x = gaussian(32, 2048, &mut rng);
    let f = format(107);
    let mut rows = vec![];
    for (enc, dec) in [(1, 1), (2, 2), (2, 1), (1, 2)] {
        let blocks = encode(&f, enc, &x).unwrap();
        let y = decode(&f, dec, &blocks).unwrap();
        rows.push(((enc, dec), nrmse(&x, &y)));
    }
    let name = |v| if v == 1 { "two-scale" } else { "affine" };
    for ((enc, dec), e) in &rows {
        println!(
            "written {:<9} read {:<9} NRMSE {e:.4}",
            name(*enc),
            name(*dec)
        );
    }
    // Measured (5 seeds): matched 0.352-0.358 (two-scale) and 0.311-0.314 (affine);
    // affine data read as two-scale 1.23-1.28; two-scale data read as affine 0.60-0.65
    // (only that low because the two halves of i.i.d. Gaussian blocks get similar
    // scales, so reading e[1] as an offset roughly cancels the extra level; the spec's
    // ~0.75-0.80 was not measured on this data or with this encoder).
    let matched = |v| rows.iter().find(|r| r.0 == (v, v)).unwrap().1;
    for ((enc, dec), e) in rows.iter().copied() {
        if enc == dec {
            assert!(e < 0.40, "seed {seed}: matched {} {e}", name(enc));
        } else {
            assert!(
                e > 0.5 && e > 1.5 * matched(dec),
                "seed {seed}: {} read as {}: {e}",
                name(enc),
                name(dec)
            );
        }
    }
}

/// Non-finite inputs are quantised as 0; saturating inputs stay finite.
#[test]
fn encode_handles_non_finite_and_huge_inputs() {
    for (id, variant, label) in DECODABLE {
        let f = format(id);
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 31.5) * 0.1).collect();
        x[3] = f32::NAN;
        x[40] = f32::INFINITY;
        x[41] = f32::NEG_INFINITY;
        let y = decode(&f, variant, &encode(&f, variant, &x).unwrap()).unwrap();
        for i in [3, 40, 41] {
            let mut z = x.clone();
            z[3] = 0.0;
            z[40] = 0.0;
            z[41] = 0.0;
            // The decoded value sits where a 0 would: within one block step of 0.
            let step = z[(i / 32) * 32..(i / 32) * 32 + 32]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert!(y[i].abs() <= step, "{label} [{i}]: {}", y[i]);
        }
        // Far beyond the largest level (top level x 224): saturates at it.
        let top = BOUNDS
            .iter()
            .find(|b| (b.0, b.1) == (id, variant))
            .unwrap()
            .4;
        let big = vec![1e6f32; 32];
        let y = decode(&f, variant, &encode(&f, variant, &big).unwrap()).unwrap();
        assert!(y.iter().all(|v| *v == top * 224.0), "{label}: {y:?}");
        let zero = decode(&f, variant, &encode(&f, variant, &[0.0; 32]).unwrap()).unwrap();
        assert!(zero.iter().all(|v| *v == 0.0), "{label}: {zero:?}");
    }
}
