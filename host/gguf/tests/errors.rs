//! Broken and hostile files: each must be refused with a one-line message naming the file.
mod common;

use common::*;
use moe_gguf::{ggml_type_size, GgufError, GgufFile};

/// A valid file with one u32 key and one f32 tensor of `n` elements at data offset 0.
fn one_tensor_file(n: u64) -> Vec<u8> {
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("k", 1)
        .tensor("t", &[n], 0, 0)
        .data(32, n as usize * 4);
    r.done()
}

#[test]
fn baseline_is_valid() {
    let f = open_bytes(one_tensor_file(8)).unwrap();
    assert_eq!(f.tensor("t").unwrap().n_bytes, 32);
    assert_eq!(f.data_offset(), 96);
}

#[test]
fn bad_magic() {
    let mut b = one_tensor_file(8);
    b[..4].copy_from_slice(b"GGML");
    assert_eq!(
        err_of(b.clone()),
        r#"test.gguf: not a GGUF file (it starts with "GGML", expected "GGUF")"#
    );
    b[..4].copy_from_slice(b"\x7fELF");
    assert_eq!(
        err_of(b),
        r#"test.gguf: not a GGUF file (it starts with "\x7fELF", expected "GGUF")"#
    );
}

#[test]
fn unsupported_versions() {
    let with_version = |v: u32| {
        let mut b = one_tensor_file(8);
        b[4..8].copy_from_slice(&v.to_le_bytes());
        err_of(b)
    };
    assert_eq!(
        with_version(1),
        "test.gguf: unsupported GGUF version 1: GGUF v1 is obsolete; re-convert the model with a current llama.cpp"
    );
    assert_eq!(
        with_version(4),
        "test.gguf: unsupported GGUF version 4: only versions 2 and 3 are supported"
    );
    assert_eq!(
        with_version(0),
        "test.gguf: unsupported GGUF version 0: only versions 2 and 3 are supported"
    );
    assert_eq!(
        with_version(3u32.swap_bytes()),
        "test.gguf: unsupported GGUF version 50331648: the file looks big-endian; only little-endian GGUF is supported"
    );
}

#[test]
fn truncated_anywhere() {
    assert_eq!(
        err_of(vec![]),
        "test.gguf: truncated or corrupt: the GGUF magic needs 4 bytes at offset 0, but the file ends at 0"
    );
    assert_eq!(
        err_of(b"GGUF\x03\0".to_vec()),
        "test.gguf: truncated or corrupt: the version needs 4 bytes at offset 4, but the file ends at 6"
    );

    // Every prefix that cuts off header or tensor data fails; cutting only the final padding is fine.
    let full = sample_bytes(32);
    let f = open_bytes(full.clone()).unwrap();
    let data_end = f.data_offset()
        + f.tensors()
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .unwrap();
    assert!(data_end < full.len() as u64, "sample must end in padding");
    for len in 0..full.len() {
        match open_bytes(full[..len].to_vec()) {
            Ok(_) => assert!(len as u64 >= data_end, "prefix of {len} bytes was accepted"),
            Err(e) => {
                assert!((len as u64) < data_end, "prefix of {len} bytes: {e}");
                let msg = e.to_string();
                assert!(
                    msg.starts_with("test.gguf: ") && !msg.contains('\n'),
                    "{msg}"
                );
            }
        }
    }

    // One example in the middle of a metadata value: header 24 + key (8+1) + type 4 = 37; the
    // u32 value is at 37..41.
    let mut r = Raw::header(3, 0, 1);
    r.kv_u32("k", 1);
    assert_eq!(
        err_of(r.done()[..39].to_vec()),
        "test.gguf: truncated or corrupt: metadata key 'k' needs 4 bytes at offset 37, but the file ends at 39"
    );
    // And one in a tensor info: 'first' takes 24..85, 'second' has its dims at 103..111.
    let mut r = Raw::header(3, 2, 0);
    r.tensor("first", &[8, 1, 1, 1], 0, 0)
        .tensor("second", &[8], 0, 32);
    assert_eq!(
        err_of(r.done()[..110].to_vec()),
        "test.gguf: truncated or corrupt: tensor 'second' info needs 8 bytes at offset 103, but the file ends at 110"
    );
    // Cut so short that the counts cannot fit is reported as such.
    assert_eq!(
        err_of(one_tensor_file(8)[..50].to_vec()),
        "test.gguf: header claims 1 tensors, but the 26 bytes after it could hold at most 0"
    );
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    assert_eq!(
        err_of(Raw::header(3, u64::MAX, 0).done()),
        "test.gguf: header claims 18446744073709551615 tensors, but the 0 bytes after it could hold at most 0"
    );
    let mut r = Raw::header(3, 0, 1 << 40);
    r.kv_u32("k", 1);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: header claims 1099511627776 metadata entries, but the 17 bytes after it could hold at most 1"
    );

    // A key length far beyond the file.
    let mut r = Raw::header(3, 0, 1);
    r.u64(u64::MAX).u32(0).u32(0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: truncated or corrupt: the key of metadata entry #0 needs 18446744073709551615 bytes at offset 32, but the file ends at 40"
    );

    // A string value length far beyond the file.
    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(8).u64(1 << 50).u8(b'x');
    assert_eq!(
        err_of(r.done()),
        "test.gguf: truncated or corrupt: metadata key 's' needs 1125899906842624 bytes at offset 45, but the file ends at 46"
    );

    // Array lengths: flat, and nested inside an array whose own length is plausible.
    let mut r = Raw::header(3, 0, 1);
    r.str("a").u32(9).u32(4).u64(1 << 40).u32(7);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'a': array claims 1099511627776 elements of type u32, but only 4 bytes remain in the file"
    );
    let mut r = Raw::header(3, 0, 1);
    r.str("a").u32(9).u32(9).u64(1).u32(8).u64(u64::MAX);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'a': array claims 18446744073709551615 elements of type string, but only 0 bytes remain in the file"
    );

    // More array elements in total than the reader is willing to hold.
    let n = (1u64 << 24) + 1;
    let mut r = Raw::header(3, 0, 1);
    r.str("big").u32(9).u32(0).u64(n);
    r.0.resize(r.0.len() + n as usize, 0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'big': metadata arrays hold more than 16777216 elements in all"
    );

    // Tensor dims count far beyond 4 is refused before reading the dims.
    let mut r = Raw::header(3, 1, 0);
    r.str("t").u32(u32::MAX);
    r.0.resize(r.0.len() + 40, 0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensor 't' has 4294967295 dimensions; ggml supports 1 to 4"
    );
}

