//! GGUF v2/v3 reader. The whole header is parsed and validated up front, so that once `open`
//! returns, every `TensorInfo` is known to lie inside the file, aligned and without overlaps.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use crate::error::{show, GgufError};
use crate::types::{ggml_type_name, TypeSizeFn};
use crate::value::*;

/// Default `general.alignment` when the key is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most 4 dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays nested deeper than this are refused (each level would recurse once).
const MAX_ARRAY_DEPTH: u32 = 16;
/// Total array elements over all metadata. Real files hold about a million (vocabularies); the cap
/// bounds the memory a hostile file can make us spend on `Value`s (32 bytes each).
const MAX_ARRAY_ELEMENTS: u64 = 1 << 24;
/// Smallest encodings, used to refuse counts that the remaining bytes could not possibly hold.
const MIN_KV_BYTES: u64 = 8 + 4 + 1; // key length, value type, 1-byte value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8; // name length, n_dims, 1 dim, type, offset

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension.
    pub dims: Vec<u64>,
    pub type_id: u32,
    /// Relative to the start of the data section ([`GgufFile::data_offset`]).
    pub offset: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements. Cannot overflow for infos from a [`GgufFile`] (checked on open).
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// An open GGUF file: the mapped bytes plus its parsed, validated header.
pub struct GgufFile {
    path: PathBuf,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    key_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    // The derived form would dump whole vocabularies.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl GgufFile {
    /// Memory-maps `path` and parses it. `sizes` gives the block layout of each tensor type id.
    pub fn open(path: &Path, sizes: TypeSizeFn) -> Result<GgufFile, GgufError> {
        let file_name = path.display().to_string();
        let io_err = |action, error| GgufError::Io {
            file: file_name.clone(),
            action,
            error,
        };
        // Before opening: a directory would fail to map with a puzzling "no such
        // device", and opening a FIFO would wait for a writer forever.
        let meta = std::fs::metadata(path).map_err(|e| io_err("open", e))?;
        if !meta.is_file() {
            let kind = if meta.is_dir() {
                "a directory"
            } else {
                "not a regular file"
            };
            return Err(GgufError::Invalid {
                file: file_name,
                what: format!("{kind}, not a GGUF file"),
            });
        }
        let file = std::fs::File::open(path).map_err(|e| io_err("open", e))?;
        let len = file.metadata().map_err(|e| io_err("stat", e))?.len();
        // Mapping an empty file fails on some platforms; it is rejected by the parser anyway.
        let storage = if len == 0 {
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is read-only. As with every mmap-based model loader, another process
            // truncating or rewriting the file while it is open is not supported.
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io_err("mmap", e))?;
            Storage::Mmap(map)
        };
        Self::parse(path.to_path_buf(), storage, sizes)
    }

    /// Same as [`open`](Self::open), from bytes in memory; `name` stands in for the path.
    pub fn from_bytes(
        bytes: Vec<u8>,
        name: &str,
        sizes: TypeSizeFn,
    ) -> Result<GgufFile, GgufError> {
        Self::parse(PathBuf::from(name), Storage::Owned(bytes), sizes)
    }

    fn parse(path: PathBuf, storage: Storage, sizes: TypeSizeFn) -> Result<GgufFile, GgufError> {
        let file = path.display().to_string();
        let buf: &[u8] = match &storage {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        };
        let h = parse_header(buf, &file, sizes)?;
        let key_index = index_of(&h.metadata, |kv| &kv.0);
        let tensor_index = index_of(&h.tensors, |t| &t.name);
        Ok(GgufFile {
            path,
            version: h.version,
            alignment: h.alignment,
            data_offset: h.data_offset,
            metadata: h.metadata,
            key_index,
            tensors: h.tensors,
            tensor_index,
            storage,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn version(&self) -> u32 {
        self.version
    }
    pub fn alignment(&self) -> u64 {
        self.alignment
    }
    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }
    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.storage {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }

    /// A tensor's raw data. `t` must come from this file; for a foreign info whose range does not
    /// fit, the result is empty.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = self.data_offset.saturating_add(t.offset);
        let end = start.saturating_add(t.n_bytes);
        match (usize::try_from(start), usize::try_from(end)) {
            (Ok(s), Ok(e)) => self.bytes().get(s..e).unwrap_or(&[]),
            _ => &[],
        }
    }

    fn file_name(&self) -> String {
        self.path.display().to_string()
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            file: self.file_name(),
            key: key.to_string(),
        })
    }

    fn wrong(&self, key: &str, expected: &'static str, found: &Value) -> GgufError {
        GgufError::WrongType {
            file: self.file_name(),
            key: key.to_string(),
            expected,
            found: summary(found),
        }
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }
    /// An integer of any width that fits an i64.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        let v = self.require(key)?;
        v.as_i64().ok_or_else(|| self.wrong(key, "an integer", v))
    }
    /// A float or integer.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, "a number", v))
    }
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong(key, "a bool", v))
    }
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "a string", v))
    }
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.get_array(key, "an array of strings", Value::as_str)
    }
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        self.get_array(key, "an array of integers", Value::as_i64)
    }
    pub fn get_f64_array(&self, key: &str) -> Result<Vec<f64>, GgufError> {
        self.get_array(key, "an array of numbers", Value::as_f64)
    }

    fn get_array<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        conv: impl Fn(&'s Value) -> Option<T>,
    ) -> Result<Vec<T>, GgufError> {
        let v = self.require(key)?;
        let items = v.as_array().ok_or_else(|| self.wrong(key, expected, v))?;
        items
            .iter()
            .map(|item| conv(item).ok_or_else(|| self.wrong(key, expected, v)))
            .collect()
    }

    /// JSON object of the scalar (non-array) metadata, for quant plugins' `resolve_variant`.
    /// Non-finite floats become `null` (JSON has no NaN).
    pub fn scalar_metadata_json(&self) -> String {
        use serde_json::Value as J;
        let mut map = serde_json::Map::new();
        for (key, v) in &self.metadata {
            let j = match *v {
                Value::Array(_) => continue,
                Value::String(ref s) => J::String(s.clone()),
                Value::Bool(b) => J::Bool(b),
                // Go through the shortest f32 text so 0.1f32 shows as 0.1, not 0.10000000149.
                Value::F32(f) => json_float(f.to_string().parse().unwrap_or(f64::NAN)),
                Value::F64(f) => json_float(f),
                Value::U64(u) => J::from(u),
                Value::I64(i) => J::from(i),
                ref small_int => small_int.as_i64().map_or(J::Null, J::from),
            };
            map.insert(key.clone(), j);
        }
        J::Object(map).to_string()
    }
}

