//! DeepSeek-V4 (`deepseek4` GGUF): mHC residual streams, sliding / CSA / HCA attention
//! with learned compressors and a lightning indexer, hash and top-k routed MoE. Every
//! size comes from GGUF metadata and tensor shapes. Weight products run as backend
//! MATMUL / GET_ROWS ops through the quant plugins; per-token glue is in `math`.
//!
//! The reference is transformers' cached one-token-at-a-time path; a batched prefill
//! here walks the same per-token state machine, so prefill == decode by construction
//! of the compressors and an explicit per-query causal window / row threshold.

mod gpu;
mod state;

use moe_ds4_math as math;

use std::{cell::RefCell, sync::Arc};

use anyhow::{anyhow, bail, Context, Result};
use moe_gguf::GgufFile;
use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::{
    device::{Device, Tensor},
    model::{BatchEntry, CausalLm, Weights},
};
use math::{Rope, YarnParams};
use state::{Compressor, SlotState};

/// More Sinkhorn iterations than any checkpoint uses (the release: 20); a larger value
/// in a file would make every token's mHC sites run for as long.
const MAX_SINKHORN_ITERS: usize = 1000;

/// Hyperparameters, all from GGUF metadata (and tensor shapes).
#[derive(Debug, Clone)]
pub struct Ds4Params {
    pub n_layer: usize,
    pub d: usize,
    pub n_vocab: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub n_expert: usize,
    pub n_used: usize,
    pub routed_scale: f32,
    pub norm_topk: bool,
    pub clamp_exp: Vec<f32>,
    pub clamp_shexp: Vec<f32>,
    pub window: usize,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub idx_topk: usize,
    pub ratios: Vec<usize>,
    pub n_hash: usize,
    pub hc: usize,
    pub hc_iters: usize,
    pub hc_eps: f32,
    pub eps: f32,
    pub rope_base: f32,
    pub crope_base: f32,
    pub yarn: Option<YarnParams>,
    pub train_ctx: usize,
    /// Router score function (ggml's numbering): 4 = sqrt(softplus), 2 = sigmoid.
    pub gating: u32,
    /// The file layer each layer's tensors come from (itself, unless `with_layers`).
    pub src_layer: Vec<usize>,
    /// Next-token-prediction blocks the file holds after its `n_layer` layers
    /// (`nextn_predict_layers`; an MTP drafter file holds one).
    pub n_nextn: usize,
}

const GATING_SIGMOID: u32 = 2;
const GATING_SQRT_SOFTPLUS: u32 = 4;

impl Ds4Params {
    /// `n` layers from a file of L (benchmarks: V4-Flash depth from a shorter synthetic
    /// file). Layers below L are the file's; layer j >= L repeats file layer
    /// L - 2 + (j - L) % 2, keeping the alternating CSA / HCA schedule of the last two.
    pub fn with_layers(mut self, n: usize) -> Result<Ds4Params> {
        let l = self.n_layer;
        if n <= l {
            bail!("--layers {n}: the file already has {l} layers");
        }
        if l < self.n_hash + 2 {
            bail!("repeating layers needs a file with two non-hash layers after the {} hash layers, it has {l}", self.n_hash);
        }
        let src: Vec<usize> = (0..n)
            .map(|j| if j < l { j } else { l - 2 + (j - l) % 2 })
            .collect();
        self.clamp_exp = src.iter().map(|&s| self.clamp_exp[s]).collect();
        self.clamp_shexp = src.iter().map(|&s| self.clamp_shexp[s]).collect();
        self.ratios = src.iter().map(|&s| self.ratios[s]).collect();
        self.src_layer = src;
        self.n_layer = n;
        Ok(self)
    }

    pub fn from_gguf(f: &GgufFile) -> Result<Ds4Params> {
        let a = "deepseek4";
        let key = |k: &str| format!("{a}.{k}");
        let u = |k: &str| -> Result<usize> { Ok(f.get_u64(&key(k))? as usize) };
        let u_or = |k: &str, d: usize| f.get_u64(&key(k)).map(|v| v as usize).unwrap_or(d);
        let fl = |k: &str, d: f64| f.get_f64(&key(k)).unwrap_or(d) as f32;
        let n_nextn = u_or("nextn_predict_layers", 0);
        let n_layer = u("block_count")?.checked_sub(n_nextn).ok_or_else(|| {
            anyhow!("{a}: nextn_predict_layers {n_nextn} is more than block_count")
        })?;
        // Per-layer arrays or one scalar for all layers (absent: `d`, no clamp).
        let per_layer_f = |k: &str, d: f32| -> Result<Vec<f32>> {
            if f.get(&key(k)).is_none() {
                return Ok(vec![d; n_layer]);
            }
            match (f.get_f64_array(&key(k)), f.get_f64(&key(k))) {
                (Ok(v), _) if v.len() >= n_layer => {
                    Ok(v[..n_layer].iter().map(|x| *x as f32).collect())
                }
                (_, Ok(x)) => Ok(vec![x as f32; n_layer]),
                _ => bail!("{a}: {k} is neither a number nor an array of {n_layer} numbers"),
            }
        };
        let ratios: Vec<usize> = match f.get_i64_array(&key("attention.compress_ratios")) {
            Ok(v) if v.len() >= n_layer => {
                let v = &v[..n_layer];
                if let Some(bad) = v.iter().find(|&&r| r < 0) {
                    bail!("{a}: attention.compress_ratios holds {bad}");
                }
                v.iter().map(|&r| r as usize).collect()
            }
            Ok(v) => bail!(
                "{a}: attention.compress_ratios has {} entries for {n_layer} layers",
                v.len()
            ),
            Err(_) => vec![0; n_layer],
        };
        let embd = f
            .tensor("token_embd.weight")
            .context("the model has no token_embd.weight")?;
        let yarn = match f.get_str(&key("rope.scaling.type")).unwrap_or("none") {
            "none" => None,
            "yarn" => Some(YarnParams {
                factor: fl("rope.scaling.factor", 1.0),
                original_ctx: u("rope.scaling.original_context_length")? as f32,
                beta_fast: fl("rope.scaling.yarn_beta_fast", 32.0),
                beta_slow: fl("rope.scaling.yarn_beta_slow", 1.0),
                attn_factor: fl("rope.scaling.attn_factor", 1.0),
            }),
            other => bail!("{a}: rope scaling '{other}' is not supported (yarn or none)"),
        };
        let gating = f
            .get_u64(&key("expert_gating_func"))
            .unwrap_or(GATING_SQRT_SOFTPLUS as u64) as u32;
        if gating != GATING_SQRT_SOFTPLUS && gating != GATING_SIGMOID {
            bail!("{a}: expert_gating_func {gating} is not supported (4 = sqrt(softplus), 2 = sigmoid)");
        }
        let p = Ds4Params {
            n_layer,
            d: u("embedding_length")?,
            n_vocab: embd.dims.get(1).copied().unwrap_or(0) as usize,
            n_head: u("attention.head_count")?,
            head_dim: u("attention.key_length")?,
            rope_dim: u("rope.dimension_count")?,
            q_lora: u("attention.q_lora_rank")?,
            o_groups: u_or("attention.output_group_count", 1),
            o_lora: u("attention.output_lora_rank")?,
            n_expert: u("expert_count")?,
            n_used: u("expert_used_count")?,
            routed_scale: fl("expert_weights_scale", 1.0),
            norm_topk: f.get_bool(&key("expert_weights_norm")).unwrap_or(true),
            clamp_exp: per_layer_f("swiglu_clamp_exp", 0.0)?,
            clamp_shexp: per_layer_f("swiglu_clamp_shexp", 0.0)?,
            window: u("attention.sliding_window")?,
            idx_heads: u_or("attention.indexer.head_count", 0),
            idx_dim: u_or("attention.indexer.key_length", 0),
            idx_topk: u_or("attention.indexer.top_k", 0),
            ratios,
            n_hash: u_or("hash_layer_count", 0),
            hc: u("hyper_connection.count")?,
            hc_iters: u_or("hyper_connection.sinkhorn_iterations", 20),
            hc_eps: fl("hyper_connection.epsilon", 1e-6),
            eps: fl("attention.layer_norm_rms_epsilon", 1e-6),
            rope_base: fl("rope.freq_base", 10000.0),
            crope_base: fl("attention.compress_rope_freq_base", 160000.0),
            yarn,
            train_ctx: u_or("context_length", 4096),
            gating,
            src_layer: (0..n_layer).collect(),
            n_nextn,
        };
        if p.n_head == 0 || p.o_groups == 0 || !p.n_head.is_multiple_of(p.o_groups) {
            bail!(
                "{a}: {} heads do not split into {} output groups",
                p.n_head,
                p.o_groups
            );
        }
        if !p.rope_dim.is_multiple_of(2) || p.rope_dim > p.head_dim || p.window == 0 || p.hc == 0 {
            bail!(
                "{a}: inconsistent sizes (rope {} of head {}, window {}, hc {})",
                p.rope_dim,
                p.head_dim,
                p.window,
                p.hc
            );
        }
        if [p.d, p.n_vocab, p.head_dim, p.q_lora, p.o_lora].contains(&0) {
            bail!(
                "{a}: a zero size (embedding {}, vocab {}, key_length {}, q_lora_rank {}, output_lora_rank {})",
                p.d,
                p.n_vocab,
                p.head_dim,
                p.q_lora,
                p.o_lora
            );
        }
        if p.n_used == 0 || p.n_used > p.n_expert {
            bail!(
                "{a}: expert_used_count {} of {} experts",
                p.n_used,
                p.n_expert
            );
        }
        // Values that would not fail but quietly give NaN logits, or a hang.
        let yarn_factor = p.yarn.as_ref().map_or(1.0, |y| y.factor);
        let yarn_ctx = p.yarn.as_ref().map_or(1.0, |y| y.original_ctx);
        for (v, key) in [
            (p.eps, "attention.layer_norm_rms_epsilon"),
            (p.hc_eps, "hyper_connection.epsilon"),
            (p.rope_base, "rope.freq_base"),
            (p.crope_base, "attention.compress_rope_freq_base"),
            (yarn_factor, "rope.scaling.factor"),
            (yarn_ctx, "rope.scaling.original_context_length"),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("{a}.{key} is {v}; it must be a positive number");
            }
        }
        if p.hc_iters > MAX_SINKHORN_ITERS {
            bail!(
                "{a}.hyper_connection.sinkhorn_iterations is {}; at most {MAX_SINKHORN_ITERS} \
                 (the release uses 20)",
                p.hc_iters
            );
        }
        Ok(p)
    }
}

