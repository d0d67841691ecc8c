//! `ggml-quants`: a quant-format plugin providing ggml's tensor types to the host.
//!
//! Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and
//! MXFP4, each a [`QuantFormat`] table of `extern "C"` functions. Every function checks
//! its slice lengths and runs inside [`moe_plugin_api::guard`], so neither a bad call nor a
//! bug unwinds into the host.
//!
//! * `decode` is bit-identical to the PyPI `gguf` package's numpy dequantisers (same f32
//!   operations in the same order; tested against it on random blocks and a real model);
//! * `validate` rejects blocks whose f16 scales are NaN/infinite and MXFP4 blocks whose
//!   scale is the e8m0 NaN byte 0xFF; float tensors are accepted as they are;
//! * `encode` is a simple reference quantiser (round-to-nearest, one scale search pass);
//! * `dot_q8` is the CPU decode hot path: integer dot products per 32-weight block
//!   against q8_1 activations, single-threaded (the caller splits rows across threads).

pub mod dot;
pub mod formats;
pub mod fp;

use abi_stable::{
    export_root_module,
    prefix_type::PrefixTypeTrait,
    std_types::{RResult, RSlice, RSliceMut, RStr, RString, RVec},
};
use moe_plugin_api::{
    defaults, dot_shape, guard, single_variant, AbiVersion, BlockQ8_1, Plugin, PluginInfo,
    PluginKind, PluginRef, QuantFormat, Variant,
};

pub use crate::dot::Isa;
use crate::dot::Shape;
use crate::formats::{
    float::{BF16, F16, F32},
    kquants::{Q2K, Q3K, Q4K, Q5K, Q6K},
    legacy::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0},
    mxfp4::Mxfp4,
    Format,
};

pub const PLUGIN_NAME: &str = "ggml-quants";

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
        description: format!(
            "ggml tensor types: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K \
             MXFP4 (decode bit-exact with gguf-py; q8_1 integer dots, {:?} kernels)",
            dot::best_isa()
        )
        .into(),
    }
}

/// Checks the plugin's settings: it has none, so anything but an empty table is an error.
pub fn check_settings(settings_toml: &str) -> Result<(), String> {
    let table: toml::Table = settings_toml
        .parse()
        .map_err(|e| format!("{PLUGIN_NAME}: settings are not valid TOML: {e}"))?;
    if !table.is_empty() {
        let mut keys: Vec<&str> = table.keys().map(String::as_str).collect();
        keys.sort_unstable();
        return Err(format!(
            "{PLUGIN_NAME}: unknown setting(s) {}: this plugin takes no settings",
            keys.iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    Ok(())
}

extern "C" fn configure(settings_toml: RStr<'_>) -> RResult<(), RString> {
    guard(PLUGIN_NAME, || check_settings(settings_toml.as_str()))
}

extern "C" fn quant_formats() -> RVec<QuantFormat> {
    all_formats().into_iter().collect()
}

/// Every format this plugin provides, sorted by type id.
pub fn all_formats() -> Vec<QuantFormat> {
    let mut v = vec![
        table::<F32>(),
        table::<F16>(),
        table::<Q4_0>(),
        table::<Q4_1>(),
        table::<Q5_0>(),
        table::<Q5_1>(),
        table::<Q8_0>(),
        table::<Q2K>(),
        table::<Q3K>(),
        table::<Q4K>(),
        table::<Q5K>(),
        table::<Q6K>(),
        table::<BF16>(),
        table::<Mxfp4>(),
    ];
    v.sort_by_key(|f| f.type_id);
    v
}

fn table<F: Format>() -> QuantFormat {
    QuantFormat {
        type_id: F::ID,
        name: F::NAME.into(),
        block_weights: F::BW as u32,
        block_bytes: F::BB as u32,
        resolve_variant: single_variant,
        validate: validate::<F>,
        decode: decode::<F>,
        encode: encode::<F>,
        dot_q8: dot_q8::<F>,
    }
}

fn check_variant<F: Format>(variant: Variant, op: &str) -> Result<(), String> {
    if variant != 0 {
        return Err(format!(
            "{} {op}: variant {variant} does not exist (this type has one meaning, variant 0)",
            F::NAME
        ));
    }
    Ok(())
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

extern "C" fn validate<F: Format>(
    variant: Variant,
    blocks: RSlice<'_, u8>,
) -> RResult<(), RString> {
    guard(F::NAME, || {
        check_variant::<F>(variant, "validate")?;
        whole_blocks::<F>(blocks.len(), "validate")?;
        F::validate(blocks.as_slice())
    })
}

extern "C" fn decode<F: Format>(
    variant: Variant,
    blocks: RSlice<'_, u8>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard(F::NAME, || {
        check_variant::<F>(variant, "decode")?;
        let n = whole_blocks::<F>(blocks.len(), "decode")?;
        if out.len() != n * F::BW {
            return Err(format!(
                "{} decode: {n} blocks hold {} weights but the output holds {}",
                F::NAME,
                n * F::BW,
                out.len()
            ));
        }
        F::decode(blocks.as_slice(), out.as_mut_slice());
        Ok(())
    })
}

extern "C" fn encode<F: Format>(
    variant: Variant,
    input: RSlice<'_, f32>,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard(F::NAME, || {
        check_variant::<F>(variant, "encode")?;
        if !input.len().is_multiple_of(F::BW) {
            return Err(format!(
                "{} encode: {} values are not whole {}-weight blocks",
                F::NAME,
                input.len(),
                F::BW
            ));
        }
        let n = input.len() / F::BW;
        if out.len() != n * F::BB {
            return Err(format!(
                "{} encode: {n} blocks need {} bytes but the output holds {}",
                F::NAME,
                n * F::BB,
                out.len()
            ));
        }
        F::encode(input.as_slice(), out.as_mut_slice())
    })
}

extern "C" fn dot_q8<F: Format>(
    variant: Variant,
    rows: RSlice<'_, u8>,
    k: u64,
    act: RSlice<'_, BlockQ8_1>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard(F::NAME, || {
        check_variant::<F>(variant, "dot_q8")?;
        dot_checked::<F>(
            dot::best_isa(),
            rows.as_slice(),
            k,
            act.as_slice(),
            out.as_mut_slice(),
        )
    })
}

fn dot_checked<F: Format>(
    isa: Isa,
    rows: &[u8],
    k: u64,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    let (row_bytes, n_rows, n_cols) = dot_shape(
        F::BW as u32,
        F::BB as u32,
        rows.len(),
        k,
        act.len(),
        out.len(),
    )
    .map_err(|e| format!("{} {e}", F::NAME))?;
    let shape = Shape {
        row_bytes,
        n_rows,
        n_cols,
        per_col: k as usize / 32,
    };
    F::dot(isa, rows, shape, act, out);
    Ok(())
}

/// `dot_q8` of type `type_id` with the kernels compiled for `isa` (clamped to what this
/// CPU supports, see [`dot::best_isa`]): lets tests and benchmarks cover every variant.
/// The plugin table always uses the best one.
pub fn dot_q8_with_isa(
    type_id: u32,
    isa: Isa,
    rows: &[u8],
    k: u64,
    act: &[BlockQ8_1],
    out: &mut [f32],
) -> Result<(), String> {
    macro_rules! by_id {
        ($($t:ty),*) => {
            $(if type_id == <$t as Format>::ID {
                return dot_checked::<$t>(isa, rows, k, act, out);
            })*
        };
    }
    by_id!(F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2K, Q3K, Q4K, Q5K, Q6K, Mxfp4);
    Err(format!("{PLUGIN_NAME}: no type with id {type_id}"))
}
