//! Op validation and launch planning, shared by the CUDA and HIP backends: each plan
//! checks the arguments (in the order the backends always did, so the same error
//! wins), resolves device pointers through the backend's `ptr` callback and returns
//! the kernel arguments, scratch layout and launch dims as plain values. The backend
//! then only allocates scratch and launches.

use std::ffi::c_void;

use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::kargs;

/// GGUF type id of Q2_0_ROCMFP2.
pub const TYPE_Q2_0_ROCMFP2: u32 = 107;
/// `TensorRef::variant` of type 107: two-scale (upstream default) vs affine, as
/// moe-quant-rocmfpx's `resolve_variant` returns them.
pub const FP2_TWO_SCALE: u64 = 1;
pub const FP2_AFFINE: u64 = 2;

/// The grouped MoE mat-vec's original backend-private code, kept as an alias of the
/// ABI's `ops::MATMUL_ID` (ABI 1.1).
/// args: w (107 [k, m, experts]), x (F32 [k, n_tok] shared by a token's slots, or
/// [k, n_slots * n_tok] one column per pair), ids (I32 [n_slots, n_tok], -1 = masked),
/// out (F32 [m, n_slots, n_tok]); masked pairs get exact zeros.
pub const OP_MATMUL_ID: u32 = 0x100;

/// Bytes of one type-107 block (32 values).
pub const BLOCK_BYTES: u64 = 10;
/// Bytes of one q8_1 block (32 values).
pub const Q8_BYTES: u64 = 40;
/// The tensor-core MMQ kernel (the other is `mmq_dp4a_107`).
pub const MMQ_MMA: &str = "mmq_mma_107";
pub const MMQ_DP4A: &str = "mmq_dp4a_107";
/// Columns from which a Q8_0 / ROCmFP4 MATMUL runs `mmq_mma_dense` (q8_1 activations on
/// the matrix units) instead of the f32 mat-vec, 8 columns at a time.
pub const MMQ_MIN_COLS: u64 = 16;
/// Columns a tile of `mmq_mma_dense` for `[k, m]` weights against `n` columns: 16 (the
/// narrow warp layout, 4x the blocks) where 64-column tiles would make fewer blocks
/// than `MOE_GPU_MMQ_DENSE_NARROW` (read once), else 64. Off by default (0): on the H200
/// (2026-12-04, depth 0, 43 layers) pp512 fell from 1647 / 1646 to 1597 / 1597 at 70
/// (`wq_a`, `wkv`, the output groups narrow), 1524 / 1525 at 140 (the shared expert's
/// gate / up too) and 1393 at 300: a weight tile decoded 4x as often costs more than the
/// idle multiprocessors.
pub fn mmq_dense_cols(m: u64, n: u64) -> u64 {
    static BELOW: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let below = *BELOW.get_or_init(|| env_num("MOE_GPU_MMQ_DENSE_NARROW").unwrap_or(0));
    let (bm, bn) = mmq_tile(MMQ_MMA);
    if m.div_ceil(bm) * n.div_ceil(bn) < below {
        16
    } else {
        bn
    }
}

/// Whether a Q8_0 / ROCmFP4 product of 2 to 15 columns (a drafted pass's tokens) runs
/// `mmq_mma_dense` (q8_1 activations, the tile's 16-column layout) instead of
/// `matvec_dense`: `MOE_GPU_FEW_COLS=mmq` (read once). Off: on an H100 (2026-12-06, 20
/// layers, passes of 4 tokens) the tiles took 35.2 ms a pass against 15.2 on
/// `matvec_dense`, and moved the drafted logits off decode's (the quantised fixtures'
/// "draft vs dec" 0.05 - 0.13 where `matvec_dense` gives 4e-7).
pub fn few_cols_mmq() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOE_GPU_FEW_COLS").is_ok_and(|v| v == "mmq"))
}

/// Pairs per expert (on average) from which MATMUL_ID runs `mmq_mma_id`.
pub const MMQ_MIN_PAIRS_PER_EXPERT: u64 = 4;

/// `MOE_GPU_EXACT_PREFILL=1` keeps f32 activations for the dense types' products of
/// many columns (the f32 mat-vec; slower, the same sums as the CPU up to order).
pub fn exact_prefill() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOE_GPU_EXACT_PREFILL").is_some_and(|v| v == "1"))
}

/// Whether weights of `ty` with `k` values per row run the tensor-core MMQ tiles on a
/// device whose MMQ kernel is `mmq`: type 107 always (its activations are q8_1 on every
/// path), Q8_0 / ROCmFP4 unless [`exact_prefill`].
pub fn mmq_type(ty: u32, k: u64, mmq: &str) -> bool {
    mmq == MMQ_MMA
        && k.is_multiple_of(32)
        && match ty {
            TYPE_Q2_0_ROCMFP2 => true,
            TYPE_Q8_0 | TYPE_ROCMFP4 => !exact_prefill(),
            _ => false,
        }
}

/// Whether MATMUL_ID `args` (w [k, m, experts], x, ids [slots, tokens], out) runs
/// `mmq_mma_id`: enough pairs per expert for the 64-column tiles to pay.
pub fn id_takes_mmq(args: &[TensorRef], mmq: &str) -> bool {
    let (Some(w), Some(ids)) = (args.first(), args.get(2)) else {
        return false;
    };
    let experts = w.dims[2] * w.dims[3];
    let pairs = ids.dims.iter().product::<u64>();
    mmq_type(w.type_id, w.dims[0], mmq) && pairs >= MMQ_MIN_PAIRS_PER_EXPERT * experts
}

/// Grid dims of a launch.
pub type Grid = (u32, u32, u32);

/// One kernel launch: name, grid and threads per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Launch {
    pub name: &'static str,
    pub grid: Grid,
    pub block: u32,
}

pub use types::{BF16 as TYPE_BF16, MXFP4 as TYPE_MXFP4, Q8_0 as TYPE_Q8_0};
/// ROCmFP4 (two half scales) and ROCmFP4_FAST (one scale): decoded by the dense kernels.
pub const TYPE_ROCMFP4: u32 = 100;
pub const TYPE_ROCMFP4_FAST: u32 = 101;

/// Bytes of one row of `k` values of a dense-kernel type (None: not one of them).
pub fn dense_row_bytes(ty: u32, k: u64) -> Option<Result<u64, String>> {
    let blocks = |bytes: u64| {
        if k.is_multiple_of(32) {
            Ok(k / 32 * bytes)
        } else {
            Err(format!(
                "type {ty}: rows of {k} values are not whole 32-value blocks"
            ))
        }
    };
    Some(match ty {
        types::F32 => Ok(4 * k),
        types::F16 | TYPE_BF16 => Ok(2 * k),
        TYPE_Q8_0 => blocks(34),
        TYPE_MXFP4 | TYPE_ROCMFP4_FAST => blocks(17),
        TYPE_ROCMFP4 => blocks(18),
        _ => return None,
    })
}

/// Bytes a tensor takes in device memory; `backend` names the backend in errors.
pub fn bytes_of(t: &TensorRef, backend: &str) -> Result<u64, String> {
    let n = t.numel();
    if let Some(r) = dense_row_bytes(t.type_id, t.dims[0]) {
        return Ok(r? * (n / t.dims[0].max(1)));
    }
    match t.type_id {
        types::I32 => Ok(n * 4),
        TYPE_Q2_0_ROCMFP2 => {
            if !n.is_multiple_of(32) {
                return Err(format!("type 107 tensor of {n} values is not whole blocks"));
            }
            Ok(n / 32 * BLOCK_BYTES)
        }
        other => Err(format!(
            "the {backend} backend does not handle tensors of type {other} (it has F32, F16, BF16, Q8_0, MXFP4, I32, 100, 101 and 107)"
        )),
    }
}

/// Checks a tensor's resolved address `p`, in a buffer on `buffer_device`, against
/// the stream's `device` and the alignment `align`.
pub fn check_placement(
    t: &TensorRef,
    p: u64,
    buffer_device: u32,
    device: u32,
    align: u64,
) -> Result<u64, String> {
    if buffer_device != device {
        return Err(format!(
            "buffer {} is on device {buffer_device}, the stream on device {device}",
            t.buffer
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

pub fn expect(t: &TensorRef, ty: u32, what: &str) -> Result<(), String> {
    if t.type_id != ty {
        return Err(format!("{what}: expected type {ty}, got {}", t.type_id));
    }
    Ok(())
}

/// The kernels' `affine` flag of a type-107 tensor.
pub fn affine(w: &TensorRef) -> Result<i32, String> {
    match w.variant {
        FP2_TWO_SCALE => Ok(0),
        FP2_AFFINE => Ok(1),
        v => Err(format!(
            "type 107: unknown variant {v} ({FP2_TWO_SCALE} two-scale, {FP2_AFFINE} affine)"
        )),
    }
}

pub fn to_i32(v: u64, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} = {v} is too large"))
}

pub fn three(args: &[TensorRef], op: &str) -> Result<[TensorRef; 3], String> {
    args.try_into()
        .map_err(|_| format!("{op}: expected 3 tensor arguments, got {}", args.len()))
}

/// Size of a per-stream scratch region for a request of `bytes`.
pub fn scratch_len(bytes: usize) -> usize {
    bytes.next_power_of_two().max(1 << 20)
}

/// The `planes` argument of `quantize_q8_1` for activations `consumer` reads: 1 (each
/// half plane-ordered) for the type-107 mat-vec kernels, 0 (in order) for the MMQ tiles.
pub fn rf2_planes(consumer: &str) -> i32 {
    consumer.starts_with("mmvq_") as i32
}

/// `quantize_q8_1` over `cols` columns of `k` values: the launch and its block count.
pub fn quantize(k: u64, cols: u64) -> (Launch, i64) {
    let n_blocks = (cols * k / 32) as i64;
    let grid = ((n_blocks as u64).div_ceil(8) as u32, 1, 1);
    (
        Launch {
            name: "quantize_q8_1",
            grid,
            block: 256,
        },
        n_blocks,
    )
}

/// ADD: `out = a + b` over `n` f32 values.
#[derive(Debug, PartialEq, Eq)]
pub struct Add {
    pub a: u64,
    pub b: u64,
    pub out: u64,
    pub n: i64,
    pub launch: Launch,
}

pub fn add(
    args: &[TensorRef],
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<Add, String> {
    let [a, b, out] = three(args, "add")?;
    for t in [&a, &b, &out] {
        expect(t, types::F32, "add")?;
    }
    let n = out.numel() as i64;
    if a.numel() != out.numel() || b.numel() != out.numel() {
        return Err("add: shape mismatch".into());
    }
    let (a, b, out) = (ptr(&a, 4)?, ptr(&b, 4)?, ptr(&out, 4)?);
    let grid = ((n as u64).div_ceil(256) as u32, 1, 1);
    Ok(Add {
        a,
        b,
        out,
        n,
        launch: Launch {
            name: "add_f32",
            grid,
            block: 256,
        },
    })
}

/// GET_ROWS: rows `ids` of `table` (F32 or 107) into f32 `out`; `affine` is set for
/// type 107 (the kernel's extra argument).
#[derive(Debug, PartialEq, Eq)]
pub struct GetRows {
    /// Set for the dense kernel: (row bytes, type id).
    pub dense: Option<(i64, i32)>,
    pub table: u64,
    pub ids: u64,
    pub out: u64,
    pub rows: i32,
    pub cols: i32,
    pub affine: Option<i32>,
    pub launch: Launch,
}

pub fn get_rows(
    args: &[TensorRef],
    backend: &str,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<GetRows, String> {
    let [table, ids, out] = three(args, "get_rows")?;
    expect(&ids, types::I32, "get_rows ids")?;
    expect(&out, types::F32, "get_rows out")?;
    let (cols, rows) = (table.dims[0], table.dims[1] * table.dims[2] * table.dims[3]);
    let n_ids = ids.numel();
    if out.numel() != cols * n_ids {
        return Err("get_rows: output is not cols x ids".into());
    }
    let (pt, pi, po) = (
        ptr(&table, dense_align(table.type_id))?,
        ptr(&ids, 4)?,
        ptr(&out, 4)?,
    );
    let (r, c) = (to_i32(rows, "rows")?, to_i32(cols, "cols")?);
    let grid = (cols.div_ceil(256) as u32, to_i32(n_ids, "ids")? as u32, 1);
    let (name, affine, dense) = match table.type_id {
        types::F32 => ("get_rows_f32", None, None),
        TYPE_Q2_0_ROCMFP2 => ("get_rows_107", Some(affine(&table)?), None),
        t => match dense_row_bytes(t, cols) {
            Some(rb) => ("get_rows_dense", None, Some((rb? as i64, t as i32))),
            None => {
                return Err(format!(
                    "get_rows: type {t} is not supported by the {backend} backend"
                ))
            }
        },
    };
    Ok(GetRows {
        dense,
        table: pt,
        ids: pi,
        out: po,
        rows: r,
        cols: c,
        affine,
        launch: Launch {
            name,
            grid,
            block: 256,
        },
    })
}

/// Address alignment the kernels need for a tensor of `ty` (byte loads for MXFP4).
pub(crate) fn dense_align(ty: u32) -> u64 {
    match ty {
        types::F32 => 4,
        // ROCmFP4's 18-byte blocks are read as 16-bit words; the 17-byte ones as bytes.
        TYPE_MXFP4 | TYPE_ROCMFP4_FAST => 1,
        _ => 2,
    }
}

/// MATMUL of f32 / f16 / bf16 / q8_0 / mxfp4 weights `[k, m]` with `n` f32 columns,
/// decoded as they are read (`matvec_dense`; a decode step's single column of Q8_0 or
/// ROCmFP4 weights: `matvec_dense_rows`, see [`dense_rows`]).
#[derive(Debug, PartialEq, Eq)]
pub struct DenseMatmul {
    pub w: u64,
    pub row_bytes: i64,
    pub ty: i32,
    pub k: i32,
    pub m: i32,
    pub x: u64,
    pub n: i32,
    pub out: u64,
    pub layout: DenseLayout,
    pub launch: Launch,
}

/// Which kernel a [`DenseMatmul`] launches, with its layout parameter.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub enum DenseLayout {
    /// `matvec_dense`, this many warps per row (1, 2, 4, 8; see [`dense_parts`]).
    Warps(i32),
    /// `matvec_dense_rows`, this many rows per block (see [`dense_rows`]).
    Rows(i32),
    /// `matvec_dense_cols`, this many rows per block (see [`dense_cols`]).
    Cols(i32),
    /// `matvec_fp4_runs_q8_cols`, the one-column runs plan (see [`fp4_runs_cols`]).
    Fp4RunsCols(RunsPlan),
    /// `matvec_fp4_runs_q8`, this many rows per thread and threads per block (see
    /// [`fp4_runs`]).
    Fp4Runs(RunsPlan),
    /// `matvec_f32_wide`: a 1024-thread block per row (see [`f32_wide`]).
    F32Wide,
    /// `quantize_q8_1` of the input into scratch, then `mmq_mma_dense` (see [`mmq_type`]).
    Mmq,
    /// `matmul_f32_tiles` over this many slices of k of `span` values each, then (more
    /// than one slice) `matmul_f32_reduce` from scratch (see [`f32_tiles`]).
    F32Tiles { slices: u64, span: u64 },
}

/// One column of f32 weights with at most 1024 rows (the mHC mixes, the router) runs
/// `matvec_f32_wide` when k is whole float4s and weights and activations are 16-byte
/// aligned.
pub fn f32_wide(ty: u32, k: u64, m: u64, n: u64, w: u64, x: u64) -> bool {
    ty == types::F32
        && n == 1
        && m <= 1024
        && k.is_multiple_of(4)
        && w.is_multiple_of(16)
        && x.is_multiple_of(16)
        && !dense_rows_off()
}

/// `MOE_GPU_ROUTER_MM=0` runs ROUTER's product and selection as two launches (A/B runs;
/// read once).
pub(crate) fn router_mm_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_ROUTER_MM"))
}

/// `MOE_GPU_F32_TILES=0` keeps f32 products of many columns on `matvec_dense` (A/B runs;
/// read once).
fn f32_tiles_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_F32_TILES"))
}

/// Tile of `matmul_f32_tiles` (rows, columns) and its step along k (F32T_BM / F32T_BN /
/// F32T_BK in kernels/gpu/rocmfpx.cu).
pub const F32_TILE: (u64, u64, u64) = (32, 64, 32);

/// Blocks a `matmul_f32_tiles` launch aims for: two for each of an H200's 132
/// multiprocessors.
const F32_TILES_BLOCKS: u64 = 264;

/// f32 weights `[k, m]` against `n` >= 16 columns (a prefill chunk's mHC mixes and router)
/// with k whole float4s and weights and activations 16-byte aligned: `matmul_f32_tiles`'s
/// (slices, span), k cut into slices of `span` values (a multiple of the tile's step, the
/// last slice what is left) while the tiles alone are too few blocks and the slices would
/// still average 256 values or more, at most 32 slices. None: `matvec_dense` (or decode's
/// `matvec_f32_wide`).
pub fn f32_tiles(ty: u32, k: u64, m: u64, n: u64, w: u64, x: u64) -> Option<(u64, u64)> {
    if ty != types::F32
        || n < 16
        || k == 0
        || !k.is_multiple_of(4)
        || !w.is_multiple_of(16)
        || !x.is_multiple_of(16)
        || f32_tiles_off()
    {
        return None;
    }
    let (bm, bn, bk) = F32_TILE;
    let tiles = m.div_ceil(bm) * n.div_ceil(bn);
    let mut slices = 1;
    while slices < 32 && tiles * slices < F32_TILES_BLOCKS && k / (2 * slices) >= 256 {
        slices *= 2;
    }
    let span = k.div_ceil(slices).div_ceil(bk) * bk;
    Some((k.div_ceil(span), span))
}

/// The variable `name` parsed as a number, if set and valid (callers keep it in a
/// OnceLock: read once).
pub(crate) fn env_num<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// `MOE_GPU_ID_NOSORT=0`: one token's MATMUL_ID sorts too (A/B runs; read once).
fn id_nosort_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_ID_NOSORT"))
}

/// Whether `n_tok` tokens' MATMUL_ID of `pairs` pairs on `experts` experts runs
/// `mmvq_id_107` (a block row a pair, no sort) rather than `moe_sort` and
/// `mmvq_grouped_107`: one token (a decode step), or a drafted pass's few tokens (up to
/// `MOE_GPU_ID_NOSORT_MAX`, 8 by default; read once) whose pairs are few against the
/// experts, so that few share one (an expert two pairs share is read twice, where the
/// sorted kernel reads it once; the sums are the same bits either way). Measured on an
/// H100 (20 layers, 2026-12-06): the grouped kernel took 2.5 ms of a 4-token pass.
/// `MOE_GPU_ID_NOSORT=0`: every MATMUL_ID sorts.
pub fn id_nosort(n_tok: u64, pairs: u64, experts: u64) -> bool {
    static MAX: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let max = *MAX.get_or_init(|| env_num("MOE_GPU_ID_NOSORT_MAX").unwrap_or(8));
    !id_nosort_off() && (n_tok == 1 || (n_tok <= max && 4 * pairs <= experts))
}

/// Rows per warp of `mmvq_id_107` (one token's routed experts): `MOE_GPU_ID_ROWS` (1, 2
/// or 4, for A/B runs; read once), else 4 (18:07 UTC, 43 layers, depth 0: tg32 107.4 /
/// 106.6 / 103.7 tok/s at 4 / 2 / 1).
pub fn id_rows() -> u64 {
    static ROWS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| {
        env_num("MOE_GPU_ID_ROWS")
            .filter(|r| matches!(r, 1 | 2 | 4))
            .unwrap_or(4)
    })
}

/// `MOE_GPU_DENSE_ROWS=0` keeps `matvec_dense` everywhere (A/B runs on the device).
fn dense_rows_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_DENSE_ROWS"))
}

/// `MOE_GPU_FP4_RUNS=0` keeps every ROCmFP4 decode product on `matvec_dense_rows` (A/B
/// runs; read once).
fn fp4_runs_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_FP4_RUNS"))
}

/// Largest k `matvec_fp4_runs_q8` stages (FP4_RUNS_MAX_K in kernels/gpu/rocmfpx.cu).
pub const FP4_RUNS_MAX_K: u64 = 8192;

