//! The OpenAI-compatible HTTP API. One handler per route; shared state passed
//! explicitly; every error is an OpenAI-style JSON body.

mod chat_output;
mod error;
mod generate;
mod request;

use std::{
    net::SocketAddr,
    sync::{atomic::Ordering, Arc, OnceLock},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    body::{Body, Bytes},
    extract::{rejection::BytesRejection, DefaultBodyLimit, Path, Request, State},
    http::{header, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::{get, post},
    Json, Router,
};
use moe_engine::Scheduler;
use moe_tokenizer::{ChatMessage, FALLBACK_CHAT_TEMPLATE};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

pub use error::ApiError;
use generate::{Flavor, Job};
pub use request::LengthLimits;
use request::{content_text, not_supported, output_length, ChatRequest, CompletionRequest, Prompt};

#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub api_key: Option<String>,
    pub limits: LengthLimits,
    pub max_body_bytes: usize,
    /// Time a client has to send a request's headers, and again its body; a slower
    /// one is dropped (it would hold a connection, and shutdown, open).
    pub read_timeout: Duration,
    /// After SIGTERM / Ctrl-C, how long in-flight requests may run before the
    /// server exits anyway.
    pub shutdown_timeout: Duration,
    /// Origins a browser page may call the API from (`*`: any); empty: no CORS
    /// headers, so browsers keep other sites' pages out.
    pub cors_origins: Vec<String>,
    /// The temperature of a request that gives none (OpenAI's 1.0 by default; 0 makes
    /// such requests greedy).
    pub default_temperature: f32,
    /// Chat answers' `<think>` blocks go to `reasoning_content` (`--reasoning-format
    /// deepseek`, llama-server's default); off: they stay in `content`.
    pub reasoning: bool,
}

pub struct AppInner {
    /// Set once the model has loaded; until then /health answers 503.
    pub scheduler: OnceLock<Scheduler>,
    pub opts: ServerOptions,
    /// Name clients may also use for the model (the GGUF file stem).
    pub alias: String,
    /// When the server started (Unix seconds): the model's `created`.
    pub started: u64,
}

pub type AppState = Arc<AppInner>;

impl AppInner {
    pub fn scheduler(&self) -> Result<&Scheduler, ApiError> {
        self.scheduler
            .get()
            .ok_or_else(|| ApiError::unavailable("the model is still loading"))
    }

    fn check_model(&self, asked: &Option<String>) -> Result<(), ApiError> {
        let s = self.scheduler()?;
        match asked {
            None => Ok(()),
            Some(m) if m == &s.model_name || m == &self.alias || m == "default" => Ok(()),
            Some(m) => Err(ApiError::not_found_model(m)),
        }
    }
}

/// Runs CPU-heavy request work (templating, tokenizing) on tokio's blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Parses a JSON body into `T`, mapping every failure to an OpenAI-style error.
fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>) -> Result<T, ApiError> {
    let bytes = body.map_err(|r| {
        let status = r.status();
        let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
            "request body too large".to_string()
        } else {
            r.body_text()
        };
        ApiError::invalid(msg, None).status(status)
    })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("invalid JSON body: {e}"), None))
}

pub fn router(state: AppState) -> Router {
    let guarded = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/apply-template", post(apply_template))
        .route("/detokenize", post(detokenize))
        // (the key is checked first: no body is read for a client without it)
        .route_layer(middleware::from_fn_with_state(state.clone(), read_body))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    let router = Router::new()
        .merge(guarded)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::invalid("no such route", None).status(StatusCode::NOT_FOUND)
        })
        .method_not_allowed_fallback(|| async {
            ApiError::invalid("method not allowed on this route", None)
                .status(StatusCode::METHOD_NOT_ALLOWED)
        })
        .layer(DefaultBodyLimit::max(state.opts.max_body_bytes));
    // (around the routes, so a preflight OPTIONS is answered before the key check and
    // routing; inside the log, which sees preflights too)
    let router = match cors_layer(&state.opts.cors_origins) {
        Some(cors) => router.layer(cors),
        None => router,
    };
    router
        .layer(middleware::from_fn(log_request))
        .with_state(state)
}

