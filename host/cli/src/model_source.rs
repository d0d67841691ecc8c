//! Where `bench` and `logits` get their model: a GGUF file (`--model`) or a synthetic
//! V4-Flash-shaped deepseek4 model built in memory (`--synth`), no file written.

use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use moe_engine::{load_gguf, open_gguf_bytes, LoadOptions, LoadedModel};
use moe_plugin_host::Registry;

#[derive(Args, Debug)]
pub struct ModelSource {
    /// The GGUF file.
    #[arg(long, required_unless_present = "synth")]
    pub model: Option<PathBuf>,
    /// Instead of a file: a V4-Flash-shaped deepseek4 model of this many layers with
    /// random valid weights (the same as `synth --seed 1` writes), built in memory and
    /// uploaded; with --layers the layers past these repeat the last two.
    #[arg(long, conflicts_with = "model")]
    pub synth: Option<usize>,
    /// Weight types of --synth: `strix-lean` or `q8_0` (as `synth --mix`).
    #[arg(long, default_value = "strix-lean")]
    pub synth_mix: String,
    /// Routed experts of --synth.
    #[arg(long, default_value_t = 256)]
    pub synth_experts: usize,
    /// Vocabulary of --synth.
    #[arg(long, default_value_t = 129280)]
    pub synth_vocab: usize,
    /// deepseek4: a next-token-prediction (MTP) GGUF to draft with (`convert --mtp`
    /// writes one; llama.cpp's `--mtp` files are the same layout).
    #[arg(long)]
    pub mtp: Option<PathBuf>,
}

impl ModelSource {
    /// The file's path, or `synth:<layers>:<mix>:<experts>:<vocab>`.
    pub fn describe(&self) -> String {
        match (&self.model, self.synth) {
            (Some(p), _) => p.display().to_string(),
            (None, layers) => format!(
                "synth:{}:{}:{}:{}",
                layers.unwrap_or(0),
                self.synth_mix,
                self.synth_experts,
                self.synth_vocab
            ),
        }
    }

    pub fn load(&self, config: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
        let opts = &LoadOptions {
            mtp: self.mtp.clone(),
            ..opts.clone()
        };
        match (&self.model, self.synth) {
            (Some(path), _) => crate::eval_cmd::load_model(config, path, opts),
            (None, Some(layers)) => {
                let reg = Registry::from_config_file(config)?;
                let image = crate::synth_cmd::in_memory(
                    layers,
                    self.synth_experts,
                    self.synth_vocab,
                    1,
                    &self.synth_mix,
                )?;
                let f = open_gguf_bytes(&reg, image, &self.describe())?;
                load_gguf(&reg, f, opts)
            }
            (None, None) => anyhow::bail!("give --model FILE or --synth LAYERS"),
        }
    }
}
