//! The CUDA runtime state: devices (primary contexts), buffers, streams and events
//! behind the opaque ids of the plugin ABI. Everything goes through the driver API,
//! loaded at run time (cudarc `dynamic-loading`), so a machine without CUDA gets an
//! error saying so instead of a crash.

use std::{
    collections::{HashMap, VecDeque},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, OnceLock,
    },
};

use cudarc::driver::{result as cu, sys};

use crate::kernels::Module;

/// Error text when libcuda cannot be opened.
pub const NO_DRIVER: &str = "no CUDA driver found (libcuda.so could not be loaded)";

/// Raw driver handles are plain pointers; the driver API is thread-safe, and every
/// use here makes the owning context current first.
#[derive(Clone, Copy, Debug)]
pub struct Raw<T>(pub T);
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

pub struct Device {
    pub index: u32,
    pub cu_dev: sys::CUdevice,
    pub ctx: Raw<sys::CUcontext>,
    pub name: String,
    /// `sm_90` etc.
    pub arch: String,
    pub cc: (i32, i32),
    pub memory_bytes: u64,
    pub multiprocessors: i32,
    module: OnceLock<Result<Module, String>>,
    bandwidth: OnceLock<f64>,
}

pub struct Runtime {
    pub devices: Vec<Device>,
}

pub fn err(what: &str, e: impl std::fmt::Debug) -> String {
    format!("{what}: {e:?}")
}

/// The runtime, initialised on first use (driver loaded, devices enumerated).
pub fn runtime() -> Result<&'static Runtime, String> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(init).as_ref().map_err(|e| e.clone())
}

/// Whether libcuda can be opened (never panics).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    std::panic::catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false)
}

fn init() -> Result<Runtime, String> {
    if !driver_present() {
        return Err(NO_DRIVER.into());
    }
    cu::init().map_err(|e| err("cuInit", e))?;
    let n = cu::device::get_count().map_err(|e| err("cuDeviceGetCount", e))?;
    let mut devices = Vec::new();
    for i in 0..n {
        let d = cu::device::get(i).map_err(|e| err("cuDeviceGet", e))?;
        // SAFETY: `d` is a valid device handle.
        let (ctx, mem, major, minor, sms) = unsafe {
            use sys::CUdevice_attribute::*;
            let ctx = cu::primary_ctx::retain(d).map_err(|e| err("cuDevicePrimaryCtxRetain", e))?;
            let mem = cu::device::total_mem(d).map_err(|e| err("cuDeviceTotalMem", e))?;
            let a =
                |at| cu::device::get_attribute(d, at).map_err(|e| err("cuDeviceGetAttribute", e));
            (
                ctx,
                mem,
                a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                a(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                a(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            )
        };
        devices.push(Device {
            index: i as u32,
            cu_dev: d,
            ctx: Raw(ctx),
            name: cu::device::get_name(d).unwrap_or_else(|_| format!("CUDA device {i}")),
            arch: format!("sm_{major}{minor}"),
            cc: (major, minor),
            memory_bytes: mem as u64,
            multiprocessors: sms,
            module: OnceLock::new(),
            bandwidth: OnceLock::new(),
        });
    }
    Ok(Runtime { devices })
}

impl Runtime {
    pub fn device(&self, index: u32) -> Result<&Device, String> {
        self.devices.get(index as usize).ok_or_else(|| {
            format!(
                "the cuda backend has {} device(s); there is no device {index}",
                self.devices.len()
            )
        })
    }
}

impl Device {
    /// Makes this device's context current on the calling thread.
    pub fn bind(&self) -> Result<(), String> {
        // SAFETY: the primary context is retained for the process's lifetime.
        unsafe { cu::ctx::set_current(self.ctx.0) }.map_err(|e| err("cuCtxSetCurrent", e))
    }

    /// The kernels, compiled (or read from the cache) and loaded on first use.
    pub fn module(&self) -> Result<&Module, String> {
        self.module
            .get_or_init(|| {
                self.bind()?;
                Module::load(self)
            })
            .as_ref()
            .map_err(|e| e.clone())
    }

    /// The kernel module if it has been loaded already (never compiles).
    pub fn loaded_module(&self) -> Option<&Result<Module, String>> {
        self.module.get()
    }

    /// Device-to-device copy bandwidth (bytes read + written per second), measured
    /// once with a 256 MiB copy.
    pub fn bandwidth(&self) -> f64 {
        *self
            .bandwidth
            .get_or_init(|| measure_copy_bandwidth(self, 256 << 20, 10).unwrap_or(0.0))
    }
}

/// Times `reps` device-to-device copies of `bytes` and returns (read + written) / s.
pub fn measure_copy_bandwidth(dev: &Device, bytes: usize, reps: usize) -> Result<f64, String> {
    dev.bind()?;
    // SAFETY: plain allocations, copies and events on this device's context.
    unsafe {
        let a = cu::malloc_sync(bytes).map_err(|e| err("cuMemAlloc", e))?;
        let b = cu::malloc_sync(bytes).map_err(|e| err("cuMemAlloc", e))?;
        let run = || -> Result<f64, String> {
            let s = cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| err("cuStreamCreate", e))?;
            let e0 = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| err("cuEventCreate", e))?;
            let e1 = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| err("cuEventCreate", e))?;
            cu::memcpy_dtod_async(b, a, bytes, s).map_err(|e| err("cuMemcpyDtoD", e))?;
            cu::event::record(e0, s).map_err(|e| err("cuEventRecord", e))?;
            for _ in 0..reps {
                cu::memcpy_dtod_async(b, a, bytes, s).map_err(|e| err("cuMemcpyDtoD", e))?;
            }
            cu::event::record(e1, s).map_err(|e| err("cuEventRecord", e))?;
            cu::event::synchronize(e1).map_err(|e| err("cuEventSynchronize", e))?;
            let ms = cu::event::elapsed(e0, e1).map_err(|e| err("cuEventElapsedTime", e))?;
            let _ = cu::event::destroy(e0);
            let _ = cu::event::destroy(e1);
            let _ = cu::stream::destroy(s);
            Ok(2.0 * bytes as f64 * reps as f64 / (ms as f64 * 1e-3).max(1e-12))
        };
        let r = run();
        let _ = cu::free_sync(a);
        let _ = cu::free_sync(b);
        r
    }
}

