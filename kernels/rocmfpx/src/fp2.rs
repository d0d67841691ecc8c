//! Type 107 (Q2_0_ROCMFP2): which of its two meanings a file uses, and the reference
//! quantiser of the affine meaning.
//!
//! The same 10-byte block means two incompatible things depending on how the upstream
//! writer was built:
//!
//! * **two-scale** (variant [`VARIANT_TWO_SCALE`] = 1; the default upstream build):
//!   `w_i = (c_i - 1) * UE4M3(e[i / 16])`, levels -1, 0, 1, 2 per 16-weight half;
//! * **affine** (variant [`VARIANT_AFFINE`] = 2; upstream built with `ROCMFP2_AFFINE`, as
//!   the published DeepSeek-V4-Flash "Strix-Lean" files are): `w_i = c_i * S - O` with
//!   `S = UE4M3(e[0])`, `O = UE4M3(e[1])` for all 32 weights.
//!
//! Nothing in an upstream file says which (upstream writes no metadata for it), so the
//! meaning is never guessed: it comes from the plugin setting `fp2 = "affine"` /
//! `fp2 = "two-scale"` in plugins.toml, or from the GGUF string key
//! [`METADATA_KEY`] (`rocmfpx.fp2_mode`, value `"affine"` or `"two-scale"`) that a
//! writer (or a user, with gguf-py's `gguf_set_metadata`/`gguf_new_metadata`) adds.
//! Neither: an error saying how to choose. Both but different: an error too.

use std::sync::atomic::{AtomicU8, Ordering};

use moe_plugin_api::Variant;

use crate::formats::QK;
use crate::ue4m3;

pub const VARIANT_TWO_SCALE: Variant = 1;
pub const VARIANT_AFFINE: Variant = 2;

/// The GGUF metadata key this plugin reads: a string, `"affine"` or `"two-scale"`.
pub const METADATA_KEY: &str = "rocmfpx.fp2_mode";

/// The plugin setting (in `[plugin.settings]`) with the same values.
pub const SETTING: &str = "fp2";

/// One meaning of type 107.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp2Mode {
    TwoScale,
    Affine,
}

impl Fp2Mode {
    pub const ALL: [Fp2Mode; 2] = [Fp2Mode::TwoScale, Fp2Mode::Affine];

    pub fn as_str(self) -> &'static str {
        match self {
            Fp2Mode::TwoScale => "two-scale",
            Fp2Mode::Affine => "affine",
        }
    }

    /// Exact spelling only: "affine" or "two-scale".
    pub fn parse(s: &str) -> Option<Fp2Mode> {
        Fp2Mode::ALL.into_iter().find(|m| m.as_str() == s)
    }

    pub fn variant(self) -> Variant {
        match self {
            Fp2Mode::TwoScale => VARIANT_TWO_SCALE,
            Fp2Mode::Affine => VARIANT_AFFINE,
        }
    }

    pub fn from_variant(v: Variant) -> Option<Fp2Mode> {
        Fp2Mode::ALL.into_iter().find(|m| m.variant() == v)
    }
}

/// The `fp2` setting from the last successful `configure` (0 = none, else the variant).
static SETTING_STATE: AtomicU8 = AtomicU8::new(0);

/// Records the plugin setting (`None`: not set).
pub fn set_setting(mode: Option<Fp2Mode>) {
    SETTING_STATE.store(mode.map_or(0, |m| m.variant() as u8), Ordering::SeqCst);
}

/// The plugin setting recorded by `configure`.
pub fn setting() -> Option<Fp2Mode> {
    Fp2Mode::from_variant(SETTING_STATE.load(Ordering::SeqCst) as Variant)
}

fn how_to_choose() -> String {
    format!(
        "choose with the plugin setting `{SETTING} = \"affine\"` or `{SETTING} = \"two-scale\"` \
         under this plugin's [plugin.settings] in plugins.toml, or with the GGUF string \
         metadata key `{METADATA_KEY}` (\"affine\" or \"two-scale\") in the file \
         (files written by lucebox built with ROCMFP2_AFFINE, such as the DeepSeek-V4-Flash \
         \"Strix-Lean\" releases, are affine)"
    )
}

