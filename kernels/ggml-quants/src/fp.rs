//! Small exact float helpers shared by the formats.

/// Widens IEEE binary16 bits to f32, exactly (normals, subnormals, infinities; NaNs stay
/// NaN with their payload shifted up, which is what numpy's `astype(np.float32)` does).
///
/// Used by the portable kernels and by block decoding (scale fields). Branch-free and
/// inlinable, unlike `half::f16::to_f32`, which detects F16C at run time on every call.
/// `tests::fast_f16_matches_half` checks all 65,536 inputs against `half`; the F16 tensor
/// type itself decodes through `half`'s slice conversion.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let em = (h as u32) & 0x7fff;
    // Shifting exponent+mantissa into place and scaling by 2^112 rebias normals and
    // turns the integer subnormal mantissa into the right value; both are exact.
    let scaled = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000);
    let bits = if em >= 0x7c00 {
        (em << 13) | 0x7f80_0000
    } else {
        scaled.to_bits()
    };
    f32::from_bits(bits | sign)
}

/// The f16 at byte offset `off` (little-endian), widened to f32 the way `O` does it
/// (all ways are exact and agree except for NaN payloads).
#[inline(always)]
pub fn f16_at<O: crate::dot::Ops>(b: &[u8], off: usize) -> f32 {
    O::f16(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// Raw f16 bits at byte offset `off`.
#[inline(always)]
pub fn f16_bits_at(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

/// Widens bfloat16 bits to f32 (exact, NaN payload kept, like gguf-py's `<< 16`).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// ggml's MXFP4 scale: the e8m0 value 2^(e-127) HALVED (2^(e-128)), because the e2m1
/// table is stored doubled as integers. e = 0 and 1 give f32 subnormals. e = 0xFF, NaN in
/// the OCP MX spec, comes out as 2^127 here, exactly as gguf-py and ggml decode it.
#[inline(always)]
pub fn e8m0_half_to_f32(e: u8) -> f32 {
    if e < 2 {
        f32::from_bits(0x0020_0000u32 << e)
    } else {
        f32::from_bits(((e as u32) - 1) << 23)
    }
}

/// Rounds `v` to f16 (round to nearest even, via `half`) for an encoder, refusing values
/// that do not stay finite. Returns the bits and the value the decoder will see.
pub fn f16_checked(v: f32, what: &str) -> Result<(u16, f32), String> {
    let h = half::f16::from_f32(v);
    let back = h.to_f32();
    if !back.is_finite() {
        return Err(format!(
            "{what} = {v} does not fit in an f16 scale (input values too large for this type)"
        ));
    }
    Ok((h.to_bits(), back))
}

/// Rejects a non-finite f16 scale field in a block.
pub fn check_f16(b: &[u8], off: usize, what: &str) -> Result<(), String> {
    let bits = f16_bits_at(b, off);
    if bits & 0x7c00 == 0x7c00 {
        let kind = if bits & 0x03ff == 0 {
            "infinite"
        } else {
            "NaN"
        };
        return Err(format!("{what} is {kind} (f16 bits 0x{bits:04x})"));
    }
    Ok(())
}

/// Round half away from zero (C `roundf`, gguf-py's `np_roundf`), then clamp.
#[inline(always)]
pub fn round_clamp(v: f32, lo: i32, hi: i32) -> i32 {
    // `as i32` saturates and maps NaN to 0, so this never panics.
    (v.round() as i32).clamp(lo, hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_f16_matches_half() {
        for bits in 0..=u16::MAX {
            let ours = f16_to_f32(bits);
            let theirs = half::f16::from_bits(bits).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "0x{bits:04x}");
                assert_eq!(ours.is_sign_negative(), theirs.is_sign_negative());
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "0x{bits:04x}");
            }
        }
    }

    #[test]
    fn e8m0_half_is_a_power_of_two() {
        for e in 0..=255u8 {
            let v = e8m0_half_to_f32(e) as f64;
            assert_eq!(v, 2f64.powi(e as i32 - 128), "e = {e}");
        }
    }
}
