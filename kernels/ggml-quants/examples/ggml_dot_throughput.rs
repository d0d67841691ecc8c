//! Single-thread `dot_q8` throughput: 1000 weight rows against one q8_1 column (batch-1
//! decode), every type, k = 576 and 1536 (K-quants: 1536 and 2048, since 576 is not a
//! multiple of 256), every instruction-set variant this CPU runs.
//!
//! Run: `cargo run --release -p moe-quant-ggml --example ggml_dot_throughput [-- --json] [--only Q4_K] [--rows N]`
//!
//! The last column runs 8 activation columns at once (each unpacked block reused 8 times):
//! GB/s of weights and Gmac/s (weight x column products per second).
//!
//! GB/s counts the packed weight bytes read per second. 1000 rows are at most ~4 MB
//! (F32, k = 1536) and usually < 1 MB, so this measures the kernels from cache, not DRAM;
//! `--rows 100000` streams them from DRAM (what decode does).

use std::time::Instant;

use moe_plugin_api::{
    abi_stable::std_types::{RSlice, RSliceMut},
    into_result, BlockQ8_1,
};
use moe_quant_ggml::{all_formats, dot::best_isa, dot_q8_with_isa, Isa};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let json = args.iter().any(|a| a == "--json");
    // `--only NAME` restricts to one type (for profiling).
    let only = args
        .iter()
        .position(|a| a == "--only")
        .map(|i| args[i + 1].clone());
    let mut seed = 0x1234_5678_9abc_def0u64;
    let mut normal = move || {
        // splitmix64 + Box-Muller, enough for benchmark data.
        let mut next = || {
            seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        let (u, v) = (next().max(1e-300), next());
        ((-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()) as f32
    };
    // `--rows N` (default 1000, from cache): enough rows to stream from DRAM instead.
    let rows_n: usize = args
        .iter()
        .position(|a| a == "--rows")
        .map_or(1000, |i| args[i + 1].parse().expect("--rows N"));
    let isas: Vec<Isa> = Isa::ALL.into_iter().filter(|i| *i <= best_isa()).collect();
    println!(
        "single thread, {rows_n} rows x 1 column; GB/s of packed weights (Gw/s = 1e9 weights/s)"
    );
    print!("{:>6} {:>5} {:>8}", "type", "k", "bytes");
    for isa in &isas {
        print!(" {:>18}", isa.name());
    }
    println!(" {:>22}", "8 columns, best isa");
    let mut records = vec![];
    for f in all_formats() {
        if only.as_deref().is_some_and(|o| o != f.name.as_str()) {
            continue;
        }
        let bw = f.block_weights as usize;
        let ks: &[usize] = if bw == 256 {
            &[1536, 2048]
        } else {
            &[576, 1536]
        };
        for &k in ks {
            let x: Vec<f32> = (0..rows_n * k).map(|_| normal() * 0.05).collect();
            let mut rows = vec![0u8; rows_n * k / bw * f.block_bytes as usize];
            into_result((f.encode)(
                0,
                RSlice::from_slice(&x),
                RSliceMut::from_mut_slice(&mut rows),
            ))
            .unwrap();
            let a: Vec<f32> = (0..k).map(|_| normal()).collect();
            let act: Vec<BlockQ8_1> = a.chunks_exact(32).map(BlockQ8_1::quantize).collect();
            let mut out = vec![0f32; rows_n];
            print!("{:>6} {:>5} {:>8}", f.name.as_str(), k, rows.len());
            for &isa in &isas {
                // Warm up, then time whole passes for at least 0.3 s.
                dot_q8_with_isa(f.type_id, isa, &rows, k as u64, &act, &mut out).unwrap();
                let start = Instant::now();
                let mut passes = 0u64;
                while start.elapsed().as_secs_f64() < 0.3 {
                    for _ in 0..10 {
                        dot_q8_with_isa(f.type_id, isa, &rows, k as u64, &act, &mut out).unwrap();
                    }
                    passes += 10;
                }
                let secs = start.elapsed().as_secs_f64();
                let gbs = rows.len() as f64 * passes as f64 / secs / 1e9;
                let gws = (rows_n * k) as f64 * passes as f64 / secs / 1e9;
                print!(" {:>8.2} GB/s {:>4.1}", gbs, gws);
                records.push(format!(
                    "{{\"type\":\"{}\",\"k\":{k},\"rows\":{rows_n},\"isa\":\"{}\",\"gb_per_s\":{gbs:.3},\"gweights_per_s\":{gws:.3}}}",
                    f.name.as_str(),
                    isa.name()
                ));
            }
            // Small batch: 8 activation columns share each unpacked block.
            let act8: Vec<BlockQ8_1> = (0..8).flat_map(|_| act.iter().copied()).collect();
            let mut out8 = vec![0f32; rows_n * 8];
            let isa = best_isa();
            dot_q8_with_isa(f.type_id, isa, &rows, k as u64, &act8, &mut out8).unwrap();
            let start = Instant::now();
            let mut passes = 0u64;
            while start.elapsed().as_secs_f64() < 0.3 {
                dot_q8_with_isa(f.type_id, isa, &rows, k as u64, &act8, &mut out8).unwrap();
                passes += 1;
            }
            let secs = start.elapsed().as_secs_f64();
            let gbs8 = rows.len() as f64 * passes as f64 / secs / 1e9;
            let gdots = (rows_n * k * 8) as f64 * passes as f64 / secs / 1e9;
            print!(" {:>6.2} GB/s {:>5.1} Gmac/s", gbs8, gdots);
            records.push(format!(
                "{{\"type\":\"{}\",\"k\":{k},\"rows\":{rows_n},\"cols\":8,\"isa\":\"{}\",\"gb_per_s\":{gbs8:.3},\"gmac_per_s\":{gdots:.3}}}",
                f.name.as_str(),
                isa.name()
            ));
            println!();
            std::hint::black_box((&out, &out8));
        }
    }
    if json {
        println!("[{}]", records.join(",\n "));
    }
}
