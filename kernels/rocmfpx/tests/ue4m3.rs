//! Every UE4M3 scale byte: its value against the spec's f32 bit construction, its
//! validity, and how decode and validate treat it in real blocks.

mod common;

use common::*;
use moe_quant_rocmfpx::ue4m3;

/// The spec's formula, built independently of the plugin from f32 bits:
/// exp > 0: bits ((exp + 119) << 23) | (man << 20); exp == 0: man * 2^-10.
/// `None` for the invalid bytes 0x7F and 0x80..=0xFF.
fn expected(b: u8) -> Option<f32> {
    if b == 0x7f || b & 0x80 != 0 {
        return None;
    }
    let (exp, man) = (((b >> 3) & 15) as u32, (b & 7) as u32);
    Some(if exp == 0 {
        // 2^-10 is exact as bits: exponent field 117.
        man as f32 * f32::from_bits(117 << 23)
    } else {
        f32::from_bits(((exp + 119) << 23) | (man << 20))
    })
}

#[test]
fn every_byte_value_and_validity() {
    let mut valid = 0;
    for b in 0..=255u8 {
        let got = ue4m3::decode(b);
        match expected(b) {
            Some(v) => {
                valid += 1;
                assert!(ue4m3::is_valid(b), "{b:#04x}");
                assert_eq!(got.to_bits(), v.to_bits(), "{b:#04x}: {got} vs {v}");
            }
            None => {
                assert!(!ue4m3::is_valid(b), "{b:#04x}");
                assert_eq!(got.to_bits(), 0, "{b:#04x} decodes to +0");
            }
        }
    }
    assert_eq!(valid, 127);
    assert_eq!(ue4m3::decode(0x01), 1.0 / 1024.0);
    assert_eq!(ue4m3::decode(0x7e), 224.0);
    assert_eq!(ue4m3::decode(ue4m3::ONE), 1.0);
}

/// One Q8_0_ROCMFPX block per byte, codes all 1: decoding gives the byte's value (0 for
/// the invalid ones, as upstream), and validate accepts exactly the valid bytes.
#[test]
fn every_byte_through_decode_and_validate() {
    let f = format(103);
    let mut blocks = vec![];
    for b in 0..=255u8 {
        let mut blk = [1u8; 33];
        blk[32] = b;
        blocks.extend_from_slice(&blk);
    }
    let out = decode(&f, 0, &blocks).unwrap();
    for b in 0..=255usize {
        let want = expected(b as u8).unwrap_or(0.0);
        for v in &out[32 * b..32 * b + 32] {
            assert_eq!(v.to_bits(), want.to_bits(), "byte {b:#04x}");
        }
    }
    validate(&f, 0, &blocks[..127 * 33]).unwrap();
    let e = validate(&f, 0, &blocks).unwrap_err();
    assert!(e.contains("block 127") && e.contains("0x7F"), "{e}");
}

/// Every type, every scale byte position, every invalid byte: validate names the block,
/// the scale field's block byte and the bad byte's value.
#[test]
fn validate_rejects_0x7f_and_sign_bit_bytes_everywhere() {
    let mut rng = Rng(7);
    for (id, variant, label) in DECODABLE {
        let f = format(id);
        let bb = f.block_bytes as usize;
        let blocks = random_valid_blocks(&f, 4, &mut rng);
        validate(&f, variant, &blocks).unwrap();
        for &off in scale_offsets(id) {
            for bad in 0x7f..=0xffu8 {
                let mut b = blocks.clone();
                b[2 * bb + off] = bad;
                let e = validate(&f, variant, &b).unwrap_err();
                assert!(
                    e.contains("block 2")
                        && e.contains(&format!("block byte {off}"))
                        && e.contains(&format!("0x{bad:02X}"))
                        && e.contains(f.name.as_str()),
                    "{label}: {e}"
                );
                let why = if bad == 0x7f { "NaN" } else { "sign bit" };
                assert!(e.contains(why), "{label}: {e}");
            }
            // Every valid byte is accepted in that position.
            for good in 0..=0x7eu8 {
                let mut b = blocks.clone();
                b[2 * bb + off] = good;
                validate(&f, variant, &b).unwrap();
            }
        }
    }
}
