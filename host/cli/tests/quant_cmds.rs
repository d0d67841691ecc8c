//! `moeserve quantize` and `moeserve dequant` through the real binary, on small GGUF
//! files built here: ROCmFP2 affine checked against a decoder written from the spec,
//! Q8_0 against the PyPI `gguf` package, and the error paths.

use std::path::Path;
use std::process::Command;

use moe_gguf::{ggml_type_size, GgufFile, GgufWriter, Value};

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

/// moeserve with the repo's plugins.toml (rocmfpx loaded without an `fp2` setting).
fn run(args: &[&str]) -> (bool, String, String) {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../../plugins.toml");
    let mut all = vec!["--config", config];
    all.extend_from_slice(args);
    moeserve(&all)
}

/// The failure is exactly one `error:` line on stderr.
fn assert_one_error_line(ok: bool, err: &str) -> String {
    assert!(!ok, "expected a failure, got success; stderr:\n{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line:\n{err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    lines[0].to_string()
}

/// `quantize --model input --out out --tensors tensors --type ty`.
fn quantize(input: &Path, out: &Path, tensors: &str, ty: &str) -> (bool, String, String) {
    run(&[
        "quantize",
        "--model",
        s(input),
        "--out",
        s(out),
        "--tensors",
        tensors,
        "--type",
        ty,
    ])
}

/// `dequant --model model --tensor tensor --out out`.
fn dequant(model: &Path, tensor: &str, out: &Path) -> (bool, String, String) {
    run(&[
        "dequant",
        "--model",
        s(model),
        "--tensor",
        tensor,
        "--out",
        s(out),
    ])
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Deterministic standard normal values (xorshift64 + Box-Muller).
fn gaussian(n: usize, mut seed: u64) -> Vec<f32> {
    let mut uniform = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
        })
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect()
}

const GAUSS: &str = "w.gauss";

/// The source model: `w.gauss` F32 [64, 8] (Gaussian), `w.odd` F16 [48, 2] (rows that
/// are not whole 32-weight blocks), `norm.bias` F16 [64] (not matched by `w.*`), and
/// some metadata of several types.
fn write_model(path: &Path) -> Vec<f32> {
    let gauss = gaussian(64 * 8, 0x5eed_1234_abcd_0001);
    let mut w = GgufWriter::new(32);
    w.add_kv("general.architecture", Value::String("test".into()));
    w.add_kv("general.name", Value::String("quant-cmds fixture".into()));
    w.add_kv("test.count", Value::U32(7));
    w.add_kv("test.scale", Value::F32(0.5));
    w.add_kv(
        "test.names",
        Value::Array(vec![Value::String("a".into()), Value::String("b".into())]),
    );
    w.add_tensor(GAUSS, &[64, 8], 0, f32_bytes(&gauss));
    w.add_tensor("w.odd", &[48, 2], 1, f16_bytes(&gaussian(96, 7)));
    w.add_tensor("norm.bias", &[64], 1, f16_bytes(&gaussian(64, 9)));
    w.write_file(path).unwrap();
    gauss
}

fn open(path: &Path) -> GgufFile {
    let sizes = |id: u32| {
        if id == 107 {
            Some((32, 10))
        } else {
            ggml_type_size(id)
        }
    };
    GgufFile::open(path, &sizes).unwrap()
}

/// A float32 .npy file: (shape, values).
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"\x93NUMPY\x01\x00");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(header.contains("'descr': '<f4'"), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape_txt = header.split("'shape': (").nth(1).unwrap();
    let shape_txt = &shape_txt[..shape_txt.find(')').unwrap()];
    let shape: Vec<usize> = shape_txt
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().unwrap())
        .collect();
    let values: Vec<f32> = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(shape.iter().product::<usize>(), values.len());
    (shape, values)
}

