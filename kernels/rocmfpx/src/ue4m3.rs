//! UE4M3: the unsigned 8-bit float every ROCmFPx scale byte uses.
//!
//! A byte `b` has a 4-bit exponent `(b >> 3) & 15` and a 3-bit mantissa `b & 7`;
//! exponent 0 is subnormal (`man * 2^-10`), otherwise the value is
//! `(8 + man) * 2^(exp - 11)`. So 0x00 is 0, 0x01 is 2^-10, 0x08 is 2^-7, 0x40 is 1 and
//! 0x7E, the largest, is 224. 0x7F (the NaN slot of E4M3) and every byte with bit 7 set
//! are not scales: they decode to 0 here (as upstream) and `validate` rejects them.

/// The largest valid scale byte (224.0).
pub const MAX_BYTE: u8 = 0x7e;

/// The byte whose value is 1.0.
pub const ONE: u8 = 0x40;

/// Whether `b` is a finite, non-negative UE4M3 value (0x00..=0x7E).
#[inline(always)]
pub const fn is_valid(b: u8) -> bool {
    b <= MAX_BYTE
}

/// `2^e` for small `e`, by repeated exact doubling/halving (usable in const context).
const fn pow2(e: i32) -> f32 {
    let mut v = 1.0f32;
    let mut i = 0;
    while i < e {
        v *= 2.0;
        i += 1;
    }
    while i > e {
        v *= 0.5;
        i -= 1;
    }
    v
}

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0;
    while b <= MAX_BYTE as usize {
        let exp = ((b >> 3) & 15) as i32;
        let man = (b & 7) as i32;
        t[b] = if exp == 0 {
            man as f32 * pow2(-10)
        } else {
            (8 + man) as f32 * pow2(exp - 11)
        };
        b += 1;
    }
    t
}

/// Every byte's value; invalid bytes hold 0.
pub static TABLE: [f32; 256] = build_table();

/// The value of scale byte `b` (0 for the invalid bytes 0x7F..=0xFF).
#[inline(always)]
pub fn decode(b: u8) -> f32 {
    TABLE[b as usize]
}

/// The valid byte nearest to `target`; ties go to the smaller byte. A target that is not
/// a positive finite number gives 0x00; any positive target gives at least 0x01 (upstream's
/// convention: a positive scale never snaps to zero). Targets above 224 give 0x7E.
pub fn nearest(target: f32) -> u8 {
    if !target.is_finite() || target <= 0.0 {
        return 0;
    }
    let vals = &TABLE[1..=MAX_BYTE as usize];
    // First index whose value is >= target (the values increase strictly).
    let i = vals.partition_point(|v| *v < target);
    if i == 0 {
        return 1;
    }
    if i == vals.len() {
        return MAX_BYTE;
    }
    let (lo, hi) = (vals[i - 1], vals[i]);
    // Byte of vals[j] is j + 1.
    if target - lo <= hi - target {
        i as u8
    } else {
        i as u8 + 1
    }
}

/// Checks the scale bytes at `offsets` of one block; the error names the field and byte.
pub fn check(block: &[u8], fields: &[(usize, &str)]) -> Result<(), String> {
    for &(off, name) in fields {
        let b = block[off];
        if !is_valid(b) {
            let why = if b == 0x7f {
                "the UE4M3 NaN encoding"
            } else {
                "a byte with the sign bit set"
            };
            return Err(format!(
                "scale byte {name} (block byte {off}) is 0x{b:02X}, {why}: valid scales are \
                 0x00..=0x7E"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn landmarks() {
        assert_eq!(decode(0x00), 0.0);
        assert_eq!(decode(0x01), 1.0 / 1024.0);
        assert_eq!(decode(0x07), 7.0 / 1024.0);
        assert_eq!(decode(0x08), 8.0 / 1024.0);
        assert_eq!(decode(ONE), 1.0);
        assert_eq!(decode(MAX_BYTE), 224.0);
        assert_eq!(decode(0x7f), 0.0);
        assert_eq!(decode(0xb8), 0.0);
    }

    #[test]
    fn values_increase_strictly() {
        for b in 1..=MAX_BYTE {
            assert!(decode(b) > decode(b - 1), "{b:#x}");
        }
    }

    #[test]
    fn nearest_snaps_and_breaks_ties_down() {
        for b in 1..=MAX_BYTE {
            assert_eq!(nearest(decode(b)), b, "{b:#x}");
        }
        // Midway between 1.0 (0x40) and 1.125 (0x41): the smaller byte.
        assert_eq!(nearest(1.0625), 0x40);
        assert_eq!(nearest(1.0626), 0x41);
        assert_eq!(nearest(1e-9), 0x01);
        assert_eq!(nearest(1e9), MAX_BYTE);
        assert_eq!(nearest(0.0), 0);
        assert_eq!(nearest(-1.0), 0);
        assert_eq!(nearest(f32::NAN), 0);
        assert_eq!(nearest(f32::INFINITY), 0);
    }
}