/// A small tensor the host glue reads every step, kept as f32 on the host.
type HostF32 = Vec<f32>;

struct CompWeights {
    ratio: usize,
    /// ratio x width position biases.
    ape: HostF32,
    norm: HostF32,
    kv: Arc<Tensor>,
    gate: Arc<Tensor>,
    /// Overlapping windows (CSA and its indexer) project 2 x dim per token.
    overlap: bool,
    dim: usize,
}

struct Indexer {
    comp: CompWeights,
    q_b: Arc<Tensor>,
    proj: Arc<Tensor>,
}

struct Layer {
    attn_norm: HostF32,
    ffn_norm: HostF32,
    hc_attn: (Arc<Tensor>, HostF32, HostF32),
    hc_ffn: (Arc<Tensor>, HostF32, HostF32),
    q_a: Arc<Tensor>,
    q_a_norm: HostF32,
    q_b: Arc<Tensor>,
    kv: Arc<Tensor>,
    kv_norm: HostF32,
    out_a: Arc<Tensor>,
    out_b: Arc<Tensor>,
    sinks: HostF32,
    comp: Option<CompWeights>,
    indexer: Option<Indexer>,
    router: Arc<Tensor>,
    bias: Option<HostF32>,
    tid2eid: Option<Vec<i32>>,
    gate_exps: Arc<Tensor>,
    up_exps: Arc<Tensor>,
    down_exps: Arc<Tensor>,
    shexp: Option<(Arc<Tensor>, Arc<Tensor>, Arc<Tensor>)>,
}

/// DeepSeek-V4's next-token-prediction block (`mtp.0`; from a GGUF as llama.cpp's
/// converter writes it with `--mtp`), a drafter for speculative decoding: from the
/// target's last mHC streams at position p - 1 and the token at p, one more block
/// (sliding window only) and the head give a guess at the token after p.
struct Mtp {
    /// The block, run as layer `p.n_layer` (its ratio and clamps are appended to `p`).
    layer: Layer,
    /// [2d, d]: the normed embedding and the normed stream side by side -> a stream.
    eh_proj: Arc<Tensor>,
    enorm: HostF32,
    hnorm: HostF32,
    /// The head's norm (the block's own where the file has one, else the model's).
    head_norm: HostF32,
    /// The block's own mHC head.
    hc_head: (Arc<Tensor>, HostF32, HostF32),
}

/// The prefix the MTP file's weights are uploaded under (its layer may share a number
/// with one of the model's, e.g. when layers repeat).
pub const MTP_PREFIX: &str = "mtp:";

pub struct Deepseek4 {
    p: Ds4Params,
    dev: Arc<Device>,
    embd: Arc<Tensor>,
    out_norm: HostF32,
    output: Arc<Tensor>,
    hc_head: (Arc<Tensor>, HostF32, HostF32),
    layers: Vec<Layer>,
    rope_main: Rope,
    rope_comp: Rope,
    n_ctx: usize,
    slots: Vec<SlotState>,
    /// Grow-only input / output buffers for the weight products, reused across calls
    /// (a device allocation per product cost more than the product on the GPU).
    io: RefCell<[Option<Tensor>; 2]>,
    /// The device-resident forward, when the backend runs the glue ops.
    gpu: Option<gpu::GpuPath>,
    /// The drafter, when loaded (`attach_mtp`).
    mtp: Option<Mtp>,
}

/// A reused f32 buffer in `slot` holding at least `n` values.
fn reuse<'a>(dev: &Arc<Device>, slot: &'a mut Option<Tensor>, n: usize) -> Result<&'a Tensor> {
    if slot.as_ref().is_none_or(|t| t.bytes < 4 * n as u64) {
        *slot = None; // free the old one first
        *slot = Some(dev.f32([n.next_power_of_two() as u64, 1, 1, 1])?);
    }
    slot.as_ref().ok_or_else(|| anyhow!("scratch buffer"))
}

/// Reads a small tensor to host f32 (F32 directly from the file, anything else
/// decoded by the backend through its quant plugin).
fn host_f32(f: &GgufFile, name: &str, w: &Weights, wname: &str) -> Result<HostF32> {
    let info = f
        .tensor(name)
        .ok_or_else(|| anyhow!("the model has no tensor '{name}'"))?;
    if info.type_id == types::F32 {
        return Ok(f
            .tensor_data(info)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect());
    }
    let t = w.get(wname)?;
    let cols = info.dims[0] as usize;
    let rows = (info.numel() as usize) / cols.max(1);
    let dev = w.device();
    let ids = dev.i32(rows)?;
    ids.upload_i32(&(0..rows as i32).collect::<Vec<_>>())?;
    let out = dev.f32([cols as u64, rows as u64, 1, 1])?;
    let table = TensorRef {
        dims: [cols as u64, rows as u64, 1, 1],
        ..t.r
    };
    dev.op(ops::GET_ROWS, OpParams::default(), &[table, ids.r, out.r])
        .with_context(|| format!("decoding {name}"))?;
    dev.sync()?;
    out.download_f32(cols * rows)
}

