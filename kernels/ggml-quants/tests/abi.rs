//! The plugin as the host sees it: root module, settings, validation, and errors (never
//! panics) for every malformed call.

mod common;

use common::*;
use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut, RStr},
    into_result, AbiVersion, BlockQ8_1, PluginKind,
};

const EXPECTED: [(u32, &str, u32, u32); 14] = [
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (30, "BF16", 1, 2),
    (39, "MXFP4", 32, 17),
];

#[test]
fn root_module_describes_the_plugin() {
    let root = moe_quant_ggml::get_root_module();
    assert_eq!(root.abi(), AbiVersion::CURRENT);
    let info = (root.info())();
    assert_eq!(info.name.as_str(), "ggml-quants");
    assert_eq!(info.version.as_str(), env!("CARGO_PKG_VERSION"));
    assert_eq!(info.kind, PluginKind::QuantFormat);
    assert!((root.backend())().is_none());
    assert!((root.policies())().is_empty());
    let formats = (root.quant_formats())();
    let got: Vec<_> = formats
        .iter()
        .map(|f| (f.type_id, f.name.as_str(), f.block_weights, f.block_bytes))
        .collect();
    assert_eq!(got, EXPECTED.to_vec());
    for f in formats.iter() {
        assert_eq!(into_result((f.resolve_variant)(RStr::from("{}"))), Ok(0));
    }
}

#[test]
fn configure_accepts_nothing_but_empty_settings() {
    let configure = moe_quant_ggml::get_root_module().configure();
    assert!(into_result(configure(RStr::from(""))).is_ok());
    assert!(into_result(configure(RStr::from("# just a comment\n"))).is_ok());
    let e = into_result(configure(RStr::from("threads = 4\nfast = true"))).unwrap_err();
    assert!(
        e.contains("`fast`") && e.contains("`threads`") && e.contains("no settings"),
        "{e}"
    );
    let e = into_result(configure(RStr::from("= nonsense ["))).unwrap_err();
    assert!(e.contains("not valid TOML"), "{e}");
}

#[test]
fn validate_rejects_non_finite_scales() {
    let mut rng = Rng(1);
    for f in formats() {
        let name = f.name.as_str();
        let bb = f.block_bytes as usize;
        let blocks = random_valid_blocks(&f, 3, &mut rng);
        validate(&f, &blocks).unwrap();
        for &off in scale_offsets(name) {
            for (bits, kind) in [
                (0x7e00u16, "NaN"),
                (0x7c00, "infinite"),
                (0xfc00, "infinite"),
                (0xfd01, "NaN"),
            ] {
                let mut bad = blocks.clone();
                bad[2 * bb + off..2 * bb + off + 2].copy_from_slice(&bits.to_le_bytes());
                let e = validate(&f, &bad).unwrap_err();
                assert!(
                    e.contains("block 2") && e.contains(kind),
                    "{name} @{off} {bits:04x}: {e}"
                );
            }
        }
        if name == "MXFP4" {
            let mut bad = blocks.clone();
            bad[bb] = 0xff;
            let e = validate(&f, &bad).unwrap_err();
            assert!(e.contains("block 1") && e.contains("0xFF"), "{e}");
            bad[bb] = 0xfe; // 2^126: large but a number
            validate(&f, &bad).unwrap();
        }
        if f.block_weights == 1 {
            // Float tensors: any bit pattern, NaN and infinities included, is accepted.
            let special: Vec<u8> = (0..64u8)
                .map(|i| if i % 2 == 1 { 0xff } else { 0x80 | i })
                .collect();
            validate(&f, &special).unwrap();
        }
    }
}

