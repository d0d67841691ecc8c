//! DeepSeek-V4 `config.json` in either style: the release's (`compress_ratios`,
//! `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) or transformers 5's
//! (`layer_types`, `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`,
//! `rope_parameters` with `main` / `compress`).

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_ctx: u64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    pub attn_factor: f64,
}

#[derive(Debug, Clone)]
pub struct Ds4Config {
    pub n_layer: usize,
    pub hidden: usize,
    pub vocab: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub n_shared: usize,
    pub moe_ff: usize,
    pub routed_scale: f64,
    pub swiglu_limit: f64,
    pub sliding_window: usize,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    /// Per layer: 0 = sliding only, otherwise the compression ratio.
    pub compress_ratios: Vec<u32>,
    pub n_hash: usize,
    pub hc_mult: usize,
    pub hc_iters: usize,
    pub hc_eps: f64,
    pub eps: f64,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    pub yarn: Option<Yarn>,
    pub max_pos: u64,
    pub bos: Option<u64>,
    pub eos: Option<u64>,
    /// ggml's expert gating function: 4 = sqrt(softplus), 2 = sigmoid.
    pub gating: u32,
    /// lm_head shares the embedding (no head.weight in the checkpoint).
    pub tied: bool,
    /// Next-token-prediction (MTP) blocks in the checkpoint (`mtp.N.*`), usable as drafters.
    pub n_nextn: usize,
    /// `compress_ratios` entries past the main layers (the MTP blocks'), where listed.
    pub nextn_ratios: Vec<u32>,
}

fn get<'a>(v: &'a Value, k: &str) -> Option<&'a Value> {
    v.get(k).filter(|x| !x.is_null())
}

/// `k` as an array: None when absent, an error when it is something else (rather than
/// quietly falling back to a default).
fn array<'a>(v: &'a Value, k: &str) -> Result<Option<&'a Vec<Value>>> {
    match get(v, k) {
        None => Ok(None),
        Some(x) => x
            .as_array()
            .map(Some)
            .ok_or_else(|| anyhow!("config.json: '{k}' is {x}, not a list")),
    }
}

/// `k` as an object, in the same way.
fn object<'a>(v: &'a Value, k: &str) -> Result<Option<&'a Value>> {
    match get(v, k) {
        None => Ok(None),
        Some(x) if x.is_object() => Ok(Some(x)),
        Some(x) => bail!("config.json: '{k}' is {x}, not an object"),
    }
}

fn num(v: &Value, k: &str) -> Result<f64> {
    get(v, k)
        .and_then(Value::as_f64)
        .ok_or_else(|| anyhow!("config.json: '{k}' is missing or not a number"))
}

fn num_or(v: &Value, k: &str, d: f64) -> Result<f64> {
    match get(v, k) {
        None => Ok(d),
        Some(x) => x
            .as_f64()
            .ok_or_else(|| anyhow!("config.json: '{k}' is not a number")),
    }
}

fn int(v: &Value, k: &str) -> Result<usize> {
    get(v, k)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .ok_or_else(|| anyhow!("config.json: '{k}' is missing or not a non-negative integer"))
}

fn int_or(v: &Value, k: &str, d: usize) -> Result<usize> {
    match get(v, k) {
        None => Ok(d),
        Some(_) => int(v, k),
    }
}

/// More Sinkhorn iterations than any checkpoint uses (the release: 20).
const MAX_SINKHORN_ITERS: usize = 1000;

