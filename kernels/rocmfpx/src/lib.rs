//! `rocmfpx`: a quant-format plugin for the ROCmFPx GGUF weight types of the lucebox
//! project (a llama.cpp fork for AMD GPUs).
//!
//! | id | name | bytes / 32 w | variants |
//! |---|---|---|---|
//! | 100 | Q4_0_ROCMFP4 | 18 | 0 |
//! | 101 | Q4_0_ROCMFP4_FAST | 17 | 0 |
//! | 102 | Q6_0_ROCMFPX | 26 | 0 |
//! | 103 | Q8_0_ROCMFPX | 33 | 0 |
//! | 104 | Q3_0_ROCMFPX | 14 | 0 |
//! | 105 | Q3_1_ROCMFP3_MIX | 14 | none: needs per-expert codebooks (not supported) |
//! | 106 | Q2_1_ROCMFP2_MIX | 10 | none: needs per-expert codebooks (not supported) |
//! | 107 | Q2_0_ROCMFP2 | 10 | 1 = two-scale, 2 = affine (see [`fp2`]) |
//!
//! Every table function checks its slice lengths and variant and runs inside
//! [`moe_plugin_api::guard`], so neither a bad call nor a bug unwinds into the host.
//!
//! * `decode` follows the wire format bit for bit (layouts in [`formats`], scales in
//!   [`ue4m3`]);
//! * `validate` rejects scale bytes that are not finite UE4M3 values (0x7F and 0x80..),
//!   naming the block and the byte; every code bit pattern is valid;
//! * `encode` is a reference quantiser: non-finite inputs count as 0; round-to-nearest
//!   with a scale search (a window of bytes around `max|x| / top level`), and for affine
//!   ROCmFP2 the coordinate search of upstream's writer ([`fp2::choose_affine`]);
//! * `dot_q8` is integer dot products per block against q8_1 activations ([`dot`]).
//!
//! Settings (`[plugin.settings]`): `fp2 = "affine" | "two-scale"` fixes the meaning of
//! type 107 for every file; without it a file must carry the metadata key
//! `rocmfpx.fp2_mode` (same values). See [`fp2`].

pub mod dot;
pub mod formats;
pub mod fp2;
pub mod ue4m3;

use abi_stable::{
    export_root_module,
    prefix_type::PrefixTypeTrait,
    std_types::{RResult, RSlice, RSliceMut, RStr, RString, RVec},
};
use moe_plugin_api::{
    defaults, dot_shape, guard, AbiVersion, BlockQ8_1, Plugin, PluginInfo, PluginKind, PluginRef,
    QuantFormat, Variant,
};

pub use crate::dot::Isa;
use crate::dot::Shape;
use crate::formats::{Format, Fp2Affine, Fp2TwoScale, Fp3, Fp4, Fp4Fast, Fp6, Fp8, QK};
use crate::fp2::Fp2Mode;

pub const PLUGIN_NAME: &str = "rocmfpx";

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion::CURRENT,
        info,
        configure,
        quant_formats,
        backend: defaults::no_backend,
        policies: defaults::no_policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: PLUGIN_NAME.into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::QuantFormat,
        description: "ROCmFPx types 100-107: ROCmFP4 (+FAST), FP6, FP8, FP3, FP2 two-scale/affine \
                      (setting fp2 or key rocmfpx.fp2_mode); 105/106 adaptive not supported"
            .into(),
    }
}

/// Parses the plugin's settings: only `fp2` ("affine" or "two-scale"), optional.
pub fn parse_settings(settings_toml: &str) -> Result<Option<Fp2Mode>, String> {
    let table: toml::Table = settings_toml
        .parse()
        .map_err(|e| format!("{PLUGIN_NAME}: settings are not valid TOML: {e}"))?;
    let mut unknown: Vec<&str> = table
        .keys()
        .map(String::as_str)
        .filter(|k| *k != fp2::SETTING)
        .collect();
    if !unknown.is_empty() {
        unknown.sort_unstable();
        return Err(format!(
            "{PLUGIN_NAME}: unknown setting(s) {}: the only setting is `{}` (\"affine\" or \
             \"two-scale\")",
            unknown
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", "),
            fp2::SETTING
        ));
    }
    match table.get(fp2::SETTING) {
        None => Ok(None),
        Some(toml::Value::String(s)) => Fp2Mode::parse(s).map(Some).ok_or_else(|| {
            format!(
                "{PLUGIN_NAME}: setting `{}` is \"{s}\": expected \"affine\" or \"two-scale\"",
                fp2::SETTING
            )
        }),
        Some(v) => Err(format!(
            "{PLUGIN_NAME}: setting `{}` is {v}, not a string: expected \"affine\" or \
             \"two-scale\"",
            fp2::SETTING
        )),
    }
}

extern "C" fn configure(settings_toml: RStr<'_>) -> RResult<(), RString> {
    guard(PLUGIN_NAME, || {
        fp2::set_setting(parse_settings(settings_toml.as_str())?);
        Ok(())
    })
}

