//! Loading a GGUF model: tensors placed by the configured policy and uploaded to the
//! backend, the tokenizer built from metadata, and the architecture's graph.

use std::{collections::HashMap, path::Path, sync::Arc};

use anyhow::{anyhow, bail, Context, Result};
use moe_gguf::GgufFile;
use moe_plugin_api::{
    abi_stable::std_types::{ROption, RVec},
    into_result, DeviceInfo, Phase, PlacementRequest, TensorMeta,
};
use moe_plugin_host::{config::settings_text, Registry};
use moe_tokenizer::{ExtraParts, Tokenizer, TokenizerParts};

use crate::{deepseek4, device::Device, device::Tensor, llama};

/// One token of a forward batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchEntry {
    pub token: u32,
    /// KV-cache slot (one per concurrent sequence).
    pub slot: u32,
    /// Position within its sequence.
    pub pos: u32,
    /// Whether this position's logits are returned.
    pub want_logits: bool,
    /// A drafted token (speculative decoding) that the model may be asked to drop: the
    /// slot's next pass may start at its position or any later one of this pass. Drafts
    /// end their slot's run of a batch, after at least one token that is not a draft.
    pub draft: bool,
}

impl BatchEntry {
    /// A prompt fed to `slot` from position 0, with logits at every position or only
    /// at the last.
    pub fn prompt(tokens: &[u32], slot: u32, all_logits: bool) -> Vec<BatchEntry> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| BatchEntry {
                token,
                slot,
                pos: i as u32,
                want_logits: all_logits || i + 1 == tokens.len(),
                draft: false,
            })
            .collect()
    }
}

/// A decoder-only model over cached slots.
pub trait CausalLm: Send {
    fn arch(&self) -> &str;
    fn n_ctx(&self) -> usize;
    fn n_slots(&self) -> usize;
    fn n_vocab(&self) -> usize;
    fn device(&self) -> &Arc<Device>;
    /// Runs the batch; returns logits rows for entries with `want_logits`, in order.
    fn forward(&mut self, batch: &[BatchEntry]) -> Result<Vec<Vec<f32>>>;
    /// Benchmarks: puts slot `slot` at position `pos` as if `pos` tokens had run,
    /// without running them (the caches get representative values, or keep whatever
    /// they hold), so a step at depth `pos` costs what a real one does.
    fn seek(&mut self, _slot: u32, _pos: usize) -> Result<()> {
        anyhow::bail!("{}: seeking a slot is not supported", self.arch())
    }
    /// A new sequence in slot `slot`, whose cache holds `cached` tokens, of which the
    /// first `matching` equal its prompt's: how many to keep (its prefill starts there).
    /// 0 = start over, the default for models that have not said what they can reuse.
    fn keep_prefix(&self, _slot: u32, _cached: usize, _matching: usize) -> usize {
        0
    }
    /// Where slot `slot` can be put back at position `len`, after a prompt of that many
    /// tokens it held, and kept the logits that prompt's last token gave: those logits
    /// (a prompt sent again then needs no pass). None by default.
    fn replay_logits(&self, _slot: u32, _len: usize) -> Option<&[f32]> {
        None
    }
    /// Whether a slot may go back to any earlier position (its cache rows past it
    /// count for nothing).
    fn can_rewind(&self) -> bool {
        false
    }
    /// Whether the model drafts with a block of its own ([`CausalLm::draft_logits`]).
    fn has_drafter(&self) -> bool {
        false
    }
    /// Drafting with a block of its own (deepseek4's MTP): the logits of up to `k` chained
    /// guesses after `token` at position `pos` of `slot` (whose cache holds the positions
    /// before `pos`), each step fed the greedy choice of the one before; the chain stops
    /// before a guess whose probability is below `p_min` (0: never). None without one.
    fn draft_logits(
        &mut self,
        _slot: u32,
        _token: u32,
        _pos: usize,
        _k: usize,
        _p_min: f32,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        Ok(None)
    }
    /// How many drafted tokens (entries marked `draft`) one pass of a slot may carry
    /// after its sure token, all of which the model can drop afterwards; 0: none, so no
    /// speculative decoding. A model that rewinds to any position takes any number.
    fn max_draft(&self) -> usize {
        if self.can_rewind() {
            usize::MAX
        } else {
            0
        }
    }
    /// What one decoded token reads at context depth `pos`, where the model knows.
    fn step_traffic(&self, _pos: usize) -> Option<StepTraffic> {
        None
    }
}

