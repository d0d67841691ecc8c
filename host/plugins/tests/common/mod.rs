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

/// A small deterministic generator in [-1, 1), so the tests need no extra crates.
pub fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A fresh seed per run, printed so a failure can be replayed.
pub fn fresh_seed() -> u64 {
    let s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    eprintln!("seed {s}");
    s
}

/// Runs `out = W x` on a backend: `w` holds `m` rows of `k` weights of `type_id`, `x`
/// holds columns of `k` values. Returns `out` as [n][m].
pub fn backend_matmul(
    be: &moe_plugin_api::Backend,
    w: &[u8],
    type_id: u32,
    k: usize,
    m: usize,
    x: &[f32],
) -> Vec<f32> {
    use moe_plugin_api::{into_result, ops, types, OpParams, TensorRef};
    let n = x.len() / k;
    let bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let alloc = |len: usize| into_result((be.alloc)(0, len as u64)).unwrap();
    let (wbuf, xbuf, obuf) = (alloc(w.len()), alloc(x.len() * 4), alloc(m * n * 4));
    into_result((be.upload)(wbuf, 0, w.into())).unwrap();
    into_result((be.upload)(xbuf, 0, bytes(x).as_slice().into())).unwrap();
    let t = |buffer, type_id, dims| TensorRef {
        buffer,
        offset: 0,
        type_id,
        variant: 0,
        dims,
    };
    let stream = into_result((be.stream_create)(0)).unwrap();
    let args = [
        t(wbuf, type_id, [k as u64, m as u64, 1, 1]),
        t(xbuf, types::F32, [k as u64, n as u64, 1, 1]),
        t(obuf, types::F32, [m as u64, n as u64, 1, 1]),
    ];
    into_result((be.run_op)(
        stream,
        ops::MATMUL,
        OpParams::default(),
        args.as_slice().into(),
    ))
    .unwrap();
    let mut out = vec![0u8; m * n * 4];
    into_result((be.download)(obuf, 0, out.as_mut_slice().into())).unwrap();
    for b in [wbuf, xbuf, obuf] {
        into_result((be.free)(b)).unwrap();
    }
    out.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Checks `out` ([n][m]) against decoded weights `wd` ([m][k]) times `x` in f64, within
/// `rel` of each dot product's magnitude sum.
pub fn check_matmul(what: &str, wd: &[f32], x: &[f32], k: usize, m: usize, out: &[f32], rel: f64) {
    for c in 0..x.len() / k {
        for r in 0..m {
            let (row, col) = (&wd[r * k..(r + 1) * k], &x[c * k..(c + 1) * k]);
            let want: f64 = row
                .iter()
                .zip(col)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let mag: f64 = row
                .iter()
                .zip(col)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let got = out[c * m + r] as f64;
            assert!(
                (got - want).abs() <= rel * mag + 1e-5,
                "{what} row {r} col {c}: {got} vs {want}"
            );
        }
    }
}