#[test]
fn bad_metadata_values() {
    let mut r = Raw::header(3, 0, 1);
    r.str("b").u32(7).u8(2);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'b': bool value is 2, not 0 or 1"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str("x").u32(13).u64(0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'x': unknown value type id 13"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str("x").u32(9).u32(99).u64(0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'x': array of unknown value type id 99"
    );

    let mut r = Raw::header(3, 0, 1);
    r.str("s").u32(8).u64(2).u8(0xc3).u8(0x28);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 's': string is not valid UTF-8 (bad byte at position 0)"
    );

    let mut r = Raw::header(3, 0, 1);
    r.u64(1).u8(0xff).u32(4).u32(0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: the key of metadata entry #0: string is not valid UTF-8 (bad byte at position 0)"
    );

    // 17 levels of nested one-element arrays.
    let mut r = Raw::header(3, 0, 1);
    r.str("deep").u32(9);
    for _ in 0..17 {
        r.u32(9).u64(1);
    }
    r.u32(0).u64(0);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: metadata key 'deep': arrays nested more than 16 deep"
    );

    let mut r = Raw::header(3, 0, 2);
    r.kv_u32("k", 1).kv_u32("k", 2);
    assert_eq!(err_of(r.done()), "test.gguf: duplicate metadata key 'k'");
}

#[test]
fn bad_alignment() {
    for (a, msg) in [
        (
            0,
            "general.alignment is 0; it must be a nonzero power of two",
        ),
        (
            48,
            "general.alignment is 48; it must be a nonzero power of two",
        ),
    ] {
        let mut r = Raw::header(3, 0, 1);
        r.kv_u32("general.alignment", a);
        assert_eq!(err_of(r.done()), format!("test.gguf: {msg}"));
    }
    let mut r = Raw::header(3, 0, 1);
    r.str("general.alignment").u32(10).u64(64);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: general.alignment must be a u32, but is u64 64"
    );
    // A valid non-default alignment moves the data section.
    let mut r = Raw::header(3, 1, 1);
    r.kv_u32("general.alignment", 256)
        .tensor("t", &[4], 0, 0)
        .data(256, 16);
    let f = open_bytes(r.done()).unwrap();
    assert_eq!((f.alignment(), f.data_offset()), (256, 256));
}

#[test]
fn bad_dims() {
    let file_with = |dims: &[u64]| {
        let mut r = Raw::header(3, 1, 0);
        r.tensor("t", dims, 0, 0).data(32, 64);
        r.done()
    };
    assert_eq!(
        err_of(file_with(&[])),
        "test.gguf: tensor 't' has 0 dimensions; ggml supports 1 to 4"
    );
    assert_eq!(
        err_of(file_with(&[1, 1, 1, 1, 1])),
        "test.gguf: tensor 't' has 5 dimensions; ggml supports 1 to 4"
    );
    assert_eq!(
        err_of(file_with(&[1 << 32, 1 << 32])),
        "test.gguf: tensor 't' dims [4294967296, 4294967296] give more than 2^63-1 elements"
    );
    assert_eq!(
        err_of(file_with(&[1 << 63, 0])),
        "test.gguf: tensor 't' dims [9223372036854775808, 0] give more than 2^63-1 elements"
    );
    // Elements fit i64 but the byte size of f32 does not fit u64.
    assert_eq!(
        err_of(file_with(&[1 << 31, 1 << 31])),
        "test.gguf: tensor 't' dims [2147483648, 2147483648] give a byte size over 2^64"
    );
    // A zero dim is an empty tensor, which is allowed.
    let f = open_bytes(file_with(&[4, 0])).unwrap();
    assert_eq!(f.tensor("t").unwrap().n_bytes, 0);
    assert_eq!(f.tensor_data(f.tensor("t").unwrap()), &[] as &[u8]);
}

