//! The GPU kernels: kernels/gpu sources embedded in the library, compiled with NVRTC
//! for the device's arch on first use, cached on disk, loaded per device; launches
//! counted on the host and, by the kernels themselves, on the device.

use std::{
    collections::{BTreeMap, HashMap},
    ffi::{c_void, CString},
    sync::{Arc, Mutex},
};

use cudarc::{
    driver::{result as cu, sys},
    nvrtc::{result as rtc, sys as rtc_sys},
};

use moe_gpu_common::kernels;

use crate::rt::{err, Device, Raw};

pub const COMMON_CUH: &str = include_str!("../../../kernels/gpu/common.cuh");
pub const ROCMFPX_CU: &str = include_str!("../../../kernels/gpu/rocmfpx.cu");
pub const DS4_CU: &str = include_str!("../../../kernels/gpu/ds4.cu");

pub use moe_gpu_common::kernels::{cache_dir, COUNTER_SLOTS, KERNELS};

/// The full translation unit NVRTC compiles (the include resolved in place).
pub fn source() -> String {
    moe_gpu_common::kernels::source(COMMON_CUH, &[ROCMFPX_CU, DS4_CU])
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library.
    std::panic::catch_unwind(|| unsafe { rtc_sys::is_culib_present() }).unwrap_or(false)
}

fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { rtc_sys::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

/// Compiles the kernels for `arch` (`sm_90`) to a cubin, through the on-disk cache.
/// Returns the image and whether it came from the cache.
pub fn compile(arch: &str) -> Result<(Arc<Vec<u8>>, bool), String> {
    static MEM: Mutex<BTreeMap<String, Arc<Vec<u8>>>> = Mutex::new(BTreeMap::new());
    if let Some(img) = MEM.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok((img.clone(), true));
    }
    if !nvrtc_present() {
        return Err("NVRTC not found (libnvrtc.so): cannot compile the CUDA kernels".into());
    }
    let src = source();
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
    ];
    opts.extend(compile_defines(&|var| std::env::var(var).ok()));
    let (maj, min) = nvrtc_version();
    let ver = format!("nvrtc {maj}.{min}");
    let file = kernels::cache_file(&src, &opts, &ver, arch, "cubin");
    let (img, cached) = kernels::read_or_build(&cache_dir(), &cache_dir().join(file), || {
        nvrtc_compile(&src, &opts)
    })?;
    let img = Arc::new(img);
    MEM.lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(arch.to_string(), img.clone());
    Ok((img, cached))
}

fn nvrtc_compile(src: &str, opts: &[String]) -> Result<Vec<u8>, String> {
    let csrc = CString::new(src).map_err(|e| e.to_string())?;
    let name = CString::new("rocmfpx.cu").expect("no nul");
    let prog = rtc::create_program(&csrc, Some(&name)).map_err(|e| err("nvrtcCreateProgram", e))?;
    // SAFETY: `prog` is live until destroyed below.
    unsafe {
        let r = rtc::compile_program(prog, opts);
        if let Err(e) = r {
            let log = rtc::get_program_log(prog)
                .map(|l| {
                    let bytes: Vec<u8> =
                        l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
                    String::from_utf8_lossy(&bytes).into_owned()
                })
                .unwrap_or_default();
            let _ = rtc::destroy_program(prog);
            return Err(format!("NVRTC failed to compile the kernels ({e}):\n{log}"));
        }
        let mut size = 0usize;
        let r = rtc_sys::nvrtcGetCUBINSize(prog, &mut size);
        if r != rtc_sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            let _ = rtc::destroy_program(prog);
            return Err(format!("nvrtcGetCUBINSize: {r:?}"));
        }
        let mut img = vec![0u8; size];
        let r = rtc_sys::nvrtcGetCUBIN(prog, img.as_mut_ptr() as *mut _);
        let _ = rtc::destroy_program(prog);
        if r != rtc_sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(format!("nvrtcGetCUBIN: {r:?}"));
        }
        Ok(img)
    }
}

