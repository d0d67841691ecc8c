//! Seeded random mutations of a valid file: the reader must answer Ok or a one-line Err, never
//! panic, and an Ok file's tensor slices must be exactly their sizes.
mod common;

use common::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

const CASES: u64 = 10_000;

fn mutate(rng: &mut Rng, b: &mut Vec<u8>) {
    let len = b.len();
    match rng.below(7) {
        // Flip one bit.
        0 if len > 0 => b[rng.below(len)] ^= 1 << rng.below(8),
        // Overwrite one byte.
        1 if len > 0 => b[rng.below(len)] = rng.next() as u8,
        // Truncate.
        2 => b.truncate(rng.below(len + 1)),
        // Insert a few random bytes.
        3 => {
            let at = rng.below(len + 1);
            let n = 1 + rng.below(16);
            let bytes = pseudo_bytes(rng.next(), n);
            b.splice(at..at, bytes);
        }
        // Remove a few bytes.
        4 if len > 0 => {
            let at = rng.below(len);
            let end = (at + 1 + rng.below(16)).min(len);
            b.drain(at..end);
        }
        // Write a huge or edge-case length/count/offset anywhere (4 or 8 bytes).
        5 | 6 => {
            let v = match rng.below(8) {
                0 => u64::MAX,
                1 => 1 << 63,
                2 => 1 << 40,
                3 => u32::MAX as u64,
                4 => 0,
                5 => len as u64,
                6 => rng.next() % 64,
                _ => rng.next(),
            };
            // Header counts sit at 8 and 16: target them often.
            let at = match rng.below(4) {
                0 => 8,
                1 => 16,
                _ => rng.below(len.max(1)),
            };
            let width = if rng.below(2) == 0 { 8 } else { 4 };
            let bytes = v.to_le_bytes();
            for (i, &byte) in bytes[..width].iter().enumerate() {
                if let Some(slot) = b.get_mut(at + i) {
                    *slot = byte;
                }
            }
        }
        _ => {}
    }
}

#[test]
fn seeded_mutations_never_panic() {
    let bases = [sample_bytes(32), sample_bytes(8), one_kv_file()];
    let (mut ok, mut err) = (0, 0);
    for case in 0..CASES {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (case + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        let mut bytes = bases[case as usize % bases.len()].clone();
        for _ in 0..1 + rng.below(4) {
            mutate(&mut rng, &mut bytes);
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| match open_bytes(bytes) {
            Ok(f) => {
                for t in f.tensors() {
                    assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
                    assert!(t.offset % f.alignment() == 0);
                }
                let _ = f.scalar_metadata_json();
                true
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(msg.starts_with("test.gguf: "), "{msg}");
                assert!(!msg.contains('\n'), "{msg}");
                false
            }
        }));
        match outcome {
            Ok(true) => ok += 1,
            Ok(false) => err += 1,
            Err(_) => panic!("case {case} panicked (see above)"),
        }
    }
    println!("{CASES} mutated files: {ok} accepted, {err} refused");
    // Both outcomes must actually be exercised.
    assert!(ok > CASES / 50 && err > CASES / 2, "ok {ok}, err {err}");
}

/// A file with a single string key: mutations there mostly hit lengths and type ids.
fn one_kv_file() -> Vec<u8> {
    let mut w = moe_gguf::GgufWriter::new(32);
    w.add_kv(
        "tokenizer.ggml.tokens",
        moe_gguf::Value::Array(vec![moe_gguf::Value::String("<s>".into()); 4]),
    );
    let mut out = Vec::new();
    w.write_to(&mut out).unwrap();
    out
}
