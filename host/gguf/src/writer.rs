//! GGUF v3 writer (little-endian), for tests, fixtures and converters.

use std::collections::HashSet;
use std::io::{self, Write};
use std::path::Path;

use rayon::prelude::*;

use crate::reader::{DEFAULT_ALIGNMENT, MAX_DIMS};
use crate::value::*;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes them as one GGUF v3 file.
pub struct GgufWriter {
    alignment: u64,
    kvs: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

fn invalid_input(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

impl GgufWriter {
    /// `alignment` must be a nonzero power of two that fits a u32 (checked when writing). If it is
    /// not the default 32, `general.alignment` is written for it.
    pub fn new(alignment: u64) -> Self {
        GgufWriter {
            alignment,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Adds a metadata entry; adding an existing key replaces its value in place.
    pub fn add_kv(&mut self, key: &str, value: Value) {
        match self.kvs.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = value,
            None => self.kvs.push((key.to_string(), value)),
        }
    }

    /// Adds a tensor. `dims` are in ggml order (`dims[0]` innermost); `data` is written as given,
    /// so it must already be in the layout of `type_id`.
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) {
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
    }

    /// Writes the whole file. Fails with `InvalidInput` for an invalid alignment, a conflicting
    /// `general.alignment`, duplicate tensor names, bad dims or mixed-type arrays.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let (head, _) = self.header()?;
        emit(
            w,
            &head,
            self.tensors.iter().map(|t| &t.data),
            self.alignment,
        )
    }

    /// The whole file in memory (as [`write_to`](Self::write_to) writes it), each tensor's
    /// data released once copied, so the peak is the file plus one tensor rather than
    /// twice the file (a synthetic 43-layer model is ~91 GB).
    ///
    /// The tensors are copied in parallel, in 16 MiB pieces (the copy and its page faults
    /// took a single core most of a minute for the benchmark's 13 GB model).
    pub fn into_bytes(self) -> io::Result<Vec<u8>> {
        const PIECE: usize = 16 << 20;
        let (head, total) = self.header()?;
        // Zero-filled: the padding between tensors stays zero.
        let mut out = vec![0u8; total as usize];
        out[..head.len()].copy_from_slice(&head);
        // Hand each tensor its own slice of the image at its aligned offset.
        let mut jobs = Vec::with_capacity(self.tensors.len());
        let mut rest = &mut out[head.len()..];
        let mut pos = head.len() as u64;
        for t in self.tensors {
            let start = pos.next_multiple_of(self.alignment);
            let tail = std::mem::take(&mut rest);
            let (dst, after) = tail[(start - pos) as usize..].split_at_mut(t.data.len());
            rest = after;
            pos = start + t.data.len() as u64;
            jobs.push((dst, t.data));
        }
        jobs.into_par_iter().for_each(|(dst, data)| {
            dst.par_chunks_mut(PIECE)
                .zip(data.par_chunks(PIECE))
                .for_each(|(d, s)| d.copy_from_slice(s));
        });
        Ok(out)
    }

    /// The header (metadata and tensor infos) and the size of the whole file, after the
    /// checks [`write_to`](Self::write_to) documents.
    fn header(&self) -> io::Result<(Vec<u8>, u64)> {
        let align = self.alignment;
        if !align.is_power_of_two() || align > u64::from(u32::MAX) {
            return Err(invalid_input(format!(
                "GGUF alignment {align} must be a nonzero power of two that fits a u32"
            )));
        }
        let mut kvs: Vec<(&str, &Value)> = self.kvs.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let align_value = Value::U32(align as u32);
        match self.kvs.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, v)) if *v != align_value => {
                return Err(invalid_input(format!(
                    "general.alignment is set to {v:?}, but the writer aligns to {align}"
                )))
            }
            None if align != DEFAULT_ALIGNMENT => {
                kvs.insert(0, ("general.alignment", &align_value))
            }
            _ => {}
        }

        let mut names = HashSet::new();
        for t in &self.tensors {
            if !names.insert(&t.name) {
                return Err(invalid_input(format!("duplicate tensor name '{}'", t.name)));
            }
            if t.dims.is_empty() || t.dims.len() > MAX_DIMS {
                return Err(invalid_input(format!(
                    "tensor '{}' has {} dimensions; ggml supports 1 to {MAX_DIMS}",
                    t.name,
                    t.dims.len()
                )));
            }
        }

        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(kvs.len() as u64).to_le_bytes());
        for (key, value) in &kvs {
            put_str(&mut head, key);
            head.extend_from_slice(&value.type_id().to_le_bytes());
            put_value(&mut head, value)
                .map_err(|e| invalid_input(format!("metadata key '{key}': {e}")))?;
        }
        let mut offset = 0u64; // relative to the data section
        for t in &self.tensors {
            offset = offset.next_multiple_of(align);
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.type_id.to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offset += t.data.len() as u64;
        }
        // The header is padded to the alignment, the data section too (see `emit`).
        let total = (head.len() as u64).next_multiple_of(align) + offset.next_multiple_of(align);
        Ok((head, total))
    }

    /// Writes the file through [`write_atomic`]: `path` is either the old file or the
    /// complete new one.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        write_atomic(path, |mut w| self.write_to(&mut w))
    }
}

