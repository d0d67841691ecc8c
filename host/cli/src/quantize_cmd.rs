//! `moeserve quantize`: rewrites the tensors whose names match a regex into another
//! quant type (decode through the source type's plugin, encode and validate through the
//! target's), copying every other tensor and all metadata as they are.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};
use moe_gguf::{GgufFile, GgufWriter, TensorInfo, Value};
use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut},
    into_result, QuantFormat, Variant,
};
use moe_plugin_host::Registry;
use rayon::prelude::*;
use regex::Regex;

use crate::dequant_cmd::{
    decode, file_fp2, open_gguf, parse_fp2, resolve_variant, type_label, with_fp2_key, FP2_KEY,
    FP2_MODES, FP2_TYPE,
};

pub struct QuantizeArgs {
    pub model: PathBuf,
    pub out: PathBuf,
    pub tensors: String,
    pub type_name: String,
    pub fp2: Option<String>,
}

/// What happens to one tensor.
enum Plan<'r> {
    /// Not matched by the regex: copied as it is.
    Copy,
    /// Matched but kept as it is, for this reason.
    Skip(String),
    Convert {
        src: &'r QuantFormat,
        variant: Variant,
    },
}

/// Weights decoded and re-encoded per work item (a whole number of rows, at least one).
const CHUNK_WEIGHTS: usize = 1 << 20;

