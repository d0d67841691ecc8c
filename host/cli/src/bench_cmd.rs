//! `moeserve bench`: prefill and decode throughput of a model, measured the way
//! llama-bench does (pp: one batched pass over N prompt tokens; tg: N tokens decoded one
//! at a time), so the two can be put side by side. At context depths > 0 the slot is
//! first moved to that depth without running it (`CausalLm::seek`: the step reads as
//! many rows as a real one; DeepSeek-V4 fills them with unit-variance values, so its
//! attention and index scores are a filled context's). With `--limits` it also measures,
//! in the same run, the device's streaming bandwidth and ROCmFP2 matrix rate and reports
//! decode as a fraction of bytes-per-token / bandwidth (the faster of that stream and the
//! device-to-device copy the backend measured) and prefill as a fraction of the matrix
//! rate.

use std::{path::Path, sync::Arc, time::Instant};

use anyhow::{bail, Context, Result};
use moe_engine::{device::Device, sampling::argmax, BatchEntry, LoadOptions, StepTraffic};
use moe_plugin_api::{ops, OpParams, TensorRef};
use serde_json::json;

use crate::model_source::ModelSource;

pub struct BenchArgs {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub repetitions: usize,
    pub json: bool,
    /// Context depths to measure at.
    pub depths: Vec<usize>,
    /// Build this many layers from the file's (deepseek4 synthetic models).
    pub layers: Option<usize>,
    /// Measure the bandwidth and matrix-rate limits.
    pub limits: bool,
    /// Drafts a decode pass carries, every one taken (0: one token a pass).
    pub draft: usize,
    /// (depth, tokens): from that depth on the prefill pass holds that many tokens.
    pub long_prompt: Option<(usize, usize)>,
    /// More draft counts measured at each depth after the main run (one model build).
    pub more_drafts: Vec<usize>,
    /// The least context the caches are sized for (0: what the run needs).
    pub ctx: usize,
}

impl BenchArgs {
    /// Prompt tokens of the prefill pass at `depth`.
    fn prompt_at(&self, depth: usize) -> usize {
        match self.long_prompt {
            Some((from, n)) if depth >= from => n,
            _ => self.prompt_tokens,
        }
    }
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let m = v.iter().sum::<f64>() / v.len() as f64;
    let var = v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (v.len().max(2) - 1) as f64;
    (m, var.sqrt())
}

/// The worker threads the report names: the CPU backend's device description ends in
/// "(N threads)", the count its pool really runs (the plugin's `threads` setting, else
/// MOE_CPU_THREADS when a positive number, else one per core); other devices: "n/a".
fn threads_used(device: &str) -> String {
    device
        .strip_suffix(" threads)")
        .and_then(|s| s.rsplit_once('('))
        .map(|(_, n)| n.to_string())
        .unwrap_or_else(|| "n/a".into())
}

/// Streaming bandwidth: `out = a + b` over 3 x 1 GiB (read 2, write 1), bytes moved / s.
fn stream_bandwidth(dev: &Arc<Device>) -> Result<f64> {
    let n = 1u64 << 28;
    let (a, b, c) = (
        dev.f32([n, 1, 1, 1])?,
        dev.f32([n, 1, 1, 1])?,
        dev.f32([n, 1, 1, 1])?,
    );
    Ok(3.0 * 4.0 * n as f64 * runs_per_second(dev, ops::ADD, &[a.r, b.r, c.r], 20)?)
}

/// Runs `op` on `args` twice to warm up, then `reps` times timed: runs per second.
fn runs_per_second(dev: &Arc<Device>, op: u32, args: &[TensorRef], reps: usize) -> Result<f64> {
    let run = |reps: usize| -> Result<f64> {
        let t = Instant::now();
        for _ in 0..reps {
            dev.op(op, OpParams::default(), args)?;
        }
        dev.sync()?;
        Ok(t.elapsed().as_secs_f64())
    };
    run(2)?;
    Ok(reps as f64 / run(reps)?)
}

