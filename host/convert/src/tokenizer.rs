//! A Hugging Face `tokenizer.json` (byte-level BPE, as DeepSeek ships) -> the GGUF
//! `tokenizer.ggml.*` keys, so a converted file can be served and loads in llama.cpp.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use moe_gguf::{GgufWriter, Value};
use serde_json::Value as Json;

/// ggml token types.
pub const NORMAL: i32 = 1;
const UNUSED: i32 = 5;
pub const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Pre-tokenizer names our tokenizer and llama.cpp both know.
pub const KNOWN_PRE: &[&str] = &["default", "deepseek-v3", "llama3", "qwen2", "smollm"];

/// Writes a byte-level BPE vocabulary (each token with its ggml type) and its merges as
/// the GGUF `tokenizer.ggml.*` keys.
pub fn write_bpe(w: &mut GgufWriter, tokens: Vec<(String, i32)>, merges: Vec<Value>, pre: &str) {
    let (strs, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .map(|(s, ty)| (Value::String(s), Value::I32(ty)))
        .unzip();
    w.add_kv("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.add_kv("tokenizer.ggml.pre", Value::String(pre.into()));
    w.add_kv("tokenizer.ggml.tokens", Value::Array(strs));
    w.add_kv("tokenizer.ggml.token_type", Value::Array(types));
    w.add_kv("tokenizer.ggml.merges", Value::Array(merges));
}

/// Adds the tokenizer in `dir` (if it has a tokenizer.json) to `w`; returns whether it did.
/// `pre` names the pre-tokenizer; without it only a plain ByteLevel one is accepted.
pub fn add_tokenizer(
    w: &mut GgufWriter,
    dir: &Path,
    n_vocab: usize,
    pre: Option<&str>,
) -> Result<bool> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(false);
    }
    let t: Json = serde_json::from_str(
        &std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?,
    )
    .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let model = t
        .get("model")
        .ok_or_else(|| anyhow!("{}: no 'model'", path.display()))?;
    if model.get("type").and_then(Json::as_str) != Some("BPE") {
        bail!("{}: only BPE tokenizers are converted", path.display());
    }
    let pre = match pre {
        Some(p) if KNOWN_PRE.contains(&p) => p.to_string(),
        Some(p) => bail!("--tokenizer-pre '{p}' is not one of {KNOWN_PRE:?}"),
        None => {
            let pt = t
                .get("pre_tokenizer")
                .and_then(|p| p.get("type"))
                .and_then(Json::as_str);
            if pt != Some("ByteLevel") {
                bail!(
                    "{}: the pre-tokenizer ({}) needs a name: pass --tokenizer-pre (one of {KNOWN_PRE:?}; DeepSeek-V3/V4 use deepseek-v3)",
                    path.display(),
                    pt.unwrap_or("none")
                );
            }
            "default".to_string()
        }
    };
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| anyhow!("{}: model.vocab is not an object", path.display()))?;
    let mut tokens: Vec<Option<(String, i32)>> = Vec::new();
    let mut put = |id: u64, s: &str, ty: i32| -> Result<()> {
        let id = usize::try_from(id)
            .ok()
            .filter(|&i| i < 1 << 24)
            .ok_or_else(|| anyhow!("token id {id} is absurd"))?;
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some((s.to_string(), ty));
        Ok(())
    };
    for (s, id) in vocab {
        put(
            id.as_u64()
                .ok_or_else(|| anyhow!("vocab entry '{s}' has no integer id"))?,
            s,
            NORMAL,
        )?;
    }
    for a in t
        .get("added_tokens")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(s)) = (
            a.get("id").and_then(Json::as_u64),
            a.get("content").and_then(Json::as_str),
        ) else {
            bail!("{}: an added token lacks id or content", path.display());
        };
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        put(id, s, if special { CONTROL } else { USER_DEFINED })?;
    }
    if tokens.len() > n_vocab {
        bail!(
            "{}: {} tokens for a vocabulary of {n_vocab}",
            path.display(),
            tokens.len()
        );
    }
    tokens.resize(n_vocab, None);
    let merges: Vec<Value> = model
        .get("merges")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(p) if p.len() == 2 && p.iter().all(Json::is_string) => Ok(format!(
                "{} {}",
                p[0].as_str().unwrap_or_default(),
                p[1].as_str().unwrap_or_default()
            )),
            _ => Err(anyhow!(
                "{}: a merge is neither 'a b' nor [a, b]",
                path.display()
            )),
        })
        .map(|r| r.map(Value::String))
        .collect::<Result<_>>()?;
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED)))
        .collect();
    write_bpe(w, tokens, merges, &pre);
    let cfg = dir.join("tokenizer_config.json");
    if let Ok(text) = std::fs::read_to_string(&cfg) {
        let c: Json = serde_json::from_str(&text)
            .with_context(|| format!("{}: not valid JSON", cfg.display()))?;
        if let Some(tpl) = c.get("chat_template").and_then(Json::as_str) {
            w.add_kv("tokenizer.chat_template", Value::String(tpl.into()));
        }
        if let Some(b) = c.get("add_bos_token").and_then(Json::as_bool) {
            w.add_kv("tokenizer.ggml.add_bos_token", Value::Bool(b));
        }
    }
    Ok(true)
}
