//! Writer -> reader round trips, accessors and writer-side checks.
mod common;

use common::*;
use moe_gguf::{ggml_type_name, ggml_type_size, GgufFile, GgufWriter, Value};

/// NaN-free values compare with `==`; keep the helper so a failure names the key.
fn assert_same(key: &str, got: &Value, want: &Value) {
    assert_eq!(got, want, "value of {key}");
}

#[test]
fn every_value_type_and_tensor_round_trips() {
    for alignment in [1u64, 8, 32, 64, 4096] {
        let f = open_bytes(sample_bytes(alignment)).expect("open sample");
        assert_eq!(f.version(), 3);
        assert_eq!(f.alignment(), alignment);
        assert_eq!(f.data_offset() % alignment, 0);

        // general.alignment is added first when not the default.
        let mut want = all_values();
        if alignment != 32 {
            want.insert(0, ("general.alignment", Value::U32(alignment as u32)));
        }
        let got = f.metadata();
        assert_eq!(got.len(), want.len());
        for ((gk, gv), (wk, wv)) in got.iter().zip(&want) {
            assert_eq!(gk, wk);
            assert_same(wk, gv, wv);
            assert_same(wk, f.get(wk).expect("key present"), wv);
        }

        let tensors = sample_tensors();
        assert_eq!(f.tensors().len(), tensors.len());
        for (info, (name, dims, ty, data)) in f.tensors().iter().zip(&tensors) {
            assert_eq!(&info.name, name);
            assert_eq!(&info.dims, dims);
            assert_eq!(info.type_id, *ty);
            assert_eq!(info.offset % alignment, 0, "{name} aligned");
            assert_eq!(info.n_bytes, data.len() as u64);
            assert_eq!(info.numel(), dims.iter().product::<u64>());
            assert_eq!(f.tensor_data(info), &data[..]);
            assert_eq!(f.tensor(name), Some(info));
        }
        assert!(f.tensor("missing").is_none());
        assert!(f.get("missing").is_none());
    }
}