/// ROCmFP2 (type 107, affine) MATMUL rate on 512 columns: flop/s of a [4096 x 16384]
/// product (weights from a fixed pseudo-random byte pattern; the kernel's speed does
/// not depend on the values).
fn matrix_rate(dev: &Arc<Device>) -> Result<f64> {
    let (k, m, n) = (4096u64, 16384u64, 512u64);
    let bytes = k * m / 32 * 10;
    let mut w = dev.tensor(107, [k, m, 1, 1], bytes)?;
    w.r.variant = 2;
    let data: Vec<u8> = (0..bytes)
        .map(|i| {
            // Scale bytes (8, 9 of each 10-byte block) kept small and valid (< 0x7f).
            let v = (i.wrapping_mul(2654435761) >> 13) as u8;
            if i % 10 >= 8 {
                0x30 | (v & 0x0f)
            } else {
                v
            }
        })
        .collect();
    w.upload(&data)?;
    let x = dev.f32([k, n, 1, 1])?;
    x.upload_f32(
        &(0..k * n)
            .map(|i| ((i % 97) as f32 - 48.0) / 64.0)
            .collect::<Vec<_>>(),
    )?;
    let out = dev.f32([m, n, 1, 1])?;
    Ok(2.0 * (k * m * n) as f64 * runs_per_second(dev, ops::MATMUL, &[w.r, x.r, out.r], 10)?)
}

/// Weight bytes / s of one dense mat-vec (a single column, `reps` runs) with weights of
/// type `ty` ([k, m], `row_bytes` per row, pseudo-random bytes).
fn matvec_rate(dev: &Arc<Device>, ty: u32, k: u64, m: u64, row_bytes: u64) -> Result<f64> {
    let bytes = row_bytes * m;
    let w = dev.tensor(ty, [k, m, 1, 1], bytes)?;
    // Bytes that decode to finite values in every type (small scales, small codes).
    w.upload(&(0..bytes).map(|i| 0x11 + (i % 7) as u8).collect::<Vec<_>>())?;
    let x = dev.f32([k, 1, 1, 1])?;
    let out = dev.f32([m, 1, 1, 1])?;
    Ok(bytes as f64 * runs_per_second(dev, ops::MATMUL, &[w.r, x.r, out.r], 20)?)
}

/// The decode limit's bandwidth from the backend's device-to-device copy and our
/// streaming add: the faster of those measured, so that a slow measuring kernel never
/// flatters the fraction (on an H200 the runtime's copy moves ~25% more than the add).
fn limit_bandwidth(copy: Option<f64>, stream: Option<f64>) -> Option<f64> {
    match (copy, stream) {
        (Some(c), Some(s)) => Some(c.max(s)),
        (c, s) => c.or(s),
    }
}

/// Decode tok/s at the memory's limit for passes of `draft` drafts, all taken: `bw` over
/// the bytes a pass reads (`StepTraffic::pass_bytes`: each token's routed experts, none
/// shared) times its tokens; one token a step for 0 drafts. None without a bandwidth
/// measurement (`--limits`) or traffic figures.
fn pass_limit(t: &StepTraffic, bw: Option<f64>, draft: usize) -> Option<f64> {
    let tokens = draft as u64 + 1;
    let bytes = t.pass_bytes(tokens);
    bw.filter(|_| bytes > 0)
        .map(|b| b * tokens as f64 / bytes as f64)
}

struct Row {
    depth: usize,
    pp_tokens: usize,
    /// The main run (--draft).
    run: Measured,
    /// The --more-drafts runs at this depth.
    drafted: Vec<Measured>,
    traffic: Option<StepTraffic>,
}

/// One depth's prefill and decode rounds with `draft` drafts a decode pass.
struct Measured {
    draft: usize,
    pp: (f64, f64),
    tg: (f64, f64),
    /// Of the measured decode time: seconds in the drafter's chains, all seconds, passes.
    chain_s: f64,
    tg_s: f64,
    passes: usize,
}

impl Measured {
    /// Where a drafted pass's time goes: the chain (MTP) and the pass itself.
    fn split(&self) -> String {
        let per = |s: f64| 1e3 * s / self.passes.max(1) as f64;
        format!(
            "{} passes, {:.3} ms each: chain {:.3} ms, pass {:.3} ms",
            self.passes,
            per(self.tg_s),
            per(self.chain_s),
            per(self.tg_s - self.chain_s)
        )
    }
}

