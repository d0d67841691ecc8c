//! The llama architecture (SmolLM2, Llama 2/3 and the like) as a graph of backend ops.

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use moe_gguf::GgufFile;
use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::{
    device::{Device, Tensor},
    model::{BatchEntry, CausalLm, Weights},
};

/// Hyperparameters, all read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct LlamaParams {
    pub n_layer: usize,
    pub d_model: usize,
    pub d_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_scale: f32,
    pub eps: f32,
    pub n_vocab: usize,
    pub train_ctx: usize,
}

impl LlamaParams {
    pub fn from_gguf(f: &GgufFile, arch: &str) -> Result<LlamaParams> {
        let u = |k: &str| -> Result<usize> { Ok(f.get_u64(&format!("{arch}.{k}"))? as usize) };
        let opt_f = |k: &str, d: f64| f.get_f64(&format!("{arch}.{k}")).unwrap_or(d) as f32;
        let n_head = u("attention.head_count")?;
        let d_model = u("embedding_length")?;
        if n_head == 0 || d_model % n_head != 0 {
            bail!("{arch}: embedding_length {d_model} is not a multiple of head_count {n_head}");
        }
        let head_dim = u("attention.key_length").unwrap_or(d_model / n_head);
        let n_head_kv = u("attention.head_count_kv").unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            bail!("{arch}: head_count {n_head} is not a multiple of head_count_kv {n_head_kv}");
        }
        let embd = f
            .tensor("token_embd.weight")
            .context("the model has no token_embd.weight")?;
        let scaling = f
            .get_str(&format!("{arch}.rope.scaling.type"))
            .unwrap_or("none");
        let rope_scale = match scaling {
            "none" => 1.0,
            "linear" => 1.0 / opt_f("rope.scaling.factor", 1.0),
            other => bail!("{arch}: rope scaling '{other}' is not supported"),
        };
        let p = LlamaParams {
            n_layer: u("block_count")?,
            d_model,
            d_ff: u("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            n_rot: u("rope.dimension_count").unwrap_or(head_dim),
            rope_base: opt_f("rope.freq_base", 10000.0),
            rope_scale,
            eps: opt_f("attention.layer_norm_rms_epsilon", 1e-5),
            n_vocab: embd.dims.get(1).copied().unwrap_or(0) as usize,
            train_ctx: u("context_length").unwrap_or(2048),
        };
        p.check(f, arch)?;
        Ok(p)
    }

    /// Values that would not fail later but quietly give wrong (or NaN) logits.
    fn check(&self, f: &GgufFile, arch: &str) -> Result<()> {
        let positive = |v: f32, key: &str| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(anyhow::anyhow!(
                    "{arch}.{key} is {v}; it must be a positive number"
                ))
            }
        };
        positive(self.eps, "attention.layer_norm_rms_epsilon")?;
        positive(self.rope_base, "rope.freq_base")?;
        positive(self.rope_scale, "rope.scaling.factor (as 1 / factor)")?;
        if self.n_rot == 0 || !self.n_rot.is_multiple_of(2) || self.n_rot > self.head_dim {
            bail!(
                "{arch}.rope.dimension_count is {}; it must be even, and between 2 and the \
                 head size {}",
                self.n_rot,
                self.head_dim
            );
        }
        // The layers the file holds must be the layers the metadata names: a
        // block_count below them would run a truncated model, above them fail late.
        let held = f
            .tensors()
            .iter()
            .filter_map(|t| {
                t.name
                    .strip_prefix("blk.")?
                    .split('.')
                    .next()?
                    .parse::<usize>()
                    .ok()
            })
            .max()
            .map_or(0, |l| l + 1);
        if held != self.n_layer {
            bail!(
                "{arch}.block_count is {}, but the file holds tensors for {held} layers",
                self.n_layer
            );
        }
        Ok(())
    }
}

struct Layer {
    attn_norm: Arc<Tensor>,
    wq: Arc<Tensor>,
    wk: Arc<Tensor>,
    wv: Arc<Tensor>,
    wo: Arc<Tensor>,
    ffn_norm: Arc<Tensor>,
    w_gate: Arc<Tensor>,
    w_up: Arc<Tensor>,
    w_down: Arc<Tensor>,
    k_cache: Tensor,
    v_cache: Tensor,
}

