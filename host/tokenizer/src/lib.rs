//! Tokenizers and chat templates built from GGUF tokenizer metadata.
//!
//! * `tokenizer.ggml.model = "gpt2"`: byte-level BPE. Text is cut by the
//!   pre-tokenizer that `tokenizer.ggml.pre` names (see [`PreTokenizerKind`]), then
//!   merged with the HF `tokenizers` BPE model built from the GGUF vocab and merges.
//! * `tokenizer.ggml.model = "llama"`: SentencePiece BPE (scores, `▁` for spaces,
//!   `<0xNN>` byte fallback). It needs `tokenizer.ggml.scores`, which
//!   [`TokenizerParts`] does not carry: pass them in [`ExtraParts`] through
//!   [`Tokenizer::from_parts_with`]. Only a space prefix at the very start of the
//!   text is added (not after every special token).
//! * Any other model type is a [`TokenizerError::UnsupportedModel`] error.
//!
//! Unknown `tokenizer.ggml.pre` names do not fail: they fall back to the GPT-2
//! split rules with a `tracing` warning, because new names appear with every model
//! family and GPT-2's rules are the common ancestor of most of them; the resolved
//! rule set is reported by [`Tokenizer::pre_tokenizer`] so callers can surface it.
//!
//! Special tokens: control (type 3) and unknown (type 2) token strings in the text
//! are recognised only when `parse_special` is set; user-defined tokens (type 4)
//! are always recognised. Matching is leftmost-longest; the text between matches
//! is pre-tokenized and merged on its own.

mod bytelevel;
mod chat;
mod pretok;
mod spm;
mod stream;

use std::collections::HashSet;

use aho_corasick::{AhoCorasick, MatchKind};
use tokenizers::models::bpe::{Vocab, BPE};

pub use chat::FALLBACK_CHAT_TEMPLATE;
pub use pretok::PreTokenizerKind;
pub use stream::StreamDecoder;

use bytelevel::ByteLevelAlphabet;
use chat::ChatTemplate;
use spm::{SpmModel, SPACE_MARK};

/// The tokenizer fields of a GGUF file, as plain Rust values.
#[derive(Debug, Clone, Default)]
pub struct TokenizerParts {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE).
    pub model: String,
    /// `tokenizer.ggml.pre`: selects the pre-tokenizer split rules (byte-level BPE only).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined,
    /// 5 unused, 6 byte. When absent, types are guessed from the token text.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: "a b" per entry, highest priority first.
    pub merges: Vec<String>,
    pub bos_id: Option<u32>,
    pub eos_id: Option<u32>,
    pub unk_id: Option<u32>,
    pub pad_id: Option<u32>,
    /// Extra end-of-generation ids (`tokenizer.ggml.eot_token_id`, `eom_token_id`, ...).
    pub eot_ids: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: bool,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// GGUF tokenizer fields that [`TokenizerParts`] does not carry, needed by some
/// model types.
#[derive(Debug, Clone, Default)]
pub struct ExtraParts {
    /// `tokenizer.ggml.scores` (required for "llama" SentencePiece vocabularies).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.add_space_prefix` ("llama" only; default true).
    pub add_space_prefix: Option<bool>,
}

/// One chat turn.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// More fields the template may read (`tool_calls`, `tool_call_id`,
    /// `reasoning_content`...), as the request gave them.
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            extra: Default::default(),
        }
    }
}

/// Variables a chat template sees besides `messages`, `add_generation_prompt` and the
/// BOS / EOS strings: `tools`, `thinking`, `reasoning_effort`... (empty: none).
pub type TemplateVars = serde_json::Map<String, serde_json::Value>;

