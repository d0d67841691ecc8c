//! SentencePiece-style BPE (`tokenizer.ggml.model = "llama"`).
//!
//! There is no merge list: the text (spaces written as U+2581) starts as one symbol
//! per character, and the adjacent pair whose concatenation is the vocab entry with
//! the highest score is merged, again and again, until no adjacent pair forms a
//! vocab entry. Ties go to the leftmost pair. A final symbol that is not in the vocab
//! is spelled with the `<0xNN>` byte tokens, or the unknown token when those are
//! missing.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The word-boundary marker SentencePiece writes for a space.
pub(crate) const SPACE_MARK: char = '\u{2581}';

pub(crate) struct SpmModel {
    vocab: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_ids: [Option<u32>; 256],
    unk_id: Option<u32>,
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Candidate {
    score: f32,
    left: usize,
    /// Combined byte length when queued; stale once either side has changed.
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Max-heap: higher score first, then the leftmost pair.
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl SpmModel {
    pub(crate) fn new(tokens: &[String], scores: Vec<f32>, unk_id: Option<u32>) -> Self {
        let mut vocab = HashMap::with_capacity(tokens.len());
        let mut byte_ids = [None; 256];
        for (id, t) in tokens.iter().enumerate() {
            vocab.entry(t.clone()).or_insert(id as u32);
            if let Some(b) = parse_byte_token(t) {
                byte_ids[b as usize].get_or_insert(id as u32);
            }
        }
        Self {
            vocab,
            scores,
            byte_ids,
            unk_id,
        }
    }

    fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Encodes text that has already had spaces replaced by [`SPACE_MARK`].
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut symbols: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }
        let mut queue = BinaryHeap::new();
        for left in 0..symbols.len().saturating_sub(1) {
            self.queue_pair(text, &symbols, left, &mut queue);
        }
        while let Some(cand) = queue.pop() {
            let left = symbols[cand.left];
            let Some(right_idx) = left.next else { continue };
            let right = symbols[right_idx];
            if left.len == 0 || right.len == 0 || left.len + right.len != cand.len {
                continue; // stale: one side was merged since this pair was queued
            }
            symbols[cand.left].len += right.len;
            symbols[cand.left].next = right.next;
            symbols[right_idx].len = 0;
            if let Some(n) = right.next {
                symbols[n].prev = Some(cand.left);
            }
            if let Some(p) = left.prev {
                self.queue_pair(text, &symbols, p, &mut queue);
            }
            self.queue_pair(text, &symbols, cand.left, &mut queue);
        }
        let mut at = Some(0);
        while let Some(i) = at {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            match self.vocab.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for b in piece.bytes() {
                        if let Some(id) = self.byte_ids[b as usize].or(self.unk_id) {
                            out.push(id);
                        }
                    }
                }
            }
            at = s.next;
        }
    }

    fn queue_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        queue: &mut BinaryHeap<Candidate>,
    ) {
        let l = symbols[left];
        let Some(r) = l.next.map(|n| symbols[n]) else {
            return;
        };
        let piece = &text[l.start..r.start + r.len];
        if let Some(&id) = self.vocab.get(piece) {
            queue.push(Candidate {
                score: self.score(id),
                left,
                len: l.len + r.len,
            });
        }
    }
}

/// `<0x0A>` -> 0x0A.
pub(crate) fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let tokens: Vec<String> = ["<unk>", "<0x21>", "a", "b", "c", "ab", "bc", "abc", "▁"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // "bc" outranks "ab", then "a"+"bc" forms "abc".
        let scores = vec![0.0, 0.0, -1.0, -1.0, -1.0, -3.0, -2.0, -2.5, -1.0];
        let m = SpmModel::new(&tokens, scores, Some(0));
        let mut out = Vec::new();
        m.encode("abc", &mut out);
        assert_eq!(out, [7]);
        out.clear();
        m.encode("ab!", &mut out);
        assert_eq!(out, [5, 1]);
        out.clear();
        m.encode("é", &mut out); // not in vocab, no byte tokens for it -> unk per byte
        assert_eq!(out, [0, 0]);
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x1>"), None);
        assert_eq!(parse_byte_token("a"), None);
    }
}