/// The CORS layer for `--cors-origin` (None when no origin is allowed). Origins are
/// checked when the options are built ([`check_cors_origins`]).
fn cors_layer(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        // (browsers send scheme and host in lower case; the list matches bytes)
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| o.to_ascii_lowercase().parse().ok()),
        )
    };
    Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([axum::http::Method::GET, axum::http::Method::POST])
            .allow_headers([
                axum::http::header::AUTHORIZATION,
                axum::http::header::CONTENT_TYPE,
            ])
            .max_age(Duration::from_secs(600)),
    )
}

/// Checks `--cors-origin` values: `*`, or an origin as browsers send it
/// (`scheme://host[:port]`, no path).
pub fn check_cors_origins(origins: &[String]) -> anyhow::Result<()> {
    for o in origins {
        if o == "*" {
            continue;
        }
        let ok = (o.starts_with("http://") || o.starts_with("https://"))
            && o.split_once("://").is_some_and(|(_, rest)| {
                !rest.is_empty() && !rest.contains('/') && !rest.contains(char::is_whitespace)
            })
            && o.parse::<axum::http::HeaderValue>().is_ok();
        if !ok {
            anyhow::bail!(
                "--cors-origin {o:?}: expected `*` or an origin such as http://localhost:3000 \
                 (scheme and host, no path)"
            );
        }
    }
    Ok(())
}

/// One log line a request: method, path, status, time to the response's head.
async fn log_request(req: Request, next: Next) -> Response {
    let (method, path, t0) = (
        req.method().clone(),
        req.uri().path().to_owned(),
        Instant::now(),
    );
    let r = next.run(req).await;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let status = r.status().as_u16();
    if r.status().is_server_error() && r.status() != StatusCode::SERVICE_UNAVAILABLE {
        tracing::warn!(target: "moeserve::http", "{method} {path} {status} {ms:.1} ms");
    } else {
        tracing::info!(target: "moeserve::http", "{method} {path} {status} {ms:.1} ms");
    }
    r
}

/// Reads the whole body within the read timeout (and the size limit), so a client
/// that stops sending mid-body gets a 408 instead of holding its connection.
async fn read_body(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let limit = st.opts.max_body_bytes;
    match tokio::time::timeout(st.opts.read_timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(e)) => {
            // to_bytes fails on the size limit or on a broken connection
            let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(&e);
            let mut too_big = false;
            while let Some(c) = cause {
                too_big |= c.is::<http_body_util::LengthLimitError>();
                cause = c.source();
            }
            if too_big {
                ApiError::invalid("request body too large", None)
                    .status(StatusCode::PAYLOAD_TOO_LARGE)
                    .into_response()
            } else {
                ApiError::invalid(format!("reading the request body: {e}"), None).into_response()
            }
        }
        Err(_) => ApiError::invalid(
            format!(
                "the request body did not arrive within {} s",
                st.opts.read_timeout.as_secs_f64()
            ),
            None,
        )
        .status(StatusCode::REQUEST_TIMEOUT)
        .into_response(),
    }
}

