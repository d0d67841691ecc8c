//! A DeepSeek-V4-shaped GGUF with random but valid weights of the types real ROCmFPx
//! files mix (routed experts ROCmFP2 affine 107, attention and shared experts ROCmFP4 100,
//! embedding / output / compressor / indexer Q8_0, control tensors f32), for runs at real
//! width without a download. Blocks are drawn directly (random codes, valid scale bytes
//! sized so each row has roughly unit-variance dot products), not quantised from floats.

use anyhow::{bail, Result};
use moe_gguf::{GgufWriter, Value};
use rand::{rngs::StdRng, Rng, RngCore, SeedableRng};
use rayon::prelude::*;

use crate::{config::Ds4Config, metadata, tokenizer};

/// V4-Flash's shape (DeepseekV4Config defaults) with `layers` layers, `experts` routed
/// experts and a `vocab`-token vocabulary.
pub fn flash_config(layers: usize, experts: usize, vocab: usize) -> Ds4Config {
    // transformers' default schedule: HCA, HCA, then alternating CSA / HCA; 3 hash layers.
    let ratios = (0..layers)
        .map(|i| if i >= 3 && i % 2 == 1 { 4 } else { 128 })
        .collect();
    Ds4Config {
        n_layer: layers,
        hidden: 4096,
        vocab,
        n_head: 64,
        head_dim: 512,
        rope_dim: 64,
        q_lora_rank: 1024,
        o_groups: 8,
        o_lora_rank: 1024,
        n_expert: experts,
        n_expert_used: 6.min(experts),
        n_shared: 1,
        moe_ff: 2048,
        routed_scale: 1.5,
        swiglu_limit: 10.0,
        sliding_window: 128,
        index_heads: 64,
        index_dim: 128,
        index_topk: 512,
        compress_ratios: ratios,
        n_hash: 3.min(layers),
        hc_mult: 4,
        hc_iters: 20,
        hc_eps: 1e-6,
        eps: 1e-6,
        rope_theta: 10000.0,
        compress_rope_theta: 160000.0,
        yarn: Some(crate::config::Yarn {
            factor: 16.0,
            original_ctx: 65536,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
        }),
        max_pos: 1 << 20,
        bos: Some(0),
        eos: Some(1),
        gating: 4,
        tied: false,
        n_nextn: 0,
        nextn_ratios: Vec::new(),
    }
}

use moe_plugin_api::types::{F32, I32, Q8_0};
/// The ROCmFPx plugin's type ids used here.
const ROCMFP4: u32 = 100;
const ROCMFP2: u32 = 107;

/// UE4M3 byte (0..=0x7E) whose value is closest to `x`.
fn ue4m3_near(x: f32) -> u8 {
    let val = |b: u8| {
        let (e, m) = ((b >> 3) as i32, (b & 7) as f32);
        if e == 0 {
            m * (-10f32).exp2()
        } else {
            (8.0 + m) * ((e - 11) as f32).exp2()
        }
    };
    (0u8..=0x7e)
        .min_by(|&a, &b| (val(a) - x).abs().total_cmp(&(val(b) - x).abs()))
        .unwrap_or(0)
}

/// Which weight types the matrices get.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TypeMix {
    /// As the published ROCmFPx "Strix-Lean" files: routed experts ROCmFP2 affine,
    /// attention and shared experts ROCmFP4, the rest Q8_0.
    StrixLean,
    /// Every matrix Q8_0: a file llama.cpp's deepseek4 loads too (for comparisons).
    Q8_0,
}

impl TypeMix {
    fn map(self, ty: u32) -> u32 {
        match (self, ty) {
            (TypeMix::Q8_0, ROCMFP2 | ROCMFP4) => Q8_0,
            _ => ty,
        }
    }
}

struct Gen {
    rng: StdRng,
    mix: TypeMix,
}

