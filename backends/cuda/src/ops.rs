//! `run_op` for the CUDA backend: MATMUL with ROCmFP2 (type 107) weights (MMVQ for
//! n <= 8 columns, MMQ above: `mmq_mma_107` on tensor cores for sm_80+, else the dp4a
//! tiled `mmq_dp4a_107`), the grouped MoE mat-vec (a backend-private op until the ABI
//! has one), GET_ROWS and ADD.

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicBool, Ordering},
        Mutex, OnceLock,
    },
};

use cudarc::driver::{result as cu, sys};
use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::{
    kargs,
    rt::{self, err, Device},
};

/// GGUF type id of Q2_0_ROCMFP2.
pub const TYPE_Q2_0_ROCMFP2: u32 = 107;
/// `TensorRef::variant` of type 107: two-scale (upstream default) vs affine, as
/// moe-quant-rocmfpx's `resolve_variant` returns them.
pub const FP2_TWO_SCALE: u64 = 1;
pub const FP2_AFFINE: u64 = 2;

/// Backend-private op (not yet in the ABI's `ops`): grouped MoE mat-vec.
/// args: w (107 [k, m, experts]), x (F32 [k, n_tok] shared by a token's slots, or
/// [k, n_slots * n_tok] one column per pair), ids (I32 [n_slots, n_tok], -1 = masked),
/// out (F32 [m, n_slots, n_tok]); masked pairs get exact zeros.
pub const OP_MATMUL_ID: u32 = 0x100;

/// Forces the dp4a MMQ kernel even where the tensor-core one runs (benchmarks and
/// parity comparisons only; off by default).
pub static FORCE_MMQ_DP4A: AtomicBool = AtomicBool::new(false);

/// The MMQ kernel MATMUL uses for more than 8 columns on a device of compute capability
/// `cc`: `mmq_mma_107` (mma.sync int8) from sm_80, else `mmq_dp4a_107`.
pub fn mmq_kernel(cc: (i32, i32)) -> &'static str {
    if cc.0 >= 8 && !FORCE_MMQ_DP4A.load(Ordering::Relaxed) {
        "mmq_mma_107"
    } else {
        "mmq_dp4a_107"
    }
}

const BLOCK_BYTES: u64 = 10;
const Q8_BYTES: u64 = 40;

fn bytes_of(t: &TensorRef) -> Result<u64, String> {
    let n = t.numel();
    match t.type_id {
        types::F32 | types::I32 => Ok(n * 4),
        TYPE_Q2_0_ROCMFP2 => {
            if !n.is_multiple_of(32) {
                return Err(format!("type 107 tensor of {n} values is not whole blocks"));
            }
            Ok(n / 32 * BLOCK_BYTES)
        }
        other => Err(format!(
            "the cuda backend does not handle tensors of type {other} (it has F32, I32 and 107)"
        )),
    }
}

/// Device pointer of a tensor, bounds- and alignment-checked, on `device`.
fn ptr(t: &TensorRef, device: u32, align: u64) -> Result<sys::CUdeviceptr, String> {
    let (b, p) = rt::range(t.buffer, t.offset, bytes_of(t)?)?;
    if b.device != device {
        return Err(format!(
            "buffer {} is on device {}, the stream on device {device}",
            t.buffer, b.device
        ));
    }
    if !p.is_multiple_of(align) {
        return Err(format!(
            "tensor at offset {} is not {align}-byte aligned",
            t.offset
        ));
    }
    Ok(p)
}

fn expect(t: &TensorRef, ty: u32, what: &str) -> Result<(), String> {
    if t.type_id != ty {
        return Err(format!("{what}: expected type {ty}, got {}", t.type_id));
    }
    Ok(())
}

fn affine(w: &TensorRef) -> Result<i32, String> {
    match w.variant {
        FP2_TWO_SCALE => Ok(0),
        FP2_AFFINE => Ok(1),
        v => Err(format!(
            "type 107: unknown variant {v} (0 two-scale, 1 affine)"
        )),
    }
}

fn to_i32(v: u64, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} is too large"))
}

/// Per-stream scratch memory (q8 activations, expert lists); ops on one stream run in
/// order, so one region per stream is enough.
static SCRATCH: OnceLock<Mutex<HashMap<u64, (sys::CUdeviceptr, usize)>>> = OnceLock::new();

fn scratch(stream: u64, raw: sys::CUstream, bytes: usize) -> Result<sys::CUdeviceptr, String> {
    let mut map = SCRATCH
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&(p, len)) = map.get(&stream) {
        if len >= bytes {
            return Ok(p);
        }
        // SAFETY: wait for queued work that may still read the old region.
        unsafe {
            cu::stream::synchronize(raw).map_err(|e| err("cuStreamSynchronize", e))?;
            let _ = cu::free_sync(p);
        }
        map.remove(&stream);
    }
    let len = bytes.next_power_of_two().max(1 << 20);
    // SAFETY: plain allocation in the bound context.
    let p = unsafe { cu::malloc_sync(len) }.map_err(|e| err("cuMemAlloc (scratch)", e))?;
    map.insert(stream, (p, len));
    Ok(p)
}