fn check_dims(t: &Tensor, name: &str, want: &[usize]) -> Result<()> {
    let have: Vec<usize> = t.r.dims.iter().map(|&d| d as usize).collect();
    if have[..want.len()] != *want || have[want.len()..].iter().any(|&d| d != 1) {
        bail!("tensor {name} has dims {have:?}, expected {want:?}");
    }
    Ok(())
}

impl Deepseek4 {
    /// The model over loaded weights; `p` from [`Ds4Params::from_gguf`] (maybe
    /// [`Ds4Params::with_layers`]): small tensors are read from the file layer
    /// `p.src_layer[l]`, weights by their own names.
    pub fn new(
        f: &GgufFile,
        w: &Weights,
        p: Ds4Params,
        n_ctx: usize,
        n_slots: usize,
    ) -> Result<Deepseek4> {
        let src = LayerSrc { f, w, wpre: "" };
        let g = |n: &str| src.g(n);
        let h = |n: &str| src.h(n);
        let layers = (0..p.n_layer)
            .map(|l| load_layer(&src, &p, l, l, p.src_layer[l], p.ratios[l]))
            .collect::<Result<Vec<_>>>()?;
        let rope_main = Rope::plain(p.rope_base, p.rope_dim);
        let rope_comp = match p.yarn {
            Some(y) => Rope::yarn(p.crope_base, p.rope_dim, y),
            None => Rope::plain(p.crope_base, p.rope_dim),
        };
        let hc_fn = g("output_hc_fn.weight")?;
        check_dims(&hc_fn, "output_hc_fn.weight", &[p.hc * p.d, p.hc])?;
        let output = g("output.weight")?;
        check_dims(&output, "output.weight", &[p.d, p.n_vocab])?;
        let (hs, hb) = (h("output_hc_scale.weight")?, h("output_hc_base.weight")?);
        if hs.is_empty() || hb.len() != p.hc {
            bail!(
                "output_hc_scale / output_hc_base: {} / {} values, expected 1 / {}",
                hs.len(),
                hb.len(),
                p.hc
            );
        }
        let out_norm = h("output_norm.weight")?;
        if out_norm.len() != p.d {
            bail!(
                "output_norm.weight: {} values, expected {}",
                out_norm.len(),
                p.d
            );
        }
        let slots = (0..n_slots.max(1))
            .map(|_| SlotState::new(&layers_shape(&layers)))
            .collect();
        let mut m = Deepseek4 {
            gpu: None,
            mtp: None,
            io: RefCell::new([None, None]),
            dev: w.device().clone(),
            embd: g("token_embd.weight")?,
            out_norm,
            output,
            hc_head: (hc_fn, hs, hb),
            layers,
            rope_main,
            rope_comp,
            n_ctx,
            slots,
            p,
        };
        if gpu::fits(&m.p) {
            m.gpu = gpu::GpuPath::new(&m).context("preparing the device-resident forward")?;
        }
        tracing::info!(
            "deepseek4: per-token glue on {}",
            if m.gpu.is_some() {
                "the device (resident activations and caches)"
            } else {
                "the host"
            }
        );
        Ok(m)
    }

    /// Adds the next-token-prediction block of `f` (an MTP GGUF: one `nextn` block after
    /// the main layers; its weights uploaded into `w` under [`MTP_PREFIX`]) as the
    /// drafter. Needs the device-resident forward, which runs it.
    pub fn attach_mtp(&mut self, f: &GgufFile, w: &Weights) -> Result<()> {
        if self.mtp.is_some() {
            bail!("an MTP drafter is already attached");
        }
        if self.gpu.is_none() {
            bail!("the MTP drafter runs on the device-resident forward, which this backend does not run");
        }
        let mp = Ds4Params::from_gguf(f)?;
        let fl = mp.n_layer;
        let nx = |s: &str| format!("blk.{fl}.nextn.{s}");
        if mp.n_nextn != 1 || f.tensor(&nx("eh_proj.weight")).is_none() {
            bail!(
                "not an MTP file: nextn_predict_layers {} (one block expected) and {} {}",
                mp.n_nextn,
                nx("eh_proj.weight"),
                if f.tensor(&nx("eh_proj.weight")).is_some() {
                    "present"
                } else {
                    "absent"
                }
            );
        }
        for own in ["embed_tokens.weight", "shared_head_head.weight"] {
            if f.tensor(&nx(own)).is_some() {
                bail!("{}: an MTP block with its own embedding or head is not supported (it shares the model's)", nx(own));
            }
        }
        let p = &self.p;
        for (what, a, b) in [
            ("embedding_length", mp.d, p.d),
            ("vocabulary", mp.n_vocab, p.n_vocab),
            ("hyper_connection.count", mp.hc, p.hc),
            ("attention.head_count", mp.n_head, p.n_head),
            ("attention.key_length", mp.head_dim, p.head_dim),
            ("attention.q_lora_rank", mp.q_lora, p.q_lora),
            ("attention.output_group_count", mp.o_groups, p.o_groups),
            ("attention.output_lora_rank", mp.o_lora, p.o_lora),
            ("attention.sliding_window", mp.window, p.window),
            ("rope.dimension_count", mp.rope_dim, p.rope_dim),
            ("expert_count", mp.n_expert, p.n_expert),
            ("expert_used_count", mp.n_used, p.n_used),
        ] {
            if a != b {
                bail!("the MTP file's {what} is {a}, the model's {b}: it belongs to another model");
            }
        }
        let key = |k: &str| format!("deepseek4.{k}");
        let ratio = f
            .get_i64_array(&key("attention.compress_ratios"))
            .ok()
            .and_then(|v| v.get(fl).copied())
            .unwrap_or(0);
        if ratio != 0 {
            bail!("the MTP block's compress ratio is {ratio}; only 0 (sliding window only) is supported");
        }
        let clamp = |k: &str| -> f32 {
            f.get_f64_array(&key(k))
                .ok()
                .and_then(|v| v.get(fl).copied())
                .or_else(|| f.get_f64(&key(k)).ok())
                .unwrap_or(0.0) as f32
        };
        let src = LayerSrc {
            f,
            w,
            wpre: MTP_PREFIX,
        };
        let l = p.n_layer;
        let layer = load_layer(&src, p, l, fl, fl, 0).context("the MTP block")?;
        // (the device path's buffers are sized by the main layers' expert widths)
        let width = |l: &Layer| {
            (
                l.gate_exps.r.dims[1],
                l.shexp.as_ref().map(|s| s.0.r.dims[1]),
            )
        };
        if let Some(main) = self.layers.first().filter(|m| width(m) != width(&layer)) {
            bail!(
                "the MTP block's expert / shared expert widths {:?} differ from the model's {:?}",
                width(&layer),
                width(main)
            );
        }
        let eh_proj = src.g(&nx("eh_proj.weight"))?;
        check_dims(&eh_proj, &nx("eh_proj.weight"), &[2 * p.d, p.d])?;
        let norm = |s: &str| -> Result<HostF32> {
            let v = src.h(&nx(s))?;
            if v.len() != p.d {
                bail!("{}: {} values, expected {}", nx(s), v.len(), p.d);
            }
            Ok(v)
        };
        let head_norm = if f.tensor(&nx("shared_head_norm.weight")).is_some() {
            norm("shared_head_norm.weight")?
        } else {
            self.out_norm.clone()
        };
        let hc_fn = src.g("output_hc_fn.weight")?;
        check_dims(&hc_fn, "output_hc_fn.weight", &[p.hc * p.d, p.hc])?;
        let (hs, hb) = (
            src.h("output_hc_scale.weight")?,
            src.h("output_hc_base.weight")?,
        );
        if hs.is_empty() || hb.len() != p.hc {
            bail!(
                "the MTP file's output_hc_scale / output_hc_base: {} / {} values, expected 1 / {}",
                hs.len(),
                hb.len(),
                p.hc
            );
        }
        let mtp = Mtp {
            layer,
            eh_proj,
            enorm: norm("enorm.weight")?,
            hnorm: norm("hnorm.weight")?,
            head_norm,
            hc_head: (hc_fn, hs, hb),
        };
        self.p.ratios.push(0);
        let (ce, cs) = (clamp("swiglu_clamp_exp"), clamp("swiglu_clamp_shexp"));
        self.p.clamp_exp.push(ce);
        self.p.clamp_shexp.push(cs);
        self.mtp = Some(mtp);
        gpu::GpuPath::attach_mtp(self).context("the MTP block on the device")
    }