#[test]
fn non_finite_floats_round_trip() {
    let mut w = GgufWriter::new(32);
    w.add_kv("nan32", Value::F32(f32::NAN));
    w.add_kv("inf64", Value::F64(f64::NEG_INFINITY));
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let f = open_bytes(bytes).unwrap();
    assert!(matches!(f.get("nan32"), Some(Value::F32(x)) if x.is_nan()));
    assert_eq!(f.get_f64("inf64").unwrap(), f64::NEG_INFINITY);
    // JSON has no NaN/inf: they become null (keys in the file's order).
    assert_eq!(f.scalar_metadata_json(), r#"{"nan32":null,"inf64":null}"#);
}

#[test]
fn version_2_is_read() {
    let mut bytes = sample_bytes(32);
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    let f = open_bytes(bytes).unwrap();
    assert_eq!(f.version(), 2);
    assert_eq!(f.tensors().len(), sample_tensors().len());
}

#[test]
fn empty_file_with_no_tensors_or_metadata() {
    let mut bytes = Vec::new();
    GgufWriter::new(32).write_to(&mut bytes).unwrap();
    assert_eq!(bytes.len(), 32); // header padded to the alignment, like llama.cpp
    let f = open_bytes(bytes).unwrap();
    assert!(f.metadata().is_empty() && f.tensors().is_empty());
    assert_eq!(f.data_offset(), 32);
    assert_eq!(f.scalar_metadata_json(), "{}");
}

#[test]
fn typed_getters() {
    let f = open_bytes(sample_bytes(32)).unwrap();
    assert_eq!(f.get_u64("v.u8").unwrap(), 255);
    assert_eq!(f.get_u64("v.u64").unwrap(), u64::MAX);
    assert_eq!(f.get_i64("v.i64").unwrap(), i64::MIN);
    assert_eq!(f.get_i64("v.u32").unwrap(), u32::MAX as i64);
    assert_eq!(f.get_f64("v.f32").unwrap(), 0.1f32 as f64);
    assert_eq!(f.get_f64("v.i16").unwrap(), -32768.0);
    assert!(f.get_bool("v.bool_t").unwrap());
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(
        f.get_str_array("a.str").unwrap(),
        vec!["a", "", "ünï", "<0x0A>"]
    );
    assert_eq!(f.get_i64_array("a.u32").unwrap(), vec![3, 4_000_000_000]);
    assert_eq!(f.get_i64_array("a.empty").unwrap(), Vec::<i64>::new());
    assert_eq!(
        f.get_f64_array("a.i32").unwrap(),
        vec![-3.0, 3.0, i32::MAX as f64]
    );
    assert_eq!(f.get_f64_array("a.f32").unwrap()[1], -1.25);

    fn err<T>(r: Result<T, moe_gguf::GgufError>) -> String {
        r.map(|_| ()).unwrap_err().to_string()
    }
    assert_eq!(
        err(f.get_u64("nope")),
        "test.gguf: metadata key 'nope' is missing"
    );
    assert_eq!(
        err(f.get_u64("v.i8")),
        "test.gguf: metadata key 'v.i8' should be a non-negative integer but is i8 -128"
    );
    assert_eq!(
        err(f.get_i64("v.u64")),
        "test.gguf: metadata key 'v.u64' should be an integer but is u64 18446744073709551615"
    );
    assert_eq!(
        err(f.get_str("v.f32")),
        "test.gguf: metadata key 'v.f32' should be a string but is f32 0.1"
    );
    assert_eq!(
        err(f.get_f64("general.architecture")),
        "test.gguf: metadata key 'general.architecture' should be a number but is string 'llama'"
    );
    assert_eq!(
        err(f.get_str_array("a.i32")),
        "test.gguf: metadata key 'a.i32' should be an array of strings but is array of i32 (3 entries)"
    );
    assert_eq!(
        err(f.get_i64_array("a.nested")),
        "test.gguf: metadata key 'a.nested' should be an array of integers but is array of array of i32 (3 entries)"
    );
    assert_eq!(
        err(f.get_bool("v.u8")),
        "test.gguf: metadata key 'v.u8' should be a bool but is u8 255"
    );
}

#[test]
fn value_conversions() {
    assert_eq!(Value::I32(-1).as_u64(), None);
    assert_eq!(Value::I64(5).as_u64(), Some(5));
    assert_eq!(Value::U64(u64::MAX).as_i64(), None);
    assert_eq!(Value::U8(3).as_f64(), Some(3.0));
    assert_eq!(Value::F32(1.5).as_i64(), None);
    assert_eq!(Value::Bool(true).as_u64(), None);
    assert_eq!(Value::String("x".into()).as_str(), Some("x"));
    assert_eq!(Value::Array(vec![]).as_array(), Some(&[][..]));
    assert_eq!(Value::F64(1.0).type_name(), "f64");
    assert_eq!(
        Value::Array(vec![Value::Bool(true)]).describe(),
        "array of bool"
    );
}

#[test]
fn scalar_metadata_json_has_scalars_only() {
    let f = open_bytes(sample_bytes(32)).unwrap();
    let json: serde_json::Value = serde_json::from_str(&f.scalar_metadata_json()).unwrap();
    let obj = json.as_object().unwrap();
    let scalars = all_values()
        .iter()
        .filter(|(_, v)| v.as_array().is_none())
        .count();
    assert_eq!(obj.len(), scalars);
    assert_eq!(obj["general.architecture"], "llama");
    assert_eq!(obj["v.u64"].as_u64(), Some(u64::MAX));
    assert_eq!(obj["v.i64"].as_i64(), Some(i64::MIN));
    assert_eq!(obj["v.f32"].as_f64(), Some(0.1)); // shortest f32 text, not 0.10000000149
    assert_eq!(obj["v.bool_f"], false);
    assert!(!obj.contains_key("a.str"));
}

#[test]
fn write_file_then_open_with_mmap() {
    let dir = tmp_dir("write-file");
    let path = dir.join("sample.gguf");
    // A file named as the old fixed temporary name was is not touched.
    std::fs::write(dir.join("sample.gguf.part"), b"keep me").unwrap();
    sample_writer(64).write_file(&path).unwrap();
    assert_eq!(
        std::fs::read(dir.join("sample.gguf.part")).unwrap(),
        b"keep me"
    );
    // nothing else is left next to it
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    // readable by others as a plain create makes it (not the temporary file's 0600)
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_ne!(mode & 0o044, 0, "mode {mode:o}");
    }
    let f = GgufFile::open(&path, SIZES).unwrap();
    assert_eq!(f.path(), path);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.bytes(), &sample_bytes(64)[..]);
    let t = f.tensor("t.q8_0").unwrap();
    assert_eq!(f.tensor_data(t), &sample_tensors()[2].3[..]);
    assert_eq!(std::fs::metadata(&path).unwrap().len() % 64, 0);
}

