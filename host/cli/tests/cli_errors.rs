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
}
