//! `moeserve serve`: load a model and answer the OpenAI-compatible API.

use std::{net::SocketAddr, path::PathBuf};

use anyhow::{Context, Result};
use clap::Args;
use moe_engine::{LoadOptions, Scheduler, SchedulerOptions};
use moe_server::{LengthLimits, ServerOptions};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// GGUF model file.
    #[arg(long, env = "MOESERVE_MODEL")]
    pub model: PathBuf,
    #[arg(long, env = "MOESERVE_HOST", default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, env = "MOESERVE_PORT", default_value_t = 8016)]
    pub port: u16,
    /// Context length per sequence (0 = the model's, capped at 4096).
    #[arg(long, env = "MOESERVE_CTX_SIZE", default_value_t = 0)]
    pub ctx_size: usize,
    /// Sequences served at once (KV-cache slots); more requests wait in a queue.
    #[arg(long, env = "MOESERVE_PARALLEL", default_value_t = 4)]
    pub parallel: usize,
    /// Temperature of a request that gives none (OpenAI's 1.0; 0 makes such requests
    /// greedy, where --draft-max drafts are kept most often).
    #[arg(long, env = "MOESERVE_DEFAULT_TEMPERATURE", default_value_t = 1.0)]
    pub default_temperature: f32,
    /// `deepseek`: a chat answer's `<think>` block goes to `reasoning_content` (as
    /// llama-server's default); `none`: it stays in `content`.
    #[arg(long, env = "MOESERVE_REASONING_FORMAT", default_value = "deepseek",
          value_parser = ["deepseek", "none"])]
    pub reasoning_format: String,
    /// A Jinja chat template to use instead of the model's own.
    #[arg(long, env = "MOESERVE_CHAT_TEMPLATE_FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Output length when a request gives none (or zero, or a negative one).
    #[arg(long, env = "MOESERVE_DEFAULT_MAX_TOKENS", default_value_t = 1024)]
    pub default_max_tokens: usize,
    /// Longest output any request may ask for (larger requests are clamped).
    #[arg(long, env = "MOESERVE_MAX_TOKENS_LIMIT", default_value_t = 8192)]
    pub max_tokens_limit: usize,
    /// Most tokens per forward pass (decode steps plus prefill chunks); 0: 256 on the
    /// CPU (a long prompt's pass holds up the sequences decoding beside it for less),
    /// 2048 on a GPU, as the upstream profile (each routed expert's tiles get ~48 tokens:
    /// prefill 1.40x a 512-token chunk's at depth 0, 1.38x at 32768, H100 2026-12-06).
    #[arg(long, env = "MOESERVE_BATCH_TOKENS", default_value_t = 0)]
    pub batch_tokens: usize,
    /// Bounded prefill: past this position a prompt's chunks are at most
    /// --prefill-long-chunk tokens (a chunk that would cross it stops there); 0: no bound.
    #[arg(long, env = "MOESERVE_PREFILL_LONG_FROM", default_value_t = 32768)]
    pub prefill_long_from: usize,
    /// Most tokens of a prompt's chunk past --prefill-long-from (bounds the attention
    /// scratch of deep chunks where the batch is larger).
    #[arg(long, env = "MOESERVE_PREFILL_LONG_CHUNK", default_value_t = 1024)]
    pub prefill_long_chunk: usize,
    /// A prompt's last piece shorter than this (and than a quarter of the batch) runs
    /// with the chunk before it where the pass has room for both.
    #[arg(long, env = "MOESERVE_PREFILL_MIN_TAIL", default_value_t = 512)]
    pub prefill_min_tail: usize,
    /// Require `Authorization: Bearer KEY` (also read from MOESERVE_API_KEY).
    #[arg(long, env = "MOESERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Largest request body accepted, in bytes.
    #[arg(long, env = "MOESERVE_MAX_BODY_BYTES", default_value_t = 4 << 20)]
    pub max_body_bytes: usize,
    /// Reuse a slot's cache for a prompt that starts with the tokens it holds
    /// (multi-turn chats prefill only the new turn); `--prefix-cache false` turns it
    /// off (a request can with `"cache_prompt": false`).
    #[arg(long, env = "MOESERVE_PREFIX_CACHE", default_value_t = true, action = clap::ArgAction::Set)]
    pub prefix_cache: bool,
    /// Speculative decoding: up to N drafted tokens checked a step (0 = off, the
    /// default). Drafts come from --mtp's block where given, else from the sequence's
    /// own text (prompt lookup); greedy and sampled requests alike, on models that can
    /// drop rejected drafts (llama; deepseek4 on its device-resident forward, at most 7
    /// a pass), same output as without (seed for seed). It pays where a pass of N+1
    /// tokens costs little more than one and the drafts are kept (see README: on 2 CPU
    /// cores 1.34x on repetitive greedy text, 0.64x on free text).
    #[arg(long, env = "MOESERVE_DRAFT_MAX", default_value_t = 0)]
    pub draft_max: usize,
    /// deepseek4: draft with this next-token-prediction (MTP) GGUF (`convert --mtp`
    /// writes one; llama.cpp's `--mtp` files are the same layout) instead of prompt
    /// lookup. Needs --draft-max N too (the block's chain length per step, at most 7).
    #[arg(long, env = "MOESERVE_MTP")]
    pub mtp: Option<std::path::PathBuf>,
    /// With --mtp: the block's chain stops before a guess whose probability is below P
    /// (0 = never, the default; llama.cpp's --draft-p-min). Unsure drafts cost a pass
    /// more work (each drafted token reads its own experts) and are seldom accepted.
    #[arg(long, env = "MOESERVE_DRAFT_P_MIN", default_value_t = 0.0)]
    pub draft_p_min: f32,
    /// Seconds a client has to send a request's headers, and again its body.
    #[arg(long, env = "MOESERVE_READ_TIMEOUT", default_value_t = 30.0)]
    pub read_timeout: f64,
    /// Seconds in-flight requests may run after SIGTERM / Ctrl-C before the server
    /// exits anyway.
    #[arg(long, env = "MOESERVE_SHUTDOWN_TIMEOUT", default_value_t = 60.0)]
    pub shutdown_timeout: f64,
    /// Let browser pages from ORIGIN call the API (CORS), e.g. http://localhost:3000;
    /// repeat for more, `*` for any. Off by default.
    #[arg(
        long = "cors-origin",
        env = "MOESERVE_CORS_ORIGINS",
        value_delimiter = ',',
        value_name = "ORIGIN"
    )]
    pub cors_origins: Vec<String>,
}