/// UE4M3 scale byte, from ../shared/spec/rocmfpx.md.
fn ue4m3(b: u8) -> f32 {
    if b > 0x7e {
        return 0.0;
    }
    let (exp, man) = (((b >> 3) & 15) as i32, (b & 7) as f32);
    if exp == 0 {
        man * 2f32.powi(-10)
    } else {
        (8.0 + man) * 2f32.powi(exp - 11)
    }
}

/// Affine ROCmFP2 (type 107, variant 2) from the spec: 10-byte blocks qs[8], e[2];
/// value = code * S - O.
fn decode_fp2_affine(data: &[u8]) -> Vec<f32> {
    assert_eq!(data.len() % 10, 0);
    let mut out = Vec::new();
    for blk in data.chunks_exact(10) {
        let (qs, s, o) = (&blk[..8], ue4m3(blk[8]), ue4m3(blk[9]));
        for i in 0..32 {
            let code = (qs[i >> 2] >> (2 * (i & 3))) & 3;
            out.push(code as f32 * s - o);
        }
    }
    out
}

fn nrmse(reference: &[f32], got: &[f32]) -> f64 {
    assert_eq!(reference.len(), got.len());
    let (mut e, mut r) = (0f64, 0f64);
    for (a, b) in reference.iter().zip(got) {
        let (a, b) = (f64::from(*a), f64::from(*b));
        e += (a - b) * (a - b);
        r += a * a;
    }
    (e / r).sqrt()
}

