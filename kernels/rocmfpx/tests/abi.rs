//! The plugin as the host sees it: root module, settings, type 107's meaning, the
//! unsupported adaptive types, and errors (never panics) for every malformed call.
//!
//! Nothing here configures an `fp2` setting (that is process-wide state); see
//! tests/settings.rs for that.

mod common;

use common::*;
use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut, RStr},
    into_result, AbiVersion, BlockQ8_1, PluginKind,
};
use moe_quant_rocmfpx::fp2::{self, Fp2Mode};

const EXPECTED: [(u32, &str, u32, u32); 8] = [
    (100, "Q4_0_ROCMFP4", 32, 18),
    (101, "Q4_0_ROCMFP4_FAST", 32, 17),
    (102, "Q6_0_ROCMFPX", 32, 26),
    (103, "Q8_0_ROCMFPX", 32, 33),
    (104, "Q3_0_ROCMFPX", 32, 14),
    (105, "Q3_1_ROCMFP3_MIX", 32, 14),
    (106, "Q2_1_ROCMFP2_MIX", 32, 10),
    (107, "Q2_0_ROCMFP2", 32, 10),
];

#[test]
fn root_module_describes_the_plugin() {
    let root = moe_quant_rocmfpx::get_root_module();
    assert_eq!(root.abi(), AbiVersion::CURRENT);
    let info = (root.info())();
    assert_eq!(info.name.as_str(), "rocmfpx");
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
    for f in formats.iter().filter(|f| f.type_id <= 104) {
        assert_eq!(resolve(f, "{}"), Ok(0), "{}", f.name);
        assert_eq!(resolve(f, r#"{"rocmfpx.fp2_mode": "affine"}"#), Ok(0));
    }
}

#[test]
fn settings_accept_only_fp2() {
    use moe_quant_rocmfpx::parse_settings as p;
    assert_eq!(p(""), Ok(None));
    assert_eq!(p("# a comment\n"), Ok(None));
    assert_eq!(p("fp2 = \"affine\""), Ok(Some(Fp2Mode::Affine)));
    assert_eq!(p("fp2 = \"two-scale\""), Ok(Some(Fp2Mode::TwoScale)));
    let e = p("fp2 = \"affine\"\nthreads = 4\nfast = true").unwrap_err();
    assert!(
        e.contains("`fast`") && e.contains("`threads`") && e.contains("`fp2`"),
        "{e}"
    );
    let e = p("fp2 = \"Affine\"").unwrap_err();
    assert!(
        e.contains("\"Affine\"") && e.contains("\"two-scale\""),
        "{e}"
    );
    let e = p("fp2 = 2").unwrap_err();
    assert!(e.contains("not a string"), "{e}");
    let e = p("= nonsense [").unwrap_err();
    assert!(e.contains("not valid TOML"), "{e}");

    // Through the root module: errors come back as errors (an empty table is accepted and
    // leaves no setting, which is also the initial state).
    let configure = moe_quant_rocmfpx::get_root_module().configure();
    assert!(into_result(configure(RStr::from(""))).is_ok());
    let e = into_result(configure(RStr::from("fp2 = \"both\""))).unwrap_err();
    assert!(e.contains("rocmfpx") && e.contains("\"both\""), "{e}");
    let e = into_result(configure(RStr::from("colour = 1"))).unwrap_err();
    assert!(e.contains("`colour`"), "{e}");
}

#[test]
fn fp2_meaning_from_setting_and_key() {
    let key = |v: &str| {
        format!(
            r#"{{"general.architecture": "deepseek4", "{}": {v}}}"#,
            fp2::METADATA_KEY
        )
    };
    // Neither: the error says how to choose, both ways.
    for meta in ["{}", r#"{"general.file_type": 118, "general.name": "x"}"#] {
        let e = fp2::resolve(None, meta).unwrap_err();
        for want in [
            "107",
            "two-scale",
            "affine",
            "fp2 = \"affine\"",
            "plugins.toml",
            "rocmfpx.fp2_mode",
        ] {
            assert!(e.contains(want), "missing {want:?} in: {e}");
        }
    }
    // The key alone.
    assert_eq!(
        fp2::resolve(None, &key("\"affine\"")),
        Ok(fp2::VARIANT_AFFINE)
    );
    assert_eq!(
        fp2::resolve(None, &key("\"two-scale\"")),
        Ok(fp2::VARIANT_TWO_SCALE)
    );
    // The setting alone.
    assert_eq!(fp2::resolve(Some(Fp2Mode::Affine), "{}"), Ok(2));
    assert_eq!(fp2::resolve(Some(Fp2Mode::TwoScale), "{}"), Ok(1));
    // Both, agreeing.
    assert_eq!(
        fp2::resolve(Some(Fp2Mode::Affine), &key("\"affine\"")),
        Ok(2)
    );
    assert_eq!(
        fp2::resolve(Some(Fp2Mode::TwoScale), &key("\"two-scale\"")),
        Ok(1)
    );
    // Both, disagreeing.
    for (s, k) in [
        (Fp2Mode::Affine, "\"two-scale\""),
        (Fp2Mode::TwoScale, "\"affine\""),
    ] {
        let e = fp2::resolve(Some(s), &key(k)).unwrap_err();
        assert!(e.contains("contradicts") && e.contains(s.as_str()), "{e}");
    }
    // A key with a bad value or type is an error even when the setting would decide.
    for (v, want) in [
        ("\"Affine\"", "\"Affine\""),
        ("2", "not a string"),
        ("null", "not a string"),
    ] {
        for s in [None, Some(Fp2Mode::Affine)] {
            let e = fp2::resolve(s, &key(v)).unwrap_err();
            assert!(e.contains(want) && e.contains(fp2::METADATA_KEY), "{e}");
        }
    }
    let e = fp2::resolve(Some(Fp2Mode::Affine), "[1, 2]").unwrap_err();
    assert!(e.contains("not a JSON object"), "{e}");

    // Through the table (no setting configured in this test binary).
    let f = format(107);
    let e = resolve(&f, "{}").unwrap_err();
    assert!(
        e.contains("plugins.toml") && e.contains(fp2::METADATA_KEY),
        "{e}"
    );
    assert_eq!(resolve(&f, &key("\"affine\"")), Ok(2));
    assert_eq!(resolve(&f, &key("\"two-scale\"")), Ok(1));
}

#[test]
fn adaptive_types_are_refused_clearly() {
    for (id, key) in [
        (105, "deepseek4.p4mix.sidecar"),
        (106, "deepseek4.gumix.sidecar"),
    ] {
        let f = format(id);
        let name = f.name.to_string();
        let e = resolve(&f, "{}").unwrap_err();
        for want in [
            &format!("type {id}"),
            name.as_str(),
            "codebook",
            key,
            "sidecar",
            "not supported yet",
        ] {
            assert!(e.contains(want), "missing {want:?} in: {e}");
        }
        let bb = f.block_bytes as usize;
        let blocks = vec![0u8; 2 * bb];
        let act = vec![BlockQ8_1::default(); 1];
        for v in [0, 1, 2] {
            let mut out32 = vec![0f32; 64];
            let mut bytes = vec![0u8; 2 * bb];
            let mut dots = [0f32; 2];
            let errs = [
                validate(&f, v, &blocks),
                into_result((f.decode)(
                    v,
                    RSlice::from_slice(&blocks),
                    RSliceMut::from_mut_slice(&mut out32),
                )),
                into_result((f.encode)(
                    v,
                    RSlice::from_slice(&[0.0f32; 64]),
                    RSliceMut::from_mut_slice(&mut bytes),
                )),
                dot_q8(&f, v, &blocks[..bb], 32, &act, &mut dots[..1]),
            ];
            for e in errs {
                let e = e.unwrap_err();
                assert!(
                    e.contains(&name) && e.contains("not supported yet") && !e.contains("panicked"),
                    "{e}"
                );
            }
        }
    }
}

#[test]
fn every_function_errors_on_bad_lengths_and_variants() {
    for (id, variant, label) in DECODABLE {
        let f = format(id);
        let name = f.name.as_str();
        let bb = f.block_bytes as usize;
        let k = 256;
        let rows = encode(&f, variant, &vec![0.25; 2 * k]).unwrap(); // 2 rows of k
        let act = vec![BlockQ8_1::default(); 3 * k / 32]; // 3 columns
        let ok = |r: Result<(), String>, what: &str| {
            r.unwrap_or_else(|e| panic!("{label} {what}: {e}"));
        };
        let err = |r: Result<(), String>, what: &str| {
            let e = r.expect_err(&format!("{label} {what}: accepted"));
            assert!(
                e.contains(name) && !e.contains("panicked"),
                "{label} {what}: {e}"
            );
        };
        // Variants that do not exist for this type.
        let bad_variants: &[u64] = if id == 107 {
            &[0, 3, u64::MAX]
        } else {
            &[1, 2, 7]
        };

        // validate
        ok(validate(&f, variant, &rows), "validate");
        ok(validate(&f, variant, &[]), "validate empty");
        err(
            validate(&f, variant, &rows[..bb + 1]),
            "validate partial block",
        );
        for &v in bad_variants {
            err(validate(&f, v, &rows), &format!("validate variant {v}"));
        }

        // decode
        let call = |blocks: &[u8], out: &mut [f32], v| {
            into_result((f.decode)(
                v,
                RSlice::from_slice(blocks),
                RSliceMut::from_mut_slice(out),
            ))
        };
        let mut out = vec![0f32; 2 * k];
        ok(call(&rows, &mut out, variant), "decode");
        ok(call(&[], &mut [], variant), "decode empty");
        err(call(&rows, &mut out[1..], variant), "decode short output");
        err(
            call(&rows, &mut vec![0f32; 2 * k + 1], variant),
            "decode long output",
        );
        err(
            call(&rows[..rows.len() - 1], &mut out, variant),
            "decode partial block",
        );
        for &v in bad_variants {
            err(call(&rows, &mut out, v), &format!("decode variant {v}"));
        }

        // encode
        let call = |x: &[f32], out: &mut [u8], v| {
            into_result((f.encode)(
                v,
                RSlice::from_slice(x),
                RSliceMut::from_mut_slice(out),
            ))
        };
        let x = vec![0.5f32; 2 * k];
        let mut bytes = vec![0u8; rows.len()];
        ok(call(&x, &mut bytes, variant), "encode");
        err(call(&x, &mut bytes[1..], variant), "encode short output");
        err(call(&x[..k], &mut bytes, variant), "encode long output");
        err(
            call(&x[1..], &mut bytes[..rows.len() - bb], variant),
            "encode partial block",
        );
        for &v in bad_variants {
            err(call(&x, &mut bytes, v), &format!("encode variant {v}"));
        }

        // dot_q8
        let mut out = vec![0f32; 6];
        ok(dot_q8(&f, variant, &rows, k, &act, &mut out), "dot");
        err(
            dot_q8(&f, variant, &rows, k, &act, &mut out[1..]),
            "dot short output",
        );
        err(
            dot_q8(&f, variant, &rows, k, &act, &mut [0f32; 7]),
            "dot long output",
        );
        err(
            dot_q8(&f, variant, &rows, k, &act[1..], &mut out),
            "dot partial column",
        );
        err(
            dot_q8(&f, variant, &rows[..rows.len() - 1], k, &act, &mut out),
            "dot partial row",
        );
        err(dot_q8(&f, variant, &rows, 0, &act, &mut out), "dot k = 0");
        err(
            dot_q8(&f, variant, &rows, k + 16, &act, &mut out),
            "dot k not a multiple of 32",
        );
        err(
            dot_q8(&f, variant, &rows, k + 32, &act, &mut out),
            "dot k not the rows' k",
        );
        for &v in bad_variants {
            err(
                dot_q8(&f, v, &rows, k, &act, &mut out),
                &format!("dot variant {v}"),
            );
        }
    }
}
