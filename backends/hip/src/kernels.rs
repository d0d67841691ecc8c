//! The GPU kernels on AMD devices: the `kernels/gpu` sources (shared with the CUDA
//! backend) compiled with hiprtc (`libhiprtc.so.7/.6`, opened at run time) for the
//! device's arch on first use, cached on disk like the CUDA backend's cubins, loaded
//! per device with `hipModuleLoadData` and launched with `hipModuleLaunchKernel`;
//! launches counted on the host and, by the kernels themselves, on the device.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::{c_char, c_int, c_uint, c_void, CStr, CString},
    sync::{Arc, Mutex, OnceLock},
};

use libloading::Library;

use moe_gpu_common::kernels;

use crate::{Hip, Ptr, KERNEL_SOURCES};

/// Error text when hiprtc cannot be opened.
pub const NO_HIPRTC: &str = "no hiprtc found (libhiprtc.so.7/.6): cannot compile the HIP kernels";
const RTC_NAMES: [&str; 3] = ["libhiprtc.so.7", "libhiprtc.so.6", "libhiprtc.so"];

pub use moe_gpu_common::kernels::{cache_dir, COUNTER_SLOTS, KERNELS};

/// The full translation unit hiprtc compiles (the include resolved in place).
pub fn source() -> String {
    moe_gpu_common::kernels::source(
        KERNEL_SOURCES[0].1,
        &[KERNEL_SOURCES[1].1, KERNEL_SOURCES[2].1],
    )
}

type RtcResult = c_int;
type Prog = *mut c_void;

/// The hiprtc functions used here (C ABI, stable across ROCm 5-7).
struct Rtc {
    _lib: Library,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> RtcResult,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> RtcResult,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> RtcResult,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> RtcResult,
    code_size: unsafe extern "C" fn(Prog, *mut usize) -> RtcResult,
    code: unsafe extern "C" fn(Prog, *mut c_char) -> RtcResult,
    destroy: unsafe extern "C" fn(*mut Prog) -> RtcResult,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> RtcResult,
}

// Function pointers into a library that is never unloaded.
unsafe impl Send for Rtc {}
unsafe impl Sync for Rtc {}

impl Rtc {
    fn open() -> Result<Rtc, String> {
        // SAFETY: opening hiprtc runs its initialisers, which is what it is for.
        let lib = RTC_NAMES
            .iter()
            .find_map(|n| unsafe { Library::new(*n) }.ok())
            .ok_or_else(|| NO_HIPRTC.to_string())?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the symbol has the C signature of the field it is stored in.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("hiprtc lacks {}: {e}", $name))?
            };
        }
        Ok(Rtc {
            create: sym!("hiprtcCreateProgram"),
            compile: sym!("hiprtcCompileProgram"),
            log_size: sym!("hiprtcGetProgramLogSize"),
            log: sym!("hiprtcGetProgramLog"),
            code_size: sym!("hiprtcGetCodeSize"),
            code: sym!("hiprtcGetCode"),
            destroy: sym!("hiprtcDestroyProgram"),
            version: sym!("hiprtcVersion"),
            _lib: lib,
        })
    }

    fn get() -> Result<&'static Rtc, String> {
        static RTC: OnceLock<Result<Rtc, String>> = OnceLock::new();
        RTC.get_or_init(Rtc::open).as_ref().map_err(|e| e.clone())
    }

    /// Compiles `src` with `opts` to a code object (HSACO).
    fn build(&self, src: &str, opts: &[String]) -> Result<Vec<u8>, String> {
        let csrc = CString::new(src).map_err(|e| e.to_string())?;
        let name = CString::new("rocmfpx.cu").expect("no nul");
        let copts: Vec<CString> = opts
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|e| e.to_string()))
            .collect::<Result<_, _>>()?;
        let popts: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: valid NUL-terminated strings and out-pointers; `prog` is destroyed
        // on every path below.
        unsafe {
            let r = (self.create)(
                &mut prog,
                csrc.as_ptr(),
                name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            );
            if r != 0 {
                return Err(format!("hiprtcCreateProgram: error {r}"));
            }
            let r = (self.compile)(prog, popts.len() as c_int, popts.as_ptr());
            if r != 0 {
                let mut n = 0usize;
                let mut log = String::new();
                if (self.log_size)(prog, &mut n) == 0 && n > 1 {
                    let mut buf = vec![0 as c_char; n];
                    if (self.log)(prog, buf.as_mut_ptr()) == 0 {
                        log = CStr::from_ptr(buf.as_ptr()).to_string_lossy().into_owned();
                    }
                }
                (self.destroy)(&mut prog);
                return Err(format!(
                    "hiprtc failed to compile the kernels (error {r}):\n{log}"
                ));
            }
            let mut size = 0usize;
            let r = (self.code_size)(prog, &mut size);
            if r != 0 || size == 0 {
                (self.destroy)(&mut prog);
                return Err(format!("hiprtcGetCodeSize: error {r}"));
            }
            let mut img = vec![0u8; size];
            let r = (self.code)(prog, img.as_mut_ptr() as *mut c_char);
            (self.destroy)(&mut prog);
            if r != 0 {
                return Err(format!("hiprtcGetCode: error {r}"));
            }
            Ok(img)
        }
    }
}