/// Activations for a batch of up to `cap` tokens.
struct Scratch {
    cap: usize,
    x: Tensor,
    x2: Tensor,
    h: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qr: Tensor,
    kr: Tensor,
    att: Tensor,
    o: Tensor,
    g: Tensor,
    u: Tensor,
    a: Tensor,
    tokens: Tensor,
    pos: Tensor,
    slot: Tensor,
}

pub struct Llama {
    p: LlamaParams,
    dev: Arc<Device>,
    embd: Arc<Tensor>,
    out_norm: Arc<Tensor>,
    output: Arc<Tensor>,
    layers: Vec<Layer>,
    n_ctx: usize,
    n_slots: usize,
    scratch: Option<Scratch>,
    /// (capacity in positions, buffer) for the output logits.
    logits: Option<(usize, Tensor)>,
}

fn d4(a: usize, b: usize) -> [u64; 4] {
    [a as u64, b as u64, 1, 1]
}

impl Llama {
    /// The graph over `w` for parameters `p` (read and checked by
    /// [`LlamaParams::from_gguf`] before any upload).
    pub fn new(p: LlamaParams, w: &Weights, n_ctx: usize, n_slots: usize) -> Result<Llama> {
        let dev = w.device().clone();
        let expect = |name: &str, dims: &[usize]| -> Result<Arc<Tensor>> {
            let t = w.get(name)?;
            let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
            // (dims past the expected ones must be 1: a [576, 2] norm is not a [576] one)
            let have = &t.r.dims[..];
            let extra_ok = have[dims.len().min(have.len())..].iter().all(|&d| d == 1);
            if have.len() < dims.len() || have[..dims.len()] != want[..] || !extra_ok {
                let shown: Vec<u64> = have
                    .iter()
                    .rev()
                    .skip_while(|&&d| d == 1)
                    .copied()
                    .collect();
                let shown: Vec<u64> = shown.into_iter().rev().collect();
                bail!("tensor {name} has dims {shown:?}, expected {want:?}");
            }
            Ok(t)
        };
        let (d, hd) = (p.d_model, p.head_dim);
        let (dq, dkv) = (p.n_head * hd, p.n_head_kv * hd);
        let mut layers = Vec::with_capacity(p.n_layer);
        for l in 0..p.n_layer {
            let n = |s: &str| format!("blk.{l}.{s}.weight");
            let cache = [hd as u64, p.n_head_kv as u64, n_ctx as u64, n_slots as u64];
            layers.push(Layer {
                attn_norm: expect(&n("attn_norm"), &[d])?,
                wq: expect(&n("attn_q"), &[d, dq])?,
                wk: expect(&n("attn_k"), &[d, dkv])?,
                wv: expect(&n("attn_v"), &[d, dkv])?,
                wo: expect(&n("attn_output"), &[dq, d])?,
                ffn_norm: expect(&n("ffn_norm"), &[d])?,
                w_gate: expect(&n("ffn_gate"), &[d, p.d_ff])?,
                w_up: expect(&n("ffn_up"), &[d, p.d_ff])?,
                w_down: expect(&n("ffn_down"), &[p.d_ff, d])?,
                k_cache: dev.f32(cache).context("allocating the key cache")?,
                v_cache: dev.f32(cache).context("allocating the value cache")?,
            });
        }
        let embd = expect("token_embd.weight", &[d, p.n_vocab])?;
        // Tied embeddings: without output.weight the embedding table is the head.
        let output = match w.get("output.weight") {
            Ok(_) => expect("output.weight", &[d, p.n_vocab])?,
            Err(_) => embd.clone(),
        };
        Ok(Llama {
            out_norm: expect("output_norm.weight", &[d])?,
            embd,
            output,
            layers,
            dev,
            n_ctx,
            n_slots,
            scratch: None,
            logits: None,
            p,
        })
    }

    pub fn params(&self) -> &LlamaParams {
        &self.p
    }