fn assert_same_bits(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

#[test]
fn quantize_to_affine_fp2_and_dequant_back() {
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.gguf"), dir.path().join("out.gguf"));
    let gauss = write_model(&input);
    let (ok, out, err) = run(&[
        "quantize",
        "--model",
        s(&input),
        "--out",
        s(&output),
        "--tensors",
        "w.*",
        "--type",
        "107-affine",
    ]);
    assert!(ok, "{err}");
    println!("{out}{err}");
    assert!(
        out.contains("1 tensor converted to Q2_0_ROCMFP2 (affine), 1 skipped"),
        "{out}"
    );
    assert!(out.contains("skipped 'w.odd'"), "{out}");
    assert!(
        out.contains("recorded rocmfpx.fp2_mode = \"affine\""),
        "{out}"
    );
    assert!(err.contains("warning: skipping 'w.odd'"), "{err}");
    assert!(!dir.path().join("out.gguf.part").exists());

    // The output: w.gauss is type 107, the rest and all metadata are as they were.
    let (src, dst) = (open(&input), open(&output));
    let t = dst.tensor(GAUSS).unwrap();
    assert_eq!(
        (t.type_id, t.dims.clone(), t.n_bytes),
        (107, vec![64, 8], 160)
    );
    for name in ["w.odd", "norm.bias"] {
        let (a, b) = (src.tensor(name).unwrap(), dst.tensor(name).unwrap());
        assert_eq!((a.type_id, &a.dims), (b.type_id, &b.dims), "{name}");
        assert_eq!(src.tensor_data(a), dst.tensor_data(b), "{name}");
    }
    assert_eq!(dst.get_str("rocmfpx.fp2_mode").unwrap(), "affine");
    for (k, v) in src.metadata() {
        assert_eq!(dst.get(k), Some(v), "metadata {k}");
    }
    assert_eq!(dst.metadata().len(), src.metadata().len() + 1);

    // dequant: numpy shape, the plugin's decode bit for bit, close to the original.
    let npy = dir.path().join("gauss.npy");
    let (ok, _, err) = run(&[
        "dequant",
        "--model",
        s(&output),
        "--tensor",
        GAUSS,
        "--out",
        s(&npy),
    ]);
    assert!(ok, "{err}");
    let (shape, values) = read_npy(&npy);
    assert_eq!(shape, vec![8, 64]);
    let spec = decode_fp2_affine(dst.tensor_data(t));
    assert_same_bits(&values, &spec, "dequant vs spec decode");
    let e = nrmse(&gauss, &values);
    println!("affine FP2 NRMSE on Gaussian data: {e:.4}");
    assert!(e > 0.05 && e < 0.4, "NRMSE {e}");

    // Without --out: a summary.
    let (ok, out, err) = run(&["dequant", "--model", s(&output), "--tensor", GAUSS]);
    assert!(ok, "{err}");
    for want in [
        "Q2_0_ROCMFP2",
        "id 107, variant 2",
        "[8, 64]",
        "mean",
        "std",
    ] {
        assert!(out.contains(want), "missing {want}:\n{out}");
    }

    // F16 and F32 tensors decode too (F16 exactly).
    let (ok, _, err) = run(&[
        "dequant",
        "--model",
        s(&output),
        "--tensor",
        "norm.bias",
        "--out",
        s(&npy),
    ]);
    assert!(ok, "{err}");
    let (shape, values) = read_npy(&npy);
    assert_eq!(shape, vec![64]);
    let want: Vec<f32> = src
        .tensor_data(src.tensor("norm.bias").unwrap())
        .chunks_exact(2)
        .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect();
    assert_same_bits(&values, &want, "F16 dequant");
    let (ok, _, err) = run(&[
        "dequant",
        "--model",
        s(&input),
        "--tensor",
        GAUSS,
        "--out",
        s(&npy),
    ]);
    assert!(ok, "{err}");
    let (shape, values) = read_npy(&npy);
    assert_eq!(shape, vec![8, 64]);
    assert_same_bits(&values, &gauss, "F32 dequant");
}

#[test]
fn q8_0_dequant_matches_gguf_py() {
    let check = Command::new("python3")
        .args(["-c", "import gguf, numpy"])
        .output();
    if !check.is_ok_and(|o| o.status.success()) {
        println!("skipped: python3 with the `gguf` package is not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.gguf"), dir.path().join("q8.gguf"));
    let gauss = write_model(&input);
    let (ok, out, err) = run(&[
        "quantize",
        "--model",
        s(&input),
        "--out",
        s(&output),
        "--tensors",
        r"^w\.gauss$",
        "--type",
        "q8_0",
    ]);
    assert!(ok, "{err}");
    assert!(
        out.contains("1 tensor converted to Q8_0, 0 skipped"),
        "{out}"
    );
    let t = open(&output).tensor(GAUSS).unwrap().clone();
    assert_eq!((t.type_id, t.n_bytes), (8, 16 * 34));
    let npy = dir.path().join("q8.npy");
    let (ok, _, err) = run(&[
        "dequant",
        "--model",
        s(&output),
        "--tensor",
        GAUSS,
        "--out",
        s(&npy),
    ]);
    assert!(ok, "{err}");
    let e = nrmse(&gauss, &read_npy(&npy).1);
    assert!(e < 0.02, "Q8_0 NRMSE {e}");
    let script = r#"
import sys, numpy as np, gguf
from gguf.quants import dequantize
r = gguf.GGUFReader(sys.argv[1])
t = next(t for t in r.tensors if t.name == sys.argv[2])
assert int(t.tensor_type) == 8, t.tensor_type
ref = dequantize(t.data, t.tensor_type).astype(np.float32)
ours = np.load(sys.argv[3])
want_shape = tuple(int(d) for d in reversed(t.shape))
assert ours.shape == want_shape, (ours.shape, want_shape)
ref = ref.reshape(ours.shape)
assert ours.dtype == np.float32
diff = np.abs(ours - ref).max()
print("max |ours - gguf-py| =", diff)
assert np.array_equal(ours, ref), diff
"#;
    let py = Command::new("python3")
        .args(["-c", script, s(&output), GAUSS, s(&npy)])
        .output()
        .unwrap();
    let (pout, perr) = (
        String::from_utf8_lossy(&py.stdout),
        String::from_utf8_lossy(&py.stderr),
    );
    println!("{pout}{perr}");
    assert!(
        py.status.success(),
        "gguf-py comparison failed:\n{pout}{perr}"
    );
}

#[test]
fn errors_are_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.gguf");
    write_model(&input);
    let before = std::fs::read(&input).unwrap();
    let out = dir.path().join("out.gguf");

    // Unknown tensor: the close name is suggested.
    let (ok, _, err) = run(&["dequant", "--model", s(&input), "--tensor", "w.gaus"]);
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("no tensor named 'w.gaus'") && line.contains("did you mean 'w.gauss'"),
        "{line}"
    );

    // A regex that matches nothing, and one that does not parse.
    let quantize = |tensors: &str, ty: &str, out: &Path| quantize(&input, out, tensors, ty);
    let (ok, _, err) = quantize("^nothing$", "Q8_0", &out);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("matches none of the 3 tensors"), "{line}");
    let (ok, _, err) = quantize("(", "Q8_0", &out);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("not a valid regex"), "{line}");
    let (ok, _, err) = quantize("w", "Q9_9", &out);
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("--type 'Q9_9'") && line.contains("Q8_0 (8)"),
        "{line}"
    );
    let (ok, _, err) = quantize("w", "Q8_0-affine", &out);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("picks the meaning of type 107"), "{line}");
    // Every matched tensor skipped (64-weight rows, 256-weight Q4_K blocks): an error.
    let (ok, _, err) = quantize("w", "Q4_K", &out);
    assert!(!ok, "{err}");
    assert!(
        err.contains("note: 'w.gauss': its rows of 64 weights"),
        "{err}"
    );
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: ") && last.contains("nothing written"),
        "{err}"
    );
    assert!(!out.exists());

    // The output may not be the input, however it is spelled.
    let (ok, _, err) = quantize("w", "Q8_0", &input);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("is the input file"), "{line}");
    let dotted = dir.path().join(".").join("in.gguf");
    let (ok, _, err) = quantize("w", "Q8_0", &dotted);
    assert_one_error_line(ok, &err);
    assert_eq!(std::fs::read(&input).unwrap(), before, "input changed");

    // Type 107 without a stated meaning: the target needs one.
    let (ok, _, err) = quantize("w", "107", &out);
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("rocmfpx.fp2_mode") && line.contains("107-affine"),
        "{line}"
    );
    assert!(!out.exists());
}