impl Gen {
    /// `rows` rows of `k` weights of type `ty` (as the mix maps it), scaled to
    /// ~1/sqrt(k) per weight.
    fn matrix(&mut self, ty: u32, k: usize, rows: usize) -> Vec<u8> {
        let ty = self.mix.map(ty);
        let target = 1.0 / (k as f32).sqrt();
        let blocks = k / 32 * rows;
        match ty {
            ROCMFP2 => {
                // affine: value = code * S - O; codes uniform 0..3 -> rms ~ 1.1 S with O = 1.5 S
                let s = ue4m3_near(target / 1.1);
                let o = ue4m3_near(1.5 * target / 1.1);
                self.random_blocks(blocks, 10, |b| b[8..].copy_from_slice(&[s, o]))
            }
            ROCMFP4 => {
                // codes: sign + magnitude {0,1,2,3,4,6,8,10} (rms ~5.1); two half scales
                let s = ue4m3_near(target / 5.1);
                self.random_blocks(blocks, 18, |b| b[16..].copy_from_slice(&[s, s]))
            }
            Q8_0 => {
                let d = half::f16::from_f32(target / 73.0).to_le_bytes();
                self.random_blocks(blocks, 34, |b| {
                    b[..2].copy_from_slice(&d);
                    // int8 codes in -127..=127
                    for q in &mut b[2..] {
                        if *q == 0x80 {
                            *q = 0x81;
                        }
                    }
                })
            }
            _ => (0..k * rows)
                .flat_map(|_| ((self.rng.gen::<f32>() * 2.0 - 1.0) * target * 1.7).to_le_bytes())
                .collect(),
        }
    }