/// The kernels loaded on one device, plus its device-side launch counters.
pub struct Module {
    funcs: HashMap<&'static str, Raw<sys::CUfunction>>,
    /// `COUNTER_SLOTS` u32 counters in device memory, bumped by the kernels.
    pub counters: sys::CUdeviceptr,
    pub from_cache: bool,
    /// Launch with programmatic stream serialization (see [`pdl_enabled`]).
    pdl: bool,
    /// Dynamic shared memory the ROCmFP4 runs kernels may take for their bulk path
    /// (see [`bulk_enabled`]; 0: none).
    pub bulk_smem: u32,
    /// `l2_prefetch` asks L2 for bytes (sm_90's bulk prefetch; PREFETCH).
    pub l2_prefetch: bool,
    /// Dynamic shared memory the streamed bf16 tiles may take (0: none; sm_80 on).
    pub mmw_smem: u32,
    /// Dynamic shared memory the DS4 tensor-core prefill kernels (`ds4_attention_tc`,
    /// `ds4_index_scores_mm_tcs` and their `_bf16` forms) may take (0: none; sm_80 on).
    pub ds4_tc_smem: u32,
}

/// Kernels launched cooperatively: their blocks wait for each other at grid barriers,
/// so the launch fails rather than run with some of them not yet resident.
/// `MOE_GPU_MOER_COOP=0` launches them plainly (A/B runs only: their grids are sized to
/// fit an idle device, but nothing then keeps a side stream's kernels from holding the
/// room some blocks need while the others wait for them).
static COOPERATIVE: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| {
    if moe_gpu_common::ds4::env_off("MOE_GPU_MOER_COOP") {
        vec![]
    } else {
        vec!["ds4_moe_routed"]
    }
});

/// The streamed bf16 tiles, whose stages live in dynamic shared memory (mmw_tile in
/// kernels/gpu/rocmfpx.cu).
const MMW_KERNELS: [&str; 4] = ["mmw_dense", "mmw_id", "mmw_dense_m2", "mmw_id_m2"];

/// The ROCmFP4 runs kernels, whose blocks bring their rows into shared memory with bulk
/// copies where the launch gives them room (fp4_runs_q8_bulk in kernels/gpu/rocmfpx.cu).
const BULK_KERNELS: [&str; 6] = [
    "matvec_fp4_runs_q8",
    "matvec_fp4_runs_q8_norm",
    "matvec_fp4_runs_q8_id",
    "matvec_fp4_runs_q8_id_swiglu",
    "matvec_fp4_runs_q8_b2",
    "matvec_fp4_runs_q8_id_b2",
];

/// Bulk copies (cp.async.bulk) from compute capability 9.0 (measured on the H200 only;
/// newer devices take them too, within their shared memory); `MOE_GPU_FP4_BULK=0` keeps
/// the runs kernels on their register path (A/B runs; the same sums).
pub fn bulk_enabled(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && std::env::var_os("MOE_GPU_FP4_BULK").is_none_or(|v| v != "0")
}

/// Lets kernels `names` take all the shared memory a block may opt into, less their
/// static part, and returns the least of those (0: none of them could).
///
/// # Safety
/// `funcs` are live functions of the bound device's module.
unsafe fn smem_room(
    dev: &Device,
    funcs: &HashMap<&'static str, Raw<sys::CUfunction>>,
    names: &[&str],
) -> u32 {
    use sys::{CUdevice_attribute as DA, CUfunction_attribute as FA};
    let Ok(optin) = cu::device::get_attribute(
        dev.cu_dev,
        DA::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    ) else {
        return 0;
    };
    let mut room = u32::MAX;
    for name in names {
        let Some(f) = funcs.get(name) else { return 0 };
        let mut fixed = 0;
        if sys::cuFuncGetAttribute(&mut fixed, FA::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f.0)
            != sys::CUresult::CUDA_SUCCESS
        {
            return 0;
        }
        let dynamic = optin - fixed;
        if dynamic <= 0
            || sys::cuFuncSetAttribute(
                f.0,
                FA::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                dynamic,
            ) != sys::CUresult::CUDA_SUCCESS
        {
            return 0;
        }
        room = room.min(dynamic as u32);
    }
    room
}