    /// out[n, m] = W x for `n` rows of `k` values (W given as a view: [k, m]).
    fn mm(&self, w: TensorRef, x: &[f32]) -> Result<Vec<f32>> {
        let (k, m) = (w.dims[0] as usize, w.dims[1] as usize);
        let n = x.len() / k.max(1);
        if n == 0 {
            return Ok(Vec::new());
        }
        let mut io = self.io.borrow_mut();
        let [xs, ys] = &mut *io;
        let xin = reuse(&self.dev, xs, k * n)?;
        xin.upload_f32(x)?;
        let out = reuse(&self.dev, ys, m * n)?;
        let (xr, yr) = (
            xin.view([k as u64, n as u64, 1, 1]),
            out.view([m as u64, n as u64, 1, 1]),
        );
        self.dev
            .op(ops::MATMUL, OpParams::default(), &[w, xr, yr])?;
        self.dev.sync()?;
        out.download_f32(m * n)
    }

    fn lin(&self, w: &Tensor, x: &[f32]) -> Result<Vec<f32>> {
        let r = TensorRef {
            dims: [w.r.dims[0], w.r.dims[1], 1, 1],
            ..w.r
        };
        self.mm(r, x)
    }

    /// The [k, m] slice of expert `e` of a stacked [k, m, E] tensor.
    fn expert_view(w: &Tensor, e: usize) -> TensorRef {
        let per = w.bytes / w.r.dims[2].max(1);
        TensorRef {
            offset: w.r.offset + per * e as u64,
            dims: [w.r.dims[0], w.r.dims[1], 1, 1],
            ..w.r
        }
    }

    /// One mHC site: streams [T, hc, d] -> (block inputs [T, d], weights per token).
    fn hc_pre(
        &self,
        site: &(Arc<Tensor>, HostF32, HostF32),
        streams: &[f32],
    ) -> Result<(Vec<f32>, Vec<math::HcWeights>)> {
        let (d, hc) = (self.p.d, self.p.hc);
        let mut normed = streams.to_vec();
        math::rms_norm(&mut normed, hc * d, None, self.p.eps);
        let mix = self.lin(&site.0, &normed)?;
        let nm = 2 * hc + hc * hc;
        let mut x = vec![0.0; streams.len() / hc];
        let mut ws = Vec::new();
        for (t, s) in streams.chunks_exact(hc * d).enumerate() {
            let w = math::hc_weights(
                &mix[t * nm..(t + 1) * nm],
                &site.1,
                &site.2,
                hc,
                self.p.hc_iters,
                self.p.hc_eps,
            );
            math::hc_collapse(s, &w.pre, d, &mut x[t * d..(t + 1) * d]);
            ws.push(w);
        }
        Ok((x, ws))
    }

    /// Runs `n` consecutive tokens of one slot, starting at position `p0`; returns the
    /// final hidden rows (after the HC head and output norm) of the tokens in `keep`.
    fn run_chunk(&mut self, slot: usize, tokens: &[u32], p0: usize) -> Result<Vec<f32>> {
        let p = self.p.clone();
        let (d, hc, n) = (p.d, p.hc, tokens.len());
        // Embedding, copied into every stream.
        let ids = self.dev.i32(n)?;
        ids.upload_i32(&tokens.iter().map(|&t| t as i32).collect::<Vec<_>>())?;
        let emb = self.dev.f32([d as u64, n as u64, 1, 1])?;
        self.dev.op(
            ops::GET_ROWS,
            OpParams::default(),
            &[self.embd.r, ids.r, emb.r],
        )?;
        self.dev.sync()?;
        let emb = emb.download_f32(n * d)?;
        let mut streams = vec![0.0f32; n * hc * d];
        for t in 0..n {
            for s in 0..hc {
                streams[(t * hc + s) * d..(t * hc + s + 1) * d]
                    .copy_from_slice(&emb[t * d..(t + 1) * d]);
            }
        }
        for l in 0..p.n_layer {
            let (mut x, ws) = self.hc_pre(&self.layers[l].hc_attn, &streams)?;
            math::rms_norm(&mut x, d, Some(&self.layers[l].attn_norm), p.eps);
            let a = self.attention(l, slot, &x, p0)?;
            for t in 0..n {
                math::hc_expand(
                    &mut streams[t * hc * d..(t + 1) * hc * d],
                    &a[t * d..(t + 1) * d],
                    &ws[t],
                    d,
                );
            }
            let (mut x, ws) = self.hc_pre(&self.layers[l].hc_ffn, &streams)?;
            math::rms_norm(&mut x, d, Some(&self.layers[l].ffn_norm), p.eps);
            let m = self.moe(l, &x, tokens)?;
            for t in 0..n {
                math::hc_expand(
                    &mut streams[t * hc * d..(t + 1) * hc * d],
                    &m[t * d..(t + 1) * d],
                    &ws[t],
                    d,
                );
            }
        }
        // Output head: collapse the streams with their own sigmoid weights, then norm.
        let mut normed = streams.clone();
        math::rms_norm(&mut normed, hc * d, None, p.eps);
        let mix = self.lin(&self.hc_head.0, &normed)?;
        let mut out = vec![0.0; n * d];
        for t in 0..n {
            let pre: Vec<f32> = (0..hc)
                .map(|i| {
                    math::sigmoid(mix[t * hc + i] * self.hc_head.1[0] + self.hc_head.2[i])
                        + p.hc_eps
                })
                .collect();
            math::hc_collapse(
                &streams[t * hc * d..(t + 1) * hc * d],
                &pre,
                d,
                &mut out[t * d..(t + 1) * d],
            );
        }
        math::rms_norm(&mut out, d, Some(&self.out_norm), p.eps);
        Ok(out)
    }

