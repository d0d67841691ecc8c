//! Host time of one sampled token at DeepSeek-V4's vocabulary (129280 logits): the
//! sampler (`Sampler::sample`) under the API's common settings, and the bench's greedy
//! `argmax`. Prints a table of microseconds per token (medians of `REPS` tokens; random
//! logits, fresh each run). Run: `cargo run --release -p moe-engine --example
//! sampling_bench`.
use std::time::Instant;

use moe_engine::sampling::{argmax, Sampler, SamplingParams};
use rand::{rngs::StdRng, Rng, SeedableRng};

const VOCAB: usize = 129280;
const REPS: usize = 40;

fn median_us(mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..REPS)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[REPS / 2]
}

fn main() {
    let mut rng = StdRng::from_entropy();
    // Logits of a confident model: a few large values over a normal spread.
    let mut logits: Vec<f32> = (0..VOCAB).map(|_| rng.gen::<f32>() * 6.0 - 3.0).collect();
    for _ in 0..8 {
        let i = rng.gen_range(0..VOCAB);
        logits[i] += 12.0;
    }
    let cases: [(&str, SamplingParams); 6] = [
        (
            "greedy",
            SamplingParams {
                temperature: 0.0,
                ..Default::default()
            },
        ),
        ("temperature 1 (API default)", SamplingParams::default()),
        (
            "temperature 0.7, top_p 0.9",
            SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                ..Default::default()
            },
        ),
        (
            "temperature 0.7, top_k 40",
            SamplingParams {
                temperature: 0.7,
                top_k: 40,
                ..Default::default()
            },
        ),
        (
            "temperature 1, min_p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..Default::default()
            },
        ),
        (
            "greedy, logprobs 5",
            SamplingParams {
                temperature: 0.0,
                logprobs: Some(5),
                ..Default::default()
            },
        ),
    ];
    println!("| sampler setting ({VOCAB} logits) | us per token |");
    println!("|---|---|");
    for (name, p) in cases {
        let mut s = Sampler::new(SamplingParams { seed: Some(1), ..p });
        let us = median_us(|| {
            std::hint::black_box(s.sample(std::hint::black_box(&logits)));
        });
        println!("| {name} | {us:.1} |");
    }
    let us = median_us(|| {
        std::hint::black_box(argmax(std::hint::black_box(&logits)));
    });
    println!("| bench's argmax | {us:.1} |");
}