pub fn run(config: &Path, a: &QuantizeArgs) -> Result<()> {
    crate::out_path::check_out(&a.out, &[&a.model])?;
    let re = Regex::new(&a.tensors).map_err(|e| {
        // The regex crate's syntax errors draw a caret diagram over several lines; keep
        // the line that says what is wrong.
        let text = e.to_string();
        let why = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        let why = why.trim().trim_start_matches("error: ");
        anyhow!("--tensors '{}' is not a valid regex: {why}", a.tensors)
    })?;
    let flag_mode = a.fp2.as_deref().map(parse_fp2).transpose()?;
    let reg = Registry::from_config_file(config)?;
    let (target, type_mode) = parse_type(&reg, &a.type_name)?;
    let mode = match (type_mode, flag_mode) {
        (Some(t), Some(f)) if t != f => bail!("--type {} and --fp2 {f} disagree", a.type_name),
        (t, f) => t.or(f),
    };
    if mode.is_some() && target.type_id != FP2_TYPE {
        bail!(
            "--fp2 (or a -affine / -two-scale suffix) picks the meaning of type {FP2_TYPE}; \
             --type {} is {}",
            a.type_name,
            type_label(&reg, target.type_id)
        );
    }

    let file = open_gguf(&reg, &a.model)?;
    let in_meta = file.scalar_metadata_json();
    let out_meta = match mode {
        Some(m) => with_fp2_key(&in_meta, m)?,
        None => in_meta.clone(),
    };
    let target_variant = resolve_variant(target, &out_meta).map_err(|e| {
        let hint = if mode.is_none() && target.type_id == FP2_TYPE {
            format!(
                "; or choose here with --type {FP2_TYPE}-affine or --type \
                 {FP2_TYPE}-two-scale (also records {FP2_KEY} in the output)"
            )
        } else {
            String::new()
        };
        anyhow!("--type {}: {e}{hint}", a.type_name)
    })?;

    // Plan every tensor before doing any work, so that errors come first.
    let mut plans = Vec::with_capacity(file.tensors().len());
    for t in file.tensors() {
        plans.push(if re.is_match(&t.name) {
            plan_one(&reg, t, target, target_variant, &in_meta)?
        } else {
            Plan::Copy
        });
    }
    if plans.iter().all(|p| matches!(p, Plan::Copy)) {
        let names: Vec<String> = file
            .tensors()
            .iter()
            .take(5)
            .map(|t| format!("'{}'", t.name))
            .collect();
        bail!(
            "--tensors '{}' matches none of the {} tensors of {} ({}{}); it is searched \
             anywhere in the name",
            a.tensors,
            file.tensors().len(),
            a.model.display(),
            names.join(", "),
            if file.tensors().len() > names.len() {
                ", ..."
            } else {
                ""
            }
        );
    }
    if out_meta != in_meta {
        check_kept_meanings(&reg, &file, &plans, &in_meta, &out_meta, mode)?;
    }
    if !plans.iter().any(|p| matches!(p, Plan::Convert { .. })) {
        for (t, p) in file.tensors().iter().zip(&plans) {
            if let Plan::Skip(why) = p {
                eprintln!("note: '{}': {why}", t.name);
            }
        }
        bail!(
            "none of the tensors --tensors '{}' matches can be converted to {} (see above); \
             nothing written",
            a.tensors,
            target.name
        );
    }
    let target_label = match mode {
        Some(m) => format!("{} ({m})", target.name),
        None => target.name.to_string(),
    };
    for (t, p) in file.tensors().iter().zip(&plans) {
        if let Plan::Skip(why) = p {
            eprintln!(
                "warning: skipping '{}': {why}; kept as {}",
                t.name,
                type_label(&reg, t.type_id)
            );
        }
    }

    let total: u64 = file.tensors().iter().map(|t| t.n_bytes).sum();
    let pb = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} \
             ({eta}) {msg}",
        )
        .map_err(|e| anyhow!("progress bar template: {e}"))?,
    );

    let mut w = GgufWriter::new(file.alignment());
    for (k, v) in file.metadata() {
        w.add_kv(k, v.clone());
    }
    if let Some(m) = mode {
        w.add_kv(FP2_KEY, Value::String(m.into()));
    }
    let mut s = Summary::default();
    for (t, p) in file.tensors().iter().zip(&plans) {
        let data = file.tensor_data(t);
        s.bytes_before += t.n_bytes;
        match p {
            Plan::Copy | Plan::Skip(_) => {
                w.add_tensor(&t.name, &t.dims, t.type_id, data.to_vec());
                s.bytes_after += t.n_bytes;
                pb.inc(t.n_bytes);
                match p {
                    Plan::Skip(why) => s.skipped.push((t.name.clone(), why.clone())),
                    _ => s.copied += 1,
                }
            }
            Plan::Convert { src, variant } => {
                pb.set_message(t.name.clone());
                let c = convert(t, data, (src, *variant), (target, target_variant), &pb)?;
                if c.non_finite > 0 {
                    pb.suspend(|| {
                        eprintln!(
                            "warning: '{}' has {} non-finite values; they were encoded as 0",
                            t.name, c.non_finite
                        )
                    });
                }
                s.converted_before += t.n_bytes;
                s.converted_after += c.bytes.len() as u64;
                s.bytes_after += c.bytes.len() as u64;
                s.nrmse.push((t.name.clone(), c.nrmse()));
                w.add_tensor(&t.name, &t.dims, target.type_id, c.bytes);
            }
        }
    }
    pb.set_message(format!("writing {}", a.out.display()));
    w.write_file(&a.out)
        .with_context(|| format!("writing {}", a.out.display()))?;
    pb.finish_and_clear();
    let file_size = std::fs::metadata(&a.out).map(|m| m.len()).unwrap_or(0);
    s.print(&a.model, &a.out, &target_label, file_size, mode);
    Ok(())
}

/// A `--type`: a format name as the plugins spell it (any case) or a type id, optionally
/// followed by `-affine` / `-two-scale` for type 107.
fn parse_type<'r>(reg: &'r Registry, s: &str) -> Result<(&'r QuantFormat, Option<&'static str>)> {
    let (base, mode) = FP2_MODES
        .into_iter()
        .find_map(|m| {
            s.strip_suffix(m)
                .and_then(|b| b.strip_suffix('-'))
                .map(|b| (b, Some(m)))
        })
        .unwrap_or((s, None));
    let found = match base.parse::<u32>() {
        Ok(id) => reg.quant_format(id),
        Err(_) => reg
            .quant_formats()
            .find(|f| f.name.as_str().eq_ignore_ascii_case(base)),
    };
    let Some(f) = found else {
        let known: Vec<String> = reg
            .quant_formats()
            .map(|f| format!("{} ({})", f.name, f.type_id))
            .collect();
        bail!(
            "--type '{s}' is not a type any loaded quant plugin claims; give a name or id of: \
             {} (type {FP2_TYPE} also as {FP2_TYPE}-affine or {FP2_TYPE}-two-scale)",
            known.join(", ")
        );
    };
    Ok((f, mode))
}

