//! Every code of every type: hand-built blocks with hand-computed values (nibble order,
//! sign handling, LSB-first packing across byte boundaries), then every code at every
//! position against levels written out here.

mod common;

use common::*;
use moe_quant_rocmfpx::ue4m3;

fn check(id: u32, variant: u64, block: &[u8], want: &[f32; 32]) {
    let f = format(id);
    assert_eq!(block.len(), f.block_bytes as usize, "{}", f.name);
    validate(&f, variant, block).unwrap();
    let got = decode(&f, variant, block).unwrap();
    for i in 0..32 {
        assert_eq!(
            got[i].to_bits(),
            want[i].to_bits(),
            "{} v{variant} weight {i}: {} vs {}\n got {got:?}",
            f.name,
            got[i],
            want[i]
        );
    }
}

// Scale bytes used below: 0x40 = 1.0, 0x48 = 2.0, 0x38 = 0.5, 0x30 = 0.25.

#[test]
fn rocmfp4_nibble_order_codebook_and_two_scales() {
    let mut b = [0u8; 18];
    for j in 0..16u8 {
        b[j as usize] = j | ((15 - j) << 4);
    }
    b[16] = 0x40;
    b[17] = 0x48;
    #[rustfmt::skip]
    let want = [
        0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -10.0,
        -20.0, -16.0, -12.0, -8.0, -6.0, -4.0, -2.0, 0.0, 20.0, 16.0, 12.0, 8.0, 6.0, 4.0, 2.0, 0.0,
    ];
    check(100, 0, &b, &want);
}

#[test]
fn rocmfp4_fast_one_scale() {
    let mut b = [0u8; 17];
    for j in 0..16u8 {
        b[j as usize] = j | ((15 - j) << 4);
    }
    b[16] = 0x38;
    #[rustfmt::skip]
    let want = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -5.0,
        -5.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 5.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0,
    ];
    check(101, 0, &b, &want);
}

#[test]
fn fp6_codes_cross_byte_boundaries() {
    let mut b = [0u8; 26];
    // qs[0] = 1100_0001: code 0 = 000001 (1); code 1 takes bits 6,7 (11) and the low
    // nibble of qs[1] (1000): 100011 = sign + 3 (-3). Code 2 = high nibble of qs[1] (0000)
    // and bits 0,1 of qs[2] (10): 100000 = "-0" (0). Code 3 = qs[2] >> 2 = 111111 (-31).
    b[0] = 0xC1;
    b[1] = 0x08;
    b[2] = 0xFE;
    // Weight 16 starts at bit 96 = byte 12: 011111 (31); weight 17 = bits 6,7 of qs[12]
    // (00) and the low nibble of qs[13] (0010): 001000 (8). Second-half scale 2.0.
    b[12] = 0x1F;
    b[13] = 0x02;
    b[24] = 0x40;
    b[25] = 0x48;
    let mut want = [0f32; 32];
    want[..4].copy_from_slice(&[1.0, -3.0, 0.0, -31.0]);
    want[16] = 62.0;
    want[17] = 16.0;
    check(102, 0, &b, &want);
}

#[test]
fn fp8_int8_codes() {
    let mut b = [0u8; 33];
    b[..9].copy_from_slice(&[0x00, 0x01, 0x02, 0x7E, 0x7F, 0x80, 0x81, 0xFE, 0xFF]);
    b[32] = 0x48;
    let mut want = [0f32; 32];
    want[..9].copy_from_slice(&[0.0, 2.0, 4.0, 252.0, 254.0, -256.0, -254.0, -4.0, -2.0]);
    check(103, 0, &b, &want);
}

#[test]
fn fp3_codes_cross_byte_boundaries() {
    // Codes 0..7 at bits 3i: 0x88 0xC6 0xFA; codes 7..0: 0x77 0x39 0x05 (code 2 spans
    // bits 6..8 and code 5 bits 15..17 of each 3-byte group).
    let g = [0x88, 0xC6, 0xFA, 0x77, 0x39, 0x05];
    let mut b = [0u8; 14];
    b[..6].copy_from_slice(&g);
    b[6..12].copy_from_slice(&g);
    b[12] = 0x40;
    b[13] = 0x30;
    #[rustfmt::skip]
    let want = [
        0.0, 1.0, 2.0, 4.0, 0.0, -1.0, -2.0, -4.0, -4.0, -2.0, -1.0, 0.0, 4.0, 2.0, 1.0, 0.0,
        0.0, 0.25, 0.5, 1.0, 0.0, -0.25, -0.5, -1.0, -1.0, -0.5, -0.25, 0.0, 1.0, 0.5, 0.25, 0.0,
    ];
    check(104, 0, &b, &want);
}

/// qs: 0xE4 = codes 0,1,2,3 (LSB first); 0x1B = 3,2,1,0; 0x55 = 1,1,1,1; 0x00 = 0,0,0,0.
const FP2_QS: [u8; 8] = [0xE4, 0x1B, 0x55, 0x55, 0xE4, 0x1B, 0x00, 0x00];

#[test]
fn fp2_two_scale_levels_per_half() {
    let mut b = [0u8; 10];
    b[..8].copy_from_slice(&FP2_QS);
    b[8] = 0x40; // 1.0
    b[9] = 0x30; // 0.25
    #[rustfmt::skip]
    let want = [
        -1.0, 0.0, 1.0, 2.0, 2.0, 1.0, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
        -0.25, 0.0, 0.25, 0.5, 0.5, 0.25, 0.0, -0.25,
        -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25,
    ];
    check(107, 1, &b, &want);
}

