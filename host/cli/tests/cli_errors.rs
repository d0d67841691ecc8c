//! The binary fails fast with one `error:` line and a non-zero exit on bad input, and
//! `plugins` lists what the default config loads.

use std::process::Command;

fn moeserve(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_moeserve"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run moeserve");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn repo_config() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../plugins.toml").to_string()
}

#[test]
fn plugins_lists_the_bundled_plugins() {
    let (ok, out, err) = moeserve(&["--config", &repo_config(), "plugins"]);
    assert!(ok, "{err}");
    for want in [
        "cpu",
        "backend",
        "ggml-quants",
        "Q4_K",
        "MXFP4",
        "single-device",
        "split-by-layer",
        "cpu:0",
    ] {
        assert!(out.contains(want), "missing {want} in:\n{out}");
    }
}

#[test]
fn missing_config_is_one_line_and_nonzero() {
    let (ok, _, err) = moeserve(&["--config", "no/such/plugins.toml", "plugins"]);
    assert!(!ok);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(
        lines[0].starts_with("error: no/such/plugins.toml: cannot read it"),
        "{err}"
    );
}

#[test]
fn bad_model_files_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let (ok, _, err) = moeserve(&[
        "--config",
        &repo_config(),
        "logits",
        "--model",
        junk.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--out",
        dir.path().join("x.npy").to_str().unwrap(),
    ]);
    assert!(!ok);
    assert!(
        err.starts_with("error: ") && err.contains("junk.gguf"),
        "{err}"
    );
    let (ok, _, err) = moeserve(&[
        "--config",
        &repo_config(),
        "serve",
        "--model",
        "missing.gguf",
    ]);
    assert!(!ok);
    assert!(
        err.contains("model file missing.gguf does not exist"),
        "{err}"
    );
    // bad serve settings are refused before the model loads
    for (flag, value, says) in [
        (
            "--prefill-long-chunk",
            "0",
            "--prefill-long-chunk must be at least 1",
        ),
        (
            "--default-temperature",
            "3",
            "--default-temperature must be between 0 and 2",
        ),
        ("--mtp", "mtp.gguf", "--mtp drafts only with --draft-max N"),
        (
            "--draft-p-min",
            "1.5",
            "--draft-p-min must be between 0 and 1",
        ),
    ] {
        let config = repo_config();
        let args = [
            "--config", &config, "serve", "--model", &config, flag, value,
        ];
        let (ok, _, err) = moeserve(&args);
        assert!(!ok);
        assert!(err.starts_with(&format!("error: {says}")), "{err}");
    }
}

type Kv = Vec<(String, moe_gguf::Value)>;
type Shapes = Vec<(String, Vec<u64>)>;
type Edit = Box<dyn Fn(&mut Kv, &mut Shapes)>;

/// A tiny llama GGUF (2 layers, f32) with `edit` applied to its metadata and shapes.
fn tiny_llama(path: &std::path::Path, edit: impl Fn(&mut Kv, &mut Shapes)) {
    use moe_gguf::{GgufWriter, Value};
    let (d, ff, vocab) = (64u64, 128u64, 32u64);
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String("llama".into())),
        ("llama.block_count".into(), Value::U32(2)),
        ("llama.embedding_length".into(), Value::U32(d as u32)),
        ("llama.feed_forward_length".into(), Value::U32(ff as u32)),
        ("llama.attention.head_count".into(), Value::U32(4)),
        ("llama.attention.head_count_kv".into(), Value::U32(4)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.context_length".into(), Value::U32(64)),
    ];
    let mut tensors: Vec<(String, Vec<u64>)> = vec![
        ("token_embd.weight".into(), vec![d, vocab]),
        ("output_norm.weight".into(), vec![d]),
    ];
    for l in 0..2 {
        for (n, dims) in [
            ("attn_norm", vec![d]),
            ("attn_q", vec![d, d]),
            ("attn_k", vec![d, d]),
            ("attn_v", vec![d, d]),
            ("attn_output", vec![d, d]),
            ("ffn_norm", vec![d]),
            ("ffn_gate", vec![d, ff]),
            ("ffn_up", vec![d, ff]),
            ("ffn_down", vec![ff, d]),
        ] {
            tensors.push((format!("blk.{l}.{n}.weight"), dims));
        }
    }
    edit(&mut kv, &mut tensors);
    let mut w = GgufWriter::new(32);
    for (k, v) in kv {
        w.add_kv(&k, v);
    }
    for (i, (name, dims)) in tensors.iter().enumerate() {
        let n: u64 = dims.iter().product();
        let data: Vec<u8> = (0..n)
            .flat_map(|j| (((j * 7 + i as u64) % 13) as f32 * 0.01 + 0.01).to_le_bytes())
            .collect();
        w.add_tensor(name, dims, 0, data);
    }
    w.write_file(path).unwrap();
}

