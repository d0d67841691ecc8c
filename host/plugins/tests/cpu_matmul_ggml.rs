//! The CPU backend's matmul through the ggml-quants plugin, for every type and both
//! code paths (q8 activation dots, decode-to-f32), against decoded weights times the
//! activations in f64.

mod common;
use common::*;
use moe_plugin_api::into_result;
use moe_plugin_host::Registry;

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
    let mut seed = fresh_seed();
    for fmt in reg.quant_formats() {
        for k in [512usize, 576, 1536] {
            if k % fmt.block_weights as usize != 0 {
                continue;
            }
            let m = 70usize;
            let w: Vec<f32> = (0..k * m).map(|_| lcg(&mut seed)).collect();
            let mut wq = vec![0u8; m * fmt.row_bytes(k as u64).unwrap() as usize];
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
            for n in [1usize, 3, 8, 17, 40] {
                let x: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
                let out = backend_matmul(be, &wq, fmt.type_id, k, m, &x);
                // q8_1 activations: each value off by at most half a step (1/254 of its
                // block's max), so 0.3% of the magnitude sum bounds the error.
                check_matmul(
                    &format!("{} k={k} n={n}", fmt.name),
                    &wd,
                    &x,
                    k,
                    m,
                    &out,
                    0.003,
                );
            }
        }
    }
}