/// Asks the driver to give kernel `name` the largest shared-memory carveout (a hint):
/// `ds4_index_scores_mm_tcs` (and `_tcs_bf16`) run two blocks an SM only with nearly all of it.
unsafe fn prefer_shared(funcs: &HashMap<&'static str, Raw<sys::CUfunction>>, name: &str) {
    use sys::CUfunction_attribute as FA;
    if let Some(f) = funcs.get(name) {
        // (a hint: a driver that declines it runs one block an SM, as before)
        let _ = sys::cuFuncSetAttribute(
            f.0,
            FA::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        );
    }
}

/// Programmatic dependent launch from compute capability 9.0: a kernel's launch and
/// block scheduling overlap its predecessor's tail (every kernel waits for the
/// predecessor's completion first thing: `gpu_grid_wait` in kernels/gpu/common.cuh).
/// `MOE_GPU_PDL=0` turns it off (A/B runs).
pub fn pdl_enabled(cc: (i32, i32)) -> bool {
    cc.0 >= 9 && std::env::var_os("MOE_GPU_PDL").is_none_or(|v| v != "0")
}

/// When kernels let their successor launch (see gpu_grid_wait in kernels/gpu/common.cuh).
/// By default (`MOE_GPU_PDL_EARLY=graph`) kernels of small grids do so as they start, and
/// only launches a graph records (a decode step) use dependent launch at all, none
/// outside (prefill): decode +3-5% on the H200, 2026-12-05. `=small`: small grids as they
/// start, in and out of graphs; `=1`: every kernel; `=0`: none (each lets its successor go
/// as it finishes; A/B runs). The compiler define to add, if any.
fn pdl_early(setting: &str) -> Option<&'static str> {
    match setting {
        "1" => Some("-DGPU_PDL_EARLY=1"),
        "small" | "graph" => Some("-DGPU_PDL_EARLY_SMALL=1"),
        _ => None,
    }
}

fn pdl_early_setting(env: &dyn Fn(&str) -> Option<String>) -> String {
    env("MOE_GPU_PDL_EARLY").unwrap_or_else(|| "graph".into())
}

/// Every define the kernels are compiled with for these variables (`env` looks one up):
/// the dependent-launch one, then the A/B switches'.
fn compile_defines(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    let mut d: Vec<String> = pdl_early(&pdl_early_setting(env))
        .map(str::to_string)
        .into_iter()
        .collect();
    d.extend(ab_defines(env));
    d
}

/// Kernels that let their successor launch as they start whatever their grid, while
/// dependent launch is on (`MOE_GPU_PDL_EARLY_KERNELS`, names separated by commas; A/B
/// runs: which product's early start pays); read once.
fn early_kernels() -> &'static [String] {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES.get_or_init(|| parse_names(std::env::var("MOE_GPU_PDL_EARLY_KERNELS").ok().as_deref()))
}

/// Kernel names from a comma-separated list (blanks trimmed, empty entries dropped).
fn parse_names(list: Option<&str>) -> Vec<String> {
    list.unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_string)
        .collect()
}

/// `MOE_GPU_PDL_EARLY=graph`, the default (see [`pdl_early`]); read once.
fn pdl_graph_only() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| pdl_early_setting(&|var| std::env::var(var).ok()) == "graph")
}

