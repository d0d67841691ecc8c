//! `moeserve convert`: a DeepSeek-V4 checkpoint directory -> deepseek4 GGUF. Matrices are
//! encoded by the quant plugins' reference encoders (the same code `quantize` uses).

use std::path::Path;

use anyhow::{anyhow, Result};
use indicatif::{ProgressBar, ProgressStyle};
use moe_convert::{convert, OutType};
use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut},
    into_result,
};
use moe_plugin_host::Registry;

pub fn run(
    config: &Path,
    dir: &Path,
    out: &Path,
    ty: &str,
    pre: Option<&str>,
    mtp: bool,
) -> Result<()> {
    // The checkpoint's own files (weights, config, tokenizer) are inputs; a GGUF there
    // may be replaced.
    let inputs: Vec<std::path::PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    let inputs: Vec<&Path> = inputs
        .iter()
        .filter(|p| p.extension().is_none_or(|e| e != "gguf"))
        .map(|p| p.as_path())
        .collect();
    crate::out_path::check_out(out, &inputs)?;
    let ty = OutType::parse(ty)?;
    let reg = Registry::from_config_file(config)?;
    let encode = |type_id: u32, v: &[f32], k: usize| -> Result<Vec<u8>> {
        let f = reg.quant_format(type_id).ok_or_else(|| {
            anyhow!("no loaded plugin encodes type {type_id} (load the ggml-quants plugin)")
        })?;
        let rows = v.len() / k.max(1);
        let mut q = vec![
            0u8;
            f.row_bytes(k as u64)
                .map_err(|e| anyhow!("{}: {e}", f.name))? as usize
                * rows
        ];
        into_result((f.encode)(
            0,
            RSlice::from_slice(v),
            RSliceMut::from_mut_slice(&mut q),
        ))
        .map_err(|e| anyhow!("{}: {e}", f.name))?;
        into_result((f.validate)(0, RSlice::from_slice(&q)))
            .map_err(|e| anyhow!("the {} encoder wrote an invalid block: {e}", f.name))?;
        Ok(q)
    };
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} tensors {msg}")
            .expect("static progress template"),
    );
    let progress = |done: usize, total: usize, name: &str| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
        pb.set_message(name.to_string());
    };
    let s = convert(dir, out, ty, pre, mtp, &encode, &progress)?;
    pb.finish_and_clear();
    // Notes repeat per tensor (e.g. the q8_0 -> f16 fallback); show a few.
    for n in s.notes.iter().take(6) {
        eprintln!("note: {n}");
    }
    if s.notes.len() > 6 {
        eprintln!("note: ... and {} more like these", s.notes.len() - 6);
    }
    if !s.skipped.is_empty() {
        eprintln!(
            "skipped {} tensors not used by the model (MTP layers, hash-layer biases)",
            s.skipped.len()
        );
    }
    eprintln!(
        "wrote {} ({} tensors, {:.2} MiB)",
        out.display(),
        s.tensors,
        s.bytes as f64 / (1 << 20) as f64
    );
    Ok(())
}
