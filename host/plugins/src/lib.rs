//! Plugin host: reads `plugins.toml`, loads each plugin library once (never unloading
//! it), checks its ABI, configures it, and indexes the quant formats, backends and
//! placement policies it provides.

pub mod config;
mod load;

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use moe_plugin_api::{
    abi_stable::std_types::RStr, into_result, AbiVersion, Backend, PlacementPolicy, PluginInfo,
    QuantFormat,
};

pub use config::Config;
pub use load::load_plugin;

/// Every way loading can fail, each printed as one sentence.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    #[error("{}: {msg}", path.display())]
    Config { path: PathBuf, msg: String },
    #[error("plugin {}: no such file (build the workspace with `cargo build --release`, or fix the path in plugins.toml)", path.display())]
    Missing { path: PathBuf },
    #[error("{}: not a moeserve plugin ({reason})", path.display())]
    NotAPlugin { path: PathBuf, reason: String },
    #[error("{}: built for plugin ABI {found} but this host speaks {expected}; rebuild the plugin against moe-plugin-api {}.{}", path.display(), expected.major, expected.minor)]
    AbiMismatch {
        path: PathBuf,
        expected: AbiVersion,
        found: String,
    },
    #[error("{}: its plugin-api types do not match this host's (ABI {expected}): rebuild it against this moe-plugin-api; first difference: {detail}", path.display())]
    Layout {
        path: PathBuf,
        expected: AbiVersion,
        detail: String,
    },
    #[error("{}: plugin '{name}' rejected its settings: {msg}", path.display())]
    Settings {
        path: PathBuf,
        name: String,
        msg: String,
    },
    #[error("quant type id {type_id} is claimed by both '{first}' ({}) and '{second}' ({}); remove one of them from plugins.toml", first_path.display(), second_path.display())]
    DuplicateType {
        type_id: u32,
        first: String,
        first_path: PathBuf,
        second: String,
        second_path: PathBuf,
    },
    #[error("{what} '{name}' is not provided by any loaded plugin (available: {available})")]
    Unknown {
        what: &'static str,
        name: String,
        available: String,
    },
    #[error("plugin '{plugin}': {msg}")]
    Call { plugin: String, msg: String },
}

/// A plugin library is loaded once per process, so it is configured once: loading the
/// same config again (say, a second Registry) reuses it; other settings are refused.
fn configure_once(
    path: &Path,
    name: &str,
    settings: &str,
    configure: impl FnOnce(&str) -> Result<(), String>,
) -> Result<(), PluginError> {
    static DONE: std::sync::Mutex<BTreeMap<PathBuf, String>> =
        std::sync::Mutex::new(BTreeMap::new());
    let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    let err = |msg: String| PluginError::Settings {
        path: path.to_path_buf(),
        name: name.to_string(),
        msg,
    };
    match done.get(&key) {
        Some(prev) if prev == settings => Ok(()),
        Some(_) => Err(err(
            "already loaded in this process with other settings; one process can hold one configuration of a plugin".into(),
        )),
        None => {
            configure(settings).map_err(err)?;
            done.insert(key, settings.to_string());
            Ok(())
        }
    }
}

/// One loaded plugin and what it provides.
pub struct LoadedPlugin {
    pub path: PathBuf,
    pub info: PluginInfo,
    pub abi: AbiVersion,
    pub quant_formats: Vec<QuantFormat>,
    pub backend: Option<Backend>,
    pub policies: Vec<PlacementPolicy>,
}

/// Everything the config loaded, indexed.
pub struct Registry {
    pub config: Config,
    pub plugins: Vec<LoadedPlugin>,
    /// type id -> (plugin index, format)
    quant: BTreeMap<u32, (usize, QuantFormat)>,
}

impl Registry {
    /// Loads the config file and every plugin it lists.
    pub fn from_config_file(path: &Path) -> Result<Registry, PluginError> {
        Self::from_config(Config::load(path)?)
    }

    pub fn from_config(config: Config) -> Result<Registry, PluginError> {
        let mut plugins = Vec::new();
        for entry in &config.plugins {
            let path = config.library_path(entry)?;
            let root = load_plugin(&path)?;
            let info = (root.info())();
            let settings = config::settings_text(&entry.settings);
            configure_once(&path, &info.name, &settings, |s| {
                into_result((root.configure())(RStr::from_str(s)))
            })?;
            let quant_formats = (root.quant_formats())().into_iter().collect();
            let backend = (root.backend())().into_option();
            let policies = (root.policies())().into_iter().collect();
            tracing::debug!(plugin = %info.name, path = %path.display(), "loaded");
            plugins.push(LoadedPlugin {
                path,
                abi: root.abi(),
                info,
                quant_formats,
                backend,
                policies,
            });
        }
        let mut quant: BTreeMap<u32, (usize, QuantFormat)> = BTreeMap::new();
        for (i, p) in plugins.iter().enumerate() {
            for f in &p.quant_formats {
                if let Some((j, _)) = quant.get(&f.type_id) {
                    let first = &plugins[*j];
                    return Err(PluginError::DuplicateType {
                        type_id: f.type_id,
                        first: first.info.name.to_string(),
                        first_path: first.path.clone(),
                        second: p.info.name.to_string(),
                        second_path: p.path.clone(),
                    });
                }
                quant.insert(f.type_id, (i, f.clone()));
            }
        }
        let reg = Registry {
            config,
            plugins,
            quant,
        };
        // Fail at start-up, not at first request, on a policy nobody provides.
        reg.policy(&reg.config.placement.policy)?;
        Ok(reg)
    }

    pub fn quant_format(&self, type_id: u32) -> Option<&QuantFormat> {
        self.quant.get(&type_id).map(|(_, f)| f)
    }

    /// All quant formats, sorted by type id.
    pub fn quant_formats(&self) -> impl Iterator<Item = &QuantFormat> {
        self.quant.values().map(|(_, f)| f)
    }

    /// (weights per block, bytes per block) of a type, as the GGUF reader needs it.
    pub fn type_size(&self, type_id: u32) -> Option<(u32, u32)> {
        self.quant_format(type_id)
            .map(|f| (f.block_weights, f.block_bytes))
    }

    pub fn backend(&self, name: &str) -> Result<&Backend, PluginError> {
        self.plugins
            .iter()
            .filter_map(|p| p.backend.as_ref())
            .find(|b| b.name.as_str() == name)
            .ok_or_else(|| PluginError::Unknown {
                what: "backend",
                name: name.into(),
                available: self.names(|p| p.backend.iter().map(|b| b.name.to_string()).collect()),
            })
    }

    pub fn policy(&self, name: &str) -> Result<&PlacementPolicy, PluginError> {
        self.plugins
            .iter()
            .flat_map(|p| p.policies.iter())
            .find(|p| p.name.as_str() == name)
            .ok_or_else(|| PluginError::Unknown {
                what: "placement policy",
                name: name.into(),
                available: self.names(|p| p.policies.iter().map(|x| x.name.to_string()).collect()),
            })
    }

    fn names(&self, f: impl Fn(&LoadedPlugin) -> Vec<String>) -> String {
        let mut all: Vec<String> = self.plugins.iter().flat_map(f).collect();
        all.sort();
        if all.is_empty() {
            "none".into()
        } else {
            all.join(", ")
        }
    }
}
