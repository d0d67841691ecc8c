//! `run_op` for the HIP backend, the CUDA backend's ops on the same kernels: MATMUL with
//! ROCmFP2 (type 107) weights (MMVQ for n <= 8 columns, MMQ above: `mmq_mma_107` on
//! WMMA for gfx1100/gfx1151, else the dp4a tiled `mmq_dp4a_107`), the grouped MoE
//! mat-vec (backend-private op [`OP_MATMUL_ID`]), GET_ROWS and ADD. Validation and
//! launch planning live in `moe_gpu_common::ops` (shared with the CUDA backend); this
//! file allocates and launches.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::{c_int, c_void},
    sync::{Mutex, OnceLock},
};

use moe_gpu_common::ops::{self as plan, bytes_of, check_placement, Launch};
pub use moe_gpu_common::ops::{FP2_AFFINE, FP2_TWO_SCALE, OP_MATMUL_ID, TYPE_Q2_0_ROCMFP2};
use moe_plugin_api::{ops, OpParams, TensorRef};

use crate::{bind, checked, get, kernels::Module, Hip, Ptr, STREAMS};

type DevPtr = u64;

/// Forces the dp4a MMQ kernel even where the tensor-core one runs (benchmarks and
/// parity comparisons only; off by default).
pub static FORCE_MMQ_DP4A: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// The MMQ kernel MATMUL uses for more than 8 columns on a device of arch `arch`:
/// `mmq_mma_107` (WMMA int8) on gfx1100/gfx1151, else `mmq_dp4a_107`.
pub fn mmq_kernel(arch: &str) -> &'static str {
    if matches!(arch, "gfx1100" | "gfx1151")
        && !FORCE_MMQ_DP4A.load(std::sync::atomic::Ordering::Relaxed)
    {
        plan::MMQ_MMA
    } else {
        plan::MMQ_DP4A
    }
}

/// Device pointer of a tensor, bounds- and alignment-checked, on `device`.
fn ptr(t: &TensorRef, device: u32, align: u64) -> Result<DevPtr, String> {
    let len = usize::try_from(bytes_of(t, "hip")?).map_err(|_| "tensor too large".to_string())?;
    let (b, p) = checked(t.buffer, t.offset, len)?;
    check_placement(t, p as u64, b.device, device, align)
}

/// Per-stream scratch memory (q8 activations, expert lists); ops on one stream run in
/// order, so one region per stream is enough.
static SCRATCH: OnceLock<Mutex<HashMap<u64, (usize, usize)>>> = OnceLock::new();

fn scratch(c: &Ctx, stream: u64, bytes: usize) -> Result<DevPtr, String> {
    let mut map = SCRATCH
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(&(p, len)) = map.get(&stream) {
        if len >= bytes {
            return Ok(p as u64);
        }
        // SAFETY: wait for queued work that may still read the old region: any stream's
        // (a graph of another stream may hold a branch that ran on this one).
        unsafe {
            c.hip
                .check("hipDeviceSynchronize", (c.hip.device_synchronize)())?;
            let _ = (c.hip.free)(p as Ptr);
        }
        drop_graphs(c.hip);
        map.remove(&stream);
    }
    let len = plan::scratch_len(bytes);
    let mut p: Ptr = std::ptr::null_mut();
    // SAFETY: plain allocation on the current device.
    c.hip.check("hipMalloc (scratch)", unsafe {
        (c.hip.malloc)(&mut p, len)
    })?;
    map.insert(stream, (p as usize, len));
    Ok(p as u64)
}

/// Instantiated graphs per (stream, key).
struct Exec(Ptr);
// SAFETY: a graph exec handle is usable from any thread of the process.
unsafe impl Send for Exec {}
static GRAPHS: Mutex<BTreeMap<(u64, i64), Exec>> = Mutex::new(BTreeMap::new());