async fn require_key(State(st): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.opts.api_key {
        let ok = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            // (the scheme is case-insensitive, RFC 9110)
            .is_some_and(|(scheme, k)| scheme.eq_ignore_ascii_case("bearer") && k.trim() == key);
        if !ok {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn health(State(st): State<AppState>) -> Response {
    match st.scheduler.get() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

fn model_card(st: &AppInner, s: &Scheduler) -> serde_json::Value {
    json!({
        "id": s.model_name, "object": "model", "created": st.started, "owned_by": "moeserve",
        "meta": {"n_ctx": s.n_ctx, "n_slots": s.n_slots, "n_vocab": s.tokenizer.vocab_size(), "alias": st.alias},
    })
}

async fn models(State(st): State<AppState>) -> Result<Response, ApiError> {
    let s = st.scheduler()?;
    Ok(Json(json!({"object": "list", "data": [model_card(&st, s)]})).into_response())
}

/// `GET /v1/models/{id}`: the model by its name or alias.
async fn model(State(st): State<AppState>, Path(id): Path<String>) -> Result<Response, ApiError> {
    st.check_model(&Some(id))?;
    Ok(Json(model_card(&st, st.scheduler()?)).into_response())
}

async fn chat_completions(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    st.check_model(&req.common.model)?;
    let s = st.scheduler()?;
    req.common.unsupported()?;
    let ChatPrompt { msgs, vars, tools } = chat_prompt(&req, s)?;
    let top = req.top_logprobs.unwrap_or(0);
    if !(0..=20).contains(&top) {
        return Err(ApiError::invalid(
            "'top_logprobs' must be between 0 and 20",
            Some("top_logprobs"),
        ));
    }
    if req.top_logprobs.is_some() && req.logprobs != Some(true) {
        return Err(ApiError::invalid(
            "'top_logprobs' needs 'logprobs' set to true",
            Some("top_logprobs"),
        ));
    }
    let logprobs = req.logprobs.unwrap_or(false).then_some(top as usize);
    let sampling = req.common.sampling(
        logprobs,
        s.tokenizer.vocab_size(),
        st.opts.default_temperature,
    )?;
    let tok = s.tokenizer.clone();
    // Message content is encoded as plain text: a control-token string in it (e.g.
    // "<|im_end|>") cannot open or close a turn. (Off the async workers: a 4 MB prompt
    // takes about a second, and other clients' streams must not wait for it.)
    let encoded = blocking(move || match tok.encode_chat_vars(&msgs, true, &vars) {
        Err(moe_tokenizer::TokenizerError::NoChatTemplate) => {
            tracing::warn!("the model has no chat template; using ChatML");
            tok.encode_chat_template_vars(FALLBACK_CHAT_TEMPLATE, &msgs, true, &vars)
        }
        r => r,
    })
    .await?;
    let prompt = encoded.map_err(|e| match e {
        moe_tokenizer::TokenizerError::Template { .. } => {
            ApiError::invalid(format!("chat template: {e}"), Some("messages"))
        }
        e => ApiError::invalid(e.to_string(), Some("messages")),
    })?;
    let split = chat_output::SplitOptions {
        reasoning: st.opts.reasoning,
        starts_in_reasoning: prompt_opens_thinking(&s.tokenizer, &prompt),
        dsml_tools: tools.is_some(),
    };
    generate::run(
        &st,
        Job {
            flavor: Flavor::Chat,
            prompt,
            sampling,
            max_tokens: output_length(&req.common, st.opts.limits),
            stop: req.common.stop_strings()?,
            stream: req.common.stream(),
            include_usage: req.common.include_usage(),
            cache_prompt: req.common.cache_prompt.unwrap_or(true),
            logprobs,
            split: Some(split),
        },
    )
    .await
}

/// What a chat request gives its template: the turns, the variables (`tools`, the
/// request's `chat_template_kwargs`, `reasoning_effort`) and the tools it offers.
struct ChatPrompt {
    msgs: Vec<ChatMessage>,
    vars: moe_tokenizer::TemplateVars,
    tools: Option<Vec<Value>>,
}

fn chat_prompt(req: &ChatRequest, s: &Scheduler) -> Result<ChatPrompt, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "'messages' must not be empty",
            Some("messages"),
        ));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        msgs.push(chat_message(m)?);
    }
    // Tools go to the template, and the answer's calls are parsed, where the model's
    // template writes calls in a markup this server reads (DeepSeek's DSML).
    let template = s
        .tokenizer
        .chat_template()
        .unwrap_or(FALLBACK_CHAT_TEMPLATE);
    let tools = req.common.tools()?;
    let calls_in_history = msgs.iter().any(|m| m.extra.contains_key("tool_calls"));
    if (tools.is_some() || calls_in_history) && !chat_output::template_has_dsml_tools(template) {
        return Err(not_supported(
            "tool calling with this model's chat template (the server reads DeepSeek's \
             DSML tool calls)",
            if tools.is_some() { "tools" } else { "messages" },
        ));
    }
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if vars.contains_key("tools") {
        // (they would skip the checks above and the answer's call parsing)
        return Err(ApiError::invalid(
            "send tools as the request's 'tools', not in 'chat_template_kwargs'",
            Some("chat_template_kwargs"),
        ));
    }
    if let Some(t) = &tools {
        vars.insert("tools".into(), Value::Array(t.clone()));
    }
    if let Some(e) = &req.reasoning_effort {
        vars.insert("reasoning_effort".into(), Value::String(e.clone()));
    }
    Ok(ChatPrompt { msgs, vars, tools })
}

