//! `moeserve synth`: a DeepSeek-V4-Flash-shaped GGUF with random valid weights of the
//! real type mix (see moe_convert::synth), optionally with fewer layers / experts / tokens.

use std::path::Path;

use anyhow::{Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use moe_convert::synth::{flash_config, synth, SynthBytes, TypeMix};
use moe_gguf::GgufWriter;

pub fn run(
    out: &Path,
    layers: usize,
    experts: usize,
    vocab: usize,
    seed: u64,
    mix: &str,
) -> Result<()> {
    let (w, b) = generate(layers, experts, vocab, seed, mix)?;
    w.write_file(out)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "wrote {} ({})",
        out.display(),
        summary(&b, layers, experts, vocab)
    );
    Ok(())
}

fn summary(b: &SynthBytes, layers: usize, experts: usize, vocab: usize) -> String {
    format!(
        "{layers} layers, {experts} experts, vocab {vocab}: {:.2} GiB of weights; one decoded \
         token reads {:.1} MiB of them",
        b.total as f64 / (1u64 << 30) as f64,
        b.per_token as f64 / (1u64 << 20) as f64
    )
}

/// The same model as a GGUF image in memory, for runs that need no file
/// (`moeserve bench --synth`).
pub fn in_memory(
    layers: usize,
    experts: usize,
    vocab: usize,
    seed: u64,
    mix: &str,
) -> Result<Vec<u8>> {
    let (w, b) = generate(layers, experts, vocab, seed, mix)?;
    let image = w
        .into_bytes()
        .context("building the synthetic GGUF image")?;
    eprintln!(
        "synth: built in memory ({})",
        summary(&b, layers, experts, vocab)
    );
    Ok(image)
}

fn generate(
    layers: usize,
    experts: usize,
    vocab: usize,
    seed: u64,
    mix: &str,
) -> Result<(GgufWriter, SynthBytes)> {
    let mix = match mix {
        "strix-lean" => TypeMix::StrixLean,
        "q8_0" => TypeMix::Q8_0,
        other => anyhow::bail!("--mix {other}: expected strix-lean or q8_0"),
    };
    let c = flash_config(layers, experts, vocab);
    let mut w = GgufWriter::new(32);
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} tensors")
            .expect("static progress template"),
    );
    let b = synth(&c, mix, seed, &mut w, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    Ok((w, b))
}
