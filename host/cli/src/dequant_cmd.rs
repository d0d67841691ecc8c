//! `moeserve dequant`: one tensor of a GGUF file decoded to float32 through the quant
//! plugin that claims its type, written as `.npy` or summarised. Also the pieces that
//! `moeserve quantize` shares: opening a file with the plugins' block sizes, finding a
//! tensor's format and variant, decoding through a plugin.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use moe_engine::npy;
use moe_gguf::{ggml_type_name, ggml_type_size, GgufFile, TensorInfo};
use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut, RStr},
    into_result, QuantFormat, Variant,
};
use moe_plugin_host::Registry;

/// The GGUF type id whose meaning a file has to state (ROCmFP2: two-scale or affine).
pub(crate) const FP2_TYPE: u32 = 107;
/// The string metadata key the rocmfpx plugin reads for type 107's meaning.
pub(crate) const FP2_KEY: &str = "rocmfpx.fp2_mode";
/// The values of [`FP2_KEY`] (and of `--fp2`).
pub(crate) const FP2_MODES: [&str; 2] = ["affine", "two-scale"];

/// Checks a `--fp2` value.
pub(crate) fn parse_fp2(s: &str) -> Result<&'static str> {
    FP2_MODES
        .into_iter()
        .find(|m| *m == s)
        .with_context(|| format!("--fp2 is '{s}': expected 'affine' or 'two-scale'"))
}

/// Opens a GGUF file; block sizes come from the loaded plugins, then from ggml's table,
/// so that a tensor no plugin claims can still be copied or named in an error.
pub(crate) fn open_gguf(reg: &Registry, path: &Path) -> Result<GgufFile> {
    let sizes = |id: u32| reg.type_size(id).or_else(|| ggml_type_size(id));
    Ok(GgufFile::open(path, &sizes)?)
}

/// "Q8_0 (8)", "i32 (26)" or "type 200".
pub(crate) fn type_label(reg: &Registry, id: u32) -> String {
    match reg.quant_format(id) {
        Some(f) => format!("{} ({id})", f.name),
        None => match ggml_type_name(id) {
            Some(n) => format!("{n} ({id})"),
            None => format!("type {id}"),
        },
    }
}

/// The plugin format of a tensor's type, or an error naming the type.
pub(crate) fn tensor_format<'r>(reg: &'r Registry, t: &TensorInfo) -> Result<&'r QuantFormat> {
    reg.quant_format(t.type_id).with_context(|| {
        format!(
            "tensor '{}' has type {}, which no loaded quant plugin claims (`moeserve plugins` \
             lists the formats; add a plugin that claims it to the config)",
            t.name,
            type_label(reg, t.type_id)
        )
    })
}

/// The variant of `f` for a file whose scalar metadata is `metadata_json`.
pub(crate) fn resolve_variant(f: &QuantFormat, metadata_json: &str) -> Result<Variant, String> {
    into_result((f.resolve_variant)(RStr::from_str(metadata_json)))
}

/// Decodes whole blocks of `f` into `out` (`out.len()` weights).
pub(crate) fn decode(
    f: &QuantFormat,
    variant: Variant,
    blocks: &[u8],
    out: &mut [f32],
) -> Result<(), String> {
    into_result((f.decode)(
        variant,
        RSlice::from_slice(blocks),
        RSliceMut::from_mut_slice(out),
    ))
}

/// NumPy shape of ggml dims (`dims[0]` is innermost, so numpy's order is the reverse).
pub(crate) fn numpy_shape(dims: &[u64]) -> Vec<usize> {
    dims.iter().rev().map(|&d| d as usize).collect()
}

/// `metadata_json` (a JSON object) with [`FP2_KEY`] set to `mode`.
pub(crate) fn with_fp2_key(metadata_json: &str, mode: &str) -> Result<String> {
    let mut map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(metadata_json).context("the file's metadata as JSON")?;
    map.insert(FP2_KEY.into(), serde_json::Value::String(mode.into()));
    Ok(serde_json::Value::Object(map).to_string())
}

/// The value of [`FP2_KEY`] in `file`, if it is a string.
pub(crate) fn file_fp2(file: &GgufFile) -> Option<&str> {
    file.get(FP2_KEY).and_then(|v| v.as_str())
}

/// "unknown tensor" with the closest names the file has.
pub(crate) fn unknown_tensor(file: &GgufFile, name: &str) -> anyhow::Error {
    let names: Vec<&str> = file.tensors().iter().map(|t| t.name.as_str()).collect();
    let close = close_names(&names, name, 3);
    let hint = if close.is_empty() {
        let first: Vec<String> = names.iter().take(5).map(|n| format!("'{n}'")).collect();
        if first.is_empty() {
            "it has no tensors".to_string()
        } else {
            format!(
                "it has {} tensors: {}{}",
                names.len(),
                first.join(", "),
                if names.len() > first.len() {
                    ", ..."
                } else {
                    ""
                }
            )
        }
    } else {
        let close: Vec<String> = close.iter().map(|n| format!("'{n}'")).collect();
        format!("did you mean {}?", close.join(" or "))
    };
    anyhow::anyhow!(
        "{}: no tensor named '{name}'; {hint}",
        file.path().display()
    )
}