#[test]
fn type_107_without_a_meaning_is_refused_until_chosen() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("fp2.gguf");
    // Random 107 blocks with valid scale bytes, a type no plugin claims (i32), and an F32
    // tensor; no rocmfpx.fp2_mode key.
    let mut blocks = Vec::new();
    let mut x = 0x1234_5678_9abc_def1u64;
    for _ in 0..8 {
        for _ in 0..8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            blocks.push(x as u8);
        }
        blocks.push(0x30 + (x >> 8) as u8 % 16);
        blocks.push(0x28 + (x >> 16) as u8 % 16);
    }
    let mut w = GgufWriter::new(32);
    w.add_kv("general.architecture", Value::String("test".into()));
    w.add_tensor("fp2.weight", &[64, 4], 107, blocks.clone());
    w.add_tensor("ids", &[4], 26, vec![0; 16]);
    w.add_tensor(GAUSS, &[64, 8], 0, f32_bytes(&gaussian(512, 3)));
    w.write_file(&input).unwrap();

    // dequant says how to choose.
    let (ok, _, err) = run(&["dequant", "--model", s(&input), "--tensor", "fp2.weight"]);
    let line = assert_one_error_line(ok, &err);
    for want in [
        "fp2.weight",
        "two incompatible meanings",
        "rocmfpx.fp2_mode",
        "fp2 = \"affine\"",
        "--fp2 affine",
    ] {
        assert!(line.contains(want), "missing {want}: {line}");
    }
    // ... and decodes once told.
    let npy = dir.path().join("fp2.npy");
    let (ok, _, err) = run(&[
        "dequant",
        "--model",
        s(&input),
        "--tensor",
        "fp2.weight",
        "--fp2",
        "affine",
        "--out",
        s(&npy),
    ]);
    assert!(ok, "{err}");
    let (shape, values) = read_npy(&npy);
    assert_eq!(shape, vec![4, 64]);
    assert_same_bits(&values, &decode_fp2_affine(&blocks), "--fp2 affine");

    // A type no plugin claims.
    let (ok, _, err) = run(&["dequant", "--model", s(&input), "--tensor", "ids"]);
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("i32 (26)") && line.contains("no loaded quant plugin"),
        "{line}"
    );

    let out = dir.path().join("out.gguf");
    let quantize = |tensors: &str, ty: &str| {
        run(&[
            "quantize",
            "--model",
            s(&input),
            "--out",
            s(&out),
            "--tensors",
            tensors,
            "--type",
            ty,
        ])
    };
    // Converting the ambiguous tensor needs its meaning.
    let (ok, _, err) = quantize("fp2", "Q8_0");
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("fp2.weight") && line.contains("rocmfpx.fp2_mode"),
        "{line}"
    );
    // Recording a meaning would silently give one to the kept 107 tensor.
    let (ok, _, err) = quantize(r"^w\.gauss$", "107-affine");
    let line = assert_one_error_line(ok, &err);
    assert!(
        line.contains("'fp2.weight'") && line.contains("stays as it is"),
        "{line}"
    );
    assert!(!out.exists());
    // Skipping a type no plugin decodes is a warning, not an error.
    let (ok, stdout, err) = quantize("^(ids|w.gauss)$", "F16");
    assert!(ok, "{err}");
    assert!(err.contains("warning: skipping 'ids'"), "{err}");
    assert!(
        stdout.contains("1 tensor converted to F16, 1 skipped"),
        "{stdout}"
    );
    let dst = open(&out);
    assert_eq!(dst.tensor(GAUSS).unwrap().type_id, 1);
    assert_eq!(dst.tensor("fp2.weight").unwrap().type_id, 107);
    assert!(dst.get("rocmfpx.fp2_mode").is_none());
}

