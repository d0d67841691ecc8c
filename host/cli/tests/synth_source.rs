//! `--synth` (a synthetic V4-Flash-shaped deepseek4 model built in memory, no file)
//! against the same model written by `moeserve synth` and read back from the file: on
//! the CPU backend the logits of both must be bit-identical, and real numbers.

use std::process::Command;

fn run(args: &[&str]) -> String {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../plugins.toml");
    let out = Command::new(env!("CARGO_BIN_EXE_moeserve"))
        .args(["--config", config])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run moeserve");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "moeserve {args:?} failed:\n{err}");
    err
}

/// The f32 payload of a .npy file (its header ends at the first newline).
fn npy_f32(bytes: &[u8]) -> Vec<f32> {
    let start = bytes.iter().position(|&b| b == b'\n').expect("npy header") + 1;
    bytes[start..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

#[test]
fn in_memory_model_equals_the_written_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    // One full-width layer, 4 experts, a 512-token vocabulary: ~150 MB.
    let shape = ["--experts", "4", "--vocab", "512"];
    run(&[
        &["synth", "--out", &p("m.gguf"), "--layers", "1"],
        &shape[..],
    ]
    .concat());
    let tokens = "5,17,300,2";
    run(&[
        "logits",
        "--model",
        &p("m.gguf"),
        "--tokens",
        tokens,
        "--out",
        &p("file.npy"),
    ]);
    let err = run(&[
        "logits",
        "--synth",
        "1",
        "--synth-experts",
        "4",
        "--synth-vocab",
        "512",
        "--tokens",
        tokens,
        "--out",
        &p("mem.npy"),
    ]);
    assert!(err.contains("in memory"), "{err}");
    let (a, b) = (
        std::fs::read(p("file.npy")).unwrap(),
        std::fs::read(p("mem.npy")).unwrap(),
    );
    let (fa, fb) = (npy_f32(&a), npy_f32(&b));
    assert_eq!(fa.len(), 4 * 512);
    assert!(fa.iter().all(|v| v.is_finite()));
    assert!(fa.iter().any(|&v| v != fa[0]), "constant logits");
    assert_eq!(fa, fb, "in-memory model differs from the file");
}