/// What to do with a tensor the regex matched.
fn plan_one<'r>(
    reg: &'r Registry,
    t: &TensorInfo,
    target: &QuantFormat,
    target_variant: Variant,
    in_meta: &str,
) -> Result<Plan<'r>> {
    let Some(src) = reg.quant_format(t.type_id) else {
        return Ok(Plan::Skip(format!(
            "no loaded quant plugin decodes its type {}",
            type_label(reg, t.type_id)
        )));
    };
    let row = t.dims[0];
    // A vector (a norm's weights, a bias) is read by element-wise ops, which take floats:
    // quantised, the model would no longer load.
    if t.numel() == row && target.type_id != moe_plugin_api::types::F32 {
        return Ok(Plan::Skip(format!(
            "it is a vector of {row} (a norm or a bias), which the models read as floats"
        )));
    }
    let bw = u64::from(target.block_weights);
    if bw == 0 || !row.is_multiple_of(bw) {
        return Ok(Plan::Skip(format!(
            "its rows of {row} weights are not a whole number of {bw}-weight {} blocks",
            target.name
        )));
    }
    let variant = resolve_variant(src, in_meta)
        .map_err(|e| anyhow!("tensor '{}' ({}): {e}", t.name, src.name))?;
    if src.type_id == target.type_id && variant == target_variant {
        return Ok(Plan::Skip(format!("it is {} already", target.name)));
    }
    Ok(Plan::Convert { src, variant })
}

/// Recording a new type-107 meaning must not change how a tensor that stays as it is
/// decodes (or give one to a tensor whose meaning the input leaves open).
fn check_kept_meanings(
    reg: &Registry,
    file: &GgufFile,
    plans: &[Plan],
    in_meta: &str,
    out_meta: &str,
    mode: Option<&str>,
) -> Result<()> {
    for (t, p) in file.tensors().iter().zip(plans) {
        if matches!(p, Plan::Convert { .. }) {
            continue;
        }
        let Some(f) = reg.quant_format(t.type_id) else {
            continue;
        };
        let before = resolve_variant(f, in_meta);
        let after = resolve_variant(f, out_meta);
        let same = match (&before, &after) {
            (Ok(a), Ok(b)) => a == b,
            (Err(_), Err(_)) => true,
            _ => false,
        };
        if !same {
            let was = match (before, file_fp2(file)) {
                (Ok(v), Some(m)) => format!("variant {v} ({FP2_KEY} = \"{m}\")"),
                (Ok(v), None) => format!("variant {v}"),
                (Err(_), _) => "no stated meaning".to_string(),
            };
            bail!(
                "tensor '{}' ({}) stays as it is, but recording {FP2_KEY} = \"{}\" in the \
                 output would change how it decodes (in the input it has {was}); include it \
                 in --tensors so it is converted too",
                t.name,
                f.name,
                mode.unwrap_or("?")
            );
        }
    }
    Ok(())
}

struct Converted {
    bytes: Vec<u8>,
    /// Sum of squared errors and of squared originals over the finite inputs.
    err2: f64,
    ref2: f64,
    non_finite: usize,
}

impl Converted {
    /// Error RMS over original RMS (0 for an all-zero tensor).
    fn nrmse(&self) -> f64 {
        if self.ref2 > 0.0 {
            (self.err2 / self.ref2).sqrt()
        } else {
            0.0
        }
    }
}