/// Compile-time kernel switches for A/B runs, each the same sums as the default:
/// `MOE_GPU_PLAIN_I2F=1` converts the quantised kernels' integer sums with the plain
/// int-to-float instruction instead of `gpu_i2f_small` (the same bits);
/// `MOE_GPU_MMQ_NARROW=0` keeps the wide warp layout for MMQ column tiles of at most 16
/// columns (the same sums in the same order); `MOE_GPU_STREAM_HINT=0` reads the decode
/// products' weights with plain loads instead of evict-first ones (the same values),
/// `=runs` / `=rf2` / `=products` / `=mhc` only those of the ROCmFP4 runs kernels, the
/// ROCmFP2 mat-vecs, both, or the fused mHC site's mixes (the rows kernels and
/// `matvec_f32_wide` keep the hint but with `=0`; other values: ignored);
/// `MOE_GPU_BARRIER_FENCES=1` has the kernels' group barriers (the mHC site's blocks,
/// the many-block top-k, the one-launch decode attention's splits) wait with full
/// fences around plain atomics instead of acquire-release ones (the same values);
/// `MOE_GPU_FP4_STAGE=serial` has the ROCmFP4 runs kernels' bulk path load x one chunk
/// at a time as it quantises it, as the register path does (the same values);
/// `MOE_GPU_FP4_CHUNKS=8` has that path ask for a block's rows in 8 chunks instead of 4
/// and `MOE_GPU_FP4_INFLIGHT=N` (1, 2, 3, 4 or 6) keep only N of them in flight (the same values;
/// see fp4_runs_q8_bulk); `MOE_GPU_MMW_LDSM=1` has the streamed bf16 tiles load their
/// activation fragments by ldmatrix (the same words); `MOE_GPU_MMW_ISSUE=fast` has them
/// work out each thread's copy addresses once a tile instead of once a stage (the same
/// bytes in the same places); `MOE_GPU_MMW_E4=lut` has them look up the blocks' scale
/// bytes in a shared-memory table instead of converting them (the same values);
/// `MOE_GPU_MMW_AFF=template` compiles their type-107 tiles once for affine blocks and
/// once for two-scale ones (the same values, only the tables each uses);
/// `MOE_GPU_RF2_ID=lean` does the same for the routed experts' decode mat-vec
/// (`mmvq_id_107`) and has it look its scales up in a shared table (the same values);
/// `MOE_GPU_FP4_LOOP=lean` has the ROCmFP4 runs kernels keep their permute table in a
/// register and take their activations at immediate offsets (the same values);
/// `MOE_GPU_HCF_SUM=batch` has the fused mHC site ask for all of a warp's shares of the
/// mixes at once before summing them (the same sums in the same order); and
/// `MOE_GPU_POLICY=imm` names the weights' evict-first L2 policy as an immediate in
/// their loads (the same hint; see `GPU_POLICY_IMM` in kernels/gpu/common.cuh);
/// `MOE_GPU_HCF_ROUTE_PREFETCH=0` has the MoE site's routing (`MOE_DS4_SITE_ROUTE=1`)
/// read its router rows without asking L2 for them before the dependent-launch wait
/// (the same values); `MOE_GPU_IDX_SPLIT=trunc` has the indexer's tensor-core scores
/// split their f32 operands into TF32 parts by truncation (three instructions, as
/// `ds4_attention_tc` does) instead of `cvt.rna` (within 2^-20 of each value instead of
/// 2^-22: other bits, so possibly other rows at the top-k's ties);
/// `MOE_GPU_ONE_TRIP=1` has three decode-path loads leave in one L2 round trip where
/// they took several (the same bits): `ds4_norm_rope` asks for a row of up to 1024
/// values at once instead of one iteration of its general loop at a time, the MoE
/// output's combine in the mHC site asks for its up to 8 experts' values before the
/// first product, and `ds4_attention` asks for its head's sink before its
/// dependent-launch wait instead of after its warps' merge.
///
/// The seven from `MOE_GPU_MMW_ISSUE` to `MOE_GPU_POLICY` are on by default since 2026-12-05 (H200, with `MOE_GPU_PDL_EARLY=graph`:
/// depth-0 decode 182.8 / 183.1 / 179.0 tok/s against 173.5 / 176.1 / 171.6 in the same
/// runs, prefill ~1% lower, the fixtures' digits unchanged); `=0` turns each off (A/B runs).
fn ab_defines(env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
    // (variable, the value that switches it on, the define, on when the variable is unset)
    const SWITCHES: [(&str, &str, &str, bool); 16] = [
        ("MOE_GPU_PLAIN_I2F", "1", "-DGPU_PLAIN_I2F=1", false),
        ("MOE_GPU_MMQ_NARROW", "0", "-DMMQ_NARROW_OFF=1", false),
        (
            "MOE_GPU_BARRIER_FENCES",
            "1",
            "-DGPU_BARRIER_FENCES=1",
            false,
        ),
        ("MOE_GPU_FP4_STAGE", "serial", "-DFP4_STAGE_SERIAL=1", false),
        ("MOE_GPU_FP4_CHUNKS", "8", "-DFP4_BULK_CHUNKS=8", false),
        ("MOE_GPU_MMW_LDSM", "1", "-DMMW_LDSM=1", false),
        ("MOE_GPU_MMW_ISSUE", "fast", "-DMMW_FAST_ISSUE=1", true),
        ("MOE_GPU_MMW_E4", "lut", "-DMMW_E4_LUT=1", true),
        ("MOE_GPU_MMW_AFF", "template", "-DMMW_AFF_T=1", true),
        ("MOE_GPU_RF2_ID", "lean", "-DRF2_ID_LEAN=1", true),
        ("MOE_GPU_FP4_LOOP", "lean", "-DFP4_LOOP_LEAN=1", true),
        ("MOE_GPU_HCF_SUM", "batch", "-DHCF_SUM_BATCH=1", true),
        ("MOE_GPU_POLICY", "imm", "-DGPU_POLICY_IMM=1", true),
        (
            "MOE_GPU_HCF_ROUTE_PREFETCH",
            "0",
            "-DHCF_ROUTE_NO_PREFETCH=1",
            false,
        ),
        ("MOE_GPU_IDX_SPLIT", "trunc", "-DIXM_SPLIT_TRUNC=1", false),
        ("MOE_GPU_ONE_TRIP", "1", "-DONE_TRIP=1", false),
    ];
    let mut d: Vec<&str> = SWITCHES
        .iter()
        .filter(|&&(var, val, _, default)| switch_on(env(var).as_deref(), val, default))
        .map(|&(_, _, define, _)| define)
        .collect();
    match env("MOE_GPU_STREAM_HINT").as_deref() {
        Some("0") => d.push("-DGPU_NO_STREAM_HINT=1"),
        Some("runs") => d.push("-DRUNS_NO_STREAM_HINT=1"),
        Some("rf2") => d.push("-DRF2_NO_STREAM_HINT=1"),
        Some("products") => d.extend(["-DRUNS_NO_STREAM_HINT=1", "-DRF2_NO_STREAM_HINT=1"]),
        Some("mhc") => d.push("-DHC_NO_STREAM_HINT=1"),
        _ => {}
    }
    let mut d: Vec<String> = d.into_iter().map(str::to_string).collect();
    if let Some(n) = env("MOE_GPU_FP4_INFLIGHT") {
        if ["1", "2", "3", "4", "6"].contains(&n.as_str()) {
            d.push(format!("-DFP4_BULK_INFLIGHT={n}"));
        }
    }
    // The largest grid that lets its successor launch as it starts (GPU_PDL_SMALL_GRID,
    // 64 by default): larger values let mid-sized decode kernels (the router, the rows
    // products) start the next product's weight loads earlier.
    if let Some(n) = env("MOE_GPU_PDL_SMALL_GRID").and_then(|n| n.parse::<u32>().ok()) {
        if (1..=1 << 20).contains(&n) {
            d.push(format!("-DGPU_PDL_SMALL_GRID={n}"));
        }
    }
    d
}

