//! Request bodies of the two generation endpoints, and their validation.

use std::collections::HashMap;

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
    /// An assistant turn's calls (`[{id, type, function: {name, arguments}}]`),
    /// handed to the chat template as given.
    #[serde(default)]
    pub tool_calls: Option<Value>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// An assistant turn's reasoning, as this server returns it (templates that keep
    /// reasoning in the history read it).
    #[serde(default)]
    pub reasoning_content: Option<String>,
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

/// Fields shared by chat and text completions. Unknown fields are ignored, as OpenAI
/// clients send many; known ones that would change the answer and are not supported
/// (tools, structured output...) are refused by [`Common::unsupported`]. `null` is
/// the same as leaving a field out.
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
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    /// Token id (a decimal string) -> bias in [-100, 100].
    pub logit_bias: Option<HashMap<String, f64>>,
    pub best_of: Option<i64>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub functions: Option<Value>,
    pub function_call: Option<Value>,
    pub response_format: Option<Value>,
    /// llama-server's switch: false = prefill the whole prompt even where a slot's
    /// cache holds its start (default true).
    pub cache_prompt: Option<bool>,
}

/// The longest stop sequence accepted, in bytes (each is searched for after every
/// token).
pub const MAX_STOP_BYTES: usize = 1024;

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// Chat style: a bool, with `top_logprobs` for alternatives.
    #[serde(default)]
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// More variables for the chat template (`{"thinking": true}`), as llama-server
    /// and vLLM take them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Handed to the chat template as `reasoning_effort`.
    pub reasoning_effort: Option<String>,
    #[serde(flatten)]
    pub common: Common,
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Legacy style: the number of alternatives per token.
    pub logprobs: Option<i64>,
    /// Refused when true / non-empty (not supported).
    pub echo: Option<bool>,
    pub suffix: Option<String>,
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

/// Whether a field was given a value that asks for something (not null, not empty).
fn given(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
        Some(_) => true,
    }
}

pub fn not_supported(what: &str, param: &str) -> ApiError {
    ApiError::invalid(
        format!("{what} is not supported by this server"),
        Some(param),
    )
    .with_code("unsupported_parameter")
}

impl Common {
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// Refuses what the request asks for that this server cannot do, rather than
    /// answering as if it had not been asked.
    pub fn unsupported(&self) -> Result<(), ApiError> {
        if given(&self.functions) {
            return Err(not_supported(
                "'functions' (the deprecated form; send 'tools')",
                "functions",
            ));
        }
        if given(&self.function_call)
            && self.function_call.as_ref().and_then(Value::as_str) != Some("none")
        {
            return Err(not_supported(
                "'function_call' (the deprecated form; send 'tool_choice')",
                "function_call",
            ));
        }
        if let Some(f) = self.response_format.as_ref().filter(|v| !v.is_null()) {
            if f.get("type").and_then(Value::as_str) != Some("text") {
                return Err(not_supported(
                    "'response_format' other than {\"type\": \"text\"}",
                    "response_format",
                ));
            }
        }
        if self.best_of.is_some_and(|b| b != 1) {
            return Err(not_supported("'best_of' other than 1", "best_of"));
        }
        Ok(())
    }

    /// Checks values and builds sampling parameters (`top_logprobs`: None = no
    /// logprobs; `n_vocab` bounds `logit_bias`'s token ids; `default_temperature` where
    /// the request gives none).
    pub fn sampling(
        &self,
        logprobs: Option<usize>,
        n_vocab: usize,
        default_temperature: f32,
    ) -> Result<SamplingParams, ApiError> {
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
            return Err(not_supported("'n' other than 1", "n"));
        }
        if self.stream_options.is_some() && !self.stream() {
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
        let mut logit_bias = Vec::new();
        for (k, &b) in self.logit_bias.iter().flatten() {
            let bad = |m: String| ApiError::invalid(m, Some("logit_bias"));
            let id: u32 = k
                .parse()
                .map_err(|_| bad(format!("'logit_bias' key {k:?} is not a token id")))?;
            if id as usize >= n_vocab {
                return Err(bad(format!(
                    "'logit_bias' token id {id} is outside the vocabulary ({n_vocab})"
                )));
            }
            if !(-100.0..=100.0).contains(&b) {
                return Err(bad(format!(
                    "'logit_bias' values must be between -100 and 100, got {b}"
                )));
            }
            logit_bias.push((id, b as f32));
        }
        logit_bias.sort_unstable_by_key(|&(id, _)| id);
        Ok(SamplingParams {
            temperature: self.temperature.map_or(default_temperature, |t| t as f32),
            top_k: self.top_k.unwrap_or(0) as usize,
            top_p: self.top_p.unwrap_or(1.0) as f32,
            min_p: self.min_p.unwrap_or(0.0) as f32,
            seed: self.seed.map(|s| s as u64),
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logprobs,
            logit_bias,
        })
    }

