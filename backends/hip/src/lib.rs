//! The HIP kernel backend (AMD GPUs: RDNA3 gfx1100, RDNA3.5 gfx1151, ...).
//!
//! A small hand-written binding of the HIP runtime, opened at run time with
//! `libloading` (`libamdhip64.so.7`, then `.6`, then unversioned), so the plugin builds
//! and loads anywhere; without ROCm every entry point answers
//! "no HIP runtime found (libamdhip64.so.7/.6)" instead of crashing.
//!
//! Implemented: devices (name, memory, arch from the KFD topology, or `$MOE_HIP_ARCH`),
//! buffers, streams, events (stream_wait_event across devices), and `run_op`: the same
//! `kernels/gpu` sources as the CUDA backend ([`KERNEL_SOURCES`]), compiled at run time
//! with hiprtc (`libhiprtc.so.7/.6`, also opened with `libloading`) for the device's
//! arch, cached on disk ([`kernels::cache_dir`]), loaded with `hipModuleLoadData` and
//! launched with `hipModuleLaunchKernel`. Ops as the CUDA backend's ([`ops`]): MATMUL
//! with type 107 weights (MMVQ for n <= 8, MMQ above: WMMA on gfx1100/gfx1151, dp4a
//! elsewhere), the grouped MoE mat-vec [`ops::OP_MATMUL_ID`], GET_ROWS (F32, 107), ADD,
//! the dense mat-vecs and the DeepSeek-V4 glue ops (shared plans and kernels), and graph
//! capture (GRAPH_BEGIN / END / LAUNCH through hipStreamBeginCapture, hipGraphInstantiate
//! and hipGraphLaunch, as the CUDA backend does; a runtime without them answers "not
//! supported" and the engine launches op by op). Not yet run on AMD hardware.
//! `kernel_counters` reports host-counted launches and, as `<name>.device`, the
//! launches the kernels counted themselves.

use std::{
    collections::HashMap,
    ffi::{c_char, c_int, c_uint, c_void, CStr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, OnceLock,
    },
};

use libloading::Library;

pub mod kernels;
pub mod ops;

/// Builds the `void**` argument list of a launch from local variables.
pub use moe_gpu_common::kargs;

use kernels::Module;
use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{ROption, RResult, RSlice, RSliceMut, RString, RVec, Tuple2},
    },
    defaults, guard, guard_or, AbiVersion, Backend, DeviceInfo, OpParams, Plugin, PluginInfo,
    PluginKind, PluginRef, QuantFormat, TensorRef,
};

/// The kernel sources the HIP path will compile with hiprtc (shared with CUDA).
pub const KERNEL_SOURCES: [(&str, &str); 3] = [
    (
        "common.cuh",
        include_str!("../../../kernels/gpu/common.cuh"),
    ),
    (
        "rocmfpx.cu",
        include_str!("../../../kernels/gpu/rocmfpx.cu"),
    ),
    ("ds4.cu", include_str!("../../../kernels/gpu/ds4.cu")),
];

pub const NO_RUNTIME: &str = "no HIP runtime found (libamdhip64.so.7/.6)";
const LIB_NAMES: [&str; 3] = ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"];

type Err = c_int;
/// A raw HIP handle or device pointer.
pub type Ptr = *mut c_void;