/// Whether an A/B switch is on: its value names it, or it is on by default and the
/// variable is unset or anything but `0`.
fn switch_on(value: Option<&str>, on: &str, default: bool) -> bool {
    match value {
        Some(v) if v == on => true,
        Some(v) => default && v != "0",
        None => default,
    }
}

impl Module {
    /// Compiles (or reads from cache) and loads the kernels; the device is bound.
    pub fn load(dev: &Device) -> Result<Module, String> {
        moe_gpu_common::ds4::check_prec()?;
        let (img, from_cache) = compile(&dev.arch)?;
        // SAFETY: a cubin produced by NVRTC for this arch; module kept for the process.
        unsafe {
            let m = cu::module::load_data(img.as_ptr() as *const c_void)
                .map_err(|e| err(&format!("cuModuleLoadData ({})", dev.arch), e))?;
            let mut funcs = HashMap::new();
            for name in KERNELS {
                let f = cu::module::get_function(m, CString::new(name).expect("no nul"))
                    .map_err(|e| err(&format!("cuModuleGetFunction({name})"), e))?;
                funcs.insert(name, Raw(f));
            }
            let counters = cu::malloc_sync(COUNTER_SLOTS * 4).map_err(|e| err("cuMemAlloc", e))?;
            cu::memset_d8_sync(counters, 0, COUNTER_SLOTS * 4).map_err(|e| err("cuMemset", e))?;
            let bulk_smem = match bulk_enabled(dev.cc) {
                true => smem_room(dev, &funcs, &BULK_KERNELS),
                false => 0,
            };
            // (mma.sync on bf16 and cp.async: sm_80 on)
            let (mmw_smem, ds4_tc_smem) = match dev.cc.0 >= 8 {
                true => {
                    prefer_shared(&funcs, "ds4_index_scores_mm_tcs");
                    prefer_shared(&funcs, "ds4_index_scores_mm_tcs_bf16");
                    let ds4_tc = [
                        "ds4_attention_tc",
                        "ds4_attention_tc_bf16",
                        "ds4_index_scores_mm_tcs",
                        "ds4_index_scores_mm_tcs_bf16",
                    ];
                    (
                        smem_room(dev, &funcs, &MMW_KERNELS),
                        smem_room(dev, &funcs, &ds4_tc),
                    )
                }
                false => (0, 0),
            };
            Ok(Module {
                funcs,
                counters,
                from_cache,
                pdl: pdl_enabled(dev.cc),
                bulk_smem,
                // (the kernel's bulk prefetch is compiled where GPU_BULK is: sm_90 on)
                l2_prefetch: dev.cc.0 >= 9,
                mmw_smem,
                ds4_tc_smem,
            })
        }
    }