/// `POST /apply-template` (as llama-server's): a chat request's prompt as text, the
/// template rendered with the request's turns, tools and variables.
async fn apply_template(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(body)?;
    let s = st.scheduler()?;
    let ChatPrompt { msgs, vars, .. } = chat_prompt(&req, s)?;
    let tok = s.tokenizer.clone();
    let text = blocking(
        move || match tok.apply_chat_template_vars(&msgs, true, &vars) {
            Err(moe_tokenizer::TokenizerError::NoChatTemplate) => {
                tok.apply_template_vars(FALLBACK_CHAT_TEMPLATE, &msgs, true, &vars)
            }
            r => r,
        },
    )
    .await?
    .map_err(|e| ApiError::invalid(format!("chat template: {e}"), Some("messages")))?;
    Ok(Json(json!({"prompt": text})).into_response())
}

/// A request's chat turn as the template gets it: role, text, and the fields a
/// template may read about tool calls and reasoning.
fn chat_message(m: &request::Message) -> Result<ChatMessage, ApiError> {
    if !["system", "user", "assistant", "tool", "developer"].contains(&m.role.as_str()) {
        return Err(ApiError::invalid(
            format!("unknown role '{}'", m.role),
            Some("messages"),
        ));
    }
    let mut msg = ChatMessage::new(m.role.clone(), content_text(&m.content)?);
    let none = |v: &&Value| v.is_null() || v.as_array().is_some_and(Vec::is_empty);
    if let Some(calls) = m.tool_calls.as_ref().filter(|v| !none(v)) {
        let ok = m.role == "assistant"
            && calls.as_array().is_some_and(|a| {
                a.iter().all(|c| {
                    c.pointer("/function/name")
                        .and_then(Value::as_str)
                        .is_some()
                        && c.pointer("/function/arguments")
                            .is_some_and(|a| a.is_string() || a.is_object())
                })
            });
        if !ok {
            return Err(ApiError::invalid(
                "'tool_calls' belong to assistant messages: [{\"id\": ..., \"type\": \
                 \"function\", \"function\": {\"name\": ..., \"arguments\": ...}}]",
                Some("messages"),
            ));
        }
        msg.extra.insert("tool_calls".into(), calls.clone());
    }
    for (k, v) in [
        ("tool_call_id", &m.tool_call_id),
        ("name", &m.name),
        ("reasoning_content", &m.reasoning_content),
    ] {
        if let Some(v) = v {
            msg.extra.insert(k.into(), Value::String(v.clone()));
        }
    }
    Ok(msg)
}

/// Whether the prompt's text ends inside an open `<think>` block (a thinking-mode
/// generation prompt): the answer then starts as reasoning.
fn prompt_opens_thinking(tok: &moe_tokenizer::Tokenizer, prompt: &[u32]) -> bool {
    let tail: Vec<u8> = prompt[prompt.len().saturating_sub(4)..]
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap_or_default())
        .collect();
    chat_output::prompt_opens_thinking(&String::from_utf8_lossy(&tail))
}