/// The meaning the file's metadata declares, if any.
pub fn mode_from_metadata(metadata_json: &str) -> Result<Option<Fp2Mode>, String> {
    let meta: serde_json::Map<String, serde_json::Value> = serde_json::from_str(metadata_json)
        .map_err(|e| format!("the file's metadata is not a JSON object: {e}"))?;
    match meta.get(METADATA_KEY) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Fp2Mode::parse(s).map(Some).ok_or_else(|| {
            format!(
                "metadata key `{METADATA_KEY}` is \"{s}\": expected \"affine\" or \"two-scale\""
            )
        }),
        Some(v) => Err(format!(
            "metadata key `{METADATA_KEY}` is {v}, not a string: expected \"affine\" or \
             \"two-scale\""
        )),
    }
}

/// Picks the variant of type 107 from the plugin setting and the file's metadata.
pub fn resolve(setting: Option<Fp2Mode>, metadata_json: &str) -> Result<Variant, String> {
    let key = mode_from_metadata(metadata_json)?;
    match (setting, key) {
        (None, None) => Err(format!(
            "type 107 (Q2_0_ROCMFP2) has two incompatible meanings, two-scale \
             ((code - 1) * e[half]) and affine (code * e[0] - e[1]), and nothing says which \
             this file uses: {}",
            how_to_choose()
        )),
        (Some(s), Some(k)) if s != k => Err(format!(
            "type 107 (Q2_0_ROCMFP2): the plugin setting `{SETTING} = \"{}\"` contradicts the \
             file's metadata `{METADATA_KEY}` = \"{}\": remove the setting or fix the file",
            s.as_str(),
            k.as_str()
        )),
        (Some(m), _) | (None, Some(m)) => Ok(m.variant()),
    }
}

// ------------------------------------------------------------- affine quantiser

/// The affine code of `x`: `clamp(floor((x + O) / S + 0.5), 0, 3)` (0 when `S` is 0).
#[inline(always)]
pub fn affine_code(x: f32, s: f32, o: f32) -> u8 {
    if s.is_nan() || s <= 0.0 {
        return 0;
    }
    ((x + o) / s + 0.5).floor().clamp(0.0, 3.0) as u8
}

/// The codes of a block for scale byte `s` and offset byte `o`.
pub fn affine_codes(x: &[f32; QK], s: u8, o: u8) -> [u8; QK] {
    let (s, o) = (ue4m3::decode(s), ue4m3::decode(o));
    x.map(|v| affine_code(v, s, o))
}

/// Weighted squared error of the block at (S, O) bytes, stopping once above `stop`.
/// Elements whose weight is not positive do not count. Summed in f64 so that huge
/// finite inputs (beyond what the format can reach) still rank candidates instead of
/// all scoring infinity.
pub fn affine_error(x: &[f32; QK], w: &[f32; QK], s: u8, o: u8, stop: f64) -> f64 {
    let (s, o) = (ue4m3::decode(s), ue4m3::decode(o));
    let mut err = 0f64;
    for (v, w) in x.iter().zip(w) {
        if w.is_nan() || *w <= 0.0 {
            continue;
        }
        let d = (*v as f64) - (affine_code(*v, s, o) as f32 * s - o) as f64;
        err += *w as f64 * d * d;
        if err > stop {
            break;
        }
    }
    err
}