/// GGUF token types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    /// From the GGUF integer; values outside 1..=6 count as normal.
    pub fn from_gguf(v: i32) -> Self {
        match v {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer model type {0:?} is not supported (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece BPE)")]
    UnsupportedModel(String),
    #[error("tokenizer metadata incomplete: {0}")]
    MissingData(String),
    #[error("cannot build tokenizer: {0}")]
    Build(String),
    #[error("token id {id} is out of range (vocabulary has {vocab_size} tokens)")]
    InvalidTokenId { id: u32, vocab_size: usize },
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("the model has no chat template")]
    NoChatTemplate,
    #[error("message content holds the control-token string {0:?}, and this chat template changes content, so it cannot be kept as plain text")]
    LiteralContent(String),
    #[error("a message's tool calls, reasoning or name, or the tools, hold the control-token string {0:?}: only message content is kept as plain text")]
    ControlTokenInField(String),
    #[error("chat template error{}: {message}", line.map(|l| format!(" at line {l}")).unwrap_or_default())]
    Template {
        line: Option<usize>,
        message: String,
    },
}

/// Token strings that end a turn or a document when they are control tokens.
const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|return|>",
    "<end_of_turn>",
    "<|end_of_turn|>",
    "<|end▁of▁sentence|>",
    "<｜end▁of▁sentence｜>",
    "<EOT>",
    "<|EOT|>",
    "</s>",
];

enum Model {
    /// Byte-level BPE: pre-tokenizer + BPE merges (HF `tokenizers`), no added tokens.
    ByteBpe(Box<tokenizers::Tokenizer>),
    Spm {
        model: Box<SpmModel>,
        add_space_prefix: bool,
    },
}

/// Leftmost-longest matcher over special-token strings.
struct SpecialMatcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl SpecialMatcher {
    fn new(entries: Vec<(&str, u32)>) -> Result<Option<Self>, TokenizerError> {
        if entries.is_empty() {
            return Ok(None);
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(entries.iter().map(|(t, _)| t))
            .map_err(|e| TokenizerError::Build(format!("special-token matcher: {e}")))?;
        Ok(Some(Self {
            automaton,
            ids: entries.into_iter().map(|(_, id)| id).collect(),
        }))
    }
}

/// A tokenizer built from GGUF metadata. Cheap to share (`Send + Sync`).
pub struct Tokenizer {
    model: Model,
    pre: Option<PreTokenizerKind>,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    /// Raw bytes of each token.
    pieces: Vec<Box<[u8]>>,
    /// User-defined tokens: always matched in input text.
    always_special: Option<SpecialMatcher>,
    /// User-defined, control and unknown tokens: matched when `parse_special`.
    all_special: Option<SpecialMatcher>,
    bos_id: Option<u32>,
    eos_id: Option<u32>,
    unk_id: Option<u32>,
    pad_id: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    end_of_generation: Vec<u32>,
    chat_template_source: Option<String>,
    chat_template: Option<Result<ChatTemplate, TokenizerError>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model_type())
            .field("pre_tokenizer", &self.pre_tokenizer())
            .field("vocab_size", &self.vocab_size())
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("end_of_generation", &self.end_of_generation)
            .field("has_chat_template", &self.chat_template_source.is_some())
            .finish()
    }
}

fn guess_type(model: &str, token: &str) -> TokenType {
    let wrapped = |open: &str, close: &str| {
        token.len() > open.len() + close.len() && token.starts_with(open) && token.ends_with(close)
    };
    if model == "llama" {
        if spm::parse_byte_token(token).is_some() {
            return TokenType::Byte;
        }
        if token == "<unk>" {
            return TokenType::Unknown;
        }
        if token == "<s>" || token == "</s>" || wrapped("<|", "|>") {
            return TokenType::Control;
        }
        return TokenType::Normal;
    }
    if wrapped("<|", "|>") || wrapped("<｜", "｜>") {
        TokenType::Control
    } else {
        TokenType::Normal
    }
}

impl Tokenizer {
    /// Builds a tokenizer from GGUF tokenizer metadata.
    pub fn from_parts(p: TokenizerParts) -> Result<Tokenizer, TokenizerError> {
        Self::from_parts_with(p, ExtraParts::default())
    }