#[test]
fn fp2_affine_code_times_s_minus_o() {
    let mut b = [0u8; 10];
    b[..8].copy_from_slice(&FP2_QS);
    b[8] = 0x40; // S = 1.0
    b[9] = 0x30; // O = 0.25
    #[rustfmt::skip]
    let want = [
        -0.25, 0.75, 1.75, 2.75, 2.75, 1.75, 0.75, -0.25, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75, 0.75,
        -0.25, 0.75, 1.75, 2.75, 2.75, 1.75, 0.75, -0.25,
        -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25, -0.25,
    ];
    check(107, 2, &b, &want);
}

// ---------------------------------------------------------------- exhaustive

/// How a type stores its 32 codes.
enum Packing {
    /// Low nibbles of qs[0..16] are weights 0..16, high nibbles weights 16..32.
    Nibbles,
    /// `bits`-bit codes LSB-first at bit `bits * i`.
    Stream(usize),
    /// One i8 per weight.
    Bytes,
}

/// Packs codes bit by bit (independently of the plugin's packers).
fn pack(codes: &[u8; 32], p: &Packing, qs: &mut [u8]) {
    match *p {
        Packing::Nibbles => {
            for j in 0..16 {
                qs[j] = codes[j] | (codes[j + 16] << 4);
            }
        }
        Packing::Stream(bits) => {
            for (i, c) in codes.iter().enumerate() {
                for bit in 0..bits {
                    if (c >> bit) & 1 == 1 {
                        let n = bits * i + bit;
                        qs[n / 8] |= 1 << (n % 8);
                    }
                }
            }
        }
        Packing::Bytes => qs[..32].copy_from_slice(codes),
    }
}

const CB10: [f32; 16] = [
    0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -10.0,
];
const FP3: [f32; 8] = [0.0, 1.0, 2.0, 4.0, 0.0, -1.0, -2.0, -4.0];
const FP2: [f32; 4] = [-1.0, 0.0, 1.0, 2.0];

#[test]
fn every_code_at_every_position() {
    struct Case {
        id: u32,
        variant: u64,
        n_codes: usize,
        packing: Packing,
        qs_bytes: usize,
        /// Scale byte offsets; weight i uses scales[i / 16] when there are two.
        scales: &'static [usize],
        value: fn(code: u8, s: &[f32]) -> f32,
        half: fn(i: usize) -> usize,
    }
    fn split(i: usize) -> usize {
        i / 16
    }
    fn one(_: usize) -> usize {
        0
    }
    let cases = [
        Case {
            id: 100,
            variant: 0,
            n_codes: 16,
            packing: Packing::Nibbles,
            qs_bytes: 16,
            scales: &[16, 17],
            value: |c, s| CB10[c as usize] * s[0],
            half: split,
        },
        Case {
            id: 101,
            variant: 0,
            n_codes: 16,
            packing: Packing::Nibbles,
            qs_bytes: 16,
            scales: &[16],
            value: |c, s| CB10[c as usize] * s[0],
            half: one,
        },
        Case {
            id: 102,
            variant: 0,
            n_codes: 64,
            packing: Packing::Stream(6),
            qs_bytes: 24,
            scales: &[24, 25],
            // The level is an integer: "-0" (code 32) is 0, not -0.0.
            value: |c, s| {
                let m = (c % 32) as i32;
                (if c >= 32 { -m } else { m }) as f32 * s[0]
            },
            half: split,
        },
        Case {
            id: 103,
            variant: 0,
            n_codes: 256,
            packing: Packing::Bytes,
            qs_bytes: 32,
            scales: &[32],
            value: |c, s| (c as i8) as f32 * s[0],
            half: one,
        },
        Case {
            id: 104,
            variant: 0,
            n_codes: 8,
            packing: Packing::Stream(3),
            qs_bytes: 12,
            scales: &[12, 13],
            value: |c, s| FP3[c as usize] * s[0],
            half: split,
        },
        Case {
            id: 107,
            variant: 1,
            n_codes: 4,
            packing: Packing::Stream(2),
            qs_bytes: 8,
            scales: &[8, 9],
            value: |c, s| FP2[c as usize] * s[0],
            half: split,
        },
        // Affine: S = e[0], O = e[1] for every weight.
        Case {
            id: 107,
            variant: 2,
            n_codes: 4,
            packing: Packing::Stream(2),
            qs_bytes: 8,
            scales: &[8, 9],
            value: |c, s| c as f32 * s[0] - s[1],
            half: one,
        },
    ];
    let mut rng = Rng(42);
    for case in &cases {
        let f = format(case.id);
        let bb = f.block_bytes as usize;
        let mut blocks = vec![];
        let mut want = vec![];
        // Block t holds code (i + t) % n at weight i: every code lands on every position.
        for t in 0..case.n_codes {
            let codes: [u8; 32] = std::array::from_fn(|i| ((i + t) % case.n_codes) as u8);
            let mut b = vec![0u8; bb];
            pack(&codes, &case.packing, &mut b[..case.qs_bytes]);
            let e: Vec<u8> = case
                .scales
                .iter()
                .map(|_| (rng.next_u64() % 0x7f) as u8)
                .collect();
            for (&o, &e) in case.scales.iter().zip(&e) {
                b[o] = e;
            }
            let s: Vec<f32> = e.iter().map(|e| ue4m3::decode(*e)).collect();
            for (i, c) in codes.iter().enumerate() {
                let h = (case.half)(i);
                let scales: Vec<f32> = if case.variant == 2 {
                    s.clone()
                } else {
                    vec![s[h]]
                };
                want.push((case.value)(*c, &scales));
            }
            blocks.extend_from_slice(&b);
        }
        validate(&f, case.variant, &blocks).unwrap();
        let got = decode(&f, case.variant, &blocks).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{} v{} block {} weight {}: {g} vs {w}",
                f.name,
                case.variant,
                i / 32,
                i % 32
            );
        }
    }
}
