//! Helpers shared by the integration tests (each test binary uses a subset).
#![allow(dead_code)]

use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut, RStr},
    into_result, BlockQ8_1, QuantFormat, Variant,
};

/// Every format, through the same tables the host gets.
pub fn formats() -> Vec<QuantFormat> {
    moe_quant_rocmfpx::all_formats()
}

pub fn format(id: u32) -> QuantFormat {
    formats()
        .into_iter()
        .find(|f| f.type_id == id)
        .unwrap_or_else(|| panic!("no format {id}"))
}

/// The decodable (type id, variant) pairs, with a label for messages.
pub const DECODABLE: [(u32, Variant, &str); 7] = [
    (100, 0, "Q4_0_ROCMFP4"),
    (101, 0, "Q4_0_ROCMFP4_FAST"),
    (102, 0, "Q6_0_ROCMFPX"),
    (103, 0, "Q8_0_ROCMFPX"),
    (104, 0, "Q3_0_ROCMFPX"),
    (107, 1, "Q2_0_ROCMFP2 two-scale"),
    (107, 2, "Q2_0_ROCMFP2 affine"),
];

pub fn decode(f: &QuantFormat, v: Variant, blocks: &[u8]) -> Result<Vec<f32>, String> {
    let n = blocks.len() / f.block_bytes as usize * f.block_weights as usize;
    let mut out = vec![f32::NAN; n];
    into_result((f.decode)(
        v,
        RSlice::from_slice(blocks),
        RSliceMut::from_mut_slice(&mut out),
    ))?;
    Ok(out)
}

pub fn encode(f: &QuantFormat, v: Variant, x: &[f32]) -> Result<Vec<u8>, String> {
    let n = x.len() / f.block_weights as usize * f.block_bytes as usize;
    let mut out = vec![0xAAu8; n];
    into_result((f.encode)(
        v,
        RSlice::from_slice(x),
        RSliceMut::from_mut_slice(&mut out),
    ))?;
    Ok(out)
}

pub fn validate(f: &QuantFormat, v: Variant, blocks: &[u8]) -> Result<(), String> {
    into_result((f.validate)(v, RSlice::from_slice(blocks)))
}

pub fn resolve(f: &QuantFormat, metadata_json: &str) -> Result<Variant, String> {
    into_result((f.resolve_variant)(RStr::from(metadata_json)))
}

pub fn dot_q8(
    f: &QuantFormat,
    v: Variant,
    rows: &[u8],
    k: usize,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    into_result((f.dot_q8)(
        v,
        RSlice::from_slice(rows),
        k as u64,
        RSlice::from_slice(act),
        RSliceMut::from_mut_slice(out),
    ))
}

/// Normalised RMSE: sqrt(sum (y - x)^2 / sum x^2), in f64.
pub fn nrmse(x: &[f32], y: &[f32]) -> f64 {
    assert_eq!(x.len(), y.len());
    let (mut e, mut n) = (0f64, 0f64);
    for (a, b) in x.iter().zip(y) {
        let d = *b as f64 - *a as f64;
        e += d * d;
        n += *a as f64 * *a as f64;
    }
    (e / n).sqrt()
}

// The seedable test-data generator both quant plugins' tests share.
#[path = "../../../../tests/support/rng.rs"]
mod rng;
pub use rng::Rng;

/// Byte offsets of the scale bytes in a block of type `id`.
pub fn scale_offsets(id: u32) -> &'static [usize] {
    match id {
        100 => &[16, 17],
        101 => &[16],
        102 => &[24, 25],
        103 => &[32],
        104 => &[12, 13],
        105 => &[12, 13],
        106 | 107 => &[8, 9],
        _ => panic!("type {id}"),
    }
}

/// Random valid blocks: random code bytes, scale bytes in a realistic valid range.
pub fn random_valid_blocks(f: &QuantFormat, n: usize, rng: &mut Rng) -> Vec<u8> {
    let bb = f.block_bytes as usize;
    let mut b = rng.bytes(n * bb);
    for blk in b.chunks_exact_mut(bb) {
        for &o in scale_offsets(f.type_id) {
            blk[o] = 0x20 + (rng.next_u64() % 0x30) as u8;
        }
    }
    b
}

pub fn seed_from_clock() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}
