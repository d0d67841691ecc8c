//! The byte <-> character alphabet of byte-level BPE vocabularies (GPT-2 style).
//!
//! Every byte gets a printable stand-in character so that vocab entries are plain
//! strings: bytes that are already printable and not whitespace (`!`..=`~`,
//! `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the remaining 68 bytes are given
//! the code points 256, 257, ... in increasing byte order.

/// Code points used by the table end below this bound (256 + 68 shifted bytes).
const CHAR_LIMIT: usize = 256 + 68;

fn stands_for_itself(b: u8) -> bool {
    matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF)
}

/// Lookup from a vocab character to the byte it stands for.
pub(crate) struct ByteLevelAlphabet {
    to_byte: [i16; CHAR_LIMIT],
}

impl ByteLevelAlphabet {
    pub(crate) fn new() -> Self {
        let mut to_byte = [-1i16; CHAR_LIMIT];
        let mut shifted = 0usize;
        for b in 0..=255u8 {
            let c = if stands_for_itself(b) {
                b as usize
            } else {
                shifted += 1;
                255 + shifted
            };
            to_byte[c] = b as i16;
        }
        Self { to_byte }
    }

    /// Bytes a byte-level vocab entry stands for. Characters outside the alphabet
    /// (seen in hand-edited vocabularies) are kept as their own UTF-8.
    pub(crate) fn decode_token(&self, token: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(token.len());
        for c in token.chars() {
            match self.to_byte.get(c as usize) {
                Some(&b) if b >= 0 => out.push(b as u8),
                _ => {
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_has_one_character() {
        let a = ByteLevelAlphabet::new();
        let mapped = a.to_byte.iter().filter(|&&b| b >= 0).count();
        assert_eq!(mapped, 256);
        assert_eq!(a.decode_token("Ġhello"), b" hello");
        assert_eq!(a.decode_token("Ċ"), b"\n");
        assert_eq!(a.decode_token("ĉ"), b"\t");
        // "é" in UTF-8 is C3 A9, both printable Latin-1 stand-ins.
        assert_eq!(a.decode_token("Ã©"), "é".as_bytes());
    }
}
