//! Shared by the integration tests: a sample file and a raw byte builder for broken files.
#![allow(dead_code)] // each test crate uses a different part

use moe_gguf::{GgufFile, GgufWriter, Value};
use std::path::PathBuf;

pub const SIZES: moe_gguf::TypeSizeFn = &moe_gguf::ggml_type_size;

pub fn open_bytes(bytes: Vec<u8>) -> Result<GgufFile, moe_gguf::GgufError> {
    GgufFile::from_bytes(bytes, "test.gguf", SIZES)
}

/// Error message of a file that must fail to open.
pub fn err_of(bytes: Vec<u8>) -> String {
    match open_bytes(bytes) {
        Ok(_) => panic!("expected the file to be refused"),
        Err(e) => e.to_string(),
    }
}

/// A fresh directory under cargo's per-target temp dir.
pub fn tmp_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("moe-gguf-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One metadata entry of every value type, plus arrays (nested, empty, of each kind).
pub fn all_values() -> Vec<(&'static str, Value)> {
    use Value::*;
    let s = |x: &str| String(x.to_string());
    vec![
        ("general.architecture", s("llama")),
        ("v.u8", U8(255)),
        ("v.i8", I8(-128)),
        ("v.u16", U16(65535)),
        ("v.i16", I16(-32768)),
        ("v.u32", U32(u32::MAX)),
        ("v.i32", I32(i32::MIN)),
        ("v.f32", F32(0.1)),
        ("v.bool_t", Bool(true)),
        ("v.bool_f", Bool(false)),
        ("v.string", s("héllo ✓\n\"quoted\"")),
        ("v.empty_string", s("")),
        ("v.u64", U64(u64::MAX)),
        ("v.i64", I64(i64::MIN)),
        ("v.f64", F64(-2.5e-300)),
        ("a.str", Array(vec![s("a"), s(""), s("ünï"), s("<0x0A>")])),
        ("a.u8", Array(vec![U8(0), U8(7), U8(255)])),
        ("a.i8", Array(vec![I8(-1), I8(1)])),
        ("a.u16", Array(vec![U16(1), U16(65535)])),
        ("a.i16", Array(vec![I16(-2), I16(2)])),
        ("a.u32", Array(vec![U32(3), U32(4_000_000_000)])),
        ("a.i32", Array(vec![I32(-3), I32(3), I32(i32::MAX)])),
        ("a.f32", Array(vec![F32(0.5), F32(-1.25), F32(1e-3)])),
        ("a.bool", Array(vec![Bool(true), Bool(false)])),
        ("a.u64", Array(vec![U64(0), U64(u64::MAX)])),
        ("a.i64", Array(vec![I64(i64::MIN), I64(i64::MAX)])),
        ("a.f64", Array(vec![F64(1e300), F64(-0.0)])),
        ("a.empty", Array(vec![])),
        (
            "a.nested",
            Array(vec![
                Array(vec![I32(1), I32(2), I32(3)]),
                Array(vec![I32(4)]),
                Array(vec![]),
            ]),
        ),
        (
            "a.nested_str",
            Array(vec![Array(vec![Array(vec![s("deep")])]), Array(vec![])]),
        ),
    ]
}

/// Deterministic pseudo-random bytes (xorshift64*).
pub fn pseudo_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = Rng(seed | 1);
    (0..n).map(|_| rng.next() as u8).collect()
}

/// Tiny deterministic PRNG (xorshift64*), so failures reproduce without a rand dependency.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Tensors of a few types: (name, ggml dims, type id, data).
pub fn sample_tensors() -> Vec<(&'static str, Vec<u64>, u32, Vec<u8>)> {
    let f32_data: Vec<u8> = (0..12)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    vec![
        ("t.f32", vec![4, 3], 0, f32_data),
        ("t.f16", vec![8, 2], 1, pseudo_bytes(1, 8 * 2 * 2)),
        ("t.q8_0", vec![64, 2, 1], 8, pseudo_bytes(2, 2 * 2 * 34)),
        ("t.q4_k", vec![256], 12, pseudo_bytes(3, 144)),
        ("t.empty", vec![0, 5], 0, vec![]),
        ("t.i8", vec![3], 24, vec![1, 2, 3]),
    ]
}

pub fn sample_writer(alignment: u64) -> GgufWriter {
    let mut w = GgufWriter::new(alignment);
    for (k, v) in all_values() {
        w.add_kv(k, v);
    }
    for (name, dims, ty, data) in sample_tensors() {
        w.add_tensor(name, &dims, ty, data);
    }
    w
}

pub fn sample_bytes(alignment: u64) -> Vec<u8> {
    let mut out = Vec::new();
    sample_writer(alignment)
        .write_to(&mut out)
        .expect("write sample");
    out
}

/// Little-endian byte builder for hand-made (often broken) files.
#[derive(Default)]
pub struct Raw(pub Vec<u8>);
impl Raw {
    /// Magic, version, tensor count, kv count.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        let mut r = Raw(b"GGUF".to_vec());
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.0.extend_from_slice(s.as_bytes());
        self
    }
    /// A u32 metadata entry.
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.str(key).u32(4).u32(v)
    }
    pub fn tensor(&mut self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> &mut Self {
        self.str(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(type_id).u64(offset)
    }
    /// Pads to `align` and appends `n` data bytes.
    pub fn data(&mut self, align: usize, n: usize) -> &mut Self {
        let padded = self.0.len().next_multiple_of(align);
        self.0.resize(padded + n, 0);
        self
    }
    pub fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.0)
    }
}