/// How `matvec_fp4_runs_q8` runs a product: rows per thread and threads per block; with
/// `mma`, `matvec_fp4_mma` instead, `rows` then its groups of 16 rows a block.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub struct RunsPlan {
    pub rows: u64,
    pub threads: u64,
    pub mma: bool,
}

impl RunsPlan {
    /// The kernel the plan launches, plain or `grouped` (one token's MATMUL_ID): with
    /// [`fp4_b2`] a one-row, 512-thread plan takes the two-blocks-a-multiprocessor forms.
    pub fn kernel(&self, grouped: bool) -> &'static str {
        let b2 = fp4_b2() && self.rows == 1 && self.threads == 512;
        match (self.mma, grouped, b2) {
            (false, false, false) => "matvec_fp4_runs_q8",
            (false, true, false) => "matvec_fp4_runs_q8_id",
            (false, false, true) => "matvec_fp4_runs_q8_b2",
            (false, true, true) => "matvec_fp4_runs_q8_id_b2",
            (true, false, _) => "matvec_fp4_mma",
            (true, true, _) => "matvec_fp4_mma_id",
        }
    }
}

/// `MOE_GPU_FP4_B2=1` (A/B runs; read once): the ROCmFP4 decode products at one row a
/// thread on 512-thread blocks, two a multiprocessor (`matvec_fp4_runs_q8_b2` and
/// `_id_b2`: the same sums), instead of two rows a thread on one or two blocks. The
/// other runs kernels (`_id_swiglu`, `_cols`) then take one row a thread on their
/// one-block form, and q_a's norm inside `wq_b` (`MOE_DS4_NORM_MM=1`) is not fused.
pub fn fp4_b2() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOE_GPU_FP4_B2").is_some_and(|v| v == "1"))
}

/// Forces `matvec_fp4_mma` on (its threads a block, 256 or 512) or off (1) for the
/// ROCmFP4 decode products the runs kernel would take, over `MOE_GPU_FP4_MMA` (0: as
/// the variable says; device tests).
pub static FORCE_FP4_MMA: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Threads a block of `matvec_fp4_mma` (the runs kernel's one-run-a-thread products
/// with their integer sums on the matrix units: the same bits), or None for the runs
/// kernel: [`FORCE_FP4_MMA`], else `MOE_GPU_FP4_MMA` (0 off, 256 or 512; read once),
/// else off (43 layers, depth 0, H200 2026-12-03: tg32 151.0 / 150.4 at 256 and 150.3 at
/// 512 against 153.9 / 156.4 without).
pub fn fp4_mma_threads() -> Option<u64> {
    static ENV: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    match FORCE_FP4_MMA.load(std::sync::atomic::Ordering::Relaxed) {
        0 => *ENV.get_or_init(|| env_num("MOE_GPU_FP4_MMA").filter(|t| matches!(t, 256 | 512))),
        1 => None,
        t => Some(t),
    }
}

/// `plan` on `matvec_fp4_mma` at `threads` a block ([`fp4_mma_threads`]) where k is whole
/// 1024-value groups (each warp's four lanes a row take four runs): k / 1024 warps along
/// k, as many groups of 16 rows as fill the threads (at least one).
fn fp4_mma_plan(k: u64, plan: RunsPlan, threads: Option<u64>) -> RunsPlan {
    match threads {
        Some(t) if k.is_multiple_of(1024) => {
            let along_k = k / 1024;
            let groups = (t / (32 * along_k)).max(1);
            RunsPlan {
                rows: groups,
                threads: 32 * along_k * groups,
                mma: true,
            }
        }
        _ => plan,
    }
}

/// The runs kernel's rows a thread and threads a block for `m` rows of `k` values.
fn fp4_plain_plan(m: u64, k: u64) -> RunsPlan {
    let (rows, threads) = match (m, k) {
        _ if fp4_b2() => (1, 512),
        (16384.., _) => (2, 256),
        (_, FP4_RUNS_MAX_K) => (2, 512),
        _ => (1, 256),
    };
    RunsPlan {
        rows,
        threads,
        mma: false,
    }
}

/// [`RunsPlan`] of `matvec_fp4_runs_q8` (8-bit activations, dp4a) for one column of
/// ROCmFP4 weights `[k, m]` at `w` with activations at `x`, or None where
/// `matvec_dense_rows` (f32 activations) runs: k not whole 256-value runs or over
/// FP4_RUNS_MAX_K, weights or activations not 16-byte aligned, under 4096 rows, or
/// under 16384 rows with k under 2048.
/// Every block quantises all of x, so wide blocks pay where k is long. Measured on the
/// V4-Flash shapes (scripts/device/dense_matvec_bench.sh, 20:01 UTC, graph-replayed us,
/// rows layout in brackets): `wq_b` (1024 x 32768) 11.0 at 2 rows x 256 threads
/// (17.1); `wo_b` (8192 x 4096) 13.1 at 2 x 512 (16.9); the shared expert's down
/// (2048 x 4096) 5.0 at 1 x 256 (6.0). Under 4096 rows (the shared expert's gate / up,
/// `wq_a`, `wkv`, one of the output projection's groups alone) the rows layout was as
/// fast or faster.
pub fn fp4_runs(ty: u32, k: u64, m: u64, n: u64, w: u64, x: u64) -> Option<RunsPlan> {
    let fits = !fp4_runs_off()
        && ty == TYPE_ROCMFP4
        && n == 1
        && m >= 4096
        && (m >= 16384 || k >= 2048)
        && k.is_multiple_of(256)
        && k <= FP4_RUNS_MAX_K
        && w.is_multiple_of(16)
        && x.is_multiple_of(16);
    fits.then(|| fp4_mma_plan(k, fp4_plain_plan(m, k), fp4_mma_threads()))
}

/// [`RunsPlan`] of `matvec_fp4_runs_q8_id` for one token's grouped product (`tokens` ==
/// 1; more go to MMQ or, with `MOE_GPU_EXACT_PREFILL=1`, keep f32 activations) of
/// `pairs` products of `[k, m]` ROCmFP4 weights each (the output projection's groups),
/// from the rows of all the pairs; None as [`fp4_runs`]. Under 16384 rows in all, two
/// rows a thread and 512 threads: on the output projection (8 groups of 4096 x 1024;
/// scripts/device/dense_matvec_bench.sh, 20:09 UTC) 12.3 us against 17.2 on
/// `matvec_dense_rows_id` (15.1 at four rows a block) and 15.1 at one row, 256 threads.
pub fn fp4_runs_id(
    ty: u32,
    k: u64,
    m: u64,
    pairs: u64,
    tokens: u64,
    w: u64,
    x: u64,
) -> Option<RunsPlan> {
    let all = m * pairs;
    fp4_runs(ty, k, all, tokens, w, x).map(|p| {
        if all < 16384 && !p.mma {
            RunsPlan {
                rows: if fp4_b2() { 1 } else { 2 },
                threads: 512,
                mma: false,
            }
        } else {
            p
        }
    })
}

/// Threads of `matvec_fp4_runs_q8` sharing a row: the largest power of two <= min(k / 256,
/// 32) (fp4_runs_lanes in the kernel); a block of `threads` covers rows * threads / that
/// rows.
pub fn fp4_runs_rows_per_block(k: u64, plan: RunsPlan) -> u64 {
    if plan.mma {
        return 16 * plan.rows;
    }
    let mut l = 1;
    while 2 * l <= k / 256 && l < 32 {
        l *= 2;
    }
    plan.rows * plan.threads / l
}

/// Dynamic shared memory of a runs-kernel launch (`matvec_fp4_runs_q8*`) of `plan` on
/// rows of `row_bytes`: a block's rows, for the kernel's bulk path, where the device
/// gives that much ([`Gpu::bulk_smem`]); else 0, the register path (the same sums).
pub fn fp4_runs_smem(gpu: &impl Gpu, k: u64, plan: RunsPlan, row_bytes: u64) -> u32 {
    let bytes = fp4_runs_rows_per_block(k, plan) * row_bytes;
    match plan.mma || bytes > gpu.bulk_smem() as u64 {
        true => 0,
        false => bytes as u32,
    }
}

/// Rows per 128-thread block of `matvec_dense_rows` for one column of `ty` weights with
/// `m` rows at address `x` of the activations, or None where `matvec_dense` runs: other
/// types, under 32 rows, activations not 16-byte aligned. Four rows from 8192 rows up,
/// two from 256, else one (measured: scripts/device/dense_matvec_bench.sh; the 64-row
/// indexer projection took 11.7 us a launch on `matvec_dense`, ncu 15:31).
pub fn dense_rows(ty: u32, m: u64, n: u64, x: u64) -> Option<u64> {
    let fits = !dense_rows_off()
        && n == 1
        && matches!(ty, TYPE_Q8_0 | TYPE_ROCMFP4)
        && m >= 32
        && x.is_multiple_of(16);
    fits.then_some(match m {
        8192.. => 4,
        256.. => 2,
        _ => 1,
    })
}

/// Rows per 128-thread block of `matvec_dense_cols` for `n` (2 - 15) f32 columns of `ty`
/// weights (a drafted pass's products below the matrix-unit tiles), or None where
/// `matvec_dense` runs: the types and alignment of [`dense_rows`]. Eight rows (each
/// activation load serving more rows) for up to 4 columns from 2048 rows up, else four;
/// `MOE_GPU_DENSE_COLS=0` keeps `matvec_dense`, `MOE_GPU_DENSE_COLS=4|8` forces those
/// rows a block where 8 may run (read once; A/B runs).
pub fn dense_cols(ty: u32, m: u64, n: u64, x: u64) -> Option<u64> {
    static SET: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let set = SET.get_or_init(|| std::env::var("MOE_GPU_DENSE_COLS").ok());
    let fits = set.as_deref() != Some("0")
        && (2..MMQ_MIN_COLS).contains(&n)
        && matches!(ty, TYPE_Q8_0 | TYPE_ROCMFP4)
        && m >= 32
        && x.is_multiple_of(16);
    let eight = n <= 4
        && match set.as_deref() {
            Some("8") => true,
            Some("4") => false,
            _ => m >= 2048,
        };
    fits.then_some(if eight { 8 } else { 4 })
}

/// The runs-kernel plan of `matvec_fp4_runs_q8_cols` for `n` (2 - 15) columns of ROCmFP4
/// weights: where one column takes the runs kernel (`fp4_runs`) and each thread has one
/// run a row (k / 256 a power of two), its rows and threads on the register path (the
/// matrix-unit variant's plan falls back to the plain one). Other k the runs kernel takes
/// (1280, 3072, ...: several runs a thread) go to `matvec_dense_cols`, whose f32
/// activations give other bits than a decode step's q8_1 ones (none of V4-Flash's). `MOE_GPU_RUNS_COLS=0` (read
/// once) leaves these products to `matvec_dense_cols` (A/B runs).
pub fn fp4_runs_cols(ty: u32, k: u64, m: u64, n: u64, w: u64, x: u64) -> Option<RunsPlan> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_RUNS_COLS"));
    if off || !(2..MMQ_MIN_COLS).contains(&n) || !(k / 256).is_power_of_two() {
        return None;
    }
    let one = fp4_runs(ty, k, m, 1, w, x)?;
    Some(match one.mma {
        false => one,
        true => fp4_plain_plan(m, k),
    })
}

/// Warps sharing one row of the dense mat-vec: enough warps in all (~8192) for few-row
/// products, each with at least two 256-value groups.
pub fn dense_parts(m: u64, k: u64) -> u64 {
    let mut parts = 1;
    while parts < 8 && m * parts < 8192 && k >= parts * 512 {
        parts *= 2;
    }
    parts
}

/// `dense_parts` for `n` columns: with `MOE_GPU_DENSE_WIDE=1` (staged for an A/B, not yet
/// measured) a product of many columns (a prefill chunk's mHC mixes, router) halves the
/// warps a row while the grid keeps 256 blocks or more: each block reads its 8 columns
/// of x once per row it takes, so fewer rows a block re-read x from L2 more often (24
/// rows of 16384 over 512 columns: 768 MB at 8 warps a row, 192 MB at 2).
pub fn dense_parts_cols(m: u64, k: u64, n: u64) -> u64 {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var_os("MOE_GPU_DENSE_WIDE").is_some_and(|v| v == "1"));
    let mut parts = dense_parts(m, k);
    if on && n > 8 {
        while parts > 1 && m.div_ceil(16 / parts) * n.div_ceil(8) >= 256 {
            parts /= 2;
        }
    }
    parts
}

pub fn matmul_dense(
    args: &[TensorRef],
    mmq: &str,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<Option<DenseMatmul>, String> {
    let [w, x, out] = three(args, "matmul")?;
    let (k, m) = (w.dims[0], w.dims[1] * w.dims[2] * w.dims[3]);
    let Some(row_bytes) = dense_row_bytes(w.type_id, k) else {
        return Ok(None);
    };
    let row_bytes = row_bytes?;
    expect(&x, types::F32, "matmul input")?;
    expect(&out, types::F32, "matmul output")?;
    if k == 0 || !x.numel().is_multiple_of(k) {
        return Err(format!(
            "matmul: input of {} values is not columns of {k}",
            x.numel()
        ));
    }
    let n = x.numel() / k;
    if out.numel() != m * n {
        return Err(format!(
            "matmul: output holds {} values, expected {m} x {n}",
            out.numel()
        ));
    }
    let (pw, px, po) = (ptr(&w, dense_align(w.type_id))?, ptr(&x, 4)?, ptr(&out, 4)?);
    let parts = dense_parts_cols(m, k, n);
    let one_col = (
        fp4_runs(w.type_id, k, m, n, pw, px),
        dense_rows(w.type_id, m, n, px),
    );
    let layout = match one_col {
        _ if (n >= MMQ_MIN_COLS || (n > 1 && few_cols_mmq())) && mmq_type(w.type_id, k, mmq) => {
            DenseLayout::Mmq
        }
        (Some(r), _) => DenseLayout::Fp4Runs(r),
        (None, Some(r)) => DenseLayout::Rows(r as i32),
        // 2 - 15 columns: the columns kernels; else the f32 and generic layouts.
        (None, None) => match (
            fp4_runs_cols(w.type_id, k, m, n, pw, px),
            dense_cols(w.type_id, m, n, px),
        ) {
            (Some(r), _) => DenseLayout::Fp4RunsCols(r),
            (None, Some(r)) => DenseLayout::Cols(r as i32),
            _ if f32_wide(w.type_id, k, m, n, pw, px) => DenseLayout::F32Wide,
            _ => match f32_tiles(w.type_id, k, m, n, pw, px) {
                Some((slices, span)) => DenseLayout::F32Tiles { slices, span },
                None => DenseLayout::Warps(parts as i32),
            },
        },
    };
    let launch = match layout {
        DenseLayout::Rows(r) => Launch {
            name: "matvec_dense_rows",
            grid: (to_i32(m.div_ceil(r as u64), "m")? as u32, 1, 1),
            block: 128,
        },
        DenseLayout::Fp4RunsCols(r) => Launch {
            name: "matvec_fp4_runs_q8_cols",
            grid: (
                to_i32(m.div_ceil(fp4_runs_rows_per_block(k, r)), "m")? as u32,
                1,
                1,
            ),
            block: r.threads as u32,
        },
        DenseLayout::Cols(r) => Launch {
            name: "matvec_dense_cols",
            grid: (
                to_i32(m.div_ceil(r as u64), "m")? as u32,
                to_i32(n.div_ceil(8), "n / 8")? as u32,
                1,
            ),
            block: 128,
        },
        DenseLayout::Fp4Runs(r) => Launch {
            name: r.kernel(false),
            grid: (
                to_i32(m.div_ceil(fp4_runs_rows_per_block(k, r)), "m")? as u32,
                1,
                1,
            ),
            block: r.threads as u32,
        },
        DenseLayout::F32Wide => Launch {
            name: "matvec_f32_wide",
            grid: (m as u32, 1, 1),
            block: 1024,
        },
        DenseLayout::F32Tiles { slices, .. } => Launch {
            name: "matmul_f32_tiles",
            grid: (
                to_i32(m.div_ceil(F32_TILE.0), "m")? as u32,
                to_i32(n.div_ceil(F32_TILE.1), "n")? as u32,
                slices as u32,
            ),
            block: 256,
        },
        DenseLayout::Mmq => {
            let (bm, bn) = (mmq_tile(MMQ_MMA).0, mmq_dense_cols(m, n));
            Launch {
                name: "mmq_mma_dense",
                grid: (
                    to_i32(m.div_ceil(bm), "m")? as u32,
                    to_i32(n.div_ceil(bn), "n")? as u32,
                    1,
                ),
                block: 256,
            }
        }
        DenseLayout::Warps(_) => Launch {
            name: "matvec_dense",
            grid: (
                to_i32(m.div_ceil(8 / parts), "m")? as u32,
                to_i32(n.div_ceil(8), "n / 8")? as u32,
                1,
            ),
            block: 256,
        },
    };
    Ok(Some(DenseMatmul {
        w: pw,
        row_bytes: row_bytes as i64,
        ty: w.type_id as i32,
        k: to_i32(k, "k")?,
        m: to_i32(m, "m")?,
        x: px,
        n: to_i32(n, "n")?,
        out: po,
        layout,
        launch,
    }))
}

/// Forces 8-bit activations on the decode products (`matvec_dense_q8_multi`) as
/// `MOE_GPU_Q8_DECODE=1` does (device tests; off by default).
pub static FORCE_Q8_DECODE: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether one column's Q8_0 / ROCmFP4 products (the ones `matvec_dense_rows` would run)
/// take q8_1 activations, quantised once per input, on `matvec_dense_q8_multi`:
/// `MOE_GPU_Q8_DECODE=1` (read once) or [`FORCE_Q8_DECODE`]. Off by default: f32
/// activations in decode until measured end to end.
pub fn q8_decode() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCE_Q8_DECODE.load(std::sync::atomic::Ordering::Relaxed)
        || *ON.get_or_init(|| std::env::var("MOE_GPU_Q8_DECODE").is_ok_and(|v| v == "1"))
}

/// Rows a block of `matvec_dense_q8_multi` for a product of `m` rows: two from 4096 rows,
/// else one (the bench's 8-bit candidate, 14:29: one row was fastest up to 2048 rows,
/// two on `wo_b`).
pub fn q8_rows(m: u64) -> i32 {
    if m >= 4096 {
        2
    } else {
        1
    }
}

/// Most products one `matvec_dense_rows_multi` launch takes (DENSE_MULTI_MAX in
/// kernels/gpu/rocmfpx.cu).
pub const DENSE_MULTI_MAX: usize = 8;

/// `matvec_dense_rows_multi`'s parameter block (`struct dense_multi` in rocmfpx.cu,
/// field for field): product i's weights, output, rows, first block and rows a block.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DenseMulti {
    pub w: [u64; DENSE_MULTI_MAX],
    pub out: [u64; DENSE_MULTI_MAX],
    pub m: [i32; DENSE_MULTI_MAX],
    pub first: [i32; DENSE_MULTI_MAX],
    pub rows: [i32; DENSE_MULTI_MAX],
    pub n: i32,
}

/// One step of a MATMUL_MULTI plan.
#[derive(Debug, PartialEq)]
pub enum MultiStep {
    /// The products `pairs` (indices among the op's pairs) in one
    /// `matvec_dense_rows_multi` launch, or with `q8` one `matvec_dense_q8_multi` launch
    /// on the op's one q8_1 quantisation of x, or for `n` > 1 columns (a drafted pass)
    /// one `matvec_dense_cols_multi` launch.
    Fused {
        p: Box<DenseMulti>,
        row_bytes: i64,
        ty: i32,
        k: i32,
        x: u64,
        n: i32,
        q8: bool,
        pairs: Vec<usize>,
        launch: Launch,
    },
    /// Pair i as its own MATMUL.
    Single(usize),
}