async fn completions(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    st.check_model(&req.common.model)?;
    let s = st.scheduler()?;
    req.common.unsupported()?;
    if req.common.tools()?.is_some() {
        return Err(not_supported("tool calling on /v1/completions", "tools"));
    }
    if req.echo == Some(true) {
        return Err(not_supported("'echo'", "echo"));
    }
    if req.suffix.as_ref().is_some_and(|x| !x.is_empty()) {
        return Err(not_supported("'suffix'", "suffix"));
    }
    if req.logprobs.is_some_and(|n| !(0..=20).contains(&n)) {
        return Err(ApiError::invalid(
            "'logprobs' must be between 0 and 20",
            Some("logprobs"),
        ));
    }
    let logprobs = req.logprobs.map(|n| n as usize);
    let sampling = req.common.sampling(
        logprobs,
        s.tokenizer.vocab_size(),
        st.opts.default_temperature,
    )?;
    let encode = |t: String| {
        let tok = s.tokenizer.clone();
        blocking(move || tok.encode(&t, true, true))
    };
    let prompt = match req.prompt {
        Prompt::Text(t) => encode(t)
            .await?
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
        Prompt::Tokens(ids) => {
            let v = s.tokenizer.vocab_size() as u32;
            if let Some(bad) = ids.iter().find(|&&i| i >= v) {
                return Err(ApiError::invalid(
                    format!("token id {bad} outside the vocabulary ({v})"),
                    Some("prompt"),
                ));
            }
            ids
        }
        Prompt::Texts(mut v) if v.len() == 1 => encode(v.remove(0))
            .await?
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
        Prompt::Texts(_) => {
            return Err(ApiError::invalid(
                "only one prompt per request is supported",
                Some("prompt"),
            ))
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    generate::run(
        &st,
        Job {
            flavor: Flavor::Text,
            prompt,
            sampling,
            max_tokens: output_length(&req.common, st.opts.limits),
            stop: req.common.stop_strings()?,
            stream: req.common.stream(),
            include_usage: req.common.include_usage(),
            cache_prompt: req.common.cache_prompt.unwrap_or(true),
            logprobs,
            split: None,
        },
    )
    .await
}

#[derive(serde::Deserialize)]
struct TokenizeReq {
    content: String,
    #[serde(default)]
    add_special: bool,
    /// llama-server's form: each token as {"id", "piece"}, the piece its text (or its
    /// bytes, where they are not whole UTF-8 on their own).
    #[serde(default)]
    with_pieces: bool,
}

async fn tokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: TokenizeReq = parse_body(body)?;
    let tok = &st.scheduler()?.tokenizer;
    let toks = tok
        .encode(&r.content, r.add_special, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("content")))?;
    if !r.with_pieces {
        return Ok(Json(json!({"tokens": toks})).into_response());
    }
    let pieces: Vec<Value> = toks
        .iter()
        .map(|&id| {
            let bytes = tok.token_bytes(id).unwrap_or_default();
            let piece = match String::from_utf8(bytes) {
                Ok(text) => json!(text),
                Err(e) => json!(e.into_bytes()),
            };
            json!({"id": id, "piece": piece})
        })
        .collect();
    Ok(Json(json!({"tokens": pieces})).into_response())
}

#[derive(serde::Deserialize)]
struct DetokenizeReq {
    tokens: Vec<u32>,
}

async fn detokenize(
    State(st): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: DetokenizeReq = parse_body(body)?;
    let text = st
        .scheduler()?
        .tokenizer
        .decode(&r.tokens, false)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("tokens")))?;
    Ok(Json(json!({"content": text})).into_response())
}

async fn metrics(State(st): State<AppState>) -> Response {
    use prometheus::{Counter, Encoder, IntCounter, IntGauge, Opts, Registry, TextEncoder};
    let reg = Registry::new();
    let s = st.scheduler.get().map(|s| s.stats.clone());
    let ld = |o: &std::sync::atomic::AtomicU64| o.load(Ordering::Relaxed);
    macro_rules! counter {
        ($name:expr, $help:expr, $v:expr) => {{
            let c = IntCounter::with_opts(Opts::new($name, $help)).expect("valid metric");
            c.inc_by($v);
            let _ = reg.register(Box::new(c));
        }};
    }
    macro_rules! gauge {
        ($ty:ty, $name:expr, $help:expr, $v:expr) => {{
            let g = <$ty>::with_opts(Opts::new($name, $help)).expect("valid metric");
            g.set($v);
            let _ = reg.register(Box::new(g));
        }};
    }
    gauge!(
        IntGauge,
        "moeserve_model_loaded",
        "1 once the model is loaded",
        s.is_some() as i64
    );
    if let Some(s) = s {
        counter!(
            "moeserve_requests_total",
            "Generation requests accepted",
            ld(&s.requests)
        );
        counter!(
            "moeserve_prompt_tokens_total",
            "Prompt tokens admitted",
            ld(&s.prompt_tokens)
        );
        counter!(
            "moeserve_prompt_tokens_cached_total",
            "Prompt tokens a slot's cache already held (not prefilled)",
            ld(&s.cached_prompt_tokens)
        );
        counter!(
            "moeserve_generated_tokens_total",
            "Tokens generated",
            ld(&s.generated_tokens)
        );
        counter!(
            "moeserve_draft_tokens_total",
            "Drafted tokens checked (speculative decoding)",
            ld(&s.draft_offered)
        );
        counter!(
            "moeserve_draft_tokens_accepted_total",
            "Drafted tokens the model's own choice matched",
            ld(&s.draft_accepted)
        );
        counter!(
            "moeserve_forward_passes_total",
            "Forward passes run",
            ld(&s.forward_passes)
        );
        let secs = Counter::with_opts(Opts::new(
            "moeserve_forward_seconds_total",
            "Time spent in forward passes",
        ))
        .expect("valid metric");
        secs.inc_by(ld(&s.forward_us) as f64 / 1e6);
        let _ = reg.register(Box::new(secs));
        gauge!(
            IntGauge,
            "moeserve_requests_running",
            "Sequences in the running batch",
            s.active.load(Ordering::Relaxed) as i64
        );
        gauge!(
            IntGauge,
            "moeserve_requests_waiting",
            "Requests waiting for a slot",
            s.waiting.load(Ordering::Relaxed) as i64
        );
    }
    let mut buf = Vec::new();
    let _ = TextEncoder::new().encode(&reg.gather(), &mut buf);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], buf).into_response()
}