    fn scratch(&mut self, t: usize) -> Result<&Scratch> {
        if self.scratch.as_ref().is_none_or(|s| s.cap < t) {
            let cap = t.next_power_of_two().max(8);
            let p = &self.p;
            let dev = &self.dev;
            let (dq, dkv) = (p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
            self.scratch = None; // free the old arena before allocating the new one
            self.scratch = Some(Scratch {
                cap,
                x: dev.f32(d4(p.d_model, cap))?,
                x2: dev.f32(d4(p.d_model, cap))?,
                h: dev.f32(d4(p.d_model, cap))?,
                q: dev.f32(d4(dq, cap))?,
                k: dev.f32(d4(dkv, cap))?,
                v: dev.f32(d4(dkv, cap))?,
                qr: dev.f32(d4(dq, cap))?,
                kr: dev.f32(d4(dkv, cap))?,
                att: dev.f32(d4(dq, cap))?,
                o: dev.f32(d4(p.d_model, cap))?,
                g: dev.f32(d4(p.d_ff, cap))?,
                u: dev.f32(d4(p.d_ff, cap))?,
                a: dev.f32(d4(p.d_ff, cap))?,
                tokens: dev.i32(cap)?,
                pos: dev.i32(cap)?,
                slot: dev.i32(cap)?,
            });
        }
        Ok(self.scratch.as_ref().expect("just set"))
    }
}

impl CausalLm for Llama {
    fn arch(&self) -> &str {
        "llama"
    }
    fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    fn n_slots(&self) -> usize {
        self.n_slots
    }
    fn n_vocab(&self) -> usize {
        self.p.n_vocab
    }
    fn device(&self) -> &Arc<Device> {
        &self.dev
    }
    /// Any matching prefix: the cache is by position, and attention reads only the
    /// positions before a token's own, so rows past the kept prefix are overwritten
    /// before anything reads them.
    fn keep_prefix(&self, _slot: u32, _cached: usize, matching: usize) -> usize {
        matching
    }
    fn can_rewind(&self) -> bool {
        true
    }

