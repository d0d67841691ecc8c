//! Running one generation through the scheduler and shaping its events into OpenAI
//! responses: whole (JSON) or streamed (SSE), chat or text flavour.

use std::{
    convert::Infallible,
    time::{SystemTime, UNIX_EPOCH},
};

use axum::response::{
    sse::{Event as SseEvent, KeepAlive, Sse},
    IntoResponse, Response,
};
use futures_util::stream::{self, Stream, StreamExt};
use moe_engine::{
    Emitted, Event, FinishReason, GenRequest, Sampled, SamplingParams, SubmitError, Timings,
};
use moe_tokenizer::Tokenizer;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::UnboundedReceiverStream;

use crate::{
    chat_output::{OutputSplitter, Part, SplitOptions},
    error::ApiError,
    AppState,
};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    Chat,
    Text,
}

pub struct Job {
    pub flavor: Flavor,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_prompt: bool,
    /// Whether the client asked for logprobs (None = no).
    pub logprobs: Option<usize>,
    /// Chat answers: how reasoning and tool calls are split out of the text.
    pub split: Option<SplitOptions>,
}

/// A chat answer's parts as OpenAI's `message` (or a stream's `delta`) fields:
/// reasoning, content and calls (ids from the response's id, numbered from 0).
#[derive(Default)]
struct MessageParts {
    reasoning: String,
    content: String,
    calls: Vec<Value>,
}

impl MessageParts {
    fn of(parts: Vec<Part>, id: &str) -> Self {
        let mut p = Self::default();
        p.add(parts, id);
        p
    }

    fn add(&mut self, parts: Vec<Part>, id: &str) {
        for p in parts {
            match p {
                Part::Reasoning(r) => self.reasoning.push_str(&r),
                Part::Content(c) => self.content.push_str(&c),
                Part::ToolCalls(calls) => {
                    for c in calls {
                        let n = self.calls.len();
                        let mut v = c.to_openai(&format!(
                            "call_{}_{n}",
                            id.rsplit('-').next().unwrap_or(id)
                        ));
                        v["index"] = json!(n);
                        self.calls.push(v);
                    }
                }
            }
        }
    }

    /// The fields of a whole answer's `message`: `content` null only beside calls.
    fn message(self) -> Value {
        let mut m = json!({"role": "assistant", "content": self.content});
        if self.content.is_empty() && !self.calls.is_empty() {
            m["content"] = Value::Null;
        }
        if !self.reasoning.is_empty() {
            m["reasoning_content"] = json!(self.reasoning);
        }
        if !self.calls.is_empty() {
            let calls: Vec<Value> = self
                .calls
                .into_iter()
                .map(|mut c| {
                    c.as_object_mut().map(|o| o.remove("index"));
                    c
                })
                .collect();
            m["tool_calls"] = json!(calls);
        }
        m
    }

    /// A stream's delta of these parts (None when there is nothing to send).
    fn delta(self) -> Option<Value> {
        let mut d = serde_json::Map::new();
        if !self.reasoning.is_empty() {
            d.insert("reasoning_content".into(), json!(self.reasoning));
        }
        if !self.content.is_empty() {
            d.insert("content".into(), json!(self.content));
        }
        if !self.calls.is_empty() {
            d.insert("tool_calls".into(), json!(self.calls));
        }
        (!d.is_empty()).then_some(Value::Object(d))
    }
}

/// "tool_calls" where an answer that stopped by itself made calls.
fn finish_reason(reason: FinishReason, calls: bool) -> &'static str {
    match (reason, calls) {
        (FinishReason::Stop, true) => "tool_calls",
        (r, _) => r.as_str(),
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(flavor: Flavor) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let prefix = if flavor == Flavor::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    };
    format!("{prefix}-{:x}{n:04x}", now())
}

/// `x` rounded to `places` decimal places.
fn round_to(x: f64, places: i32) -> f64 {
    let scale = 10f64.powi(places);
    (x * scale).round() / scale
}

/// Accepted drafts / offered drafts (0 when none were offered).
fn accept_rate(t: &Timings) -> f64 {
    if t.draft_offered == 0 {
        0.0
    } else {
        round_to(t.draft_accepted as f64 / t.draft_offered as f64, 3)
    }
}

