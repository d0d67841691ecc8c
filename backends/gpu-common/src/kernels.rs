//! The kernel list (launch-counter slot order), the translation unit both runtime
//! compilers see, the on-disk cache (directory, key, read-or-build) and host-side
//! launch counting.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Mutex,
};

/// Kernel names in launch-counter slot order (the `KID_*` defines of rocmfpx.cu).
pub const KERNELS: [&str; 80] = [
    "quantize_q8_1",
    "mmvq_107_n1",
    "mmvq_107_n2",
    "mmvq_107_n3",
    "mmvq_107_n4",
    "mmvq_107_n5",
    "mmvq_107_n6",
    "mmvq_107_n7",
    "mmvq_107_n8",
    "mmq_dp4a_107",
    "moe_sort",
    "mmvq_grouped_107",
    "add_f32",
    "get_rows_f32",
    "get_rows_107",
    "mmq_mma_107",
    "matvec_dense",
    "get_rows_dense",
    "ds4_norm_rope",
    "ds4_hc_pre",
    "ds4_hc_post",
    "ds4_comp_pool",
    "ds4_comp_store",
    "ds4_index_scores",
    "ds4_topk_rows",
    "ds4_attention",
    "ds4_window_store",
    "ds4_router",
    "ds4_swiglu",
    "ds4_moe_combine",
    "matvec_dense_id",
    "transpose12",
    "matvec_dense_rows",
    "matvec_dense_rows_id",
    "matvec_f32_wide",
    "mmq_mma_dense",
    "mmq_mma_id",
    "mmvq_id_107",
    "matvec_fp4_runs_q8",
    "matvec_fp4_runs_q8_id",
    "matvec_dense_rows_multi",
    "matvec_dense_q8_multi",
    "matvec_dense_q8_id",
    "quantize_q8_1_swiglu",
    "ds4_hc_post_pre",
    "ds4_hc_sinkhorn",
    "ds4_attention_heads",
    "ds4_attention_merge",
    "ds4_index_scores_mm",
    "ds4_index_scores_mm_tc",
    "mmb_dense",
    "mmb_id",
    "matvec_fp4_mma",
    "matvec_fp4_mma_id",
    "matmul_f32_tiles",
    "matmul_f32_reduce",
    "ds4_attention_dec",
    "ds4_topk_rows_wide",
    "matvec_fp4_runs_q8_id_swiglu",
    "ds4_router_mm",
    "matvec_fp4_runs_q8_norm",
    "mmw_dense",
    "mmw_id",
    "f32_to_bf16",
    "mmw_dense_m2",
    "mmw_id_m2",
    "l2_prefetch",
    "matvec_dense_cols",
    "matvec_fp4_runs_q8_cols",
    "matvec_dense_cols_multi",
    "ds4_index_scores_few",
    "ds4_attention_grp",
    "ds4_attention_heads4",
    "ds4_attention_tc",
    "ds4_index_scores_mm_tcs",
    "ds4_index_scores_mm_tcs_bf16",
    "ds4_attention_tc_bf16",
    "ds4_moe_routed",
    "matvec_fp4_runs_q8_b2",
    "matvec_fp4_runs_q8_id_b2",
];
/// Device-side launch counters (u32 each) the kernels bump: one a kernel.
pub const COUNTER_SLOTS: usize = KERNELS.len();

/// Parameter count of each `__global__` kernel in the sources (the backend appends
/// the counters pointer, the last parameter): tests check launches against it.
#[cfg(test)]
pub(crate) fn signatures() -> std::collections::HashMap<String, usize> {
    let src = [
        include_str!("../../../kernels/gpu/ds4.cu"),
        include_str!("../../../kernels/gpu/rocmfpx.cu"),
    ]
    .concat();
    let mut out = std::collections::HashMap::new();
    for part in src.split("__global__ void __launch_bounds__(").skip(1) {
        let rest = &part[part.find(')').unwrap() + 1..];
        let (name, args) = rest.split_once('(').unwrap();
        let args = &args[..args.find(')').unwrap()];
        out.insert(name.trim().to_string(), args.split(',').count());
    }
    out
}

/// The full translation unit: the `units` in order, the first one's
/// `#include "common.cuh"` replaced by `common_cuh` (less its `#pragma once`), the
/// others' dropped, and so are the units' includes of each other (a unit that reads an
/// earlier one includes it for compiles of it alone, kernels/check.sh).
pub fn source(common_cuh: &str, units: &[&str]) -> String {
    let inc = "#include \"common.cuh\"";
    let mut out = String::new();
    for (i, u) in units.iter().enumerate() {
        let with = if i == 0 {
            common_cuh.replace("#pragma once", "")
        } else {
            String::new()
        };
        for line in u.replace(inc, &with).lines() {
            let unit_include = line.starts_with("#include \"") && line.ends_with(".cu\"");
            if !unit_include {
                out.push_str(line);
            }
            out.push('\n');
        }
    }
    out
}

/// 64-bit FNV-1a: a hash stable across builds and Rust versions, for cache keys.
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where compiled kernels are cached: `$MOE_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/moeserve/kernels`, else `~/.cache/moeserve/kernels`, else
/// `.cache/kernels`.
pub fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MOE_KERNEL_CACHE") {
        return d.into();
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("moeserve/kernels");
    }
    if let Some(d) = std::env::var_os("HOME") {
        return PathBuf::from(d).join(".cache/moeserve/kernels");
    }
    PathBuf::from(".cache/kernels")
}