// ------------------------------------------------------------------------------------
// Buffers, streams, events behind ids.

#[derive(Clone, Copy)]
pub struct Buffer {
    pub device: u32,
    pub ptr: sys::CUdeviceptr,
    pub len: u64,
}

#[derive(Clone, Copy)]
pub struct Stream {
    pub device: u32,
    pub raw: Raw<sys::CUstream>,
}

#[derive(Clone, Copy)]
struct Event {
    device: u32,
    raw: Raw<sys::CUevent>,
}

/// Events kept alive: the ABI has no event_destroy, so an event id stays valid for
/// the next `EVENT_KEEP` records (ample for fork/join within a step).
const EVENT_KEEP: usize = 4096;

#[derive(Default)]
struct Tables {
    buffers: HashMap<u64, Buffer>,
    streams: HashMap<u64, Stream>,
    events: HashMap<u64, Event>,
    event_order: VecDeque<u64>,
}

static TABLES: Mutex<Option<Tables>> = Mutex::new(None);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn with_tables<R>(f: impl FnOnce(&mut Tables) -> R) -> R {
    let mut g = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    f(g.get_or_insert_with(Tables::default))
}

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

pub fn alloc(device: u32, bytes: u64) -> Result<u64, String> {
    let dev = runtime()?.device(device)?;
    dev.bind()?;
    let len =
        usize::try_from(bytes.max(1)).map_err(|_| format!("cannot allocate {bytes} bytes"))?;
    // SAFETY: plain device allocation in the bound context.
    let ptr = unsafe { cu::malloc_sync(len) }.map_err(|e| {
        err(
            &format!("cuMemAlloc of {bytes} bytes on device {device}"),
            e,
        )
    })?;
    let id = next_id();
    with_tables(|t| {
        t.buffers.insert(
            id,
            Buffer {
                device,
                ptr,
                len: bytes,
            },
        )
    });
    Ok(id)
}

