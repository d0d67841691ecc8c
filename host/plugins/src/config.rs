//! `plugins.toml`: which plugins load, with what settings, on which devices, under which
//! placement policy.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::PluginError;

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Folder where plugins named by `library` are looked for, relative to the config
    /// file. Default: the folder of the running executable (where cargo puts the
    /// workspace's cdylibs next to `moeserve`).
    pub plugin_dir: Option<PathBuf>,
    #[serde(default, rename = "plugin")]
    pub plugins: Vec<PluginEntry>,
    #[serde(default)]
    pub devices: DeviceSelection,
    #[serde(default)]
    pub placement: PlacementConfig,
    /// Where the config came from (set by [`Config::load`]).
    #[serde(skip)]
    pub source: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginEntry {
    /// Library name without platform prefix/suffix: `moe_backend_cpu` -> `libmoe_backend_cpu.so`.
    pub library: Option<String>,
    /// Or an explicit path to the library file (relative to the config file).
    pub path: Option<PathBuf>,
    /// Handed to the plugin's `configure` as TOML.
    #[serde(default)]
    pub settings: Option<toml::Table>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceSelection {
    /// Name of the backend that runs the model (`cpu`, `cuda`, `hip`).
    #[serde(default = "default_backend")]
    pub backend: String,
    /// Device indices of that backend to use; empty = all.
    #[serde(default)]
    pub use_devices: Vec<u32>,
}

impl Default for DeviceSelection {
    fn default() -> Self {
        DeviceSelection {
            backend: default_backend(),
            use_devices: Vec::new(),
        }
    }
}

fn default_backend() -> String {
    "cpu".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementConfig {
    #[serde(default = "default_policy")]
    pub policy: String,
    /// Optional routing-profile CSV (relative to the config file).
    pub routing_profile: Option<PathBuf>,
    #[serde(default)]
    pub settings: Option<toml::Table>,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig {
            policy: default_policy(),
            routing_profile: None,
            settings: None,
        }
    }
}

fn default_policy() -> String {
    "single-device".into()
}

impl Config {
    /// Reads and parses a config file; errors are one line naming the file (and the
    /// line and column for TOML syntax or schema errors).
    pub fn load(path: &Path) -> Result<Config, PluginError> {
        let text = std::fs::read_to_string(path).map_err(|e| PluginError::Config {
            path: path.to_path_buf(),
            msg: format!("cannot read it: {e}"),
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Config, PluginError> {
        let mut cfg: Config = toml::from_str(text).map_err(|e| {
            let loc = e
                .span()
                .map(|s| {
                    let before = &text[..s.start.min(text.len())];
                    let line = before.matches('\n').count() + 1;
                    let col = before.len() - before.rfind('\n').map_or(0, |i| i + 1) + 1;
                    format!("line {line}, column {col}: ")
                })
                .unwrap_or_default();
            PluginError::Config {
                path: path.to_path_buf(),
                msg: format!(
                    "invalid TOML at {loc}{}",
                    e.message().trim().replace('\n', "; ")
                ),
            }
        })?;
        cfg.source = path.to_path_buf();
        Ok(cfg)
    }

    /// The folder relative paths in the config are resolved against.
    pub fn base_dir(&self) -> PathBuf {
        self.source
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from("."))
    }

    /// Resolves a plugin entry to a library path.
    pub fn library_path(&self, entry: &PluginEntry) -> Result<PathBuf, PluginError> {
        let base = self.base_dir();
        match (&entry.path, &entry.library) {
            (Some(p), None) => Ok(base.join(p)),
            (None, Some(name)) => {
                let dir = match &self.plugin_dir {
                    Some(d) => base.join(d),
                    None => std::env::current_exe()
                        .ok()
                        .and_then(|exe| exe.parent().map(Path::to_path_buf))
                        .unwrap_or_else(|| PathBuf::from(".")),
                };
                Ok(dir.join(format!(
                    "{}{name}{}",
                    std::env::consts::DLL_PREFIX,
                    std::env::consts::DLL_SUFFIX
                )))
            }
            _ => Err(PluginError::Config {
                path: self.source.clone(),
                msg: "each [[plugin]] needs exactly one of `library` (a name) or `path`".into(),
            }),
        }
    }
}

/// Serialises an optional settings table for a plugin's `configure`.
pub fn settings_text(t: &Option<toml::Table>) -> String {
    t.as_ref().map(|t| t.to_string()).unwrap_or_default()
}