/// `usage` with the seed's timings, plus the llama-server style top-level `timings`.
pub fn usage_and_timings(t: &Timings) -> (Value, Value) {
    let decode_s = t.decode_ms / 1e3;
    let tps = if decode_s > 0.0 {
        t.completion_tokens as f64 / decode_s
    } else {
        0.0
    };
    // (llama-server counts only the prompt tokens it evaluated: the cached ones are
    // cache_n)
    let prompt_n = t.prompt_tokens - t.cached_prefix_tokens;
    let prompt_per_s = if t.prefill_ms > 0.0 {
        prompt_n as f64 / (t.prefill_ms / 1e3)
    } else {
        0.0
    };
    let usage = json!({
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": t.prompt_tokens + t.completion_tokens,
        "timings": {
            "prefill_ms": round_to(t.prefill_ms, 1),
            "decode_ms": round_to(t.decode_ms, 1),
            "decode_tokens_per_sec": round_to(tps, 1),
            "cache_hit": t.cached_prefix_tokens > 0,
            "cached_prefix_tokens": t.cached_prefix_tokens,
            "prefilled_tokens": t.prompt_tokens - t.cached_prefix_tokens,
            "effective_prompt_tokens": t.prompt_tokens,
        },
        "accept_rate": accept_rate(t),
        "spec_decode_ran": t.spec_decode_ran,
    });
    let per = |ms: f64, n: usize| if n > 0 { ms / n as f64 } else { 0.0 };
    let timings = json!({
        "cache_n": t.cached_prefix_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": t.prefill_ms,
        "prompt_per_token_ms": per(t.prefill_ms, prompt_n),
        "prompt_per_second": prompt_per_s,
        "predicted_n": t.completion_tokens,
        "predicted_ms": t.decode_ms,
        "predicted_per_token_ms": per(t.decode_ms, t.completion_tokens),
        "predicted_per_second": tps,
        "draft_n": t.draft_offered,
        "draft_n_accepted": t.draft_accepted,
    });
    (usage, timings)
}

fn token_str(tok: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tok.token_bytes(id).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat-style logprobs entry for one token.
fn chat_logprob(tok: &Tokenizer, s: &Sampled) -> Value {
    let (text, bytes) = token_str(tok, s.id);
    let top: Vec<Value> = s
        .top
        .iter()
        .map(|(id, lp)| {
            let (t, b) = token_str(tok, *id);
            json!({"token": t, "logprob": lp, "bytes": b})
        })
        .collect();
    json!({"token": text, "logprob": s.logprob, "bytes": bytes, "top_logprobs": top})
}

/// Collected result of a non-streamed generation.
struct Collected {
    text: String,
    tokens: Vec<Emitted>,
    reason: FinishReason,
    timings: Timings,
}

async fn collect(mut rx: mpsc::UnboundedReceiver<Event>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Token { text: t, tokens: e } => {
                text.push_str(&t);
                tokens.extend(e);
            }
            Event::Done { reason, timings } => {
                return Ok(Collected {
                    text,
                    tokens,
                    reason,
                    timings,
                })
            }
            Event::Error(e) => return Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    }
    Err(ApiError::internal("the scheduler dropped the request"))
}