#[test]
fn inconsistent_models_are_refused_before_loading() {
    use moe_gguf::Value;
    let dir = tempfile::tempdir().unwrap();
    let logits = |model: &std::path::Path| {
        moeserve(&[
            "--config",
            &repo_config(),
            "logits",
            "--model",
            model.to_str().unwrap(),
            "--tokens",
            "1,2,3",
            "--out",
            dir.path().join("x.npy").to_str().unwrap(),
        ])
    };
    let good = dir.path().join("good.gguf");
    tiny_llama(&good, |_, _| {});
    let (ok, _, err) = logits(&good);
    assert!(ok, "the unedited model must load: {err}");
    let set = |key: &'static str, v: Value| {
        move |kv: &mut Kv, _: &mut Shapes| {
            kv.retain(|(k, _)| k != key);
            kv.push((key.into(), v.clone()));
        }
    };
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "layers1",
            Box::new(set("llama.block_count", Value::U32(1))),
            "holds tensors for 2 layers",
        ),
        (
            "layers-huge",
            Box::new(set("llama.block_count", Value::U32(u32::MAX))),
            "holds tensors for 2 layers",
        ),
        (
            "eps-nan",
            Box::new(set(
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(f32::NAN),
            )),
            "layer_norm_rms_epsilon is NaN",
        ),
        (
            "eps-neg",
            Box::new(set(
                "llama.attention.layer_norm_rms_epsilon",
                Value::F32(-1.0),
            )),
            "must be a positive number",
        ),
        (
            "rope0",
            Box::new(set("llama.rope.freq_base", Value::F32(0.0))),
            "rope.freq_base",
        ),
        (
            "rot-odd",
            Box::new(set("llama.rope.dimension_count", Value::U32(3))),
            "rope.dimension_count is 3",
        ),
        (
            "norm-2d",
            Box::new(
                |_: &mut Vec<(String, Value)>, t: &mut Vec<(String, Vec<u64>)>| {
                    t[1].1 = vec![64, 2];
                },
            ),
            "output_norm.weight has dims [64, 2]",
        ),
    ];
    for (name, edit, want) in cases {
        let path = dir.path().join(format!("{name}.gguf"));
        tiny_llama(&path, edit);
        let (ok, _, err) = logits(&path);
        assert!(!ok, "{name}: loaded");
        let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
        assert_eq!(lines.len(), 1, "{name}: {err}");
        assert!(
            lines[0].starts_with("error: ")
                && lines[0].contains(&format!("{name}.gguf"))
                && lines[0].contains(want),
            "{name}: {err}"
        );
    }
}

#[test]
fn plugins_fails_when_the_model_backend_cannot_run() {
    let dir = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(repo_config()).unwrap();
    let bad = text.replace("use_devices = []", "use_devices = [7]");
    assert_ne!(bad, text, "the repo config names use_devices = []");
    let cfg = dir.path().join("plugins.toml");
    // (libraries are looked up next to the binary, so the copy loads the same plugins)
    std::fs::write(&cfg, bad).unwrap();
    let (ok, out, err) = moeserve(&["--config", cfg.to_str().unwrap(), "plugins"]);
    assert!(!ok, "{out}");
    assert!(
        out.contains("placement policies"),
        "the listing still prints: {out}"
    );
    assert!(
        err.contains("use_devices names cpu:7, which is not present"),
        "{err}"
    );
}
