//! GGUF reading (v2 and v3, memory-mapped) and writing (v3).
//!
//! The reader treats every file as hostile: all counts and lengths are checked against the bytes
//! that remain before anything is allocated, and every tensor is checked to be of a known type,
//! aligned, inside the file and not overlapping another, so users can slice tensor data freely.
//! Errors are one line naming the file and the problem; nothing in here panics on file contents.
//!
//! Choices where the format leaves room (matching llama.cpp where it is strict):
//! - `general.alignment` must be a u32 holding a nonzero power of two (default 32).
//! - Tensors have 1 to 4 dims; a dim of 0 is allowed (an empty tensor); element counts must fit
//!   an i64; the row length `dims[0]` must be a whole number of blocks of the tensor's type.
//! - Strings must be UTF-8; bools must be 0 or 1; keys and tensor names must be unique.
//! - Arrays may nest up to 16 deep and hold at most 2^24 elements in all, which bounds the memory
//!   a file can make the reader spend on metadata.
//! - Big-endian files are recognised and refused.

mod error;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, MAX_DIMS};
pub use types::{ggml_type_name, ggml_type_size, TypeSizeFn};
pub use value::Value;
pub use writer::{write_atomic, GgufWriter};