fn json_float(f: f64) -> serde_json::Value {
    serde_json::Number::from_f64(f).map_or(serde_json::Value::Null, serde_json::Value::Number)
}

/// A value as shown in "should be X but is Y" messages.
fn summary(v: &Value) -> String {
    match v {
        Value::String(s) => format!("string '{}'", show(s)),
        Value::Array(a) => format!("{} ({} entries)", v.describe(), a.len()),
        Value::F32(f) => format!("f32 {f}"),
        Value::F64(f) => format!("f64 {f}"),
        Value::Bool(b) => format!("bool {b}"),
        other => match (other.as_i64(), other.as_u64()) {
            (Some(i), _) => format!("{} {i}", other.type_name()),
            (None, Some(u)) => format!("{} {u}", other.type_name()),
            _ => other.type_name().to_string(),
        },
    }
}

fn index_of<T>(items: &[T], key: impl Fn(&T) -> &String) -> HashMap<String, usize> {
    items
        .iter()
        .enumerate()
        .map(|(i, t)| (key(t).clone(), i))
        .collect()
}

// ---- parsing ----------------------------------------------------------------------------------

/// A parse failure before context (which key / tensor) is known.
enum PErr {
    /// `need` bytes were wanted at `at`, past the end of the buffer.
    Short {
        at: usize,
        need: u64,
    },
    Bad(String),
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    /// Checks the length against what is left before touching (or allocating for) anything.
    fn take(&mut self, n: u64) -> Result<&'a [u8], PErr> {
        if n > self.left() {
            return Err(PErr::Short {
                at: self.pos,
                need: n,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N], PErr> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N as u64)?);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, PErr> {
        self.arr().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, PErr> {
        self.arr().map(u64::from_le_bytes)
    }

    fn string(&mut self) -> Result<String, PErr> {
        let len = self.u64()?;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| {
            PErr::Bad(format!(
                "string is not valid UTF-8 (bad byte at position {})",
                e.utf8_error().valid_up_to()
            ))
        })
    }
}