#[test]
fn outputs_never_destroy_inputs() {
    let dir = tempfile::tempdir().unwrap();
    // An input named as the old fixed temporary name (`<out>.part`) survives.
    let input = dir.path().join("m.gguf.part");
    write_model(&input);
    let before = std::fs::read(&input).unwrap();
    let out = dir.path().join("m.gguf");
    let (ok, _, err) = quantize(&input, &out, "w", "Q8_0");
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(&input).unwrap(), before, "input changed");
    assert!(open(&out).tensor(GAUSS).is_some());
    let (ok, _, err) = dequant(&input, GAUSS, &dir.path().join("g.npy"));
    assert!(ok, "{err}");
    assert_eq!(std::fs::read(&input).unwrap(), before, "input changed");

    // dequant and logits onto their model: refused, the model unchanged.
    let (ok, _, err) = dequant(&input, GAUSS, &input);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("is the input file"), "{line}");
    let (ok, _, err) = run(&[
        "logits",
        "--model",
        s(&input),
        "--tokens",
        "1",
        "--out",
        s(&input),
    ]);
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("is the input file"), "{line}");
    assert_eq!(std::fs::read(&input).unwrap(), before, "input changed");

    // Every tensor asked for: the vector (norm.bias) is kept as it was, with a warning.
    let all = dir.path().join("all.gguf");
    let (ok, _, err) = quantize(&input, &all, ".", "Q8_0");
    assert!(ok, "{err}");
    assert!(
        err.contains("skipping 'norm.bias': it is a vector of 64"),
        "{err}"
    );
    assert_eq!(open(&all).tensor("norm.bias").unwrap().type_id, 1);
    std::fs::remove_file(&all).unwrap();

    // An output in a directory that does not exist: refused before any work.
    let nowhere = dir.path().join("no-such-dir").join("o.gguf");
    let (ok, _, err) = quantize(&input, &nowhere, "w", "Q8_0");
    let line = assert_one_error_line(ok, &err);
    assert!(line.contains("does not exist"), "{line}");
    // and nothing but the files written above is left in the directory
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["g.npy", "m.gguf", "m.gguf.part"]);
}