/// The HIP runtime functions this backend calls (C ABI, stable across ROCm 5-7).
pub struct Hip {
    _lib: Library,
    init: unsafe extern "C" fn(c_uint) -> Err,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> Err,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Err,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> Err,
    set_device: unsafe extern "C" fn(c_int) -> Err,
    malloc: unsafe extern "C" fn(*mut Ptr, usize) -> Err,
    free: unsafe extern "C" fn(Ptr) -> Err,
    memcpy: unsafe extern "C" fn(Ptr, *const c_void, usize, c_int) -> Err,
    stream_create: unsafe extern "C" fn(*mut Ptr) -> Err,
    stream_synchronize: unsafe extern "C" fn(Ptr) -> Err,
    device_synchronize: unsafe extern "C" fn() -> Err,
    stream_wait_event: unsafe extern "C" fn(Ptr, Ptr, c_uint) -> Err,
    event_create: unsafe extern "C" fn(*mut Ptr) -> Err,
    event_destroy: unsafe extern "C" fn(Ptr) -> Err,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> Err,
    get_error_string: unsafe extern "C" fn(Err) -> *const c_char,
    memset: unsafe extern "C" fn(Ptr, c_int, usize) -> Err,
    module_load_data: unsafe extern "C" fn(*mut Ptr, *const c_void) -> Err,
    module_get_function: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> Err,
    #[allow(clippy::type_complexity)]
    module_launch_kernel: unsafe extern "C" fn(
        Ptr,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Ptr,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> Err,
    /// Stream capture (GRAPH_BEGIN / END / LAUNCH); None where the runtime lacks it.
    pub graph: Option<GraphFns>,
}

/// The HIP graph functions: capture a stream's work, instantiate it, replay it.
pub struct GraphFns {
    pub begin_capture: unsafe extern "C" fn(Ptr, c_int) -> Err,
    pub end_capture: unsafe extern "C" fn(Ptr, *mut Ptr) -> Err,
    pub instantiate: unsafe extern "C" fn(*mut Ptr, Ptr, *mut Ptr, *mut c_char, usize) -> Err,
    pub launch: unsafe extern "C" fn(Ptr, Ptr) -> Err,
    pub destroy: unsafe extern "C" fn(Ptr) -> Err,
    pub exec_destroy: unsafe extern "C" fn(Ptr) -> Err,
}

// Function pointers into a library that is never unloaded.
unsafe impl Send for Hip {}
unsafe impl Sync for Hip {}

const MEMCPY_H2D: c_int = 1;
const MEMCPY_D2H: c_int = 2;

impl Hip {
    fn open() -> Result<Hip, String> {
        // SAFETY: opening the HIP runtime runs its initialisers, which is what it is for.
        let lib = LIB_NAMES
            .iter()
            .find_map(|n| unsafe { Library::new(*n) }.ok())
            .ok_or_else(|| NO_RUNTIME.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the C signature of the field it is stored in.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("HIP runtime lacks {}: {e}", $name))?
            };
        }
        Ok(Hip {
            init: sym!("hipInit"),
            get_device_count: sym!("hipGetDeviceCount"),
            device_get_name: sym!("hipDeviceGetName"),
            device_total_mem: sym!("hipDeviceTotalMem"),
            set_device: sym!("hipSetDevice"),
            malloc: sym!("hipMalloc"),
            free: sym!("hipFree"),
            memcpy: sym!("hipMemcpy"),
            stream_create: sym!("hipStreamCreate"),
            stream_synchronize: sym!("hipStreamSynchronize"),
            device_synchronize: sym!("hipDeviceSynchronize"),
            stream_wait_event: sym!("hipStreamWaitEvent"),
            event_create: sym!("hipEventCreate"),
            event_destroy: sym!("hipEventDestroy"),
            event_record: sym!("hipEventRecord"),
            get_error_string: sym!("hipGetErrorString"),
            memset: sym!("hipMemset"),
            module_load_data: sym!("hipModuleLoadData"),
            module_get_function: sym!("hipModuleGetFunction"),
            module_launch_kernel: sym!("hipModuleLaunchKernel"),
            graph: graph_fns(&lib),
            _lib: lib,
        })
    }

    pub(crate) fn check(&self, what: &str, e: Err) -> Result<(), String> {
        if e == 0 {
            return Ok(());
        }
        // SAFETY: returns a static string for any code.
        let s = unsafe { (self.get_error_string)(e) };
        let msg = if s.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated static string.
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(format!("{what}: HIP error {e} {msg}"))
    }
}

/// The graph functions when the runtime has all of them.
fn graph_fns(lib: &Library) -> Option<GraphFns> {
    macro_rules! opt {
        ($name:literal) => {
            // SAFETY: the symbol has the C signature of the field it is stored in.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.ok()?
        };
    }
    Some(GraphFns {
        begin_capture: opt!("hipStreamBeginCapture"),
        end_capture: opt!("hipStreamEndCapture"),
        instantiate: opt!("hipGraphInstantiate"),
        launch: opt!("hipGraphLaunch"),
        destroy: opt!("hipGraphDestroy"),
        exec_destroy: opt!("hipGraphExecDestroy"),
    })
}

struct Runtime {
    hip: Hip,
    devices: Vec<DeviceInfo>,
    /// Per device: the kernels, compiled (or read from the cache) and loaded on first use.
    modules: Vec<OnceLock<Result<Module, String>>>,
}

