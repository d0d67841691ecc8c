//! Parity with the PyPI `gguf` package (an implementation nobody here wrote): its writer's files
//! read by us, our writer's files read by its reader, and its quant size table. Skipped (with a
//! printed line) when python3 cannot import `gguf`.
mod common;

use common::*;
use moe_gguf::{ggml_type_name, ggml_type_size, GgufFile, Value};
use serde_json::Value as J;
use std::path::{Path, PathBuf};
use std::process::Command;

fn python_gguf_available() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import gguf"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        println!("skipped: python3 with the `gguf` package is not available");
    }
    ok
}

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/gguf_py_roundtrip.py")
}

/// Runs the helper script and returns its stdout.
fn run_script(mode: &str, arg: &Path) -> String {
    let out = Command::new("python3")
        .arg(script())
        .arg(mode)
        .arg(arg)
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "gguf_py_roundtrip.py {mode} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8 stdout")
}

/// Type ids as GGUFReader lists them: the value's, then for arrays the first element's, nested.
fn types_of(v: &Value) -> Vec<u32> {
    let mut types = vec![v.type_id()];
    if let Some(first) = v.as_array().and_then(|a| a.first()) {
        types.extend(types_of(first));
    }
    types
}

/// Leaves of a (possibly nested) array, which is how GGUFReader returns nested arrays.
fn leaves<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
    match v.as_array() {
        Some(items) => items.iter().for_each(|i| leaves(i, out)),
        None => out.push(v),
    }
}

fn scalar_matches(ours: &Value, theirs: &J) -> bool {
    match *ours {
        // Python holds the f32 as a double; compare at f32 precision.
        Value::F32(x) => theirs.as_f64().is_some_and(|t| t as f32 == x),
        // serde_json may round the last bit of long decimals.
        Value::F64(x) => theirs
            .as_f64()
            .is_some_and(|t| t == x || ((t - x) / x).abs() < 1e-15),
        Value::Bool(b) => theirs.as_bool() == Some(b),
        Value::String(ref s) => theirs.as_str() == Some(s.as_str()),
        ref int => match int.as_i64() {
            Some(i) => theirs.as_i64() == Some(i),
            None => int.as_u64().is_some() && theirs.as_u64() == int.as_u64(),
        },
    }
}

fn assert_metadata_eq(ours: &[(String, Value)], theirs: &J) {
    let theirs = theirs.as_array().expect("metadata list");
    let our_keys: Vec<_> = ours.iter().map(|(k, _)| k.as_str()).collect();
    let their_keys: Vec<_> = theirs.iter().map(|m| m["key"].as_str().unwrap()).collect();
    assert_eq!(our_keys, their_keys, "keys in file order");
    for ((key, value), m) in ours.iter().zip(theirs) {
        let their_types: Vec<u32> = m["types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(types_of(value), their_types, "types of {key}");
        let mut flat = Vec::new();
        leaves(value, &mut flat);
        match m["value"].as_array() {
            Some(items) => {
                assert!(value.as_array().is_some(), "{key}: python sees an array");
                assert_eq!(flat.len(), items.len(), "length of {key}");
                for (i, (o, t)) in flat.iter().zip(items).enumerate() {
                    assert!(scalar_matches(o, t), "{key}[{i}]: ours {o:?}, python {t}");
                }
            }
            None => assert!(
                scalar_matches(value, &m["value"]),
                "{key}: ours {value:?}, python {}",
                m["value"]
            ),
        }
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn assert_tensors_eq(f: &GgufFile, theirs: &J) {
    let theirs = theirs.as_array().expect("tensor list");
    assert_eq!(f.tensors().len(), theirs.len());
    for (t, p) in f.tensors().iter().zip(theirs) {
        assert_eq!(t.name, p["name"].as_str().unwrap());
        let dims: Vec<u64> = p["dims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(t.dims, dims, "dims of {}", t.name);
        assert_eq!(
            u64::from(t.type_id),
            p["type"].as_u64().unwrap(),
            "type of {}",
            t.name
        );
        assert_eq!(
            hex(f.tensor_data(t)),
            p["hex"].as_str().unwrap(),
            "data of {}",
            t.name
        );
    }
}

#[test]
fn python_writer_our_reader() {
    if !python_gguf_available() {
        return;
    }
    let dir = tmp_dir("py-writer");
    run_script("write", &dir);
    let expected: J =
        serde_json::from_str(&std::fs::read_to_string(dir.join("py.json")).unwrap()).unwrap();
    let f = GgufFile::open(&dir.join("py.gguf"), SIZES).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    assert_metadata_eq(f.metadata(), &expected["metadata"]);
    assert_tensors_eq(&f, &expected["tensors"]);
    // And python's own reader agrees with what it meant to write.
    let seen: J = serde_json::from_str(&run_script("read", &dir.join("py.gguf"))).unwrap();
    assert_metadata_eq(f.metadata(), &seen["metadata"]);
}

#[test]
fn our_writer_python_reader() {
    if !python_gguf_available() {
        return;
    }
    let path = tmp_dir("our-writer").join("ours.gguf");
    sample_writer(64).write_file(&path).unwrap();
    let seen: J = serde_json::from_str(&run_script("read", &path)).unwrap();
    assert_eq!(seen["alignment"], 64);
    let f = GgufFile::open(&path, SIZES).unwrap();
    assert_metadata_eq(f.metadata(), &seen["metadata"]);
    assert_tensors_eq(&f, &seen["tensors"]);
}

#[test]
fn builtin_sizes_match_gguf_py() {
    if !python_gguf_available() {
        return;
    }
    let table: J = serde_json::from_str(&run_script("sizes", Path::new("-"))).unwrap();
    let table = table.as_object().unwrap();
    for (id, entry) in table {
        let id: u32 = id.parse().unwrap();
        let (name, block, bytes) = (
            entry[0].as_str().unwrap(),
            entry[1].as_u64().unwrap() as u32,
            entry[2].as_u64().unwrap() as u32,
        );
        assert_eq!(
            ggml_type_name(id).map(str::to_uppercase),
            Some(name.to_uppercase()),
            "id {id}"
        );
        if id == 9 {
            // Q8_1: ggml's block is 2 f16 + 32 i8 = 36 bytes; gguf-py still says 40.
            assert_eq!((block, bytes), (32, 40), "gguf-py changed its Q8_1 size");
            assert_eq!(ggml_type_size(id), Some((32, 36)));
        } else {
            assert_eq!(ggml_type_size(id), Some((block, bytes)), "{name}");
        }
    }
    // Nothing in our table that gguf-py does not know.
    for id in 0..256u32 {
        if ggml_type_size(id).is_some() {
            assert!(
                table.contains_key(&id.to_string()),
                "id {id} unknown to gguf-py"
            );
        }
    }
}