/// Binds, then loads the model in the background (health says 503 until it is ready),
/// and serves until SIGTERM/Ctrl-C, letting in-flight requests finish.
pub async fn serve(
    addr: SocketAddr,
    opts: ServerOptions,
    alias: String,
    load: impl FnOnce() -> anyhow::Result<Scheduler> + Send + 'static,
) -> anyhow::Result<()> {
    let state = Arc::new(AppInner {
        scheduler: OnceLock::new(),
        opts,
        alias,
        started: unix_now(),
    });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {addr}: {e}"))?;
    // (the port the system gave, for --port 0)
    let addr = listener.local_addr().unwrap_or(addr);
    let st = state.clone();
    let loaded = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let sched = load()?;
        let _ = st.scheduler.set(sched);
        Ok(())
    });
    let app = router(state.clone());
    // Serve while loading, so /health can say 503 instead of refusing connections.
    let mut server = tokio::spawn(serve_connections(listener, app, state.opts.clone()));
    tokio::select! {
        r = loaded => r.map_err(|e| anyhow::anyhow!("model loading panicked: {e}"))??,
        // SIGTERM / Ctrl-C while loading: stop now, not once the model is in memory
        _ = &mut server => {
            eprintln!("stopped before the model finished loading");
            return Ok(());
        }
    }
    let s = state.scheduler().map_err(|e| anyhow::anyhow!(e.message))?;
    eprintln!(
        "ready: model '{}' (context {} x {} slots) on http://{addr}",
        s.model_name, s.n_ctx, s.n_slots
    );
    eprintln!(
        "try: curl http://{addr}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"What is the capital of France?\"}}],\"temperature\":0}}'"
    );
    server
        .await
        .map_err(|e| anyhow::anyhow!("the server task failed: {e}"))?;
    Ok(())
}

/// Accepts connections until SIGTERM / Ctrl-C, then lets open ones finish for up to
/// `shutdown_timeout`. Each connection gets `read_timeout` for a request's headers.
async fn serve_connections(listener: tokio::net::TcpListener, app: Router, opts: ServerOptions) {
    use hyper_util::{
        rt::{TokioIo, TokioTimer},
        server::graceful::GracefulShutdown,
        service::TowerToHyperService,
    };
    let graceful = GracefulShutdown::new();
    let mut signal = std::pin::pin!(shutdown_signal());
    loop {
        let (io, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // (out of file descriptors and the like: back off, keep serving)
                    tracing::warn!("accepting a connection: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut signal => break,
        };
        let _ = io.set_nodelay(true);
        let svc = TowerToHyperService::new(app.clone());
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(opts.read_timeout)
            .serve_connection(TokioIo::new(io), svc);
        let watched = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = watched.await {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
    drop(listener);
    let open = graceful.count();
    if open > 0 {
        eprintln!("waiting for {open} open connection(s)");
    }
    let limit = opts.shutdown_timeout;
    if tokio::time::timeout(limit, graceful.shutdown())
        .await
        .is_err()
    {
        eprintln!(
            "connections still open after {} s; closing them",
            limit.as_secs_f64()
        );
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    eprintln!("shutting down: finishing in-flight requests");
}