/// Bytes one decode step reads and the weights it multiplies.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTraffic {
    /// Weight bytes read (routed experts: the ones a token uses).
    pub weight_bytes: u64,
    /// Cache bytes read (window, compressed rows, indexer keys).
    pub cache_bytes: u64,
    /// Weight values multiplied per token (2 flops each).
    pub weight_params: u64,
    /// Of `weight_bytes`, the routed experts' (those one token uses): a pass of several
    /// tokens reads them once a token where no two share an expert, the rest once.
    pub routed_bytes: u64,
}

impl StepTraffic {
    /// Bytes a pass of `tokens` consecutive tokens reads where none shares a routed
    /// expert with another: the shared weights once, each token's experts and cache rows.
    pub fn pass_bytes(&self, tokens: u64) -> u64 {
        self.weight_bytes.saturating_sub(self.routed_bytes)
            + tokens * (self.routed_bytes + self.cache_bytes)
    }
}

/// The model's weights on their devices, by GGUF tensor name.
pub struct Weights {
    dev: Arc<Device>,
    map: HashMap<String, Arc<Tensor>>,
}

impl Weights {
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
    pub fn get(&self, name: &str) -> Result<Arc<Tensor>> {
        self.map
            .get(name)
            .cloned()
            .ok_or_else(|| anyhow!("the model has no tensor '{name}'"))
    }
}

#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// Context length per sequence (0 = the model's training context, capped at 4096).
    pub n_ctx: usize,
    /// Concurrent sequences (KV-cache slots).
    pub n_slots: usize,
    /// Benchmarks only (deepseek4): build this many layers from a file with fewer, layer
    /// j >= L copying a file layer of the same kind (see `Ds4Params::with_layers`); each
    /// copy is its own device allocation, so memory and bytes read are the real ones.
    pub repeat_layers: Option<usize>,
    /// deepseek4: a next-token-prediction (MTP) GGUF to draft with (llama.cpp's `--mtp`
    /// layout, as `moeserve convert --mtp` writes it: the block's own mHC head as the
    /// file's `output_hc_*`).
    pub mtp: Option<std::path::PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            n_ctx: 0,
            n_slots: 4,
            repeat_layers: None,
            mtp: None,
        }
    }
}

pub struct LoadedModel {
    pub name: String,
    pub arch: String,
    /// None when the file carries no tokenizer (enough for `logits`, not for serving).
    pub tokenizer: Option<Arc<Tokenizer>>,
    pub model: Box<dyn CausalLm>,
}

