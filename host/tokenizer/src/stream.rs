//! Incremental detokenisation for streaming responses.

use crate::Tokenizer;

/// Incremental detokeniser for streaming: push ids, get back the text that is now
/// complete UTF-8. Bytes of a multi-byte character split across tokens are held
/// back until the character is complete; bytes that can never become valid UTF-8
/// come out as U+FFFD, exactly as [`Tokenizer::decode`] renders them, so the
/// concatenated output of `push`es and `finish` equals `decode` of the same ids
/// (except that for SentencePiece vocabularies `decode` drops the leading space
/// that encoding prefixed, while a stream keeps it: streamed text continues a
/// prompt, so its first space is real).
///
/// Control tokens (e.g. `<|im_end|>`) are skipped by default, as in
/// `decode(ids, true)`; use [`StreamDecoder::with_special`] to keep them.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    keep_special: bool,
}

impl StreamDecoder {
    /// A decoder that skips control tokens.
    pub fn new() -> Self {
        Self::default()
    }

    /// A decoder that renders control tokens as their text when `keep_special`.
    pub fn with_special(keep_special: bool) -> Self {
        Self {
            pending: Vec::new(),
            keep_special,
        }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    /// Ids outside the vocabulary contribute nothing.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if !self.keep_special && tok.is_control(id) {
            return String::new();
        }
        match tok.piece(id) {
            Some(bytes) => self.pending.extend_from_slice(bytes),
            None => return String::new(),
        }
        self.drain(false)
    }

    /// Flushes what is held back (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        self.drain(true)
    }

    /// Whether bytes are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain(&mut self, at_end: bool) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, after) = rest.split_at(e.valid_up_to());
                    // SAFETY-free: `valid` was just checked by from_utf8.
                    out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                    match e.error_len() {
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &after[n..];
                        }
                        None if at_end => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &[];
                            break;
                        }
                        None => {
                            rest = after; // incomplete character: wait for more bytes
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let len = self.pending.len();
        self.pending.drain(..len - keep);
        out
    }
}