impl Ds4Config {
    /// Values the GGUF would carry without complaint but that make the model fail to
    /// load, give NaN logits or hang: refused here, naming the key.
    fn check(&self) -> Result<()> {
        for (v, k) in [
            (self.hidden, "hidden_size"),
            (self.n_head, "num_attention_heads"),
            (self.head_dim, "head_dim"),
            (self.vocab, "vocab_size"),
            (self.q_lora_rank, "q_lora_rank"),
            (self.o_lora_rank, "o_lora_rank"),
            (self.o_groups, "o_groups"),
            (self.moe_ff, "moe_intermediate_size"),
            (self.sliding_window, "sliding_window"),
            (self.hc_mult, "hc_mult"),
        ] {
            if v == 0 {
                bail!("config.json: '{k}' is 0");
            }
        }
        if self.n_expert > 0 && !(1..=self.n_expert).contains(&self.n_expert_used) {
            bail!(
                "config.json: num_experts_per_tok {} of {} routed experts",
                self.n_expert_used,
                self.n_expert
            );
        }
        let yarn = self.yarn.as_ref();
        for (v, k) in [
            (self.eps, "rms_norm_eps"),
            (self.hc_eps, "hc_eps"),
            (self.rope_theta, "rope_theta"),
            (self.compress_rope_theta, "compress_rope_theta"),
            (yarn.map_or(1.0, |y| y.factor), "rope scaling factor"),
            (
                yarn.map_or(1.0, |y| y.original_ctx as f64),
                "original_max_position_embeddings",
            ),
        ] {
            if !(v.is_finite() && v > 0.0) {
                bail!("config.json: {k} is {v}; it must be a positive number");
            }
        }
        if self.hc_iters > MAX_SINKHORN_ITERS {
            bail!(
                "config.json: hc_sinkhorn_iters {} (at most {MAX_SINKHORN_ITERS}; the release uses 20)",
                self.hc_iters
            );
        }
        Ok(())
    }

