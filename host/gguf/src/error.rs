/// Everything that can go wrong reading a GGUF file. `Display` is always one line that starts with
/// the file's name and says what is wrong; names and keys taken from the file are escaped and
/// shortened so a hostile file cannot break the line.
#[derive(thiserror::Error, Debug)]
pub enum GgufError {
    /// The file could not be opened, sized or mapped.
    #[error("{file}: cannot {action}: {error}")]
    Io {
        file: String,
        action: &'static str,
        error: std::io::Error,
    },
    #[error("{file}: not a GGUF file (it starts with \"{found}\", expected \"GGUF\")")]
    BadMagic { file: String, found: String },
    #[error("{file}: unsupported GGUF version {version}: {why}")]
    UnsupportedVersion {
        file: String,
        version: u32,
        why: &'static str,
    },
    /// Something needs more bytes than the file has: a cut-off file, or a length field that is
    /// larger than the rest of the file could hold.
    #[error("{file}: truncated or corrupt: {what} needs {need} bytes at offset {offset}, but the file ends at {size}")]
    Truncated {
        file: String,
        what: String,
        offset: u64,
        need: u64,
        size: u64,
    },
    /// Any other structural problem (bad counts, dims, alignment, duplicates, overlaps, ...).
    #[error("{file}: {what}")]
    Invalid { file: String, what: String },
    #[error("{file}: tensor '{tensor}' has type id {type_id} which no loaded quant plugin claims")]
    UnknownTensorType {
        file: String,
        tensor: String,
        type_id: u32,
    },
    /// `offset` is absolute (from the start of the file).
    #[error("{file}: tensor '{tensor}' data (offset {offset}, {n_bytes} bytes) runs past the end of the file (size {size})")]
    TensorOutOfBounds {
        file: String,
        tensor: String,
        offset: u64,
        n_bytes: u64,
        size: u64,
    },
    #[error("{file}: metadata key '{key}' is missing")]
    MissingKey { file: String, key: String },
    #[error("{file}: metadata key '{key}' should be {expected} but is {found}")]
    WrongType {
        file: String,
        key: String,
        expected: &'static str,
        found: String,
    },
}

impl GgufError {
    /// The file the error is about, as it appears in the message.
    pub fn file(&self) -> &str {
        match self {
            GgufError::Io { file, .. }
            | GgufError::BadMagic { file, .. }
            | GgufError::UnsupportedVersion { file, .. }
            | GgufError::Truncated { file, .. }
            | GgufError::Invalid { file, .. }
            | GgufError::UnknownTensorType { file, .. }
            | GgufError::TensorOutOfBounds { file, .. }
            | GgufError::MissingKey { file, .. }
            | GgufError::WrongType { file, .. } => file,
        }
    }
}

/// A string from the file made safe for a one-line message: control characters escaped, and at
/// most 120 characters kept.
pub(crate) fn show(s: &str) -> String {
    const MAX: usize = 120;
    let mut out = String::new();
    for (n, c) in s.chars().enumerate() {
        if n == MAX {
            out.push_str("...");
            break;
        }
        if c.is_control() || c == '\'' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}