pub fn free(id: u64) -> Result<(), String> {
    let b = with_tables(|t| t.buffers.remove(&id))
        .ok_or_else(|| format!("free: unknown buffer {id}"))?;
    runtime()?.device(b.device)?.bind()?;
    // SAFETY: allocated by `alloc`, removed from the table so freed once.
    unsafe { cu::free_sync(b.ptr) }.map_err(|e| err("cuMemFree", e))
}

pub fn buffer(id: u64) -> Result<Buffer, String> {
    with_tables(|t| t.buffers.get(&id).copied()).ok_or_else(|| format!("unknown buffer {id}"))
}

/// Device address of `len` bytes at `offset` of buffer `id`, bounds-checked.
pub fn range(id: u64, offset: u64, len: u64) -> Result<(Buffer, sys::CUdeviceptr), String> {
    let b = buffer(id)?;
    if offset.checked_add(len).is_none_or(|end| end > b.len) {
        return Err(format!(
            "{len} bytes at offset {offset} overrun buffer {id} of {} bytes",
            b.len
        ));
    }
    Ok((b, b.ptr + offset))
}

pub fn upload(id: u64, offset: u64, data: &[u8]) -> Result<(), String> {
    let (b, ptr) = range(id, offset, data.len() as u64)?;
    runtime()?.device(b.device)?.bind()?;
    // SAFETY: destination range checked; synchronous copy.
    unsafe { cu::memcpy_htod_sync(ptr, data) }.map_err(|e| err("cuMemcpyHtoD", e))
}

pub fn download(id: u64, offset: u64, out: &mut [u8]) -> Result<(), String> {
    let (b, ptr) = range(id, offset, out.len() as u64)?;
    runtime()?.device(b.device)?.bind()?;
    // SAFETY: source range checked; synchronous copy (waits for the legacy stream,
    // which the backend's blocking streams synchronise with).
    unsafe { cu::memcpy_dtoh_sync(out, ptr) }.map_err(|e| err("cuMemcpyDtoH", e))
}

/// Stream priorities: the first stream created on a device in this process (the
/// engine's main one, the decode path's critical chain; a second model loaded in the same
/// process gets the default) gets the greatest priority, later ones (the engine's side
/// branches) the default. Launches take their stream's priority (with dependent launch
/// also as an explicit launch attribute) and graphs are instantiated to keep their
/// nodes' (see `graph_op`): where blocks of both wait for a multiprocessor, the main
/// stream's go first (depth-0 decode +1.6% on the H200, 2026-12-04).
/// `MOE_GPU_STREAM_PRIO=0` gives every stream the default; `=ladder` (A/B runs) the
/// n-th stream of a device the greatest + n; `=two` (A/B runs) the first two streams
/// (the engine's main one and its compressor / shared-expert branch) the greatest.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum StreamPrio {
    Off,
    First,
    Two,
    Ladder,
}

pub fn stream_prio() -> StreamPrio {
    static AT: std::sync::OnceLock<StreamPrio> = std::sync::OnceLock::new();
    *AT.get_or_init(|| match std::env::var("MOE_GPU_STREAM_PRIO").as_deref() {
        Ok("0") => StreamPrio::Off,
        Ok("ladder") => StreamPrio::Ladder,
        Ok("two") => StreamPrio::Two,
        _ => StreamPrio::First,
    })
}

pub fn stream_create(device: u32) -> Result<u64, String> {
    runtime()?.device(device)?.bind()?;
    let earlier = with_tables(|t| t.streams.values().filter(|s| s.device == device).count());
    let (mut least, mut greatest) = (0, 0);
    if stream_prio() != StreamPrio::Off {
        // SAFETY: out-parameters; a bound context.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(|e| err("cuCtxGetStreamPriorityRange", e))?;
    }
    // (numerically lower is greater)
    let prio = match stream_prio() {
        StreamPrio::First if earlier == 0 => Some(greatest),
        StreamPrio::Two if earlier < 2 => Some(greatest),
        StreamPrio::Ladder => Some((greatest + earlier as i32).min(least)),
        _ => None,
    };
    // Blocking streams: synchronous copies on the legacy stream order after them.
    let raw = if let Some(prio) = prio {
        let mut raw = std::ptr::null_mut();
        // SAFETY: an out-parameter; a bound context.
        unsafe { sys::cuStreamCreateWithPriority(&mut raw, 0, prio) }
            .result()
            .map_err(|e| err("cuStreamCreateWithPriority", e))?;
        raw
    } else {
        cu::stream::create(cu::stream::StreamKind::Default).map_err(|e| err("cuStreamCreate", e))?
    };
    let id = next_id();
    with_tables(|t| {
        t.streams.insert(
            id,
            Stream {
                device,
                raw: Raw(raw),
            },
        )
    });
    Ok(id)
}