/// MATMUL_MULTI (args: x, then (w, out) pairs): every product is checked as MATMUL
/// checks it; those that would run `matvec_dense_rows` with the same type, k and row
/// length share `matvec_dense_rows_multi` launches (at most DENSE_MULTI_MAX each, each
/// product with the rows a block its own MATMUL takes: the same sums), the rest run
/// alone. With `q8` ([`q8_decode`]) those products all take `matvec_dense_q8_multi`
/// instead, a lone one too, on one quantisation of x ([`q8_rows`] rows a block).
pub fn matmul_multi(
    args: &[TensorRef],
    mmq: &str,
    q8: bool,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<Vec<MultiStep>, String> {
    if args.len() < 3 || args.len().is_multiple_of(2) {
        return Err(format!(
            "matmul_multi: expected x and (w, out) pairs, got {} tensor arguments",
            args.len()
        ));
    }
    let x = args[0];
    // (type, k, row bytes, columns) -> pairs that take matvec_dense_rows (one column) or
    // matvec_dense_cols, in order.
    type Group = ((i32, i32, i64, i32), Vec<(usize, DenseMatmul)>);
    let mut groups: Vec<Group> = Vec::new();
    let mut steps = Vec::new();
    for (i, pair) in args[1..].chunks_exact(2).enumerate() {
        let plan = matmul_dense(&[pair[0], x, pair[1]], mmq, &mut ptr)
            .map_err(|e| format!("matmul_multi, product {i}: {e}"))?;
        match plan {
            Some(p) if matches!(p.layout, DenseLayout::Rows(_) | DenseLayout::Cols(_)) => {
                let key = (p.ty, p.k, p.row_bytes, p.n);
                match groups.iter_mut().find(|g| g.0 == key) {
                    Some(g) => g.1.push((i, p)),
                    None => groups.push((key, vec![(i, p)])),
                }
            }
            _ => steps.push(MultiStep::Single(i)),
        }
    }
    for ((ty, k, row_bytes, n), members) in groups {
        // (q8 is the one-column decode's: the columns' kernel keeps f32 activations)
        let q8 = q8 && n == 1;
        for chunk in members.chunks(DENSE_MULTI_MAX) {
            if let ([(i, _)], false) = (chunk, q8) {
                steps.push(MultiStep::Single(*i));
                continue;
            }
            let mut p = DenseMulti {
                n: chunk.len() as i32,
                ..DenseMulti::default()
            };
            let mut blocks = 0u64;
            for (j, (_, d)) in chunk.iter().enumerate() {
                let (DenseLayout::Rows(rows) | DenseLayout::Cols(rows)) = d.layout else {
                    unreachable!("grouped by layout")
                };
                let rows = if q8 { q8_rows(d.m as u64) } else { rows };
                p.w[j] = d.w;
                p.out[j] = d.out;
                p.m[j] = d.m;
                p.rows[j] = rows;
                p.first[j] = to_i32(blocks, "blocks")?;
                blocks += (d.m as u64).div_ceil(rows as u64);
            }
            steps.push(MultiStep::Fused {
                p: Box::new(p),
                row_bytes,
                ty,
                k,
                x: chunk[0].1.x,
                n,
                q8,
                pairs: chunk.iter().map(|(i, _)| *i).collect(),
                launch: Launch {
                    name: match (q8, n > 1) {
                        (true, _) => "matvec_dense_q8_multi",
                        (false, true) => "matvec_dense_cols_multi",
                        (false, false) => "matvec_dense_rows_multi",
                    },
                    grid: (to_i32(blocks, "blocks")? as u32, (n as u32).div_ceil(8), 1),
                    block: 128,
                },
            });
        }
    }
    Ok(steps)
}

/// MATMUL of type-107 weights `[k, m]` with `n` f32 columns: quantise the input into
/// `q8_bytes` of scratch, then MMVQ (n <= 8) or MMQ (`n_cols` is set: the MMQ
/// kernels' extra argument).
#[derive(Debug, PartialEq, Eq)]
pub struct Matmul {
    pub w: u64,
    pub x: u64,
    pub out: u64,
    pub k: u64,
    pub n: u64,
    pub q8_bytes: usize,
    pub blocks: i32,
    pub m: i32,
    pub affine: i32,
    pub n_cols: Option<i32>,
    pub launch: Launch,
}

/// Rows per warp of the MMVQ kernel for `n` columns on `backend` (RF_MMVQ_ROWS in
/// rocmfpx.cu: HIP keeps 2 rows past 4 columns, where 4 spill on gfx11).
pub fn mmvq_rows_per_warp(n: u64, backend: &str) -> u64 {
    match n {
        1 => 4,
        2..=4 => 2,
        _ if backend == "hip" => 2,
        _ => 4,
    }
}

/// Tile (rows, columns) of an MMQ kernel: 128 x 64 (mmq_mma_107), 64 x 32
/// (mmq_dp4a_107).
pub fn mmq_tile(name: &str) -> (u64, u64) {
    if name == MMQ_MMA {
        (128, 64)
    } else {
        (64, 32)
    }
}

/// `mmq` is the MMQ kernel this device runs (used for more than 8 columns).
pub fn matmul(
    args: &[TensorRef],
    backend: &str,
    mmq: &'static str,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<Matmul, String> {
    let [w, x, out] = three(args, "matmul")?;
    expect(
        &w,
        TYPE_Q2_0_ROCMFP2,
        &format!("matmul weights (the {backend} backend runs type 107)"),
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
    let (pw, px, po) = (ptr(&w, 2)?, ptr(&x, 4)?, ptr(&out, 4)?);
    let q8_bytes = (n * k / 32 * Q8_BYTES) as usize;
    let blocks = to_i32(k / 32, "k / 32")?;
    let mm = to_i32(m, "m")?;
    let a = affine(&w)?;
    let (n_cols, launch) = if n <= 8 {
        // 4 warps per block.
        let grid = (m.div_ceil(4 * mmvq_rows_per_warp(n, backend)) as u32, 1, 1);
        let name = crate::kernels::KERNELS[n as usize];
        (
            None,
            Launch {
                name,
                grid,
                block: 128,
            },
        )
    } else {
        let nn = to_i32(n, "n")?;
        let (bm, bn) = mmq_tile(mmq);
        let grid = (m.div_ceil(bm) as u32, n.div_ceil(bn) as u32, 1);
        (
            Some(nn),
            Launch {
                name: mmq,
                grid,
                block: 256,
            },
        )
    };
    Ok(Matmul {
        w: pw,
        x: px,
        out: po,
        k,
        n,
        q8_bytes,
        blocks,
        m: mm,
        affine: a,
        n_cols,
        launch,
    })
}

/// Where the grouped mat-vec's scratch parts lie, as offsets from the region's start
/// (q8 activations at 0, 256-byte aligned parts after it, 16-byte aligned lists).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdLayout {
    /// Bytes to request for the whole region.
    pub bytes: usize,
    /// Per-expert offsets (`experts + 2` i32).
    pub offsets: u64,
    /// Active experts (`experts + 2` i32).
    pub active: u64,
    /// Pair ids sorted by expert (`pairs` i32).
    pub sorted: u64,
}

/// The scratch layout of MATMUL_ID for `x_cols` input columns of `k` values,
/// `experts` experts and `pairs` (slot, token) pairs.
pub fn id_layout(x_cols: u64, k: u64, experts: u64, pairs: u64) -> IdLayout {
    let q8_bytes = (x_cols * k / 32 * Q8_BYTES).next_multiple_of(256);
    let list_bytes = (experts + 2) * 4;
    let offsets = q8_bytes;
    let active = offsets + list_bytes.next_multiple_of(16);
    let sorted = active + list_bytes.next_multiple_of(16);
    IdLayout {
        bytes: (q8_bytes + 2 * list_bytes + pairs * 4 + 256) as usize,
        offsets,
        active,
        sorted,
    }
}

/// MATMUL_ID ([`OP_MATMUL_ID`]): quantise `x_cols` input columns into the scratch
/// (`layout`), sort the pairs by expert (`sort`), then the grouped mat-vec (`grouped`).
#[derive(Debug, PartialEq, Eq)]
pub struct MatmulId {
    pub w: u64,
    pub x: u64,
    pub ids: u64,
    pub out: u64,
    pub k: u64,
    pub x_cols: u64,
    pub layout: IdLayout,
    pub pairs: i32,
    pub experts: i32,
    pub blocks: i32,
    pub m: i32,
    pub slots: i32,
    /// Bytes of one expert's weights, and of one row.
    pub expert_bytes: i64,
    pub row_bytes: i64,
    /// Weight type id (107, or Q8_0 / ROCmFP4 on `mmq_mma_id`).
    pub ty: i32,
    /// 1 when x has one column per pair, 0 when per token.
    pub per_pair: i32,
    pub affine: i32,
    /// `moe_sort`, or None for one token (`mmvq_id_107` reads the ids itself).
    pub sort: Option<Launch>,
    pub grouped: Launch,
}

/// One step of a MATMUL_ID_MULTI plan.
#[derive(Debug, PartialEq)]
pub enum IdMultiStep {
    /// Products a and b (indices among the op's pairs) of one token in one
    /// `mmvq_id_107` launch (grid z = 2) on one quantisation of x: same shapes and
    /// variant, b's weights and outputs at `w_step` / `out_step` bytes from a's.
    Pair {
        plan: Box<MatmulId>,
        pairs: (usize, usize),
        w_step: i64,
        out_step: i64,
    },
    /// Pair i as its own MATMUL_ID.
    Single(usize),
}

/// MATMUL_ID_MULTI (args: x, ids, then (w, out) pairs): every product checked as
/// MATMUL_ID checks it; consecutive one-token type-107 products of the same shape share
/// a launch two at a time, the rest run alone.
pub fn matmul_id_multi(
    args: &[TensorRef],
    mmq: &str,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<Vec<IdMultiStep>, String> {
    if args.len() < 4 || !args.len().is_multiple_of(2) {
        return Err(format!(
            "matmul_id_multi: expected x, ids and (w, out) pairs, got {} tensor arguments",
            args.len()
        ));
    }
    let (x, ids) = (args[0], args[1]);
    let mut plans = Vec::new();
    for (i, pair) in args[2..].chunks_exact(2).enumerate() {
        let a = [pair[0], x, ids, pair[1]];
        // Dense weights of one token take their own kernels (`ds4::matmul_id_dense`).
        let fused = pair[0].type_id == TYPE_Q2_0_ROCMFP2 && !id_takes_mmq(&a, mmq);
        let plan = if fused {
            Some(
                matmul_id(&a, mmq, &mut ptr)
                    .map_err(|e| format!("matmul_id_multi, product {i}: {e}"))?,
            )
        } else {
            None
        };
        plans.push(plan.filter(|p| p.sort.is_none()));
    }
    // What two products must share to run as one launch (x and ids are the op's).
    let shape = |p: &MatmulId| {
        let ints = [
            p.blocks, p.m, p.pairs, p.experts, p.affine, p.per_pair, p.slots,
        ];
        (p.k, p.expert_bytes, ints)
    };
    let same = |a: &MatmulId, b: &MatmulId| shape(a) == shape(b);
    let mut steps = Vec::new();
    let mut i = 0;
    while i < plans.len() {
        match (&plans[i], plans.get(i + 1)) {
            (Some(a), Some(Some(b))) if same(a, b) => {
                let (w_step, out_step) = (
                    b.w.wrapping_sub(a.w) as i64,
                    b.out.wrapping_sub(a.out) as i64,
                );
                let mut plan = Box::new(plans[i].take().expect("matched above"));
                plan.grouped.grid.2 = 2;
                steps.push(IdMultiStep::Pair {
                    plan,
                    pairs: (i, i + 1),
                    w_step,
                    out_step,
                });
                i += 2;
            }
            _ => {
                steps.push(IdMultiStep::Single(i));
                i += 1;
            }
        }
    }
    Ok(steps)
}

/// MATMUL_ID_MULTI's arguments without xq, and xq (i[0] = 1, ABI 1.10: x's q8_1 blocks
/// as HC_POST_PRE stored them, the third argument).
fn id_multi_xq(
    args: &[TensorRef],
    p: &OpParams,
) -> Result<(Vec<TensorRef>, Option<TensorRef>), String> {
    if p.i[0] == 0 {
        return Ok((args.to_vec(), None));
    }
    match args {
        [x, ids, xq, rest @ ..] => {
            expect(xq, types::I32, "matmul_id_multi xq")?;
            let mut v = vec![*x, *ids];
            v.extend_from_slice(rest);
            Ok((v, Some(*xq)))
        }
        _ => Err(format!(
            "matmul_id_multi: expected x, ids, xq and (w, out) pairs, got {} tensor arguments",
            args.len()
        )),
    }
}

/// Whether xq holds a one-token plan's q8_1 blocks in the order its kernel reads
/// (`mmvq_id_107`: planes), so the plan may skip its quantisation.
pub(crate) fn xq_fits(xq: &TensorRef, p: &MatmulId) -> bool {
    rf2_planes(p.grouped.name) == 1
        && p.per_pair == 0
        && p.x_cols == 1
        && xq.numel() * 4 >= p.k / 32 * Q8_BYTES
}

/// 1 when MATMUL_ID's input has a column per (slot, token) pair, 0 when per token.
pub fn id_input(x: &TensorRef, k: u64, n_tok: u64, pairs: u64) -> Result<i32, String> {
    if x.numel() == k * n_tok {
        Ok(0)
    } else if x.numel() == k * pairs {
        Ok(1)
    } else {
        Err(format!(
            "matmul_id: input of {} values is neither {n_tok} nor {pairs} columns of {k}",
            x.numel()
        ))
    }
}

/// `mmq` is the device's MMQ kernel: with enough pairs ([`id_takes_mmq`]) the grouped
/// product runs `mmq_mma_id`, one token (a decode step) or a drafted pass's few
/// ([`id_nosort`]) `mmvq_id_107` with no sort (`MOE_GPU_ID_NOSORT=0`: the sorted kernel,
/// for A/B runs), else `mmvq_grouped_107`.
/// Weights: type 107, or Q8_0 / ROCmFP4 when they take the MMQ tiles (the dense kernels
/// run them otherwise).
pub fn matmul_id(
    args: &[TensorRef],
    mmq: &str,
    mut ptr: impl FnMut(&TensorRef, u64) -> Result<u64, String>,
) -> Result<MatmulId, String> {
    let [w, x, ids, out]: [TensorRef; 4] = args
        .try_into()
        .map_err(|_| format!("matmul_id: expected 4 tensor arguments, got {}", args.len()))?;
    let tiles = id_takes_mmq(args, mmq);
    if !(tiles && matches!(w.type_id, TYPE_Q8_0 | TYPE_ROCMFP4)) {
        expect(&w, TYPE_Q2_0_ROCMFP2, "matmul_id weights")?;
    }
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
    let per_pair = id_input(&x, k, n_tok, pairs)?;
    if out.numel() != m * pairs {
        return Err(format!(
            "matmul_id: output holds {} values, expected {m} x {pairs}",
            out.numel()
        ));
    }
    let (pw, px, pi, po) = (ptr(&w, 2)?, ptr(&x, 4)?, ptr(&ids, 4)?, ptr(&out, 4)?);
    let (row_bytes, affine) = match dense_row_bytes(w.type_id, k) {
        Some(rb) => (rb?, 0),
        None => (k / 32 * BLOCK_BYTES, affine(&w)?),
    };
    let grouped = if tiles {
        let (bm, _) = mmq_tile(MMQ_MMA);
        Launch {
            name: "mmq_mma_id",
            grid: (m.div_ceil(bm) as u32, pairs.min(experts) as u32 + 1, 1),
            block: 256,
        }
    } else if id_nosort(n_tok, pairs, experts) {
        Launch {
            name: "mmvq_id_107",
            // 4 warps x id_rows() rows per block, a block row per pair.
            grid: (
                m.div_ceil(4 * id_rows()) as u32,
                to_i32(pairs, "pairs")? as u32,
                1,
            ),
            block: 128,
        }
    } else {
        Launch {
            name: "mmvq_grouped_107",
            // 4 warps x RF_GROUPED_ROWS (1) rows per block.
            grid: (m.div_ceil(4) as u32, pairs.min(experts) as u32 + 1, 1),
            block: 128,
        }
    };
    Ok(MatmulId {
        w: pw,
        x: px,
        ids: pi,
        out: po,
        k,
        x_cols,
        layout: id_layout(x_cols, k, experts, pairs),
        pairs: to_i32(pairs, "pairs")?,
        experts: to_i32(experts, "experts")?,
        blocks: to_i32(k / 32, "k / 32")?,
        m: to_i32(m, "m")?,
        slots: to_i32(n_slots, "slots")?,
        expert_bytes: (m * row_bytes) as i64,
        row_bytes: row_bytes as i64,
        ty: w.type_id as i32,
        per_pair,
        affine,
        sort: (grouped.name != "mmvq_id_107").then_some(Launch {
            name: "moe_sort",
            grid: (1, 1, 1),
            block: 256,
        }),
        grouped,
    })
}

/// What a backend provides to run a planned op on one stream.
pub trait Gpu {
    /// Device pointer of a tensor, bounds-, device- and `align`-checked.
    fn ptr(&self, t: &TensorRef, align: u64) -> Result<u64, String>;
    /// The stream's scratch region, at least `bytes` long.
    fn scratch(&self, bytes: usize) -> Result<u64, String>;
    /// Launches `l` on the stream.
    ///
    /// # Safety
    /// `params` must match the kernel's signature, and every device pointer in them
    /// must be valid for what the kernel touches.
    unsafe fn launch(&self, l: Launch, params: &[*mut c_void]) -> Result<(), String>;
    /// Launches `l` with `smem` bytes of dynamic shared memory (at most
    /// [`Gpu::bulk_smem`]; 0: as [`Gpu::launch`]).
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    unsafe fn launch_smem(
        &self,
        l: Launch,
        smem: u32,
        params: &[*mut c_void],
    ) -> Result<(), String> {
        match smem {
            0 => self.launch(l, params),
            _ => Err(format!(
                "{}: this backend launches no dynamic shared memory ({smem} bytes asked)",
                l.name
            )),
        }
    }
    /// Bytes of dynamic shared memory a block of the ROCmFP4 runs kernels may take for
    /// its rows' bulk copies (sm_90's copy engine; see fp4_runs_q8_bulk in
    /// kernels/gpu/rocmfpx.cu); 0 where the device has none or they are off.
    fn bulk_smem(&self) -> u32 {
        0
    }
    /// Multiprocessors (CUDA SMs, AMD compute units) of the stream's device; 0 where
    /// unknown. Kernels whose blocks wait for each other launch only as many as this.
    fn multiprocessors(&self) -> u32 {
        0
    }
    /// Whether `l2_prefetch` asks the device's L2 for bytes (PREFETCH; CUDA sm_90's
    /// bulk prefetch). Where it does not, PREFETCH is "not supported".
    fn l2_prefetch(&self) -> bool {
        false
    }
    /// Whether prefill products of type 107 / ROCmFP4 with `cols` columns an expert (a
    /// dense product's all, a grouped one's on average) take the bf16 MMB tiles
    /// (`mmb_dense` / `mmb_id`: CUDA sm_80+, opt-in) instead of the int8 MMQ ones.
    fn bf16_tiles(&self, cols: u64) -> bool {
        let _ = cols;
        false
    }
    /// Bytes of dynamic shared memory the streamed bf16 tiles (`mmw_dense` / `mmw_id`:
    /// CUDA sm_80+, opt-in) may take where products take the bf16 tiles; 0 where they
    /// do not run (the products then take `mmb_dense` / `mmb_id`).
    fn bf16_streamed(&self) -> u32 {
        0
    }
    /// Bytes of dynamic shared memory the DS4 tensor-core prefill kernels may take
    /// (`ds4_attention_tc`, a chunk's attention, and `ds4_index_scores_mm_tcs` /
    /// `_tcs_bf16`, its indexer's scores: CUDA sm_80+); 0 where they do not run.
    fn ds4_tc_smem(&self) -> u32 {
        0
    }
    /// Rows a warp of the streamed bf16 tiles takes: 16 (`mmw_dense` / `mmw_id`, 256
    /// threads) or 32 (`mmw_dense_m2` / `mmw_id_m2`, 128 threads: each activation
    /// fragment feeds two products).
    fn bf16_streamed_rows(&self) -> u32 {
        16
    }
    /// Whether the backend launches `ds4_moe_routed` cooperatively (every block resident
    /// at once, so its blocks may wait for each other at grid barriers: MOE_ROUTED's one
    /// launch; CUDA).
    fn grid_sync(&self) -> bool {
        false
    }
}

/// Whether a product of weight type `ty` on MMQ tiles, `cols` columns an expert, takes the
/// bf16 tiles instead: the device runs them for that width, the type is 107 or ROCmFP4,
/// and the f32 input `x` is 16-byte aligned (the tiles load it four values at a time).
pub fn takes_mmb(gpu: &impl Gpu, ty: u32, x: u64, cols: u64) -> bool {
    matches!(ty, TYPE_Q2_0_ROCMFP2 | TYPE_ROCMFP4) && x.is_multiple_of(16) && gpu.bf16_tiles(cols)
}

/// The streamed bf16 tiles' shapes (kernels/gpu/rocmfpx.cu): rows a tile, k values a
/// stage, stages in flight, words a staged activation column.
const MMW_BM: u64 = 128;
const MMW_KS: u64 = 128;
const MMW_STAGES: u64 = 4;
const MMW_ALD: u64 = MMW_KS / 2 + 4;

/// Dynamic shared memory of a streamed bf16 tile launch whose widest tile is `bn`
/// columns (64 or 16) of weight type `ty` (107 or ROCmFP4): its stages' raw weight
/// blocks and bf16 activations (MMW_STAGES * mmw_stage_bytes in the kernel source).
pub fn mmw_smem(ty: u32, bn: u64) -> u32 {
    let block = if ty == TYPE_ROCMFP4 { 18 } else { BLOCK_BYTES };
    (MMW_STAGES * (MMW_BM * 4 * block + bn * MMW_ALD * 4)) as u32
}

/// Where a product that takes the bf16 tiles ([`takes_mmb`]) runs on their streamed
/// form: k is whole stages, the weights (at `w`) are 8-byte aligned for the stages'
/// copies, and the backend gives the launch room: for 64-column tiles, else (where
/// `cols`, a dense product's columns or a grouped one's average an expert, is at most
/// 16) for 16-column ones (a wider list then runs as narrow tiles, each weight streamed
/// again for each: where that would be the rule, the MMB tiles run instead). The
/// launch's dynamic shared memory, if so.
pub fn takes_mmw(gpu: &impl Gpu, ty: u32, k: u64, w: u64, cols: u64) -> Option<u32> {
    let room = gpu.bf16_streamed();
    if !k.is_multiple_of(MMW_KS) || !w.is_multiple_of(8) {
        return None;
    }
    [mmw_smem(ty, mmq_tile(MMQ_MMA).1), mmw_smem(ty, 16)]
        .into_iter()
        .enumerate()
        .find(|&(i, smem)| room >= smem && (i == 0 || cols <= 16))
        .map(|(_, smem)| smem)
}

/// `values` f32 at `x` (a multiple of 4, 16-byte aligned) as bf16 pairs at `dst`
/// (`f32_to_bf16`: the streamed tiles' activations, rounded as the MMB tiles round them).
///
/// # Safety
/// `x` and `dst` valid for `values` f32 and `values / 2` u32.
unsafe fn to_bf16(gpu: &impl Gpu, x: u64, values: u64, dst: u64) -> Result<(), String> {
    let (mut px, mut pd, mut quads) = (x, dst, (values / 4) as i64);
    let blocks = u32::try_from((values / 4).div_ceil(256))
        .map_err(|_| format!("f32_to_bf16: {values} values are too many for one launch"))?;
    let l = Launch {
        name: "f32_to_bf16",
        grid: (blocks, 1, 1),
        block: 256,
    };
    gpu.launch(l, &kargs!(px, quads, pd))
}

/// The streamed tiles' kernel (`one`: 16 rows a warp; `two`: 32) and block size for the
/// backend's [`Gpu::bf16_streamed_rows`].
fn mmw_kernel(gpu: &impl Gpu, one: &'static str, two: &'static str) -> (&'static str, u32) {
    match gpu.bf16_streamed_rows() {
        32 => (two, 128),
        _ => (one, 256),
    }
}

/// A dense product of `m` rows and `n` columns of type `ty` (`nb` blocks a row of
/// `row_bytes`) on the streamed bf16 tiles with `smem` bytes: x (`n` columns of f32) to
/// bf16 in the scratch, then `mmw_dense`.
///
/// # Safety
/// As [`Gpu::launch`]: a checked product's pointers.
#[allow(clippy::too_many_arguments)]
unsafe fn mmw_dense(
    gpu: &impl Gpu,
    (w, row_bytes, ty, nb): (u64, i64, i32, i32),
    (m, n): (i32, i32),
    (x, out, affine): (u64, u64, i32),
    smem: u32,
) -> Result<(), String> {
    let values = n as u64 * nb as u64 * 32;
    let mut xb = gpu.scratch((values * 2) as usize)?;
    to_bf16(gpu, x, values, xb)?;
    let (mut pw, mut rb, mut ty, mut nb, mut m, mut n) = (w, row_bytes, ty, nb, m, n);
    let (mut po, mut a) = (out, affine);
    let (name, block) = mmw_kernel(gpu, "mmw_dense", "mmw_dense_m2");
    let l = Launch {
        name,
        grid: (
            (n as u64).div_ceil(mmq_tile(MMQ_MMA).1) as u32,
            (m as u64).div_ceil(MMW_BM) as u32,
            1,
        ),
        block,
    };
    gpu.launch_smem(l, smem, &kargs!(pw, rb, ty, nb, m, n, xb, po, a))
}

/// The bf16 tiles' launch for a dense product of `m` rows and `n` columns.
pub fn mmb_dense_launch(m: u64, n: u64) -> Launch {
    let (bm, bn) = mmq_tile(MMQ_MMA);
    Launch {
        name: "mmb_dense",
        grid: (m.div_ceil(bm) as u32, n.div_ceil(bn) as u32, 1),
        block: 256,
    }
}

/// What one token's grouped product reads as its q8_1 input.
#[derive(Clone, Copy, Debug)]
enum IdInput {
    /// x, quantised into the scratch by a launch of its own.
    Quantise,
    /// SwiGLU(x, up) (x the gate; f32 the clamp), quantised as it is computed.
    Swiglu(u64, f32),
    /// Already quantised at this address (HC_POST_PRE's xq, ABI 1.10).
    Quantised(u64),
}

/// One token's MATMUL_ID (`p.sort` is None): x's q8_1 quantisation into scratch (or
/// `input`'s), then `mmvq_id_107` on `p.grouped`'s grid (z = 2: a second product
/// `w_step` / `out_step` bytes on, MATMUL_ID_MULTI).
///
/// # Safety
/// As [`Gpu::launch`]: `p` is a checked plan; a `Quantised` address holds x's blocks.
unsafe fn launch_id_one_token(
    gpu: &impl Gpu,
    p: &MatmulId,
    mut w_step: i64,
    mut out_step: i64,
    input: IdInput,
) -> Result<(), String> {
    let mut planes = rf2_planes(p.grouped.name);
    let mut pq = match input {
        IdInput::Quantised(at) => at,
        _ => gpu.scratch(p.layout.bytes)?,
    };
    let (q, mut n_blocks) = quantize(p.k, p.x_cols);
    let mut px = p.x;
    match input {
        IdInput::Quantised(_) => {}
        IdInput::Swiglu(mut up, mut lim) => gpu.launch(
            Launch {
                name: "quantize_q8_1_swiglu",
                ..q
            },
            &kargs!(px, up, lim, pq, n_blocks, planes),
        )?,
        IdInput::Quantise => gpu.launch(q, &kargs!(px, pq, n_blocks, planes))?,
    }
    let (mut pw, mut ebytes, mut nb, mut mm) = (p.w, p.expert_bytes, p.blocks, p.m);
    let (mut ne, mut pp, mut ns, mut pi) = (p.experts, p.per_pair, p.slots, p.ids);
    let (mut po, mut a, mut rows) = (p.out, p.affine, id_rows() as i32);
    gpu.launch(
        p.grouped,
        &kargs!(pw, ebytes, nb, mm, ne, pq, pp, ns, pi, po, a, rows, w_step, out_step),
    )
}

/// NORM_MATMUL (ABI 1.8): a one-token ROCmFP4 product on the runs kernel norms x itself
/// (`matvec_fp4_runs_q8_norm`); any other product runs on x normed into xn by NORM_ROPE's
/// kernel, as MATMUL runs it. Every argument is checked before anything launches (the
/// product's as MATMUL plans it).
fn norm_matmul(
    gpu: &impl Gpu,
    backend: &str,
    mmq: &'static str,
    p: &OpParams,
    a: &[TensorRef],
) -> Result<(), String> {
    let [w, x, g, out, xn]: [TensorRef; 5] = a
        .try_into()
        .map_err(|_| format!("norm_matmul: expected 5 tensor arguments, got {}", a.len()))?;
    let k = w.dims[0];
    expect(&g, types::F32, "norm_matmul weight")?;
    expect(&xn, types::F32, "norm_matmul normed input")?;
    // (the norm's kernel takes values in pairs)
    if k == 0 || !k.is_multiple_of(2) || !x.numel().is_multiple_of(k) {
        return Err(format!(
            "norm_matmul: an input of {} values is not columns of an even {k}",
            x.numel()
        ));
    }
    if g.numel() < k || xn.numel() < x.numel() {
        return Err(format!(
            "norm_matmul: weight of {} and normed input of {} values for rows of {k} and an input of {}",
            g.numel(),
            xn.numel(),
            x.numel()
        ));
    }
    let plan = matmul_dense(&[w, x, out], mmq, |t, al| gpu.ptr(t, al))?;
    if plan.is_none() {
        // Type 107 (or a type the backend lacks: refused here, before the norm).
        matmul(&[w, x, out], backend, mmq, |t, al| gpu.ptr(t, al))?;
    }
    let eps = p.f[0];
    let pg = gpu.ptr(&g, 4)?;
    let fused = plan.and_then(|pl| match pl.layout {
        DenseLayout::Fp4Runs(r)
            if pl.launch.name == "matvec_fp4_runs_q8"
                && pg.is_multiple_of(16)
                && !norm_mm_off() =>
        {
            Some((pl, r))
        }
        _ => None,
    });
    if let Some((pl, r)) = fused {
        let (mut pw, mut rb, mut kk, mut m, mut px, mut po) =
            (pl.w, pl.row_bytes, pl.k, pl.m, pl.x, pl.out);
        let (mut pg, mut eps, mut rows) = (pg, eps, r.rows as i32);
        let smem = fp4_runs_smem(gpu, k, r, rb as u64);
        let l = Launch {
            name: "matvec_fp4_runs_q8_norm",
            ..pl.launch
        };
        // SAFETY: matmul_dense checked w, x and out; g holds k values, 16-byte aligned.
        return unsafe { gpu.launch_smem(l, smem, &kargs!(pw, rb, kk, m, px, pg, eps, po, rows)) };
    }
    // NORM_ROPE's plain norm times g (no rotary: g stands in for its frequencies and
    // positions, which it then does not read), into xn.
    let n = x.numel() / k;
    let (x3, xn3) = (
        TensorRef {
            dims: [k, 1, n, 1],
            ..x
        },
        TensorRef {
            dims: [k, 1, n, 1],
            ..xn
        },
    );
    let mut pn = OpParams::default();
    (pn.f[0], pn.f[1], pn.i[0]) = (eps, 1.0, 2);
    crate::ds4::run(gpu, ops::NORM_ROPE, &pn, &[x3, g, g, g, xn3])
        .unwrap_or_else(|| Err("norm_matmul: no norm kernel".into()))?;
    let xn = TensorRef {
        dims: [k, n, 1, 1],
        ..xn
    };
    run(
        gpu,
        backend,
        mmq,
        ops::MATMUL,
        &OpParams::default(),
        &[w, xn, out],
    )
}

/// Bytes `l2_prefetch` asks for at once (its L2P_CHUNK).
const L2P_CHUNK: u64 = 16384;

/// PREFETCH (ABI 1.9): one `l2_prefetch` launch over the tensors' bytes (1 to 4, each
/// range checked as any op's). Its grid: a block of 32 a 64 chunks, at most 32 blocks,
/// so the copy engines of several multiprocessors take the requests.
fn prefetch(gpu: &impl Gpu, backend: &str, args: &[TensorRef]) -> Result<(), String> {
    if !gpu.l2_prefetch() {
        return Err(format!(
            "prefetch: not supported by the {backend} backend on this device"
        ));
    }
    if args.is_empty() || args.len() > 4 {
        return Err(format!(
            "prefetch: expected 1 to 4 tensors, got {}",
            args.len()
        ));
    }
    let mut slots = [0u64; 8];
    let mut chunks = 0;
    for (i, t) in args.iter().enumerate() {
        // (the bulk prefetch takes 16-byte units: a range's unaligned ends are left out,
        // not refused, as a hint should be)
        let (a, n) = (gpu.ptr(t, 1)?, bytes_of(t, backend)?);
        let start = a.next_multiple_of(16);
        slots[2 * i] = start;
        slots[2 * i + 1] = (a + n).saturating_sub(start) & !15;
        chunks += slots[2 * i + 1].div_ceil(L2P_CHUNK);
    }
    let params: Vec<*mut c_void> = slots
        .iter_mut()
        .map(|v| v as *mut u64 as *mut c_void)
        .collect();
    let blocks = chunks.div_ceil(64).clamp(1, 32);
    let l = Launch {
        name: "l2_prefetch",
        grid: (blocks as u32, 1, 1),
        block: 32,
    };
    // SAFETY: eight 64-bit slots as the kernel's (address, bytes) pairs, each range
    // checked by `ptr`; the kernel only asks for the bytes (no access is made).
    unsafe { gpu.launch(l, &params) }
}

/// `MOE_GPU_NORM_MM=0` runs NORM_MATMUL's norm as its own launch everywhere (A/B runs;
/// read once).
fn norm_mm_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| crate::ds4::env_off("MOE_GPU_NORM_MM"))
}

