//! The CPU kernel backend: one device (the host), ops split over a spinning worker pool, weight
//! formats decoded and dotted through the quant plugins the host registers.
//!
//! Streams run their ops synchronously, so events are complete when recorded; the
//! stream/event API is still honoured so the host's code paths are the GPU ones.

mod attention;
mod buffers;
mod ds4;
mod kernels;
mod pool;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex, OnceLock, RwLock},
};

use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec, Tuple2},
    },
    defaults, guard, guard_or, AbiVersion, Backend, DeviceInfo, OpParams, Plugin, PluginInfo,
    PluginKind, PluginRef, QuantFormat, TensorRef,
};
use serde::Deserialize;

/// How activations meet quantised weights in mat-vec products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ActivationMode {
    /// Quantise activations to q8_1 and use the format's integer dot (fast decode).
    #[default]
    Q8,
    /// Decode weights to f32 and dot in f32 (reference precision).
    F32,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Worker threads; 0 = `MOE_CPU_THREADS`, else one per core.
    #[serde(default)]
    pub threads: usize,
    #[serde(default)]
    pub activation: ActivationMode,
}

static SETTINGS: OnceLock<Settings> = OnceLock::new();
static POOL: OnceLock<pool::Pool> = OnceLock::new();
static FORMATS: RwLock<Option<Arc<HashMap<u32, QuantFormat>>>> = RwLock::new(None);
/// kernel path -> (launches, nanoseconds spent).
static COUNTERS: Mutex<BTreeMap<&'static str, (u64, u64)>> = Mutex::new(BTreeMap::new());

pub(crate) fn settings() -> Settings {
    SETTINGS.get().cloned().unwrap_or_default()
}

pub(crate) fn formats() -> Arc<HashMap<u32, QuantFormat>> {
    FORMATS
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .clone()
        .unwrap_or_default()
}

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion::CURRENT,
        info,
        configure,
        quant_formats: defaults::no_quant_formats,
        backend,
        policies: defaults::no_policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "cpu".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::KernelBackend,
        description:
            "host CPU, multithreaded (spinning worker pool), weights through quant plugins".into(),
    }
}

extern "C" fn configure(settings: RStr<'_>) -> RResult<(), RString> {
    guard("cpu configure", || {
        let s: Settings = toml::from_str(settings.as_str()).map_err(|e| e.message().to_string())?;
        let threads = s.threads;
        SETTINGS
            .set(s)
            .map_err(|_| "the cpu backend is already configured".to_string())?;
        if threads > 0 {
            let _ = POOL.set(pool::Pool::new(at_most_cores(
                threads,
                "threads in plugins.toml",
            )));
        }
        Ok(())
    })
}

extern "C" fn backend() -> ROption<Backend> {
    ROption::RSome(Backend {
        name: "cpu".into(),
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
    })
}

fn meminfo_total() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|n| n.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

/// The best of three 64 MiB copies on one thread, timed (bytes read + written a
/// second): the figure `moeserve plugins` shows and `bench --limits` weighs against its
/// multi-threaded stream add. Both buffers are written first, so that the kernel's
/// first-touch page faults are not timed as memory traffic.
fn measure_bandwidth() -> f64 {
    static BW: OnceLock<f64> = OnceLock::new();
    *BW.get_or_init(|| {
        let src = vec![1u8; 64 << 20];
        let mut dst = vec![2u8; 64 << 20];
        let best = (0..3)
            .map(|_| {
                let t = std::time::Instant::now();
                dst.copy_from_slice(&src);
                std::hint::black_box(&dst);
                t.elapsed().as_secs_f64()
            })
            .fold(f64::INFINITY, f64::min);
        // A copy reads and writes every byte.
        2.0 * src.len() as f64 / best.max(1e-9)
    })
}

extern "C" fn devices() -> RResult<RVec<DeviceInfo>, RString> {
    guard("cpu devices", || {
        let threads = threads();
        Ok(RVec::from(vec![DeviceInfo {
            index: 0,
            name: format!("{} ({threads} threads)", cpu_name()).into(),
            arch: "cpu".into(),
            memory_bytes: meminfo_total(),
            bandwidth_bytes_per_s: measure_bandwidth(),
            unified_memory: true,
        }]))
    })
}

extern "C" fn register_quant_formats(formats: RVec<QuantFormat>) -> RResult<(), RString> {
    guard("cpu register_quant_formats", || {
        let mut table = FORMATS.write().unwrap_or_else(|e| e.into_inner());
        let mut map = table.as_deref().cloned().unwrap_or_default();
        for f in formats {
            map.insert(f.type_id, f);
        }
        *table = Some(Arc::new(map));
        Ok(())
    })
}

fn check_device(device: u32) -> Result<(), String> {
    if device != 0 {
        return Err(format!("the cpu backend has one device (0), not {device}"));
    }
    Ok(())
}

extern "C" fn alloc(device: u32, bytes: u64) -> RResult<u64, RString> {
    guard("cpu alloc", || {
        check_device(device)?;
        buffers::alloc(bytes)
    })
}

extern "C" fn free(buffer: u64) -> RResult<(), RString> {
    guard("cpu free", || buffers::free(buffer))
}

extern "C" fn upload(buffer: u64, offset: u64, data: RSlice<'_, u8>) -> RResult<(), RString> {
    guard("cpu upload", || {
        buffers::with_buffers(|b| {
            let dst = b.copy(buffer, offset, data.len())?;
            // SAFETY: destination range bounds-checked by `copy`.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
            Ok(())
        })
    })
}

