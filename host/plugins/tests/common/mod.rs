//! Shared by the plugin-host tests: where cargo put the workspace's plugin libraries,
//! and a temp plugins.toml writer. Run `cargo build --workspace` before the tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// target/<profile>/, where the cdylibs live (the test binary runs from deps/ below it).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test exe path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

pub fn lib(name: &str) -> PathBuf {
    let p = lib_dir().join(format!("lib{name}.so"));
    assert!(
        p.is_file(),
        "{} missing: run `cargo build --workspace` first",
        p.display()
    );
    p
}

/// Writes `body` as plugins.toml into a fresh temp dir and returns (dir, path).
pub fn config(body: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("plugins.toml");
    std::fs::write(&path, body).expect("write config");
    (dir, path)
}

pub fn plugin_line(name: &str) -> String {
    format!("[[plugin]]\npath = {:?}\n", lib(name))
}