impl Runtime {
    /// The kernels of `device`, loaded on first use (binds the device).
    fn module(&self, device: u32) -> Result<&Module, String> {
        let slot = self
            .modules
            .get(device as usize)
            .ok_or_else(|| format!("the hip backend has no device {device}"))?;
        slot.get_or_init(|| {
            bind(device)?;
            Module::load(&self.hip, self.devices[device as usize].arch.as_str())
        })
        .as_ref()
        .map_err(|e| e.clone())
    }
}

fn runtime() -> Result<&'static Runtime, String> {
    static RT: OnceLock<Result<Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        let hip = Hip::open()?;
        // SAFETY: plain calls with valid out-pointers.
        unsafe {
            hip.check("hipInit", (hip.init)(0))?;
            let mut n = 0;
            hip.check("hipGetDeviceCount", (hip.get_device_count)(&mut n))?;
            let archs = match std::env::var("MOE_HIP_ARCH") {
                Ok(a) if !a.is_empty() => vec![a; n.max(0) as usize],
                _ => kfd_archs(),
            };
            let mut devices = Vec::new();
            for i in 0..n {
                let mut name = [0 as c_char; 256];
                hip.check(
                    "hipDeviceGetName",
                    (hip.device_get_name)(name.as_mut_ptr(), 256, i),
                )?;
                let mut mem = 0usize;
                hip.check("hipDeviceTotalMem", (hip.device_total_mem)(&mut mem, i))?;
                let arch = archs
                    .get(i as usize)
                    .cloned()
                    .unwrap_or_else(|| "gfx?".into());
                devices.push(DeviceInfo {
                    index: i as u32,
                    name: CStr::from_ptr(name.as_ptr())
                        .to_string_lossy()
                        .into_owned()
                        .into(),
                    bandwidth_bytes_per_s: nominal_bandwidth(&arch),
                    // Strix Halo (gfx1151) is an APU reading host memory.
                    unified_memory: arch == "gfx1151" || arch == "gfx1150",
                    arch: arch.into(),
                    memory_bytes: mem as u64,
                });
            }
            let modules = devices.iter().map(|_| OnceLock::new()).collect();
            Ok(Runtime {
                hip,
                devices,
                modules,
            })
        }
    })
    .as_ref()
    .map_err(|e| e.clone())
}

/// GPU archs in KFD topology order (`gfx_target_version 110501` -> `gfx1151`), which
/// is HIP's device order when no visibility mask is set.
fn kfd_archs() -> Vec<String> {
    let mut nodes: Vec<(u32, String)> = Vec::new();
    let Ok(dir) = std::fs::read_dir("/sys/class/kfd/kfd/topology/nodes") else {
        return Vec::new();
    };
    for e in dir.flatten() {
        let Ok(idx) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let props = std::fs::read_to_string(e.path().join("properties")).unwrap_or_default();
        let v = props
            .lines()
            .find_map(|l| l.strip_prefix("gfx_target_version "))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or(0);
        if v > 0 {
            let (major, minor, step) = (v / 10000, (v / 100) % 100, v % 100);
            nodes.push((idx, format!("gfx{major}{minor:x}{step:x}")));
        }
    }
    nodes.sort();
    nodes.into_iter().map(|n| n.1).collect()
}

/// Datasheet memory bandwidth of the archs this project targets (bytes/s).
fn nominal_bandwidth(arch: &str) -> f64 {
    match arch {
        "gfx1100" => 800e9,
        "gfx1151" => 256e9,
        _ => 0.0,
    }
}

#[derive(Clone, Copy)]
struct Handle {
    device: u32,
    ptr: usize,
    len: u64,
}

static NEXT: AtomicU64 = AtomicU64::new(1);
static BUFFERS: Mutex<Option<HashMap<u64, Handle>>> = Mutex::new(None);
static STREAMS: Mutex<Option<HashMap<u64, Handle>>> = Mutex::new(None);
static EVENTS: Mutex<Option<HashMap<u64, Handle>>> = Mutex::new(None);
/// Event ids oldest first: an event is destroyed (its id forgotten) after the next
/// `EVENT_KEEP` records, ample for the forks and joins of a step (the CUDA backend's
/// rule), so recording one per fork does not grow without bound.
static EVENT_ORDER: Mutex<std::collections::VecDeque<u64>> =
    Mutex::new(std::collections::VecDeque::new());
const EVENT_KEEP: usize = 4096;

