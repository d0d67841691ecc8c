//! `moeserve convert`: a DeepSeek-V4 checkpoint directory (config.json + safetensors,
//! as transformers' save_pretrained or the release writes it) -> a `deepseek4` GGUF with
//! the metadata keys and tensor names of real DS4 GGUF files.

pub mod config;
pub mod names;
pub mod source;
pub mod synth;
pub mod tokenizer;

use std::{collections::BTreeMap, path::Path};

use anyhow::{anyhow, bail, Context, Result};
use moe_gguf::{GgufWriter, Value};

pub use config::Ds4Config;
use names::Kind;
use source::Source;

use moe_plugin_api::types::{BF16, F16, F32, I32, MXFP4, Q8_0};

/// The output type of projection matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl OutType {
    pub fn parse(s: &str) -> Result<OutType> {
        Ok(match s {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::Bf16,
            "q8_0" => OutType::Q8_0,
            other => bail!("--type must be f32, f16, bf16 or q8_0, not '{other}'"),
        })
    }
    pub fn type_id(self) -> u32 {
        match self {
            OutType::F32 => F32,
            OutType::F16 => F16,
            OutType::Bf16 => BF16,
            OutType::Q8_0 => Q8_0,
        }
    }
}

/// Encodes rows of f32 values (row length `k`) into a ggml type; the host passes the
/// quant plugins' reference encoders.
pub type Encoder<'a> = &'a dyn Fn(u32, &[f32], usize) -> Result<Vec<u8>>;

pub struct Summary {
    pub tensors: usize,
    pub bytes: u64,
    pub skipped: Vec<String>,
    pub notes: Vec<String>,
}