/// A warm-up round, then `a.repetitions` measured ones of: the slot moved to `depth`,
/// `prompt` prefilled in one pass, `a.gen_tokens` decoded in passes of a token and
/// `draft` drafts (all taken; with a drafter loaded, its chain runs before each pass).
fn measure(
    m: &mut moe_engine::LoadedModel,
    a: &BenchArgs,
    depth: usize,
    prompt: &[u32],
    draft: usize,
) -> Result<Measured> {
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    let (mut chain_s, mut tg_s, mut passes) = (0.0, 0.0, 0);
    for rep in 0..=a.repetitions {
        if depth > 0 {
            m.model
                .seek(0, depth)
                .with_context(|| format!("moving to depth {depth}"))?;
        }
        let entries: Vec<BatchEntry> = prompt
            .iter()
            .enumerate()
            .map(|(i, &token)| BatchEntry {
                token,
                slot: 0,
                pos: (depth + i) as u32,
                want_logits: i + 1 == prompt.len(),
                draft: false,
            })
            .collect();
        let t0 = Instant::now();
        let mut logits = m.model.forward(&entries)?.pop().context("no logits")?;
        let dt_pp = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let mut i = 0;
        let mtp = m.model.has_drafter();
        while i < a.gen_tokens {
            // The sure token, then drafts (the same id; all taken).
            let n = (1 + draft).min(a.gen_tokens - i);
            let token = argmax(&logits);
            if n > 1 && mtp {
                // The drafter's chain runs too (its cost counts), its guesses not used.
                let p0 = depth + prompt.len() + i;
                let tc = Instant::now();
                m.model.draft_logits(0, token, p0, n - 1, 0.0)?;
                if rep > 0 {
                    chain_s += tc.elapsed().as_secs_f64();
                }
            }
            let pass: Vec<BatchEntry> = (0..n)
                .map(|j| BatchEntry {
                    token,
                    slot: 0,
                    pos: (depth + prompt.len() + i + j) as u32,
                    want_logits: true,
                    draft: j > 0,
                })
                .collect();
            logits = m.model.forward(&pass)?.pop().context("no logits")?;
            passes += usize::from(rep > 0);
            i += n;
        }
        let dt_tg = t1.elapsed().as_secs_f64();
        if rep > 0 {
            pp.push(prompt.len() as f64 / dt_pp);
            tg.push(a.gen_tokens as f64 / dt_tg);
            tg_s += dt_tg;
        }
    }
    Ok(Measured {
        draft,
        pp: mean_sd(&pp),
        tg: mean_sd(&tg),
        chain_s,
        tg_s,
        passes,
    })
}

