//! `run_op` for the CUDA backend: MATMUL with ROCmFP2 (type 107) weights (MMVQ for
//! n <= 8 columns, MMQ above: `mmq_mma_107` on tensor cores for sm_80+, else the dp4a
//! tiled `mmq_dp4a_107`) and dense weights, MATMUL_ID, GET_ROWS, ADD and the DeepSeek-V4
//! glue ops. Validation and launch planning live in `moe_gpu_common` (shared with the
//! HIP backend); this file allocates, launches, and records / replays CUDA graphs.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::c_void,
    sync::{
        atomic::{AtomicBool, AtomicU32, AtomicU8, Ordering},
        Mutex, OnceLock,
    },
};

use cudarc::driver::{result as cu, sys};
pub use moe_gpu_common::ds4::{
    FORCE_ATT_BF16, FORCE_ATT_DEC, FORCE_ATT_GRP, FORCE_ATT_HPW4, FORCE_ATT_TC, FORCE_HC_GSYNC,
    FORCE_IDX_BF16, FORCE_IDX_TCS,
};
use moe_gpu_common::ops::{self as plan, bytes_of, check_placement, Launch};
pub use moe_gpu_common::ops::{
    fp4_b2, id_nosort, FORCE_FP4_MMA, FORCE_Q8_DECODE, FP2_AFFINE, FP2_TWO_SCALE, OP_MATMUL_ID,
    TYPE_Q2_0_ROCMFP2,
};
use moe_plugin_api::{ops, OpParams, TensorRef};

use crate::{
    kernels::Module,
    rt::{self, err},
};

/// Forces the dp4a MMQ kernel even where the tensor-core one runs (benchmarks and
/// parity comparisons only; off by default).
pub static FORCE_MMQ_DP4A: AtomicBool = AtomicBool::new(false);
/// Tests: the bf16 MMB tiles whatever `MOE_GPU_MMB` says (see `bf16_tiles`).
pub static FORCE_MMB: AtomicBool = AtomicBool::new(false);
/// Tests: the bf16 tiles' streamed form as `MOE_GPU_MMB` says (0), on (1: with
/// FORCE_MMB or a mode that takes the bf16 tiles) or off (2); see `bf16_streamed`.
pub static FORCE_MMW: AtomicU8 = AtomicU8::new(0);
/// Tests: rows a warp of the streamed tiles as `MOE_GPU_MMW_ROWS` says (0), or 16 / 32
/// (`mmw_*_m2`); see `bf16_streamed_rows`.
pub static FORCE_MMW_ROWS: AtomicU32 = AtomicU32::new(0);
/// Tests: the streamed tiles given room for narrow tiles only (a grouped list over 16
/// pairs then runs as narrow tiles).
pub static FORCE_MMW_NARROW: AtomicBool = AtomicBool::new(false);
/// Tests: the ROCmFP4 runs kernels on their register path even where the device gives
/// them room for their bulk copies (see `bulk_smem`), to compare the two paths' bits.
pub static FORCE_FP4_REGS: AtomicBool = AtomicBool::new(false);

/// `MOE_GPU_MMB`: which prefill products of type 107 / ROCmFP4 take the bf16 tiles, and
/// whether in their streamed form (`mmw_dense` / `mmw_id`). Unset or `stream`: all of
/// them, streamed (the default since 2026-12-05: pp512 +34% at depth 0 on the H200, and
/// closer to the CPU than the int8 tiles); `0`: the int8 tiles (MMQ); `1` / `wide`: the
/// unstreamed bf16 tiles (all / only products of 64+ columns an expert); `stream-wide`:
/// the streamed ones for 64+ columns. Read once.
fn mmb_env() -> (MmbMode, bool) {
    static MODE: std::sync::OnceLock<(MmbMode, bool)> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("MOE_GPU_MMB").as_deref() {
        Ok("0") => (MmbMode::Off, false),
        Ok("1") => (MmbMode::All, false),
        Ok("wide") => (MmbMode::Wide, false),
        Ok("stream-wide") => (MmbMode::Wide, true),
        _ => (MmbMode::All, true),
    })
}