    /// The tools the model may call: None where none were given or `tool_choice` is
    /// "none". A choice the output would have to be forced to ("required", a named
    /// function) is refused: nothing here constrains what the model writes.
    pub fn tools(&self) -> Result<Option<Vec<Value>>, ApiError> {
        match self.tool_choice.as_ref().filter(|v| !v.is_null()) {
            None => {}
            Some(v) if v.as_str() == Some("auto") => {}
            Some(v) if v.as_str() == Some("none") => return Ok(None),
            Some(_) => {
                return Err(not_supported(
                    "a 'tool_choice' other than \"auto\" or \"none\" (the output cannot be forced)",
                    "tool_choice",
                ))
            }
        }
        if !given(&self.tools) {
            return Ok(None);
        }
        let Some(Value::Array(tools)) = &self.tools else {
            return Err(ApiError::invalid("'tools' must be an array", Some("tools")));
        };
        for (i, t) in tools.iter().enumerate() {
            let ok = t.get("type").and_then(Value::as_str) == Some("function")
                && t.pointer("/function/name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| !n.is_empty());
            if !ok {
                return Err(ApiError::invalid(
                    format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    Some("tools"),
                ));
            }
        }
        Ok(Some(tools.clone()))
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
        if v.iter().any(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                format!("a stop sequence may be at most {MAX_STOP_BYTES} bytes long"),
                Some("stop"),
            ));
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
                let bad = |m: String| Err(ApiError::invalid(m, Some("messages")));
                match (p.get("type"), p.get("text").and_then(Value::as_str)) {
                    (Some(Value::String(k)), Some(t)) if k == "text" => out.push_str(t),
                    (Some(Value::String(k)), None) if k == "text" => {
                        return bad("a content part of type 'text' needs a string 'text'".into())
                    }
                    (Some(Value::String(k)), _) => {
                        return bad(format!(
                            "content parts of type '{k}' are not supported (text only)"
                        ))
                    }
                    _ => return bad("a content part needs a string 'type'".into()),
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
            .sampling(None, 10, 1.0)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e = common(json!({"stream_options": {"include_usage": true}}))
            .sampling(None, 10, 1.0)
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options"));
        assert!(common(json!({"n": 2})).sampling(None, 10, 1.0).is_err());
        for (j, p) in [
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"10": 1}}), "logit_bias"),
            (json!({"logit_bias": {"3": 101}}), "logit_bias"),
        ] {
            let e = common(j).sampling(None, 10, 1.0).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(p));
        }
        let s = common(json!({"logit_bias": {"9": -100, "2": 5.5}, "stream": null}))
            .sampling(None, 10, 1.0)
            .unwrap();
        assert_eq!(s.logit_bias, [(2, 5.5), (9, -100.0)]);
    }

    #[test]
    fn unsupported_features_are_refused_and_empty_ones_pass() {
        use serde_json::json;
        for (j, p) in [
            (json!({"functions": [{}]}), "functions"),
            (json!({"function_call": "auto"}), "function_call"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (json!({"best_of": 3}), "best_of"),
        ] {
            let e = common(j).unsupported().unwrap_err();
            assert_eq!(e.param.as_deref(), Some(p));
        }
        for j in [
            json!({"tools": [], "tool_choice": "none", "response_format": {"type": "text"}}),
            json!({"tools": null, "tool_choice": null, "best_of": 1, "stream": null}),
        ] {
            assert!(common(j).unsupported().is_ok());
        }
        // Tools: well-formed functions pass; forced choices and malformed tools do not.
        let f = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        assert_eq!(
            common(json!({"tools": [f]}))
                .tools()
                .unwrap()
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            common(json!({"tools": [f], "tool_choice": "auto"}))
                .tools()
                .unwrap()
                .unwrap()
                .len(),
            1
        );
        assert!(common(json!({"tools": [f], "tool_choice": "none"}))
            .tools()
            .unwrap()
            .is_none());
        assert!(common(json!({"tools": []})).tools().unwrap().is_none());
        for (j, p) in [
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (
                json!({"tools": [{"type": "code", "function": {"name": "f"}}]}),
                "tools",
            ),
            (json!({"tools": {"a": 1}}), "tools"),
            (
                json!({"tools": [f], "tool_choice": "required"}),
                "tool_choice",
            ),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
        ] {
            let e = common(j).tools().unwrap_err();
            assert_eq!(e.param.as_deref(), Some(p));
        }
    }
}
