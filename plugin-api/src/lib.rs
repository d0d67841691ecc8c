//! The stable ABI between the `moeserve` host and its plugins.
//!
//! Every plugin is a `cdylib` exporting ONE root module, [`PluginRef`], built with
//! abi_stable. The root says which ABI version it was built against and hands out up to
//! three kinds of tables:
//!
//! * [`QuantFormat`]: a GGUF tensor type (block size, validate, decode, encode, q8 dot);
//! * [`Backend`]: devices, buffers, streams/events, the ops the models run, kernel counters;
//! * [`PlacementPolicy`]: which device holds which tensor (and expert slice), per phase.
//!
//! Rules every plugin follows (see `README.md` of the repository):
//! * every exported function contains panics ([`guard`]) and returns `RResult`;
//! * memory is freed on the side that allocated it (abi_stable's `RVec`/`RString` carry
//!   their allocator with them);
//! * plugins are never unloaded.

pub mod backend;
pub mod placement;
pub mod q8;
pub mod quant;

use std::panic::{catch_unwind, AssertUnwindSafe};

use abi_stable::{
    declare_root_module_statics,
    library::RootModule,
    package_version_strings,
    sabi_types::VersionStrings,
    std_types::{ROption, RResult, RStr, RString, RVec},
    StableAbi,
};

pub use abi_stable;
pub use backend::*;
pub use placement::*;
pub use q8::BlockQ8_1;
pub use quant::*;

/// Major version of this ABI. A plugin with another major never loads.
pub const ABI_MAJOR: u32 = 1;
/// Minor version. A plugin built against an older minor of the same major loads; fields
/// added to prefix tables since then read as absent.
/// 1: the DeepSeek-V4 glue ops, MATMUL_ID and graph capture (`backend::ops` 9, 16..=28).
/// 2: MATMUL_MULTI and MATMUL_ID_MULTI (`backend::ops` 29, 30).
/// 3: SWIGLU_MATMUL_ID (`backend::ops` 31), HC_POST of the MoE's outputs (4 or 5 args).
/// 4: HC_POST_PRE and HC_SINKHORN (`backend::ops` 32, 33), HC_PRE's deferred Sinkhorn,
///    the rotaries inside SPARSE_ATTENTION (a 9th argument) and INDEX_SCORES (a 6th).
/// 5: SPARSE_ATTENTION's sync words (a 10th argument).
/// 6: TOPK_ROWS's work words (a 4th argument).
/// 7: ROUTER with its product (x, the router's weights and sync words: 9 arguments).
/// 8: NORM_MATMUL (`backend::ops` 34).
/// 9: PREFETCH (`backend::ops` 35).
/// 10: HC_POST_PRE's xq (i[3]) and MATMUL_ID_MULTI's (i[0]): x quantised once for the
///     MoE's grouped products.
/// 11: HC_POST_PRE's routing (i[4]): ROUTER with its product of the site's x, in the op.
/// 12: MATMUL_ID's and SWIGLU_MATMUL_ID's fixed ids (i[0]): their weights may stream
///     before the ops ahead of them finish.
/// 13: MOE_ROUTED (`backend::ops` 36): one token's router and routed experts as one op.
pub const ABI_MINOR: u32 = 13;

/// Explicit ABI version carried by every root module.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub struct AbiVersion {
    pub major: u32,
    pub minor: u32,
}

impl AbiVersion {
    pub const CURRENT: AbiVersion = AbiVersion {
        major: ABI_MAJOR,
        minor: ABI_MINOR,
    };
}

impl std::fmt::Display for AbiVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// What a plugin mainly is (a plugin may still provide tables of several kinds).
#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginKind {
    QuantFormat,
    KernelBackend,
    PlacementPolicy,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::QuantFormat => "quant",
            PluginKind::KernelBackend => "backend",
            PluginKind::PlacementPolicy => "placement",
        }
    }
}

/// Identity of a plugin, shown by `moeserve plugins`.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct PluginInfo {
    pub name: RString,
    pub version: RString,
    pub kind: PluginKind,
    pub description: RString,
}

/// The root module every plugin exports with `#[export_root_module]`.
///
/// It is a prefix type: fields after `last_prefix_field` may be added in later minor
/// versions, and a plugin built before them still loads.
#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginRef)))]
#[sabi(missing_field(panic))]
pub struct Plugin {
    /// The ABI version the plugin was compiled against (`AbiVersion::CURRENT` there).
    pub abi: AbiVersion,
    pub info: extern "C" fn() -> PluginInfo,
    /// Called once, before anything else, with the plugin's `[plugin.settings]` table
    /// from plugins.toml serialised as TOML (empty string when there is none).
    pub configure: extern "C" fn(settings_toml: RStr<'_>) -> RResult<(), RString>,
    pub quant_formats: extern "C" fn() -> RVec<QuantFormat>,
    pub backend: extern "C" fn() -> ROption<Backend>,
    #[sabi(last_prefix_field)]
    pub policies: extern "C" fn() -> RVec<PlacementPolicy>,
}

impl RootModule for PluginRef {
    declare_root_module_statics! {PluginRef}
    const BASE_NAME: &'static str = "moe_plugin";
    const NAME: &'static str = "moe_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

/// Runs `f`, turning a panic or an `Err` into an `RErr` so nothing unwinds across the
/// ABI boundary (a panic there would abort the whole server).
pub fn guard<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> RResult<T, RString> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => RResult::ROk(v),
        Ok(Err(e)) => RResult::RErr(RString::from(e)),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            RResult::RErr(RString::from(format!("{what}: plugin panicked: {msg}")))
        }
    }
}

/// Like [`guard`] for functions that cannot fail: a panic yields `fallback`.
pub fn guard_or<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// Converts an ABI result into a std one.
pub fn into_result<T>(r: RResult<T, RString>) -> Result<T, String> {
    match r {
        RResult::ROk(v) => Ok(v),
        RResult::RErr(e) => Err(e.into_string()),
    }
}

/// Root-module helpers for plugins that only provide some of the tables.
pub mod defaults {
    use super::*;
    pub extern "C" fn no_quant_formats() -> RVec<QuantFormat> {
        RVec::new()
    }
    pub extern "C" fn no_backend() -> ROption<Backend> {
        ROption::RNone
    }
    pub extern "C" fn no_policies() -> RVec<PlacementPolicy> {
        RVec::new()
    }
    pub extern "C" fn accept_any_settings(_settings: RStr<'_>) -> RResult<(), RString> {
        RResult::ROk(())
    }
}
