//! Device buffers of the CPU backend: 64-byte aligned host allocations behind ids.

use std::{
    alloc::{alloc_zeroed, dealloc, Layout},
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        RwLock,
    },
};

use moe_plugin_api::{types, QuantFormat, TensorRef};

const ALIGN: usize = 64;

struct Buf {
    ptr: *mut u8,
    len: usize,
}

// The pointer is owned by the table and only handed out under its lock.
unsafe impl Send for Buf {}
unsafe impl Sync for Buf {}

static BUFFERS: RwLock<Option<HashMap<u64, Buf>>> = RwLock::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

pub fn alloc(bytes: u64) -> Result<u64, String> {
    let len =
        usize::try_from(bytes.max(1)).map_err(|_| format!("cannot allocate {bytes} bytes"))?;
    let layout = Layout::from_size_align(len, ALIGN).map_err(|e| e.to_string())?;
    // SAFETY: layout has non-zero size.
    let ptr = unsafe { alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(format!("out of host memory allocating {bytes} bytes"));
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut table = BUFFERS.write().unwrap_or_else(|e| e.into_inner());
    table
        .get_or_insert_with(HashMap::new)
        .insert(id, Buf { ptr, len });
    Ok(id)
}

pub fn free(id: u64) -> Result<(), String> {
    let mut table = BUFFERS.write().unwrap_or_else(|e| e.into_inner());
    let buf = table
        .get_or_insert_with(HashMap::new)
        .remove(&id)
        .ok_or_else(|| format!("free: unknown buffer {id}"))?;
    // SAFETY: allocated in `alloc` with this exact layout.
    unsafe { dealloc(buf.ptr, Layout::from_size_align_unchecked(buf.len, ALIGN)) };
    Ok(())
}

/// Runs `f` with the buffer table read-locked, so buffers stay alive during an op.
pub fn with_buffers<R>(f: impl FnOnce(&Buffers) -> R) -> R {
    let table = BUFFERS.read().unwrap_or_else(|e| e.into_inner());
    let empty = HashMap::new();
    f(&Buffers {
        map: table.as_ref().unwrap_or(&empty),
    })
}

pub struct Buffers<'a> {
    map: &'a HashMap<u64, Buf>,
}

/// Byte size of a tensor of `type_id`: native types, else the quant format's blocks.
pub fn tensor_bytes(t: &TensorRef, fmt: Option<&QuantFormat>) -> Result<usize, String> {
    let n = t.numel();
    let bytes = match t.type_id {
        types::F32 | types::I32 => n * 4,
        _ => {
            let f =
                fmt.ok_or_else(|| format!("no quant format registered for type id {}", t.type_id))?;
            let bw = f.block_weights as u64;
            if !n.is_multiple_of(bw) {
                return Err(format!(
                    "{} tensor of {n} values is not whole blocks",
                    f.name
                ));
            }
            n / bw * f.block_bytes as u64
        }
    };
    usize::try_from(bytes).map_err(|_| "tensor too large".to_string())
}

impl Buffers<'_> {
    /// Start pointer and byte length of a tensor, bounds-checked.
    pub fn raw(&self, t: &TensorRef, bytes: usize) -> Result<*mut u8, String> {
        let buf = self
            .map
            .get(&t.buffer)
            .ok_or_else(|| format!("unknown buffer {}", t.buffer))?;
        let off = usize::try_from(t.offset).map_err(|_| "offset too large".to_string())?;
        if off.checked_add(bytes).is_none_or(|end| end > buf.len) {
            return Err(format!(
                "tensor of {bytes} bytes at offset {off} overruns buffer {} of {} bytes",
                t.buffer, buf.len
            ));
        }
        // SAFETY: in bounds of a live allocation (checked above).
        Ok(unsafe { buf.ptr.add(off) })
    }

    pub fn bytes(&self, t: &TensorRef, len: usize) -> Result<&[u8], String> {
        let p = self.raw(t, len)?;
        // SAFETY: bounds checked; callers never hold a mutable view of the same range
        // (run_op refuses outputs that overlap inputs).
        Ok(unsafe { std::slice::from_raw_parts(p, len) })
    }

    pub fn f32s(&self, t: &TensorRef) -> Result<&[f32], String> {
        expect_type(t, types::F32)?;
        let n = t.numel() as usize;
        let p = self.raw(t, n * 4)?;
        if !(p as usize).is_multiple_of(4) {
            return Err("f32 tensor offset not 4-byte aligned".into());
        }
        // SAFETY: bounds and alignment checked.
        Ok(unsafe { std::slice::from_raw_parts(p as *const f32, n) })
    }

    pub fn i32s(&self, t: &TensorRef) -> Result<&[i32], String> {
        expect_type(t, types::I32)?;
        let n = t.numel() as usize;
        let p = self.raw(t, n * 4)?;
        if !(p as usize).is_multiple_of(4) {
            return Err("i32 tensor offset not 4-byte aligned".into());
        }
        // SAFETY: bounds and alignment checked.
        Ok(unsafe { std::slice::from_raw_parts(p as *const i32, n) })
    }

    #[allow(clippy::mut_from_ref)]
    pub fn f32s_mut(&self, t: &TensorRef) -> Result<&mut [f32], String> {
        expect_type(t, types::F32)?;
        let n = t.numel() as usize;
        let p = self.raw(t, n * 4)?;
        if !(p as usize).is_multiple_of(4) {
            return Err("f32 tensor offset not 4-byte aligned".into());
        }
        // SAFETY: bounds and alignment checked; run_op checked this output overlaps no
        // input, and ops run one at a time per stream.
        Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut f32, n) })
    }

    /// Copies host bytes in or out of a buffer.
    pub fn copy(&self, id: u64, offset: u64, len: usize) -> Result<*mut u8, String> {
        let t = TensorRef {
            buffer: id,
            offset,
            type_id: types::F32,
            variant: 0,
            dims: [0; 4],
        };
        self.raw(&t, len)
    }
}

fn expect_type(t: &TensorRef, ty: u32) -> Result<(), String> {
    if t.type_id != ty {
        return Err(format!(
            "expected a tensor of type {ty}, got type {}",
            t.type_id
        ));
    }
    Ok(())
}

/// Whether two tensors' byte ranges intersect (same buffer only).
pub fn overlaps(a: &TensorRef, a_len: usize, b: &TensorRef, b_len: usize) -> bool {
    a.buffer == b.buffer && a.offset < b.offset + b_len as u64 && b.offset < a.offset + a_len as u64
}
