//! The CPU backend's matmul through the ggml-quants plugin, for every type and both
//! code paths (q8 activation dots for few columns, decode-to-f32 for many), against
//! decoded weights times the activations in f64.

mod common;
use common::*;
use moe_plugin_api::{into_result, ops, types, OpParams, TensorRef};
use moe_plugin_host::Registry;

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

#[test]
fn matmul_matches_decoded_reference_for_every_type() {
    let body = [
        plugin_line("moe_backend_cpu"),
        plugin_line("moe_quant_ggml"),
        plugin_line("moe_policy_basic"),
    ]
    .concat();
    let (_dir, path) = config(&body);
    let reg = Registry::from_config_file(&path).unwrap();
    let be = reg.backend("cpu").unwrap();
    into_result((be.register_quant_formats)(
        reg.quant_formats().cloned().collect(),
    ))
    .unwrap();
    let stream = into_result((be.stream_create)(0)).unwrap();
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let f32_bytes = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    for fmt in reg.quant_formats() {
        for k in [512usize, 576, 1536] {
            if k % fmt.block_weights as usize != 0 {
                continue;
            }
            let m = 70usize;
            let w: Vec<f32> = (0..k * m).map(|_| lcg(&mut seed)).collect();
            let wq_len = m * fmt.row_bytes(k as u64).unwrap() as usize;
            let mut wq = vec![0u8; wq_len];
            into_result((fmt.encode)(
                0,
                w.as_slice().into(),
                wq.as_mut_slice().into(),
            ))
            .unwrap();
            let mut wd = vec![0f32; k * m];
            into_result((fmt.decode)(
                0,
                wq.as_slice().into(),
                wd.as_mut_slice().into(),
            ))
            .unwrap();
            let wbuf = into_result((be.alloc)(0, wq.len() as u64)).unwrap();
            into_result((be.upload)(wbuf, 0, wq.as_slice().into())).unwrap();
            for n in [1usize, 3, 8, 17] {
                let x: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
                let xbuf = into_result((be.alloc)(0, (x.len() * 4) as u64)).unwrap();
                let obuf = into_result((be.alloc)(0, (m * n * 4) as u64)).unwrap();
                into_result((be.upload)(xbuf, 0, f32_bytes(&x).as_slice().into())).unwrap();
                let t = |buffer, type_id, dims| TensorRef {
                    buffer,
                    offset: 0,
                    type_id,
                    variant: 0,
                    dims,
                };
                into_result((be.run_op)(
                    stream,
                    ops::MATMUL,
                    OpParams::default(),
                    [
                        t(wbuf, fmt.type_id, [k as u64, m as u64, 1, 1]),
                        t(xbuf, types::F32, [k as u64, n as u64, 1, 1]),
                        t(obuf, types::F32, [m as u64, n as u64, 1, 1]),
                    ]
                    .as_slice()
                    .into(),
                ))
                .unwrap();
                let mut out = vec![0u8; m * n * 4];
                into_result((be.download)(obuf, 0, out.as_mut_slice().into())).unwrap();
                let out: Vec<f32> = out
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                for c in 0..n {
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
                        // q8_1 activations: each value off by at most half a step (1/254 of the
                        // block max), so 1% of the magnitude sum bounds the error.
                        assert!(
                            (got - want).abs() <= 0.003 * mag + 1e-5,
                            "{} n={n} row {r} col {c}: {got} vs {want}",
                            fmt.name
                        );
                    }
                }
                into_result((be.free)(xbuf)).unwrap();
                into_result((be.free)(obuf)).unwrap();
            }
            into_result((be.free)(wbuf)).unwrap();
        }
    }
}