pub fn run(config: &Path, source: &ModelSource, a: &BenchArgs) -> Result<()> {
    if a.depths.is_empty() || a.depths.iter().any(|&d| a.prompt_at(d) == 0) {
        bail!("bench: need at least one depth and one prompt token");
    }
    if a.repetitions == 0 {
        bail!("bench: --repetitions must be at least 1 (a warm-up round runs before them)");
    }
    let deepest = a.depths.iter().max().copied().unwrap_or(0);
    let longest = a.depths.iter().map(|&d| a.prompt_at(d)).max().unwrap_or(0);
    let n_ctx = [deepest, longest, a.gen_tokens, 8]
        .into_iter()
        .try_fold(0usize, |s, v| s.checked_add(v))
        .map(|n| n.max(a.ctx))
        .filter(|&n| n <= 1 << 24)
        .with_context(|| {
            format!(
                "bench: depth {deepest} + {} prompt + {} generated tokens (or --ctx-size {}) is \
                 past any context (at most 16M positions)",
                longest, a.gen_tokens, a.ctx
            )
        })?;
    let opts = LoadOptions {
        n_ctx,
        n_slots: 1,
        repeat_layers: a.layers,
        mtp: None,
    };
    let t_load = Instant::now();
    let mut m = source.load(config, &opts)?;
    eprintln!("bench: loaded in {:.1} s", t_load.elapsed().as_secs_f64());
    if let Some(&d) = std::iter::once(&a.draft)
        .chain(&a.more_drafts)
        .find(|&&d| d > m.model.max_draft())
    {
        bail!(
            "bench: {d} drafts a pass: this model drops at most {} drafts a pass",
            m.model.max_draft()
        );
    }
    let vocab = m.model.n_vocab() as u32;
    // Deterministic pseudo-random prompt ids, avoiding the first few (special) ids where
    // the vocabulary is large enough to.
    let skip = if vocab > 200 { 100 } else { 0 };
    let prompt_all: Vec<u32> = (0..longest as u32)
        .map(|i| skip + (i.wrapping_mul(2654435761) % (vocab - skip).max(1)))
        .collect();
    let mut rows = Vec::new();
    for &depth in &a.depths {
        let prompt = &prompt_all[..a.prompt_at(depth)];
        let run = measure(&mut m, a, depth, prompt, a.draft)?;
        let mut drafted = Vec::new();
        for &d in &a.more_drafts {
            let r = measure(&mut m, a, depth, prompt, d)?;
            eprintln!(
                "bench: depth {depth}: tg{} {:.1} tok/s with {d} drafts a pass, all taken: {}",
                a.gen_tokens,
                r.tg.0,
                r.split()
            );
            drafted.push(r);
        }
        let row = Row {
            depth,
            pp_tokens: prompt.len(),
            run,
            drafted,
            traffic: m
                .model
                .step_traffic(depth + prompt.len() + a.gen_tokens / 2),
        };
        eprintln!(
            "bench: depth {depth}: pp{} {:.1} tok/s, tg{} {:.1} tok/s",
            prompt.len(),
            row.run.pp.0,
            a.gen_tokens,
            row.run.tg.0
        );
        if a.draft > 0 {
            eprintln!("bench: depth {depth}: {}", row.run.split());
        }
        rows.push(row);
    }
    let dev = m.model.device().clone();
    let (bw, rate) = if a.limits {
        (Some(stream_bandwidth(&dev)?), Some(matrix_rate(&dev)?))
    } else {
        (None, None)
    };
    // The device-to-device copy bandwidth the backend reports for this device (CUDA:
    // the runtime's copy of 256 MiB, timed when it listed its devices in this process;
    // the CPU: a timed 64 MiB copy; HIP: the datasheet figure).
    let copy = a
        .limits
        .then(|| dev.info().map(|i| i.bandwidth_bytes_per_s))
        .flatten()
        .filter(|b| b.is_finite() && *b > 0.0);
    let lim_bw = limit_bandwidth(copy, bw);
    // The dense mat-vec's own read rate on the shapes decode runs (output head, the
    // attention's wide and narrow products, an mHC mix).
    let mut dense = Vec::new();
    if a.limits {
        for (what, ty, k, m, rb) in [
            ("q8_0 4096x129280", 8, 4096, 129280, 4096 / 32 * 34),
            ("rocmfp4 1024x32768", 100, 1024, 32768, 1024 / 32 * 18),
            ("rocmfp4 8192x4096", 100, 8192, 4096, 8192 / 32 * 18),
            ("f32 16384x24", 0, 16384, 24, 16384 * 4),
        ] {
            dense.push(json!({"shape": what, "bytes_s": matvec_rate(&dev, ty, k, m, rb)?}));
        }
    }
    // What each plugin says of itself (e.g. which SIMD kernels it picked on this CPU).
    let plugins: Vec<String> = moe_plugin_host::Registry::from_config_file(config)?
        .plugins
        .iter()
        .map(|p| format!("{}: {}", p.info.name, p.info.description))
        .collect();
    let threads = threads_used(&dev.description());
    let depth_json: Vec<_> = rows
        .iter()
        .map(|r| {
            let t = r.traffic.unwrap_or_default();
            // The main run's limit at its draft count (one token a step without drafts),
            // and the same from the stream add alone (the tables before 2026-12-07 20:30).
            let limit = pass_limit(&t, lim_bw, r.run.draft);
            let stream_limit = pass_limit(&t, bw, r.run.draft);
            let pp_flops = 2.0 * t.weight_params as f64 * r.run.pp.0;
            json!({
                "depth": r.depth, "pp_tokens": r.pp_tokens,
                "pp_tok_s": r.run.pp.0, "pp_tok_s_sd": r.run.pp.1,
                "tg_tok_s": r.run.tg.0, "tg_tok_s_sd": r.run.tg.1,
                "tg_split": r.run.split(),
                "tg_drafted": r.drafted.iter().map(|d| {
                    let limit = pass_limit(&t, lim_bw, d.draft);
                    json!({
                        "drafts": d.draft, "tg_tok_s": d.tg.0, "passes": d.passes,
                        "chain_s": d.chain_s, "decode_s": d.tg_s,
                        "limit_tok_s": limit, "fraction_of_limit": limit.map(|l| d.tg.0 / l),
                    })
                }).collect::<Vec<_>>(),
                "routed_bytes_per_token": t.routed_bytes,
                "weight_bytes_per_token": t.weight_bytes, "cache_bytes_per_token": t.cache_bytes,
                "weight_params_per_token": t.weight_params,
                "tg_limit_tok_s": limit,
                "tg_fraction_of_limit": limit.map(|l| r.run.tg.0 / l),
                "tg_stream_limit_tok_s": stream_limit,
                "tg_fraction_of_stream_limit": stream_limit.map(|l| r.run.tg.0 / l),
                "pp_weight_flop_s": pp_flops,
                "pp_fraction_of_matrix_rate": rate.map(|x| pp_flops / x),
            })
        })
        .collect();
    if a.json {
        println!(
            "{}",
            json!({
                "engine": "moeserve", "model": source.describe(), "arch": m.arch,
                "device": dev.name(), "layers": a.layers,
                "threads": threads, "repetitions": a.repetitions,
                "pp_tokens": a.prompt_tokens, "pp_tok_s": rows[0].run.pp.0, "pp_tok_s_sd": rows[0].run.pp.1,
                "tg_tokens": a.gen_tokens, "tg_tok_s": rows[0].run.tg.0, "tg_tok_s_sd": rows[0].run.tg.1,
                "tg_drafts_a_pass": a.draft,
                "tg_drafts_from_mtp": m.model.has_drafter(),
                "stream_bandwidth_bytes_s": bw, "copy_bandwidth_bytes_s": copy,
                "limit_bandwidth_bytes_s": lim_bw, "matrix_rate_flop_s": rate,
                "dense_matvec": dense,
                "depths": depth_json,
                "kernels": dev.counters(),
                "plugins": plugins,
            })
        );
    } else {
        println!("| model | threads | depth | test | tok/s | fraction of limit |");
        println!("| --- | --- | --- | --- | --- | --- |");
        for (r, j) in rows.iter().zip(&depth_json) {
            let frac = |k: &str| {
                j[k].as_f64()
                    .map_or("-".into(), |f| format!("{:.1}%", 100.0 * f))
            };
            println!(
                "| {} | {threads} | {} | pp{} | {:.1} ± {:.1} | {} of matrix rate |",
                m.name,
                r.depth,
                r.pp_tokens,
                r.run.pp.0,
                r.run.pp.1,
                frac("pp_fraction_of_matrix_rate")
            );
            let drafts = |d: usize| match d {
                0 => String::new(),
                d if m.model.has_drafter() => {
                    format!(" ({d} drafts a pass from the MTP block, all taken)")
                }
                d => format!(" ({d} drafts a pass, all taken)"),
            };
            println!(
                "| {} | {threads} | {} | tg{}{} | {:.1} ± {:.1} | {} of bandwidth limit |",
                m.name,
                r.depth,
                a.gen_tokens,
                drafts(a.draft),
                r.run.tg.0,
                r.run.tg.1,
                frac("tg_fraction_of_limit")
            );
            // --more-drafts: each against its own pass's limit.
            for (d, dj) in r
                .drafted
                .iter()
                .zip(j["tg_drafted"].as_array().into_iter().flatten())
            {
                let f = dj["fraction_of_limit"]
                    .as_f64()
                    .map_or("-".into(), |f| format!("{:.1}%", 100.0 * f));
                println!(
                    "| {} | {threads} | {} | tg{}{} | {:.1} ± {:.1} | {f} of bandwidth limit |",
                    m.name,
                    r.depth,
                    a.gen_tokens,
                    drafts(d.draft),
                    d.tg.0,
                    d.tg.1,
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{limit_bandwidth, pass_limit, threads_used};
    use moe_engine::StepTraffic;

    #[test]
    fn the_limit_takes_the_faster_measured_bandwidth() {
        assert_eq!(limit_bandwidth(Some(4.2e12), Some(3.4e12)), Some(4.2e12));
        assert_eq!(limit_bandwidth(Some(2.0e10), Some(9.0e10)), Some(9.0e10));
        assert_eq!(limit_bandwidth(None, Some(3.4e12)), Some(3.4e12));
        assert_eq!(limit_bandwidth(Some(4.2e12), None), Some(4.2e12));
        assert_eq!(limit_bandwidth(None, None), None);
    }

    #[test]
    fn a_drafted_pass_reads_each_tokens_experts_and_the_rest_once() {
        let t = StepTraffic {
            weight_bytes: 100,
            routed_bytes: 30,
            cache_bytes: 10,
            weight_params: 0,
        };
        // One token: all 110 bytes; four: 70 shared + 4 x (30 + 10).
        assert_eq!((t.pass_bytes(1), t.pass_bytes(4)), (110, 230));
        let near = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-9);
        assert!(near(pass_limit(&t, Some(1000.0), 0), 1000.0 / 110.0));
        assert!(near(pass_limit(&t, Some(1000.0), 3), 4000.0 / 230.0));
        assert_eq!(pass_limit(&t, None, 3), None);
        assert_eq!(pass_limit(&StepTraffic::default(), Some(1000.0), 0), None);
    }

    #[test]
    fn threads_come_from_the_cpu_backends_description() {
        assert_eq!(threads_used("Intel(R) Xeon(R) Gold (16 threads)"), "16");
        assert_eq!(threads_used("AMD EPYC 9654 (2 threads)"), "2");
        assert_eq!(threads_used("NVIDIA H200"), "n/a");
        assert_eq!(threads_used("cuda:0"), "n/a");
    }
}