    /// Kernel `name`'s registers a thread and local (spilled) bytes a thread, as the
    /// driver reports them for the loaded image (None: no such kernel, or no answer).
    pub fn resources(&self, name: &str) -> Option<(i32, i32)> {
        use sys::CUfunction_attribute as FA;
        let f = self.funcs.get(name)?;
        let attr = |a| {
            let mut v = 0;
            // SAFETY: a live function of this module; v is written by the call.
            (unsafe { sys::cuFuncGetAttribute(&mut v, a, f.0) } == sys::CUresult::CUDA_SUCCESS)
                .then_some(v)
        };
        Some((
            attr(FA::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            attr(FA::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
        ))
    }

    /// Reads the device-side launch counters (waits for queued work on the device's
    /// legacy stream, which the backend's streams synchronise with).
    pub fn device_counts(&self, dev: &Device) -> Result<[u32; COUNTER_SLOTS], String> {
        dev.bind()?;
        let mut out = [0u32; COUNTER_SLOTS];
        // SAFETY: the counter buffer lives as long as the module.
        unsafe { cu::memcpy_dtoh_sync(&mut out[..], self.counters) }
            .map_err(|e| err("cuMemcpyDtoH", e))?;
        Ok(out)
    }

    /// Launches kernel `name` with `smem` bytes of dynamic shared memory; `params` point
    /// at the argument values, the trailing `counters` pointer is appended here.
    ///
    /// # Safety
    /// `params` must match the kernel's signature (minus the last `counters`), and
    /// every device pointer in them must be valid for what the kernel touches.
    pub unsafe fn launch(
        &self,
        stream: sys::CUstream,
        name: &'static str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: &[*mut c_void],
    ) -> Result<(), String> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| format!("kernel {name} is not loaded"))?;
        let uncaptured = || {
            matches!(
                cu::stream::is_capturing(stream),
                Ok(sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
            )
        };
        let timed = profiling() && uncaptured();
        let start = if timed { record(stream) } else { None };
        let pdl = self.pdl && !(pdl_graph_only() && uncaptured());
        // The low bit of the counters' address asks the kernel to let its successor
        // launch as it starts (gpu_count_launch in kernels/gpu/common.cuh).
        let early = pdl && early_kernels().iter().any(|k| k == name);
        let mut counters = self.counters | u64::from(early);
        let mut all: Vec<*mut c_void> = params.to_vec();
        all.push(&mut counters as *mut u64 as *mut c_void);
        let coop = COOPERATIVE.contains(&name);
        if pdl || coop {
            let mut attrs: [sys::CUlaunchAttribute; 3] = [std::mem::zeroed(); 3];
            let mut n_attrs = 0;
            if pdl {
                attrs[0].id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attrs[0].value.programmaticStreamSerializationAllowed = 1;
                n_attrs = 1;
                if crate::rt::stream_prio() != crate::rt::StreamPrio::Off {
                    let mut prio = 0;
                    if sys::cuStreamGetPriority(stream, &mut prio) == sys::CUresult::CUDA_SUCCESS {
                        attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PRIORITY;
                        attrs[n_attrs].value.priority = prio;
                        n_attrs += 1;
                    }
                }
            }
            if coop {
                attrs[n_attrs].id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
                attrs[n_attrs].value.cooperative = 1;
                n_attrs += 1;
            }
            let cfg = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block,
                blockDimY: 1,
                blockDimZ: 1,
                sharedMemBytes: smem,
                hStream: stream,
                attrs: attrs.as_mut_ptr(),
                numAttrs: n_attrs as u32,
            };
            sys::cuLaunchKernelEx(&cfg, f.0, all.as_mut_ptr(), std::ptr::null_mut())
                .result()
                .map_err(|e| err(&format!("launching {name}"), e))?;
        } else {
            cu::launch_kernel(f.0, grid, (block, 1, 1), smem, stream, &mut all)
                .map_err(|e| err(&format!("launching {name}"), e))?;
        }
        if let (Some(start), Some(end)) = (start, if timed { record(stream) } else { None }) {
            let mut t = TIMED.lock().unwrap_or_else(|e| e.into_inner());
            t.push(Timed { name, start, end });
            if t.len() >= 1 << 14 {
                resolve(&mut t);
            }
        }
        count_launch(name);
        Ok(())
    }
}