    /// Like [`Tokenizer::from_parts`], with the GGUF fields some model types need
    /// beyond [`TokenizerParts`] (scores for "llama").
    pub fn from_parts_with(
        p: TokenizerParts,
        extra: ExtraParts,
    ) -> Result<Tokenizer, TokenizerError> {
        let n = p.tokens.len();
        if n == 0 {
            return Err(TokenizerError::MissingData(
                "tokenizer.ggml.tokens is empty".into(),
            ));
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::Build(format!(
                "{n} tokens do not fit u32 ids"
            )));
        }
        let types: Vec<TokenType> = match &p.token_types {
            Some(t) if t.len() != n => {
                return Err(TokenizerError::Build(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    t.len()
                )))
            }
            Some(t) => t.iter().map(|&v| TokenType::from_gguf(v)).collect(),
            None => p.tokens.iter().map(|t| guess_type(&p.model, t)).collect(),
        };
        let check_id = |name: &str, id: Option<u32>| match id {
            Some(i) if i as usize >= n => {
                tracing::warn!("ignoring {name} id {i}: the vocabulary has {n} tokens");
                None
            }
            other => other,
        };
        let bos_id = check_id("bos", p.bos_id);
        let eos_id = check_id("eos", p.eos_id);
        let unk_id = check_id("unknown-token", p.unk_id);
        let pad_id = check_id("padding", p.pad_id);

        let (model, pre, pieces) = match p.model.as_str() {
            "gpt2" => {
                let (kind, hf) = build_byte_bpe(&p)?;
                let alphabet = ByteLevelAlphabet::new();
                let pieces = p
                    .tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, ty)| match ty {
                        // Added tokens are stored as their literal text.
                        TokenType::Control | TokenType::UserDefined | TokenType::Unknown => {
                            t.as_bytes().into()
                        }
                        _ => alphabet.decode_token(t).into_boxed_slice(),
                    })
                    .collect();
                (Model::ByteBpe(Box::new(hf)), Some(kind), pieces)
            }
            "llama" => {
                let scores = extra.scores.ok_or_else(|| {
                    TokenizerError::MissingData(
                        "a SentencePiece (\"llama\") vocabulary needs tokenizer.ggml.scores: \
                         pass them in ExtraParts via Tokenizer::from_parts_with"
                            .into(),
                    )
                })?;
                if scores.len() != n {
                    return Err(TokenizerError::Build(format!(
                        "tokenizer.ggml.scores has {} entries for {n} tokens",
                        scores.len()
                    )));
                }
                let pieces = p
                    .tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, ty)| match ty {
                        TokenType::Byte => match spm::parse_byte_token(t) {
                            Some(b) => vec![b].into_boxed_slice(),
                            None => t.as_bytes().into(),
                        },
                        TokenType::Normal | TokenType::Unused => {
                            t.replace(SPACE_MARK, " ").into_bytes().into_boxed_slice()
                        }
                        _ => t.as_bytes().into(),
                    })
                    .collect();
                let model = Model::Spm {
                    model: Box::new(SpmModel::new(&p.tokens, scores, unk_id)),
                    add_space_prefix: extra.add_space_prefix.unwrap_or(true),
                };
                (model, None, pieces)
            }
            other => return Err(TokenizerError::UnsupportedModel(other.to_owned())),
        };

        let mut always = Vec::new();
        let mut all = Vec::new();
        let mut seen = HashSet::new();
        for (id, (t, ty)) in p.tokens.iter().zip(&types).enumerate() {
            let special = matches!(
                ty,
                TokenType::UserDefined | TokenType::Control | TokenType::Unknown
            );
            // Empty strings would match everywhere; a repeated string keeps its first id.
            if !special || t.is_empty() || !seen.insert(t.as_str()) {
                continue;
            }
            if *ty == TokenType::UserDefined {
                always.push((t.as_str(), id as u32));
            }
            all.push((t.as_str(), id as u32));
        }

        let mut end_of_generation: Vec<u32> = eos_id.into_iter().collect();
        end_of_generation.extend(p.eot_ids.iter().copied().filter(|&i| (i as usize) < n));
        for (id, (t, ty)) in p.tokens.iter().zip(&types).enumerate() {
            if matches!(ty, TokenType::Control | TokenType::UserDefined)
                && END_OF_GENERATION_TEXTS.contains(&t.as_str())
            {
                end_of_generation.push(id as u32);
            }
        }
        end_of_generation.sort_unstable();
        end_of_generation.dedup();

        let chat_template = p.chat_template.as_deref().map(ChatTemplate::compile);
        if let Some(Err(e)) = &chat_template {
            tracing::warn!("the model's chat template does not compile: {e}");
        }

        Ok(Tokenizer {
            model,
            pre,
            always_special: SpecialMatcher::new(always)?,
            all_special: SpecialMatcher::new(all)?,
            tokens: p.tokens,
            types,
            pieces,
            bos_id,
            eos_id,
            unk_id,
            pad_id,
            add_bos: p.add_bos,
            add_eos: p.add_eos,
            end_of_generation,
            chat_template_source: p.chat_template,
            chat_template,
        })
    }

    /// Whether a chat template compiles (checked before a model loads).
    pub fn check_chat_template(source: &str) -> Result<(), TokenizerError> {
        ChatTemplate::compile(source).map(drop)
    }

    /// Replaces the model's chat template (a template file given to the server); an
    /// error, and the old one kept, if the new one does not compile.
    pub fn set_chat_template(&mut self, source: String) -> Result<(), TokenizerError> {
        let t = ChatTemplate::compile(&source)?;
        self.chat_template = Some(Ok(t));
        self.chat_template_source = Some(source);
        Ok(())
    }

    /// Text to ids. `add_special` adds BOS/EOS as the model asks (`add_bos`/`add_eos`);
    /// `parse_special` recognises control-token strings such as `<|im_start|>` in
    /// `text` (user-defined tokens are always recognised).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_segments(&[(text, parse_special)], add_special)
    }

    /// Encodes the concatenation of `segments`, each with its own `parse_special`:
    /// a special-token string is recognised only when it lies wholly inside one
    /// segment that allows it, while the text between special tokens is merged as one
    /// run across segment boundaries (so a literal segment tokenizes exactly as it
    /// would inside the whole text).
    pub fn encode_segments(
        &self,
        segments: &[(&str, bool)],
        add_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let len: usize = segments.iter().map(|(t, _)| t.len()).sum();
        let mut ids = Vec::with_capacity(len / 3 + 2);
        if add_special && self.add_bos {
            ids.extend(self.bos_id);
        }
        let mut run = String::new();
        let mut at_start = true;
        for &(text, parse_special) in segments {
            let matcher = if parse_special {
                &self.all_special
            } else {
                &self.always_special
            };
            let mut last = 0;
            if let Some(m) = matcher {
                for found in m.automaton.find_iter(text) {
                    run.push_str(&text[last..found.start()]);
                    self.encode_text(&run, at_start, &mut ids)?;
                    run.clear();
                    at_start = false;
                    ids.push(m.ids[found.pattern().as_usize()]);
                    last = found.end();
                }
            }
            run.push_str(&text[last..]);
        }
        self.encode_text(&run, at_start, &mut ids)?;
        if add_special && self.add_eos {
            ids.extend(self.eos_id);
        }
        Ok(ids)
    }

    /// Encodes text that holds no special tokens.
    fn encode_text(
        &self,
        text: &str,
        at_start: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.model {
            Model::ByteBpe(hf) => {
                let enc = hf
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Encode(e.to_string()))?;
                out.extend_from_slice(enc.get_ids());
            }
            Model::Spm {
                model,
                add_space_prefix,
            } => {
                let mut escaped = String::with_capacity(text.len() + 3);
                if *add_space_prefix && at_start {
                    escaped.push(SPACE_MARK);
                }
                escaped.extend(text.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                model.encode(&escaped, out);
            }
        }
        Ok(())
    }

    /// Ids to text. `skip_special` leaves out control tokens (e.g. `<|im_end|>`).
    /// Bytes that do not form valid UTF-8 come out as U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        // SentencePiece vocabularies: undo the space prefix that encoding added, on
        // the first piece that is text (not BOS or another control token).
        let mut strip_space = matches!(
            self.model,
            Model::Spm {
                add_space_prefix: true,
                ..
            }
        );
        for &id in ids {
            let piece = self.piece(id).ok_or(TokenizerError::InvalidTokenId {
                id,
                vocab_size: self.vocab_size(),
            })?;
            let control = self.is_control(id);
            if skip_special && control {
                continue;
            }
            let mut piece = piece;
            if strip_space && !control {
                strip_space = false;
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            bytes.extend_from_slice(piece);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    pub(crate) fn piece(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(|p| &p[..])
    }

    pub(crate) fn is_control(&self, id: u32) -> bool {
        self.types.get(id as usize) == Some(&TokenType::Control)
    }

    /// The raw bytes a token stands for (a control token's bytes are its text).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        self.piece(id).map(<[u8]>::to_vec)
    }

    /// The token's vocab string as stored in the GGUF.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos_id
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// "gpt2" or "llama".
    pub fn model_type(&self) -> &'static str {
        match self.model {
            Model::ByteBpe(_) => "gpt2",
            Model::Spm { .. } => "llama",
        }
    }

    /// The split rules in use (byte-level BPE only): after an unknown
    /// `tokenizer.ggml.pre` this is the GPT-2 fallback.
    pub fn pre_tokenizer(&self) -> Option<PreTokenizerKind> {
        self.pre
    }

    /// EOS, the extra end-of-generation ids, and control tokens that end a turn
    /// (`<|im_end|>`, `<|endoftext|>`, `<|eot_id|>`, `<|end_of_text|>`, ...).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.binary_search(&id).is_ok()
    }

    /// All end-of-generation ids, sorted.
    pub fn end_of_generation_ids(&self) -> &[u32] {
        &self.end_of_generation
    }

    /// The model's own chat template source, if it has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template_source.as_deref()
    }

    fn special_text(&self, id: Option<u32>) -> &str {
        id.and_then(|i| self.token_text(i)).unwrap_or("")
    }

    /// Renders the model's chat template. [`TokenizerError::NoChatTemplate`] when it
    /// has none (render [`FALLBACK_CHAT_TEMPLATE`] with [`Tokenizer::apply_template`]
    /// instead); template errors carry minijinja's message and the line.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_chat_template_vars(messages, add_generation_prompt, &TemplateVars::new())
    }

    /// [`Tokenizer::apply_chat_template`] with more template variables.
    pub fn apply_chat_template_vars(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String, TokenizerError> {
        match &self.chat_template {
            None => Err(TokenizerError::NoChatTemplate),
            Some(Err(e)) => Err(e.clone()),
            Some(Ok(t)) => t.render(
                messages,
                (add_generation_prompt, vars),
                self.special_text(self.bos_id),
                self.special_text(self.eos_id),
            ),
        }
    }

    /// Renders any chat template (e.g. [`FALLBACK_CHAT_TEMPLATE`]) with this
    /// tokenizer's BOS/EOS strings.
    pub fn apply_template(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.apply_template_vars(
            template,
            messages,
            add_generation_prompt,
            &TemplateVars::new(),
        )
    }

    /// [`Tokenizer::apply_template`] with more template variables.
    pub fn apply_template_vars(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String, TokenizerError> {
        ChatTemplate::compile(template)?.render(
            messages,
            (add_generation_prompt, vars),
            self.special_text(self.bos_id),
            self.special_text(self.eos_id),
        )
    }
}

impl Tokenizer {
    /// Renders the model's chat template and encodes it with every message's content
    /// kept literal: a control-token string such as `<|im_end|>` typed by a user
    /// stays text instead of closing a turn. Errors as [`Tokenizer::apply_chat_template`],
    /// plus [`TokenizerError::LiteralContent`] (see [`Tokenizer::encode_chat_with`]).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_with(messages, |m| {
            self.apply_chat_template(m, add_generation_prompt)
        })
    }

    /// [`Tokenizer::encode_chat`] with more template variables.
    pub fn encode_chat_vars(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.check_vars(vars)?;
        self.encode_chat_with(messages, |m| {
            self.apply_chat_template_vars(m, add_generation_prompt, vars)
        })
    }

    /// [`Tokenizer::encode_chat`] with another template (e.g. [`FALLBACK_CHAT_TEMPLATE`]).
    pub fn encode_chat_template(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_chat_template_vars(
            template,
            messages,
            add_generation_prompt,
            &TemplateVars::new(),
        )
    }

    /// [`Tokenizer::encode_chat_template`] with template variables.
    pub fn encode_chat_template_vars(
        &self,
        template: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.check_vars(vars)?;
        let t = ChatTemplate::compile(template)?;
        self.encode_chat_with(messages, |m| {
            t.render(
                m,
                (add_generation_prompt, vars),
                self.special_text(self.bos_id),
                self.special_text(self.eos_id),
            )
        })
    }

    /// Encodes `render(messages)` (BOS/EOS as `encode(.., true, true)` adds them) with
    /// the messages' content literal. The content's place in the text is found by
    /// rendering once more with a marker per message; when putting the contents back
    /// in the markers' places gives the same text, the markers' spans are encoded
    /// without special tokens and the template's text with them. A template that
    /// changes content (trims it, branches on it) fails that check: its text is then
    /// encoded as a whole, which is the same when no content holds a control-token
    /// string, and otherwise a [`TokenizerError::LiteralContent`] error.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        render: impl Fn(&[ChatMessage]) -> Result<String, TokenizerError>,
    ) -> Result<Vec<u32>, TokenizerError> {
        // Fields besides content (tool calls' arguments, reasoning, names) go into the
        // template's text, whose control-token strings are parsed: none may hold one.
        for msg in messages.iter().filter(|m| !m.extra.is_empty()) {
            let fields = serde_json::Value::Object(msg.extra.clone()).to_string();
            if let Some(found) = self.control_token_in(&fields) {
                return Err(TokenizerError::ControlTokenInField(found));
            }
        }
        let text = render(messages)?;
        if let Some(segments) = content_spans(messages, &text, &render) {
            let segs: Vec<(&str, bool)> = segments
                .iter()
                .map(|&(a, b, literal)| (&text[a..b], !literal))
                .collect();
            return self.encode_segments(&segs, true);
        }
        // Only control (and unknown) token strings matter: user-defined ones such as
        // `<think>` are tokens wherever they appear, literal or not.
        for msg in messages {
            if let Some(found) = self.control_token_in(&msg.content) {
                return Err(TokenizerError::LiteralContent(found));
            }
        }
        self.encode(&text, true, true)
    }

    /// The first control (or unknown) token string in `s`: user-defined ones such as
    /// `<think>` are tokens wherever they appear, literal or not, so they do not count.
    fn control_token_in(&self, s: &str) -> Option<String> {
        let m = self.all_special.as_ref()?;
        m.automaton
            .find_iter(s)
            .find(|f| {
                self.token_type(m.ids[f.pattern().as_usize()]) != Some(TokenType::UserDefined)
            })
            .map(|f| s[f.start()..f.end()].to_string())
    }

    /// A control-token string in the template variables (`tools`' schemas...) as a
    /// [`TokenizerError::ControlTokenInField`] error: they are template text.
    fn check_vars(&self, vars: &TemplateVars) -> Result<(), TokenizerError> {
        if vars.is_empty() {
            return Ok(());
        }
        let all = serde_json::Value::Object(vars.clone()).to_string();
        match self.control_token_in(&all) {
            Some(found) => Err(TokenizerError::ControlTokenInField(found)),
            None => Ok(()),
        }
    }
}