    fn attention(&mut self, l: usize, slot: usize, x: &[f32], p0: usize) -> Result<Vec<f32>> {
        let p = &self.p;
        let (hd, nh, n) = (p.head_dim, p.n_head, x.len() / p.d);
        let lay = &self.layers[l];
        let rope = if p.ratios[l] == 0 {
            &self.rope_main
        } else {
            &self.rope_comp
        };
        let mut q_res = self.lin(&lay.q_a, x)?;
        math::rms_norm(&mut q_res, p.q_lora, Some(&lay.q_a_norm), p.eps);
        let mut q = self.lin(&lay.q_b, &q_res)?;
        math::rms_norm(&mut q, hd, None, p.eps);
        let mut kv = self.lin(&lay.kv, x)?;
        math::rms_norm(&mut kv, hd, Some(&lay.kv_norm), p.eps);
        for t in 0..n {
            let pos = (p0 + t) as u32;
            rope.apply(&mut q[t * nh * hd..(t + 1) * nh * hd], hd, pos, false);
            rope.apply(&mut kv[t * hd..(t + 1) * hd], hd, pos, false);
        }
        // Compressed rows (emitted as their windows close) and, for CSA, the indexer's.
        if let Some(c) = &lay.comp {
            let (ck, cg) = (self.lin(&c.kv, x)?, self.lin(&c.gate, x)?);
            let st = self.slots[slot].layers[l]
                .comp
                .as_mut()
                .ok_or_else(|| anyhow!("layer {l}: no compressor state"))?;
            st.push(c, &ck, &cg, &self.rope_comp, p.eps);
        }
        let mut selected: Option<Vec<Vec<usize>>> = None;
        if let Some(ix) = &lay.indexer {
            let (ik, ig) = (self.lin(&ix.comp.kv, x)?, self.lin(&ix.comp.gate, x)?);
            let mut iq = self.lin(&ix.q_b, &q_res)?;
            let w = self.lin(&ix.proj, x)?;
            let st = self.slots[slot].layers[l]
                .idx
                .as_mut()
                .ok_or_else(|| anyhow!("layer {l}: no indexer state"))?;
            st.push(&ix.comp, &ik, &ig, &self.rope_comp, p.eps);
            let st = &*st;
            let (ih, id) = (p.idx_heads, p.idx_dim);
            let (sm, ws) = ((id as f32).powf(-0.5), (ih as f32).powf(-0.5));
            let rows = &st.rows;
            let mut sel = Vec::with_capacity(n);
            for t in 0..n {
                let pos = p0 + t;
                self.rope_comp.apply(
                    &mut iq[t * ih * id..(t + 1) * ih * id],
                    id,
                    pos as u32,
                    false,
                );
                let visible = ((pos + 1) / ix.comp.ratio).min(rows.len() / id);
                let scores: Vec<f32> = (0..visible)
                    .map(|s| {
                        let k = &rows[s * id..(s + 1) * id];
                        (0..ih)
                            .map(|h| {
                                let qh = &iq[(t * ih + h) * id..(t * ih + h + 1) * id];
                                let dot: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                                dot.max(0.0) * sm * (w[t * ih + h] * ws)
                            })
                            .sum()
                    })
                    .collect();
                sel.push(math::top_k(&scores, p.idx_topk.min(visible)));
            }
            selected = Some(sel);
        }
        // Sliding window: previous rows of this slot, then this chunk's.
        let st = &self.slots[slot].layers[l];
        let prior = st.window.len() / hd;
        let mut win = st.window.clone();
        win.extend_from_slice(&kv);
        let scale = (hd as f32).powf(-0.5);
        let mut out = vec![0.0; n * nh * hd];
        for t in 0..n {
            let pos = p0 + t;
            let last = prior + t;
            let first = (last + 1).saturating_sub(p.window);
            let mut keys: Vec<&[f32]> =
                (first..=last).map(|r| &win[r * hd..(r + 1) * hd]).collect();
            if let Some(cst) = st.comp.as_ref() {
                let c = &cst.rows;
                match &selected {
                    Some(sel) => keys.extend(sel[t].iter().map(|&s| &c[s * hd..(s + 1) * hd])),
                    None => {
                        let visible = ((pos + 1) / p.ratios[l]).min(c.len() / hd);
                        keys.extend((0..visible).map(|s| &c[s * hd..(s + 1) * hd]));
                    }
                }
            }
            for h in 0..nh {
                let o = (t * nh + h) * hd;
                math::attend(
                    &q[o..o + hd],
                    &keys,
                    scale,
                    lay.sinks[h],
                    &mut out[o..o + hd],
                );
            }
            rope.apply(
                &mut out[t * nh * hd..(t + 1) * nh * hd],
                hd,
                pos as u32,
                true,
            );
        }
        let keep = (prior + n).min(p.window.saturating_sub(1));
        let st = &mut self.slots[slot].layers[l];
        st.window = win[(prior + n - keep) * hd..].to_vec();
        // Grouped output projection: each group of heads through its own block of rows.
        let (gw, gr) = (nh * hd / p.o_groups, p.o_lora);
        let per_group = lay.out_a.bytes / p.o_groups as u64;
        let mut mid = vec![0.0; n * p.o_groups * gr];
        for g in 0..p.o_groups {
            let xs: Vec<f32> = (0..n)
                .flat_map(|t| {
                    out[t * nh * hd + g * gw..t * nh * hd + (g + 1) * gw]
                        .iter()
                        .copied()
                })
                .collect();
            let view = TensorRef {
                offset: lay.out_a.r.offset + per_group * g as u64,
                dims: [gw as u64, gr as u64, 1, 1],
                ..lay.out_a.r
            };
            let y = self.mm(view, &xs)?;
            for t in 0..n {
                mid[t * p.o_groups * gr + g * gr..t * p.o_groups * gr + (g + 1) * gr]
                    .copy_from_slice(&y[t * gr..(t + 1) * gr]);
            }
        }
        self.lin(&lay.out_b, &mid)
    }

    fn moe(&self, l: usize, x: &[f32], tokens: &[u32]) -> Result<Vec<f32>> {
        let p = &self.p;
        let (d, n, k) = (p.d, tokens.len(), p.n_used);
        let lay = &self.layers[l];
        let logits = self.lin(&lay.router, x)?;
        let e_n = p.n_expert;
        // Routes per expert: (token, weight).
        let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); e_n];
        for t in 0..n {
            let scores: Vec<f32> = logits[t * e_n..(t + 1) * e_n]
                .iter()
                .map(|&v| {
                    if p.gating == GATING_SIGMOID {
                        math::sigmoid(v)
                    } else {
                        math::softplus(v).sqrt()
                    }
                })
                .collect();
            let ids: Vec<usize> = match &lay.tid2eid {
                Some(tab) => {
                    let tok = tokens[t] as usize;
                    let row = tab
                        .get(tok * k..(tok + 1) * k)
                        .ok_or_else(|| anyhow!("token {tok} outside the hash table"))?;
                    row.iter().map(|&e| e as usize).collect()
                }
                None => {
                    let biased: Vec<f32> = match &lay.bias {
                        Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                        None => scores.clone(),
                    };
                    math::top_k(&biased, k)
                }
            };
            let mut w: Vec<f32> = ids.iter().map(|&e| scores[e]).collect();
            if p.norm_topk {
                let s: f32 = w.iter().sum::<f32>() + 1e-20;
                w.iter_mut().for_each(|v| *v /= s);
            }
            for (e, wt) in ids.into_iter().zip(w) {
                routes[e].push((t, wt * p.routed_scale));
            }
        }
        let mut out = vec![0.0f32; n * d];
        let ffn =
            |g: TensorRef, u: TensorRef, dn: TensorRef, xs: &[f32], lim: f32| -> Result<Vec<f32>> {
                let (gv, uv) = (self.mm(g, xs)?, self.mm(u, xs)?);
                let act: Vec<f32> = gv
                    .iter()
                    .zip(&uv)
                    .map(|(&a, &b)| {
                        let (a, b) = if lim > 0.0 {
                            (a.min(lim), b.clamp(-lim, lim))
                        } else {
                            (a, b)
                        };
                        math::silu(a) * b
                    })
                    .collect();
                self.mm(dn, &act)
            };
        for (e, r) in routes.iter().enumerate() {
            if r.is_empty() {
                continue;
            }
            let xs: Vec<f32> = r
                .iter()
                .flat_map(|&(t, _)| x[t * d..(t + 1) * d].iter().copied())
                .collect();
            let y = ffn(
                Self::expert_view(&lay.gate_exps, e),
                Self::expert_view(&lay.up_exps, e),
                Self::expert_view(&lay.down_exps, e),
                &xs,
                p.clamp_exp[l],
            )?;
            for (i, &(t, w)) in r.iter().enumerate() {
                out[t * d..(t + 1) * d]
                    .iter_mut()
                    .zip(&y[i * d..(i + 1) * d])
                    .for_each(|(o, v)| *o += w * v);
            }
        }
        if let Some((g, u, dn)) = &lay.shexp {
            let v = |t: &Tensor| TensorRef {
                dims: [t.r.dims[0], t.r.dims[1], 1, 1],
                ..t.r
            };
            let y = ffn(v(g), v(u), v(dn), x, p.clamp_shexp[l])?;
            out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
        }
        Ok(out)
    }
}