#[test]
fn add_kv_replaces_existing_key() {
    let mut w = GgufWriter::new(32);
    w.add_kv("k", Value::U8(1));
    w.add_kv("j", Value::U8(2));
    w.add_kv("k", Value::String("x".into()));
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    let f = open_bytes(bytes).unwrap();
    let keys: Vec<_> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["k", "j"]);
    assert_eq!(f.get_str("k").unwrap(), "x");
}

#[test]
fn writer_refuses_invalid_input() {
    let write_err = |w: GgufWriter| w.write_to(&mut Vec::new()).unwrap_err().to_string();

    let mut w = GgufWriter::new(32);
    w.add_kv("mixed", Value::Array(vec![Value::U8(1), Value::I8(1)]));
    assert_eq!(
        write_err(w),
        "metadata key 'mixed': array mixes u8 and i8 elements"
    );

    let mut w = GgufWriter::new(32);
    w.add_tensor("a", &[1], 0, vec![0; 4]);
    w.add_tensor("a", &[1], 0, vec![0; 4]);
    assert_eq!(write_err(w), "duplicate tensor name 'a'");

    let mut w = GgufWriter::new(32);
    w.add_tensor("a", &[1, 1, 1, 1, 1], 0, vec![0; 4]);
    assert_eq!(
        write_err(w),
        "tensor 'a' has 5 dimensions; ggml supports 1 to 4"
    );

    for bad in [0, 3, 1 << 32] {
        assert!(write_err(GgufWriter::new(bad)).contains("must be a nonzero power of two"));
    }

    let mut w = GgufWriter::new(64);
    w.add_kv("general.alignment", Value::U32(32));
    assert!(write_err(w).contains("general.alignment is set to U32(32)"));

    // A matching explicit general.alignment is kept, not duplicated.
    let mut w = GgufWriter::new(64);
    w.add_kv("general.alignment", Value::U32(64));
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).unwrap();
    assert_eq!(open_bytes(bytes).unwrap().metadata().len(), 1);
}

#[test]
fn into_bytes_equals_write_to() {
    for alignment in [1u64, 8, 32, 64, 4096] {
        let image = sample_writer(alignment).into_bytes().unwrap();
        assert_eq!(image, sample_bytes(alignment), "alignment {alignment}");
        assert_eq!(image.len() as u64 % alignment, 0);
    }
    let mut empty = Vec::new();
    GgufWriter::new(64).write_to(&mut empty).unwrap();
    assert_eq!(GgufWriter::new(64).into_bytes().unwrap(), empty);
    let mut w = GgufWriter::new(32);
    w.add_tensor("a", &[1], 0, vec![0; 4]);
    w.add_tensor("a", &[1], 0, vec![0; 4]);
    assert_eq!(
        w.into_bytes().unwrap_err().to_string(),
        "duplicate tensor name 'a'"
    );
}

#[test]
fn builtin_type_table() {
    // Spot checks; the full table is compared with gguf-py's GGML_QUANT_SIZES in gguf_py.rs.
    assert_eq!(ggml_type_size(0), Some((1, 4)));
    assert_eq!(ggml_type_size(8), Some((32, 34)));
    assert_eq!(ggml_type_size(9), Some((32, 36))); // ggml's block_q8_1; gguf-py's 40 is stale
    assert_eq!(ggml_type_size(12), Some((256, 144)));
    assert_eq!(ggml_type_size(39), Some((32, 17)));
    assert_eq!(ggml_type_size(4), None); // retired Q4_2
    assert_eq!(ggml_type_size(1000), None);
    assert_eq!(ggml_type_name(14), Some("q6_K"));
    assert_eq!(ggml_type_name(30), Some("bf16"));
}

#[test]
fn file_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<moe_gguf::GgufError>();
}
