//! Turning logits into the next token: penalties, temperature, top-k, top-p, min-p,
//! a seeded generator, and log-probabilities for the API.

use std::collections::HashMap;

use rand::{rngs::StdRng, Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1 = off.
    pub top_p: f32,
    /// 0 = off: drop tokens below min_p x the top token's probability.
    pub min_p: f32,
    /// Same seed, same request -> same output.
    pub seed: Option<u64>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Number of alternatives to report per token (0 = none); `None` = no logprobs.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// log p of the chosen token under the model (after penalties, before temperature).
    pub logprob: f32,
    /// The most likely alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
    counts: HashMap<u32, u32>,
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let mx = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = x.iter().map(|v| ((v - mx) as f64).exp()).sum::<f64>().ln() as f32 + mx;
    x.iter().map(|v| v - lse).collect()
}

impl Sampler {
    pub fn new(p: SamplingParams) -> Sampler {
        let rng = match p.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_entropy(),
        };
        Sampler {
            p,
            rng,
            counts: HashMap::new(),
        }
    }

    /// Records a token as generated (it then counts for the penalties).
    pub fn accept(&mut self, id: u32) {
        *self.counts.entry(id).or_default() += 1;
    }

    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let mut l = logits.to_vec();
        if self.p.presence_penalty != 0.0 || self.p.frequency_penalty != 0.0 {
            for (&id, &n) in &self.counts {
                if let Some(v) = l.get_mut(id as usize) {
                    *v -= self.p.presence_penalty + self.p.frequency_penalty * n as f32;
                }
            }
        }
        // NaN logits would poison every comparison below.
        for v in l.iter_mut() {
            if v.is_nan() {
                *v = f32::NEG_INFINITY;
            }
        }
        let lp = log_softmax(&l);
        let id = if self.p.temperature <= 0.0 {
            argmax(&l)
        } else {
            self.draw(&l)
        };
        let top = match self.p.logprobs {
            Some(n) if n > 0 => {
                let mut idx: Vec<u32> = (0..l.len() as u32).collect();
                let n = n.min(idx.len());
                idx.select_nth_unstable_by(n - 1, |a, b| {
                    lp[*b as usize].total_cmp(&lp[*a as usize])
                });
                idx.truncate(n);
                idx.sort_by(|a, b| lp[*b as usize].total_cmp(&lp[*a as usize]));
                idx.into_iter().map(|i| (i, lp[i as usize])).collect()
            }
            _ => Vec::new(),
        };
        Sampled {
            id,
            logprob: lp[id as usize],
            top,
        }
    }

    fn draw(&mut self, l: &[f32]) -> u32 {
        let t = self.p.temperature;
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .map(|(i, v)| (i as u32, v / t))
            .collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        if self.p.top_k > 0 {
            cand.truncate(self.p.top_k);
        }
        let mx = cand[0].1;
        let mut probs: Vec<f64> = cand.iter().map(|c| ((c.1 - mx) as f64).exp()).collect();
        let sum: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
        let mut keep = probs.len();
        if self.p.min_p > 0.0 {
            let floor = probs[0] * self.p.min_p as f64;
            keep = keep.min(probs.iter().take_while(|p| **p >= floor).count().max(1));
        }
        if self.p.top_p < 1.0 {
            let mut acc = 0.0;
            let n = probs
                .iter()
                .take_while(|p| {
                    let before = acc;
                    acc += **p;
                    before < self.p.top_p as f64
                })
                .count();
            keep = keep.min(n.max(1));
        }
        let total: f64 = probs[..keep].iter().sum();
        let mut r = self.rng.gen::<f64>() * total;
        for (c, p) in cand[..keep].iter().zip(&probs[..keep]) {
            r -= p;
            if r <= 0.0 {
                return c.0;
            }
        }
        cand[keep - 1].0
    }
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![0.5, 3.0, 2.9, -1.0, 0.0, 2.0]
    }

    #[test]
    fn greedy_picks_the_max_and_reports_logprobs() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            logprobs: Some(2),
            ..Default::default()
        });
        let r = s.sample(&logits());
        assert_eq!(r.id, 1);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        let p: f32 = log_softmax(&logits()).iter().map(|v| v.exp()).sum();
        assert!((p - 1.0).abs() < 1e-5);
    }

    #[test]
    fn same_seed_same_draws_and_top_k_one_is_greedy() {
        let p = SamplingParams {
            temperature: 1.5,
            seed: Some(7),
            ..Default::default()
        };
        let a: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits()).id).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(p.clone());
            (0..50).map(|_| s.sample(&logits()).id).collect()
        };
        assert_eq!(a, b);
        assert!(
            a.iter().any(|&x| x != 1),
            "temperature 1.5 should not always pick the max"
        );
        let mut s = Sampler::new(SamplingParams { top_k: 1, ..p });
        assert!((0..20).all(|_| s.sample(&logits()).id == 1));
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        });
        assert!((0..100).all(|_| [1, 2].contains(&s.sample(&logits()).id)));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.5,
            seed: Some(2),
            ..Default::default()
        });
        assert!((0..100).all(|_| [1, 2].contains(&s.sample(&logits()).id)));
    }

    #[test]
    fn penalties_push_repeated_tokens_down() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            presence_penalty: 0.5,
            ..Default::default()
        });
        s.accept(1);
        assert_eq!(s.sample(&logits()).id, 2);
    }
}