/// Marker characters around a message's index (Unicode private use: no template
/// filter touches them, no tokenizer gives them meaning).
const MARK_OPEN: char = '\u{F8FF}';
const MARK_CLOSE: char = '\u{F8FE}';

/// `(start, end, literal)` byte spans covering `text`: literal ones are message
/// content. None when the template does not place content verbatim (see
/// [`Tokenizer::encode_chat_with`]) or content already holds a marker character.
fn content_spans(
    messages: &[ChatMessage],
    text: &str,
    render: &impl Fn(&[ChatMessage]) -> Result<String, TokenizerError>,
) -> Option<Vec<(usize, usize, bool)>> {
    let has_mark = |s: &str| s.contains(MARK_OPEN) || s.contains(MARK_CLOSE);
    if messages.iter().any(|m| has_mark(&m.content)) {
        return None;
    }
    let marked: Vec<ChatMessage> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| ChatMessage {
            content: format!("{MARK_OPEN}{i}{MARK_CLOSE}"),
            ..m.clone()
        })
        .collect();
    let skeleton = render(&marked).ok()?;
    let mut spans = Vec::new();
    let mut rebuilt = String::with_capacity(text.len());
    let mut rest = skeleton.as_str();
    while let Some(open) = rest.find(MARK_OPEN) {
        let after = &rest[open + MARK_OPEN.len_utf8()..];
        let close = after.find(MARK_CLOSE)?;
        let i: usize = after[..close].parse().ok()?;
        let content = &messages.get(i)?.content;
        let a = rebuilt.len();
        rebuilt.push_str(&rest[..open]);
        spans.push((a, rebuilt.len(), false));
        let a = rebuilt.len();
        rebuilt.push_str(content);
        spans.push((a, rebuilt.len(), true));
        rest = &after[close + MARK_CLOSE.len_utf8()..];
    }
    if has_mark(rest) {
        return None;
    }
    let a = rebuilt.len();
    rebuilt.push_str(rest);
    spans.push((a, rebuilt.len(), false));
    (rebuilt == text).then_some(spans)
}

