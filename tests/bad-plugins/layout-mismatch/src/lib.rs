//! Test fixture: a plugin whose root module has the host's names but another layout
//! (as if built against a diverged copy of plugin-api). abi_stable's check must catch
//! it and the host must say so in one sentence.

use abi_stable::{
    declare_root_module_statics, export_root_module, library::RootModule, package_version_strings,
    prefix_type::PrefixTypeTrait, sabi_types::VersionStrings, StableAbi,
};

#[repr(C)]
#[derive(StableAbi)]
#[sabi(kind(Prefix(prefix_ref = PluginRef)))]
#[sabi(missing_field(panic))]
pub struct Plugin {
    /// The real root has an AbiVersion struct here.
    pub abi: u64,
    #[sabi(last_prefix_field)]
    pub info: extern "C" fn() -> u32,
}

impl RootModule for PluginRef {
    declare_root_module_statics! {PluginRef}
    const BASE_NAME: &'static str = "moe_plugin";
    const NAME: &'static str = "moe_plugin";
    const VERSION_STRINGS: VersionStrings = package_version_strings!();
}

extern "C" fn info() -> u32 {
    7
}

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin { abi: 1, info }.leak_into_prefix()
}
