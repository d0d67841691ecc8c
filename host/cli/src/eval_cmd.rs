//! `moeserve logits` and `moeserve generate`: run a model without the server.

use std::{io::Write, path::Path, time::Instant};

use anyhow::{bail, Context, Result};
use moe_engine::{load, npy, sampling::argmax, BatchEntry, LoadOptions, LoadedModel};
use moe_plugin_host::Registry;

pub fn load_model(config: &Path, model: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let reg = Registry::from_config_file(config)?;
    load(&reg, model, opts)
}

fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .filter(|t| !t.trim().is_empty())
        .map(|t| {
            t.trim()
                .parse::<u32>()
                .with_context(|| format!("bad token id '{t}'"))
        })
        .collect()
}

/// Logits for every position, by batched prefill or token-by-token decode.
pub fn logits(
    config: &Path,
    source: &crate::model_source::ModelSource,
    tokens: &str,
    out: &Path,
    mode: &str,
    layers: Option<usize>,
) -> Result<()> {
    let toks = parse_tokens(tokens)?;
    if toks.is_empty() {
        bail!("--tokens is empty");
    }
    let inputs: Vec<&Path> = source.model.as_deref().into_iter().collect();
    crate::out_path::check_out(out, &inputs)?;
    let mut m = source.load(
        config,
        &LoadOptions {
            // (room for a drafted pass past the last token)
            n_ctx: (toks.len() + MAX_CHECK_DRAFTS).max(16),
            n_slots: 1,
            repeat_layers: layers,
            mtp: None,
        },
    )?;
    let entries = BatchEntry::prompt(&toks, 0, true);
    let rows = match mode {
        "draft" => drafted_passes(&mut *m.model, &toks, |_, _| Ok(()))?,
        "mtp-draft" => mtp_at_passes(&mut *m.model, &toks)?,
        "mtp" | "mtp-prefill" => mtp_rows(&mut *m.model, &toks, mode == "mtp")?,
        "prefill" => m.model.forward(&entries)?,
        "decode" => {
            let mut rows = Vec::new();
            for e in &entries {
                rows.extend(m.model.forward(std::slice::from_ref(e))?);
            }
            rows
        }
        other => bail!(
            "--mode must be prefill, decode, draft, mtp, mtp-prefill or mtp-draft, not '{other}'"
        ),
    };
    let vocab = m.model.n_vocab();
    let flat: Vec<f32> = rows.concat();
    // whole or not at all: a failed write leaves an earlier file as it was
    moe_gguf::write_atomic(out, |mut w| {
        npy::write_f32(&mut w, &[rows.len(), vocab], &flat)
    })
    .with_context(|| format!("writing {}", out.display()))?;
    eprintln!("wrote {} x {vocab} logits to {}", rows.len(), out.display());
    Ok(())
}

/// Steps of the drafter's chain after the last token in `logits --mode mtp`.
const MTP_CHAIN: usize = 4;

/// `logits --mode mtp` / `mtp-prefill`: the MTP drafter's logits (`--mtp FILE`). `mtp`:
/// row p (one per token) is its guess after token p paired with the target's state at
/// p - 1 (the target runs one token at a time in between), and after the last token the
/// chain goes on for MTP_CHAIN - 1 more steps, each fed the greedy guess and the block's
/// own state. `mtp-prefill`: the target prefills all but the last token in one pass,
/// then only the MTP_CHAIN rows of the chain from the last token.
fn mtp_rows(
    model: &mut dyn moe_engine::CausalLm,
    toks: &[u32],
    one_by_one: bool,
) -> Result<Vec<Vec<f32>>> {
    if !model.has_drafter() {
        bail!("--mode mtp needs --mtp FILE (a deepseek4 next-token-prediction GGUF)");
    }
    let last = toks.len() - 1;
    let draft = |m: &mut dyn moe_engine::CausalLm, p: usize, k: usize| {
        m.draft_logits(0, toks[p], p, k, 0.0)?
            .ok_or_else(|| anyhow::anyhow!("the model stopped drafting"))
    };
    let mut rows = Vec::new();
    if !one_by_one {
        if last > 0 {
            model.forward(&BatchEntry::prompt(&toks[..last], 0, false))?;
        }
        return draft(model, last, MTP_CHAIN);
    }
    for (p, &t) in toks.iter().enumerate() {
        let k = if p == last { MTP_CHAIN } else { 1 };
        rows.extend(draft(model, p, k)?);
        if p < last {
            model.forward(&[BatchEntry {
                token: t,
                slot: 0,
                pos: p as u32,
                want_logits: false,
                draft: false,
            }])?;
        }
    }
    Ok(rows)
}

/// `logits --mode mtp-draft`: the MTP drafter's first guess where each pass of `--mode
/// draft`'s schedule starts (the slot goes back into passes whose made-up drafts were
/// dropped, and the drafter drafts from there): row t is its guess after token t where
/// a pass starts at t, NaN elsewhere. Those rows must be `--mode mtp`'s: the drafter
/// sees only accepted positions.
fn mtp_at_passes(model: &mut dyn moe_engine::CausalLm, toks: &[u32]) -> Result<Vec<Vec<f32>>> {
    if !model.has_drafter() {
        bail!("--mode mtp-draft needs --mtp FILE (a deepseek4 next-token-prediction GGUF)");
    }
    let mut rows = vec![vec![f32::NAN; model.n_vocab()]; toks.len()];
    drafted_passes(model, toks, |m, t| {
        let mut guess = m
            .draft_logits(0, toks[t], t, 1, 0.0)?
            .ok_or_else(|| anyhow::anyhow!("the model stopped drafting"))?;
        rows[t] = guess.pop().unwrap_or_default();
        Ok(())
    })?;
    Ok(rows)
}