/// Compiles the kernels for `arch` (`gfx1100`, `gfx1151`) to a code object, through
/// the on-disk cache. Returns the image and whether it came from the cache.
pub fn compile(arch: &str) -> Result<(Arc<Vec<u8>>, bool), String> {
    static MEM: Mutex<BTreeMap<String, Arc<Vec<u8>>>> = Mutex::new(BTreeMap::new());
    if let Some(img) = MEM.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok((img.clone(), true));
    }
    if !arch.starts_with("gfx") || arch.contains('?') {
        return Err(format!(
            "cannot compile the HIP kernels: unknown device arch {arch:?} (set MOE_HIP_ARCH)"
        ));
    }
    let rtc = Rtc::get()?;
    let src = source();
    let opts = [
        format!("--offload-arch={arch}"),
        "-O3".to_string(),
        "-std=c++17".to_string(),
    ];
    let (mut maj, mut min) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { (rtc.version)(&mut maj, &mut min) };
    let ver = format!("hiprtc {maj}.{min}");
    let file = kernels::cache_file(&src, &opts, &ver, arch, "hsaco");
    let (img, cached) = kernels::read_or_build(&cache_dir(), &cache_dir().join(file), || {
        rtc.build(&src, &opts)
    })?;
    let img = Arc::new(img);
    MEM.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), img.clone());
    Ok((img, cached))
}

/// The kernels loaded on one device, plus its device-side launch counters.
pub struct Module {
    funcs: HashMap<&'static str, usize>,
    /// `COUNTER_SLOTS` u32 counters in device memory, bumped by the kernels.
    pub counters: usize,
    pub from_cache: bool,
}

impl Module {
    /// Compiles (or reads from cache) and loads the kernels; the device is current.
    pub fn load(hip: &Hip, arch: &str) -> Result<Module, String> {
        let (img, from_cache) = compile(arch)?;
        let mut m: Ptr = std::ptr::null_mut();
        // SAFETY: a code object produced by hiprtc for this arch; module kept for the
        // process; plain allocation and memset of the counters.
        unsafe {
            hip.check(
                &format!("hipModuleLoadData ({arch})"),
                (hip.module_load_data)(&mut m, img.as_ptr() as *const c_void),
            )?;
            let mut funcs = HashMap::new();
            for name in KERNELS {
                let cname = CString::new(name).expect("no nul");
                let mut f: Ptr = std::ptr::null_mut();
                hip.check(
                    &format!("hipModuleGetFunction({name})"),
                    (hip.module_get_function)(&mut f, m, cname.as_ptr()),
                )?;
                funcs.insert(name, f as usize);
            }
            let mut counters: Ptr = std::ptr::null_mut();
            hip.check("hipMalloc", (hip.malloc)(&mut counters, COUNTER_SLOTS * 4))?;
            hip.check("hipMemset", (hip.memset)(counters, 0, COUNTER_SLOTS * 4))?;
            Ok(Module {
                funcs,
                counters: counters as usize,
                from_cache,
            })
        }
    }

    /// Reads the device-side launch counters (the device is current; waits for
    /// queued work).
    pub fn device_counts(&self, hip: &Hip) -> Result<[u32; COUNTER_SLOTS], String> {
        let mut out = [0u32; COUNTER_SLOTS];
        // SAFETY: the counter buffer lives as long as the module.
        hip.check("hipMemcpy", unsafe {
            (hip.memcpy)(
                out.as_mut_ptr() as Ptr,
                self.counters as *const c_void,
                COUNTER_SLOTS * 4,
                crate::MEMCPY_D2H,
            )
        })?;
        Ok(out)
    }

    /// Launches kernel `name`; `params` point at the argument values, the trailing
    /// `counters` pointer is appended here.
    ///
    /// # Safety
    /// `params` must match the kernel's signature (minus the last `counters`), and
    /// every device pointer in them must be valid for what the kernel touches.
    pub unsafe fn launch(
        &self,
        hip: &Hip,
        stream: Ptr,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        params: &[*mut c_void],
    ) -> Result<(), String> {
        let f = *self
            .funcs
            .get(name)
            .ok_or_else(|| format!("kernel {name} is not loaded"))?;
        let mut counters = self.counters as u64;
        let mut all: Vec<*mut c_void> = params.to_vec();
        all.push(&mut counters as *mut u64 as *mut c_void);
        hip.check(
            &format!("launching {name}"),
            (hip.module_launch_kernel)(
                f as Ptr,
                grid.0 as c_uint,
                grid.1 as c_uint,
                grid.2 as c_uint,
                block as c_uint,
                1,
                1,
                0,
                stream,
                all.as_mut_ptr(),
                std::ptr::null_mut(),
            ),
        )?;
        count_launch(name);
        Ok(())
    }
}

static HOST_COUNTS: kernels::HostCounts = kernels::HostCounts::new();

fn count_launch(name: &'static str) {
    HOST_COUNTS.count(name);
}

/// Launches per kernel counted on the host, sorted by name.
pub fn host_counts() -> BTreeMap<&'static str, u64> {
    HOST_COUNTS.get()
}