    /// `blocks` blocks of `block` random bytes, each then passed to `fix` (its scale
    /// bytes). Filled in parallel, ~16 MiB per task, each task's generator seeded from
    /// one draw of the model's generator and the task's index (a 43-layer model is
    /// ~91 GB: one core is too slow, also for the page faults).
    fn random_blocks(
        &mut self,
        blocks: usize,
        block: usize,
        fix: impl Fn(&mut [u8]) + Sync,
    ) -> Vec<u8> {
        let mut out = vec![0u8; blocks * block];
        let base = self.rng.next_u64();
        let per_task = ((16 << 20) / block).max(1) * block;
        out.par_chunks_mut(per_task)
            .enumerate()
            .for_each(|(i, chunk)| {
                let mut rng =
                    StdRng::seed_from_u64(base ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                rng.fill_bytes(chunk);
                chunk.chunks_exact_mut(block).for_each(&fix);
            });
        out
    }

    fn floats(&mut self, n: usize, centre: f32, spread: f32) -> Vec<u8> {
        (0..n)
            .flat_map(|_| (centre + spread * (self.rng.gen::<f32>() * 2.0 - 1.0)).to_le_bytes())
            .collect()
    }
}

/// A byte-level BPE vocabulary of `vocab` tokens, so the file can be served and loads in
/// llama.cpp: the 256 byte symbols (GPT-2's byte-to-character map), "ĠĠ" and its merge,
/// fillers, and begin / end-of-sentence control tokens at the top.
fn synth_tokenizer(w: &mut GgufWriter, vocab: usize) -> Result<()> {
    if vocab < 260 {
        bail!("synth: a vocabulary of {vocab} tokens is too small for the byte-level tokenizer (>= 260)");
    }
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut shifted = 0;
    let mut tokens: Vec<(String, i32)> = (0u32..256)
        .map(|b| {
            let c = if printable(b) {
                b
            } else {
                shifted += 1;
                255 + shifted
            };
            (
                char::from_u32(c).unwrap_or('?').to_string(),
                tokenizer::NORMAL,
            )
        })
        .collect();
    tokens.push(("ĠĠ".into(), tokenizer::NORMAL));
    tokens.extend((tokens.len()..vocab - 2).map(|i| (format!("<synth{i}>"), tokenizer::NORMAL)));
    tokens.push(("<｜begin▁of▁sentence｜>".into(), tokenizer::CONTROL));
    tokens.push(("<｜end▁of▁sentence｜>".into(), tokenizer::CONTROL));
    tokenizer::write_bpe(w, tokens, vec![Value::String("Ġ Ġ".into())], "default");
    w.add_kv("tokenizer.ggml.bos_token_id", Value::U32(vocab as u32 - 2));
    w.add_kv("tokenizer.ggml.eos_token_id", Value::U32(vocab as u32 - 1));
    Ok(())
}

/// Sizes of what was written.
pub struct SynthBytes {
    pub total: u64,
    /// Weights one decoded token reads: every tensor except the routed experts and the
    /// embedding table, plus `n_expert_used` experts per layer and one embedding row.
    pub per_token: u64,
}

/// Writes the model; `progress(done, total)` per tensor. `mtp`: its MTP drafter file
/// instead (as `convert --mtp` lays one out): the same embedding, head and norms as the
/// model of this config and seed (the same bytes: the generator starts alike), then one
/// sliding-window block as layer `c.n_layer` and its `nextn.*` tensors.
pub fn synth(
    c: &Ds4Config,
    types: TypeMix,
    seed: u64,
    w: &mut GgufWriter,
    progress: &dyn Fn(usize, usize),
    mtp: bool,
) -> Result<SynthBytes> {
    let main = c;
    let mut with_block = c.clone();
    if mtp {
        with_block.n_layer += 1;
        with_block.compress_ratios.push(0);
        with_block.n_nextn = 1;
    }
    let c = &with_block;
    let layers: Vec<usize> = if mtp {
        vec![main.n_layer]
    } else {
        (0..main.n_layer).collect()
    };
    if [c.hidden, c.moe_ff, c.q_lora_rank]
        .iter()
        .any(|x| !x.is_multiple_of(32))
    {
        bail!("synth: hidden, expert and q_lora sizes must be multiples of 32");
    }
    metadata(w, c, "synthetic-deepseek-v4-flash");
    if types == TypeMix::StrixLean {
        w.add_kv("rocmfpx.fp2_mode", Value::String("affine".into()));
    }
    synth_tokenizer(w, c.vocab)?;
    let mut g = Gen {
        rng: StdRng::seed_from_u64(seed),
        mix: types,
    };
    let (d, hd, hc) = (c.hidden, c.head_dim, c.hc_mult);
    let mix = 2 * hc + hc * hc;
    let total = 6 + layers.len() * 30 + 4 * mtp as usize;
    let mut done = 0;
    let (mut bytes, mut per_token) = (0u64, 0u64);
    let mut add = |w: &mut GgufWriter, name: String, dims: &[usize], ty: u32, data: Vec<u8>| {
        let n = data.len() as u64;
        bytes += n;
        per_token += if name.ends_with("_exps.weight") {
            n / c.n_expert as u64 * c.n_expert_used as u64
        } else if name == "token_embd.weight" {
            n / c.vocab as u64
        } else {
            n
        };
        let dims: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
        w.add_tensor(&name, &dims, types.map(ty), data);
        done += 1;
        progress(done, total);
    };
    add(
        w,
        "token_embd.weight".into(),
        &[d, c.vocab],
        Q8_0,
        g.matrix(Q8_0, d, c.vocab),
    );
    add(
        w,
        "output.weight".into(),
        &[d, c.vocab],
        Q8_0,
        g.matrix(Q8_0, d, c.vocab),
    );
    add(
        w,
        "output_norm.weight".into(),
        &[d],
        F32,
        g.floats(d, 1.0, 0.2),
    );
    add(
        w,
        "output_hc_fn.weight".into(),
        &[hc * d, hc],
        F32,
        g.matrix(F32, hc * d, hc),
    );
    add(
        w,
        "output_hc_scale.weight".into(),
        &[1],
        F32,
        g.floats(1, 1.0, 0.5),
    );
    add(
        w,
        "output_hc_base.weight".into(),
        &[hc],
        F32,
        g.floats(hc, 0.0, 0.5),
    );
    for &l in &layers {
        let b = |s: &str| format!("blk.{l}.{s}");
        let (e, ff, k) = (c.n_expert, c.moe_ff, c.n_expert_used);
        for site in ["attn", "ffn"] {
            add(
                w,
                b(&format!("hc_{site}_fn.weight")),
                &[hc * d, mix],
                F32,
                g.matrix(F32, hc * d, mix),
            );
            add(
                w,
                b(&format!("hc_{site}_scale.weight")),
                &[3],
                F32,
                g.floats(3, 1.0, 0.5),
            );
            add(
                w,
                b(&format!("hc_{site}_base.weight")),
                &[mix],
                F32,
                g.floats(mix, 0.0, 0.5),
            );
        }
        add(w, b("attn_norm.weight"), &[d], F32, g.floats(d, 1.0, 0.2));
        add(w, b("ffn_norm.weight"), &[d], F32, g.floats(d, 1.0, 0.2));
        add(
            w,
            b("attn_q_a.weight"),
            &[d, c.q_lora_rank],
            ROCMFP4,
            g.matrix(ROCMFP4, d, c.q_lora_rank),
        );
        add(
            w,
            b("attn_q_a_norm.weight"),
            &[c.q_lora_rank],
            F32,
            g.floats(c.q_lora_rank, 1.0, 0.2),
        );
        let qb = c.n_head * hd;
        add(
            w,
            b("attn_q_b.weight"),
            &[c.q_lora_rank, qb],
            ROCMFP4,
            g.matrix(ROCMFP4, c.q_lora_rank, qb),
        );
        add(
            w,
            b("attn_kv.weight"),
            &[d, hd],
            ROCMFP4,
            g.matrix(ROCMFP4, d, hd),
        );
        add(
            w,
            b("attn_kv_a_norm.weight"),
            &[hd],
            F32,
            g.floats(hd, 1.0, 0.2),
        );
        let (gw, go) = (qb / c.o_groups, c.o_groups * c.o_lora_rank);
        add(
            w,
            b("attn_output_a.weight"),
            &[gw, go],
            ROCMFP4,
            g.matrix(ROCMFP4, gw, go),
        );
        add(
            w,
            b("attn_output_b.weight"),
            &[go, d],
            ROCMFP4,
            g.matrix(ROCMFP4, go, d),
        );
        add(
            w,
            b("attn_sinks.weight"),
            &[c.n_head],
            F32,
            g.floats(c.n_head, 0.0, 1.0),
        );
        let r = c.compress_ratios[l] as usize;
        if r > 0 {
            let csa = r == 4;
            let width = if csa { 2 * hd } else { hd };
            add(
                w,
                b("attn_compressor_kv.weight"),
                &[d, width],
                Q8_0,
                g.matrix(Q8_0, d, width),
            );
            add(
                w,
                b("attn_compressor_gate.weight"),
                &[d, width],
                Q8_0,
                g.matrix(Q8_0, d, width),
            );
            add(
                w,
                b("attn_compressor_ape.weight"),
                &[width, r],
                F32,
                g.floats(width * r, 0.0, 0.5),
            );
            add(
                w,
                b("attn_compressor_norm.weight"),
                &[hd],
                F32,
                g.floats(hd, 1.0, 0.2),
            );
            if csa {
                let (ih, id) = (c.index_heads, c.index_dim);
                add(
                    w,
                    b("indexer.attn_q_b.weight"),
                    &[c.q_lora_rank, ih * id],
                    Q8_0,
                    g.matrix(Q8_0, c.q_lora_rank, ih * id),
                );
                add(
                    w,
                    b("indexer.proj.weight"),
                    &[d, ih],
                    Q8_0,
                    g.matrix(Q8_0, d, ih),
                );
                add(
                    w,
                    b("indexer_compressor_kv.weight"),
                    &[d, 2 * id],
                    Q8_0,
                    g.matrix(Q8_0, d, 2 * id),
                );
                add(
                    w,
                    b("indexer_compressor_gate.weight"),
                    &[d, 2 * id],
                    Q8_0,
                    g.matrix(Q8_0, d, 2 * id),
                );
                add(
                    w,
                    b("indexer_compressor_ape.weight"),
                    &[2 * id, r],
                    F32,
                    g.floats(2 * id * r, 0.0, 0.5),
                );
                add(
                    w,
                    b("indexer_compressor_norm.weight"),
                    &[id],
                    F32,
                    g.floats(id, 1.0, 0.2),
                );
            }
        }
        add(
            w,
            b("ffn_gate_inp.weight"),
            &[d, e],
            F32,
            g.matrix(F32, d, e),
        );
        if l < c.n_hash {
            // Each token's k distinct experts.
            let mut tab = Vec::with_capacity(c.vocab * k * 4);
            for _ in 0..c.vocab {
                let mut ids: Vec<i32> = (0..e as i32).collect();
                for i in 0..k {
                    let j = g.rng.gen_range(i..e);
                    ids.swap(i, j);
                    tab.extend(ids[i].to_le_bytes());
                }
            }
            add(w, b("ffn_gate_tid2eid.weight"), &[k, c.vocab], I32, tab);
        } else {
            add(w, b("exp_probs_b.bias"), &[e], F32, g.floats(e, 0.0, 0.3));
        }
        // Routed experts (ROCmFP2), then the shared expert (ROCmFP4): gate, up, down.
        for (name, k_in, m_out) in [("gate", d, ff), ("up", d, ff), ("down", ff, d)] {
            add(
                w,
                b(&format!("ffn_{name}_exps.weight")),
                &[k_in, m_out, e],
                ROCMFP2,
                g.matrix(ROCMFP2, k_in, m_out * e),
            );
        }
        for (name, k_in, m_out) in [("gate", d, ff), ("up", d, ff), ("down", ff, d)] {
            add(
                w,
                b(&format!("ffn_{name}_shexp.weight")),
                &[k_in, m_out],
                ROCMFP4,
                g.matrix(ROCMFP4, k_in, m_out),
            );
        }
        if mtp {
            let nx = |s: &str| format!("blk.{l}.nextn.{s}");
            add(
                w,
                nx("eh_proj.weight"),
                &[2 * d, d],
                ROCMFP4,
                g.matrix(ROCMFP4, 2 * d, d),
            );
            for n in ["enorm", "hnorm", "shared_head_norm"] {
                add(
                    w,
                    nx(&format!("{n}.weight")),
                    &[d],
                    F32,
                    g.floats(d, 1.0, 0.2),
                );
            }
        }
    }
    Ok(SynthBytes {
        total: bytes,
        per_token,
    })
}
