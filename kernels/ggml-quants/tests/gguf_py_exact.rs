//! Decode is bit-identical to the PyPI `gguf` package's numpy dequantisers:
//! on the committed random fixture, on fresh random blocks (when python gguf is
//! importable) and on real tensors of SmolLM2-135M (when the model is present).

mod common;

use std::path::Path;

use common::*;

/// Decodes every `<NAME>.blocks` in `dir` and compares with `<NAME>.f32`.
fn check_dir(dir: &Path) -> usize {
    let mut checked = 0;
    for f in formats() {
        let name = f.name.as_str();
        let blocks = std::fs::read(dir.join(format!("{name}.blocks")))
            .unwrap_or_else(|e| panic!("{name}: fixture missing in {}: {e}", dir.display()));
        let theirs = read_f32(&dir.join(format!("{name}.f32")));
        validate(&f, &blocks).unwrap_or_else(|e| panic!("{name}: fixture blocks invalid: {e}"));
        let ours = decode(&f, &blocks).unwrap();
        assert_bit_exact(name, f.block_weights as usize, &ours, &theirs);
        checked += ours.len();
    }
    checked
}

#[test]
fn committed_fixture_decodes_bit_exact() {
    let dir = crate_dir().join("tests/fixtures");
    let n = check_dir(&dir);
    println!("committed fixture: {n} values bit-exact with gguf-py across 14 types");
}

#[test]
fn fresh_random_blocks_decode_bit_exact() {
    let Some(versions) = python_gguf() else {
        println!("python3 with `gguf` not importable: used only the committed fixture");
        return;
    };
    let seed = seed_from_clock() % 1_000_000_007;
    let tmp = TempDir::new("fixtures");
    let script = crate_dir().join("tests/make_fixtures.py");
    run_python(&[
        script.to_str().unwrap(),
        "--out",
        tmp.0.to_str().unwrap(),
        "--seed",
        &seed.to_string(),
        "--blocks32",
        "1024",
        "--blocks256",
        "256",
        "--floats",
        "32768",
    ]);
    let n = check_dir(&tmp.0);
    println!("fresh random blocks (seed {seed}, {versions}): {n} values bit-exact");
}

#[test]
fn real_model_tensors_decode_bit_exact() {
    let model = crate_dir().join("../../.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !model.exists() {
        println!("skipped: {} not present", model.display());
        return;
    }
    let Some(versions) = python_gguf() else {
        println!("skipped: python3 with `gguf` not importable");
        return;
    };
    let tmp = TempDir::new("model");
    let script = crate_dir().join("tests/dump_gguf_tensors.py");
    let tensors = [
        "blk.0.ffn_up.weight",
        "blk.0.attn_k.weight",
        "token_embd.weight:64",
        "blk.0.attn_norm.weight",
    ];
    let mut args = vec![
        script.to_str().unwrap(),
        model.to_str().unwrap(),
        tmp.0.to_str().unwrap(),
    ];
    args.extend(tensors);
    run_python(&args);
    for spec in tensors {
        let name = spec.split(':').next().unwrap();
        let ty = std::fs::read_to_string(tmp.0.join(format!("{name}.type"))).unwrap();
        let mut it = ty.split_whitespace();
        let (ty_name, ty_id, row_len): (&str, u32, usize) = (
            it.next().unwrap(),
            it.next().unwrap().parse().unwrap(),
            it.next().unwrap().parse().unwrap(),
        );
        let f = formats().into_iter().find(|f| f.type_id == ty_id).unwrap();
        assert_eq!(f.name.as_str(), ty_name);
        let blocks = std::fs::read(tmp.0.join(format!("{name}.blocks"))).unwrap();
        let theirs = read_f32(&tmp.0.join(format!("{name}.f32")));
        validate(&f, &blocks).unwrap();
        let ours = decode(&f, &blocks).unwrap();
        assert_bit_exact(name, f.block_weights as usize, &ours, &theirs);
        println!(
            "{name} ({ty_name}, {} rows of {row_len}): {} values bit-exact with {versions}",
            ours.len() / row_len,
            ours.len()
        );

        // The dot kernel on real weights: same check as tests/dot_q8.rs.
        if f.block_weights > 1 {
            let mut rng = Rng(7);
            let x: Vec<f32> = (0..row_len).map(|_| rng.normal()).collect();
            let act: Vec<_> = x
                .chunks_exact(32)
                .map(moe_plugin_api::BlockQ8_1::quantize)
                .collect();
            let n_rows = ours.len() / row_len;
            let mut out = vec![0f32; n_rows];
            dot_q8(&f, &blocks, row_len, &act, &mut out).unwrap();
            for r in 0..n_rows {
                let w = &ours[r * row_len..(r + 1) * row_len];
                let (mut exact, mut mag, mut bound) = (0f64, 0f64, 0f64);
                for (i, wi) in w.iter().enumerate() {
                    exact += *wi as f64 * x[i] as f64;
                    mag += (*wi as f64 * x[i] as f64).abs();
                    bound += wi.abs() as f64 * act[i / 32].d as f64 * 0.5;
                }
                let err = (out[r] as f64 - exact).abs();
                assert!(
                    err <= bound + 1e-5 * mag,
                    "{name} row {r}: dot {} vs exact {exact} (bound {bound})",
                    out[r]
                );
            }
        }
    }
}