/// Smallest possible encoding of one value of the given type (for count sanity checks).
fn min_value_bytes(type_id: u32) -> Option<u64> {
    Some(match type_id {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

fn read_value(c: &mut Cursor, type_id: u32, depth: u32, budget: &mut u64) -> Result<Value, PErr> {
    Ok(match type_id {
        T_U8 => Value::U8(u8::from_le_bytes(c.arr()?)),
        T_I8 => Value::I8(i8::from_le_bytes(c.arr()?)),
        T_U16 => Value::U16(u16::from_le_bytes(c.arr()?)),
        T_I16 => Value::I16(i16::from_le_bytes(c.arr()?)),
        T_U32 => Value::U32(c.u32()?),
        T_I32 => Value::I32(i32::from_le_bytes(c.arr()?)),
        T_F32 => Value::F32(f32::from_le_bytes(c.arr()?)),
        T_U64 => Value::U64(c.u64()?),
        T_I64 => Value::I64(i64::from_le_bytes(c.arr()?)),
        T_F64 => Value::F64(f64::from_le_bytes(c.arr()?)),
        T_BOOL => match c.arr::<1>()?[0] {
            0 => Value::Bool(false),
            1 => Value::Bool(true),
            b => return Err(PErr::Bad(format!("bool value is {b}, not 0 or 1"))),
        },
        T_STRING => Value::String(c.string()?),
        T_ARRAY => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(PErr::Bad(format!(
                    "arrays nested more than {MAX_ARRAY_DEPTH} deep"
                )));
            }
            let elem_type = c.u32()?;
            let count = c.u64()?;
            let min = min_value_bytes(elem_type)
                .ok_or_else(|| PErr::Bad(format!("array of unknown value type id {elem_type}")))?;
            if count.saturating_mul(min) > c.left() {
                return Err(PErr::Bad(format!(
                    "array claims {count} elements of type {}, but only {} bytes remain in the file",
                    value_type_name(elem_type).unwrap_or("?"),
                    c.left()
                )));
            }
            if count > *budget {
                return Err(PErr::Bad(format!(
                    "metadata arrays hold more than {MAX_ARRAY_ELEMENTS} elements in all"
                )));
            }
            *budget -= count;
            // Grow as elements really parse rather than trusting the count up front.
            let mut items = Vec::with_capacity(count.min(1 << 16) as usize);
            for _ in 0..count {
                items.push(read_value(c, elem_type, depth + 1, budget)?);
            }
            Value::Array(items)
        }
        other => return Err(PErr::Bad(format!("unknown value type id {other}"))),
    })
}

struct Header {
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
}

fn parse_header(buf: &[u8], file: &str, sizes: TypeSizeFn) -> Result<Header, GgufError> {
    let size = buf.len() as u64;
    let invalid = |what: String| GgufError::Invalid {
        file: file.to_string(),
        what,
    };
    // Adds "which part of the file" to a cursor error.
    let ctx = |e: PErr, what: &dyn Fn() -> String| match e {
        PErr::Short { at, need } => GgufError::Truncated {
            file: file.to_string(),
            what: what(),
            offset: at as u64,
            need,
            size,
        },
        PErr::Bad(msg) => invalid(format!("{}: {msg}", what())),
    };
    let mut c = Cursor { buf, pos: 0 };

    let magic: [u8; 4] = c.arr().map_err(|e| ctx(e, &|| "the GGUF magic".into()))?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic {
            file: file.to_string(),
            found: magic.escape_ascii().to_string(),
        });
    }
    let version = c.u32().map_err(|e| ctx(e, &|| "the version".into()))?;
    let unsupported = |why| GgufError::UnsupportedVersion {
        file: file.to_string(),
        version,
        why,
    };
    match version {
        2 | 3 => {}
        1 => {
            return Err(unsupported(
                "GGUF v1 is obsolete; re-convert the model with a current llama.cpp",
            ))
        }
        v if (2..=3).contains(&v.swap_bytes()) => {
            return Err(unsupported(
                "the file looks big-endian; only little-endian GGUF is supported",
            ))
        }
        _ => return Err(unsupported("only versions 2 and 3 are supported")),
    }
    let n_tensors = c.u64().map_err(|e| ctx(e, &|| "the tensor count".into()))?;
    let n_kv = c
        .u64()
        .map_err(|e| ctx(e, &|| "the metadata count".into()))?;
    for (count, min, what) in [
        (n_kv, MIN_KV_BYTES, "metadata entries"),
        (n_tensors, MIN_TENSOR_INFO_BYTES, "tensors"),
    ] {
        if count > c.left() / min {
            return Err(invalid(format!(
                "header claims {count} {what}, but the {} bytes after it could hold at most {}",
                c.left(),
                c.left() / min
            )));
        }
    }

    // Capacities are capped: counts passed the check above but are still file-controlled.
    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv.min(1024) as usize);
    let mut seen_keys = HashMap::new();
    let mut budget = MAX_ARRAY_ELEMENTS;
    for i in 0..n_kv {
        let key = c
            .string()
            .map_err(|e| ctx(e, &|| format!("the key of metadata entry #{i}")))?;
        let what = || format!("metadata key '{}'", show(&key));
        let type_id = c.u32().map_err(|e| ctx(e, &what))?;
        let value = read_value(&mut c, type_id, 0, &mut budget).map_err(|e| ctx(e, &what))?;
        if seen_keys.insert(key.clone(), metadata.len()).is_some() {
            return Err(invalid(format!("duplicate metadata key '{}'", show(&key))));
        }
        metadata.push((key, value));
    }

    let alignment = match seen_keys.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(&i) => match metadata[i].1 {
            Value::U32(a) if a.is_power_of_two() => a.into(),
            Value::U32(a) => {
                return Err(invalid(format!(
                    "general.alignment is {a}; it must be a nonzero power of two"
                )))
            }
            ref other => {
                return Err(invalid(format!(
                    "general.alignment must be a u32, but is {}",
                    summary(other)
                )))
            }
        },
    };

    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors.min(4096) as usize);
    for i in 0..n_tensors {
        let name = c
            .string()
            .map_err(|e| ctx(e, &|| format!("the name of tensor #{i}")))?;
        let what = || format!("tensor '{}' info", show(&name));
        let n_dims = c.u32().map_err(|e| ctx(e, &what))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(invalid(format!(
                "tensor '{}' has {n_dims} dimensions; ggml supports 1 to {MAX_DIMS}",
                show(&name)
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64().map_err(|e| ctx(e, &what))?);
        }
        let type_id = c.u32().map_err(|e| ctx(e, &what))?;
        let offset = c.u64().map_err(|e| ctx(e, &what))?;
        tensors.push(TensorInfo {
            name,
            dims,
            type_id,
            offset,
            n_bytes: 0, // set by check_tensors
        });
    }

    // The data section starts at the next multiple of the alignment (absolute file offset).
    let data_offset = (c.pos as u64).next_multiple_of(alignment);
    check_tensors(&mut tensors, file, size, alignment, data_offset, sizes)?;
    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
    })
}