pub fn run(stream_id: u64, op: u32, _p: &OpParams, args: &[TensorRef]) -> Result<(), String> {
    let s = rt::stream(stream_id)?;
    let dev = rt::runtime()?.device(s.device)?;
    dev.bind()?;
    let module = dev.module()?;
    let raw = s.raw.0;
    match op {
        ops::MATMUL => matmul(dev, stream_id, raw, args),
        OP_MATMUL_ID => matmul_id(dev, stream_id, raw, args),
        ops::ADD => {
            let [a, b, out] = three(args, "add")?;
            for t in [&a, &b, &out] {
                expect(t, types::F32, "add")?;
            }
            let mut n = out.numel() as i64;
            if a.numel() != out.numel() || b.numel() != out.numel() {
                return Err("add: shape mismatch".into());
            }
            let (mut pa, mut pb, mut po) = (
                ptr(&a, s.device, 4)?,
                ptr(&b, s.device, 4)?,
                ptr(&out, s.device, 4)?,
            );
            let grid = ((n as u64).div_ceil(256) as u32, 1, 1);
            // SAFETY: three checked f32 ranges of n values.
            unsafe { module.launch(raw, "add_f32", grid, 256, &kargs!(pa, pb, po, n)) }
        }
        ops::GET_ROWS => {
            let [table, ids, out] = three(args, "get_rows")?;
            expect(&ids, types::I32, "get_rows ids")?;
            expect(&out, types::F32, "get_rows out")?;
            let (cols, rows) = (table.dims[0], table.dims[1] * table.dims[2] * table.dims[3]);
            let n_ids = ids.numel();
            if out.numel() != cols * n_ids {
                return Err("get_rows: output is not cols x ids".into());
            }
            let (mut pt, mut pi, mut po) = (
                ptr(&table, s.device, 2)?,
                ptr(&ids, s.device, 4)?,
                ptr(&out, s.device, 4)?,
            );
            let (mut r, mut c) = (to_i32(rows, "rows")?, to_i32(cols, "cols")?);
            let grid = (cols.div_ceil(256) as u32, to_i32(n_ids, "ids")? as u32, 1);
            // SAFETY: checked ranges; ids outside 0..rows give zero rows.
            unsafe {
                match table.type_id {
                    types::F32 => {
                        module.launch(raw, "get_rows_f32", grid, 256, &kargs!(pt, pi, r, c, po))
                    }
                    TYPE_Q2_0_ROCMFP2 => {
                        let mut a = affine(&table)?;
                        module.launch(raw, "get_rows_107", grid, 256, &kargs!(pt, pi, r, c, po, a))
                    }
                    t => Err(format!(
                        "get_rows: type {t} is not supported by the cuda backend"
                    )),
                }
            }
        }
        _ => Err(format!("op {op} is not supported by the cuda backend")),
    }
}

fn three(args: &[TensorRef], op: &str) -> Result<[TensorRef; 3], String> {
    args.try_into()
        .map_err(|_| format!("{op}: expected 3 tensor arguments, got {}", args.len()))
}

/// Quantises `cols` columns of `k` f32 values at `x` into q8_1 blocks at `q8`.
fn quantize(
    dev: &Device,
    raw: sys::CUstream,
    x: sys::CUdeviceptr,
    q8: sys::CUdeviceptr,
    k: u64,
    cols: u64,
) -> Result<(), String> {
    let (mut px, mut pq) = (x, q8);
    let mut n_blocks = (cols * k / 32) as i64;
    let grid = ((n_blocks as u64).div_ceil(8) as u32, 1, 1);
    // SAFETY: x holds cols*k f32, q8 room for cols*k/32 blocks (callers size it).
    unsafe {
        dev.module()?
            .launch(raw, "quantize_q8_1", grid, 256, &kargs!(px, pq, n_blocks))
    }
}

