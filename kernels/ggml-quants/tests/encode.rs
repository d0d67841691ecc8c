//! Reference encoders: valid blocks that decode close to the input.

mod common;

use common::*;

/// Upper bounds on NRMSE = rms(decode(encode(x)) - x) / rms(x) for Gaussian data whose
/// scale changes every 256 values (1e-3 to 10). Typical values measured over several seeds
/// are in the comments (they vary by ~3%); the bounds leave ~25% headroom. Each extra bit
/// roughly halves the error; the K-quants pay a little for quantised sub-block scales;
/// Q2_K (4 levels, plain min/max, no scale search) and MXFP4 (e2m1 grid, power-of-two
/// scale) are the coarsest.
const NRMSE_BOUNDS: [(&str, f64); 14] = [
    ("F32", 0.0),     // exact
    ("F16", 2.7e-4),  // 2.05e-4 (11-bit significand)
    ("BF16", 2.1e-3), // 1.65e-3 (8-bit significand)
    ("Q4_0", 0.11),   // 0.086
    ("Q4_1", 0.10),   // 0.079
    ("Q5_0", 0.055),  // 0.043
    ("Q5_1", 0.049),  // 0.038
    ("Q8_0", 0.0068), // 0.0053
    ("Q2_K", 0.42),   // 0.33
    ("Q3_K", 0.20),   // 0.159
    ("Q4_K", 0.10),   // 0.079
    ("Q5_K", 0.049),  // 0.039
    ("Q6_K", 0.025),  // 0.0192
    ("MXFP4", 0.145), // 0.114
];

fn nrmse(x: &[f32], y: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        e += (*a as f64 - *b as f64).powi(2);
        s += (*a as f64).powi(2);
    }
    (e / s).sqrt()
}

#[test]
fn round_trip_error_is_bounded() {
    let seed = seed_from_clock();
    let mut rng = Rng(seed);
    let n = 256 * 64;
    let x: Vec<f32> = (0..n / 256)
        .flat_map(|_| {
            let s = 10f32.powf(rng.uniform() as f32 * 4.0 - 3.0);
            (0..256).map(|_| rng.normal() * s).collect::<Vec<_>>()
        })
        .collect();
    println!("seed {seed}");
    for f in formats() {
        let name = f.name.as_str();
        let bound = NRMSE_BOUNDS.iter().find(|(n, _)| *n == name).unwrap().1;
        let blocks = encode(&f, &x).unwrap();
        validate(&f, &blocks)
            .unwrap_or_else(|e| panic!("{name}: encoder made an invalid block: {e}"));
        let y = decode(&f, &blocks).unwrap();
        let e = nrmse(&x, &y);
        println!("{name:>5}: NRMSE {e:.3e} (bound {bound:.1e})");
        assert!(e <= bound, "{name}: NRMSE {e} above {bound}");
    }
}

#[test]
fn awkward_blocks_round_trip() {
    let k = 256;
    let cases: Vec<(&str, Vec<f32>)> = vec![
        ("zeros", vec![0.0; k]),
        ("constant", vec![0.75; k]),
        ("negative constant", vec![-3.0; k]),
        (
            "one spike",
            (0..k).map(|i| if i == 77 { 5.0 } else { 0.0 }).collect(),
        ),
        (
            "all positive",
            (0..k).map(|i| 1.0 + i as f32 / 256.0).collect(),
        ),
        ("tiny", (0..k).map(|i| (i as f32 - 128.0) * 1e-7).collect()),
        (
            "large",
            (0..k).map(|i| (i as f32 - 128.0) * 100.0).collect(),
        ),
    ];
    for f in formats() {
        for (what, x) in &cases {
            let blocks = encode(&f, x).unwrap_or_else(|e| panic!("{} {what}: {e}", f.name));
            validate(&f, &blocks).unwrap();
            let y = decode(&f, &blocks).unwrap();
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in x.iter().zip(&y) {
                // Coarsest types (Q2_K, MXFP4) may be off by up to about half a block's range.
                assert!(
                    (a - b).abs() <= 0.55 * amax + 1e-6,
                    "{} {what}: {a} decoded as {b}",
                    f.name
                );
            }
            if *what == "zeros" {
                assert!(y.iter().all(|v| *v == 0.0), "{} zeros", f.name);
            }
        }
    }
}

#[test]
fn float_types_round_trip_exactly_where_representable() {
    let x: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -2.5,
        65280.0,
        2f32.powi(-14),
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.5,
    ];
    for name in ["F32", "F16", "BF16"] {
        let f = format(name);
        let y = decode(&f, &encode(&f, &x).unwrap()).unwrap();
        for (a, b) in x.iter().zip(&y) {
            assert_eq!(a.to_bits(), b.to_bits(), "{name}: {a} -> {b}");
        }
        let nan = decode(&f, &encode(&f, &[f32::NAN]).unwrap()).unwrap();
        assert!(nan[0].is_nan(), "{name}: NaN stays NaN");
    }
}

#[test]
fn encode_refuses_what_it_cannot_represent() {
    for f in formats().into_iter().filter(|f| f.block_weights > 1) {
        let bw = f.block_weights as usize;
        let mut x = vec![0.5f32; bw * 2];
        x[bw + 3] = f32::NAN;
        let e = encode(&f, &x).unwrap_err();
        assert!(
            e.contains("block 1") && e.contains("finite"),
            "{}: {e}",
            f.name
        );
        x[bw + 3] = f32::INFINITY;
        assert!(encode(&f, &x).is_err(), "{}", f.name);
        if f.name.as_str() != "MXFP4" {
            // Scales are f16: values this large overflow them.
            let big = vec![1e30f32; bw];
            let e = encode(&f, &big).unwrap_err();
            assert!(e.contains("f16"), "{}: {e}", f.name);
        }
    }
}