/// Sizes every tensor and checks names, dims, types, alignment, bounds and overlaps.
fn check_tensors(
    tensors: &mut [TensorInfo],
    file: &str,
    size: u64,
    alignment: u64,
    data_offset: u64,
    sizes: TypeSizeFn,
) -> Result<(), GgufError> {
    let invalid = |what: String| GgufError::Invalid {
        file: file.to_string(),
        what,
    };
    let mut seen = HashSet::new();
    for t in tensors.iter_mut() {
        let name = show(&t.name);
        if !seen.insert(t.name.clone()) {
            return Err(invalid(format!("duplicate tensor name '{name}'")));
        }
        // ggml stores dims and element counts as int64.
        let numel = t
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64 && t.dims.iter().all(|&d| d <= i64::MAX as u64));
        let Some(numel) = numel else {
            return Err(invalid(format!(
                "tensor '{name}' dims {:?} give more than 2^63-1 elements",
                t.dims
            )));
        };
        let (block, block_bytes) =
            sizes(t.type_id).ok_or_else(|| GgufError::UnknownTensorType {
                file: file.to_string(),
                tensor: name.clone(),
                type_id: t.type_id,
            })?;
        let type_name = ggml_type_name(t.type_id)
            .map_or_else(|| format!("type id {}", t.type_id), |n| format!("type {n}"));
        if block == 0 || block_bytes == 0 {
            return Err(invalid(format!(
                "tensor '{name}': the quant plugin for {type_name} reports an empty block ({block} weights, {block_bytes} bytes)"
            )));
        }
        // A block never spans rows, so the row length (dims[0]) must be a whole number of blocks.
        if t.dims[0] % u64::from(block) != 0 {
            return Err(invalid(format!(
                "tensor '{name}' ({type_name}) has rows of {} elements, not a multiple of its block size {block}",
                t.dims[0]
            )));
        }
        t.n_bytes = (numel / u64::from(block))
            .checked_mul(block_bytes.into())
            .ok_or_else(|| {
                invalid(format!(
                    "tensor '{name}' dims {:?} give a byte size over 2^64",
                    t.dims
                ))
            })?;
        if t.offset % alignment != 0 {
            return Err(invalid(format!(
                "tensor '{name}' data offset {} is not a multiple of the alignment {alignment}",
                t.offset
            )));
        }
        let start = data_offset.checked_add(t.offset);
        if start
            .and_then(|s| s.checked_add(t.n_bytes))
            .is_none_or(|end| end > size)
        {
            return Err(GgufError::TensorOutOfBounds {
                file: file.to_string(),
                tensor: name,
                offset: start.unwrap_or(u64::MAX),
                n_bytes: t.n_bytes,
                size,
            });
        }
    }

    // Overlaps: sort non-empty tensors by offset and compare neighbours.
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.n_bytes > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // No overflow: both ranges were checked to lie inside the file.
        if a.offset + a.n_bytes > b.offset {
            return Err(invalid(format!(
                "tensors '{}' (data offset {}, {} bytes) and '{}' (data offset {}) overlap",
                show(&a.name),
                a.offset,
                a.n_bytes,
                show(&b.name),
                b.offset
            )));
        }
    }
    Ok(())
}