    pub fn parse(text: &str) -> Result<Ds4Config> {
        let v: Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        if let Some(mt) = get(&v, "model_type").and_then(Value::as_str) {
            if mt != "deepseek_v4" {
                bail!("config.json: model_type is '{mt}', expected 'deepseek_v4'");
            }
        }
        // Router score functions transformers can run, by ggml's gating-function number.
        let gating = match get(&v, "scoring_func")
            .and_then(Value::as_str)
            .unwrap_or("sqrtsoftplus")
        {
            "sqrtsoftplus" => 4,
            "sigmoid" => 2,
            sf => {
                bail!("config.json: scoring_func '{sf}' is not supported (sqrtsoftplus or sigmoid)")
            }
        };
        for k in ["mlp_bias", "attention_bias"] {
            if get(&v, k).and_then(Value::as_bool) == Some(true) {
                bail!("config.json: {k} = true is not supported (DeepSeek-V4 has no biases there)");
            }
        }
        let n_layer = int(&v, "num_hidden_layers")?;
        let hidden = int(&v, "hidden_size")?;
        let n_head = int(&v, "num_attention_heads")?;
        let head_dim = int_or(&v, "head_dim", hidden / n_head.max(1))?;
        // num_key_value_heads is not read: the model has one shared K=V head by design.
        // Partial RoPE: the release names the rotated width, transformers a fraction.
        let rope_dim = match get(&v, "qk_rope_head_dim") {
            Some(_) => int(&v, "qk_rope_head_dim")?,
            None => (head_dim as f64 * num_or(&v, "partial_rotary_factor", 0.125)?) as usize,
        };
        if rope_dim == 0 || rope_dim % 2 != 0 || rope_dim > head_dim {
            bail!("config.json: rotated width {rope_dim} must be even and at most head_dim {head_dim}");
        }

        // Per-layer compression: transformers' layer_types + compress_rates, or the
        // release's compress_ratios (which may list extra MTP layers at the end).
        let rates = get(&v, "compress_rates");
        let rate = |ty: &str, legacy: &str, d: u64| -> Result<u64> {
            if let Some(r) = rates.and_then(|r| get(r, ty)) {
                return r
                    .as_u64()
                    .ok_or_else(|| anyhow!("config.json: compress_rates.{ty} is not an integer"));
            }
            Ok(get(&v, legacy).and_then(Value::as_u64).unwrap_or(d))
        };
        let (csa, hca) = (
            rate("compressed_sparse_attention", "compress_rate_csa", 4)?,
            rate("heavily_compressed_attention", "compress_rate_hca", 128)?,
        );
        let (csa, hca) = match (u32::try_from(csa), u32::try_from(hca)) {
            (Ok(c), Ok(h)) if c > 0 && h > 0 => (c, h),
            _ => bail!("config.json: compression rates must be positive 32-bit integers (got {csa} and {hca})"),
        };
        // Which layers are CSA (with an indexer) the engine reads from the tensors present.
        let mut nextn_ratios = Vec::new();
        let compress_ratios: Vec<u32> = if let Some(lt) = array(&v, "layer_types")? {
            if lt.len() < n_layer {
                bail!(
                    "config.json: layer_types has {} entries for {n_layer} layers",
                    lt.len()
                );
            }
            lt[..n_layer]
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(0),
                    Some("compressed_sparse_attention") => Ok(csa),
                    Some("heavily_compressed_attention") => Ok(hca),
                    other => Err(anyhow!("config.json: unknown layer type {other:?}")),
                })
                .collect::<Result<_>>()?
        } else if let Some(cr) = array(&v, "compress_ratios")? {
            nextn_ratios = cr[n_layer.min(cr.len())..]
                .iter()
                .map(|r| {
                    r.as_u64()
                        .and_then(|r| u32::try_from(r).ok())
                        .unwrap_or(u32::MAX)
                })
                .collect();
            if cr.len() < n_layer {
                bail!(
                    "config.json: compress_ratios has {} entries for {n_layer} layers",
                    cr.len()
                );
            }
            cr[..n_layer]
                .iter()
                .map(|r| {
                    r.as_u64()
                        .and_then(|r| u32::try_from(r).ok())
                        .ok_or_else(|| {
                            anyhow!("config.json: compress_ratios holds {r}, not a 32-bit integer")
                        })
                })
                .collect::<Result<_>>()?
        } else {
            // transformers' default schedule: 2 HCA, then alternating HCA / CSA.
            (0..n_layer)
                .map(|i| if i >= 3 && i % 2 == 1 { csa } else { hca })
                .collect()
        };

        let n_hash = if let Some(mt) = array(&v, "mlp_layer_types")? {
            let kinds: Vec<&str> = mt
                .iter()
                .take(n_layer)
                .map(|k| {
                    k.as_str()
                        .ok_or_else(|| anyhow!("config.json: mlp_layer_types holds {k}"))
                })
                .collect::<Result<_>>()?;
            let n = kinds.iter().take_while(|k| **k == "hash_moe").count();
            if kinds.iter().skip(n).any(|k| *k == "hash_moe") {
                bail!("config.json: hash_moe layers must come first (GGUF stores a count: hash_layer_count)");
            }
            if let Some(bad) = kinds.iter().find(|k| !matches!(**k, "hash_moe" | "moe")) {
                bail!("config.json: unknown mlp layer type '{bad}'");
            }
            n
        } else {
            int_or(&v, "num_hash_layers", 3)?.min(n_layer)
        };

        // RoPE: the main (sliding) rope is plain; the compressed branch may use YaRN.
        let rp = get(&v, "rope_parameters");
        let main = rp.and_then(|r| get(r, "main"));
        let comp = rp.and_then(|r| get(r, "compress"));
        let rope_theta = match main {
            Some(m) => num(m, "rope_theta")?,
            None => num_or(&v, "rope_theta", 10000.0)?,
        };
        let compress_rope_theta = match comp {
            Some(c) => num(c, "rope_theta")?,
            None => num_or(&v, "compress_rope_theta", 160000.0)?,
        };
        // Where YaRN parameters live: rope_parameters.compress, a flat rope_parameters,
        // or the release's rope_scaling.
        let scaling = match comp.or_else(|| rp.filter(|r| get(r, "main").is_none())) {
            Some(s) => Some(s),
            None => object(&v, "rope_scaling")?,
        };
        let yarn = match scaling {
            None => None,
            Some(s) => {
                let ty = get(s, "rope_type")
                    .or_else(|| get(s, "type"))
                    .and_then(Value::as_str)
                    .unwrap_or("default");
                match ty {
                    "default" => None,
                    "yarn" => Some(Yarn {
                        factor: num(s, "factor")?,
                        original_ctx: num(s, "original_max_position_embeddings")? as u64,
                        beta_fast: num_or(s, "beta_fast", 32.0)?,
                        beta_slow: num_or(s, "beta_slow", 1.0)?,
                        attn_factor: num_or(s, "attention_factor", 1.0)?,
                    }),
                    other => {
                        bail!("config.json: rope type '{other}' is not supported (default or yarn)")
                    }
                }
            }
        };

        let first_id = |k: &str| -> Option<u64> {
            match get(&v, k)? {
                Value::Array(a) => a.first().and_then(Value::as_u64),
                x => x.as_u64(),
            }
        };
        let c = Ds4Config {
            n_layer,
            hidden,
            vocab: int(&v, "vocab_size")?,
            n_head,
            head_dim,
            rope_dim,
            q_lora_rank: int(&v, "q_lora_rank")?,
            o_groups: int_or(&v, "o_groups", 8)?,
            o_lora_rank: int_or(&v, "o_lora_rank", 1024)?,
            n_expert: int(&v, "n_routed_experts")?,
            n_expert_used: int(&v, "num_experts_per_tok")?,
            n_shared: int_or(&v, "n_shared_experts", 1)?,
            moe_ff: int(&v, "moe_intermediate_size")?,
            routed_scale: num_or(&v, "routed_scaling_factor", 1.0)?,
            swiglu_limit: num_or(&v, "swiglu_limit", 0.0)?,
            sliding_window: int(&v, "sliding_window")?,
            index_heads: int_or(&v, "index_n_heads", 64)?,
            index_dim: int_or(&v, "index_head_dim", 128)?,
            index_topk: int_or(&v, "index_topk", 512)?,
            compress_ratios,
            n_hash,
            hc_mult: int_or(&v, "hc_mult", 4)?,
            hc_iters: int_or(&v, "hc_sinkhorn_iters", 20)?,
            hc_eps: num_or(&v, "hc_eps", 1e-6)?,
            eps: num_or(&v, "rms_norm_eps", 1e-6)?,
            rope_theta,
            compress_rope_theta,
            yarn,
            max_pos: int_or(&v, "max_position_embeddings", 1 << 20)? as u64,
            bos: first_id("bos_token_id"),
            eos: first_id("eos_token_id"),
            gating,
            tied: get(&v, "tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            n_nextn: int_or(&v, "num_nextn_predict_layers", 0)?,
            nextn_ratios,
        };
        if c.n_shared > 1 {
            bail!(
                "config.json: n_shared_experts {} is not supported (0 or 1)",
                c.n_shared
            );
        }
        if !c.n_head.is_multiple_of(c.o_groups.max(1)) {
            bail!(
                "config.json: {} heads do not split into {} output groups",
                c.n_head,
                c.o_groups
            );
        }
        c.check()?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The release fixture's config, with `edit` applied.
    fn parse_edited(edit: impl Fn(&mut serde_json::Map<String, Value>)) -> Result<Ds4Config> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/deepseek4/tiny_release/config.json"
        );
        let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        edit(v.as_object_mut().unwrap());
        Ds4Config::parse(&v.to_string())
    }

    #[test]
    fn bad_values_are_refused_naming_the_key() {
        parse_edited(|_| {}).expect("the fixture's own config parses");
        for (key, value, want) in [
            ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
            ("rope_theta", serde_json::json!(0.0), "rope_theta"),
            (
                "moe_intermediate_size",
                serde_json::json!(0),
                "moe_intermediate_size",
            ),
            (
                "hc_sinkhorn_iters",
                serde_json::json!(1_000_000_000_000u64),
                "hc_sinkhorn_iters",
            ),
            (
                "rope_scaling",
                serde_json::json!("x"),
                "'rope_scaling' is \"x\", not an object",
            ),
            (
                "compress_ratios",
                serde_json::json!("x"),
                "'compress_ratios' is \"x\", not a list",
            ),
            (
                "qk_rope_head_dim",
                serde_json::json!("x"),
                "qk_rope_head_dim",
            ),
            (
                "num_experts_per_tok",
                serde_json::json!(0),
                "num_experts_per_tok 0",
            ),
        ] {
            let e = parse_edited(|m| {
                m.insert(key.to_string(), value.clone());
            })
            .map(|_| ())
            .expect_err(key)
            .to_string();
            assert!(e.contains(want), "{key}: {e}");
        }
    }
}