pub async fn run(state: &AppState, job: Job) -> Result<Response, ApiError> {
    let sched = state.scheduler()?;
    let (tx, rx) = mpsc::unbounded_channel();
    sched
        .submit(GenRequest {
            prompt: job.prompt.clone(),
            sampling: job.sampling.clone(),
            max_tokens: job.max_tokens,
            stop: job.stop.clone(),
            cache_prompt: job.cache_prompt,
            events: tx,
        })
        .map_err(|e| {
            let param = if job.flavor == Flavor::Chat {
                "messages"
            } else {
                "prompt"
            };
            match e {
                SubmitError::Stopped => ApiError::unavailable(e.to_string()),
                SubmitError::EmptyPrompt => ApiError::invalid(e.to_string(), Some(param)),
                SubmitError::PromptTooLong { .. } => ApiError::invalid(e.to_string(), Some(param))
                    .with_code("context_length_exceeded"),
            }
        })?;
    let id = new_id(job.flavor);
    let model = sched.model_name.clone();
    let tok = sched.tokenizer.clone();
    let created = now();
    if !job.stream {
        let c = collect(rx).await?;
        let (usage, timings) = usage_and_timings(&c.timings);
        let body = match job.flavor {
            Flavor::Chat => {
                let logprobs = job.logprobs.map(|_| {
                    json!({"content": c.tokens.iter().map(|e| chat_logprob(&tok, &e.sampled)).collect::<Vec<_>>()})
                });
                let parts = match job.split {
                    Some(o) => MessageParts::of(OutputSplitter::split(o, &c.text), &id),
                    None => MessageParts {
                        content: c.text,
                        ..Default::default()
                    },
                };
                let reason = finish_reason(c.reason, !parts.calls.is_empty());
                json!({
                    "id": id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": 0, "message": parts.message(),
                                 "logprobs": logprobs, "finish_reason": reason}],
                    "usage": usage, "timings": timings,
                })
            }
            Flavor::Text => {
                let logprobs = job
                    .logprobs
                    .map(|_| legacy_logprobs(&tok, &c.tokens, &c.text, &mut (0, 0)));
                json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": c.text, "logprobs": logprobs,
                                 "finish_reason": c.reason.as_str()}],
                    "usage": usage, "timings": timings,
                })
            }
        };
        return Ok(axum::Json(body).into_response());
    }
    Ok(stream_response(job, rx, id, model, created, tok))
}