extern "C" fn download(
    buffer: u64,
    offset: u64,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard("cpu download", || {
        buffers::with_buffers(|b| {
            let src = b.copy(buffer, offset, out.len())?;
            // SAFETY: source range bounds-checked by `copy`.
            unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
            Ok(())
        })
    })
}

// Ops run synchronously: a stream is a name, an event is complete when recorded.
extern "C" fn stream_create(device: u32) -> RResult<u64, RString> {
    guard("cpu stream_create", || check_device(device).map(|_| 1))
}
extern "C" fn event_record(_stream: u64) -> RResult<u64, RString> {
    RResult::ROk(1)
}
extern "C" fn stream_wait_event(_stream: u64, _event: u64) -> RResult<(), RString> {
    RResult::ROk(())
}
extern "C" fn synchronize(_stream: u64) -> RResult<(), RString> {
    RResult::ROk(())
}

extern "C" fn run_op(
    _stream: u64,
    op: u32,
    params: OpParams,
    args: RSlice<'_, TensorRef>,
) -> RResult<(), RString> {
    guard("cpu run_op", || {
        let kernel = kernels::table()
            .iter()
            .find(|k| k.op == op)
            .ok_or_else(|| format!("op {op} is not supported by the cpu backend"))?;
        // Refuse an output overlapping any other argument, which the kernels' slices
        // would otherwise alias. Outputs are the last argument except for the ops below;
        // NORM_ROPE may work in place (x and out the very same tensor).
        use moe_plugin_api::ops;
        let outs: &[usize] = match op {
            ops::KV_STORE => &[1],
            ops::HC_PRE => &[5, 6],
            ops::HC_POST => &[0],
            ops::COMPRESS => &[6, 7, 8],
            ops::SPARSE_ATTENTION => &[2, 7],
            ops::ROUTER => &[4, 5],
            ops::MOE_COMBINE => &[2],
            _ => &[],
        };
        let last = [args.len().saturating_sub(1)];
        let outs = if outs.is_empty() { &last[..] } else { outs };
        let fmts = formats();
        for &oi in outs {
            let Some(out) = args.get(oi) else { continue };
            let out_len = buffers::tensor_bytes(out, fmts.get(&out.type_id))?;
            for (i, a) in args.iter().enumerate() {
                let in_place = op == ops::NORM_ROPE
                    && i == 0
                    && a.buffer == out.buffer
                    && a.offset == out.offset;
                if i != oi && !in_place {
                    let len = buffers::tensor_bytes(a, fmts.get(&a.type_id))?;
                    if buffers::overlaps(out, out_len, a, len) {
                        return Err(format!(
                            "{}: output {oi} overlaps argument {i}",
                            kernel.name
                        ));
                    }
                }
            }
        }
        // Kernels hand work to the pool themselves (see `par_for`): small decode-time
        // ops run on this thread, since waking the pool costs more than they take.
        let t0 = std::time::Instant::now();
        let path = buffers::with_buffers(|b| (kernel.run)(b, &params, args.as_slice()))?;
        let ns = t0.elapsed().as_nanos() as u64;
        let mut c = COUNTERS.lock().unwrap_or_else(|e| e.into_inner());
        let e = c.entry(path).or_default();
        e.0 += 1;
        e.1 += ns;
        Ok(())
    })
}

/// The worker pool: `threads` from the settings, else `MOE_CPU_THREADS`, else one per
/// core.
fn pool() -> &'static pool::Pool {
    POOL.get_or_init(|| {
        let n = std::env::var("MOE_CPU_THREADS")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .map(|n| at_most_cores(n, "MOE_CPU_THREADS"))
            .unwrap_or_else(cores);
        pool::Pool::new(n)
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `n` workers, but no more than the cores this process may use: the workers spin on
/// each step's barrier, so one waiting for a core stalls them all (4 threads on 2
/// cores decoded at under 1% of the speed of 2).
fn at_most_cores(n: usize, from: &str) -> usize {
    let c = cores();
    if n > c {
        eprintln!(
            "cpu backend: {from} asks for {n} worker threads, but this process may use {c} \
             cores; using {c}"
        );
        return c;
    }
    n
}

/// Worker threads of the backend's pool.
pub(crate) fn threads() -> usize {
    pool().threads()
}

/// Runs `f` over `0..n` in tasks of at least `grain` items: on the calling thread when
/// the work fits one task, else spread over the backend's pool. The first error any
/// task returns is returned.
pub(crate) fn par_for(
    n: usize,
    grain: usize,
    f: impl Fn(std::ops::Range<usize>) -> Result<(), String> + Sync,
) -> Result<(), String> {
    let pool = pool();
    let threads = pool.threads();
    if n <= grain.max(1) || threads <= 1 {
        return f(0..n);
    }
    let tasks = (n / grain.max(1)).clamp(1, threads * 4);
    let step = n.div_ceil(tasks);
    let first_error: Mutex<Option<String>> = Mutex::new(None);
    pool.run(tasks, &|t| {
        let (a, b) = (t * step, ((t + 1) * step).min(n));
        if a < b {
            if let Err(e) = f(a..b) {
                first_error
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .get_or_insert(e);
            }
        }
    })?;
    match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

extern "C" fn kernel_counters() -> RVec<Tuple2<RString, u64>> {
    guard_or(RVec::new(), || {
        COUNTERS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .flat_map(|(k, (n, ns))| {
                // Launch counts under the kernel's name; time under `<name>.ns`.
                [
                    Tuple2(RString::from(*k), *n),
                    Tuple2(RString::from(format!("{k}.ns")), *ns),
                ]
            })
            .collect()
    })
}