/// Where a layer's tensors come from: the file for small tensors and presence checks,
/// the uploaded weights (their names prefixed by `wpre`) for the rest.
struct LayerSrc<'a> {
    f: &'a GgufFile,
    w: &'a Weights,
    wpre: &'a str,
}

impl LayerSrc<'_> {
    fn g(&self, name: &str) -> Result<Arc<Tensor>> {
        self.w.get(&format!("{}{name}", self.wpre))
    }
    fn h(&self, name: &str) -> Result<HostF32> {
        host_f32(self.f, name, self.w, &format!("{}{name}", self.wpre))
    }
}

/// Layer `l` (hash-routed if below `p.n_hash`) of attention `ratio`: weights uploaded as
/// `blk.{wl}.*`, small tensors read from the file's `blk.{fl}.*`.
fn load_layer(
    src: &LayerSrc,
    p: &Ds4Params,
    l: usize,
    wl: usize,
    fl: usize,
    ratio: usize,
) -> Result<Layer> {
    let g = |n: &str| src.g(n);
    let h = |n: &str| src.h(n);
    let hd = p.head_dim;
    let b = |s: &str| format!("blk.{wl}.{s}");
    // File reads (small f32 tensors, presence checks) go to the source layer.
    let bf = |s: &str| format!("blk.{fl}.{s}");
    let hc_site = |s: &str| -> Result<(Arc<Tensor>, HostF32, HostF32)> {
        Ok((
            g(&b(&format!("hc_{s}_fn.weight")))?,
            h(&bf(&format!("hc_{s}_scale.weight")))?,
            h(&bf(&format!("hc_{s}_base.weight")))?,
        ))
    };
    let comp_w = |pre: &str, dim: usize, overlap: bool| -> Result<CompWeights> {
        let kv = g(&b(&format!("{pre}_kv.weight")))?;
        let width = if overlap { 2 * dim } else { dim };
        check_dims(&kv, &b(&format!("{pre}_kv.weight")), &[p.d, width])?;
        let ape = h(&bf(&format!("{pre}_ape.weight")))?;
        if ape.len() != ratio * width {
            bail!(
                "{}: {} values, expected ratio {ratio} x {width}",
                b(&format!("{pre}_ape.weight")),
                ape.len()
            );
        }
        Ok(CompWeights {
            ratio,
            ape,
            norm: h(&bf(&format!("{pre}_norm.weight")))?,
            kv,
            gate: g(&b(&format!("{pre}_gate.weight")))?,
            overlap,
            dim,
        })
    };
    // A compressed layer with an indexer is CSA (overlapping windows); without, HCA.
    let is_csa = ratio > 0 && src.f.tensor(&bf("indexer.attn_q_b.weight")).is_some();
    let comp = if ratio > 0 {
        Some(comp_w("attn_compressor", hd, is_csa)?)
    } else {
        None
    };
    let indexer = if is_csa {
        if p.idx_heads == 0 || p.idx_dim == 0 || p.idx_dim < p.rope_dim {
            bail!(
                "layer {l}: indexer of {} heads x {} dims cannot carry rope width {}",
                p.idx_heads,
                p.idx_dim,
                p.rope_dim
            );
        }
        Some(Indexer {
            comp: comp_w("indexer_compressor", p.idx_dim, true)?,
            q_b: g(&b("indexer.attn_q_b.weight"))?,
            proj: g(&b("indexer.proj.weight"))?,
        })
    } else {
        None
    };
    let is_hash = l < p.n_hash;
    let tid2eid = if is_hash {
        let name = bf("ffn_gate_tid2eid.weight");
        let info = src
            .f
            .tensor(&name)
            .ok_or_else(|| anyhow!("hash layer {l} has no {name}"))?;
        if info.type_id != types::I32 || info.dims[0] as usize != p.n_used {
            bail!(
                "{name}: expected I32 [{}, vocab], found type {} dims {:?}",
                p.n_used,
                info.type_id,
                info.dims
            );
        }
        let v: Vec<i32> = src
            .f
            .tensor_data(info)
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if let Some(bad) = v.iter().find(|&&e| e < 0 || e as usize >= p.n_expert) {
            bail!("{name}: expert id {bad} outside 0..{}", p.n_expert);
        }
        Some(v)
    } else {
        None
    };
    let bias = if !is_hash && src.f.tensor(&bf("exp_probs_b.bias")).is_some() {
        Some(h(&bf("exp_probs_b.bias"))?)
    } else {
        None
    };
    let shexp = if src.f.tensor(&bf("ffn_gate_shexp.weight")).is_some() {
        Some((
            g(&b("ffn_gate_shexp.weight"))?,
            g(&b("ffn_up_shexp.weight"))?,
            g(&b("ffn_down_shexp.weight"))?,
        ))
    } else {
        None
    };
    let q_b = g(&b("attn_q_b.weight"))?;
    check_dims(&q_b, &b("attn_q_b.weight"), &[p.q_lora, p.n_head * hd])?;
    let out_a = g(&b("attn_output_a.weight"))?;
    check_dims(
        &out_a,
        &b("attn_output_a.weight"),
        &[p.n_head * hd / p.o_groups, p.o_groups * p.o_lora],
    )?;
    let gate_exps = g(&b("ffn_gate_exps.weight"))?;
    if gate_exps.r.dims[2] as usize != p.n_expert {
        bail!(
            "{}: {} experts, metadata says {}",
            b("ffn_gate_exps.weight"),
            gate_exps.r.dims[2],
            p.n_expert
        );
    }
    let layer = Layer {
        attn_norm: h(&bf("attn_norm.weight"))?,
        ffn_norm: h(&bf("ffn_norm.weight"))?,
        hc_attn: hc_site("attn")?,
        hc_ffn: hc_site("ffn")?,
        q_a: g(&b("attn_q_a.weight"))?,
        q_a_norm: h(&bf("attn_q_a_norm.weight"))?,
        q_b,
        kv: g(&b("attn_kv.weight"))?,
        kv_norm: h(&bf("attn_kv_a_norm.weight"))?,
        out_a,
        out_b: g(&b("attn_output_b.weight"))?,
        sinks: h(&bf("attn_sinks.weight"))?,
        comp,
        indexer,
        router: g(&b("ffn_gate_inp.weight"))?,
        bias,
        tid2eid,
        gate_exps,
        up_exps: g(&b("ffn_up_exps.weight"))?,
        down_exps: g(&b("ffn_down_exps.weight"))?,
        shexp,
    };
    check_layer(p, l, &layer)?;
    Ok(layer)
}