    fn forward(&mut self, batch: &[BatchEntry]) -> Result<Vec<Vec<f32>>> {
        let t = batch.len();
        if t == 0 {
            return Ok(Vec::new());
        }
        for b in batch {
            if b.pos as usize >= self.n_ctx || b.slot as usize >= self.n_slots {
                bail!(
                    "position {} / slot {} outside the cache ({} x {})",
                    b.pos,
                    b.slot,
                    self.n_ctx,
                    self.n_slots
                );
            }
            if b.token as usize >= self.p.n_vocab {
                bail!(
                    "token id {} outside the vocabulary ({})",
                    b.token,
                    self.p.n_vocab
                );
            }
        }
        self.scratch(t)?;
        let s = self.scratch.as_ref().expect("allocated above");
        let p = &self.p;
        let dev = &self.dev;
        let (d, hd) = (p.d_model, p.head_dim);
        let (dq, dkv) = (p.n_head * hd, p.n_head_kv * hd);

        s.tokens
            .upload_i32(&batch.iter().map(|b| b.token as i32).collect::<Vec<_>>())?;
        s.pos
            .upload_i32(&batch.iter().map(|b| b.pos as i32).collect::<Vec<_>>())?;
        s.slot
            .upload_i32(&batch.iter().map(|b| b.slot as i32).collect::<Vec<_>>())?;
        let ids = |x: &Tensor| x.view([t as u64, 1, 1, 1]);
        let v2 = |x: &Tensor, rows: usize| x.view(d4(rows, t));
        let heads = |x: &Tensor, n: usize| x.view([hd as u64, n as u64, t as u64, 1]);
        let none = OpParams::default();
        let norm = OpParams {
            f: [p.eps, 0., 0., 0., 0., 0., 0., 0.],
            ..Default::default()
        };
        let rope = OpParams {
            f: [p.rope_base, p.rope_scale, 0., 0., 0., 0., 0., 0.],
            i: [p.n_rot as i64, 0, 0, 0, 0, 0, 0, 0],
        };
        let attn = OpParams {
            f: [1.0 / (hd as f32).sqrt(), 0., 0., 0., 0., 0., 0., 0.],
            ..Default::default()
        };

        dev.op(
            ops::GET_ROWS,
            none,
            &[self.embd.r, ids(&s.tokens), v2(&s.x, d)],
        )?;
        for (l, ly) in self.layers.iter().enumerate() {
            let ctx = || format!("layer {l}");
            dev.op(
                ops::RMS_NORM,
                norm,
                &[v2(&s.x, d), ly.attn_norm.r, v2(&s.h, d)],
            )
            .with_context(ctx)?;
            dev.op(ops::MATMUL, none, &[ly.wq.r, v2(&s.h, d), v2(&s.q, dq)])
                .with_context(ctx)?;
            dev.op(ops::MATMUL, none, &[ly.wk.r, v2(&s.h, d), v2(&s.k, dkv)])
                .with_context(ctx)?;
            dev.op(ops::MATMUL, none, &[ly.wv.r, v2(&s.h, d), v2(&s.v, dkv)])
                .with_context(ctx)?;
            dev.op(
                ops::ROPE,
                rope,
                &[heads(&s.q, p.n_head), ids(&s.pos), heads(&s.qr, p.n_head)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::ROPE,
                rope,
                &[
                    heads(&s.k, p.n_head_kv),
                    ids(&s.pos),
                    heads(&s.kr, p.n_head_kv),
                ],
            )
            .with_context(ctx)?;
            let (kc, vc) = (ly.k_cache.r, ly.v_cache.r);
            dev.op(
                ops::KV_STORE,
                none,
                &[heads(&s.kr, p.n_head_kv), kc, ids(&s.slot), ids(&s.pos)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::KV_STORE,
                none,
                &[heads(&s.v, p.n_head_kv), vc, ids(&s.slot), ids(&s.pos)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::ATTENTION,
                attn,
                &[
                    heads(&s.qr, p.n_head),
                    kc,
                    vc,
                    ids(&s.slot),
                    ids(&s.pos),
                    heads(&s.att, p.n_head),
                ],
            )
            .with_context(ctx)?;
            dev.op(ops::MATMUL, none, &[ly.wo.r, v2(&s.att, dq), v2(&s.o, d)])
                .with_context(ctx)?;
            dev.op(ops::ADD, none, &[v2(&s.x, d), v2(&s.o, d), v2(&s.x2, d)])
                .with_context(ctx)?;
            dev.op(
                ops::RMS_NORM,
                norm,
                &[v2(&s.x2, d), ly.ffn_norm.r, v2(&s.h, d)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::MATMUL,
                none,
                &[ly.w_gate.r, v2(&s.h, d), v2(&s.g, p.d_ff)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::MATMUL,
                none,
                &[ly.w_up.r, v2(&s.h, d), v2(&s.u, p.d_ff)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::SWIGLU,
                none,
                &[v2(&s.g, p.d_ff), v2(&s.u, p.d_ff), v2(&s.a, p.d_ff)],
            )
            .with_context(ctx)?;
            dev.op(
                ops::MATMUL,
                none,
                &[ly.w_down.r, v2(&s.a, p.d_ff), v2(&s.o, d)],
            )
            .with_context(ctx)?;
            dev.op(ops::ADD, none, &[v2(&s.x2, d), v2(&s.o, d), v2(&s.x, d)])
                .with_context(ctx)?;
        }
        // Only the positions that need logits go through the head.
        let want: Vec<i32> = (0..t as i32)
            .filter(|&i| batch[i as usize].want_logits)
            .collect();
        if want.is_empty() {
            return Ok(Vec::new());
        }
        let n = want.len();
        s.tokens.upload_i32(&want)?;
        let sel = TensorRef {
            dims: d4(n, 1),
            ..s.tokens.r
        };
        dev.op(
            ops::RMS_NORM,
            norm,
            &[v2(&s.x, d), self.out_norm.r, v2(&s.h, d)],
        )?;
        dev.op(
            ops::GET_ROWS,
            none,
            &[v2(&s.h, d), sel, s.x2.view(d4(d, n))],
        )?;
        // Grow-only, so decode steps reuse one buffer instead of allocating per token.
        if self.logits.as_ref().is_none_or(|(cap, _)| *cap < n) {
            self.logits = None;
            self.logits = Some((n, dev.f32(d4(p.n_vocab, n))?));
        }
        let (_, logits) = self.logits.as_ref().expect("just set");
        dev.op(
            ops::MATMUL,
            none,
            &[
                self.output.r,
                s.x2.view(d4(d, n)),
                logits.view(d4(p.n_vocab, n)),
            ],
        )?;
        dev.sync()?;
        let flat = logits.download_f32(p.n_vocab * n)?;
        Ok(flat.chunks_exact(p.n_vocab).map(<[f32]>::to_vec).collect())
    }
}

/// GGUF roles of llama tensors, for placement policies.
pub fn role_of(name: &str) -> &'static str {
    match name {
        "token_embd.weight" => "embedding",
        "output.weight" => "output",
        "output_norm.weight" => "norm",
        n if n.contains("norm") => "norm",
        n if n.contains(".attn_") => "attention",
        n if n.contains(".ffn_") => "dense_ffn",
        _ => "other",
    }
}

#[allow(dead_code)]
const _: u32 = types::F32;