fn layer_of(name: &str) -> i32 {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

/// Uploads `f`'s tensors to `dev` under the names `names_of` gives (none: skipped),
/// each checked by its quant plugin first.
fn upload_tensors(
    reg: &Registry,
    f: &GgufFile,
    dev: &Arc<Device>,
    map: &mut HashMap<String, Arc<Tensor>>,
    names_of: impl Fn(&str) -> Vec<String>,
) -> Result<()> {
    let path = f.path();
    let meta_json = f.scalar_metadata_json();
    for t in f.tensors() {
        let names = names_of(&t.name);
        if names.is_empty() {
            continue;
        }
        let data = f.tensor_data(t);
        let mut variant = 0;
        if let Some(fmt) = reg.quant_format(t.type_id) {
            variant = into_result((fmt.resolve_variant)(meta_json.as_str().into()))
                .map_err(|e| anyhow!("{}: tensor {}: {e}", path.display(), t.name))?;
            into_result((fmt.validate)(variant, data.into())).map_err(|e| {
                anyhow!("{}: tensor {} ({}): {e}", path.display(), t.name, fmt.name)
            })?;
        }
        let mut dims = [1u64; 4];
        for (d, v) in dims.iter_mut().zip(&t.dims) {
            *d = *v;
        }
        for name in names {
            let mut tensor = dev.tensor(t.type_id, dims, t.n_bytes.max(1))?;
            tensor.r.variant = variant;
            tensor
                .upload(data)
                .with_context(|| format!("uploading {name}"))?;
            map.insert(name, Arc::new(tensor));
        }
    }
    Ok(())
}

/// An MTP file drafts for the model whose embedding and output head it shares (the
/// block uses the model's copies). Other shapes are refused; other bytes only warned
/// about (another quantisation of the same model is fine; another model's block drafts
/// badly, but the output stays the model's own, drafts being checked).
fn check_mtp_file(model: &GgufFile, mtp: &GgufFile) -> Result<()> {
    if mtp.get_str("general.architecture").ok() != Some("deepseek4") {
        bail!("not a deepseek4 GGUF");
    }
    for name in ["token_embd.weight", "output.weight"] {
        if let (Some(a), Some(b)) = (model.tensor(name), mtp.tensor(name)) {
            if a.dims != b.dims {
                bail!(
                    "its {name} has dims {:?}, the model's {:?}: it drafts for another model",
                    b.dims,
                    a.dims
                );
            }
            if a.type_id != b.type_id || model.tensor_data(a) != mtp.tensor_data(b) {
                tracing::warn!(
                    "{}: its {name} differs from the model's (another quantisation, or another \
                     model: then its drafts will rarely be accepted)",
                    mtp.path().display()
                );
            }
        }
    }
    Ok(())
}

/// Opens a GGUF with the type sizes the loaded quant plugins declare.
pub fn open_gguf(reg: &Registry, path: &Path) -> Result<GgufFile> {
    Ok(GgufFile::open(path, &|id| type_size(reg, id))?)
}

/// [`open_gguf`] over a GGUF image in memory (`name` stands in for its path).
pub fn open_gguf_bytes(reg: &Registry, bytes: Vec<u8>, name: &str) -> Result<GgufFile> {
    Ok(GgufFile::from_bytes(bytes, name, &|id| type_size(reg, id))?)
}

/// (weights, bytes) per block of a tensor type. Integer tables (e.g. deepseek4's tid2eid, I32) are
/// plain data the host reads itself; every other type must be claimed by a quant plugin.
fn type_size(reg: &Registry, id: u32) -> Option<(u32, u32)> {
    reg.type_size(id).or_else(|| {
        (24..=27)
            .contains(&id)
            .then(|| moe_gguf::ggml_type_size(id))
            .flatten()
    })
}

/// Runs the configured placement policy and returns the single device it chose.
fn place(reg: &Registry, f: &GgufFile, devices: &[DeviceInfo]) -> Result<u32> {
    let cfg = &reg.config;
    let policy = reg.policy(&cfg.placement.policy)?;
    let profile = match &cfg.placement.routing_profile {
        Some(p) => {
            let path = cfg.base_dir().join(p);
            ROption::RSome(
                std::fs::read_to_string(&path)
                    .with_context(|| format!("reading routing profile {}", path.display()))?
                    .into(),
            )
        }
        None => ROption::RNone,
    };
    let tensors: RVec<TensorMeta> = f
        .tensors()
        .iter()
        .map(|t| TensorMeta {
            name: t.name.as_str().into(),
            shape: t.dims.iter().copied().collect(),
            type_id: t.type_id,
            bytes: t.n_bytes,
            layer: layer_of(&t.name),
            n_experts: if t.name.contains("_exps") {
                t.dims.last().copied().unwrap_or(0) as u32
            } else {
                0
            },
            role: llama::role_of(&t.name).into(),
        })
        .collect();
    let req = PlacementRequest {
        devices: devices.iter().cloned().collect(),
        tensors,
        phase: Phase::Decode,
        routing_profile: profile,
        settings_toml: settings_text(&cfg.placement.settings).into(),
    };
    let plan = into_result((policy.place)(&req))
        .map_err(|e| anyhow!("placement policy '{}': {e}", policy.name))?;
    let mut used: Vec<u32> = plan.iter().map(|a| a.device).collect();
    used.sort_unstable();
    used.dedup();
    match used.as_slice() {
        [one] => Ok(devices
            .get(*one as usize)
            .ok_or_else(|| anyhow!("placement chose device {one}, which was not offered"))?
            .index),
        [] => bail!("placement policy '{}' placed no tensors", policy.name),
        many => bail!(
            "placement policy '{}' spread the model over devices {many:?}; running one model across several devices is not supported yet — use single-device",
            policy.name
        ),
    }
}

fn tokenizer_from(f: &GgufFile) -> Result<Tokenizer> {
    let opt_u32 = |k: &str| f.get_u64(k).ok().map(|v| v as u32);
    let strings = |k: &str| -> Result<Vec<String>> {
        Ok(f.get_str_array(k)?.into_iter().map(str::to_owned).collect())
    };
    let mut eot = Vec::new();
    for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        eot.extend(opt_u32(k));
    }
    let parts = TokenizerParts {
        model: f.get_str("tokenizer.ggml.model")?.to_owned(),
        pre: f.get_str("tokenizer.ggml.pre").ok().map(str::to_owned),
        tokens: strings("tokenizer.ggml.tokens")?,
        token_types: f
            .get_i64_array("tokenizer.ggml.token_type")
            .ok()
            .map(|v| v.into_iter().map(|x| x as i32).collect()),
        merges: strings("tokenizer.ggml.merges").unwrap_or_default(),
        bos_id: opt_u32("tokenizer.ggml.bos_token_id"),
        eos_id: opt_u32("tokenizer.ggml.eos_token_id"),
        unk_id: opt_u32("tokenizer.ggml.unknown_token_id"),
        pad_id: opt_u32("tokenizer.ggml.padding_token_id"),
        eot_ids: eot,
        add_bos: f.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(false),
        add_eos: f.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false),
        chat_template: f.get_str("tokenizer.chat_template").ok().map(str::to_owned),
    };
    let extra = ExtraParts {
        scores: f
            .get_f64_array("tokenizer.ggml.scores")
            .ok()
            .map(|v| v.into_iter().map(|x| x as f32).collect()),
        add_space_prefix: f.get_bool("tokenizer.ggml.add_space_prefix").ok(),
    };
    Ok(Tokenizer::from_parts_with(parts, extra)?)
}