/// The cache file name of the image of `src` compiled with `opts` by compiler
/// `version` for `arch`: `rocmfpx-<key>-<arch>.<ext>`.
pub fn cache_file(src: &str, opts: &[String], version: &str, arch: &str, ext: &str) -> String {
    let key = fnv1a(&[
        src.as_bytes(),
        opts.join(" ").as_bytes(),
        version.as_bytes(),
    ]);
    format!("rocmfpx-{key:016x}-{arch}.{ext}")
}

/// Reads the image at `path` in `dir`, or builds it and writes it there (atomically;
/// the cache is an optimisation, failing to write it is not an error). Returns the
/// image and whether it came from the cache.
pub fn read_or_build(
    dir: &Path,
    path: &Path,
    build: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<(Vec<u8>, bool), String> {
    match std::fs::read(path) {
        Ok(b) if !b.is_empty() => Ok((b, true)),
        _ => {
            let img = build()?;
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = path.with_extension(format!("tmp{}", std::process::id()));
                if std::fs::write(&tmp, &img).is_ok() {
                    let _ = std::fs::rename(&tmp, path);
                }
            }
            Ok((img, false))
        }
    }
}

/// Launches counted on the host, per kernel name (one per backend).
pub struct HostCounts(Mutex<BTreeMap<&'static str, u64>>);

impl HostCounts {
    pub const fn new() -> HostCounts {
        HostCounts(Mutex::new(BTreeMap::new()))
    }

    pub fn count(&self, name: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(name)
            .or_default() += 1;
    }

    /// Launches per kernel, sorted by name.
    pub fn get(&self) -> BTreeMap<&'static str, u64> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Default for HostCounts {
    fn default() -> Self {
        HostCounts::new()
    }
}

/// The `kernel_counters` list: host counts under each kernel's name and, when `device`
/// holds the summed device-side counters, the non-zero ones as `<name>.device`; sorted.
pub fn counter_list(
    host: BTreeMap<&'static str, u64>,
    device: Option<[u64; COUNTER_SLOTS]>,
) -> Vec<(String, u64)> {
    let mut out: Vec<(String, u64)> = host.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    if let Some(dev) = device {
        for (i, name) in KERNELS.iter().enumerate() {
            if dev[i] > 0 {
                out.push((format!("{name}.device"), dev[i]));
            }
        }
    }
    out.sort();
    out
}

/// Adds one device's counters to `sum`.
pub fn add_counts(sum: &mut [u64; COUNTER_SLOTS], c: [u32; COUNTER_SLOTS]) {
    for (a, b) in sum.iter_mut().zip(c) {
        *a += b as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn source_resolves_the_include() {
        let s = source(
            "#pragma once\nint c;\n",
            &[
                "#include \"common.cuh\"\nint k;\n",
                "#include \"common.cuh\"\nint j;\n",
            ],
        );
        assert!(!s.contains("#include") && !s.contains("#pragma once"));
        assert!(s.contains("int c;") && s.contains("int k;") && s.contains("int j;"));
        assert_eq!(s.matches("int c;").count(), 1);
    }

    #[test]
    fn cache_key_changes_with_source_opts_version_and_arch() {
        let o = vec!["--gpu-architecture=sm_90".to_string()];
        let base = cache_file("src", &o, "nvrtc 13.0", "sm_90", "cubin");
        assert!(base.starts_with("rocmfpx-") && base.ends_with("-sm_90.cubin"));
        assert_eq!(base.len(), "rocmfpx-".len() + 16 + "-sm_90.cubin".len());
        assert_eq!(base, cache_file("src", &o, "nvrtc 13.0", "sm_90", "cubin"));
        assert_ne!(base, cache_file("src2", &o, "nvrtc 13.0", "sm_90", "cubin"));
        assert_ne!(base, cache_file("src", &[], "nvrtc 13.0", "sm_90", "cubin"));
        assert_ne!(base, cache_file("src", &o, "nvrtc 12.8", "sm_90", "cubin"));
        assert_ne!(base, cache_file("src", &o, "nvrtc 13.0", "sm_80", "cubin"));
        // Part boundaries count: ("ab", "c") is not ("a", "bc").
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
    }

    #[test]
    fn read_or_build_caches() {
        let dir = std::env::temp_dir().join(format!("moe-gpu-common-{}", std::process::id()));
        let path = dir.join("x.bin");
        let (img, cached) = read_or_build(&dir, &path, || Ok(vec![1, 2, 3])).unwrap();
        assert_eq!((img, cached), (vec![1, 2, 3], false));
        let (img, cached) = read_or_build(&dir, &path, || Err("not again".into())).unwrap();
        assert_eq!((img, cached), (vec![1, 2, 3], true));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(read_or_build(&dir, &path, || Err("e".into())).is_err());
    }

    #[test]
    fn counters() {
        assert!(KERNELS.len() <= COUNTER_SLOTS);
        let h = HostCounts::new();
        h.count("moe_sort");
        h.count("add_f32");
        h.count("moe_sort");
        let mut dev = [0u64; COUNTER_SLOTS];
        add_counts(&mut dev, [1; COUNTER_SLOTS]);
        add_counts(&mut dev, {
            let mut c = [0; COUNTER_SLOTS];
            c[10] = 1;
            c
        });
        assert_eq!(counter_list(h.get(), None).len(), 2);
        let l = counter_list(h.get(), Some(dev));
        assert_eq!(l[0], ("add_f32".to_string(), 1));
        assert!(l.contains(&("moe_sort".to_string(), 2)));
        assert!(l.contains(&("moe_sort.device".to_string(), 2)));
        assert_eq!(l.len(), 2 + KERNELS.len());
    }
}