/// Sizes the per-token glue indexes by; a file that disagrees is refused here rather
/// than failing mid-forward.
fn check_layer(p: &Ds4Params, l: usize, y: &Layer) -> Result<()> {
    let (d, hd, hc) = (p.d, p.head_dim, p.hc);
    let nmix = 2 * hc + hc * hc;
    let len = |what: &str, v: &[f32], want: usize| -> Result<()> {
        if v.len() != want {
            bail!("blk.{l}.{what}: {} values, expected {want}", v.len());
        }
        Ok(())
    };
    let dims =
        |what: &str, t: &Tensor, want: &[usize]| check_dims(t, &format!("blk.{l}.{what}"), want);
    len("attn_norm", &y.attn_norm, d)?;
    len("ffn_norm", &y.ffn_norm, d)?;
    len("attn_q_a_norm", &y.q_a_norm, p.q_lora)?;
    len("attn_kv_a_norm", &y.kv_norm, hd)?;
    len("attn_sinks", &y.sinks, p.n_head)?;
    for (site, (fnw, scale, base)) in [("attn", &y.hc_attn), ("ffn", &y.hc_ffn)] {
        dims(&format!("hc_{site}_fn"), fnw, &[hc * d, nmix])?;
        len(&format!("hc_{site}_scale"), scale, 3)?;
        len(&format!("hc_{site}_base"), base, nmix)?;
    }
    dims("attn_q_a", &y.q_a, &[d, p.q_lora])?;
    dims("attn_kv", &y.kv, &[d, hd])?;
    dims("attn_output_b", &y.out_b, &[p.o_groups * p.o_lora, d])?;
    dims("ffn_gate_inp", &y.router, &[d, p.n_expert])?;
    if let Some(b) = &y.bias {
        len("exp_probs_b", b, p.n_expert)?;
    }
    if let Some(t) = &y.tid2eid {
        if t.len() % p.n_used != 0 {
            bail!(
                "blk.{l}.ffn_gate_tid2eid: {} ids are not rows of {}",
                t.len(),
                p.n_used
            );
        }
    }
    let ff = y.gate_exps.r.dims[1] as usize;
    dims("ffn_gate_exps", &y.gate_exps, &[d, ff, p.n_expert])?;
    dims("ffn_up_exps", &y.up_exps, &[d, ff, p.n_expert])?;
    dims("ffn_down_exps", &y.down_exps, &[ff, d, p.n_expert])?;
    if let Some((g, u, dn)) = &y.shexp {
        let sf = g.r.dims[1] as usize;
        dims("ffn_gate_shexp", g, &[d, sf])?;
        dims("ffn_up_shexp", u, &[d, sf])?;
        dims("ffn_down_shexp", dn, &[sf, d])?;
    }
    for c in [y.comp.as_ref(), y.indexer.as_ref().map(|i| &i.comp)]
        .into_iter()
        .flatten()
    {
        len("compressor norm", &c.norm, c.dim)?;
        dims(
            "compressor gate",
            &c.gate,
            &[d, if c.overlap { 2 * c.dim } else { c.dim }],
        )?;
    }
    if let Some(ix) = &y.indexer {
        dims(
            "indexer.attn_q_b",
            &ix.q_b,
            &[p.q_lora, p.idx_heads * p.idx_dim],
        )?;
        dims("indexer.proj", &ix.proj, &[d, p.idx_heads])?;
    }
    Ok(())
}

/// Per-layer (compressor?, indexer?) shapes for the state.
fn layers_shape(layers: &[Layer]) -> Vec<(state::Shape, state::Shape)> {
    layers
        .iter()
        .map(|l| {
            (
                l.comp.as_ref().map(|c| (c.ratio, c.dim, c.overlap)),
                l.indexer
                    .as_ref()
                    .map(|i| (i.comp.ratio, i.comp.dim, i.comp.overlap)),
            )
        })
        .collect()
}

impl Compressor {
    fn push(&mut self, w: &CompWeights, kv: &[f32], gate: &[f32], rope: &Rope, eps: f32) {
        self.feed(kv, gate, &w.ape, |row, pos| {
            math::rms_norm(row, w.dim, Some(&w.norm), eps);
            rope.apply(row, w.dim, pos, false);
        });
    }
}

impl Deepseek4 {
    /// Puts `slot` back at `pos`, before the positions it holds, where its device state
    /// allows: into its last drafted pass (the rejected drafts dropped), or to its
    /// prompt mark (the end of an earlier prompt, see `keep_prefix`). Ok(false) where
    /// neither does; a failed copy starts the slot over.
    fn go_back(&mut self, slot: usize, pos: usize) -> Result<bool> {
        let Some(g) = self.gpu.as_ref().filter(|_| pos < self.slots[slot].n_past) else {
            return Ok(false);
        };
        let done = if g.can_return(slot, pos) {
            gpu::GpuPath::rewind(self, slot, pos)
        } else if g.mark_pos(slot) == Some(pos) {
            gpu::GpuPath::back_to_mark(self, slot).map(|_| ())
        } else {
            return Ok(false);
        };
        if let Err(e) = done {
            self.slots[slot].reset();
            if let Some(g) = self.gpu.as_mut() {
                g.forget_mark(slot);
            }
            return Err(e);
        }
        self.slots[slot].n_past = pos;
        Ok(true)
    }
}