pub fn stream(id: u64) -> Result<Stream, String> {
    with_tables(|t| t.streams.get(&id).copied()).ok_or_else(|| format!("unknown stream {id}"))
}

/// Records a (timing-capable) event on `stream`.
pub fn event_record(stream_id: u64) -> Result<u64, String> {
    let s = stream(stream_id)?;
    runtime()?.device(s.device)?.bind()?;
    let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
        .map_err(|e| err("cuEventCreate", e))?;
    // SAFETY: fresh event, live stream.
    unsafe { cu::event::record(ev, s.raw.0) }.map_err(|e| err("cuEventRecord", e))?;
    let id = next_id();
    let old = with_tables(|t| {
        t.events.insert(
            id,
            Event {
                device: s.device,
                raw: Raw(ev),
            },
        );
        t.event_order.push_back(id);
        if t.event_order.len() > EVENT_KEEP {
            t.event_order
                .pop_front()
                .and_then(|old| t.events.remove(&old))
        } else {
            None
        }
    });
    if let Some(old) = old {
        if runtime()?.device(old.device)?.bind().is_ok() {
            // SAFETY: no longer reachable by id; the driver defers destruction of an
            // event still pending.
            let _ = unsafe { cu::event::destroy(old.raw.0) };
        }
        runtime()?.device(s.device)?.bind()?;
    }
    Ok(id)
}

fn event(id: u64) -> Result<Event, String> {
    with_tables(|t| t.events.get(&id).copied())
        .ok_or_else(|| format!("unknown (or expired) event {id}"))
}

/// Work queued on `stream` after this waits for `event` (of any device).
pub fn stream_wait_event(stream_id: u64, event_id: u64) -> Result<(), String> {
    let s = stream(stream_id)?;
    let e = event(event_id)?;
    runtime()?.device(s.device)?.bind()?;
    // SAFETY: live stream and event; cross-device waits are allowed by the driver.
    unsafe {
        cu::stream::wait_event(
            s.raw.0,
            e.raw.0,
            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
        )
    }
    .map_err(|e| err("cuStreamWaitEvent", e))
}

pub fn synchronize(stream_id: u64) -> Result<(), String> {
    let s = stream(stream_id)?;
    runtime()?.device(s.device)?.bind()?;
    // SAFETY: live stream.
    unsafe { cu::stream::synchronize(s.raw.0) }.map_err(|e| err("cuStreamSynchronize", e))
}

/// Milliseconds between two recorded events (both complete).
pub fn event_elapsed_ms(start: u64, end: u64) -> Result<f32, String> {
    let (a, b) = (event(start)?, event(end)?);
    runtime()?.device(b.device)?.bind()?;
    // SAFETY: live events.
    unsafe {
        cu::event::synchronize(b.raw.0).map_err(|e| err("cuEventSynchronize", e))?;
        cu::event::elapsed(a.raw.0, b.raw.0).map_err(|e| err("cuEventElapsedTime", e))
    }
}

/// Queues a device-to-device copy on `stream` (same device).
pub fn copy_async(
    stream_id: u64,
    dst: (u64, u64),
    src: (u64, u64),
    bytes: u64,
) -> Result<(), String> {
    let s = stream(stream_id)?;
    let (_, d) = range(dst.0, dst.1, bytes)?;
    let (_, p) = range(src.0, src.1, bytes)?;
    runtime()?.device(s.device)?.bind()?;
    // SAFETY: both ranges checked.
    unsafe { cu::memcpy_dtod_async(d, p, bytes as usize, s.raw.0) }
        .map_err(|e| err("cuMemcpyDtoDAsync", e))
}