/// The HF `tokenizers` BPE + pre-tokenizer for a byte-level vocabulary.
fn build_byte_bpe(
    p: &TokenizerParts,
) -> Result<(PreTokenizerKind, tokenizers::Tokenizer), TokenizerError> {
    if p.merges.is_empty() {
        return Err(TokenizerError::MissingData(
            "tokenizer.ggml.merges is missing or empty (required for \"gpt2\" BPE)".into(),
        ));
    }
    let kind = match p.pre.as_deref() {
        None => PreTokenizerKind::Gpt2,
        Some(name) => PreTokenizerKind::from_gguf_name(name).unwrap_or_else(|| {
            tracing::warn!(
                "unknown tokenizer.ggml.pre {name:?}: falling back to GPT-2 split rules; \
                 tokenization may differ from the model's own"
            );
            PreTokenizerKind::Gpt2
        }),
    };
    let mut vocab = Vocab::with_capacity(p.tokens.len());
    for (id, t) in p.tokens.iter().enumerate() {
        vocab.entry(t.clone()).or_insert(id as u32);
    }
    let mut merges = Vec::with_capacity(p.merges.len());
    for (i, m) in p.merges.iter().enumerate() {
        // The separator is the first space after the first character, so a left
        // side that is itself a space still parses.
        let first = m.chars().next().map_or(0, char::len_utf8);
        let Some(sep) = m.get(first..).and_then(|rest| rest.find(' ')) else {
            return Err(TokenizerError::Build(format!(
                "merge {i} ({m:?}) is not two tokens separated by a space"
            )));
        };
        let (a, b) = (&m[..first + sep], &m[first + sep + 1..]);
        merges.push((a.to_owned(), b.to_owned()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(kind.ignore_merges())
        .build()
        .map_err(|e| TokenizerError::Build(format!("BPE model: {e}")))?;
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(kind.build()?));
    Ok((kind, hf))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shareable() {
        assert_send_sync::<Tokenizer>();
    }
}