impl CausalLm for Deepseek4 {
    fn arch(&self) -> &str {
        "deepseek4"
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn n_slots(&self) -> usize {
        self.slots.len()
    }
    fn n_vocab(&self) -> usize {
        self.p.n_vocab
    }
    fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// The whole cached sequence, where the prompt extends it (it continues from there
    /// as a prompt's next chunk does); else, on the device-resident forward, the slot's
    /// prompt mark (its rings copied at the end of its latest prefill chunk) where the
    /// prompt shares the positions before it: the same prompt again, a chat whose
    /// template rewrote the last answer. The compressed rows and the compressors'
    /// partial windows cannot be rewound to any other position (except into a drafted
    /// pass, which the held tokens end inside of).
    fn keep_prefix(&self, slot: u32, cached: usize, matching: usize) -> usize {
        if matching == cached {
            return cached;
        }
        self.gpu
            .as_ref()
            .and_then(|g| g.mark_pos(slot as usize))
            .filter(|&p| p <= matching)
            .unwrap_or(0)
    }

    /// The logits of the last token before the slot's prompt mark, where the mark is at
    /// `len` and came with them (the chunk that ended there wanted its last row).
    fn replay_logits(&self, slot: u32, len: usize) -> Option<&[f32]> {
        self.gpu.as_ref()?.mark_logits(slot as usize, len)
    }

    /// Drafts on the device path only (its caches are positional; the host glue's
    /// compressor buffers are not), as many as the smallest ring leaves room for.
    fn max_draft(&self) -> usize {
        self.gpu
            .as_ref()
            .map_or(0, |g| g.pass_cap.saturating_sub(1))
    }

    fn has_drafter(&self) -> bool {
        self.mtp.is_some()
    }

    fn draft_logits(
        &mut self,
        slot: u32,
        token: u32,
        pos: usize,
        k: usize,
        p_min: f32,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        if self.mtp.is_none() {
            return Ok(None);
        }
        let n = self.slots.len();
        let n_past = self
            .slots
            .get(slot as usize)
            .ok_or_else(|| anyhow!("slot {slot} outside 0..{n}"))?
            .n_past;
        // The slot holds the positions before `pos`, or more: inside its last drafted
        // pass, whose rejected rows (the block's window's too) go back first, as the
        // next pass would put them back, so the chain sees the accepted ones only; or
        // past its prompt mark, for a prompt sent again (its first token from the
        // mark's logits), as its first pass would go.
        if pos != n_past && !self.go_back(slot as usize, pos)? {
            bail!("slot {slot} holds {n_past} positions; a draft starts right after them, not at {pos}");
        }
        if token as usize >= self.p.n_vocab {
            bail!(
                "token id {token} outside the vocabulary of {}",
                self.p.n_vocab
            );
        }
        gpu::GpuPath::mtp_draft(self, slot as usize, token, (pos, k, p_min)).map(Some)
    }

    fn seek(&mut self, slot: u32, pos: usize) -> Result<()> {
        if self.gpu.is_none() {
            bail!("deepseek4: seeking needs the device-resident forward (the host glue keeps its compressor state on the host)");
        }
        if pos >= self.n_ctx {
            bail!("position {pos} is outside the context of {}", self.n_ctx);
        }
        let n = self.slots.len();
        let st = self
            .slots
            .get_mut(slot as usize)
            .ok_or_else(|| anyhow!("slot {slot} outside 0..{n}"))?;
        st.reset();
        st.n_past = pos;
        if let Some(g) = self.gpu.as_mut() {
            g.forget(slot as usize);
            g.forget_mark(slot as usize);
            g.mtp_forget(slot as usize);
        }
        // The device caches as a filled context's (`MOE_DS4_SEEK_ZEROS=1`: left as they
        // are, zeros where nothing ran; the benchmark's tables before 2026-12-04 14:00).
        if std::env::var_os("MOE_DS4_SEEK_ZEROS").is_none_or(|v| v != "1") {
            gpu::GpuPath::fill(self, slot as usize, pos)
                .context("filling the caches for the seek")?;
        }
        Ok(())
    }

    fn step_traffic(&self, pos: usize) -> Option<crate::model::StepTraffic> {
        let p = &self.p;
        let mut t = crate::model::StepTraffic::default();
        let add = |t: &mut crate::model::StepTraffic, w: &Tensor, frac: (u64, u64)| {
            t.weight_bytes += w.bytes * frac.0 / frac.1;
            t.weight_params += w.r.numel() * frac.0 / frac.1;
        };
        let all = (1, 1);
        // One embedding row.
        add(&mut t, &self.embd, (1, p.n_vocab as u64));
        for (l, y) in self.layers.iter().enumerate() {
            for w in [
                &y.hc_attn.0,
                &y.hc_ffn.0,
                &y.q_a,
                &y.q_b,
                &y.kv,
                &y.out_a,
                &y.out_b,
                &y.router,
            ] {
                add(&mut t, w, all);
            }
            for c in [y.comp.as_ref(), y.indexer.as_ref().map(|i| &i.comp)]
                .into_iter()
                .flatten()
            {
                add(&mut t, &c.kv, all);
                add(&mut t, &c.gate, all);
            }
            if let Some(ix) = &y.indexer {
                add(&mut t, &ix.q_b, all);
                add(&mut t, &ix.proj, all);
            }
            if let Some((g, u, d)) = &y.shexp {
                for w in [g, u, d] {
                    add(&mut t, w, all);
                }
            }
            for w in [&y.gate_exps, &y.up_exps, &y.down_exps] {
                let before = t.weight_bytes;
                add(&mut t, w, (p.n_used as u64, p.n_expert as u64));
                t.routed_bytes += t.weight_bytes - before;
            }
            // Caches: the window, then compressed rows (selected or all visible) and
            // the indexer's keys.
            let hd = p.head_dim as u64;
            let mut rows = (pos + 1).min(p.window) as u64;
            if let Some(visible) = (pos + 1).checked_div(p.ratios[l]) {
                let visible = visible as u64;
                if y.indexer.is_some() {
                    rows += visible.min(p.idx_topk as u64);
                    t.cache_bytes += 4 * visible * p.idx_dim as u64;
                } else {
                    rows += visible;
                }
            }
            t.cache_bytes += 4 * rows * hd;
        }
        add(&mut t, &self.hc_head.0, all);
        add(&mut t, &self.output, all);
        Some(t)
    }

    fn forward(&mut self, batch: &[BatchEntry]) -> Result<Vec<Vec<f32>>> {
        let mut rows = Vec::new();
        let mut i = 0;
        while i < batch.len() {
            // A run of one slot's consecutive positions is one chunk.
            let (slot, p0) = (batch[i].slot as usize, batch[i].pos as usize);
            let mut j = i + 1;
            while j < batch.len()
                && batch[j].slot as usize == slot
                && batch[j].pos as usize == p0 + (j - i)
            {
                j += 1;
            }
            let n_slots = self.slots.len();
            let st = self
                .slots
                .get_mut(slot)
                .ok_or_else(|| anyhow!("slot {slot} outside 0..{n_slots}"))?;
            let n_past = st.n_past;
            if p0 == 0 {
                st.reset();
                if let Some(g) = self.gpu.as_mut() {
                    g.forget(slot);
                    g.forget_mark(slot);
                }
            } else if p0 != n_past && !self.go_back(slot, p0)? {
                bail!("deepseek4 slot {slot} holds {n_past} positions; a chunk at {p0} would need a rewind, which the compressed state can do only into a pass whose later tokens were drafts");
            }
            // Drafts end the run, after its sure token (see BatchEntry::draft).
            let drafted = match batch[i..j].iter().position(|e| e.draft) {
                None => false,
                Some(f) if f > 0 && batch[i + f..j].iter().all(|e| e.draft) => true,
                Some(_) => bail!(
                    "slot {slot}: drafted tokens must end a slot's run of a batch, after one that is not drafted"
                ),
            };
            if drafted && j - i > self.max_draft() + 1 {
                bail!(
                    "slot {slot}: a pass of {} tokens carries more than the {} drafts this model can drop",
                    j - i,
                    self.max_draft()
                );
            }
            if p0 + (j - i) > self.n_ctx {
                bail!(
                    "positions up to {} exceed the context of {}",
                    p0 + (j - i),
                    self.n_ctx
                );
            }
            let tokens: Vec<u32> = batch[i..j].iter().map(|e| e.token).collect();
            if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.p.n_vocab) {
                bail!(
                    "token id {bad} outside the vocabulary of {}",
                    self.p.n_vocab
                );
            }
            let want: Vec<usize> = (i..j)
                .filter(|&e| batch[e].want_logits)
                .map(|e| e - i)
                .collect();
            if self.gpu.is_some() {
                let out = gpu::GpuPath::checkpoint(self, slot, p0, tokens.len(), drafted)
                    .and_then(|()| gpu::GpuPath::run(self, slot, &tokens, p0, &want, drafted))
                    .inspect_err(|_| {
                        self.slots[slot].reset();
                        if let Some(g) = self.gpu.as_mut() {
                            g.forget(slot);
                            g.forget_mark(slot);
                        }
                    })?;
                self.slots[slot].n_past = p0 + tokens.len();
                // A prefill chunk's end may be a prompt's: mark it (see `keep_prefix`),
                // with the last token's logits where the chunk wanted them.
                if !drafted && tokens.len() > 1 {
                    let last = (want.last() == Some(&(tokens.len() - 1)))
                        .then(|| out.last().cloned())
                        .flatten();
                    if let Err(e) = gpu::GpuPath::mark(self, slot, p0 + tokens.len(), last) {
                        tracing::warn!("slot {slot}: no prompt mark: {e:#}");
                        if let Some(g) = self.gpu.as_mut() {
                            g.forget_mark(slot);
                        }
                    }
                }
                rows.extend(out);
                i = j;
                continue;
            }
            // A failed step leaves some layers advanced: start the slot over.
            let hidden = self
                .run_chunk(slot, &tokens, p0)
                .inspect_err(|_| self.slots[slot].reset())?;
            self.slots[slot].n_past = p0 + tokens.len();
            if !want.is_empty() {
                let d = self.p.d;
                let xs: Vec<f32> = want
                    .iter()
                    .flat_map(|&t| hidden[t * d..(t + 1) * d].iter().copied())
                    .collect();
                let logits = self.lin(&self.output, &xs)?;
                rows.extend(logits.chunks_exact(self.p.n_vocab).map(<[f32]>::to_vec));
            }
            i = j;
        }
        Ok(rows)
    }
}
