//! Opening one plugin library and turning abi_stable's long reports into one sentence.

use std::{collections::HashMap, path::Path, sync::Mutex};

use moe_plugin_api::{
    abi_stable::library::{lib_header_from_path, LibraryError},
    AbiVersion, PluginRef,
};

use crate::PluginError;

/// Loads (once per canonical path) and checks a plugin's root module.
///
/// `RootModule::load_from_file` caches ONE module per interface type in a static, so a
/// second plugin would silently come back as the first: go through the library header.
pub fn load_plugin(path: &Path) -> Result<PluginRef, PluginError> {
    static LOADED: Mutex<Option<HashMap<std::path::PathBuf, PluginRef>>> = Mutex::new(None);
    if !path.is_file() {
        return Err(PluginError::Missing {
            path: path.to_path_buf(),
        });
    }
    let key = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mut guard = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    let cache = guard.get_or_insert_with(HashMap::new);
    if let Some(root) = cache.get(&key) {
        return Ok(*root);
    }
    let header = lib_header_from_path(path).map_err(|e| describe(path, e))?;
    let root = header
        .init_root_module::<PluginRef>()
        .map_err(|e| describe(path, e))?;
    let abi = root.abi();
    if abi.major != AbiVersion::CURRENT.major || abi.minor > AbiVersion::CURRENT.minor {
        return Err(PluginError::AbiMismatch {
            path: path.to_path_buf(),
            expected: AbiVersion::CURRENT,
            found: abi.to_string(),
        });
    }
    cache.insert(key, root);
    Ok(root)
}

fn first_line(s: &str) -> String {
    let line = s
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let mut out: String = line.chars().take(200).collect();
    if line.chars().count() > 200 {
        out.push('…');
    }
    out
}

fn describe(path: &Path, e: LibraryError) -> PluginError {
    let path = path.to_path_buf();
    match e {
        LibraryError::OpenError { err, .. } => PluginError::NotAPlugin {
            path,
            reason: format!(
                "the dynamic loader refused it: {}",
                first_line(&err.to_string())
            ),
        },
        LibraryError::GetSymbolError { .. } => PluginError::NotAPlugin {
            path,
            reason:
                "it exports no abi_stable root module; was it built with #[export_root_module]?"
                    .into(),
        },
        LibraryError::IncompatibleVersionNumber { actual_version, .. } => {
            PluginError::AbiMismatch {
                path,
                expected: AbiVersion::CURRENT,
                found: actual_version.to_string(),
            }
        }
        LibraryError::AbiInstability(err) => PluginError::Layout {
            path,
            expected: AbiVersion::CURRENT,
            detail: layout_detail(&err.to_string()),
        },
        LibraryError::InvalidAbiHeader(h) => PluginError::Layout {
            path,
            expected: AbiVersion::CURRENT,
            detail: format!("it was built with an incompatible abi_stable ({h:?})"),
        },
        other => PluginError::NotAPlugin {
            path,
            reason: first_line(&other.to_string()),
        },
    }
}

/// abi_stable explains a layout mismatch in hundreds of lines; keep the first line that
/// names what differs.
fn layout_detail(report: &str) -> String {
    let interesting = report.lines().map(str::trim).find(|l| {
        let l = l.to_ascii_lowercase();
        l.contains("mismatch") || l.contains("expected") || l.contains("different")
    });
    first_line(interesting.unwrap_or(report))
}
