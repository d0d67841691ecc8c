//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut},
    into_result, BlockQ8_1, QuantFormat,
};

/// Every format, through the same tables the host gets.
pub fn formats() -> Vec<QuantFormat> {
    moe_quant_ggml::all_formats()
}

pub fn format(name: &str) -> QuantFormat {
    formats()
        .into_iter()
        .find(|f| f.name.as_str() == name)
        .unwrap_or_else(|| panic!("no format {name}"))
}

pub fn decode(f: &QuantFormat, blocks: &[u8]) -> Result<Vec<f32>, String> {
    let n = blocks.len() / f.block_bytes as usize * f.block_weights as usize;
    let mut out = vec![0f32; n];
    into_result((f.decode)(
        0,
        RSlice::from_slice(blocks),
        RSliceMut::from_mut_slice(&mut out),
    ))?;
    Ok(out)
}

pub fn encode(f: &QuantFormat, x: &[f32]) -> Result<Vec<u8>, String> {
    let n = x.len() / f.block_weights as usize * f.block_bytes as usize;
    let mut out = vec![0u8; n];
    into_result((f.encode)(
        0,
        RSlice::from_slice(x),
        RSliceMut::from_mut_slice(&mut out),
    ))?;
    Ok(out)
}

pub fn validate(f: &QuantFormat, blocks: &[u8]) -> Result<(), String> {
    into_result((f.validate)(0, RSlice::from_slice(blocks)))
}

pub fn dot_q8(
    f: &QuantFormat,
    rows: &[u8],
    k: usize,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    into_result((f.dot_q8)(
        0,
        RSlice::from_slice(rows),
        k as u64,
        RSlice::from_slice(act),
        RSliceMut::from_mut_slice(out),
    ))
}

/// Equal bit patterns, or both NaN (payloads may differ between numpy and us).
pub fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// Asserts `ours` equals gguf-py's `theirs` bit for bit; reports the first mismatches.
pub fn assert_bit_exact(what: &str, block_weights: usize, ours: &[f32], theirs: &[f32]) {
    assert_eq!(ours.len(), theirs.len(), "{what}: lengths differ");
    let bad: Vec<usize> = (0..ours.len())
        .filter(|&i| !same(ours[i], theirs[i]))
        .collect();
    if !bad.is_empty() {
        let show: Vec<String> = bad
            .iter()
            .take(8)
            .map(|&i| {
                format!(
                    "[{i}] block {} ours {:e} (0x{:08x}) gguf-py {:e} (0x{:08x})",
                    i / block_weights,
                    ours[i],
                    ours[i].to_bits(),
                    theirs[i],
                    theirs[i].to_bits()
                )
            })
            .collect();
        panic!(
            "{what}: {} of {} values differ from gguf-py:\n  {}",
            bad.len(),
            ours.len(),
            show.join("\n  ")
        );
    }
}

pub fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh directory under the system temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p = std::env::temp_dir().join(format!(
            "moe-quant-ggml-{tag}-{}-{nanos}",
            std::process::id()
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether `python3` can import the PyPI `gguf` package (and numpy).
pub fn python_gguf() -> Option<String> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import numpy, gguf; from importlib.metadata import version; \
             print(version('gguf'), numpy.__version__)",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let v = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let mut it = v.split_whitespace();
    Some(format!("gguf {} numpy {}", it.next()?, it.next()?))
}

pub fn run_python(args: &[&str]) {
    let out = Command::new("python3")
        .args(args)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "python3 {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// The seedable test-data generator both quant plugins' tests share.
#[path = "../../../../tests/support/rng.rs"]
mod rng;
pub use rng::Rng;

/// Byte offsets of the f16 scale fields (d, m / dmin) in a block of the named type.
pub fn scale_offsets(name: &str) -> &'static [usize] {
    match name {
        "Q4_0" | "Q5_0" | "Q8_0" => &[0],
        "Q4_1" | "Q5_1" | "Q4_K" | "Q5_K" => &[0, 2],
        "Q2_K" => &[80, 82],
        "Q3_K" => &[108],
        "Q6_K" => &[208],
        _ => &[],
    }
}

/// Random but valid blocks of `f`: random bytes, f16 scale fields replaced by finite
/// realistic values, MXFP4 scale bytes kept below 0xFF and in a sane range.
pub fn random_valid_blocks(f: &QuantFormat, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = f.block_bytes as usize;
    let mut b = rng.bytes(n * bb);
    for blk in b.chunks_exact_mut(bb) {
        for &o in scale_offsets(f.name.as_str()) {
            let v = half::f16::from_f32(rng.normal() * 0.01);
            blk[o..o + 2].copy_from_slice(&v.to_le_bytes());
        }
        if f.name.as_str() == "MXFP4" {
            blk[0] = 110 + (rng.next_u64() % 30) as u8;
        }
    }
    if f.block_weights == 1 {
        // Float types: finite random values instead of random bit patterns.
        let vals: Vec<f32> = (0..n).map(|_| rng.normal()).collect();
        return encode(f, &vals).unwrap();
    }
    b
}

pub fn seed_from_clock() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}