/// `MOE_GPU_MMW_ROWS`: rows a warp of the streamed bf16 tiles, 16 (unset) or 32 (A/B
/// runs: the `_m2` kernels, 128 threads a block; the same sums); read once.
fn mmw_rows_env() -> u32 {
    static ROWS: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *ROWS.get_or_init(|| match std::env::var("MOE_GPU_MMW_ROWS").as_deref() {
        Ok("32") => 32,
        _ => 16,
    })
}

/// Which prefill products `MOE_GPU_MMB` sends to the bf16 tiles: none (`0`), all
/// (unset, `stream`, `1`), or (`wide`, `stream-wide`) those with at least a whole
/// tile's columns (MMA_BN, 64) an expert:
/// the dense products and the output projection's groups of a long chunk, not the routed
/// experts' few tokens each (the bf16 decode of a staged weight is paid once a tile).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MmbMode {
    Off,
    All,
    Wide,
}

/// The MMQ kernel MATMUL uses for more than 8 columns on a device of compute capability
/// `cc`: `mmq_mma_107` (mma.sync int8) from sm_80, else `mmq_dp4a_107`.
pub fn mmq_kernel(cc: (i32, i32)) -> &'static str {
    if cc.0 >= 8 && !FORCE_MMQ_DP4A.load(Ordering::Relaxed) {
        plan::MMQ_MMA
    } else {
        plan::MMQ_DP4A
    }
}

/// Device pointer of a tensor, bounds- and alignment-checked, on `device`.
fn ptr(t: &TensorRef, device: u32, align: u64) -> Result<sys::CUdeviceptr, String> {
    let (b, p) = rt::range(t.buffer, t.offset, bytes_of(t, "cuda")?)?;
    check_placement(t, p, b.device, device, align)
}

/// Per-stream scratch memory (q8 activations, expert lists); ops on one stream run in
/// order, so one region per stream is enough.
static SCRATCH: OnceLock<Mutex<HashMap<u64, (sys::CUdeviceptr, usize)>>> = OnceLock::new();

fn scratch(stream: u64, bytes: usize) -> Result<sys::CUdeviceptr, String> {
    let mut map = SCRATCH
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&(p, len)) = map.get(&stream) {
        if len >= bytes {
            return Ok(p);
        }
        // SAFETY: wait for queued work that may still read the old region: any stream's
        // of the device (a graph of another stream may hold a branch that ran on this one).
        unsafe {
            cu::ctx::synchronize().map_err(|e| err("cuCtxSynchronize", e))?;
            let _ = cu::free_sync(p);
        }
        drop_graphs();
        map.remove(&stream);
    }
    let len = plan::scratch_len(bytes);
    // SAFETY: plain allocation in the bound context.
    let p = unsafe { cu::malloc_sync(len) }.map_err(|e| err("cuMemAlloc (scratch)", e))?;
    map.insert(stream, (p, len));
    Ok(p)
}

/// One op's stream on a bound device.
struct Stream<'a> {
    id: u64,
    device: u32,
    raw: sys::CUstream,
    module: &'a Module,
}

impl plan::Gpu for Stream<'_> {
    fn ptr(&self, t: &TensorRef, align: u64) -> Result<u64, String> {
        ptr(t, self.device, align)
    }

    fn scratch(&self, bytes: usize) -> Result<u64, String> {
        scratch(self.id, bytes)
    }

    unsafe fn launch(&self, l: Launch, params: &[*mut c_void]) -> Result<(), String> {
        self.launch_smem(l, 0, params)
    }

    unsafe fn launch_smem(
        &self,
        l: Launch,
        smem: u32,
        params: &[*mut c_void],
    ) -> Result<(), String> {
        self.module
            .launch(self.raw, l.name, l.grid, l.block, smem, params)
    }

    fn bulk_smem(&self) -> u32 {
        match FORCE_FP4_REGS.load(Ordering::Relaxed) {
            true => 0,
            false => self.module.bulk_smem,
        }
    }

    fn l2_prefetch(&self) -> bool {
        self.module.l2_prefetch
    }

    fn grid_sync(&self) -> bool {
        true
    }

    fn multiprocessors(&self) -> u32 {
        rt::runtime()
            .and_then(|r| r.device(self.device))
            .map_or(0, |d| d.multiprocessors.max(0) as u32)
    }

    fn bf16_tiles(&self, cols: u64) -> bool {
        // mma.sync on bf16 and cvt.rn.bf16x2: sm_80 on (older devices keep the int8 tiles).
        let on = match mmb_env().0 {
            MmbMode::All => true,
            MmbMode::Wide => cols >= 64,
            MmbMode::Off => false,
        };
        (on || FORCE_MMB.load(Ordering::Relaxed))
            && rt::runtime()
                .and_then(|r| r.device(self.device))
                .is_ok_and(|d| d.cc.0 >= 8)
    }

    fn bf16_streamed(&self) -> u32 {
        let on = match FORCE_MMW.load(Ordering::Relaxed) {
            0 => mmb_env().1,
            forced => forced == 1,
        };
        let room = match on {
            true => self.module.mmw_smem,
            false => 0,
        };
        match FORCE_MMW_NARROW.load(Ordering::Relaxed) {
            true => room.min(plan::mmw_smem(plan::TYPE_ROCMFP4, 16)),
            false => room,
        }
    }

    fn ds4_tc_smem(&self) -> u32 {
        self.module.ds4_tc_smem
    }

    fn bf16_streamed_rows(&self) -> u32 {
        match FORCE_MMW_ROWS.load(Ordering::Relaxed) {
            0 => mmw_rows_env(),
            forced => forced,
        }
    }
}