/// `MOE_GPU_PROFILE=1`: every launch outside a graph capture is bracketed by two events,
/// and `kernel_counters` adds `<name>.ns`, the GPU time between them (profiling runs
/// only: the events cost launches of their own).
pub fn profiling() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("MOE_GPU_PROFILE").is_some_and(|v| v != "0"))
}

struct Timed {
    name: &'static str,
    start: sys::CUevent,
    end: sys::CUevent,
}
// SAFETY: event handles are usable from any thread of the process.
unsafe impl Send for Timed {}
static TIMED: Mutex<Vec<Timed>> = Mutex::new(Vec::new());
static GPU_NS: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn record(stream: sys::CUstream) -> Option<sys::CUevent> {
    let ev = cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ok()?;
    // SAFETY: a fresh event on a live stream.
    unsafe { cu::event::record(ev, stream) }.ok()?;
    Some(ev)
}

/// Waits for the recorded launches and adds their times to GPU_NS.
fn resolve(t: &mut Vec<Timed>) {
    let mut ns = GPU_NS.lock().unwrap_or_else(|e| e.into_inner());
    for x in t.drain(..) {
        // SAFETY: events created and recorded by `record`, destroyed once here.
        unsafe {
            if cu::event::synchronize(x.end).is_ok() {
                if let Ok(ms) = cu::event::elapsed(x.start, x.end) {
                    *ns.entry(x.name).or_default() += (ms as f64 * 1e6) as u64;
                }
            }
            let _ = cu::event::destroy(x.start);
            let _ = cu::event::destroy(x.end);
        }
    }
}