/// Reference choice of the affine (S, O) bytes for one block of finite values `x` with
/// importance weights `w` (all 1 without an importance matrix).
///
/// The range comes from the elements with positive weight (all of them when none has);
/// an all-zero range gives (0, 0). Start: `O0 = max(0, -min)`,
/// `S0 = max((max + O0) / 3, UE4M3(0x01))`, each snapped to the nearest UE4M3 byte;
/// then a coordinate search: every S byte 0x01..=0x7E with O fixed, every O byte
/// 0x00..=0x7E with S fixed, every S byte again, each keeping the smallest weighted
/// squared error (ties: the smaller byte).
pub fn choose_affine(x: &[f32; QK], w: &[f32; QK]) -> (u8, u8) {
    let range = |only_weighted: bool| {
        x.iter()
            .zip(w)
            .filter(|(_, w)| !only_weighted || **w > 0.0)
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), (v, _)| {
                (lo.min(*v), hi.max(*v))
            })
    };
    let (mut lo, mut hi) = range(true);
    if lo > hi {
        (lo, hi) = range(false);
    }
    if lo == 0.0 && hi == 0.0 {
        return (0, 0);
    }
    let o0 = (-lo).max(0.0);
    let s0 = ((hi + o0) / 3.0).max(ue4m3::decode(1));
    let (mut bs, mut bo) = (ue4m3::nearest(s0), ue4m3::nearest(o0));
    let mut best = affine_error(x, w, bs, bo, f64::INFINITY);
    let better = |err: f64, e: u8, best: f64, best_e: u8| err < best || (err == best && e < best_e);
    for pass in 0..3 {
        if pass == 1 {
            for e in 0..=ue4m3::MAX_BYTE {
                let err = affine_error(x, w, bs, e, best);
                if better(err, e, best, bo) {
                    (best, bo) = (err, e);
                }
            }
        } else {
            for e in 1..=ue4m3::MAX_BYTE {
                let err = affine_error(x, w, e, bo, best);
                if better(err, e, best, bs) {
                    (best, bs) = (err, e);
                }
            }
        }
    }
    (bs, bo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_variants() {
        assert_eq!(Fp2Mode::parse("affine"), Some(Fp2Mode::Affine));
        assert_eq!(Fp2Mode::parse("two-scale"), Some(Fp2Mode::TwoScale));
        assert_eq!(Fp2Mode::parse("Affine"), None);
        assert_eq!(Fp2Mode::parse("two_scale"), None);
        assert_eq!(Fp2Mode::TwoScale.variant(), 1);
        assert_eq!(Fp2Mode::Affine.variant(), 2);
        assert_eq!(Fp2Mode::from_variant(0), None);
        assert_eq!(Fp2Mode::from_variant(3), None);
    }

    #[test]
    fn affine_code_rounds_half_up_and_clamps() {
        assert_eq!(affine_code(-10.0, 1.0, 1.0), 0);
        assert_eq!(affine_code(-0.5, 1.0, 1.0), 1); // (x+O)/S = 0.5 -> floor(1.0) = 1
        assert_eq!(affine_code(-0.51, 1.0, 1.0), 0);
        assert_eq!(affine_code(1.0, 1.0, 1.0), 2);
        assert_eq!(affine_code(100.0, 1.0, 1.0), 3);
        assert_eq!(affine_code(5.0, 0.0, 1.0), 0);
    }

    #[test]
    fn zero_block_gives_zero_bytes() {
        assert_eq!(choose_affine(&[0.0; QK], &[1.0; QK]), (0, 0));
    }

    #[test]
    fn exactly_representable_block_is_found() {
        // Levels {-O, S-O, 2S-O, 3S-O} with S = 0.5, O = 0.75: all exact in UE4M3.
        let (s, o) = (0.5f32, 0.75f32);
        let x: [f32; QK] = std::array::from_fn(|i| (i % 4) as f32 * s - o);
        let (bs, bo) = choose_affine(&x, &[1.0; QK]);
        assert_eq!(affine_error(&x, &[1.0; QK], bs, bo, f64::INFINITY), 0.0);
        assert_eq!((ue4m3::decode(bs), ue4m3::decode(bo)), (s, o));
    }

    #[test]
    fn weights_steer_the_choice() {
        // One outlier: with weight 0 it is ignored (range and error), so the remaining
        // values are matched exactly.
        let mut x: [f32; QK] = std::array::from_fn(|i| (i % 4) as f32 * 0.25 - 0.25);
        x[7] = 40.0;
        let mut w = [1f32; QK];
        w[7] = 0.0;
        let (bs, bo) = choose_affine(&x, &w);
        assert_eq!(affine_error(&x, &w, bs, bo, f64::INFINITY), 0.0);
        let (us, uo) = choose_affine(&x, &[1.0; QK]);
        assert!(
            ue4m3::decode(us) > ue4m3::decode(bs),
            "{us} {uo} vs {bs} {bo}"
        );
    }
}
