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
    mtp: bool,
) -> Result<()> {
    crate::out_path::check_out(out, &[])?;
    let (w, b) = generate(layers, experts, vocab, seed, mix, mtp)?;
    w.write_file(out)
        .with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "wrote {} ({})",
        out.display(),
        summary(&b, layers, experts, vocab)
    );
    Ok(())
}

/// Memory the system could give this process now (Linux: MemAvailable), if known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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
    let (w, b) = generate(layers, experts, vocab, seed, mix, false)?;
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
    mtp: bool,
) -> Result<(GgufWriter, SynthBytes)> {
    let (mix, expert_bits) = match mix {
        "strix-lean" => (TypeMix::StrixLean, 2.5),
        "q8_0" => (TypeMix::Q8_0, 8.5),
        other => anyhow::bail!("--mix {other}: expected strix-lean or q8_0"),
    };
    if layers == 0 || experts == 0 {
        anyhow::bail!("synth: {layers} layers of {experts} experts: need at least one of each");
    }
    if vocab < 260 {
        anyhow::bail!(
            "synth: a vocabulary of {vocab} tokens is too small for the byte-level tokenizer \
             (>= 260)"
        );
    }
    if vocab > 1 << 24 {
        anyhow::bail!("synth: a vocabulary of {vocab} tokens is too large (at most 16M)");
    }
    // The model is built in memory before it is written or uploaded: refuse what this
    // machine cannot hold rather than abort half-way (estimate: the experts' three
    // 4096 x 2048 matrices at the mix's bits a weight, ~0.2 GB of the rest a layer, the
    // embedding and head at 8.5 bits).
    let est = layers as f64 * (experts as f64 * 3.0 * 4096.0 * 2048.0 * expert_bits / 8.0 + 0.2e9)
        + 2.0 * vocab as f64 * 4096.0 * 8.5 / 8.0;
    if let Some(avail) = available_memory() {
        if est > 0.9 * avail as f64 {
            anyhow::bail!(
                "synth: {layers} layers of {experts} experts need about {:.1} GiB of memory to \
                 build, and {:.1} GiB is available; use fewer layers (bench --synth L --layers \
                 43 repeats layers as device copies) or experts",
                est / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            );
        }
    }
    let c = flash_config(layers, experts, vocab);
    let mut w = GgufWriter::new(32);
    let pb = ProgressBar::new(0);
    pb.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} tensors")
            .expect("static progress template"),
    );
    let progress = |done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    };
    let b = synth(&c, mix, seed, &mut w, &progress, mtp)?;
    pb.finish_and_clear();
    Ok((w, b))
}