/// GPU nanoseconds per kernel name (`MOE_GPU_PROFILE=1`), sorted by name.
pub fn gpu_ns() -> BTreeMap<&'static str, u64> {
    resolve(&mut TIMED.lock().unwrap_or_else(|e| e.into_inner()));
    GPU_NS.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

static HOST_COUNTS: kernels::HostCounts = kernels::HostCounts::new();

fn count_launch(name: &'static str) {
    HOST_COUNTS.count(name);
}

/// Launches per kernel counted on the host, sorted by name.
pub fn host_counts() -> BTreeMap<&'static str, u64> {
    HOST_COUNTS.get()
}

#[cfg(test)]
mod tests {
    use super::{compile_defines, parse_names, switch_on};

    /// The defines of a build with no variable set are the committed list that CI's NVRTC
    /// check compiles (kernels/gpu/default_options).
    #[test]
    fn default_defines_are_the_listed_ones() {
        let listed: Vec<String> = include_str!("../../../kernels/gpu/default_options")
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(|l| format!("-D{l}"))
            .collect();
        assert_eq!(compile_defines(&|_| None), listed);
        // Turning every default-on switch off leaves no define.
        const DEFAULT_ON: [&str; 8] = [
            "MOE_GPU_PDL_EARLY",
            "MOE_GPU_MMW_ISSUE",
            "MOE_GPU_MMW_E4",
            "MOE_GPU_MMW_AFF",
            "MOE_GPU_RF2_ID",
            "MOE_GPU_FP4_LOOP",
            "MOE_GPU_HCF_SUM",
            "MOE_GPU_POLICY",
        ];
        let off = |var: &str| DEFAULT_ON.contains(&var).then(|| "0".to_string());
        assert_eq!(compile_defines(&off), Vec::<String>::new());
    }

    #[test]
    fn early_kernel_names_parse() {
        assert!(parse_names(None).is_empty());
        assert_eq!(
            parse_names(Some(" mmvq_id_107, ,ds4_router_mm,")),
            ["mmvq_id_107", "ds4_router_mm"]
        );
    }

    #[test]
    fn pdl_small_grid_takes_a_block_count_only() {
        let with = |v: &'static str| {
            compile_defines(&move |var: &str| {
                (var == "MOE_GPU_PDL_SMALL_GRID").then(|| v.to_string())
            })
        };
        assert!(with("256").contains(&"-DGPU_PDL_SMALL_GRID=256".to_string()));
        for bad in ["0", "-4", "many", "99999999"] {
            assert!(
                !with(bad).iter().any(|d| d.contains("PDL_SMALL_GRID")),
                "{bad}"
            );
        }
    }

    #[test]
    fn switches_default_on_turn_off_with_zero_only() {
        // An opt-in switch: only its value turns it on.
        assert!(!switch_on(None, "lean", false));
        assert!(!switch_on(Some("0"), "lean", false));
        assert!(!switch_on(Some("1"), "lean", false));
        assert!(switch_on(Some("lean"), "lean", false));
        // A default-on switch: `0` turns it off; its value or anything else keeps it.
        assert!(switch_on(None, "lean", true));
        assert!(switch_on(Some("lean"), "lean", true));
        assert!(!switch_on(Some("0"), "lean", true));
    }
}