fn put(table: &Mutex<Option<HashMap<u64, Handle>>>, h: Handle) -> u64 {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    table
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(id, h);
    id
}

fn get(table: &Mutex<Option<HashMap<u64, Handle>>>, id: u64, what: &str) -> Result<Handle, String> {
    table
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&id)
        .copied()
        .ok_or_else(|| format!("unknown {what} {id}"))
}

fn bind(device: u32) -> Result<&'static Hip, String> {
    let rt = runtime()?;
    if device as usize >= rt.devices.len() {
        return Err(format!(
            "the hip backend has {} device(s); there is no device {device}",
            rt.devices.len()
        ));
    }
    // SAFETY: valid device index.
    rt.hip.check("hipSetDevice", unsafe {
        (rt.hip.set_device)(device as c_int)
    })?;
    Ok(&rt.hip)
}

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion::CURRENT,
        info,
        configure: defaults::accept_any_settings,
        quant_formats: defaults::no_quant_formats,
        backend,
        policies: defaults::no_policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "hip".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::KernelBackend,
        description:
            "AMD GPUs through the HIP runtime (loaded at run time); kernels compiled with hiprtc"
                .into(),
    }
}

/// The backend's function table.
pub fn table() -> Backend {
    Backend {
        name: "hip".into(),
        devices,
        register_quant_formats,
        alloc,
        free,
        upload,
        download,
        stream_create,
        event_record,
        stream_wait_event,
        synchronize,
        run_op,
        kernel_counters,
    }
}

extern "C" fn backend() -> ROption<Backend> {
    ROption::RSome(table())
}

extern "C" fn devices() -> RResult<RVec<DeviceInfo>, RString> {
    guard("hip devices", || Ok(runtime()?.devices.clone().into()))
}

extern "C" fn register_quant_formats(_formats: RVec<QuantFormat>) -> RResult<(), RString> {
    RResult::ROk(())
}

extern "C" fn alloc(device: u32, bytes: u64) -> RResult<u64, RString> {
    guard("hip alloc", || {
        let hip = bind(device)?;
        let mut p: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        hip.check("hipMalloc", unsafe {
            (hip.malloc)(&mut p, bytes.max(1) as usize)
        })?;
        Ok(put(
            &BUFFERS,
            Handle {
                device,
                ptr: p as usize,
                len: bytes,
            },
        ))
    })
}

extern "C" fn free(buffer: u64) -> RResult<(), RString> {
    guard("hip free", || {
        runtime()?;
        let h = BUFFERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .remove(&buffer)
            .ok_or_else(|| format!("free: unknown buffer {buffer}"))?;
        let hip = bind(h.device)?;
        // SAFETY: allocated by hipMalloc, removed from the table so freed once.
        hip.check("hipFree", unsafe { (hip.free)(h.ptr as Ptr) })
    })
}

fn checked(buffer: u64, offset: u64, len: usize) -> Result<(Handle, usize), String> {
    let h = get(&BUFFERS, buffer, "buffer")?;
    if offset.checked_add(len as u64).is_none_or(|end| end > h.len) {
        return Err(format!(
            "{len} bytes at offset {offset} overrun buffer {buffer} of {} bytes",
            h.len
        ));
    }
    Ok((h, h.ptr + offset as usize))
}

extern "C" fn upload(buffer: u64, offset: u64, data: RSlice<'_, u8>) -> RResult<(), RString> {
    guard("hip upload", || {
        runtime()?;
        let (h, p) = checked(buffer, offset, data.len())?;
        let hip = bind(h.device)?;
        // SAFETY: destination range checked.
        let e = unsafe {
            (hip.memcpy)(
                p as Ptr,
                data.as_ptr() as *const c_void,
                data.len(),
                MEMCPY_H2D,
            )
        };
        hip.check("hipMemcpy", e)
    })
}

extern "C" fn download(
    buffer: u64,
    offset: u64,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard("hip download", || {
        runtime()?;
        let (h, p) = checked(buffer, offset, out.len())?;
        let hip = bind(h.device)?;
        // SAFETY: source range checked.
        let e = unsafe {
            (hip.memcpy)(
                out.as_mut_ptr() as Ptr,
                p as *const c_void,
                out.len(),
                MEMCPY_D2H,
            )
        };
        hip.check("hipMemcpy", e)
    })
}