/// GGUF dims (innermost first) of a row-major checkpoint shape.
fn ggml_dims(shape: &[usize]) -> Vec<u64> {
    shape.iter().rev().map(|&d| d as u64).collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn encode_matrix(
    name: &str,
    shape: &[usize],
    v: &[f32],
    ty: OutType,
    enc: Encoder<'_>,
    notes: &mut Vec<String>,
) -> Result<(u32, Vec<u8>)> {
    let k = *shape.last().unwrap_or(&1);
    let mut t = ty.type_id();
    if t == Q8_0 && !k.is_multiple_of(32) {
        notes.push(format!(
            "{name}: rows of {k} are not a multiple of 32; stored as f16 instead of q8_0"
        ));
        t = F16;
    }
    if t == F32 {
        return Ok((F32, f32_bytes(v)));
    }
    let data = enc(t, v, k).with_context(|| format!("encoding {name}"))?;
    Ok((t, data))
}

/// The deepseek4 metadata keys for `c` (also used by `moeserve synth`).
pub fn metadata(w: &mut GgufWriter, c: &Ds4Config, name: &str) {
    let a = "deepseek4";
    let u = |x: usize| Value::U32(x as u32);
    let f = |x: f64| Value::F32(x as f32);
    let mut kv = |k: &str, v: Value| w.add_kv(&format!("{a}.{k}"), v);
    kv(
        "context_length",
        Value::U32(c.max_pos.min(u32::MAX as u64) as u32),
    );
    kv("block_count", u(c.n_layer));
    kv("embedding_length", u(c.hidden));
    kv("embedding_length_out", u(c.hidden * c.hc_mult));
    kv("feed_forward_length", u(c.moe_ff));
    kv("vocab_size", u(c.vocab));
    kv("attention.head_count", u(c.n_head));
    kv("attention.head_count_kv", u(1));
    kv("attention.key_length", u(c.head_dim));
    kv("attention.value_length", u(c.head_dim));
    kv("attention.q_lora_rank", u(c.q_lora_rank));
    kv("attention.output_group_count", u(c.o_groups));
    kv("attention.output_lora_rank", u(c.o_lora_rank));
    kv("attention.sliding_window", u(c.sliding_window));
    kv("attention.indexer.head_count", u(c.index_heads));
    kv("attention.indexer.key_length", u(c.index_dim));
    kv("attention.indexer.top_k", u(c.index_topk));
    kv(
        "attention.compress_ratios",
        Value::Array(c.compress_ratios.iter().map(|&r| Value::U32(r)).collect()),
    );
    kv(
        "attention.compress_rope_freq_base",
        f(c.compress_rope_theta),
    );
    kv("attention.layer_norm_rms_epsilon", f(c.eps));
    kv("expert_count", u(c.n_expert));
    kv("expert_used_count", u(c.n_expert_used));
    kv("expert_shared_count", u(c.n_shared));
    kv("expert_feed_forward_length", u(c.moe_ff));
    kv("expert_weights_scale", f(c.routed_scale));
    // transformers renormalises the chosen experts' weights whatever norm_topk_prob says;
    // the file records what the reference model does.
    kv("expert_weights_norm", Value::Bool(true));
    kv("expert_gating_func", u(c.gating as usize));
    kv("hash_layer_count", u(c.n_hash));
    kv("hyper_connection.count", u(c.hc_mult));
    kv("hyper_connection.sinkhorn_iterations", u(c.hc_iters));
    kv("hyper_connection.epsilon", f(c.hc_eps));
    kv("rope.dimension_count", u(c.rope_dim));
    kv("rope.freq_base", f(c.rope_theta));
    if c.n_nextn > 0 {
        kv("nextn_predict_layers", u(c.n_nextn));
    }
    let clamp = Value::Array(vec![f(c.swiglu_limit); c.n_layer]);
    kv("swiglu_clamp_exp", clamp.clone());
    kv("swiglu_clamp_shexp", clamp);
    if let Some(y) = &c.yarn {
        kv("rope.scaling.type", Value::String("yarn".into()));
        kv("rope.scaling.factor", f(y.factor));
        kv(
            "rope.scaling.original_context_length",
            Value::U32(y.original_ctx as u32),
        );
        kv("rope.scaling.yarn_beta_fast", f(y.beta_fast));
        kv("rope.scaling.yarn_beta_slow", f(y.beta_slow));
        kv("rope.scaling.attn_factor", f(y.attn_factor));
    }
    w.add_kv("general.architecture", Value::String(a.into()));
    w.add_kv("general.name", Value::String(name.into()));
    if let Some(b) = c.bos {
        w.add_kv("tokenizer.ggml.bos_token_id", Value::U32(b as u32));
    }
    if let Some(e) = c.eos {
        w.add_kv("tokenizer.ggml.eos_token_id", Value::U32(e as u32));
    }
}

/// Converts `dir` into a GGUF at `out`. `progress(done, total, tensor)` is called per
/// written tensor. `mtp`: write the checkpoint's next-token-prediction block instead, as
/// the drafter file llama.cpp's converter writes with `--mtp` (the block as layer
/// `num_hidden_layers` with its `nextn.*` tensors, its own mHC head, and the model's
/// embedding, final norm and head; `block_count` counts it, `nextn_predict_layers` = 1).
pub fn convert(
    dir: &Path,
    out: &Path,
    ty: OutType,
    tokenizer_pre: Option<&str>,
    mtp: bool,
    enc: Encoder<'_>,
    progress: &dyn Fn(usize, usize, &str),
) -> Result<Summary> {
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path)
        .with_context(|| format!("reading {}", cfg_path.display()))?;
    let mut c = Ds4Config::parse(&text).with_context(|| cfg_path.display().to_string())?;
    let mut src = Source::open(dir)?;
    if mtp {
        if c.n_nextn == 0 || !src.names().any(|n| n.starts_with("mtp.0.")) {
            bail!(
                "{}: --mtp: the checkpoint has no MTP block (num_nextn_predict_layers {}, no mtp.0.* tensors)",
                dir.display(),
                c.n_nextn
            );
        }
        // llama.cpp runs the block as sliding-window attention only.
        match c.nextn_ratios.first() {
            None | Some(0) => {}
            Some(r) => bail!("config.json: the MTP block's compress ratio is {r}; only 0 (sliding window) is supported"),
        }
        let block = c.n_layer;
        src.rename(|n| names::mtp_name(n, block))?;
        c.n_layer += 1;
        c.compress_ratios.push(0);
        c.n_nextn = 1;
    } else {
        c.n_nextn = 0;
    }
    let src = src;
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "deepseek4".into());

    let mut w = GgufWriter::new(32);
    metadata(&mut w, &c, &name);
    let mut notes = Vec::new();

    // Plan: plain tensors one by one, experts grouped per (layer, projection).
    let mut plain = Vec::new();
    let mut experts: BTreeMap<(usize, u8), Vec<usize>> = BTreeMap::new();
    let mut skipped = Vec::new();
    for n in src.names() {
        if let Some((layer, e, k)) = names::expert(n) {
            if n.ends_with(".weight") {
                experts.entry((layer, k)).or_default().push(e);
            }
            continue;
        }
        let base = names::base_name(n);
        if base.starts_with("mtp.") {
            skipped.push(n.to_string());
            continue;
        }
        if base.contains(".nextn.e_proj.") || base.contains(".nextn.h_proj.") {
            continue; // joined into nextn.eh_proj below
        }
        if n.ends_with(".scale")
            && src.has(&format!("{}.weight", n.strip_suffix(".scale").unwrap()))
        {
            continue; // consumed with its weight
        }
        match names::map(n) {
            Some(m) => plain.push((n.to_string(), m)),
            None => bail!(
                "{}: tensor '{n}' is not part of DeepSeek-V4 as this converter knows it",
                dir.display()
            ),
        }
    }
    let maps_to = |g: &str| {
        plain
            .iter()
            .find(|(_, m)| m.gguf == g)
            .map(|(n, _)| n.clone())
    };
    let embd = maps_to("token_embd.weight")
        .ok_or_else(|| anyhow!("{}: no token embedding (embed.weight)", dir.display()))?;
    // Sizes the rest of the conversion allocates by must agree with the weights.
    let shape = &src.raw(&embd)?.shape;
    let rows = shape.first().copied().unwrap_or(0);
    if rows != c.vocab {
        bail!(
            "config.json: vocab_size {} but the embedding has {rows} rows",
            c.vocab
        );
    }
    let width = shape.get(1).copied().unwrap_or(0);
    if width != c.hidden {
        bail!(
            "config.json: hidden_size {} but the embedding rows hold {width} values",
            c.hidden
        );
    }
    let top = src
        .names()
        .filter_map(|n| {
            names::base_name(n)
                .strip_prefix("layers.")?
                .split('.')
                .next()?
                .parse::<usize>()
                .ok()
        })
        .max();
    if top.map_or(0, |t| t + 1) != c.n_layer {
        bail!(
            "config.json: num_hidden_layers {} but the weights have {} layers",
            c.n_layer,
            top.map_or(0, |t| t + 1)
        );
    }
    if maps_to("output.weight").is_none() {
        if !c.tied {
            bail!(
                "{}: no output head (head.weight) and tie_word_embeddings is not set",
                dir.display()
            );
        }
        // Tied: the output head is the embedding; store it under both names.
        let head = names::Mapped {
            gguf: "output.weight".into(),
            kind: Kind::Matrix,
        };
        plain.push((embd, head));
    }
    for ((layer, k), es) in experts.iter_mut() {
        es.sort_unstable();
        if *es != (0..c.n_expert).collect::<Vec<_>>() {
            bail!(
                "layer {layer}: the w{k} experts are not exactly 0..{} (config n_routed_experts)",
                c.n_expert
            );
        }
    }
    if c.n_layer > 0 && experts.is_empty() && c.n_expert > 0 {
        bail!(
            "{}: no routed expert weights (layers.N.ffn.experts.E.w1/w2/w3)",
            dir.display()
        );
    }

    if !tokenizer::add_tokenizer(&mut w, dir, c.vocab, tokenizer_pre)? {
        notes.push(
            "no tokenizer.json: the GGUF has no tokenizer (logits work, serve does not)"
                .to_string(),
        );
    }
    let eh_block = mtp.then(|| c.n_layer - 1);
    let total = plain.len() + experts.len() + eh_block.is_some() as usize;
    let mut done = 0;
    let mut bytes = 0u64;
    if let Some(b) = eh_block {
        // The MTP block's input product over [embedding | hidden]: e_proj's and h_proj's
        // rows side by side, as llama.cpp's converter joins them.
        let (es, e) = src.f32(&format!("layers.{b}.nextn.e_proj.weight"))?;
        let (hs, h) = src.f32(&format!("layers.{b}.nextn.h_proj.weight"))?;
        if es != [c.hidden, c.hidden] || hs != es {
            bail!(
                "MTP e_proj / h_proj: shapes {es:?} / {hs:?}, expected [{0}, {0}]",
                c.hidden
            );
        }
        let v: Vec<f32> = e
            .chunks_exact(c.hidden)
            .zip(h.chunks_exact(c.hidden))
            .flat_map(|(a, b)| a.iter().chain(b).copied())
            .collect();
        let gname = format!("blk.{b}.nextn.eh_proj.weight");
        let shape = [c.hidden, 2 * c.hidden];
        let (t, data) = encode_matrix(&gname, &shape, &v, ty, enc, &mut notes)?;
        bytes += data.len() as u64;
        w.add_tensor(&gname, &ggml_dims(&shape), t, data);
        done += 1;
        progress(done, total, &gname);
    }
    for (n, m) in &plain {
        let layer = names::base_name(n)
            .strip_prefix("layers.")
            .and_then(|r| r.split('.').next())
            .and_then(|l| l.parse::<usize>().ok());
        if m.gguf.ends_with("exp_probs_b.bias") && layer.is_some_and(|l| l < c.n_hash) {
            skipped.push(n.clone()); // hash layers choose by table; the bias is unused
            done += 1;
            continue;
        }
        let (t, dims, data) = match m.kind {
            Kind::Table => {
                let (shape, v) = src.i32(n)?;
                if let Some(&bad) = v.iter().find(|&&e| e < 0 || e as usize >= c.n_expert) {
                    bail!("'{n}': expert id {bad} outside 0..{}", c.n_expert);
                }
                (
                    I32,
                    ggml_dims(&shape),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            }
            Kind::Control => {
                let (shape, v) = src.f32(n)?;
                (F32, ggml_dims(&shape), f32_bytes(&v))
            }
            Kind::Matrix => {
                let (shape, v) = src.f32(n)?;
                let (t, d) = encode_matrix(&m.gguf, &shape, &v, ty, enc, &mut notes)?;
                (t, ggml_dims(&shape), d)
            }
        };
        bytes += data.len() as u64;
        w.add_tensor(&m.gguf, &dims, t, data);
        done += 1;
        progress(done, total, &m.gguf);
    }
    for (&(layer, k), es) in &experts {
        let proj = match k {
            1 => "gate",
            2 => "down",
            3 => "up",
            _ => bail!("layer {layer}: unknown expert projection w{k}"),
        };
        let gname = format!("blk.{layer}.ffn_{proj}_exps.weight");
        let prefix = |e: usize| {
            let p = format!("model.layers.{layer}.ffn.experts.{e}.w{k}.weight");
            if src.has(&p) {
                p
            } else {
                format!("layers.{layer}.ffn.experts.{e}.w{k}.weight")
            }
        };
        let (mut data, mut shape, mut t) = (Vec::new(), None, None);
        for &e in es {
            let n = prefix(e);
            let (s, part, pt) = match src.mxfp4_blocks(&n)? {
                Some((rows, cols, blocks)) => (vec![rows, cols], blocks, MXFP4),
                None => {
                    let (s, v) = src.f32(&n)?;
                    let (pt, d) = encode_matrix(&gname, &s, &v, ty, enc, &mut notes)?;
                    (s, d, pt)
                }
            };
            if s.len() != 2 {
                bail!("'{n}': an expert weight must be 2-D, found {s:?}");
            }
            if shape.get_or_insert(s.clone()) != &s || *t.get_or_insert(pt) != pt {
                bail!("'{n}': shape {s:?} or type differs from expert 0 of the same layer");
            }
            data.extend(part);
        }
        let s = shape.ok_or_else(|| anyhow!("layer {layer}: no experts"))?;
        let dims = vec![s[1] as u64, s[0] as u64, es.len() as u64];
        bytes += data.len() as u64;
        w.add_tensor(&gname, &dims, t.unwrap_or(F32), data);
        done += 1;
        progress(done, total, &gname);
    }
    notes.sort();
    notes.dedup();
    w.write_file(out)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(Summary {
        tensors: done,
        bytes,
        skipped,
        notes,
    })
}