extern "C" fn quant_formats() -> RVec<QuantFormat> {
    all_formats().into_iter().collect()
}

pub const Q3_1_MIX: u32 = 105;
pub const Q2_1_MIX: u32 = 106;

/// (id, name, block bytes) of every type id this plugin claims, by id.
pub const TYPES: [(u32, &str, u32); 8] = [
    (Fp4::ID, Fp4::NAME, Fp4::BB as u32),
    (Fp4Fast::ID, Fp4Fast::NAME, Fp4Fast::BB as u32),
    (Fp6::ID, Fp6::NAME, Fp6::BB as u32),
    (Fp8::ID, Fp8::NAME, Fp8::BB as u32),
    (Fp3::ID, Fp3::NAME, Fp3::BB as u32),
    (Q3_1_MIX, "Q3_1_ROCMFP3_MIX", 14),
    (Q2_1_MIX, "Q2_1_ROCMFP2_MIX", 10),
    (Fp2TwoScale::ID, Fp2TwoScale::NAME, Fp2TwoScale::BB as u32),
];

/// Every format this plugin provides, sorted by type id.
pub fn all_formats() -> Vec<QuantFormat> {
    vec![
        table::<100>(),
        table::<101>(),
        table::<102>(),
        table::<103>(),
        table::<104>(),
        table::<105>(),
        table::<106>(),
        table::<107>(),
    ]
}

fn table<const ID: u32>() -> QuantFormat {
    let (_, name, bb) = type_info(ID);
    QuantFormat {
        type_id: ID,
        name: name.into(),
        block_weights: QK as u32,
        block_bytes: bb,
        resolve_variant: resolve_variant::<ID>,
        validate: validate::<ID>,
        decode: decode::<ID>,
        encode: encode::<ID>,
        dot_q8: dot_q8::<ID>,
    }
}

fn type_info(id: u32) -> (u32, &'static str, u32) {
    TYPES
        .into_iter()
        .find(|t| t.0 == id)
        .unwrap_or((id, "unknown ROCmFPx type", 1))
}

fn type_name(id: u32) -> &'static str {
    type_info(id).1
}

/// Why the adaptive types cannot be decoded.
fn unsupported(id: u32) -> String {
    let (what, key, suffix) = if id == Q3_1_MIX {
        (
            "per-expert codebook",
            "deepseek4.p4mix.sidecar",
            ".p4mix.bin",
        )
    } else {
        (
            "per-expert codebooks",
            "deepseek4.gumix.sidecar",
            ".gumix.bin",
        )
    };
    format!(
        "type {id} ({}) needs its {what}: metadata key `{key}` (a byte array; \
         `deepseek4.dmix.sidecar` for dense attention tensors) or sidecar file \
         `<model>.gguf{suffix}` (`.dmix.bin`); not supported yet",
        type_name(id)
    )
}

/// The concrete block type behind a (type id, variant) pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fp4,
    Fp4Fast,
    Fp6,
    Fp8,
    Fp3,
    Fp2TwoScale,
    Fp2Affine,
}

/// Runs `$body` with `$F` the block type of `$kind`.
macro_rules! with_kind {
    ($kind:expr, $F:ident => $body:expr) => {
        match $kind {
            Kind::Fp4 => {
                type $F = Fp4;
                $body
            }
            Kind::Fp4Fast => {
                type $F = Fp4Fast;
                $body
            }
            Kind::Fp6 => {
                type $F = Fp6;
                $body
            }
            Kind::Fp8 => {
                type $F = Fp8;
                $body
            }
            Kind::Fp3 => {
                type $F = Fp3;
                $body
            }
            Kind::Fp2TwoScale => {
                type $F = Fp2TwoScale;
                $body
            }
            Kind::Fp2Affine => {
                type $F = Fp2Affine;
                $body
            }
        }
    };
}

fn pick(id: u32, variant: Variant, op: &str) -> Result<Kind, String> {
    let name = type_name(id);
    let single = |k: Kind| {
        if variant == 0 {
            Ok(k)
        } else {
            Err(format!(
                "{name} {op}: variant {variant} does not exist (this type has one meaning, \
                 variant 0)"
            ))
        }
    };
    match id {
        100 => single(Kind::Fp4),
        101 => single(Kind::Fp4Fast),
        102 => single(Kind::Fp6),
        103 => single(Kind::Fp8),
        104 => single(Kind::Fp3),
        107 => match Fp2Mode::from_variant(variant) {
            Some(Fp2Mode::TwoScale) => Ok(Kind::Fp2TwoScale),
            Some(Fp2Mode::Affine) => Ok(Kind::Fp2Affine),
            None => Err(format!(
                "{name} {op}: variant {variant} does not exist: type 107 is variant 1 \
                 (two-scale) or 2 (affine), as resolve_variant picks it"
            )),
        },
        Q3_1_MIX | Q2_1_MIX => Err(format!("{name} {op}: {}", unsupported(id))),
        _ => Err(format!("{PLUGIN_NAME}: no type with id {id}")),
    }
}

