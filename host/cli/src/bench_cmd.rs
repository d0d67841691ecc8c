//! `moeserve bench`: prefill and decode throughput of a model, measured the way
//! llama-bench does (pp: one batched pass over N prompt tokens; tg: N tokens decoded one
//! at a time), so the two can be put side by side.

use std::{path::Path, time::Instant};

use anyhow::{Context, Result};
use moe_engine::{sampling::argmax, BatchEntry, LoadOptions};
use serde_json::json;

pub struct BenchArgs {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub repetitions: usize,
    pub json: bool,
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len().max(2) - 1) as f64;
    (m, var.sqrt())
}

pub fn run(config: &Path, model: &Path, a: &BenchArgs) -> Result<()> {
    let n_ctx = (a.prompt_tokens + a.gen_tokens + 8).next_power_of_two();
    let mut m = crate::eval_cmd::load_model(config, model, &LoadOptions { n_ctx, n_slots: 1 })?;
    let vocab = m.model.n_vocab() as u32;
    // Deterministic pseudo-random prompt ids, avoiding the first few (special) ids.
    let prompt: Vec<u32> = (0..a.prompt_tokens as u32)
        .map(|i| 100 + (i.wrapping_mul(2654435761) % (vocab - 100)))
        .collect();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    // One warm-up round, then the measured ones.
    for rep in 0..=a.repetitions {
        let entries = BatchEntry::prompt(&prompt, 0, false);
        let t0 = Instant::now();
        let mut logits = m.model.forward(&entries)?.pop().context("no logits")?;
        let dt_pp = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for i in 0..a.gen_tokens {
            let e = BatchEntry {
                token: argmax(&logits),
                slot: 0,
                pos: (prompt.len() + i) as u32,
                want_logits: true,
            };
            logits = m.model.forward(&[e])?.pop().context("no logits")?;
        }
        let dt_tg = t1.elapsed().as_secs_f64();
        if rep > 0 {
            pp.push(a.prompt_tokens as f64 / dt_pp);
            tg.push(a.gen_tokens as f64 / dt_tg);
        }
    }
    let (pp_m, pp_sd) = mean_sd(&pp);
    let (tg_m, tg_sd) = mean_sd(&tg);
    // What each plugin says of itself (e.g. which SIMD kernels it picked on this CPU).
    let plugins: Vec<String> = moe_plugin_host::Registry::from_config_file(config)?
        .plugins
        .iter()
        .map(|p| format!("{}: {}", p.info.name, p.info.description))
        .collect();
    let threads = std::env::var("MOE_CPU_THREADS").unwrap_or_else(|_| "all".into());
    if a.json {
        println!(
            "{}",
            json!({
                "engine": "moeserve", "model": model.display().to_string(), "arch": m.arch,
                "threads": threads, "repetitions": a.repetitions,
                "pp_tokens": a.prompt_tokens, "pp_tok_s": pp_m, "pp_tok_s_sd": pp_sd,
                "tg_tokens": a.gen_tokens, "tg_tok_s": tg_m, "tg_tok_s_sd": tg_sd,
                "kernels": m.model.device().counters(),
                "plugins": plugins,
            })
        );
    } else {
        println!("| model | threads | test | tok/s |");
        println!("| --- | --- | --- | --- |");
        println!(
            "| {} | {threads} | pp{} | {pp_m:.1} ± {pp_sd:.1} |",
            m.name, a.prompt_tokens
        );
        println!(
            "| {} | {threads} | tg{} | {tg_m:.1} ± {tg_sd:.1} |",
            m.name, a.gen_tokens
        );
    }
    Ok(())
}