#[test]
fn tensor_data_past_the_end() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.0.ffn_up.weight", &[1024], 0, 0).data(32, 100);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensor 'blk.0.ffn_up.weight' data (offset 96, 4096 bytes) runs past the end of the file (size 196)"
    );
    // An offset so large that offset + size overflows.
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[8], 0, u64::MAX - 31).data(32, 32);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensor 't' data (offset 18446744073709551615, 32 bytes) runs past the end of the file (size 96)"
    );
}

#[test]
fn overlapping_and_misaligned_tensors() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("b", &[16], 0, 32)
        .tensor("a", &[16], 0, 0)
        .data(32, 128);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensors 'a' (data offset 0, 64 bytes) and 'b' (data offset 32) overlap"
    );
    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[4], 0, 4).data(32, 64);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensor 't' data offset 4 is not a multiple of the alignment 32"
    );
    // Two tensors sharing an offset where one is empty do not overlap.
    let mut r = Raw::header(3, 2, 0);
    r.tensor("e", &[0], 0, 0)
        .tensor("t", &[4], 0, 0)
        .data(32, 16);
    assert!(open_bytes(r.done()).is_ok());
}

#[test]
fn duplicate_tensor_names() {
    let mut r = Raw::header(3, 2, 0);
    r.tensor("t", &[8], 0, 0)
        .tensor("t", &[8], 0, 32)
        .data(32, 64);
    assert_eq!(err_of(r.done()), "test.gguf: duplicate tensor name 't'");
    // Names from the file are escaped, so the message stays one line.
    let mut r = Raw::header(3, 2, 0);
    r.tensor("a\nb'", &[8], 0, 0)
        .tensor("a\nb'", &[8], 0, 32)
        .data(32, 64);
    assert_eq!(
        err_of(r.done()),
        r"test.gguf: duplicate tensor name 'a\nb\''"
    );
}

#[test]
fn unknown_type_and_block_size() {
    let mut r = Raw::header(3, 1, 0);
    r.tensor("blk.0.attn_q.weight", &[32], 4, 0).data(32, 64);
    let bytes = r.done();
    assert_eq!(
        err_of(bytes.clone()),
        "test.gguf: tensor 'blk.0.attn_q.weight' has type id 4 which no loaded quant plugin claims"
    );
    // The same file is fine once a plugin claims type 4.
    let plugin = |id: u32| {
        if id == 4 {
            Some((32, 20))
        } else {
            ggml_type_size(id)
        }
    };
    let f = GgufFile::from_bytes(bytes.clone(), "test.gguf", &plugin).unwrap();
    assert_eq!(f.tensors()[0].n_bytes, 20);
    // A plugin reporting an empty block is refused rather than dividing by zero.
    let broken = |id: u32| if id == 4 { Some((0, 0)) } else { None };
    let e = GgufFile::from_bytes(bytes, "test.gguf", &broken).unwrap_err();
    assert_eq!(
        e.to_string(),
        "test.gguf: tensor 'blk.0.attn_q.weight': the quant plugin for type id 4 reports an empty block (0 weights, 0 bytes)"
    );

    let mut r = Raw::header(3, 1, 0);
    r.tensor("t", &[16, 2], 8, 0).data(32, 64);
    assert_eq!(
        err_of(r.done()),
        "test.gguf: tensor 't' (type q8_0) has rows of 16 elements, not a multiple of its block size 32"
    );
}

#[test]
fn missing_file_names_the_path() {
    let path = tmp_dir("missing").join("missing.gguf");
    let e = GgufFile::open(&path, SIZES).unwrap_err();
    assert!(matches!(e, GgufError::Io { .. }));
    assert_eq!(e.file(), path.display().to_string());
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{}: cannot open: ", path.display())),
        "{msg}"
    );

    // An empty file on disk is a truncation, not an mmap failure.
    let empty = tmp_dir("empty").join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    let msg = GgufFile::open(&empty, SIZES).unwrap_err().to_string();
    assert!(
        msg.contains("empty.gguf: truncated or corrupt: the GGUF magic"),
        "{msg}"
    );
}
