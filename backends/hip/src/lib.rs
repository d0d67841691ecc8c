//! The HIP kernel backend (AMD GPUs: RDNA3 gfx1100, RDNA3.5 gfx1151, ...).
//!
//! A small hand-written binding of the HIP runtime, opened at run time with
//! `libloading` (`libamdhip64.so.7`, then `.6`, then unversioned), so the plugin builds
//! and loads anywhere; without ROCm every entry point answers
//! "no HIP runtime found (libamdhip64.so.7/.6)" instead of crashing.
//!
//! Implemented: devices (name, memory, arch from the KFD topology), buffers, streams,
//! events (stream_wait_event across devices). Not yet: `run_op`, which is to compile
//! the same `kernels/gpu` sources with hiprtc for the device arch (see
//! [`KERNEL_SOURCES`]) as the CUDA backend does with NVRTC.

use std::{
    collections::HashMap,
    ffi::{c_char, c_int, c_uint, c_void, CStr},
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, OnceLock,
    },
};

use libloading::Library;
use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{ROption, RResult, RSlice, RSliceMut, RString, RVec, Tuple2},
    },
    defaults, guard, AbiVersion, Backend, DeviceInfo, OpParams, Plugin, PluginInfo, PluginKind,
    PluginRef, QuantFormat, TensorRef,
};

/// The kernel sources the HIP path will compile with hiprtc (shared with CUDA).
pub const KERNEL_SOURCES: [(&str, &str); 2] = [
    (
        "common.cuh",
        include_str!("../../../kernels/gpu/common.cuh"),
    ),
    (
        "rocmfpx.cu",
        include_str!("../../../kernels/gpu/rocmfpx.cu"),
    ),
];

pub const NO_RUNTIME: &str = "no HIP runtime found (libamdhip64.so.7/.6)";
const LIB_NAMES: [&str; 3] = ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"];

type Err = c_int;
type Ptr = *mut c_void;

/// The HIP runtime functions this backend calls (C ABI, stable across ROCm 5-7).
struct Hip {
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
    stream_wait_event: unsafe extern "C" fn(Ptr, Ptr, c_uint) -> Err,
    event_create: unsafe extern "C" fn(*mut Ptr) -> Err,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> Err,
    get_error_string: unsafe extern "C" fn(Err) -> *const c_char,
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
            stream_wait_event: sym!("hipStreamWaitEvent"),
            event_create: sym!("hipEventCreate"),
            event_record: sym!("hipEventRecord"),
            get_error_string: sym!("hipGetErrorString"),
            _lib: lib,
        })
    }

    fn check(&self, what: &str, e: Err) -> Result<(), String> {
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

struct Runtime {
    hip: Hip,
    devices: Vec<DeviceInfo>,
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
            let archs = kfd_archs();
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
            Ok(Runtime { hip, devices })
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
        description: "AMD GPUs through the HIP runtime (loaded at run time); ops pending".into(),
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
        let s = get(&STREAMS, stream, "stream")?;
        let hip = bind(s.device)?;
        let mut e: Ptr = std::ptr::null_mut();
        // SAFETY: valid out-pointer, live stream.
        unsafe {
            hip.check("hipEventCreate", (hip.event_create)(&mut e))?;
            hip.check("hipEventRecord", (hip.event_record)(e, s.ptr as Ptr))?;
        }
        Ok(put(
            &EVENTS,
            Handle {
                device: s.device,
                ptr: e as usize,
                len: 0,
            },
        ))
    })
}

extern "C" fn stream_wait_event(stream: u64, event: u64) -> RResult<(), RString> {
    guard("hip stream_wait_event", || {
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
        let s = get(&STREAMS, stream, "stream")?;
        let hip = bind(s.device)?;
        // SAFETY: live stream.
        hip.check("hipStreamSynchronize", unsafe {
            (hip.stream_synchronize)(s.ptr as Ptr)
        })
    })
}

extern "C" fn run_op(
    _stream: u64,
    op: u32,
    _params: OpParams,
    _args: RSlice<'_, TensorRef>,
) -> RResult<(), RString> {
    guard("hip run_op", || {
        runtime()?;
        Err(format!(
            "op {op}: the hip backend does not run ops yet (hiprtc compilation of kernels/gpu is pending)"
        ))
    })
}

extern "C" fn kernel_counters() -> RVec<Tuple2<RString, u64>> {
    RVec::new()
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

    #[test]
    fn kfd_arch_names() {
        // Parsing is exercised on machines with KFD; the helper never panics here.
        let _ = kfd_archs();
        assert_eq!(nominal_bandwidth("gfx1100"), 800e9);
    }
}
