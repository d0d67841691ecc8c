//! The CUDA kernel backend.
//!
//! Builds with no CUDA installed: libcuda and libnvrtc are opened at run time
//! (cudarc's `dynamic-loading`), and a machine without them gets a clear error from
//! `devices` instead of a crash. The kernel sources (`kernels/gpu`, shared with the
//! HIP backend) are embedded in the library and compiled with NVRTC for each device's
//! arch on first use, then cached on disk (see [`kernels::cache_dir`]).
//!
//! Ops: MATMUL with ROCmFP2 (type 107, both meanings) weights, MMVQ for 1..8 columns
//! and MMQ above (int8 tensor cores on sm_80+, dp4a below), and with the dense types
//! (f32/f16/bf16/q8_0/mxfp4/ROCmFP4); MATMUL_ID (the grouped MoE mat-vec; also under the
//! older private code [`ops::OP_MATMUL_ID`]); GET_ROWS, ADD; the DeepSeek-V4 glue ops of
//! ABI 1.1 (`moe_gpu_common::ds4`) and graph capture (GRAPH_BEGIN / END / LAUNCH).
//! `kernel_counters` reports launches counted on the host under each kernel's name and,
//! under `<name>.device`, the launches the kernels counted themselves (proof of which
//! kernel actually ran); with `MOE_GPU_PROFILE=1`, `<name>.ns` the GPU time of each.

pub mod kernels;
pub mod ops;
pub mod rt;

/// Builds the `void**` argument list of a kernel launch from local variables.
pub use moe_gpu_common::kargs;

use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{ROption, RResult, RSlice, RSliceMut, RStr, RString, RVec, Tuple2},
    },
    defaults, guard, guard_or, AbiVersion, Backend, DeviceInfo, OpParams, Plugin, PluginInfo,
    PluginKind, PluginRef, QuantFormat, TensorRef,
};

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

/// The backend's plugins.toml settings (`[plugin.settings]`). Both precisions are
/// DeepSeek-V4's reduced-precision paths on the tensor cores, "f32" (the default) or
/// "bf16" (see the README); `MOE_GPU_IDX_PREC` / `MOE_GPU_ATT_PREC` override them.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    /// The indexer's scores.
    indexer_precision: Option<String>,
    /// A prefill chunk's attention products.
    attention_precision: Option<String>,
}

extern "C" fn configure(settings: RStr<'_>) -> RResult<(), RString> {
    guard("cuda configure", || {
        let s: Settings = toml::from_str(settings.as_str()).map_err(|e| e.message().to_string())?;
        let prec = |key: &str, v: &Option<String>| {
            v.as_deref()
                .map(|v| moe_gpu_common::ds4::prec_bf16(key, v))
                .transpose()
        };
        moe_gpu_common::ds4::set_precision(
            prec("indexer_precision", &s.indexer_precision)?,
            prec("attention_precision", &s.attention_precision)?,
        );
        Ok(())
    })
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "cuda".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::KernelBackend,
        description: "NVIDIA GPUs through the CUDA driver API; kernels compiled with NVRTC".into(),
    }
}