/// Runs `op` (MATMUL, MATMUL_ID / [`OP_MATMUL_ID`], MATMUL_MULTI, MATMUL_ID_MULTI, ADD,
/// GET_ROWS and the DeepSeek-V4 glue of [`crate::ds4`]) on `gpu`; `mmq` is the MMQ kernel the device
/// runs, `backend` names the backend in errors.
pub fn run(
    gpu: &impl Gpu,
    backend: &str,
    mmq: &'static str,
    op: u32,
    params: &OpParams,
    args: &[TensorRef],
) -> Result<(), String> {
    if op == ops::ROUTER && args.len() == ops::ROUTER_MM_ARGS {
        // The product first (as MATMUL takes it), in the router's launch where it is one
        // `matvec_f32_wide`. Every argument is checked before either form launches.
        let fused = crate::ds4::router_mm(gpu, params, args)?;
        let mm = [args[7], args[6], args[0]];
        let plan = matmul_dense(&mm, mmq, |t, a| gpu.ptr(t, a))?;
        if plan.is_some_and(|p| p.layout == DenseLayout::F32Wide) && !router_mm_off() {
            // SAFETY: matmul_dense checked the product's tensors, router_mm the rest.
            return unsafe { fused.launch(gpu) };
        }
        run(gpu, backend, mmq, ops::MATMUL, &OpParams::default(), &mm)?;
        return run(gpu, backend, mmq, op, params, &args[..6]);
    }
    if op == ops::NORM_MATMUL {
        return norm_matmul(gpu, backend, mmq, params, args);
    }
    if op == ops::MOE_ROUTED {
        return crate::moe_routed::run(gpu, backend, mmq, params, args);
    }
    if op == ops::PREFETCH {
        return prefetch(gpu, backend, args);
    }
    if let Some(r) = crate::ds4::run(gpu, op, params, args) {
        return r;
    }
    let op = if op == ops::MATMUL_ID {
        OP_MATMUL_ID
    } else {
        op
    };
    if op == OP_MATMUL_ID && !id_takes_mmq(args, mmq) {
        if let Some(r) = crate::ds4::matmul_id_dense(gpu, args, params.i[0] == 1) {
            return r;
        }
    }
    let ptr = |t: &TensorRef, a| gpu.ptr(t, a);
    // SAFETY (all launches): the plans check every tensor's range and size the
    // scratch; the parameter lists match the kernels' signatures.
    unsafe {
        match op {
            ops::MATMUL if args.first().is_some_and(|w| w.type_id != TYPE_Q2_0_ROCMFP2) => {
                let p = matmul_dense(args, mmq, ptr)?.ok_or_else(|| {
                    format!(
                        "matmul: weights of type {} are not supported by the {backend} backend",
                        args[0].type_id
                    )
                })?;
                let (mut pw, mut rb, mut ty, mut k, mut m) = (p.w, p.row_bytes, p.ty, p.k, p.m);
                let (mut px, mut n, mut po) = (p.x, p.n, p.out);
                match p.layout {
                    // One product of the 8-bit decode: MATMUL_MULTI's path.
                    DenseLayout::Rows(_) if q8_decode() => run(
                        gpu,
                        backend,
                        mmq,
                        ops::MATMUL_MULTI,
                        params,
                        &[args[1], args[0], args[2]],
                    ),
                    DenseLayout::Rows(mut rows) => {
                        gpu.launch(p.launch, &kargs!(pw, rb, ty, k, m, px, po, rows))
                    }
                    DenseLayout::Fp4RunsCols(r) => {
                        let mut rows = r.rows as i32;
                        gpu.launch(p.launch, &kargs!(pw, rb, k, m, px, n, po, rows))
                    }
                    DenseLayout::Cols(mut rows) => {
                        gpu.launch(p.launch, &kargs!(pw, rb, ty, k, m, px, n, po, rows))
                    }
                    DenseLayout::Fp4Runs(r) => {
                        let mut rows = r.rows as i32;
                        let smem = fp4_runs_smem(gpu, k as u64, r, rb as u64);
                        gpu.launch_smem(p.launch, smem, &kargs!(pw, rb, k, m, px, po, rows))
                    }
                    DenseLayout::F32Wide => gpu.launch(p.launch, &kargs!(pw, k, m, px, po)),
                    DenseLayout::F32Tiles { slices, span } => {
                        let mut span = to_i32(span, "span")?;
                        if slices == 1 {
                            return gpu.launch(p.launch, &kargs!(pw, k, m, px, n, span, po));
                        }
                        // Each slice's sums into scratch, then added in slice order.
                        let len = m as u64 * n as u64;
                        let mut part = gpu.scratch((slices * len * 4) as usize)?;
                        gpu.launch(p.launch, &kargs!(pw, k, m, px, n, span, part))?;
                        let (mut sl, mut ln) = (slices as i32, len as i64);
                        let reduce = Launch {
                            name: "matmul_f32_reduce",
                            grid: (to_i32(len.div_ceil(256), "m n")? as u32, 1, 1),
                            block: 256,
                        };
                        gpu.launch(reduce, &kargs!(part, sl, ln, po))
                    }
                    // (The bf16 tiles from MMQ_MIN_COLS on: fewer columns keep q8_1.)
                    DenseLayout::Mmq
                        if n as u64 >= MMQ_MIN_COLS && takes_mmb(gpu, ty as u32, px, n as u64) =>
                    {
                        let (mut nb, mut affine) = (k / 32, 0i32);
                        if let Some(smem) = takes_mmw(gpu, ty as u32, k as u64, pw, n as u64) {
                            return mmw_dense(gpu, (pw, rb, ty, nb), (m, n), (px, po, 0), smem);
                        }
                        let l = mmb_dense_launch(m as u64, n as u64);
                        gpu.launch(l, &kargs!(pw, rb, ty, nb, m, n, px, po, affine))
                    }
                    DenseLayout::Mmq => {
                        let (q, mut n_blocks) = quantize(k as u64, n as u64);
                        let mut pq = gpu.scratch(n_blocks as usize * Q8_BYTES as usize)?;
                        let mut planes = 0i32; // the MMQ tile reads values in order
                        gpu.launch(q, &kargs!(px, pq, n_blocks, planes))?;
                        let mut nb = k / 32;
                        let mut bn = mmq_dense_cols(m as u64, n as u64) as i32;
                        gpu.launch(p.launch, &kargs!(pw, rb, ty, nb, m, n, pq, po, bn))
                    }
                    DenseLayout::Warps(mut parts) => {
                        gpu.launch(p.launch, &kargs!(pw, rb, ty, k, m, px, n, po, parts))
                    }
                }
            }
            ops::MATMUL => {
                let p = matmul(args, backend, mmq, ptr)?;
                if let (Some(mut nn), true) = (p.n_cols, mmq == MMQ_MMA) {
                    if takes_mmb(gpu, TYPE_Q2_0_ROCMFP2, p.x, p.n) {
                        let (mut pw, mut px, mut po, mut a) = (p.w, p.x, p.out, p.affine);
                        let (mut nb, mut mm) = (p.blocks, p.m);
                        let mut rb = p.blocks as i64 * BLOCK_BYTES as i64;
                        let mut ty = TYPE_Q2_0_ROCMFP2 as i32;
                        if let Some(smem) = takes_mmw(gpu, TYPE_Q2_0_ROCMFP2, p.k, pw, p.n) {
                            let sizes = (mm, nn);
                            return mmw_dense(gpu, (pw, rb, ty, nb), sizes, (px, po, a), smem);
                        }
                        let l = mmb_dense_launch(p.m as u64, p.n);
                        return gpu.launch(l, &kargs!(pw, rb, ty, nb, mm, nn, px, po, a));
                    }
                }
                let mut pq = gpu.scratch(p.q8_bytes)?;
                let (q, mut n_blocks) = quantize(p.k, p.n);
                let mut px = p.x;
                let mut planes = rf2_planes(p.launch.name);
                gpu.launch(q, &kargs!(px, pq, n_blocks, planes))?;
                let (mut pw, mut nb, mut mm, mut po, mut a) = (p.w, p.blocks, p.m, p.out, p.affine);
                match p.n_cols {
                    None => gpu.launch(p.launch, &kargs!(pw, nb, mm, pq, po, a)),
                    Some(mut nn) => gpu.launch(p.launch, &kargs!(pw, nb, mm, nn, pq, po, a)),
                }
            }
            OP_MATMUL_ID => {
                let p = matmul_id(args, mmq, ptr)?;
                let Some(sort) = p.sort else {
                    return launch_id_one_token(gpu, &p, 0, 0, IdInput::Quantise);
                };
                let cols = (p.pairs / p.experts.max(1)) as u64;
                let mmb = p.grouped.name == "mmq_mma_id" && takes_mmb(gpu, p.ty as u32, p.x, cols);
                let mmw = mmb
                    .then(|| takes_mmw(gpu, p.ty as u32, p.k, p.w, cols))
                    .flatten();
                // The streamed tiles' bf16 columns go after the layout's lists (its q8_1
                // part unused then).
                let bf16_at = (p.layout.bytes as u64).next_multiple_of(256);
                let bf16_bytes = p.x_cols * p.k * 2;
                let base = gpu.scratch(match mmw {
                    Some(_) => (bf16_at + bf16_bytes) as usize,
                    None => p.layout.bytes,
                })?;
                let (mut px, mut pq) = (p.x, base);
                if mmw.is_some() {
                    to_bf16(gpu, px, p.x_cols * p.k, base + bf16_at)?;
                } else if !mmb {
                    let (q, mut n_blocks) = quantize(p.k, p.x_cols);
                    let mut planes = rf2_planes(p.grouped.name);
                    gpu.launch(q, &kargs!(px, pq, n_blocks, planes))?;
                }
                let mut poff = base + p.layout.offsets;
                let mut pact = base + p.layout.active;
                let mut psorted = base + p.layout.sorted;
                let (mut pi, mut np, mut ne) = (p.ids, p.pairs, p.experts);
                let (mut pw, mut ebytes, mut nb, mut mm) = (p.w, p.expert_bytes, p.blocks, p.m);
                let (mut pp, mut ns, mut po, mut a) = (p.per_pair, p.slots, p.out, p.affine);
                gpu.launch(sort, &kargs!(pi, np, ne, poff, pact, psorted))?;
                if p.grouped.name != "mmq_mma_id" {
                    return gpu.launch(
                        p.grouped,
                        &kargs!(pw, ebytes, nb, mm, ne, pq, pp, ns, poff, pact, psorted, po, a),
                    );
                }
                // The bf16 tiles read the f32 input itself (the streamed ones its bf16
                // columns), the int8 ones its q8_1.
                let (mut rb, mut ty) = (p.row_bytes, p.ty);
                let (name, mut act, smem, block) = match (mmb, mmw) {
                    (true, Some(smem)) => {
                        let (name, block) = mmw_kernel(gpu, "mmw_id", "mmw_id_m2");
                        (name, base + bf16_at, smem, block)
                    }
                    (true, None) => ("mmb_id", px, 0, p.grouped.block),
                    (false, _) => (p.grouped.name, pq, 0, p.grouped.block),
                };
                let l = Launch {
                    name,
                    block,
                    ..p.grouped
                };
                gpu.launch_smem(
                    l,
                    smem,
                    &kargs!(
                        pw, ebytes, rb, ty, nb, mm, ne, act, pp, ns, poff, pact, psorted, po, a
                    ),
                )
            }
            ops::SWIGLU_MATMUL_ID => {
                let [w, g, u, ids, out, act] = args else {
                    return Err(format!(
                        "swiglu_matmul_id: expected 6 tensor arguments, got {}",
                        args.len()
                    ));
                };
                if u.dims != g.dims || act.dims != g.dims {
                    return Err("swiglu_matmul_id: gate, up and act differ in shape".into());
                }
                if [g, u, act].iter().any(|t| t.type_id != types::F32) {
                    return Err("swiglu_matmul_id: gate, up and act must be F32".into());
                }
                let fused = if w.type_id == TYPE_Q2_0_ROCMFP2 {
                    Some(matmul_id(&[*w, *g, *ids, *out], mmq, ptr)?).filter(|p| p.sort.is_none())
                } else {
                    None
                };
                // (where MATMUL_ID would take the MMQ tiles, SWIGLU then MATMUL_ID run,
                // so the sums stay those of the two ops)
                if fused.is_none() && !id_takes_mmq(&[*w, *g, *ids, *out], mmq) {
                    if let Some(r) =
                        crate::ds4::swiglu_matmul_id_runs(gpu, w, g, u, ids, out, params)
                    {
                        return r;
                    }
                }
                match fused {
                    Some(p) => {
                        let up = ptr(u, 4)?;
                        launch_id_one_token(gpu, &p, 0, 0, IdInput::Swiglu(up, params.f[0]))
                    }
                    // Elsewhere the two ops it stands for.
                    None => {
                        run(gpu, backend, mmq, ops::SWIGLU, params, &[*g, *u, *act])?;
                        let d = OpParams::default();
                        run(
                            gpu,
                            backend,
                            mmq,
                            ops::MATMUL_ID,
                            &d,
                            &[*w, *act, *ids, *out],
                        )
                    }
                }
            }
            ops::MATMUL_MULTI => {
                let steps = matmul_multi(args, mmq, q8_decode(), ptr)?;
                // The 8-bit launches share one quantisation of x.
                let mut act = None;
                for step in steps {
                    match step {
                        MultiStep::Fused {
                            p,
                            mut row_bytes,
                            mut ty,
                            mut k,
                            mut x,
                            mut n,
                            q8,
                            launch,
                            ..
                        } => {
                            let mut p = *p;
                            if n > 1 {
                                gpu.launch(launch, &kargs!(p, row_bytes, ty, k, x, n))?;
                                continue;
                            }
                            if !q8 {
                                gpu.launch(launch, &kargs!(p, row_bytes, ty, k, x))?;
                                continue;
                            }
                            let mut pq = match act {
                                Some(pq) => pq,
                                None => {
                                    let (q, mut n_blocks) = quantize(k as u64, 1);
                                    let mut pq =
                                        gpu.scratch(n_blocks as usize * Q8_BYTES as usize)?;
                                    let mut planes = 0i32; // values in order
                                    gpu.launch(q, &kargs!(x, pq, n_blocks, planes))?;
                                    act = Some(pq);
                                    pq
                                }
                            };
                            gpu.launch(launch, &kargs!(p, row_bytes, ty, k, pq))?
                        }
                        MultiStep::Single(i) => run(
                            gpu,
                            backend,
                            mmq,
                            ops::MATMUL,
                            params,
                            &[args[1 + 2 * i], args[0], args[2 + 2 * i]],
                        )?,
                    }
                }
                Ok(())
            }
            ops::HC_POST_PRE => {
                let (args, route) = crate::ds4::hc_route_split(gpu, args, params)?;
                let routed = match crate::ds4::hc_post_pre(gpu, params, args, route.as_ref())? {
                    crate::ds4::PostPre::Launched { routed } => routed,
                    crate::ds4::PostPre::Parts(parts) => {
                        if let Some(post) = &parts.post {
                            run(gpu, backend, mmq, ops::HC_POST, params, post)?;
                        }
                        let d = OpParams::default();
                        run(gpu, backend, mmq, ops::MATMUL, &d, &parts.mix)?;
                        run(gpu, backend, mmq, ops::HC_PRE, params, &parts.pre)?;
                        if let Some(q) = parts.quant {
                            crate::ds4::quantize_into(gpu, q)?;
                        }
                        false
                    }
                };
                // The routing the site did not take: ROUTER after it.
                match route.filter(|_| !routed) {
                    Some(r) => run(gpu, backend, mmq, ops::ROUTER, &r.params, &r.args),
                    None => Ok(()),
                }
            }
            ops::MATMUL_ID_MULTI => {
                let (args, xq) = id_multi_xq(args, params)?;
                let xq = xq.map(|t| gpu.ptr(&t, 4).map(|at| (t, at))).transpose()?;
                for step in matmul_id_multi(&args, mmq, ptr)? {
                    match step {
                        IdMultiStep::Pair {
                            plan,
                            w_step,
                            out_step,
                            ..
                        } => {
                            let input = match xq {
                                Some((t, at)) if xq_fits(&t, &plan) => IdInput::Quantised(at),
                                _ => IdInput::Quantise,
                            };
                            launch_id_one_token(gpu, &plan, w_step, out_step, input)?
                        }
                        IdMultiStep::Single(i) => run(
                            gpu,
                            backend,
                            mmq,
                            ops::MATMUL_ID,
                            &OpParams::default(),
                            &[args[2 + 2 * i], args[0], args[1], args[3 + 2 * i]],
                        )?,
                    }
                }
                Ok(())
            }
            ops::ADD => {
                let p = add(args, ptr)?;
                let (mut pa, mut pb, mut po, mut n) = (p.a, p.b, p.out, p.n);
                gpu.launch(p.launch, &kargs!(pa, pb, po, n))
            }
            ops::GET_ROWS => {
                let p = get_rows(args, backend, ptr)?;
                let (mut pt, mut pi, mut r, mut c, mut po) =
                    (p.table, p.ids, p.rows, p.cols, p.out);
                match (p.affine, p.dense) {
                    (_, Some((mut rb, mut ty))) => {
                        gpu.launch(p.launch, &kargs!(pt, rb, ty, pi, r, c, po))
                    }
                    (None, None) => gpu.launch(p.launch, &kargs!(pt, pi, r, c, po)),
                    (Some(mut a), None) => gpu.launch(p.launch, &kargs!(pt, pi, r, c, po, a)),
                }
            }
            _ => Err(format!("op {op} is not supported by the {backend} backend")),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tensor of `type_id` and `dims` (type 107's affine variant where it applies).
    pub(crate) fn t(type_id: u32, dims: [u64; 4]) -> TensorRef {
        TensorRef {
            buffer: 1,
            offset: 0,
            type_id,
            variant: FP2_AFFINE,
            dims,
        }
    }

    /// Pointers 0x1000, 0x2000, ... in argument order.
    fn seq() -> impl FnMut(&TensorRef, u64) -> Result<u64, String> {
        let mut i = 0;
        move |_, _| {
            i += 1;
            Ok(i * 0x1000)
        }
    }

    #[test]
    fn matmul_multi_plans() {
        let x = t(types::F32, [4096, 1, 1, 1]);
        let pair = |ty, m| [t(ty, [4096, m, 1, 1]), t(types::F32, [m, 1, 1, 1])];
        let mut args = vec![x];
        for (ty, m) in [
            (TYPE_ROCMFP4, 1024),
            (TYPE_ROCMFP4, 512),
            (TYPE_Q8_0, 1024),
            (TYPE_Q8_0, 64),
            (types::F32, 256),
            (TYPE_Q2_0_ROCMFP2, 512),
        ] {
            args.extend(pair(ty, m));
        }
        let steps = matmul_multi(&args, MMQ_MMA, false, seq()).unwrap();
        assert_eq!(steps[..2], [MultiStep::Single(4), MultiStep::Single(5)]);
        // Pair i's pointers: w (3i + 1) * 0x1000, x + 1, out + 2 (seq's order).
        let MultiStep::Fused {
            p,
            pairs,
            launch,
            ty,
            row_bytes,
            ..
        } = &steps[2]
        else {
            panic!("{:?}", steps[2]);
        };
        // ROCmFP4, 1024 + 512 rows, two a block each (as their MATMULs): 512 + 256 blocks.
        assert_eq!((ty, row_bytes, pairs), (&100, &2304, &vec![0, 1]));
        assert_eq!(&p.rows[..2], &[2, 2]);
        assert_eq!(
            (launch.name, launch.grid, launch.block),
            ("matvec_dense_rows_multi", (768, 1, 1), 128)
        );
        assert_eq!(
            (p.n, &p.first[..2], &p.m[..2]),
            (2, &[0, 512][..], &[1024, 512][..])
        );
        assert_eq!((p.w[1], p.out[1]), (0x4000, 0x6000));
        let MultiStep::Fused {
            p, pairs, launch, ..
        } = &steps[3]
        else {
            panic!("{:?}", steps[3]);
        };
        // Q8_0: 1024 rows two a block, 64 rows one a block (as alone): 512 + 64 blocks.
        assert_eq!((pairs, launch.grid.0), (&vec![2, 3], 576));
        assert_eq!(
            (&p.first[..2], &p.m[..2], &p.rows[..2]),
            (&[0, 512][..], &[1024, 64][..], &[2, 1][..])
        );
        assert_eq!(steps.len(), 4);
        // 8-bit decode: the same groups on matvec_dense_q8_multi, one row a block under
        // 4096 rows; a lone product takes it too.
        let steps = matmul_multi(&args, MMQ_MMA, true, seq()).unwrap();
        let q8: Vec<_> = steps
            .iter()
            .filter_map(|s| match s {
                MultiStep::Fused {
                    p,
                    q8: true,
                    pairs,
                    launch,
                    ..
                } => Some((
                    launch.name,
                    launch.grid.0,
                    pairs.clone(),
                    p.rows[..2].to_vec(),
                )),
                _ => None,
            })
            .collect();
        assert_eq!(
            q8,
            [
                ("matvec_dense_q8_multi", 1536, vec![0, 1], vec![1, 1]),
                ("matvec_dense_q8_multi", 1088, vec![2, 3], vec![1, 1]),
            ]
        );
        let lone = [
            x,
            t(TYPE_Q8_0, [4096, 8192, 1, 1]),
            t(types::F32, [8192, 1, 1, 1]),
        ];
        assert!(matches!(
            &matmul_multi(&lone, MMQ_MMA, true, seq()).unwrap()[..],
            [MultiStep::Fused { q8: true, p, launch, .. }] if p.rows[0] == 2 && launch.grid.0 == 4096
        ));
        // Nine of one kind: a launch of eight and one alone.
        let mut nine = vec![x];
        for _ in 0..9 {
            nine.extend(pair(TYPE_Q8_0, 256));
        }
        let steps = matmul_multi(&nine, MMQ_MMA, false, seq()).unwrap();
        assert!(matches!(&steps[0], MultiStep::Fused { pairs, .. } if pairs.len() == 8));
        assert_eq!(steps[1], MultiStep::Single(8));
        // Two columns (a drafted pass): the columns' kernel, fused the same way (4 rows a
        // block under 2048 rows, 8 from there up to 4 columns), with or without q8; a
        // lone product runs alone, and 16 columns take the tiles.
        let cols = |n: u64, m1: u64| {
            [
                t(types::F32, [4096, n, 1, 1]),
                t(TYPE_Q8_0, [4096, 64, 1, 1]),
                t(types::F32, [64, n, 1, 1]),
                t(TYPE_Q8_0, [4096, m1, 1, 1]),
                t(types::F32, [m1, n, 1, 1]),
            ]
        };
        for q8 in [false, true] {
            let steps = matmul_multi(&cols(2, 4096), MMQ_MMA, q8, seq()).unwrap();
            let [MultiStep::Fused {
                p,
                n,
                q8: false,
                pairs,
                launch,
                ..
            }] = &steps[..]
            else {
                panic!("{steps:?}");
            };
            assert_eq!((n, pairs, &p.rows[..2]), (&2, &vec![0, 1], &[4, 8][..]));
            assert_eq!(
                (launch.name, launch.grid, &p.first[..2]),
                ("matvec_dense_cols_multi", (16 + 512, 1, 1), &[0, 16][..])
            );
        }
        let steps = matmul_multi(&cols(9, 64), MMQ_MMA, false, seq()).unwrap();
        assert!(
            matches!(&steps[..], [MultiStep::Fused { launch, .. }] if launch.grid == (32, 2, 1)),
            "{steps:?}"
        );
        let lone = &cols(3, 64)[..3];
        assert_eq!(
            matmul_multi(lone, MMQ_MMA, false, seq()).unwrap(),
            [MultiStep::Single(0)]
        );
        assert_eq!(
            matmul_multi(&cols(16, 64), MMQ_MMA, false, seq()).unwrap(),
            [MultiStep::Single(0), MultiStep::Single(1)]
        );
        // Bad arguments name the product or the count.
        let mut bad = args.clone();
        bad[4] = t(types::F32, [500, 1, 1, 1]);
        let e = matmul_multi(&bad, MMQ_MMA, false, seq()).unwrap_err();
        assert!(
            e.starts_with("matmul_multi, product 1: matmul: output holds 500"),
            "{e}"
        );
        let e = matmul_multi(&args[..4], MMQ_MMA, false, seq()).unwrap_err();
        assert!(e.contains("got 4 tensor arguments"), "{e}");
        // The kernel's parameter block: 16 pointers, 24 + 1 ints, padded to 8 bytes.
        assert_eq!(std::mem::size_of::<DenseMulti>(), 232);
    }

    #[test]
    fn matmul_id_multi_plans() {
        // Every tensor at its own offset; the device pointer is the offset.
        let at = |ty, dims, offset| TensorRef {
            offset,
            ..t(ty, dims)
        };
        let addr = |t: &TensorRef, _| Ok(t.offset);
        let x = at(types::F32, [64, 1, 1, 1], 0x100);
        let ids = at(types::I32, [2, 1, 1, 1], 0x200);
        let w = |i: u64| at(107, [64, 4, 3, 1], 0x1000 * (i + 1));
        let out = |i: u64| at(types::F32, [4, 2, 1, 1], 0x10000 + 0x100 * i);
        let q8 = at(TYPE_Q8_0, [64, 4, 3, 1], 0x8000);
        let args = [x, ids, w(0), out(0), w(2), out(1), w(1), out(2), q8, out(3)];
        let steps = matmul_id_multi(&args, MMQ_MMA, addr).unwrap();
        let IdMultiStep::Pair {
            plan,
            pairs,
            w_step,
            out_step,
        } = &steps[0]
        else {
            panic!("{:?}", steps[0]);
        };
        assert_eq!(pairs, &(0, 1));
        assert_eq!(
            (plan.grouped.name, plan.grouped.grid),
            ("mmvq_id_107", (1, 2, 2))
        );
        assert_eq!((*w_step, *out_step), (0x2000, 0x100));
        assert_eq!(steps[1..], [IdMultiStep::Single(2), IdMultiStep::Single(3)]);
        // Two tokens: the sorted kernel, each alone.
        let ids2 = at(types::I32, [2, 2, 1, 1], 0x200);
        let out4 = |i: u64| at(types::F32, [4, 4, 1, 1], 0x10000 + 0x100 * i);
        let x2 = at(types::F32, [64, 2, 1, 1], 0x100);
        let two = [x2, ids2, w(0), out4(0), w(1), out4(1)];
        assert_eq!(
            matmul_id_multi(&two, MMQ_MMA, addr).unwrap(),
            [IdMultiStep::Single(0), IdMultiStep::Single(1)]
        );
        let e = matmul_id_multi(&args[..5], MMQ_MMA, addr).unwrap_err();
        assert!(e.contains("got 5 tensor arguments"), "{e}");
        let mut bad = args;
        bad[3] = at(types::F32, [4, 3, 1, 1], 0x10000);
        let e = matmul_id_multi(&bad, MMQ_MMA, addr).unwrap_err();
        assert!(
            e.starts_with("matmul_id_multi, product 0: matmul_id: output holds 12"),
            "{e}"
        );
    }

    #[test]
    fn sizes_and_checks() {
        assert_eq!(bytes_of(&t(107, [64, 4, 1, 1]), "x"), Ok(80));
        assert_eq!(bytes_of(&t(types::F32, [3, 1, 1, 1]), "x"), Ok(12));
        assert!(bytes_of(&t(107, [33, 1, 1, 1]), "x")
            .unwrap_err()
            .contains("not whole blocks"));
        assert!(bytes_of(&t(12, [256, 1, 1, 1]), "hip")
            .unwrap_err()
            .contains("the hip backend"));
        // The dense-kernel types.
        assert_eq!(bytes_of(&t(types::F16, [3, 2, 1, 1]), "x"), Ok(12));
        assert_eq!(bytes_of(&t(TYPE_Q8_0, [64, 2, 1, 1]), "x"), Ok(4 * 34));
        assert_eq!(bytes_of(&t(TYPE_MXFP4, [32, 3, 1, 1]), "x"), Ok(3 * 17));
        assert_eq!(bytes_of(&t(TYPE_ROCMFP4, [64, 1, 1, 1]), "x"), Ok(2 * 18));
        assert!(bytes_of(&t(TYPE_Q8_0, [48, 1, 1, 1]), "x")
            .unwrap_err()
            .contains("whole 32-value blocks"));
        let x = t(types::F32, [4, 1, 1, 1]);
        assert_eq!(check_placement(&x, 64, 0, 0, 4), Ok(64));
        assert!(check_placement(&x, 66, 0, 0, 4)
            .unwrap_err()
            .contains("4-byte aligned"));
        assert!(check_placement(&x, 64, 1, 0, 4)
            .unwrap_err()
            .contains("on device 1"));
        assert_eq!(affine(&t(107, [32, 1, 1, 1])), Ok(1));
        let mut two = t(107, [32, 1, 1, 1]);
        two.variant = FP2_TWO_SCALE;
        assert_eq!(affine(&two), Ok(0));
        two.variant = 7;
        assert!(affine(&two).is_err());
        assert!(to_i32(1 << 31, "n").unwrap_err().contains("too large"));
        assert_eq!(scratch_len(10), 1 << 20);
        assert_eq!(scratch_len((1 << 20) + 1), 1 << 21);
        assert_eq!(quantize(64, 3).0.grid, (1, 1, 1));
        assert_eq!(quantize(64, 3).1, 6);
        let planes = [
            "mmvq_107_n3",
            "mmvq_id_107",
            "mmvq_grouped_107",
            MMQ_MMA,
            "mmq_mma_id",
        ];
        assert_eq!(planes.map(rf2_planes), [1, 1, 1, 0, 0]);
    }

    #[test]
    fn add_and_get_rows() {
        let f = |n| t(types::F32, [n, 1, 1, 1]);
        let p = add(&[f(300), f(300), f(300)], seq()).unwrap();
        assert_eq!((p.a, p.b, p.out, p.n), (0x1000, 0x2000, 0x3000, 300));
        assert_eq!(p.launch.grid, (2, 1, 1));
        assert_eq!(
            add(&[f(3), f(4), f(3)], seq()).unwrap_err(),
            "add: shape mismatch"
        );
        assert!(add(&[f(3), f(3)], seq())
            .unwrap_err()
            .contains("expected 3"));
        assert!(add(&[f(3), f(3), t(107, [32, 1, 1, 1])], seq()).is_err());

        let ids = t(types::I32, [5, 1, 1, 1]);
        let g = get_rows(
            &[t(107, [64, 10, 1, 1]), ids, t(types::F32, [64, 5, 1, 1])],
            "cuda",
            seq(),
        )
        .unwrap();
        assert_eq!((g.rows, g.cols, g.affine), (10, 64, Some(1)));
        assert_eq!(g.launch.name, "get_rows_107");
        assert_eq!(g.launch.grid, (1, 5, 1));
        let g = get_rows(&[f(64), ids, t(types::F32, [64, 5, 1, 1])], "cuda", seq()).unwrap();
        assert_eq!((g.launch.name, g.affine), ("get_rows_f32", None));
        assert!(get_rows(&[f(64), ids, f(63)], "cuda", seq())
            .unwrap_err()
            .contains("not cols x ids"));
        let g = get_rows(
            &[
                t(TYPE_Q8_0, [64, 10, 1, 1]),
                ids,
                t(types::F32, [64, 5, 1, 1]),
            ],
            "cuda",
            seq(),
        )
        .unwrap();
        assert_eq!((g.launch.name, g.dense), ("get_rows_dense", Some((68, 8))));
        // An unsupported table type fails in `ptr` first, as before.
        let e = get_rows(
            &[t(12, [256, 1, 1, 1]), ids, t(types::F32, [256, 5, 1, 1])],
            "hip",
            |t, _| bytes_of(t, "hip"),
        )
        .unwrap_err();
        assert!(e.contains("the hip backend does not handle"), "{e}");
    }

    #[test]
    fn dense_matmul_plans() {
        let w = t(TYPE_MXFP4, [64, 10, 1, 1]);
        let p = matmul_dense(
            &[
                w,
                t(types::F32, [64, 9, 1, 1]),
                t(types::F32, [10, 9, 1, 1]),
            ],
            MMQ_MMA,
            seq(),
        )
        .unwrap()
        .unwrap();
        assert_eq!((p.row_bytes, p.ty, p.k, p.m, p.n), (34, 39, 64, 10, 9));
        assert_eq!(
            (p.launch.name, p.launch.grid, p.layout),
            ("matvec_dense", (2, 2, 1), DenseLayout::Warps(1))
        );
        assert_eq!(
            (
                dense_parts(24, 16384),
                dense_parts(1024, 4096),
                dense_parts(4096, 4096)
            ),
            (8, 8, 2)
        );
        assert_eq!((dense_parts(129280, 4096), dense_parts(8, 256)), (1, 1));
        // One column of Q8_0 / ROCmFP4 weights: a block on 4 (output-head sized) or 2 rows.
        let one_on = |mmq, ty, k, m, n, x_at: u64| {
            let mut i = 0;
            let p = matmul_dense(
                &[
                    t(ty, [k, m, 1, 1]),
                    t(types::F32, [k, n, 1, 1]),
                    t(types::F32, [m, n, 1, 1]),
                ],
                mmq,
                move |_, _| {
                    i += 1;
                    Ok(if i == 2 { x_at } else { i * 0x1000 })
                },
            )
            .unwrap()
            .unwrap();
            (p.launch.name, p.launch.grid, p.launch.block, p.layout)
        };
        let one = |ty, k, m, n, x_at| {
            let (name, grid, block, layout) = one_on(MMQ_MMA, ty, k, m, n, x_at);
            (name, grid.0, block, layout)
        };
        let one_launch = |ty, k, m, n, x_at| {
            let (name, grid, _, layout) = one_on(MMQ_MMA, ty, k, m, n, x_at);
            (name, grid, layout)
        };
        assert_eq!(
            one(TYPE_Q8_0, 4096, 129280, 1, 0x2000),
            ("matvec_dense_rows", 32320, 128, DenseLayout::Rows(4))
        );
        // ROCmFP4 in whole 256-value runs (fp4_runs): wq_b, 4 threads a row, 2 rows a
        // thread, 256 threads: 128 rows a block; wo_b (k = 8192: 32 threads a row) 2 rows a
        // thread, 512 threads: 32 rows a block; the shared expert's down (k = 2048: 8
        // threads a row) 1 row, 256 threads; under 4096 rows: the rows layout.
        let runs = |rows, threads| {
            DenseLayout::Fp4Runs(RunsPlan {
                rows,
                threads,
                mma: false,
            })
        };
        let rows = DenseLayout::Rows;
        // Not whole runs (k = 4000) or over the staged k (below): the rows layout (or
        // matvec_dense), however many rows.
        for (k, m, want) in [
            (8192, 4096, ("matvec_fp4_runs_q8", 128, 512, runs(2, 512))),
            (2048, 4096, ("matvec_fp4_runs_q8", 128, 256, runs(1, 256))),
            (1024, 32768, ("matvec_fp4_runs_q8", 256, 256, runs(2, 256))),
            (4096, 2048, ("matvec_dense_rows", 1024, 128, rows(2))),
            (1024, 8192, ("matvec_dense_rows", 2048, 128, rows(4))),
            (4096, 1023, ("matvec_dense_rows", 512, 128, rows(2))),
            (4000, 32768, ("matvec_dense_rows", 8192, 128, rows(4))),
        ] {
            assert_eq!(one(TYPE_ROCMFP4, k, m, 1, 0x2000), want, "{k} x {m}");
        }
        assert_eq!(
            one(TYPE_ROCMFP4, 8448, 32768, 1, 0x2000).0,
            "matvec_dense_rows"
        );
        assert_eq!(one(TYPE_ROCMFP4, 1024, 32768, 1, 0x2008).0, "matvec_dense");
        // The matrix-unit form of those plans: k / 1024 warps along k, groups of 16 rows
        // filling the threads asked for; k not whole 1024-value groups keeps the runs.
        let base = RunsPlan {
            rows: 2,
            threads: 512,
            mma: false,
        };
        let mma = |rows, threads| RunsPlan {
            rows,
            threads,
            mma: true,
        };
        for (k, t, want) in [
            (8192, 256, mma(1, 256)),
            (8192, 512, mma(2, 512)),
            (4096, 512, mma(4, 512)),
            (2048, 256, mma(4, 256)),
            (1024, 256, mma(8, 256)),
            (1024, 512, mma(16, 512)),
        ] {
            let p = fp4_mma_plan(k, base, Some(t));
            assert_eq!(p, want, "{k} at {t}");
            assert_eq!(fp4_runs_rows_per_block(k, p), 16 * want.rows);
        }
        assert_eq!(fp4_mma_plan(1280, base, Some(256)), base);
        assert_eq!(fp4_mma_plan(8192, base, None), base);
        // A few rows of f32 (an mHC mix): a 1024-thread block per row.
        assert_eq!(
            one(types::F32, 16384, 24, 1, 0x2000),
            ("matvec_f32_wide", 24, 1024, DenseLayout::F32Wide)
        );
        assert_eq!(one(types::F32, 16384, 1025, 1, 0x2000).0, "matvec_dense");
        assert_eq!(one(types::F32, 16384, 24, 2, 0x2000).0, "matvec_dense");
        // 16 columns or more of f32 (a prefill chunk's mHC mix, router): tiles over slices
        // of k until 264 blocks; misaligned activations or k not whole float4s: matvec_dense.
        assert_eq!(
            one(types::F32, 16384, 24, 512, 0x2000),
            (
                "matmul_f32_tiles",
                1,
                256,
                DenseLayout::F32Tiles {
                    slices: 32,
                    span: 512
                }
            )
        );
        assert_eq!(f32_tiles(types::F32, 4096, 256, 512, 0, 0), Some((8, 512)));
        assert_eq!(f32_tiles(types::F32, 1000, 37, 70, 0, 0), Some((2, 512)));
        assert_eq!(f32_tiles(types::F32, 300, 4096, 4096, 0, 0), Some((1, 320)));
        // Slices of whole steps: 28 of 288 values and a last one of 136.
        assert_eq!(f32_tiles(types::F32, 8200, 24, 512, 0, 0), Some((29, 288)));
        assert_eq!(f32_tiles(types::F32, 16384, 24, 15, 0, 0), None);
        assert_eq!(f32_tiles(types::F32, 1002, 24, 64, 0, 0), None);
        assert_eq!(f32_tiles(types::F16, 4096, 24, 64, 0, 0), None);
        assert_eq!(one(types::F32, 16384, 24, 512, 0x2004).0, "matvec_dense");
        assert_eq!(one(types::F32, 16384, 24, 1, 0x2004).0, "matvec_dense");
        // Few rows, other types or misaligned activations: matvec_dense.
        assert_eq!(
            one(TYPE_Q8_0, 4096, 255, 1, 0x2000),
            ("matvec_dense_rows", 255, 128, DenseLayout::Rows(1))
        );
        assert_eq!(one(TYPE_Q8_0, 4096, 31, 1, 0x2000).0, "matvec_dense");
        assert_eq!(one(TYPE_ROCMFP4, 4096, 1024, 1, 0x2004).0, "matvec_dense");
        // 16 columns or more of Q8_0 / ROCmFP4 on a device with matrix-unit MMQ: q8_1 tiles.
        assert_eq!(
            one(TYPE_Q8_0, 4096, 1024, 16, 0x2000),
            ("mmq_mma_dense", 8, 256, DenseLayout::Mmq)
        );
        assert_eq!(
            one(TYPE_ROCMFP4, 4096, 1000, 512, 0x2004).0,
            "mmq_mma_dense"
        );
        let runs_cols = |rows, threads| {
            DenseLayout::Fp4RunsCols(RunsPlan {
                rows,
                threads,
                mma: false,
            })
        };
        // 2 - 15 columns (a drafted pass): matvec_dense_cols, 8 columns a grid row, or
        // where one column takes the runs kernel with one run a thread, its columns form
        // on the same grid (the q8_1 tiles only with MOE_GPU_FEW_COLS=mmq, not set in
        // tests).
        for n in [2u64, 4, 8, 15] {
            let y = n.div_ceil(8) as u32;
            assert_eq!(
                one_launch(TYPE_Q8_0, 4096, 1024, n, 0x2000),
                ("matvec_dense_cols", (256, y, 1), DenseLayout::Cols(4))
            );
            assert_eq!(
                one_launch(TYPE_ROCMFP4, 1024, 32768, n, 0x2000),
                ("matvec_fp4_runs_q8_cols", (256, 1, 1), runs_cols(2, 256))
            );
            assert_eq!(
                one_launch(TYPE_ROCMFP4, 8192, 4096, n, 0x2000),
                ("matvec_fp4_runs_q8_cols", (128, 1, 1), runs_cols(2, 512))
            );
            // 12 runs a row over 8 threads: not one run a thread.
            let r = if n <= 4 { 8 } else { 4 };
            assert_eq!(
                one_launch(TYPE_ROCMFP4, 3072, 16384, n, 0x2000),
                (
                    "matvec_dense_cols",
                    (16384 / r as u32, y, 1),
                    DenseLayout::Cols(r)
                )
            );
        }
        // Few rows, misaligned activations or other types keep matvec_dense.
        assert_eq!(one(TYPE_Q8_0, 4096, 31, 4, 0x2000).0, "matvec_dense");
        assert_eq!(one(TYPE_ROCMFP4, 4096, 1024, 4, 0x2004).0, "matvec_dense");
        assert_eq!(one(types::F16, 4096, 1024, 4, 0x2000).0, "matvec_dense");
        // 64-column tiles unless MOE_GPU_MMQ_DENSE_NARROW is set (not in tests).
        assert_eq!(
            (mmq_dense_cols(512, 512), mmq_dense_cols(32768, 17)),
            (64, 64)
        );
        assert_eq!(one(types::F16, 4096, 1024, 64, 0x2000).0, "matvec_dense");
        assert_eq!(
            one_on(MMQ_DP4A, TYPE_Q8_0, 4096, 1024, 64, 0x2000).0,
            "matvec_dense"
        );
        // 107 is not a dense type; a shape mismatch is refused.
        assert_eq!(
            matmul_dense(
                &[
                    t(107, [64, 1, 1, 1]),
                    t(types::F32, [64, 1, 1, 1]),
                    t(types::F32, [1, 1, 1, 1])
                ],
                MMQ_MMA,
                seq()
            ),
            Ok(None)
        );
        assert!(matmul_dense(
            &[
                t(types::F16, [8, 2, 1, 1]),
                t(types::F32, [8, 1, 1, 1]),
                t(types::F32, [3, 1, 1, 1])
            ],
            MMQ_MMA,
            seq()
        )
        .unwrap_err()
        .contains("expected 2 x 1"));
    }

    #[test]
    fn matmul_plans() {
        let w = t(107, [256, 1000, 1, 1]);
        let x = |n| t(types::F32, [256, n, 1, 1]);
        let o = |n| t(types::F32, [1000, n, 1, 1]);
        for (n, name, grid) in [
            (1, "mmvq_107_n1", (63, 1, 1)),
            (3, "mmvq_107_n3", (125, 1, 1)),
            (8, "mmvq_107_n8", (63, 1, 1)),
        ] {
            let p = matmul(&[w, x(n), o(n)], "cuda", MMQ_MMA, seq()).unwrap();
            assert_eq!(
                (p.launch.name, p.launch.grid, p.launch.block),
                (name, grid, 128)
            );
            assert_eq!((p.n_cols, p.blocks, p.m, p.affine), (None, 8, 1000, 1));
            assert_eq!(p.q8_bytes, n as usize * 8 * 40);
        }
        let p = matmul(&[w, x(100), o(100)], "cuda", MMQ_MMA, seq()).unwrap();
        assert_eq!(
            (p.launch.grid, p.launch.block, p.n_cols),
            ((8, 2, 1), 256, Some(100))
        );
        // HIP: two rows a warp past four columns (125 blocks of 4 warps for 1000 rows)
        let p = matmul(&[w, x(8), o(8)], "hip", MMQ_DP4A, seq()).unwrap();
        assert_eq!((p.launch.name, p.launch.grid), ("mmvq_107_n8", (125, 1, 1)));
        let p = matmul(&[w, x(100), o(100)], "hip", MMQ_DP4A, seq()).unwrap();
        assert_eq!((p.launch.name, p.launch.grid), (MMQ_DP4A, (16, 4, 1)));
        let e = matmul(&[t(107, [48, 4, 1, 1]), x(1), o(1)], "cuda", MMQ_MMA, seq());
        assert!(e.unwrap_err().contains("multiple of 32"));
        let e = matmul(&[w, x(2), o(3)], "cuda", MMQ_MMA, seq());
        assert!(e.unwrap_err().contains("expected 1000 x 2"));
        let e = matmul(&[x(1), x(1), o(1)], "hip", MMQ_MMA, seq());
        assert!(e.unwrap_err().contains("the hip backend runs type 107"));
    }

    #[test]
    fn matmul_id_plan_and_layout() {
        let w = t(107, [64, 4, 3, 1]);
        let ids = t(types::I32, [2, 5, 1, 1]);
        let out = t(types::F32, [4, 2, 5, 1]);
        let p = matmul_id(&[w, t(types::F32, [64, 5, 1, 1]), ids, out], MMQ_MMA, seq()).unwrap();
        assert_eq!((p.w, p.x, p.ids, p.out), (0x1000, 0x2000, 0x3000, 0x4000));
        assert_eq!((p.per_pair, p.x_cols, p.pairs, p.experts), (0, 5, 10, 3));
        assert_eq!((p.blocks, p.m, p.slots, p.expert_bytes), (2, 4, 2, 80));
        assert_eq!(p.grouped.grid, (1, 4, 1));
        // 4 rows per block (4 warps x 1 row).
        let w40 = t(107, [64, 40, 3, 1]);
        let out40 = t(types::F32, [40, 2, 5, 1]);
        let p = matmul_id(
            &[w40, t(types::F32, [64, 5, 1, 1]), ids, out40],
            MMQ_MMA,
            seq(),
        )
        .unwrap();
        assert_eq!(p.grouped.grid, (10, 4, 1));
        // One token (6 slots): mmvq_id_107, 4 warps x id_rows() rows a block, no sort.
        let ids1 = t(types::I32, [6, 1, 1, 1]);
        let p = matmul_id(
            &[
                w40,
                t(types::F32, [64, 1, 1, 1]),
                ids1,
                t(types::F32, [40, 6, 1, 1]),
            ],
            MMQ_MMA,
            seq(),
        )
        .unwrap();
        assert_eq!(p.grouped.name, "mmvq_id_107");
        assert_eq!(p.grouped.grid, (40u64.div_ceil(4 * id_rows()) as u32, 6, 1));
        assert!(p.sort.is_none());
        let p = matmul_id(
            &[w, t(types::F32, [64, 10, 1, 1]), ids, out],
            MMQ_MMA,
            seq(),
        )
        .unwrap();
        assert_eq!((p.per_pair, p.x_cols), (1, 10));
        assert!(
            matmul_id(&[w, t(types::F32, [64, 7, 1, 1]), ids, out], MMQ_MMA, seq())
                .unwrap_err()
                .contains("neither 5 nor 10")
        );
        assert!(
            matmul_id(&[w, t(types::F32, [64, 5, 1, 1]), ids], MMQ_MMA, seq())
                .unwrap_err()
                .contains("expected 4")
        );
        // Four pairs or more per expert: the MMQ tiles (128 rows), for 107 and, there
        // only, for Q8_0 / ROCmFP4; the dense types take the dense kernels otherwise.
        let ids12 = t(types::I32, [2, 6, 1, 1]);
        let out12 = |m| t(types::F32, [m, 2, 6, 1]);
        let x6 = t(types::F32, [64, 6, 1, 1]);
        let p = matmul_id(&[w40, x6, ids12, out12(40)], MMQ_MMA, seq()).unwrap();
        assert_eq!((p.grouped.name, p.grouped.grid), ("mmq_mma_id", (1, 4, 1)));
        assert_eq!((p.row_bytes, p.ty, p.affine), (20, 107, 1));
        let q8 = t(TYPE_Q8_0, [64, 300, 3, 1]);
        let p = matmul_id(&[q8, x6, ids12, out12(300)], MMQ_MMA, seq()).unwrap();
        assert_eq!((p.grouped.name, p.grouped.grid), ("mmq_mma_id", (3, 4, 1)));
        assert_eq!(
            (p.row_bytes, p.expert_bytes, p.ty, p.affine),
            (68, 68 * 300, 8, 0)
        );
        assert!(id_takes_mmq(&[q8, x6, ids12, out12(300)], MMQ_MMA));
        assert!(!id_takes_mmq(&[q8, x6, ids12, out12(300)], MMQ_DP4A));
        assert!(!id_takes_mmq(
            &[q8, t(types::F32, [64, 5, 1, 1]), ids, out],
            MMQ_MMA
        ));
        // Without the tiles: 6 tokens' 12 pairs on 4 experts sort (they share experts);
        // 4 tokens of 6 slots on 256 experts (a drafted pass) do not, 9 tokens do.
        let p = matmul_id(&[w40, x6, ids12, out12(40)], MMQ_DP4A, seq()).unwrap();
        assert_eq!(p.grouped.name, "mmvq_grouped_107");
        let w256 = t(107, [64, 40, 256, 1]);
        for (tok, name) in [
            (4, "mmvq_id_107"),
            (8, "mmvq_id_107"),
            (9, "mmvq_grouped_107"),
        ] {
            let p = matmul_id(
                &[
                    w256,
                    t(types::F32, [64, tok, 1, 1]),
                    t(types::I32, [6, tok, 1, 1]),
                    t(types::F32, [40, 6, tok, 1]),
                ],
                MMQ_MMA,
                seq(),
            )
            .unwrap();
            assert_eq!(
                (p.grouped.name, p.sort.is_none()),
                (name, name == "mmvq_id_107")
            );
        }
        let e = matmul_id(
            &[q8, t(types::F32, [64, 5, 1, 1]), ids, out],
            MMQ_MMA,
            seq(),
        );
        assert!(e.unwrap_err().contains("matmul_id weights"));
        let many = t(107, [64, 4, 1025, 1]);
        assert!(matmul_id(
            &[many, t(types::F32, [64, 5, 1, 1]), ids, out],
            MMQ_MMA,
            seq()
        )
        .unwrap_err()
        .contains("at most 1024"));

        for (x_cols, k, experts, pairs) in [(1, 32, 1, 1), (5, 64, 3, 10), (7, 2048, 1024, 4096)] {
            let l = id_layout(x_cols, k, experts, pairs);
            let q8 = x_cols * k / 32 * Q8_BYTES;
            let list = (experts + 2) * 4;
            assert!(l.offsets >= q8 && l.offsets.is_multiple_of(256));
            assert!(l.active >= l.offsets + list && l.active.is_multiple_of(16));
            assert!(l.sorted >= l.active + list && l.sorted.is_multiple_of(16));
            assert!(l.sorted + pairs * 4 <= l.bytes as u64);
        }
    }
}

#[cfg(test)]
mod run_tests {
    use std::cell::RefCell;

    use super::*;

    /// Records launches (name, grid, argument count), their dynamic shared memory and
    /// scratch requests; `bulk` is the room it offers for bulk copies.
    #[derive(Default)]
    struct Rec {
        launches: RefCell<Vec<(&'static str, Grid, usize)>>,
        smem: RefCell<Vec<(&'static str, u32)>>,
        blocks: RefCell<Vec<(&'static str, u32)>>,
        scratch: RefCell<Vec<usize>>,
        bulk: u32,
        /// Whether products take the bf16 tiles, and the room of their streamed form.
        bf16: bool,
        streamed: u32,
        rows: u32,
        /// Whether it offers PREFETCH.
        prefetch: bool,
    }

    impl Gpu for Rec {
        fn ptr(&self, t: &TensorRef, _align: u64) -> Result<u64, String> {
            bytes_of(t, "test").map(|_| 0x10000 + t.offset)
        }
        fn scratch(&self, bytes: usize) -> Result<u64, String> {
            self.scratch.borrow_mut().push(bytes);
            Ok(0x100000)
        }
        unsafe fn launch(&self, l: Launch, params: &[*mut c_void]) -> Result<(), String> {
            self.launches
                .borrow_mut()
                .push((l.name, l.grid, params.len()));
            self.blocks.borrow_mut().push((l.name, l.block));
            Ok(())
        }
        unsafe fn launch_smem(
            &self,
            l: Launch,
            smem: u32,
            params: &[*mut c_void],
        ) -> Result<(), String> {
            self.smem.borrow_mut().push((l.name, smem));
            self.launch(l, params)
        }
        fn multiprocessors(&self) -> u32 {
            132
        }
        fn bulk_smem(&self) -> u32 {
            self.bulk
        }
        fn bf16_tiles(&self, _cols: u64) -> bool {
            self.bf16
        }
        fn bf16_streamed(&self) -> u32 {
            self.streamed
        }
        fn bf16_streamed_rows(&self) -> u32 {
            self.rows
        }
        fn l2_prefetch(&self) -> bool {
            self.prefetch
        }
    }

    /// PREFETCH: "not supported" where the device cannot; else one `l2_prefetch` launch
    /// of 1 to 4 ranges, a block of 32 a 64 chunks of the kernel's size, at most 32.
    #[test]
    fn prefetch_launch() {
        let src = include_str!("../../../kernels/gpu/rocmfpx.cu");
        assert!(
            src.contains("#define L2P_RANGES 4\n") && src.contains("#define L2P_CHUNK 16384\n")
        );
        let p = OpParams::default();
        // wo_b's shape in ROCmFP4: 8192 x 4096, 18 bytes a 32 values (1152 chunks)
        let w = t(TYPE_ROCMFP4, [8192, 4096, 1, 1]);
        let e = run(&Rec::default(), "test", MMQ_MMA, ops::PREFETCH, &p, &[w]).unwrap_err();
        assert!(e.contains("not supported"), "{e}");
        let sig = crate::kernels::signatures();
        for (args, blocks) in [(vec![w], 18), (vec![w, w, w], 32)] {
            let g = Rec {
                prefetch: true,
                ..Default::default()
            };
            run(&g, "test", MMQ_MMA, ops::PREFETCH, &p, &args).unwrap();
            assert_eq!(*g.launches.borrow(), [("l2_prefetch", (blocks, 1, 1), 8)]);
            assert_eq!(sig.get("l2_prefetch"), Some(&9));
        }
        let g = Rec {
            prefetch: true,
            ..Default::default()
        };
        // an unaligned range: its whole 16-byte units only
        let mut odd = t(types::F32, [9, 1, 1, 1]);
        odd.offset = 4;
        run(&g, "test", MMQ_MMA, ops::PREFETCH, &p, &[odd]).unwrap();
        for bad in [vec![], vec![w; 5]] {
            let e = run(&g, "test", MMQ_MMA, ops::PREFETCH, &p, &bad).unwrap_err();
            assert!(e.contains("1 to 4 tensors"), "{e}");
        }
    }

    /// The host's copy of the streamed tiles' shapes is the kernel source's: the shared
    /// memory it gives a launch must be what the kernel's stages take.
    #[test]
    fn streamed_tile_shapes_match_the_source() {
        let src = include_str!("../../../kernels/gpu/rocmfpx.cu");
        let define = |name: &str| -> String {
            let line = src
                .lines()
                .find(|l| l.starts_with(&format!("#define {name} ")))
                .unwrap_or_else(|| panic!("#define {name} in rocmfpx.cu"));
            let v = line[format!("#define {name} ").len()..]
                .split("//")
                .next()
                .unwrap();
            v.trim().to_string()
        };
        assert_eq!(define("MMW_BM"), MMW_BM.to_string());
        assert_eq!(define("MMW_KS"), MMW_KS.to_string());
        assert_eq!(define("MMW_STAGES"), MMW_STAGES.to_string());
        assert_eq!(define("MMW_ALD"), "(MMW_KS / 2 + 4)");
        assert_eq!(MMW_ALD, MMW_KS / 2 + 4);
        assert_eq!(define("MMA_BN"), mmq_tile(MMQ_MMA).1.to_string());
        // mmw_row_bytes: 4 blocks (of 10 or 18 bytes) a stage row.
        assert!(src.contains("return 4 * mma_block_bytes<TY>();"));
        assert!(src.contains("return MMW_BM * mmw_row_bytes<TY>() + BN * MMW_ALD * 4;"));
    }

    /// The streamed bf16 tiles (MOE_GPU_MMB=stream): a product that takes the bf16 tiles
    /// converts its input once (`f32_to_bf16`, into the scratch) and launches `mmw_dense`
    /// / `mmw_id` with its stages' shared memory (narrow where no tile is over 16
    /// columns, wide otherwise, as the kernel's formula); a k of no whole 128-value
    /// stages, or less room than the launch needs, keeps `mmb_*`; without the bf16 tiles
    /// the int8 ones run. Every launch's parameters match its kernel's.
    #[test]
    fn streamed_bf16_tiles() {
        let f = |a, b| t(types::F32, [a, b, 1, 1]);
        let sig = crate::kernels::signatures();
        let launched = |g: &Rec, op, a: &[TensorRef]| {
            run(g, "test", MMQ_MMA, op, &OpParams::default(), a).unwrap();
            for &(name, _, np) in g.launches.borrow().iter() {
                assert_eq!(sig.get(name), Some(&(np + 1)), "{name}'s parameters");
            }
            let l: Vec<_> = g.launches.borrow().iter().map(|l| (l.0, l.1)).collect();
            let smem = g.smem.borrow().clone();
            let scratch = g.scratch.borrow().clone();
            (l, smem, scratch)
        };
        let rec = |bf16, streamed| Rec {
            bf16,
            streamed,
            ..Default::default()
        };
        // ROCmFP4 1000 x 4096 against 40 columns: wide tiles, one column tile, 8 row tiles.
        let a = [
            t(TYPE_ROCMFP4, [4096, 1000, 1, 1]),
            f(4096, 40),
            f(1000, 40),
        ];
        let (l, smem, scratch) = launched(&rec(true, 120_000), ops::MATMUL, &a);
        assert_eq!(l, [("f32_to_bf16", (160, 1, 1)), ("mmw_dense", (1, 8, 1))]);
        assert_eq!(smem, [("mmw_dense", 4 * (128 * 72 + 64 * 68 * 4))]);
        assert_eq!(scratch, [40 * 4096 * 2]);
        assert_eq!(mmw_smem(TYPE_ROCMFP4, 64), 106_496);
        // 16 columns: the wide size where it fits (the kernel takes narrow tiles), else
        // the narrow one; 40 columns without room for the wide size, or weights not
        // 8-byte aligned (a view 4 bytes in): mmb.
        let a16 = [
            t(TYPE_ROCMFP4, [4096, 1000, 1, 1]),
            f(4096, 16),
            f(1000, 16),
        ];
        let (_, smem, _) = launched(&rec(true, 120_000), ops::MATMUL, &a16);
        assert_eq!(smem, [("mmw_dense", 106_496)]);
        let (l, smem, _) = launched(&rec(true, 60_000), ops::MATMUL, &a16);
        assert_eq!(l.last().unwrap().0, "mmw_dense");
        assert_eq!(smem, [("mmw_dense", 54_272)]);
        let (l, smem, _) = launched(&rec(true, 60_000), ops::MATMUL, &a);
        assert_eq!(l, [("mmb_dense", (8, 1, 1))]);
        assert!(smem.is_empty());
        let mut off = a;
        off[0].offset = 4;
        let (l, _, _) = launched(&rec(true, 120_000), ops::MATMUL, &off);
        assert_eq!(l, [("mmb_dense", (8, 1, 1))]);
        // Type 107, 20 columns: wide 107 stages; k = 160 is no whole stage: mmb.
        let b = [
            t(TYPE_Q2_0_ROCMFP2, [2048, 512, 1, 1]),
            f(2048, 20),
            f(512, 20),
        ];
        let (l, smem, _) = launched(&rec(true, 120_000), ops::MATMUL, &b);
        assert_eq!(l.last().unwrap(), &("mmw_dense", (1, 4, 1)));
        assert_eq!(smem, [("mmw_dense", 90_112)]);
        let b = [
            t(TYPE_Q2_0_ROCMFP2, [160, 512, 1, 1]),
            f(160, 20),
            f(512, 20),
        ];
        let (l, _, _) = launched(&rec(true, 120_000), ops::MATMUL, &b);
        assert_eq!(l.iter().map(|l| l.0).collect::<Vec<_>>(), ["mmb_dense"]);
        // Without the bf16 tiles: q8_1, then the int8 tiles.
        let (l, smem, _) = launched(&rec(false, 120_000), ops::MATMUL, &a);
        assert_eq!(
            l.iter().map(|l| l.0).collect::<Vec<_>>(),
            ["quantize_q8_1", "mmq_mma_dense"]
        );
        assert!(smem.is_empty());
        // Grouped: 16 experts of 300 x 1024, 32 tokens of 6 slots (12 pairs an expert: the
        // narrow size where the wide one does not fit); the bf16 columns after the lists.
        let ids = t(types::I32, [6, 32, 1, 1]);
        let g = [
            t(TYPE_Q2_0_ROCMFP2, [1024, 300, 16, 1]),
            f(1024, 32),
            ids,
            t(types::F32, [300, 6, 32, 1]),
        ];
        let (_, smem, _) = launched(&rec(true, 120_000), ops::MATMUL_ID, &g);
        assert_eq!(smem, [("mmw_id", 90_112)]);
        let (l, smem, scratch) = launched(&rec(true, 60_000), ops::MATMUL_ID, &g);
        let names: Vec<_> = l.iter().map(|l| l.0).collect();
        assert_eq!(names, ["f32_to_bf16", "moe_sort", "mmw_id"]);
        assert_eq!(smem, [("mmw_id", 4 * (128 * 40 + 16 * 68 * 4))]);
        let layout = id_layout(32, 1024, 16, 192);
        assert_eq!(
            scratch,
            [(layout.bytes as u64).next_multiple_of(256) as usize + 32 * 1024 * 2]
        );
        // 16 rows a warp: 256 threads; 32: the _m2 kernels, 128 threads (their parameters
        // checked as the others'); the other launches keep theirs.
        for (rows, threads, suffix) in [(16, 256, ""), (32, 128, "_m2")] {
            for (op, args, base, before) in [
                (ops::MATMUL, &a[..], "mmw_dense", "f32_to_bf16"),
                (ops::MATMUL_ID, &g[..], "mmw_id", "moe_sort"),
            ] {
                let gr = Rec {
                    rows,
                    ..rec(true, 120_000)
                };
                let (l, _, _) = launched(&gr, op, args);
                assert_eq!(l.last().unwrap().0, format!("{base}{suffix}"));
                let blocks = gr.blocks.borrow().clone();
                let n = blocks.len();
                assert_eq!(blocks[n - 1].1, threads);
                assert_eq!(blocks[n - 2], (before, 256));
            }
        }
        let (l, _, _) = launched(&rec(true, 0), ops::MATMUL_ID, &g);
        assert_eq!(
            l.iter().map(|l| l.0).collect::<Vec<_>>(),
            ["moe_sort", "mmb_id"]
        );
    }

    /// The ROCmFP4 runs kernel asks for its block's rows of dynamic shared memory (its
    /// bulk path) only where the device offers that much: `wo_b` (8192 x 4096, 2 rows x
    /// 512 threads: 32 rows of 4608 bytes) and the shared expert's down (2048 x 4096,
    /// 1 x 256: 32 rows of 1152).
    #[test]
    fn runs_bulk_smem() {
        let f = |k, n| t(types::F32, [k, n, 1, 1]);
        for (bulk, want) in [
            (0, [0, 0]),
            (214_000, [147_456, 36_864]),
            (100_000, [0, 36_864]),
        ] {
            let g = Rec {
                bulk,
                ..Default::default()
            };
            for (k, m) in [(8192, 4096), (2048, 4096)] {
                let a = [t(TYPE_ROCMFP4, [k, m, 1, 1]), f(k, 1), f(m, 1)];
                run(&g, "test", MMQ_MMA, ops::MATMUL, &OpParams::default(), &a).unwrap();
            }
            let got = g.smem.borrow().clone();
            let runs = "matvec_fp4_runs_q8";
            assert_eq!(got, vec![(runs, want[0]), (runs, want[1])], "room {bulk}");
        }
    }

    /// NORM_MATMUL (ABI 1.8): `wq_b`'s shape in ROCmFP4 for one token is one
    /// `matvec_fp4_runs_q8_norm` launch (the runs kernel's parameters with g and eps, and
    /// its shared memory); Q8_0 weights, or two tokens, take NORM_ROPE's kernel into xn,
    /// then the product; refused before any launch with too short a weight or xn, an odd
    /// row or weights of a type the backend lacks.
    #[test]
    fn norm_then_product() {
        let (k, m) = (1024, 32768);
        let f = |a, b| t(types::F32, [a, b, 1, 1]);
        let mut p = OpParams::default();
        p.f[0] = 1e-6;
        let sig = crate::kernels::signatures();
        let launched = |ty, n, bulk| {
            let g = Rec {
                bulk,
                ..Default::default()
            };
            let a = [t(ty, [k, m, 1, 1]), f(k, n), f(k, 1), f(m, n), f(k, n)];
            run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &a).unwrap();
            for &(name, _, np) in g.launches.borrow().iter() {
                assert_eq!(sig.get(name), Some(&(np + 1)), "{name}'s parameters");
            }
            let l: Vec<_> = g.launches.borrow().iter().map(|l| l.0).collect();
            let smem = g.smem.borrow().clone();
            (l, smem)
        };
        let (l, smem) = launched(TYPE_ROCMFP4, 1, 214_000);
        assert_eq!(l, ["matvec_fp4_runs_q8_norm"]);
        assert_eq!(smem, [("matvec_fp4_runs_q8_norm", 73_728)]);
        let (l, _) = launched(TYPE_Q8_0, 1, 0);
        assert_eq!(l.first(), Some(&"ds4_norm_rope"));
        assert!(l.len() >= 2 && !l.contains(&"matvec_fp4_runs_q8_norm"));
        let (l, _) = launched(TYPE_ROCMFP4, 2, 0);
        assert_eq!(l.first(), Some(&"ds4_norm_rope"));
        let g = Rec::default();
        let mut bad = [
            t(TYPE_ROCMFP4, [k, m, 1, 1]),
            f(k, 1),
            f(k / 2, 1),
            f(m, 1),
            f(k, 1),
        ];
        let e = run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &bad).unwrap_err();
        assert!(e.contains("norm_matmul: weight of 512"), "{e}");
        bad[2] = f(k, 1);
        bad[4] = f(k / 2, 1);
        let e = run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &bad).unwrap_err();
        assert!(e.contains("normed input of 512"), "{e}");
        let e = run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &bad[..4]).unwrap_err();
        assert!(e.contains("expected 5"), "{e}");
        let odd = [
            t(types::F32, [7, 4, 1, 1]),
            f(7, 1),
            f(7, 1),
            f(4, 1),
            f(7, 1),
        ];
        let e = run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &odd).unwrap_err();
        assert!(e.contains("an even 7"), "{e}");
        let unknown = [t(9999, [k, 4, 1, 1]), f(k, 1), f(k, 1), f(4, 1), f(k, 1)];
        let e = run(&g, "test", MMQ_MMA, ops::NORM_MATMUL, &p, &unknown).unwrap_err();
        assert!(e.contains("matmul weights"), "{e}");
        assert!(g.launches.borrow().is_empty());
    }

    /// ROUTER with its product (ABI 1.7): one `ds4_router_mm` launch, a block per two
    /// experts, for a token; for two, the product as MATMUL runs it, then `ds4_router`;
    /// refused before any launch, in either form, with sync words of another type,
    /// weights that do not match x or the logits, or too small a weights output.
    #[test]
    fn router_with_product() {
        let (d, e, k) = (4096, 256, 6);
        let f = |a, b| t(types::F32, [a, b, 1, 1]);
        let i = |a, b| t(types::I32, [a, b, 1, 1]);
        let args = |n| {
            let (tab, tok) = (i(k, 1), i(n, 1));
            [
                f(e, n),
                f(e, 1),
                tab,
                tok,
                i(k, n),
                f(k, n),
                f(d, n),
                f(d, e),
                i(n, 1),
            ]
        };
        let mut p = OpParams::default();
        p.f[0] = 1.5;
        p.i[..3].copy_from_slice(&[4, 1, 1]);
        let sig = crate::kernels::signatures();
        let launched = |n| {
            let g = Rec::default();
            run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &args(n)).unwrap();
            let l = g.launches.borrow().clone();
            for &(name, _, np) in &l {
                assert_eq!(sig.get(name), Some(&(np + 1)), "{name}'s parameters");
            }
            l.iter().map(|l| (l.0, l.1)).collect::<Vec<_>>()
        };
        assert_eq!(launched(1), [("ds4_router_mm", (128, 1, 1))]);
        let two = launched(2);
        assert_eq!(two.last(), Some(&("ds4_router", (2, 1, 1))));
        assert!(two.len() >= 2 && !two.iter().any(|l| l.0 == "ds4_router_mm"));
        let g = Rec::default();
        let mut bad = args(1);
        bad[8] = f(1, 1);
        let err = run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &bad).unwrap_err();
        assert!(err.contains("router sync words"), "{err}");
        let mut bad = args(1);
        bad[7] = f(d / 2, e);
        let err = run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &bad).unwrap_err();
        assert!(err.contains("router: weights"), "{err}");
        // Logits as two tokens of E / 2 against one token's x and E rows of weights.
        let mut bad = args(1);
        bad[0] = f(e / 2, 2);
        let err = run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &bad).unwrap_err();
        assert!(err.contains("router: weights"), "{err}");
        // Two tokens (the product as MATMUL, then ROUTER): a bad part fails before both.
        let mut bad = args(2);
        bad[8] = f(2, 1);
        let err = run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &bad).unwrap_err();
        assert!(err.contains("router sync words"), "{err}");
        let mut bad = args(2);
        bad[5] = f(k, 1);
        let err = run(&g, "test", MMQ_MMA, ops::ROUTER, &p, &bad).unwrap_err();
        assert!(err.contains("router weights"), "{err}");
        assert!(g.launches.borrow().is_empty());
    }

    fn t(type_id: u32, dims: [u64; 4]) -> TensorRef {
        TensorRef {
            buffer: 1,
            offset: 0,
            type_id,
            variant: FP2_TWO_SCALE,
            dims,
        }
    }

    #[test]
    fn launch_sequences() {
        let g = Rec::default();
        let w = t(107, [64, 4, 1, 1]);
        let f = |k, n| t(types::F32, [k, n, 1, 1]);
        let go =
            |op, a: &[TensorRef]| run(&g, "test", MMQ_MMA, op, &OpParams::default(), a).unwrap();
        go(ops::MATMUL, &[w, f(64, 2), f(4, 2)]);
        go(ops::MATMUL, &[w, f(64, 9), f(4, 9)]);
        let we = t(107, [64, 4, 3, 1]);
        let ids = t(types::I32, [2, 1, 1, 1]);
        go(ops::MATMUL_ID, &[we, f(64, 1), ids, f(4, 2)]);
        // Prefill-sized products of Q8_0: the MMQ tiles (dense, and grouped with 4+
        // pairs per expert).
        go(
            ops::MATMUL,
            &[t(TYPE_Q8_0, [64, 4, 1, 1]), f(64, 16), f(4, 16)],
        );
        let ids12 = t(types::I32, [2, 6, 1, 1]);
        go(
            ops::MATMUL_ID,
            &[t(TYPE_Q8_0, [64, 4, 3, 1]), f(64, 6), ids12, f(4, 12)],
        );
        go(ops::ADD, &[f(8, 1); 3]);
        let rows = [w, t(types::I32, [2, 1, 1, 1]), f(64, 2)];
        go(ops::GET_ROWS, &rows);
        // Two one-token type-107 products of one input: one quantisation, one launch.
        let ids1 = t(types::I32, [2, 1, 1, 1]);
        go(
            ops::MATMUL_ID_MULTI,
            &[f(64, 1), ids1, we, f(4, 2), we, f(4, 2)],
        );
        // Two Q8_0 products of one column in one launch; the type-107 one alone.
        let q = t(TYPE_Q8_0, [64, 40, 1, 1]);
        go(
            ops::MATMUL_MULTI,
            &[f(64, 1), q, f(40, 1), w, f(4, 1), q, f(40, 1)],
        );
        // The down product of SwiGLU(gate, up): one token of type 107 quantises the
        // SwiGLU itself; Q8_0 experts run SWIGLU, then their MATMUL_ID.
        let swiglu_id = |w, m| [w, f(64, 2), f(64, 2), ids1, f(m, 2), f(64, 2)];
        go(ops::SWIGLU_MATMUL_ID, &swiglu_id(we, 4));
        go(
            ops::SWIGLU_MATMUL_ID,
            &swiglu_id(t(TYPE_Q8_0, [64, 40, 3, 1]), 40),
        );
        // A decode step's ROCmFP4 shared-expert down as one expert: the runs kernel
        // computes the SwiGLU (k whole runs, 4096 rows).
        let one = t(types::I32, [1, 1, 1, 1]);
        let (fk, fm) = (2048, 4096);
        go(
            ops::SWIGLU_MATMUL_ID,
            &[
                t(TYPE_ROCMFP4, [fk, fm, 1, 1]),
                f(fk, 1),
                f(fk, 1),
                one,
                f(fm, 1),
                f(fk, 1),
            ],
        );
        let (name, _, np) = *g.launches.borrow().last().unwrap();
        let sig = crate::kernels::signatures();
        assert_eq!(sig.get(name), Some(&(np + 1)), "{name}'s parameters");
        let names: Vec<_> = g.launches.borrow().iter().map(|l| (l.0, l.2)).collect();
        assert_eq!(
            names,
            [
                ("quantize_q8_1", 4),
                ("mmvq_107_n2", 6),
                ("quantize_q8_1", 4),
                (MMQ_MMA, 7),
                ("quantize_q8_1", 4),
                ("mmvq_id_107", 14),
                ("quantize_q8_1", 4),
                ("mmq_mma_dense", 9),
                ("quantize_q8_1", 4),
                ("moe_sort", 6),
                ("mmq_mma_id", 15),
                ("add_f32", 4),
                ("get_rows_107", 6),
                ("quantize_q8_1", 4),
                ("mmvq_id_107", 14),
                ("quantize_q8_1", 4),
                ("mmvq_107_n1", 6),
                ("matvec_dense_rows_multi", 5),
                ("quantize_q8_1_swiglu", 6),
                ("mmvq_id_107", 14),
                ("ds4_swiglu", 5),
                ("matvec_dense_rows_id", 13),
                ("matvec_fp4_runs_q8_id_swiglu", 15),
            ]
        );
        // Refused: an up of another shape, or not F32.
        for (up, why) in [
            (f(32, 2), "differ in shape"),
            (t(types::F16, [64, 2, 1, 1]), "must be F32"),
        ] {
            let bad = [we, f(64, 2), up, ids1, f(4, 2), f(64, 2)];
            let p = OpParams::default();
            let e = run(&g, "test", MMQ_MMA, ops::SWIGLU_MATMUL_ID, &p, &bad).unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        assert_eq!(g.scratch.borrow()[..2], [2 * 2 * 40, 9 * 2 * 40]);
        let e = run(&g, "test", MMQ_MMA, 99, &OpParams::default(), &[]).unwrap_err();
        assert_eq!(e, "op 99 is not supported by the test backend");
    }

    /// The tests that force `FORCE_HC_GSYNC` (a process-wide switch) take turns.
    static GSYNC_TESTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// HC_POST_PRE's tensors for d = 4096, 4 streams, n tokens (`head`: the head's pre
    /// only), then `post` inputs.
    fn post_pre_args(n: u64, head: bool, post: &[TensorRef]) -> Vec<TensorRef> {
        let (d, hc) = (4096, 4);
        let nm = if head { hc } else { 2 * hc + hc * hc };
        let f = |a: u64, b: u64, c: u64| t(types::F32, [a, b, c, 1]);
        let mut a = vec![
            f(d, hc, n),
            f(hc * d, nm, 1),
            f(if head { 1 } else { 3 }, 1, 1),
            f(nm, 1, 1),
            f(d, 1, 1),
            f(d, n, 1),
            f(24, n, 1),
            f(nm, n, 1),
            t(types::I32, [n, 1, 1, 1]),
        ];
        a.extend_from_slice(post);
        a
    }

    #[test]
    fn hc_post_pre_fuses_decode_steps_and_runs_its_parts_otherwise() {
        let _one = GSYNC_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let f = |a: u64, b: u64, c: u64| t(types::F32, [a, b, c, 1]);
        let site = OpParams {
            f: [1e-6, 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            ..Default::default()
        };
        let mut head = site;
        head.i[1] = 1;
        let sig = crate::kernels::signatures();
        let names = |p: &OpParams, a: &[TensorRef]| {
            let g = Rec::default();
            run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, p, a).unwrap();
            let l = g.launches.into_inner();
            for (name, _, np) in &l {
                assert_eq!(sig.get(*name), Some(&(np + 1)), "{name}'s parameters");
            }
            (l, g.scratch.into_inner())
        };
        // One token, each kind of post input: one launch, 4096 / (512 / 4) = 32 blocks,
        // each with 25 partial sums in scratch, 35 with the Gram shares of blocks that
        // wait for each other (the default where the device has 32 multiprocessors).
        let moe = [f(4096, 6, 1), f(6, 1, 1), f(4096, 1, 1)];
        for (force, share) in [(1, 35), (2, 25)] {
            crate::ds4::FORCE_HC_GSYNC.store(force, std::sync::atomic::Ordering::Relaxed);
            for post in [&[][..], &moe[..1], &moe[..2], &moe[..]] {
                let (l, sc) = names(&site, &post_pre_args(1, false, post));
                assert_eq!(l, [("ds4_hc_post_pre", (32, 1, 1), 36)]);
                assert_eq!(sc, [32 * share * 4]);
            }
        }
        crate::ds4::FORCE_HC_GSYNC.store(0, std::sync::atomic::Ordering::Relaxed);
        let (l, _) = names(&head, &post_pre_args(1, true, &moe[..1]));
        assert_eq!(l, [("ds4_hc_post_pre", (32, 1, 1), 36)]);
        // Longer chunks, and the head's weights for 2 tokens: HC_POST, the mixes (from 16
        // columns on tiles over slices of k, added up after), HC_PRE.
        let (l, _) = names(&site, &post_pre_args(17, false, &[f(4096, 17, 1)]));
        let l: Vec<_> = l.iter().map(|x| x.0).collect();
        assert_eq!(
            l,
            [
                "ds4_hc_post",
                "matmul_f32_tiles",
                "matmul_f32_reduce",
                "ds4_hc_pre"
            ]
        );
        let (l, _) = names(&head, &post_pre_args(2, true, &[]));
        let l: Vec<_> = l.iter().map(|x| x.0).collect();
        assert_eq!(l, ["matvec_dense", "ds4_hc_pre"]);
        // Refused: too few tensors, counters not I32, mix weights of another shape.
        let g = Rec::default();
        let mut bad = post_pre_args(1, false, &[]);
        let e = run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site, &bad[..8]).unwrap_err();
        assert!(e.contains("expected 9 to 12"), "{e}");
        bad[8] = f(1, 1, 1);
        let e = run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site, &bad).unwrap_err();
        assert!(e.contains("hc_post_pre counters"), "{e}");
        let mut bad = post_pre_args(1, false, &[]);
        bad[1] = f(4096, 24, 1);
        let e = run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site, &bad).unwrap_err();
        assert!(e.contains("mix weights"), "{e}");
        assert!(g.launches.borrow().is_empty());
    }

    /// HC_POST_PRE's routing (i[4] = 1, ABI 1.11): blocks that wait for each other
    /// route in the site's one launch (its parameters as the kernel's signature has
    /// them); the last-block form, and the hash table's experts, run ROUTER after it;
    /// too few routing arguments are refused before any launch.
    #[test]
    fn hc_post_pre_routes_in_the_site() {
        let _one = GSYNC_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        // The host's limits are the kernel's.
        let src = include_str!("../../../kernels/gpu/ds4.cu");
        for (name, v) in crate::ds4::HCF_LIMITS {
            let line = format!("#define {name} {v}");
            let ends = |r: &str| r.is_empty() || r.starts_with(' ');
            let found = src.lines().any(|l| l.strip_prefix(&line).is_some_and(ends));
            assert!(found, "{line}");
        }
        let (d, e, k) = (4096, 256, 6);
        let f = |a, b| t(types::F32, [a, b, 1, 1]);
        let i = |a, b| t(types::I32, [a, b, 1, 1]);
        let site = |mode: i64| {
            let mut p = OpParams {
                f: [1e-6, 1e-6, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0],
                ..Default::default()
            };
            p.i[4] = 1;
            p.i[5..8].copy_from_slice(&[4, 1, mode]);
            p
        };
        let mut a = post_pre_args(1, false, &[f(d, 1)]);
        // ROUTER's nine: logits, bias, table, tokens, ids, weights, x (the site's out),
        // the router's weights, sync words.
        a.extend([
            f(e, 1),
            f(e, 1),
            i(k, 1),
            i(1, 1),
            i(k, 1),
            f(k, 1),
            f(d, 1),
            f(d, e),
            i(1, 1),
        ]);
        let sig = crate::kernels::signatures();
        let names = |p: &OpParams, a: &[TensorRef]| {
            let g = Rec::default();
            run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, p, a).unwrap();
            let l = g.launches.into_inner();
            for &(name, _, np) in &l {
                assert_eq!(sig.get(name), Some(&(np + 1)), "{name}'s parameters");
            }
            l.iter().map(|l| (l.0, l.1)).collect::<Vec<_>>()
        };
        crate::ds4::FORCE_HC_GSYNC.store(1, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(names(&site(1), &a), [("ds4_hc_post_pre", (32, 1, 1))]);
        let hashed = names(&site(2), &a);
        assert_eq!(hashed.len(), 2, "{hashed:?}");
        assert_eq!(hashed[1].0, "ds4_router_mm");
        crate::ds4::FORCE_HC_GSYNC.store(2, std::sync::atomic::Ordering::Relaxed);
        let last_block = names(&site(1), &a);
        assert_eq!(
            last_block,
            [
                ("ds4_hc_post_pre", (32, 1, 1)),
                ("ds4_router_mm", (128, 1, 1))
            ]
        );
        crate::ds4::FORCE_HC_GSYNC.store(0, std::sync::atomic::Ordering::Relaxed);
        let g = Rec::default();
        let err = run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site(1), &a[..8]).unwrap_err();
        assert!(err.contains("ROUTER's 9 arguments"), "{err}");
        let mut bad = a.clone();
        bad[a.len() - 2] = f(d / 2, e);
        let err = run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site(1), &bad).unwrap_err();
        assert!(err.contains("router: weights"), "{err}");
        assert!(g.launches.borrow().is_empty());
    }

    /// HC_POST_PRE's xq (i[3] = 1, ABI 1.10) and MATMUL_ID_MULTI reading it (i[0] = 1).
    #[test]
    fn hc_post_pre_quantises_x_for_the_grouped_products() {
        let _one = GSYNC_TESTS.lock().unwrap_or_else(|e| e.into_inner());
        let f = |a: u64, b: u64, c: u64| t(types::F32, [a, b, c, 1]);
        let mut site = OpParams {
            f: [1e-6, 1e-6, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
            ..Default::default()
        };
        site.i[3] = 1;
        let with_xq = |n: u64, post: &[TensorRef], xq: TensorRef| {
            let mut a = post_pre_args(n, false, post);
            a.push(xq);
            a
        };
        let xq = |values: u64| TensorRef {
            offset: 0x4000_0000,
            ..t(types::I32, [values, 1, 1, 1])
        };
        let names = |a: &[TensorRef]| {
            let g = Rec::default();
            run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site, a).unwrap();
            g.launches.into_inner()
        };
        let block = [f(4096, 1, 1)];
        // Blocks that wait for each other store xq themselves; the last-block form and
        // longer chunks quantise x (out) after.
        crate::ds4::FORCE_HC_GSYNC.store(1, std::sync::atomic::Ordering::Relaxed);
        let l = names(&with_xq(1, &block, xq(2048)));
        assert_eq!(l, [("ds4_hc_post_pre", (32, 1, 1), 36)]);
        crate::ds4::FORCE_HC_GSYNC.store(2, std::sync::atomic::Ordering::Relaxed);
        let l = names(&with_xq(1, &block, xq(2048)));
        assert_eq!(
            l,
            [
                ("ds4_hc_post_pre", (32, 1, 1), 36),
                ("quantize_q8_1", (16, 1, 1), 4)
            ]
        );
        crate::ds4::FORCE_HC_GSYNC.store(0, std::sync::atomic::Ordering::Relaxed);
        let l = names(&with_xq(17, &[f(4096, 17, 1)], xq(17 * 2048)));
        let l: Vec<_> = l.iter().map(|x| x.0).collect();
        assert_eq!(l.last(), Some(&"quantize_q8_1"));
        // Refused before any launch: xq too small, not I32, rows not whole q8_1 blocks.
        let g = Rec::default();
        let go = |a: &[TensorRef]| run(&g, "test", MMQ_MMA, ops::HC_POST_PRE, &site, a);
        let e = go(&with_xq(1, &block, xq(2047))).unwrap_err();
        assert!(e.contains("hc_post_pre xq: 2047 values, need 2048"), "{e}");
        let e = go(&with_xq(1, &block, f(2048, 1, 1))).unwrap_err();
        assert!(e.contains("hc_post_pre xq"), "{e}");
        let mut odd = with_xq(1, &[], xq(2048));
        odd[0] = f(1000, 4, 1);
        odd[1] = f(4000, 24, 1);
        odd[4] = f(1000, 1, 1);
        odd[5] = f(1000, 1, 1);
        let e = go(&odd).unwrap_err();
        assert!(e.contains("multiple of 32 values, got 1000"), "{e}");
        assert!(g.launches.borrow().is_empty());
        // The gate and up products read xq: no quantize_q8_1, one grouped launch whose
        // input pointer is xq's.
        let g = Rec::default();
        let (we, ids) = (t(107, [64, 4, 3, 1]), t(types::I32, [2, 1, 1, 1]));
        let mut p = OpParams::default();
        p.i[0] = 1;
        let a = [f(64, 1, 1), ids, xq(32), we, f(4, 2, 1), we, f(4, 2, 1)];
        run(&g, "test", MMQ_MMA, ops::MATMUL_ID_MULTI, &p, &a).unwrap();
        let l: Vec<_> = g.launches.borrow().iter().map(|x| x.0).collect();
        assert_eq!(l, ["mmvq_id_107"]);
        // Without the flag the same arguments are x, ids and an odd list of pairs.
        let e = run(
            &g,
            "test",
            MMQ_MMA,
            ops::MATMUL_ID_MULTI,
            &OpParams::default(),
            &a,
        )
        .unwrap_err();
        assert!(e.contains("got 7 tensor arguments"), "{e}");
        let e = run(&g, "test", MMQ_MMA, ops::MATMUL_ID_MULTI, &p, &a[..2]).unwrap_err();
        assert!(e.contains("expected x, ids, xq"), "{e}");
    }
}
