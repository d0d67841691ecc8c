//! Single-thread `dot_q8` throughput of every decodable ROCmFPx type: 1000 rows of
//! k = 2048 against 1 and against 8 q8_1 columns, every compiled instruction-set variant.
//! The weights (~0.3-1 MB) stay in cache: this measures the kernels, not DRAM.
//!
//! Run: `cargo run --release -p moe-quant-rocmfpx --example rocmfpx_dot_throughput`

use std::time::Instant;

use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut},
    into_result, BlockQ8_1,
};
use moe_quant_rocmfpx::{all_formats, dot::best_isa, dot_q8_with_isa, Isa};

const ROWS: usize = 1000;
const K: usize = 2048;

fn main() {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut gauss = move || {
        let mut u = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64
        };
        let (a, b) = (u().max(1e-300), u());
        ((-2.0 * a.ln()).sqrt() * (std::f64::consts::TAU * b).cos()) as f32
    };
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|i| *i <= best_isa()).collect();
    println!("single thread, {ROWS} rows x k={K}; GB/s of packed weights, Gw/s = 1e9 weight-column products/s");
    print!("{:<24}", "type");
    for isa in &isas {
        print!(" {:>20}", format!("{isa:?} 1 col"));
    }
    println!(" {:>20}", "best, 8 cols");
    let formats = all_formats();
    for (id, variant, label) in [
        (100, 0, "Q4_0_ROCMFP4"),
        (101, 0, "Q4_0_ROCMFP4_FAST"),
        (102, 0, "Q6_0_ROCMFPX"),
        (103, 0, "Q8_0_ROCMFPX"),
        (104, 0, "Q3_0_ROCMFPX"),
        (107, 1, "Q2_0_ROCMFP2 two-scale"),
        (107, 2, "Q2_0_ROCMFP2 affine"),
    ] {
        let f = formats.iter().find(|f| f.type_id == id).unwrap();
        let x: Vec<f32> = (0..ROWS * K).map(|_| gauss()).collect();
        let mut rows = vec![0u8; ROWS * K / 32 * f.block_bytes as usize];
        into_result((f.encode)(
            variant,
            RSlice::from_slice(&x),
            RSliceMut::from_mut_slice(&mut rows),
        ))
        .unwrap();
        let a: Vec<f32> = (0..8 * K).map(|_| gauss()).collect();
        let act: Vec<BlockQ8_1> = a.chunks_exact(32).map(BlockQ8_1::quantize).collect();
        print!("{label:<24}");
        let measure = |isa: Isa, cols: usize| {
            let mut out = vec![0f32; ROWS * cols];
            let act = &act[..cols * K / 32];
            let mut best = f64::INFINITY;
            for _ in 0..25 {
                let t = Instant::now();
                dot_q8_with_isa(id, variant, isa, &rows, K as u64, act, &mut out).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            let gbs = rows.len() as f64 / best / 1e9;
            let gws = (ROWS * K * cols) as f64 / best / 1e9;
            format!("{gbs:6.2} GB/s {gws:5.2} Gw/s")
        };
        for &isa in &isas {
            print!(" {:>20}", measure(isa, 1));
        }
        println!(" {:>20}", measure(best_isa(), 8));
    }
}