/// The backend's function table (also usable directly from Rust through the rlib).
pub fn table() -> Backend {
    Backend {
        name: "cuda".into(),
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
    guard("cuda devices", || {
        let rt = rt::runtime()?;
        Ok(rt
            .devices
            .iter()
            .map(|d| DeviceInfo {
                index: d.index,
                name: d.name.clone().into(),
                arch: d.arch.clone().into(),
                memory_bytes: d.memory_bytes,
                bandwidth_bytes_per_s: d.bandwidth(),
                unified_memory: false,
            })
            .collect())
    })
}

extern "C" fn register_quant_formats(_formats: RVec<QuantFormat>) -> RResult<(), RString> {
    // The GPU kernels implement their formats natively.
    RResult::ROk(())
}

extern "C" fn alloc(device: u32, bytes: u64) -> RResult<u64, RString> {
    guard("cuda alloc", || rt::alloc(device, bytes))
}

extern "C" fn free(buffer: u64) -> RResult<(), RString> {
    guard("cuda free", || rt::free(buffer))
}

extern "C" fn upload(buffer: u64, offset: u64, data: RSlice<'_, u8>) -> RResult<(), RString> {
    guard("cuda upload", || {
        rt::upload(buffer, offset, data.as_slice())
    })
}

extern "C" fn download(
    buffer: u64,
    offset: u64,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard("cuda download", || {
        rt::download(buffer, offset, out.as_mut_slice())
    })
}

extern "C" fn stream_create(device: u32) -> RResult<u64, RString> {
    guard("cuda stream_create", || rt::stream_create(device))
}

extern "C" fn event_record(stream: u64) -> RResult<u64, RString> {
    guard("cuda event_record", || rt::event_record(stream))
}

extern "C" fn stream_wait_event(stream: u64, event: u64) -> RResult<(), RString> {
    guard("cuda stream_wait_event", || {
        rt::stream_wait_event(stream, event)
    })
}

extern "C" fn synchronize(stream: u64) -> RResult<(), RString> {
    guard("cuda synchronize", || rt::synchronize(stream))
}

extern "C" fn run_op(
    stream: u64,
    op: u32,
    params: OpParams,
    args: RSlice<'_, TensorRef>,
) -> RResult<(), RString> {
    guard("cuda run_op", || {
        ops::run(stream, op, &params, args.as_slice())
    })
}

/// Host-side launch counts under each kernel's name; `<name>.device` the counts the
/// kernels recorded on the devices (summed), for devices whose kernels are loaded.
pub fn counters() -> Vec<(String, u64)> {
    let mut dev = None;
    if let Ok(rt) = rt::runtime() {
        for d in &rt.devices {
            // Only devices whose module is already loaded: never compile here.
            if let Some(Ok(m)) = d.loaded_module() {
                if let Ok(c) = m.device_counts(d) {
                    moe_gpu_common::kernels::add_counts(
                        dev.get_or_insert([0; kernels::COUNTER_SLOTS]),
                        c,
                    );
                }
            }
        }
    }
    let mut out = moe_gpu_common::kernels::counter_list(kernels::host_counts(), dev);
    if kernels::profiling() {
        out.extend(
            kernels::gpu_ns()
                .into_iter()
                .map(|(k, v)| (format!("{k}.ns"), v)),
        );
        out.sort();
    }
    out
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

    #[test]
    fn settings_take_the_precisions_and_refuse_the_rest() {
        let conf = |t: &str| moe_plugin_api::into_result(configure(t.into()));
        assert!(conf("").is_ok());
        assert!(conf("indexer_precision = \"bf16\"\nattention_precision = \"f32\"").is_ok());
        let e = conf("indexer_precision = \"fp8\"").unwrap_err();
        assert!(
            e.contains("indexer_precision=fp8") && e.contains("\"bf16\""),
            "{e}"
        );
        let e = conf("threads = 4").unwrap_err();
        assert!(e.contains("threads"), "{e}");
        moe_gpu_common::ds4::set_precision(None, None);
    }

    #[test]
    fn no_driver_is_an_error_not_a_crash() {
        // On machines with CUDA this lists devices; without, it must say why.
        match moe_plugin_api::into_result(devices()) {
            Ok(devs) => assert!(devs.iter().all(|d| d.arch.starts_with("sm_"))),
            Err(e) => assert!(!e.is_empty()),
        }
        if !rt::driver_present() {
            let e = moe_plugin_api::into_result(devices()).unwrap_err();
            assert!(e.contains("no CUDA driver"), "{e}");
            assert!(moe_plugin_api::into_result(alloc(0, 16)).is_err());
        }
    }

    #[test]
    fn kernel_source_is_self_contained() {
        let src = kernels::source();
        assert!(!src.contains("#include"));
        for k in kernels::KERNELS {
            // The MMVQ kernels are stamped out by a macro, one per column count.
            let needle = match k.strip_prefix("mmvq_107_n") {
                Some(n) => format!("RF_MMVQ({n})"),
                None => format!(" {k}("),
            };
            assert!(src.contains(&needle), "kernel {k} missing from the source");
        }
    }
}
