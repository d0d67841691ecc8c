//! Test fixture: a well-formed plugin that claims plugin ABI 2.0, which this host
//! (1.x) must refuse with one clear sentence.

use moe_plugin_api::{
    abi_stable::{export_root_module, prefix_type::PrefixTypeTrait},
    defaults, AbiVersion, Plugin, PluginInfo, PluginKind, PluginRef,
};

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion { major: 2, minor: 0 },
        info,
        configure: defaults::accept_any_settings,
        quant_formats: defaults::no_quant_formats,
        backend: defaults::no_backend,
        policies: defaults::no_policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "abi-two".into(),
        version: "2.0.0".into(),
        kind: PluginKind::QuantFormat,
        description: "claims a future ABI".into(),
    }
}