extern "C" fn stream_create(device: u32) -> RResult<u64, RString> {
    guard("hip stream_create", || {
        let hip = bind(device)?;
        let mut s: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer.
        hip.check("hipStreamCreate", unsafe { (hip.stream_create)(&mut s) })?;
        Ok(put(
            &STREAMS,
            Handle {
                device,
                ptr: s as usize,
                len: 0,
            },
        ))
    })
}

extern "C" fn event_record(stream: u64) -> RResult<u64, RString> {
    guard("hip event_record", || {
        runtime()?;
        let s = get(&STREAMS, stream, "stream")?;
        let hip = bind(s.device)?;
        let mut e: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live stream.
        unsafe {
            hip.check("hipEventCreate", (hip.event_create)(&mut e))?;
            hip.check("hipEventRecord", (hip.event_record)(e, s.ptr as Ptr))?;
        }
        let id = put(
            &EVENTS,
            Handle {
                device: s.device,
                ptr: e as usize,
                len: 0,
            },
        );
        let old = {
            let mut order = EVENT_ORDER.lock().unwrap_or_else(|e| e.into_inner());
            order.push_back(id);
            if order.len() > EVENT_KEEP {
                order.pop_front()
            } else {
                None
            }
        };
        let old = old.and_then(|o| {
            EVENTS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
                .and_then(|t| t.remove(&o))
        });
        if let Some(old) = old {
            // SAFETY: no longer reachable by id; the runtime defers destroying an event
            // a stream still waits for.
            let _ = unsafe { (hip.event_destroy)(old.ptr as Ptr) };
        }
        Ok(id)
    })
}

extern "C" fn stream_wait_event(stream: u64, event: u64) -> RResult<(), RString> {
    guard("hip stream_wait_event", || {
        runtime()?;
        let s = get(&STREAMS, stream, "stream")?;
        let e = get(&EVENTS, event, "event")?;
        let hip = bind(s.device)?;
        // SAFETY: live stream and event (events of other devices are allowed).
        hip.check("hipStreamWaitEvent", unsafe {
            (hip.stream_wait_event)(s.ptr as Ptr, e.ptr as Ptr, 0)
        })
    })
}

extern "C" fn synchronize(stream: u64) -> RResult<(), RString> {
    guard("hip synchronize", || {
        runtime()?;
        let s = get(&STREAMS, stream, "stream")?;
        let hip = bind(s.device)?;
        // SAFETY: live stream.
        hip.check("hipStreamSynchronize", unsafe {
            (hip.stream_synchronize)(s.ptr as Ptr)
        })
    })
}

extern "C" fn run_op(
    stream: u64,
    op: u32,
    params: OpParams,
    args: RSlice<'_, TensorRef>,
) -> RResult<(), RString> {
    guard("hip run_op", || {
        runtime()?;
        ops::run(stream, op, &params, args.as_slice())
    })
}

/// Host-side launch counts under each kernel's name; `<name>.device` the counts the
/// kernels recorded on the devices (summed), for devices whose kernels are loaded.
pub fn counters() -> Vec<(String, u64)> {
    let mut dev = None;
    if let Ok(rt) = runtime() {
        for (i, slot) in rt.modules.iter().enumerate() {
            // Only devices whose module is already loaded: never compile here.
            if let Some(Ok(m)) = slot.get() {
                if let Ok(c) = bind(i as u32).and_then(|hip| m.device_counts(hip)) {
                    moe_gpu_common::kernels::add_counts(
                        dev.get_or_insert([0; kernels::COUNTER_SLOTS]),
                        c,
                    );
                }
            }
        }
    }
    moe_gpu_common::kernels::counter_list(kernels::host_counts(), dev)
}