/// The most drafts a pass of `logits --mode draft` carries.
const MAX_CHECK_DRAFTS: usize = 7;

/// `logits --mode draft`: every position's logits from passes as speculative decoding
/// runs them. Each pass is the next sure token and k drafts (k = the model's limit, at
/// most MAX_CHECK_DRAFTS), of which the first `a` are the sequence's own next tokens and
/// the rest made up (`a` cycles through 0..=k); the rows up to the first made-up draft
/// are kept, and the next pass starts there, so the model must drop the made-up drafts.
/// The rows must equal `--mode decode`'s.
fn drafted_passes(
    model: &mut dyn moe_engine::CausalLm,
    toks: &[u32],
    mut at_pass: impl FnMut(&mut dyn moe_engine::CausalLm, usize) -> Result<()>,
) -> Result<Vec<Vec<f32>>> {
    let k = model.max_draft().min(MAX_CHECK_DRAFTS);
    if k == 0 {
        bail!(
            "this model takes no drafted tokens (deepseek4: only on the device-resident forward)"
        );
    }
    let vocab = model.n_vocab() as u32;
    let entry = |token, pos: usize, draft| BatchEntry {
        token,
        slot: 0,
        pos: pos as u32,
        want_logits: true,
        draft,
    };
    let (mut rows, mut t, mut pass) = (Vec::new(), 0, 0);
    while t < toks.len() {
        let a = pass % (k + 1);
        let mut batch = vec![entry(toks[t], t, false)];
        for j in 1..=k {
            let q = t + j;
            let real = toks.get(q).copied();
            let token = match real {
                Some(r) if j <= a => r,
                // made up: any id but the real one
                _ => {
                    let x = (q as u32).wrapping_mul(2_654_435_761) % vocab;
                    if Some(x) == real {
                        (x + 1) % vocab
                    } else {
                        x
                    }
                }
            };
            batch.push(entry(token, q, true));
        }
        let keep = (a + 1).min(toks.len() - t);
        at_pass(model, t)?;
        rows.extend(model.forward(&batch)?.into_iter().take(keep));
        t += keep;
        pass += 1;
    }
    Ok(rows)
}

/// Greedy continuation of a prompt (chat-formatted unless --raw), with timings.
pub struct GenerateArgs {
    pub prompt: Option<String>,
    /// Comma-separated prompt ids (instead of a text prompt).
    pub prompt_tokens: Option<String>,
    pub max_tokens: usize,
    pub raw: bool,
    /// Print the generated ids (comma-separated) instead of text.
    pub ids: bool,
    /// Positions the cache holds.
    pub ctx_size: usize,
}

pub fn generate(config: &Path, model: &Path, a: &GenerateArgs) -> Result<()> {
    let (n, raw) = (a.max_tokens, a.raw);
    let mut m = load_model(
        config,
        model,
        &LoadOptions {
            n_ctx: a.ctx_size.max(1),
            n_slots: 1,
            repeat_layers: None,
            mtp: None,
        },
    )?;
    let ctx = m.model.n_ctx();
    let tokenizer = m.tokenizer.clone();
    let need_tok = || {
        tokenizer
            .clone()
            .context("the model has no tokenizer; give --prompt-tokens and --ids")
    };
    if !a.ids {
        need_tok()?; // before any work: printing text needs the tokenizer
    }
    let toks = match (&a.prompt, &a.prompt_tokens) {
        (_, Some(ids)) => parse_tokens(ids)?,
        (Some(prompt), None) => {
            let text = if raw {
                prompt.to_string()
            } else {
                let msgs = [moe_tokenizer::ChatMessage::new("user", prompt.as_str())];
                need_tok()?.apply_chat_template(&msgs, true)?
            };
            need_tok()?.encode(&text, true, true)?
        }
        (None, None) => bail!("give --prompt or --prompt-tokens"),
    };
    if toks.is_empty() {
        bail!("the prompt is empty");
    }
    if toks.len() >= ctx {
        bail!(
            "the prompt has {} tokens; the context holds {ctx} (--ctx-size)",
            toks.len()
        );
    }
    let t0 = Instant::now();
    let entries = BatchEntry::prompt(&toks, 0, false);
    let mut logits = m.model.forward(&entries)?.pop().context("no logits")?;
    let prefill = t0.elapsed();
    let mut dec = moe_tokenizer::StreamDecoder::new();
    let t1 = Instant::now();
    let mut made = 0;
    for i in 0..n {
        let id = argmax(&logits);
        if tokenizer
            .as_ref()
            .is_some_and(|t| t.is_end_of_generation(id))
        {
            break;
        }
        if a.ids {
            print!("{}{id}", if made == 0 { "" } else { "," });
        } else {
            print!("{}", dec.push(&*need_tok()?, id));
        }
        std::io::stdout().flush()?;
        made += 1;
        if i + 1 == n {
            break; // (no step past the last token printed)
        }
        if toks.len() + i >= ctx {
            eprintln!("\nstopped: the context of {ctx} positions is full (--ctx-size)");
            break;
        }
        let e = BatchEntry {
            token: id,
            slot: 0,
            pos: (toks.len() + i) as u32,
            want_logits: true,
            draft: false,
        };
        logits = m.model.forward(&[e])?.pop().context("no logits")?;
    }
    println!("{}", if a.ids { String::new() } else { dec.finish() });
    let dt = t1.elapsed().as_secs_f64();
    eprintln!(
        "prefill {} tokens in {:.1} ms ({:.1} tok/s); decode {made} tokens in {:.1} ms ({:.1} tok/s)",
        toks.len(),
        prefill.as_secs_f64() * 1e3,
        toks.len() as f64 / prefill.as_secs_f64(),
        dt * 1e3,
        made as f64 / dt.max(1e-9)
    );
    Ok(())
}
