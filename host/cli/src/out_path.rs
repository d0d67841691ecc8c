//! Checks on an output path before any work: it must not be one of the command's
//! inputs (the input would be destroyed), and its directory must exist (so a long
//! conversion does not fail only at the end).

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

/// `out` after resolving links and `..`, whether or not the file exists yet.
fn resolved(out: &Path) -> Option<PathBuf> {
    out.canonicalize().ok().or_else(|| {
        let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
        let parent = parent.unwrap_or(Path::new(".")).canonicalize().ok()?;
        Some(parent.join(out.file_name()?))
    })
}

/// Whether `out` names the same file as `input`.
pub fn same_file(input: &Path, out: &Path) -> bool {
    let Ok(input) = input.canonicalize() else {
        return false; // opening it fails later with a proper message
    };
    resolved(out).is_some_and(|o| o == input)
}

/// Fails unless `out` can be written: not one of `inputs`, not a directory, and in a
/// directory that exists.
pub fn check_out(out: &Path, inputs: &[&Path]) -> Result<()> {
    if let Some(input) = inputs.iter().find(|i| same_file(i, out)) {
        bail!(
            "--out {} is the input file {}; write to another file (the input is read \
             while the output is written)",
            out.display(),
            input.display()
        );
    }
    if out.is_dir() {
        bail!("--out {} is a directory; name a file", out.display());
    }
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
    if let Some(dir) = parent.filter(|d| !d.is_dir()) {
        bail!(
            "--out {}: the directory {} does not exist",
            out.display(),
            dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_directories_and_missing_parents_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("m.gguf");
        std::fs::write(&input, b"x").unwrap();
        let e = check_out(&input, &[&input]).unwrap_err().to_string();
        assert!(e.contains("is the input file"), "{e}");
        // the same file by another spelling
        let other = dir.path().join(".").join("m.gguf");
        assert!(check_out(&other, &[&input]).is_err());
        assert!(check_out(dir.path(), &[])
            .unwrap_err()
            .to_string()
            .contains("directory"));
        let missing = dir.path().join("no-such-dir").join("o.gguf");
        assert!(check_out(&missing, &[&input])
            .unwrap_err()
            .to_string()
            .contains("does not exist"));
        check_out(&dir.path().join("new.gguf"), &[&input]).unwrap();
    }
}