/// Up to `n` names near `wanted`: by edit distance (at most a third of the length, at
/// least 2), or containing it / contained in it; closest first.
fn close_names<'a>(names: &[&'a str], wanted: &str, n: usize) -> Vec<&'a str> {
    let limit = (wanted.chars().count() / 3).max(2);
    let mut scored: Vec<(usize, &str)> = names
        .iter()
        .filter_map(|&name| {
            let d = edit_distance(name, wanted);
            let contains = !wanted.is_empty() && (name.contains(wanted) || wanted.contains(name));
            (d <= limit || contains).then_some((d, name))
        })
        .collect();
    scored.sort();
    scored.into_iter().take(n).map(|(_, s)| s).collect()
}

/// Levenshtein distance over chars.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

pub struct DequantArgs {
    pub model: PathBuf,
    pub tensor: String,
    pub out: Option<PathBuf>,
    pub fp2: Option<String>,
}

pub fn run(config: &Path, a: &DequantArgs) -> Result<()> {
    if let Some(out) = &a.out {
        crate::out_path::check_out(out, &[&a.model])?;
    }
    let fp2 = a.fp2.as_deref().map(parse_fp2).transpose()?;
    let reg = Registry::from_config_file(config)?;
    let file = open_gguf(&reg, &a.model)?;
    let t = file
        .tensor(&a.tensor)
        .ok_or_else(|| unknown_tensor(&file, &a.tensor))?;
    let f = tensor_format(&reg, t)?;
    let meta = match fp2 {
        None => file.scalar_metadata_json(),
        Some(mode) => {
            if let Some(old) = file_fp2(&file).filter(|old| *old != mode) {
                bail!(
                    "--fp2 {mode} contradicts the file's metadata {FP2_KEY} = \"{old}\"; \
                     leave --fp2 out to use the file's"
                );
            }
            with_fp2_key(&file.scalar_metadata_json(), mode)?
        }
    };
    let variant = resolve_variant(f, &meta).map_err(|e| {
        let hint = if t.type_id == FP2_TYPE {
            " (for this command alone: --fp2 affine or --fp2 two-scale)"
        } else {
            ""
        };
        anyhow::anyhow!("tensor '{}': {e}{hint}", t.name)
    })?;
    let numel = usize::try_from(t.numel()).context("tensor too large for this machine")?;
    let mut values = vec![0f32; numel];
    decode(f, variant, file.tensor_data(t), &mut values)
        .map_err(|e| anyhow::anyhow!("tensor '{}': decoding failed: {e}", t.name))?;
    let shape = numpy_shape(&t.dims);
    match &a.out {
        Some(out) => {
            write_npy(out, &shape, &values)?;
            eprintln!(
                "wrote '{}' ({}, shape {shape:?}) as float32 to {}",
                t.name,
                f.name,
                out.display()
            );
        }
        None => print_summary(t, f, variant, &shape, &values),
    }
    Ok(())
}

/// Writes the file whole or not at all (`write_atomic`).
fn write_npy(out: &Path, shape: &[usize], values: &[f32]) -> Result<()> {
    moe_gguf::write_atomic(out, |mut w| npy::write_f32(&mut w, shape, values))
        .with_context(|| format!("writing {}", out.display()))
}

fn print_summary(t: &TensorInfo, f: &QuantFormat, variant: Variant, shape: &[usize], v: &[f32]) {
    println!("tensor    {}", t.name);
    let var = if variant == 0 {
        String::new()
    } else {
        format!(", variant {variant}")
    };
    println!("type      {} (id {}{var})", f.name, t.type_id);
    println!("shape     {shape:?} (numpy order; ggml dims {:?})", t.dims);
    println!("elements  {}", v.len());
    let finite: Vec<f64> = v
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| f64::from(x))
        .collect();
    if finite.len() != v.len() {
        println!("non-finite {}", v.len() - finite.len());
    }
    if !finite.is_empty() {
        let n = finite.len() as f64;
        let min = finite.iter().copied().fold(f64::INFINITY, f64::min);
        let max = finite.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mean = finite.iter().sum::<f64>() / n;
        let var = finite.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
        println!(
            "min {min:.6e}  max {max:.6e}  mean {mean:.6e}  std {:.6e}",
            var.sqrt()
        );
    }
    let first: Vec<String> = v.iter().take(8).map(|x| format!("{x:.6e}")).collect();
    println!(
        "first     [{}{}]",
        first.join(", "),
        if v.len() > 8 { ", ..." } else { "" }
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_basics() {
        assert_eq!(edit_distance("", ""), 0);
        assert_eq!(edit_distance("abc", ""), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("w.gauss", "w.gaus"), 1);
    }

    #[test]
    fn close_names_prefers_nearest() {
        let names = [
            "blk.0.attn_q.weight",
            "blk.0.attn_k.weight",
            "output.weight",
        ];
        assert_eq!(
            close_names(&names, "blk.0.attn_q.wieght", 3),
            vec!["blk.0.attn_q.weight", "blk.0.attn_k.weight"]
        );
        assert_eq!(close_names(&names, "output", 3), vec!["output.weight"]);
        assert!(close_names(&names, "zzz", 3).is_empty());
    }

    #[test]
    fn numpy_shape_reverses() {
        assert_eq!(numpy_shape(&[64, 8]), vec![8, 64]);
        assert_eq!(numpy_shape(&[5]), vec![5]);
    }
}