fn seconds(v: f64, flag: &str) -> Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} must be a positive number of seconds, got {v}"))
}

pub fn run(config: PathBuf, a: ServeArgs) -> Result<()> {
    // (a name such as localhost, an IPv4 or an IPv6 address, brackets or not)
    let host = a.host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&(host, a.port))
        .with_context(|| format!("--host {}: not an address or a known name", a.host))?
        .collect();
    // (a name with both: IPv4, as clients that say "localhost" mostly reach 127.0.0.1)
    let addr = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .with_context(|| format!("--host {}: the name has no address", a.host))?;
    if a.model.is_dir() {
        anyhow::bail!(
            "--model {} is a directory, not a GGUF file",
            a.model.display()
        );
    }
    if !a.model.exists() {
        anyhow::bail!("model file {} does not exist", a.model.display());
    }
    // (checked before the model loads, which can take minutes)
    if a.mtp.is_some() && a.draft_max == 0 {
        anyhow::bail!("--mtp drafts only with --draft-max N (the drafts a step checks, at most 7 for deepseek4)");
    }
    if let Some(m) = a.mtp.as_ref().filter(|m| !m.is_file()) {
        anyhow::bail!("--mtp {}: no such file", m.display());
    }
    let alias = a
        .model
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let opts = ServerOptions {
        api_key: a.api_key.clone().filter(|k| !k.is_empty()),
        limits: LengthLimits {
            default_max_tokens: a.default_max_tokens,
            max_tokens_limit: a.max_tokens_limit,
        },
        max_body_bytes: a.max_body_bytes,
        read_timeout: seconds(a.read_timeout, "--read-timeout")?,
        shutdown_timeout: seconds(a.shutdown_timeout, "--shutdown-timeout")?,
        cors_origins: a.cors_origins.clone(),
        default_temperature: a.default_temperature,
        reasoning: a.reasoning_format == "deepseek",
    };
    // (read and compiled before the model loads: a bad file fails at once)
    let template = match &a.chat_template_file {
        Some(p) => {
            let src = std::fs::read_to_string(p)
                .with_context(|| format!("reading the chat template {}", p.display()))?;
            moe_tokenizer::Tokenizer::check_chat_template(&src)
                .with_context(|| format!("the chat template {}", p.display()))?;
            Some(src)
        }
        None => None,
    };
    if !(0.0..=1.0).contains(&a.draft_p_min) {
        anyhow::bail!(
            "--draft-p-min must be between 0 and 1, got {}",
            a.draft_p_min
        );
    }
    if !(0.0..=2.0).contains(&a.default_temperature) {
        anyhow::bail!(
            "--default-temperature must be between 0 and 2, got {}",
            a.default_temperature
        );
    }
    moe_server::check_cors_origins(&opts.cors_origins)?;
    let load_opts = LoadOptions {
        n_ctx: a.ctx_size,
        n_slots: a.parallel,
        repeat_layers: None,
        mtp: a.mtp.clone(),
    };
    if a.prefill_long_from > 0 && a.prefill_long_chunk == 0 {
        anyhow::bail!(
            "--prefill-long-chunk must be at least 1 (or --prefill-long-from 0: no bound)"
        );
    }
    let sched_opts = SchedulerOptions {
        max_batch_tokens: a.batch_tokens,
        prefill_long_from: a.prefill_long_from,
        prefill_long_chunk: a.prefill_long_chunk,
        prefill_min_tail: a.prefill_min_tail,
        prefix_cache: a.prefix_cache,
        draft_max: a.draft_max,
        draft_p_min: a.draft_p_min,
    };
    let model = a.model.clone();
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let r = rt.block_on(moe_server::serve(addr, opts, alias, move || {
        let mut m = crate::eval_cmd::load_model(&config, &model, &load_opts)?;
        if let (Some(src), Some(tok)) = (template, m.tokenizer.as_mut()) {
            std::sync::Arc::get_mut(tok)
                .context("the tokenizer is shared before the server starts")?
                .set_chat_template(src)
                .context("--chat-template-file")?;
        }
        Scheduler::start(m, sched_opts)
    }));
    // (a model still loading on a blocking thread is not waited for)
    rt.shutdown_background();
    r
}
