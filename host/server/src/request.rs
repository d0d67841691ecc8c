//! Request bodies of the two generation endpoints, and their validation.

use moe_engine::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// `content` of a chat message: a string, or an array of parts of which we read text.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Deserialize, Debug)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by chat and text completions (unknown fields are ignored, as OpenAI
/// clients send many).
#[derive(Deserialize, Debug, Default)]
pub struct Common {
    pub model: Option<String>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub max_output_tokens: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Chat style: a bool, with `top_logprobs` for alternatives.
    #[serde(default)]
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Legacy style: the number of alternatives per token.
    pub logprobs: Option<i64>,
    #[serde(flatten)]
    pub common: Common,
}

/// Server-side limits on output length.
#[derive(Debug, Clone, Copy)]
pub struct LengthLimits {
    /// Used when the request gives no length, or zero, or a negative one.
    pub default_max_tokens: usize,
    /// Requests above this are clamped to it.
    pub max_tokens_limit: usize,
}

/// Output length: `max_tokens` wins over `max_output_tokens`, which wins over
/// `max_completion_tokens` (the upstream server's order); missing/zero/negative means the
/// server default; anything above the server maximum is clamped to it.
pub fn output_length(c: &Common, lim: LengthLimits) -> usize {
    let asked = c
        .max_tokens
        .or(c.max_output_tokens)
        .or(c.max_completion_tokens);
    match asked {
        Some(n) if n > 0 => (n as usize).min(lim.max_tokens_limit),
        _ => lim.default_max_tokens.min(lim.max_tokens_limit),
    }
}

fn range(v: Option<f64>, lo: f64, hi: f64, name: &str) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) || x.is_nan() => Err(ApiError::invalid(
            format!("'{name}' must be between {lo} and {hi}, got {x}"),
            Some(name),
        )),
        _ => Ok(()),
    }
}

impl Common {
    /// Checks values and builds sampling parameters (`top_logprobs`: None = no logprobs).
    pub fn sampling(&self, logprobs: Option<usize>) -> Result<SamplingParams, ApiError> {
        range(self.temperature, 0.0, 2.0, "temperature")?;
        range(self.top_p, 0.0, 1.0, "top_p")?;
        range(self.min_p, 0.0, 1.0, "min_p")?;
        range(self.presence_penalty, -2.0, 2.0, "presence_penalty")?;
        range(self.frequency_penalty, -2.0, 2.0, "frequency_penalty")?;
        if let Some(k) = self.top_k {
            if k < 0 {
                return Err(ApiError::invalid("'top_k' must be >= 0", Some("top_k")));
            }
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(ApiError::invalid(
                "'stream_options' is only allowed when 'stream' is true",
                Some("stream_options"),
            ));
        }
        if self.top_p == Some(0.0) {
            return Err(ApiError::invalid(
                "'top_p' must be greater than 0",
                Some("top_p"),
            ));
        }
        Ok(SamplingParams {
            temperature: self.temperature.unwrap_or(1.0) as f32,
            top_k: self.top_k.unwrap_or(0) as usize,
            top_p: self.top_p.unwrap_or(1.0) as f32,
            min_p: self.min_p.unwrap_or(0.0) as f32,
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logprobs,
        })
    }

    pub fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let v = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if v.len() > 4 {
            return Err(ApiError::invalid("at most 4 stop sequences", Some("stop")));
        }
        Ok(v.into_iter().filter(|s| !s.is_empty()).collect())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

/// Reads the text of a message's content.
pub fn content_text(c: &Option<Content>) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(s)) => Ok(s.clone()),
        Some(Content::Parts(parts)) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            format!("content part of type {kind:?} is not supported (text only)"),
                            Some("messages"),
                        ))
                    }
                }
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: LengthLimits = LengthLimits {
        default_max_tokens: 100,
        max_tokens_limit: 1000,
    };

    fn common(j: Value) -> Common {
        serde_json::from_value(j).unwrap()
    }

    #[test]
    fn output_length_precedence_defaults_and_clamp() {
        use serde_json::json;
        assert_eq!(output_length(&common(json!({})), LIM), 100);
        assert_eq!(output_length(&common(json!({"max_tokens": 0})), LIM), 100);
        assert_eq!(output_length(&common(json!({"max_tokens": -1})), LIM), 100);
        assert_eq!(
            output_length(&common(json!({"max_tokens": 5000})), LIM),
            1000
        );
        assert_eq!(
            output_length(&common(json!({"max_completion_tokens": 7})), LIM),
            7
        );
        assert_eq!(
            output_length(
                &common(json!({"max_output_tokens": 8, "max_completion_tokens": 7})),
                LIM
            ),
            8
        );
        assert_eq!(
            output_length(
                &common(
                    json!({"max_tokens": 9, "max_output_tokens": 8, "max_completion_tokens": 7})
                ),
                LIM
            ),
            9
        );
    }

    #[test]
    fn bad_values_name_their_parameter() {
        use serde_json::json;
        let e = common(json!({"temperature": 3.0}))
            .sampling(None)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = common(json!({"stream_options": {"include_usage": true}}))
            .sampling(None)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        assert!(common(json!({"n": 2})).sampling(None).is_err());
    }
}