/// Loads a GGUF model onto the configured backend.
pub fn load(reg: &Registry, path: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    load_gguf(reg, open_gguf(reg, path)?, opts)
}

/// [`load`] from an opened GGUF (a file, or an image in memory: `moeserve bench --synth`).
pub fn load_gguf(reg: &Registry, f: GgufFile, opts: &LoadOptions) -> Result<LoadedModel> {
    let path = f.path();
    let arch = f.get_str("general.architecture")?.to_owned();
    if arch != "llama" && arch != "deepseek4" {
        bail!(
            "{}: architecture '{arch}' is not supported yet (supported: llama, deepseek4)",
            path.display()
        );
    }
    let tokenizer = if f.get("tokenizer.ggml.model").is_some() {
        Some(Arc::new(
            tokenizer_from(&f).with_context(|| format!("{}: tokenizer", path.display()))?,
        ))
    } else {
        None
    };

    let be = reg.backend(&reg.config.devices.backend)?;
    into_result((be.register_quant_formats)(
        reg.quant_formats().cloned().collect(),
    ))
    .map_err(|e| anyhow!("{}: {e}", be.name))?;
    let mut devices: Vec<DeviceInfo> = into_result((be.devices)())
        .map_err(|e| anyhow!("{}: listing devices: {e}", be.name))?
        .into_iter()
        .collect();
    let wanted = &reg.config.devices.use_devices;
    if !wanted.is_empty() {
        devices.retain(|d| wanted.contains(&d.index));
    }
    if devices.is_empty() {
        bail!(
            "backend '{}' has no usable devices (use_devices = {wanted:?})",
            be.name
        );
    }
    let dev_index = place(reg, &f, &devices)?;
    let dev = Device::open(be, dev_index)?;

    let total: u64 = f.tensors().iter().map(|t| t.n_bytes).sum();
    tracing::info!(
        "loading {} ({} tensors, {:.1} MiB) onto {}",
        path.display(),
        f.tensors().len(),
        total as f64 / (1 << 20) as f64,
        dev.name()
    );
    let ds4 = if arch == "deepseek4" {
        let p = deepseek4::Ds4Params::from_gguf(&f)
            .with_context(|| format!("{}: deepseek4 metadata", path.display()))?;
        Some(match opts.repeat_layers {
            Some(n) => p.with_layers(n)?,
            None => p,
        })
    } else if opts.repeat_layers.is_some() {
        bail!("repeating layers is only done for deepseek4 models");
    } else {
        None
    };
    // (checked before any upload: a bad file fails at once, naming itself)
    let llama = match ds4 {
        Some(_) => None,
        None => Some(
            llama::LlamaParams::from_gguf(&f, &arch)
                .with_context(|| format!("{}: {arch} metadata", path.display()))?,
        ),
    };
    let n_vocab = ds4
        .as_ref()
        .map_or_else(|| llama.as_ref().map_or(0, |p| p.n_vocab), |p| p.n_vocab);
    if let Some(t) = tokenizer.as_ref().filter(|t| t.vocab_size() > n_vocab) {
        bail!(
            "{}: the tokenizer has {} tokens but the model only {n_vocab} embedding rows",
            path.display(),
            t.vocab_size()
        );
    }
    // The names each file tensor is uploaded under (more than one when layers repeat).
    let names_of = |name: &str| -> Vec<String> {
        let (Some(p), Some(rest)) = (&ds4, name.strip_prefix("blk.")) else {
            return vec![name.to_string()];
        };
        let Some((l, tail)) = rest.split_once('.') else {
            return vec![name.to_string()];
        };
        let Ok(l) = l.parse::<usize>() else {
            return vec![name.to_string()];
        };
        (0..p.n_layer)
            .filter(|&j| p.src_layer[j] == l)
            .map(|j| format!("blk.{j}.{tail}"))
            .collect()
    };
    let mut map = HashMap::new();
    upload_tensors(reg, &f, &dev, &mut map, |name| names_of(name))?;
    let mtp_file = match (&ds4, &opts.mtp) {
        (_, None) => None,
        (None, Some(_)) => bail!("--mtp: drafting blocks are read for deepseek4 models only"),
        (Some(_), Some(mp)) => {
            let mf = open_gguf(reg, mp)?;
            check_mtp_file(&f, &mf).with_context(|| format!("{}", mp.display()))?;
            // (the block is the MTP file's first after its main layers)
            let main_layers = deepseek4::Ds4Params::from_gguf(&mf)
                .with_context(|| format!("{}: deepseek4 metadata", mp.display()))?
                .n_layer;
            let blk = format!("blk.{main_layers}.");
            upload_tensors(reg, &mf, &dev, &mut map, |name| {
                let mine = name.starts_with(&blk) || name.starts_with("output_hc_");
                match mine {
                    true => vec![format!("{}{name}", deepseek4::MTP_PREFIX)],
                    false => vec![],
                }
            })
            .with_context(|| format!("{}", mp.display()))?;
            Some(mf)
        }
    };
    let weights = Weights { dev, map };
    let model: Box<dyn CausalLm> = if let Some(p) = ds4 {
        let n_ctx = if opts.n_ctx == 0 {
            p.train_ctx.min(4096)
        } else {
            opts.n_ctx
        };
        let mut m = deepseek4::Deepseek4::new(&f, &weights, p, n_ctx, opts.n_slots.max(1))
            .with_context(|| format!("{}: building the deepseek4 graph", path.display()))?;
        if let (Some(mf), Some(mp)) = (&mtp_file, &opts.mtp) {
            m.attach_mtp(mf, &weights)
                .with_context(|| format!("{}: the MTP drafter", mp.display()))?;
            tracing::info!("deepseek4: drafting with the MTP block of {}", mp.display());
        }
        Box::new(m)
    } else {
        let llama = llama.expect("parsed above for every other architecture");
        let n_ctx = if opts.n_ctx == 0 {
            llama.train_ctx.min(4096)
        } else {
            opts.n_ctx
        };
        Box::new(
            llama::Llama::new(llama, &weights, n_ctx, opts.n_slots.max(1))
                .with_context(|| format!("{}: building the {arch} graph", path.display()))?,
        )
    };
    let name = f
        .get_str("general.name")
        .ok()
        .map(str::to_owned)
        .unwrap_or_else(|| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
    Ok(LoadedModel {
        name,
        arch,
        tokenizer,
        model,
    })
}