/// Writes a file by `fill` into a new, uniquely named temporary file next to `path`
/// (created exclusively: no other file is truncated, and two writers of one path each
/// write their own), syncs it, then renames it onto `path`. On an error the temporary
/// file is removed and `path` is untouched.
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> io::Result<()>,
) -> io::Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    let prefix = format!(".{name}.");
    let mut b = tempfile::Builder::new();
    b.prefix(&prefix).suffix(".part");
    // The mode a plain create would give (0666 less the umask, which the system
    // applies), or the replaced file's: not the temporary file's owner-only 0600.
    #[cfg(unix)]
    b.permissions(
        std::fs::metadata(path)
            .map(|m| m.permissions())
            .unwrap_or_else(|_| std::os::unix::fs::PermissionsExt::from_mode(0o666)),
    );
    let tmp = b.tempfile_in(dir)?;
    let mut w = io::BufWriter::new(tmp);
    fill(&mut w)?;
    let tmp = w.into_inner().map_err(|e| e.into_error())?;
    tmp.as_file().sync_all()?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

/// The header, padded to the alignment, then each tensor's data at the next aligned
/// offset (each dropped once written when owned), and - like llama.cpp - padding after
/// the last one too, so the size is a multiple of the alignment.
fn emit<D: AsRef<[u8]>>(
    w: &mut impl Write,
    head: &[u8],
    datas: impl IntoIterator<Item = D>,
    align: u64,
) -> io::Result<()> {
    w.write_all(head)?;
    let mut pos = head.len() as u64;
    pad(w, &mut pos, align)?;
    let mut any = false;
    for d in datas {
        pad(w, &mut pos, align)?;
        w.write_all(d.as_ref())?;
        pos += d.as_ref().len() as u64;
        any = true;
    }
    if any {
        pad(w, &mut pos, align)?;
    }
    Ok(())
}

fn pad(w: &mut impl Write, pos: &mut u64, align: u64) -> io::Result<()> {
    const ZEROS: [u8; 4096] = [0; 4096];
    let mut n = pos.next_multiple_of(align) - *pos;
    *pos += n;
    while n > 0 {
        let k = n.min(ZEROS.len() as u64);
        w.write_all(&ZEROS[..k as usize])?;
        n -= k;
    }
    Ok(())
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// Encodes a value without its leading type id.
fn put_value(out: &mut Vec<u8>, v: &Value) -> Result<(), String> {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(items) => {
            // An empty array has no element to take a type from; u8 is as good as any.
            let elem_type = items.first().map_or(T_U8, Value::type_id);
            if let Some(odd) = items.iter().find(|i| i.type_id() != elem_type) {
                return Err(format!(
                    "array mixes {} and {} elements",
                    value_type_name(elem_type).unwrap_or("?"),
                    odd.type_name()
                ));
            }
            out.extend_from_slice(&elem_type.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item)?;
            }
        }
    }
    Ok(())
}