/// Instantiated graphs per (stream, key).
struct Exec(sys::CUgraphExec);
// SAFETY: a graph exec handle is usable from any thread of the process.
unsafe impl Send for Exec {}
static GRAPHS: Mutex<BTreeMap<(u64, i64), Exec>> = Mutex::new(BTreeMap::new());

fn graphs() -> std::sync::MutexGuard<'static, BTreeMap<(u64, i64), Exec>> {
    GRAPHS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Forgets every recorded graph: one may hold pointers into a stream's old scratch,
/// its own or a branch's it forked to another stream (a graph still running is freed
/// when it completes).
fn drop_graphs() {
    for (_, e) in std::mem::take(&mut *graphs()) {
        // SAFETY: the handle is no longer reachable; the driver defers an in-flight one.
        unsafe {
            let _ = cu::graph::exec_destroy(e.0);
        }
    }
}

/// GRAPH_BEGIN / GRAPH_END / GRAPH_LAUNCH on a bound stream.
fn graph_op(stream_id: u64, raw: sys::CUstream, op: u32, key: i64) -> Result<(), String> {
    // SAFETY: `raw` is a live stream of the bound context; graphs are only used on the
    // stream that recorded them.
    unsafe {
        match op {
            ops::GRAPH_BEGIN => cu::stream::begin_capture(
                raw,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
            .map_err(|e| err("cuStreamBeginCapture", e)),
            ops::GRAPH_END => {
                let g = cu::stream::end_capture(raw).map_err(|e| err("cuStreamEndCapture", e))?;
                // (node priorities: see rt::stream_prio)
                let flags = if crate::rt::stream_prio() != crate::rt::StreamPrio::Off {
                    sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY
                } else {
                    sys::CUgraphInstantiate_flags(0)
                };
                let exec = cu::graph::instantiate(g, flags);
                let _ = cu::graph::destroy(g);
                let exec = exec.map_err(|e| err("cuGraphInstantiate", e))?;
                if let Some(old) = graphs().insert((stream_id, key), Exec(exec)) {
                    let _ = cu::graph::exec_destroy(old.0);
                }
                Ok(())
            }
            _ => {
                let g = graphs();
                let e = g
                    .get(&(stream_id, key))
                    .ok_or_else(|| format!("graph {key} is not recorded on stream {stream_id}"))?;
                cu::graph::launch(e.0, raw).map_err(|e| err("cuGraphLaunch", e))
            }
        }
    }
}

pub fn run(stream_id: u64, op: u32, p: &OpParams, args: &[TensorRef]) -> Result<(), String> {
    let s = rt::stream(stream_id)?;
    let dev = rt::runtime()?.device(s.device)?;
    dev.bind()?;
    if matches!(op, ops::GRAPH_BEGIN | ops::GRAPH_END | ops::GRAPH_LAUNCH) {
        return graph_op(stream_id, s.raw.0, op, p.i[0]);
    }
    let stream = Stream {
        id: stream_id,
        device: s.device,
        raw: s.raw.0,
        module: dev.module()?,
    };
    plan::run(&stream, "cuda", mmq_kernel(dev.cc), op, p, args)
}