/// Decodes, encodes, validates and decodes again (for the error), a chunk of rows per
/// task.
fn convert(
    t: &TensorInfo,
    data: &[u8],
    (src, src_var): (&QuantFormat, Variant),
    (dst, dst_var): (&QuantFormat, Variant),
    pb: &ProgressBar,
) -> Result<Converted> {
    let k = t.dims[0];
    let numel = t.numel();
    let n_rows = if numel == 0 { 0 } else { numel / k };
    let src_row = src.row_bytes(k).map_err(|e| anyhow!("'{}': {e}", t.name))? as usize;
    let dst_row = dst.row_bytes(k).map_err(|e| anyhow!("'{}': {e}", t.name))? as usize;
    let (k, n_rows) = (k as usize, n_rows as usize);
    let per_chunk = (CHUNK_WEIGHTS / k.max(1)).max(1);
    let starts: Vec<usize> = (0..n_rows).step_by(per_chunk).collect();
    let fail = |what: &str, e: String| anyhow!("tensor '{}': {what}: {e}", t.name);
    let parts: Vec<Result<Converted>> = starts
        .par_iter()
        .map(|&r0| {
            let rows = per_chunk.min(n_rows - r0);
            let src_bytes = &data[r0 * src_row..(r0 + rows) * src_row];
            let mut x = vec![0f32; rows * k];
            decode(src, src_var, src_bytes, &mut x)
                .map_err(|e| fail(&format!("decoding {}", src.name), e))?;
            let mut q = vec![0u8; rows * dst_row];
            into_result((dst.encode)(
                dst_var,
                RSlice::from_slice(&x),
                RSliceMut::from_mut_slice(&mut q),
            ))
            .map_err(|e| fail(&format!("encoding {}", dst.name), e))?;
            into_result((dst.validate)(dst_var, RSlice::from_slice(&q))).map_err(|e| {
                fail(
                    &format!("the {} encoder wrote an invalid block", dst.name),
                    e,
                )
            })?;
            let mut y = vec![0f32; x.len()];
            decode(dst, dst_var, &q, &mut y)
                .map_err(|e| fail(&format!("decoding {} again", dst.name), e))?;
            let (mut err2, mut ref2, mut non_finite) = (0f64, 0f64, 0usize);
            for (a, b) in x.iter().zip(&y) {
                if a.is_finite() {
                    let (a, b) = (f64::from(*a), f64::from(*b));
                    err2 += (a - b) * (a - b);
                    ref2 += a * a;
                } else {
                    non_finite += 1;
                }
            }
            pb.inc(src_bytes.len() as u64);
            Ok(Converted {
                bytes: q,
                err2,
                ref2,
                non_finite,
            })
        })
        .collect();
    let mut all = Converted {
        bytes: Vec::with_capacity(n_rows * dst_row),
        err2: 0.0,
        ref2: 0.0,
        non_finite: 0,
    };
    for p in parts {
        let p = p?;
        all.bytes.extend_from_slice(&p.bytes);
        all.err2 += p.err2;
        all.ref2 += p.ref2;
        all.non_finite += p.non_finite;
    }
    Ok(all)
}

#[derive(Default)]
struct Summary {
    copied: usize,
    skipped: Vec<(String, String)>,
    /// (tensor, NRMSE) of each converted tensor.
    nrmse: Vec<(String, f64)>,
    bytes_before: u64,
    bytes_after: u64,
    converted_before: u64,
    converted_after: u64,
}

impl Summary {
    fn print(&self, input: &Path, out: &Path, target: &str, file_size: u64, mode: Option<&str>) {
        let plural = |n: usize| if n == 1 { "" } else { "s" };
        let n = self.nrmse.len();
        println!(
            "{} -> {}: {n} tensor{} converted to {target}, {} skipped (kept as they were), \
             {} not matched (copied)",
            input.display(),
            out.display(),
            plural(n),
            self.skipped.len(),
            self.copied
        );
        for (name, why) in &self.skipped {
            println!("  skipped '{name}': {why}");
        }
        println!(
            "tensor data {} -> {} (converted tensors {} -> {}); output file {}",
            HumanBytes(self.bytes_before),
            HumanBytes(self.bytes_after),
            HumanBytes(self.converted_before),
            HumanBytes(self.converted_after),
            HumanBytes(file_size)
        );
        if let Some((worst, e)) = self
            .nrmse
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .cloned()
        {
            let mean = self.nrmse.iter().map(|x| x.1).sum::<f64>() / n as f64;
            println!("NRMSE of the converted tensors: mean {mean:.4}, worst {e:.4} ('{worst}')");
        }
        if let Some(m) = mode {
            println!("recorded {FP2_KEY} = \"{m}\" in the metadata");
        }
    }
}
