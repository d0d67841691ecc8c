//! Pre-tokenizer selection for byte-level BPE vocabularies (`tokenizer.ggml.pre`).
//!
//! A byte-level BPE model only merges inside the pieces its pre-tokenizer cuts the
//! text into, so the split rules must be the ones the vocabulary was trained with.
//! The patterns below are the ones the respective models publish in their
//! tokenizer.json files.

use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::TokenizerError;

/// The split rule families we know.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreTokenizerKind {
    /// GPT-2: contractions, letters, numbers, punctuation runs, whitespace.
    Gpt2,
    /// GPT-2 rules after cutting every digit into its own piece (SmolLM, StarCoder).
    DigitsGpt2,
    /// Llama 3: case-insensitive contractions, numbers in groups of up to three.
    Llama3,
    /// Qwen2: like Llama 3 but every digit alone.
    Qwen2,
    /// DeepSeek V3: number groups, CJK runs, then letter/punctuation rules.
    DeepseekV3,
}

impl PreTokenizerKind {
    /// Canonical name, as reported by `Tokenizer::pre_tokenizer`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Gpt2 => "gpt2",
            Self::DigitsGpt2 => "smollm",
            Self::Llama3 => "llama-bpe",
            Self::Qwen2 => "qwen2",
            Self::DeepseekV3 => "deepseek-v3",
        }
    }

    /// Maps a `tokenizer.ggml.pre` value to a kind; `None` for names we don't know.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        Some(match name {
            "gpt2" | "gpt-2" | "default" => Self::Gpt2,
            "smollm" | "starcoder" | "refact" => Self::DigitsGpt2,
            "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "pixtral" => Self::Llama3,
            "qwen2" | "deepseek-r1-qwen" | "megrez" => Self::Qwen2,
            "deepseek-v3" => Self::DeepseekV3,
            _ => return None,
        })
    }

    /// Whether a piece that is itself a vocab entry is emitted without merging
    /// (Llama 3's tokenizer is published with `ignore_merges`).
    pub(crate) fn ignore_merges(self) -> bool {
        matches!(self, Self::Llama3)
    }

    pub(crate) fn build(self) -> Result<PreTokenizerWrapper, TokenizerError> {
        // ByteLevel with its own (GPT-2) regex, or as a pure byte mapping after our splits.
        let byte_level_regex = || ByteLevel::new(false, true, true).into();
        let byte_level_plain = || ByteLevel::new(false, true, false).into();
        let pieces: Vec<PreTokenizerWrapper> = match self {
            Self::Gpt2 => return Ok(byte_level_regex()),
            Self::DigitsGpt2 => vec![Digits::new(true).into(), byte_level_regex()],
            Self::Llama3 => vec![split(LLAMA3)?, byte_level_plain()],
            Self::Qwen2 => vec![split(QWEN2)?, byte_level_plain()],
            Self::DeepseekV3 => vec![
                split(DEEPSEEK_V3_NUMBERS)?,
                split(DEEPSEEK_V3_CJK)?,
                split(DEEPSEEK_V3_WORDS)?,
                byte_level_plain(),
            ],
        };
        Ok(Sequence::new(pieces).into())
    }
}

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK_V3_NUMBERS: &str = r"\p{N}{1,3}";
const DEEPSEEK_V3_CJK: &str = "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+";
const DEEPSEEK_V3_WORDS: &str = r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##;

fn split(pattern: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Split::new(
        SplitPattern::Regex(pattern.to_owned()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map(Into::into)
    .map_err(|e| TokenizerError::Build(format!("pre-tokenizer regex {pattern:?}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    fn pieces(kind: PreTokenizerKind, text: &str) -> Vec<String> {
        let pt = kind.build().unwrap();
        let mut s = PreTokenizedString::from(text);
        pt.pre_tokenize(&mut s).unwrap();
        s.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| p.to_owned())
            .collect()
    }

    #[test]
    fn every_kind_builds_and_splits_numbers_its_own_way() {
        assert_eq!(pieces(PreTokenizerKind::Gpt2, "ab 12345"), ["ab", "Ġ12345"]);
        assert_eq!(
            pieces(PreTokenizerKind::DigitsGpt2, "ab 123"),
            ["ab", "Ġ", "1", "2", "3"]
        );
        assert_eq!(
            pieces(PreTokenizerKind::Llama3, "ab 12345"),
            ["ab", "Ġ", "123", "45"]
        );
        assert_eq!(
            pieces(PreTokenizerKind::Qwen2, "I'M 12"),
            ["I", "'M", "Ġ", "1", "2"]
        );
        assert_eq!(
            pieces(PreTokenizerKind::DeepseekV3, "12345 你好"),
            ["123", "45", "Ġ", "ä½łå¥½"]
        );
    }

    #[test]
    fn names_resolve() {
        for name in [
            "gpt2",
            "smollm",
            "llama-bpe",
            "llama3",
            "qwen2",
            "deepseek-v3",
        ] {
            assert!(PreTokenizerKind::from_gguf_name(name).is_some(), "{name}");
        }
        assert!(PreTokenizerKind::from_gguf_name("no-such-thing").is_none());
    }
}