extern "C" fn resolve_variant<const ID: u32>(metadata_json: RStr<'_>) -> RResult<Variant, RString> {
    guard(type_name(ID), || match ID {
        107 => fp2::resolve(fp2::setting(), metadata_json.as_str()),
        Q3_1_MIX | Q2_1_MIX => Err(unsupported(ID)),
        _ => Ok(0),
    })
}

fn whole_blocks<F: Format>(bytes: usize, op: &str) -> Result<usize, String> {
    if !bytes.is_multiple_of(F::BB) {
        return Err(format!(
            "{} {op}: {bytes} bytes are not whole {}-byte blocks",
            F::NAME,
            F::BB
        ));
    }
    Ok(bytes / F::BB)
}

fn validate_blocks<F: Format>(blocks: &[u8]) -> Result<(), String> {
    whole_blocks::<F>(blocks.len(), "validate")?;
    for (i, b) in blocks.chunks_exact(F::BB).enumerate() {
        formats::check_block::<F>(b).map_err(|e| format!("{} block {i}: {e}", F::NAME))?;
    }
    Ok(())
}

fn decode_blocks<F: Format>(blocks: &[u8], out: &mut [f32]) -> Result<(), String> {
    let n = whole_blocks::<F>(blocks.len(), "decode")?;
    if out.len() != n * QK {
        return Err(format!(
            "{} decode: {n} blocks hold {} weights but the output holds {}",
            F::NAME,
            n * QK,
            out.len()
        ));
    }
    for (b, o) in blocks.chunks_exact(F::BB).zip(out.chunks_exact_mut(QK)) {
        formats::decode_block::<F>(b, o);
    }
    Ok(())
}

fn encode_values<F: Format>(input: &[f32], out: &mut [u8]) -> Result<(), String> {
    if !input.len().is_multiple_of(QK) {
        return Err(format!(
            "{} encode: {} values are not whole {QK}-weight blocks",
            F::NAME,
            input.len()
        ));
    }
    let n = input.len() / QK;
    if out.len() != n * F::BB {
        return Err(format!(
            "{} encode: {n} blocks need {} bytes but the output holds {}",
            F::NAME,
            n * F::BB,
            out.len()
        ));
    }
    for (x, o) in input.chunks_exact(QK).zip(out.chunks_exact_mut(F::BB)) {
        // Non-finite inputs are quantised as 0 (upstream's writers do the same).
        let x: [f32; QK] = std::array::from_fn(|i| if x[i].is_finite() { x[i] } else { 0.0 });
        o.fill(0);
        F::encode_block(&x, o);
    }
    Ok(())
}

fn dot_rows<F: Format>(
    isa: Isa,
    rows: &[u8],
    k: u64,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    let (row_bytes, n_rows, n_cols) =
        dot_shape(QK as u32, F::BB as u32, rows.len(), k, act.len(), out.len())
            .map_err(|e| format!("{} {e}", F::NAME))?;
    let shape = Shape {
        row_bytes,
        n_rows,
        n_cols,
        per_col: k as usize / QK,
    };
    dot::run::<F>(isa, rows, shape, act, out);
    Ok(())
}

extern "C" fn validate<const ID: u32>(
    variant: Variant,
    blocks: RSlice<'_, u8>,
) -> RResult<(), RString> {
    guard(
        type_name(ID),
        || with_kind!(pick(ID, variant, "validate")?, F => validate_blocks::<F>(blocks.as_slice())),
    )
}

extern "C" fn decode<const ID: u32>(
    variant: Variant,
    blocks: RSlice<'_, u8>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard(type_name(ID), || {
        with_kind!(pick(ID, variant, "decode")?, F =>
            decode_blocks::<F>(blocks.as_slice(), out.as_mut_slice()))
    })
}

extern "C" fn encode<const ID: u32>(
    variant: Variant,
    input: RSlice<'_, f32>,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard(type_name(ID), || {
        with_kind!(pick(ID, variant, "encode")?, F =>
            encode_values::<F>(input.as_slice(), out.as_mut_slice()))
    })
}

extern "C" fn dot_q8<const ID: u32>(
    variant: Variant,
    rows: RSlice<'_, u8>,
    k: u64,
    act: RSlice<'_, BlockQ8_1>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard(type_name(ID), || {
        dot_q8_with_isa(
            ID,
            variant,
            dot::best_isa(),
            rows.as_slice(),
            k,
            act.as_slice(),
            out.as_mut_slice(),
        )
    })
}

/// `dot_q8` of `type_id`/`variant` with the driver compiled for `isa` (clamped to what
/// this CPU has): lets tests and benchmarks cover every compiled variant. The plugin
/// table always uses the best one.
pub fn dot_q8_with_isa(
    type_id: u32,
    variant: Variant,
    isa: Isa,
    rows: &[u8],
    k: u64,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    with_kind!(pick(type_id, variant, "dot_q8")?, F => dot_rows::<F>(isa, rows, k, act, out))
}