/// Legacy (completions) logprobs of `toks`; `text` is the completion text so far, in
/// which each token's `text_offset` counts characters, as OpenAI's do. `at` is where
/// the count stands, (bytes, characters): tokens come in text order, so a stream
/// counts each character once.
fn legacy_logprobs(
    tok: &Tokenizer,
    toks: &[Emitted],
    text: &str,
    at: &mut (usize, usize),
) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for e in toks {
        let to = e.offset.min(text.len());
        if to >= at.0 {
            at.1 += text.get(at.0..to).map_or(0, |s| s.chars().count());
            at.0 = to;
        }
        offsets.push(at.1);
        tokens.push(token_str(tok, e.sampled.id).0);
        lps.push(e.sampled.logprob);
        let m: serde_json::Map<String, Value> = e
            .sampled
            .top
            .iter()
            .map(|(id, lp)| (token_str(tok, *id).0, json!(lp)))
            .collect();
        tops.push(Value::Object(m));
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

fn stream_response(
    job: Job,
    rx: mpsc::UnboundedReceiver<Event>,
    id: String,
    model: String,
    created: u64,
    tok: std::sync::Arc<Tokenizer>,
) -> Response {
    let flavor = job.flavor;
    let object = if flavor == Flavor::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let include_usage = job.include_usage;
    let call_id = id.clone();
    let chunk = move |choices: Value, extra: Vec<(&str, Value)>| {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if include_usage {
            // (as OpenAI: every chunk has the field; only the last one fills it)
            v["usage"] = Value::Null;
        }
        for (k, x) in extra {
            v[k] = x;
        }
        SseEvent::default().data(v.to_string())
    };
    let want_lp = job.logprobs.is_some();
    // The role comes first, as OpenAI sends it.
    let head = (flavor == Flavor::Chat).then(|| {
        chunk(json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]), Vec::new())
    });
    let chunk2 = chunk.clone();
    // The completion text so far (the legacy logprobs' offsets count its characters).
    let (mut sent, mut at) = (String::new(), (0, 0));
    let mut splitter = job.split.map(OutputSplitter::new);
    // What the splitter held to the end (a tool-call block, a partial tag) as a chunk,
    // and whether the answer made calls.
    let chunk3 = chunk.clone();
    let held_id = call_id.clone();
    let held = move |sp: &mut Option<OutputSplitter>| -> (Vec<SseEvent>, bool) {
        let Some(sp) = sp else {
            return (Vec::new(), false);
        };
        let p = MessageParts::of(sp.finish(), &held_id);
        let calls = !p.calls.is_empty();
        let out = p.delta().map(|d| {
            let choice = json!({"index": 0, "delta": d, "logprobs": null, "finish_reason": null});
            chunk3(json!([choice]), Vec::new())
        });
        (out.into_iter().collect(), calls)
    };
    let body = UnboundedReceiverStream::new(rx).flat_map(move |ev| {
        let out: Vec<SseEvent> = match ev {
            Event::Token { text, tokens } => {
                sent.push_str(&text);
                let lp = (want_lp && !tokens.is_empty()).then(|| match flavor {
                    Flavor::Chat => json!({"content": tokens.iter().map(|e| chat_logprob(&tok, &e.sampled)).collect::<Vec<_>>()}),
                    Flavor::Text => legacy_logprobs(&tok, &tokens, &sent, &mut at),
                });
                let delta = match &mut splitter {
                    Some(sp) => MessageParts::of(sp.push(&text), &call_id).delta(),
                    None => (!text.is_empty()).then(|| json!({"content": text})),
                };
                if delta.is_none() && lp.is_none() {
                    Vec::new()
                } else {
                    let choice = match flavor {
                        // (logprobs of held-back text ride on an empty delta)
                        Flavor::Chat => json!({"index": 0, "delta": delta.unwrap_or_else(|| json!({})), "logprobs": lp, "finish_reason": null}),
                        Flavor::Text => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": null}),
                    };
                    vec![chunk2(json!([choice]), Vec::new())]
                }
            }
            Event::Done { reason, timings } => {
                let (usage, llama_timings) = usage_and_timings(&timings);
                let (mut v, made_calls) = held(&mut splitter);
                let reason = finish_reason(reason, made_calls);
                let choice = match flavor {
                    Flavor::Chat => json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason}),
                    Flavor::Text => json!({"index": 0, "text": "", "logprobs": null, "finish_reason": reason}),
                };
                // llama-server clients read `timings` on the last chunk: the finish
                // chunk, and the usage chunk after it where one is sent
                v.push(chunk2(json!([choice]), vec![("timings", llama_timings.clone())]));
                if include_usage {
                    v.push(chunk2(json!([]), vec![("usage", usage), ("timings", llama_timings)]));
                }
                v.push(SseEvent::default().data("[DONE]"));
                v
            }
            Event::Error(e) => {
                let err = ApiError::internal(format!("generation failed: {e}"));
                // (what the splitter held is sent before the error, not dropped)
                let (mut v, _) = held(&mut splitter);
                v.push(SseEvent::default().data(err.body().to_string()));
                v.push(SseEvent::default().data("[DONE]"));
                v
            }
        };
        stream::iter(out.into_iter().map(Ok::<_, Infallible>))
    });
    let all: std::pin::Pin<Box<dyn Stream<Item = Result<SseEvent, Infallible>> + Send>> =
        Box::pin(stream::iter(head.into_iter().map(Ok)).chain(body));
    Sse::new(all)
        .keep_alive(KeepAlive::default())
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat_output::ToolCall;

    #[test]
    fn answers_with_calls_take_openai_shapes() {
        let call = ToolCall {
            name: "f".into(),
            arguments: serde_json::from_str(r#"{"b": 1, "a": "x"}"#).unwrap(),
        };
        let mut p = MessageParts::default();
        p.add(
            vec![
                Part::Reasoning("why".into()),
                Part::ToolCalls(vec![call.clone(), call]),
            ],
            "chatcmpl-abc",
        );
        let m = p.message();
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["reasoning_content"], "why");
        let calls = m["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1]["id"], "call_abc_1");
        assert_eq!(calls[0]["function"]["arguments"], r#"{"b":1,"a":"x"}"#);
        assert!(calls[0].get("index").is_none());
        // A stream's delta numbers the calls; plain text keeps content a string.
        let mut p = MessageParts::default();
        p.add(vec![Part::Content("hi".into())], "x");
        assert_eq!(p.delta().unwrap(), json!({"content": "hi"}));
        assert!(MessageParts::default().delta().is_none());
        assert_eq!(MessageParts::default().message()["content"], "");
        assert_eq!(finish_reason(FinishReason::Stop, true), "tool_calls");
        assert_eq!(finish_reason(FinishReason::Length, true), "length");
        assert_eq!(finish_reason(FinishReason::Stop, false), "stop");
    }
}