fn matmul(
    dev: &Device,
    stream_id: u64,
    raw: sys::CUstream,
    args: &[TensorRef],
) -> Result<(), String> {
    let [w, x, out] = three(args, "matmul")?;
    expect(
        &w,
        TYPE_Q2_0_ROCMFP2,
        "matmul weights (the cuda backend runs type 107)",
    )?;
    expect(&x, types::F32, "matmul input")?;
    expect(&out, types::F32, "matmul output")?;
    let (k, m) = (w.dims[0], w.dims[1] * w.dims[2] * w.dims[3]);
    if k == 0 || !k.is_multiple_of(32) || !x.numel().is_multiple_of(k) {
        return Err(format!(
            "matmul: k = {k} must be a multiple of 32 dividing the input"
        ));
    }
    let n = x.numel() / k;
    if out.numel() != m * n {
        return Err(format!(
            "matmul: output holds {} values, expected {m} x {n}",
            out.numel()
        ));
    }
    let d = dev.index;
    let (mut pw, px, mut po) = (ptr(&w, d, 2)?, ptr(&x, d, 4)?, ptr(&out, d, 4)?);
    let mut pq = scratch(stream_id, raw, (n * k / 32 * Q8_BYTES) as usize)?;
    quantize(dev, raw, px, pq, k, n)?;
    let mut nb = to_i32(k / 32, "k / 32")?;
    let mut mm = to_i32(m, "m")?;
    let mut a = affine(&w)?;
    let module = dev.module()?;
    // SAFETY: checked ranges; q8 scratch holds n columns of k/32 blocks.
    unsafe {
        if n <= 8 {
            let name = crate::kernels::KERNELS[n as usize];
            // Rows per warp: RF_MMVQ_ROWS in rocmfpx.cu; 4 warps per block.
            let rows_per_warp = match n {
                1 => 1,
                2..=4 => 2,
                _ => 4,
            };
            let grid = (m.div_ceil(4 * rows_per_warp) as u32, 1, 1);
            module.launch(raw, name, grid, 128, &kargs!(pw, nb, mm, pq, po, a))
        } else {
            let mut nn = to_i32(n, "n")?;
            let name = mmq_kernel(dev.cc);
            // Tiles: 128 x 64 (mmq_mma_107), 64 x 32 (mmq_dp4a_107); 256 threads.
            let (bm, bn) = if name == "mmq_mma_107" {
                (128, 64)
            } else {
                (64, 32)
            };
            let grid = (m.div_ceil(bm) as u32, n.div_ceil(bn) as u32, 1);
            module.launch(raw, name, grid, 256, &kargs!(pw, nb, mm, nn, pq, po, a))
        }
    }
}

fn matmul_id(
    dev: &Device,
    stream_id: u64,
    raw: sys::CUstream,
    args: &[TensorRef],
) -> Result<(), String> {
    let [w, x, ids, out]: [TensorRef; 4] = args
        .try_into()
        .map_err(|_| format!("matmul_id: expected 4 tensor arguments, got {}", args.len()))?;
    expect(&w, TYPE_Q2_0_ROCMFP2, "matmul_id weights")?;
    expect(&x, types::F32, "matmul_id input")?;
    expect(&ids, types::I32, "matmul_id ids")?;
    expect(&out, types::F32, "matmul_id output")?;
    let (k, m, experts) = (w.dims[0], w.dims[1], w.dims[2] * w.dims[3]);
    let (n_slots, n_tok) = (ids.dims[0], ids.dims[1] * ids.dims[2] * ids.dims[3]);
    let pairs = n_slots * n_tok;
    if k == 0 || !k.is_multiple_of(32) {
        return Err(format!("matmul_id: k = {k} is not a multiple of 32"));
    }
    if experts > 1024 {
        return Err(format!("matmul_id: {experts} experts (at most 1024)"));
    }
    let x_cols = x.numel() / k.max(1);
    let per_pair = if x.numel() == k * n_tok {
        0
    } else if x.numel() == k * pairs {
        1
    } else {
        return Err(format!(
            "matmul_id: input of {} values is neither {n_tok} nor {pairs} columns of {k}",
            x.numel()
        ));
    };
    if out.numel() != m * pairs {
        return Err(format!(
            "matmul_id: output holds {} values, expected {m} x {pairs}",
            out.numel()
        ));
    }
    let d = dev.index;
    let (mut pw, px, mut pi, mut po) = (
        ptr(&w, d, 2)?,
        ptr(&x, d, 4)?,
        ptr(&ids, d, 4)?,
        ptr(&out, d, 4)?,
    );
    let q8_bytes = (x_cols * k / 32 * Q8_BYTES).next_multiple_of(256);
    let list_bytes = (experts + 2) * 4;
    let base = scratch(
        stream_id,
        raw,
        (q8_bytes + 2 * list_bytes + pairs * 4 + 256) as usize,
    )?;
    let mut pq = base;
    let mut poff = base + q8_bytes;
    let mut pact = poff + list_bytes.next_multiple_of(16);
    let mut psorted = pact + list_bytes.next_multiple_of(16);
    quantize(dev, raw, px, pq, k, x_cols)?;
    let module = dev.module()?;
    let mut np = to_i32(pairs, "pairs")?;
    let mut ne = to_i32(experts, "experts")?;
    let mut nb = to_i32(k / 32, "k / 32")?;
    let mut mm = to_i32(m, "m")?;
    let mut ns = to_i32(n_slots, "slots")?;
    let mut ebytes = (m * k / 32 * BLOCK_BYTES) as i64;
    let mut pp = per_pair;
    let mut a = affine(&w)?;
    // SAFETY: checked ranges; the sort writes experts + 2 offsets, experts + 2 active
    // entries and `pairs` ids.
    unsafe {
        module.launch(
            raw,
            "moe_sort",
            (1, 1, 1),
            256,
            &kargs!(pi, np, ne, poff, pact, psorted),
        )?;
        let grid = (m.div_ceil(4) as u32, pairs.min(experts) as u32 + 1, 1);
        module.launch(
            raw,
            "mmvq_grouped_107",
            grid,
            128,
            &kargs!(pw, ebytes, nb, mm, ne, pq, pp, ns, poff, pact, psorted, po, a),
        )
    }
}