extern "C" fn kernel_counters() -> RVec<Tuple2<RString, u64>> {
    guard_or(RVec::new(), || {
        counters()
            .into_iter()
            .map(|(k, v)| Tuple2(RString::from(k), v))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use moe_plugin_api::into_result;

    #[test]
    fn absent_runtime_is_an_error_not_a_crash() {
        let r = into_result(devices());
        if LIB_NAMES
            .iter()
            .all(|n| unsafe { Library::new(*n) }.is_err())
        {
            assert_eq!(r.unwrap_err(), NO_RUNTIME);
            assert!(into_result(alloc(0, 16)).is_err());
            assert!(into_result(stream_create(0)).is_err());
        }
    }

    fn no_libs() -> bool {
        LIB_NAMES
            .iter()
            .all(|n| unsafe { Library::new(*n) }.is_err())
    }

    /// Without ROCm, every entry point answers NO_RUNTIME (and nothing panics: a panic
    /// would come back as "plugin panicked").
    #[test]
    fn every_entry_point_without_runtime_says_so() {
        if !no_libs() {
            return;
        }
        let is_no_runtime = |r: Result<(), String>, what: &str| {
            let e = r.expect_err(what);
            assert_eq!(e, NO_RUNTIME, "{what}");
        };
        is_no_runtime(into_result(devices()).map(|_| ()), "devices");
        is_no_runtime(into_result(alloc(0, 16)).map(|_| ()), "alloc");
        is_no_runtime(into_result(free(1)), "free");
        is_no_runtime(into_result(upload(1, 0, [0u8; 4][..].into())), "upload");
        let mut buf = [0u8; 4];
        is_no_runtime(
            into_result(download(1, 0, buf.as_mut_slice().into())),
            "download",
        );
        is_no_runtime(into_result(stream_create(0)).map(|_| ()), "stream_create");
        is_no_runtime(into_result(event_record(1)).map(|_| ()), "event_record");
        is_no_runtime(into_result(stream_wait_event(1, 2)), "stream_wait_event");
        is_no_runtime(into_result(synchronize(1)), "synchronize");
        let t = |type_id: u32, dims: [u64; 4]| TensorRef {
            buffer: 1,
            offset: 0,
            type_id,
            variant: ops::FP2_AFFINE,
            dims,
        };
        use moe_plugin_api::{ops as abi_ops, types};
        let cases: [(u32, Vec<TensorRef>); 4] = [
            (
                abi_ops::MATMUL,
                vec![
                    t(107, [64, 4, 1, 1]),
                    t(types::F32, [64, 16, 1, 1]),
                    t(types::F32, [4, 16, 1, 1]),
                ],
            ),
            (
                abi_ops::GET_ROWS,
                vec![
                    t(107, [64, 4, 1, 1]),
                    t(types::I32, [2, 1, 1, 1]),
                    t(types::F32, [64, 2, 1, 1]),
                ],
            ),
            (abi_ops::ADD, vec![t(types::F32, [8, 1, 1, 1]); 3]),
            (
                ops::OP_MATMUL_ID,
                vec![
                    t(107, [64, 4, 2, 1]),
                    t(types::F32, [64, 1, 1, 1]),
                    t(types::I32, [2, 1, 1, 1]),
                    t(types::F32, [4, 2, 1, 1]),
                ],
            ),
        ];
        for (op, args) in cases {
            is_no_runtime(
                into_result(run_op(1, op, OpParams::default(), args.as_slice().into())),
                &format!("run_op {op}"),
            );
        }
        assert!(kernel_counters().is_empty());
        assert!(counters().is_empty());
    }

    #[test]
    fn hiprtc_absent_or_bad_arch_is_an_error() {
        let e = kernels::compile("gfx?").unwrap_err();
        assert!(e.contains("unknown device arch"), "{e}");
        if ["libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so"]
            .iter()
            .all(|n| unsafe { Library::new(*n) }.is_err())
        {
            assert_eq!(kernels::compile("gfx1100").unwrap_err(), kernels::NO_HIPRTC);
        }
    }

    #[test]
    fn kernel_source_is_self_contained() {
        let src = kernels::source();
        assert!(!src.contains("#include"));
        for (i, k) in kernels::KERNELS.iter().enumerate() {
            // The MMVQ kernels are stamped out by a macro, one per column count.
            let needle = match k.strip_prefix("mmvq_107_n") {
                Some(n) => format!("RF_MMVQ({n})"),
                None => format!(" {k}("),
            };
            assert!(src.contains(&needle), "kernel {k} missing from the source");
            // Counter slot i is the kernel's KID_ define.
            if !k.starts_with("mmvq_107_n") {
                let kid = format!("#define KID_{} {i}", k.to_uppercase());
                assert!(src.contains(&kid), "{kid} missing");
            }
        }
        assert!(src.contains("__builtin_amdgcn_wmma_i32_16x16x16_iu8_w32"));
    }

    #[test]
    fn kfd_arch_names() {
        // Parsing is exercised on machines with KFD; the helper never panics here.
        let _ = kfd_archs();
        assert_eq!(nominal_bandwidth("gfx1100"), 800e9);
    }
}