#[test]
fn every_function_errors_on_bad_lengths_and_variants() {
    for f in formats() {
        let name = f.name.as_str();
        let (bw, bb) = (f.block_weights as usize, f.block_bytes as usize);
        let k = 256;
        let rows = encode(&f, &vec![0.25; 2 * k]).unwrap(); // 2 rows of k
        let act = vec![BlockQ8_1::default(); 3 * k / 32]; // 3 columns
        let ok = |r: Result<(), String>, what: &str| {
            r.unwrap_or_else(|e| panic!("{name} {what}: {e}"));
        };
        let err = |r: Result<(), String>, what: &str| {
            let e = r.expect_err(&format!("{name} {what}: accepted"));
            assert!(
                e.contains(name) && !e.contains("panicked"),
                "{name} {what}: {e}"
            );
        };

        // validate
        ok(validate(&f, &rows), "validate");
        ok(validate(&f, &[]), "validate empty");
        if bb > 1 {
            err(validate(&f, &rows[..bb + 1]), "validate partial block");
        }
        err(
            into_result((f.validate)(1, RSlice::from_slice(&rows))),
            "validate variant 1",
        );

        // decode
        let mut out = vec![0f32; 2 * k];
        let call = |blocks: &[u8], out: &mut [f32], variant| {
            into_result((f.decode)(
                variant,
                RSlice::from_slice(blocks),
                RSliceMut::from_mut_slice(out),
            ))
        };
        ok(call(&rows, &mut out, 0), "decode");
        err(call(&rows, &mut out[1..], 0), "decode short output");
        err(
            call(&rows, &mut vec![0f32; 2 * k + 1], 0),
            "decode long output",
        );
        if bb > 1 {
            err(
                call(&rows[..rows.len() - 1], &mut out, 0),
                "decode partial block",
            );
        }
        err(call(&rows, &mut out, 7), "decode variant 7");

        // encode
        let x = vec![0.5f32; 2 * k];
        let call = |x: &[f32], out: &mut [u8], variant| {
            into_result((f.encode)(
                variant,
                RSlice::from_slice(x),
                RSliceMut::from_mut_slice(out),
            ))
        };
        let mut bytes = vec![0u8; rows.len()];
        ok(call(&x, &mut bytes, 0), "encode");
        err(call(&x, &mut bytes[1..], 0), "encode short output");
        err(call(&x[..k], &mut bytes, 0), "encode long output");
        if bw > 1 {
            err(
                call(&x[1..], &mut bytes[..rows.len() - bb], 0),
                "encode partial block",
            );
        }
        err(call(&x, &mut bytes, 1), "encode variant 1");

        // dot_q8
        let mut out = vec![0f32; 6];
        ok(dot_q8(&f, &rows, k, &act, &mut out), "dot");
        err(
            dot_q8(&f, &rows, k, &act, &mut out[1..]),
            "dot short output",
        );
        err(
            dot_q8(&f, &rows, k, &act[1..], &mut out),
            "dot partial column",
        );
        err(
            dot_q8(&f, &rows[..rows.len() - 1], k, &act, &mut out),
            "dot partial row",
        );
        err(dot_q8(&f, &rows, 0, &act, &mut out), "dot k = 0");
        err(
            dot_q8(&f, &rows, k + 16, &act, &mut out),
            "dot k not a multiple of 32",
        );
        if bw == 256 {
            err(
                dot_q8(&f, &rows, 96, &act, &mut out),
                "dot k not a multiple of 256",
            );
        }
        err(
            into_result((f.dot_q8)(
                3,
                RSlice::from_slice(&rows),
                k as u64,
                RSlice::from_slice(&act),
                RSliceMut::from_mut_slice(&mut out),
            )),
            "dot variant 3",
        );
    }
}

/// The built cdylib loads through abi_stable's layout checks like the host loads it
/// (skipped when cargo has not produced the .so next to this test binary).
#[test]
fn cdylib_loads_through_abi_stable() {
    use moe_plugin_api::{abi_stable::library::lib_header_from_path, PluginRef};
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let so = dir.join(format!(
        "{}moe_quant_ggml{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    if !so.exists() {
        println!("skipped: {} not built", so.display());
        return;
    }
    let header = lib_header_from_path(&so).unwrap_or_else(|e| panic!("{}: {e}", so.display()));
    let root = header
        .init_root_module::<PluginRef>()
        .unwrap_or_else(|e| panic!("{}: {e}", so.display()));
    assert_eq!(root.abi(), AbiVersion::CURRENT);
    assert!(into_result((root.configure())(RStr::from(""))).is_ok());
    let formats = (root.quant_formats())();
    assert_eq!(formats.len(), EXPECTED.len());
    // One call through the loaded library: decode a Q8_0 block of 1s.
    let q8 = formats.iter().find(|f| f.name.as_str() == "Q8_0").unwrap();
    let mut block = vec![0u8; 34];
    block[0..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
    block[2..].fill(2);
    let mut out = vec![0f32; 32];
    into_result((q8.decode)(
        0,
        RSlice::from_slice(&block),
        RSliceMut::from_mut_slice(&mut out),
    ))
    .unwrap();
    assert!(out.iter().all(|v| *v == 1.0));
    println!("loaded {}", so.display());
}