fn graphs() -> std::sync::MutexGuard<'static, BTreeMap<(u64, i64), Exec>> {
    GRAPHS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Drops every stream's graphs: one may have recorded another stream's scratch (a
/// branch forked to it), so a scratch region moving invalidates them all.
fn drop_graphs(hip: &Hip) {
    let Some(g) = &hip.graph else { return };
    for (_, e) in std::mem::take(&mut *graphs()) {
        // SAFETY: no launch of it on this device is queued past the synchronisation
        // before this (graphs of other devices may still run: multi-device steps are
        // refused today).
        unsafe {
            let _ = (g.exec_destroy)(e.0);
        }
    }
}

/// hipStreamCaptureModeRelaxed: other threads' calls are not checked against the capture.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// GRAPH_BEGIN / GRAPH_END / GRAPH_LAUNCH on a bound stream (as the CUDA backend does).
fn graph_op(hip: &Hip, stream_id: u64, raw: Ptr, op: u32, key: i64) -> Result<(), String> {
    let g = hip
        .graph
        .as_ref()
        .ok_or_else(|| "graph capture is not supported by this HIP runtime".to_string())?;
    // SAFETY: `raw` is a live stream of the bound device; graphs are only used on the
    // stream that recorded them.
    unsafe {
        match op {
            ops::GRAPH_BEGIN => hip.check(
                "hipStreamBeginCapture",
                (g.begin_capture)(raw, CAPTURE_MODE_RELAXED),
            ),
            ops::GRAPH_END => {
                let mut graph: Ptr = std::ptr::null_mut();
                hip.check("hipStreamEndCapture", (g.end_capture)(raw, &mut graph))?;
                let mut exec: Ptr = std::ptr::null_mut();
                let r = (g.instantiate)(
                    &mut exec,
                    graph,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    0,
                );
                let _ = (g.destroy)(graph);
                hip.check("hipGraphInstantiate", r)?;
                if let Some(old) = graphs().insert((stream_id, key), Exec(exec)) {
                    let _ = (g.exec_destroy)(old.0);
                }
                Ok(())
            }
            _ => {
                let map = graphs();
                let e = map
                    .get(&(stream_id, key))
                    .ok_or_else(|| format!("graph {key} is not recorded on stream {stream_id}"))?;
                hip.check("hipGraphLaunch", (g.launch)(e.0, raw))
            }
        }
    }
}

pub fn run(stream_id: u64, op: u32, p: &OpParams, args: &[TensorRef]) -> Result<(), String> {
    let s = get(&STREAMS, stream_id, "stream")?;
    let hip = bind(s.device)?;
    if matches!(op, ops::GRAPH_BEGIN | ops::GRAPH_END | ops::GRAPH_LAUNCH) {
        return graph_op(hip, stream_id, s.ptr as Ptr, op, p.i[0]);
    }
    let rt = crate::runtime()?;
    let c = Ctx {
        hip,
        module: rt.module(s.device)?,
        device: s.device,
        arch: rt.devices[s.device as usize].arch.as_str(),
        raw: s.ptr as Ptr,
        stream: stream_id,
    };
    plan::run(&c, "hip", mmq_kernel(c.arch), op, p, args)
}

/// What one op needs: the runtime, the device's kernels and the stream.
struct Ctx<'a> {
    hip: &'static Hip,
    module: &'static Module,
    device: u32,
    arch: &'a str,
    raw: Ptr,
    stream: u64,
}

impl plan::Gpu for Ctx<'_> {
    fn ptr(&self, t: &TensorRef, align: u64) -> Result<u64, String> {
        ptr(t, self.device, align)
    }

    fn scratch(&self, bytes: usize) -> Result<u64, String> {
        scratch(self, self.stream, bytes)
    }

    unsafe fn launch(&self, l: Launch, params: &[*mut c_void]) -> Result<(), String> {
        self.module
            .launch(self.hip, self.raw, l.name, l.grid, l.block, params)
    }
}
