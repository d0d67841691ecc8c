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
    /// Added to a token's logit before anything else (OpenAI's `logit_bias`: -100
    /// bans a token in practice, +100 forces it).
    pub logit_bias: Vec<(u32, f32)>,
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
            logit_bias: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub id: u32,
    /// log p of the chosen token under the model (after logit bias and penalties,
    /// before temperature);
    /// computed only when logprobs were asked for (0 otherwise).
    pub logprob: f32,
    /// The most likely alternatives, best first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    p: SamplingParams,
    rng: StdRng,
    counts: HashMap<u32, u32>,
    /// The logits and weights of a step, kept between steps: a fresh vocabulary-sized
    /// buffer each token costs its page faults (~0.1 ms at 129280 logits).
    scratch: (Vec<f32>, Vec<f32>),
}

/// Lanes of the vectorisable passes below (independent accumulators the compiler keeps
/// in SIMD registers).
const LANES: usize = 8;

/// NaN logits become -inf (they would poison every comparison); returns the largest.
fn clean_max(l: &mut [f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = l.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            let v = if c[j].is_nan() {
                f32::NEG_INFINITY
            } else {
                c[j]
            };
            c[j] = v;
            m[j] = if v > m[j] { v } else { m[j] };
        }
    }
    for v in chunks.into_remainder() {
        if v.is_nan() {
            *v = f32::NEG_INFINITY;
        }
        m[0] = if *v > m[0] { *v } else { m[0] };
    }
    lanes_max(m)
}

/// The largest of the lanes' maxima.
fn lanes_max(m: [f32; LANES]) -> f32 {
    m.into_iter()
        .fold(f32::NEG_INFINITY, |a, b| if b > a { b } else { a })
}

/// e^x for x <= 0 (exactly 0 below -87, where e^x is about f32's smallest normal):
/// x = n ln 2 + f with n an integer (ln 2 in two parts, so f keeps its bits) and |f| <=
/// ln 2 / 2; 2^n from the exponent bits times e^f by its Taylor series to degree 7
/// (truncation < 1e-8). Branch-free, so a loop of it vectorises; relative error a few
/// f32 ulps (tests: `exp_neg_matches_std`).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75; // ln 2 to 16 bits: n * LN2_HI is exact
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = if x < -87.5 { -87.5 } else { x };
    // Round to nearest with the 1.5 * 2^23 trick: k's low mantissa bits hold n itself
    // (no float-to-int conversion, which would keep the loop scalar).
    let k = x * std::f32::consts::LOG2_E + 12_582_912.0;
    let n = k - 12_582_912.0;
    let f = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0
                    + f * (1.0 / 24.0
                        + f * (1.0 / 120.0 + f * (1.0 / 720.0 + f * (1.0 / 5040.0)))))));
    // 2^n: n + 127 in the exponent field (n >= -126 after the clamp).
    let scale = f32::from_bits(k.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if x < -87.0 {
        0.0
    } else {
        p * scale
    }
}

/// Values a lane sums in f32 before the total takes it in f64 (error <= 32 ulps of a
/// block's sum, so the vectorised f32 adds lose nothing that matters).
const BLOCK: usize = 32 * LANES;

/// w[i] = e^((l[i] - mx) * inv_t) (each in [0, 1]); returns their sum. Two plain passes
/// (a map, then lane sums), the shapes the compiler vectorises.
fn exp_weights(l: &[f32], mx: f32, inv_t: f32, w: &mut [f32]) -> f64 {
    for (a, o) in l.iter().zip(w.iter_mut()) {
        *o = exp_neg((*a - mx) * inv_t);
    }
    let mut total = 0f64;
    for wb in w.chunks(BLOCK) {
        let mut acc = [0f32; LANES];
        let mut wc = wb.chunks_exact(LANES);
        for c in &mut wc {
            for j in 0..LANES {
                acc[j] += c[j];
            }
        }
        for &v in wc.remainder() {
            acc[0] += v;
        }
        total += acc.iter().map(|&x| x as f64).sum::<f64>();
    }
    total
}

/// Indices of the values >= `floor`, in index order.
fn at_least(v: &[f32], floor: f32) -> Vec<u32> {
    (0..v.len() as u32)
        .filter(|&i| v[i as usize] >= floor)
        .collect()
}

/// The `n` largest of `idx` by value, largest first (ties: lower index first): a
/// selection, then a sort of those n only.
fn largest_first(v: &[f32], mut idx: Vec<u32>, n: usize) -> Vec<u32> {
    let order = |a: &u32, b: &u32| v[*b as usize].total_cmp(&v[*a as usize]).then(a.cmp(b));
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx
}

/// How many values are >= `floor` (a vectorised count: no allocation).
fn count_at_least(v: &[f32], floor: f32) -> usize {
    v.iter().filter(|&&x| x >= floor).count()
}

/// Sum of the values >= `floor` (f32 lanes: a screen, not an exact mass).
fn mass_at_least(v: &[f32], floor: f32) -> f64 {
    let mut acc = [0f32; LANES];
    let mut c = v.chunks_exact(LANES);
    for ch in &mut c {
        for j in 0..LANES {
            acc[j] += if ch[j] >= floor { ch[j] } else { 0.0 };
        }
    }
    let rest: f32 = c.remainder().iter().filter(|&&x| x >= floor).sum();
    acc.iter().map(|&x| x as f64).sum::<f64>() + rest as f64
}

/// The `n` largest values' indices, largest first (ties: lower index first). Counts
/// the values within a doubling margin of the max until there are n, then gathers and
/// orders only those.
fn top_n(v: &[f32], mx: f32, n: usize) -> Vec<u32> {
    let n = n.min(v.len());
    let mut margin = 0.5f32;
    loop {
        let floor = if margin > 1e30 {
            f32::NEG_INFINITY
        } else {
            mx - margin
        };
        if floor == f32::NEG_INFINITY || count_at_least(v, floor) >= n {
            return largest_first(v, at_least(v, floor), n);
        }
        margin *= 2.0;
    }
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
            scratch: Default::default(),
        }
    }

    /// Records a token as generated (it then counts for the penalties).
    pub fn accept(&mut self, id: u32) {
        *self.counts.entry(id).or_default() += 1;
    }

    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let (mut l, mut w) = std::mem::take(&mut self.scratch);
        let s = self.sample_in(logits, &mut l, &mut w);
        self.scratch = (l, w);
        s
    }

    fn sample_in(&mut self, logits: &[f32], l: &mut Vec<f32>, w: &mut Vec<f32>) -> Sampled {
        l.clear();
        l.extend_from_slice(logits);
        for &(id, b) in &self.p.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += b;
            }
        }
        if self.p.presence_penalty != 0.0 || self.p.frequency_penalty != 0.0 {
            for (&id, &n) in &self.counts {
                if let Some(v) = l.get_mut(id as usize) {
                    *v -= self.p.presence_penalty + self.p.frequency_penalty * n as f32;
                }
            }
        }
        let mx = clean_max(l);
        if !mx.is_finite() {
            // Every logit -inf (or NaN), or one +inf: the first of the largest, certain.
            let id = l.iter().position(|&v| v == mx).unwrap_or(0) as u32;
            return Sampled {
                id,
                logprob: 0.0,
                top: Vec::new(),
            };
        }
        // The weights e^((l - max) / t) for a draw; log p (l - log sum e^l, penalised,
        // temperature 1) only where logprobs were asked for, reusing the draw's weights
        // at temperature 1.
        w.resize(l.len(), 0.0);
        let t = self.p.temperature;
        let want_lp = self.p.logprobs.is_some();
        // A temperature so small that 1 / t overflows (a subnormal f32) is greedy.
        let (id, sum_t1) = if t <= 0.0 || !(1.0 / t).is_finite() {
            (l.iter().position(|&v| v == mx).unwrap_or(0) as u32, None)
        } else {
            let all = exp_weights(l, mx, 1.0 / t, w);
            (self.draw(w, all), (t == 1.0).then_some(all))
        };
        let lse = if want_lp {
            sum_t1.unwrap_or_else(|| exp_weights(l, mx, 1.0, w)).ln() as f32 + mx
        } else {
            f32::NAN
        };
        let top = match self.p.logprobs {
            Some(n) if n > 0 => top_n(l, mx, n)
                .into_iter()
                .map(|i| (i, l[i as usize] - lse))
                .collect(),
            _ => Vec::new(),
        };
        Sampled {
            id,
            logprob: if want_lp { l[id as usize] - lse } else { 0.0 },
            top,
        }
    }

    /// One draw at the temperature, from the top-k / top-p / min-p candidates (top-k
    /// first, then min-p and top-p on the renormalised top-k). Weights e^((l - max) / t) over the vocabulary in one vectorised pass; only
    /// the candidates the cuts can keep are sorted (largest first), and without any cut
    /// the draw walks the vocabulary in index order, unsorted. `w`: the weights
    /// e^((l - max) / t), summing to `all`.
    fn draw(&mut self, w: &[f32], all: f64) -> u32 {
        let (top_k, top_p, min_p) = (self.p.top_k, self.p.top_p, self.p.min_p);
        if top_k == 0 && top_p >= 1.0 && min_p <= 0.0 {
            // No cut: the whole vocabulary, in index order.
            return walk(w, 0..w.len() as u32, all, self.rng.gen());
        }
        let kept = cut(w, all, top_k, top_p, min_p);
        let total: f64 = kept.iter().map(|&i| w[i as usize] as f64).sum();
        walk(w, kept.iter().copied(), total, self.rng.gen())
    }
}

/// The tokens top-k, then min-p and top-p keep (largest weight first; at least one
/// unless `w` is empty). Candidates with weight >= a floor are gathered and ordered; the
/// floor drops until the cuts provably fall inside them (any other token weighs less
/// than every candidate).
fn cut(w: &[f32], all: f64, top_k: usize, top_p: f32, min_p: f32) -> Vec<u32> {
    let mut floor = if min_p > 0.0 {
        min_p.min(1.0)
    } else {
        1.0 / 256.0
    };
    loop {
        let exhaustive = floor <= 0.0;
        // Cheap screens before gathering: too few candidates for top-k, or too little
        // mass for top-p (with slack: the exact test follows).
        let short = if top_k > 0 {
            count_at_least(w, floor) < top_k
        } else {
            top_p < 1.0
                && !(min_p > 0.0 && floor <= min_p)
                && mass_at_least(w, floor) < top_p as f64 * all * (1.0 + 1e-4)
        };
        if short && !exhaustive {
            floor = next_floor(floor);
            continue;
        }
        let cand = at_least(w, floor);
        let (cand, base) = if top_k > 0 {
            let kept = largest_first(w, cand, top_k);
            let base: f64 = kept.iter().map(|&i| w[i as usize] as f64).sum();
            (kept, base)
        } else {
            let n = cand.len();
            (largest_first(w, cand, n), all)
        };
        // min-p: weight >= min_p x the top weight (1); top-p: while the mass before a
        // token is under top_p.
        let mut keep = cand.len();
        if min_p > 0.0 {
            keep = keep.min(
                cand.iter()
                    .take_while(|&&i| w[i as usize] >= min_p)
                    .count()
                    .max(1),
            );
        }
        let mut settled = top_k > 0 || exhaustive || (min_p > 0.0 && floor <= min_p);
        if top_p < 1.0 {
            let goal = top_p as f64 * base;
            let mut before = 0.0f64;
            let n = cand
                .iter()
                .take_while(|&&i| {
                    let b = before;
                    before += w[i as usize] as f64;
                    b < goal
                })
                .count();
            // Inside the candidates unless they all went by with mass still short.
            settled |= n < cand.len() || before >= goal;
            keep = keep.min(n.max(1));
        }
        if settled {
            let mut cand = cand;
            cand.truncate(keep);
            return cand;
        }
        floor = next_floor(floor);
    }
}

/// The next, lower candidate floor (0: every token).
fn next_floor(floor: f32) -> f32 {
    if floor < 1e-30 {
        0.0
    } else {
        floor / 16.0
    }
}

/// Inverse-CDF draw over `order` (weights w, summing to `total`) with u in [0, 1).
fn walk(w: &[f32], order: impl DoubleEndedIterator<Item = u32> + Clone, total: f64, u: f64) -> u32 {
    let mut r = u * total;
    for i in order.clone() {
        r -= w[i as usize] as f64;
        if r < 0.0 {
            return i;
        }
    }
    // Rounding left a sliver: the last token with weight (0 when there is none).
    order.rev().find(|&i| w[i as usize] > 0.0).unwrap_or(0)
}

/// Index of the largest value (the first of equals; NaN never wins unless all are).
pub fn argmax(x: &[f32]) -> u32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for j in 0..LANES {
            m[j] = if c[j] > m[j] { c[j] } else { m[j] };
        }
    }
    for &v in chunks.remainder() {
        m[0] = if v > m[0] { v } else { m[0] };
    }
    let best = lanes_max(m);
    x.iter().position(|&v| v == best).unwrap_or(0) as u32
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
        let mut s = Sampler::new(SamplingParams {
            temperature: 0.0,
            logprobs: Some(6),
            ..Default::default()
        });
        let p: f32 = s.sample(&logits()).top.iter().map(|t| t.1.exp()).sum();
        assert!((p - 1.0).abs() < 1e-5);
    }

    #[test]
    fn exp_neg_matches_std() {
        // A fine grid over [-90, 0] plus the ends: within 3e-7 of f64's e^x where e^x is
        // a normal f32, exactly 0 below -87.
        for i in 0..=900_000 {
            let x = -(i as f32) * 1e-4;
            let (got, want) = (exp_neg(x) as f64, (x as f64).exp());
            if x < -87.0 {
                assert_eq!(got, 0.0, "x = {x}");
            } else if want > f32::MIN_POSITIVE as f64 {
                assert!(
                    (got - want).abs() <= 4e-7 * want,
                    "x = {x}: {got} vs {want}"
                );
            }
        }
        assert_eq!(exp_neg(0.0), 1.0);
        assert_eq!(exp_neg(f32::NEG_INFINITY), 0.0);
    }

    /// The candidates a cut keeps, by the definition: every weight in f64, the tokens
    /// sorted (largest first, lower index first on ties), top-k, then min-p and top-p on
    /// the renormalised rest. `slack` widens (> 0) or narrows (< 0) the min-p and top-p
    /// cuts by that relative amount: the f32 weights may round a token at a cut either way.
    fn reference_kept(l: &[f32], p: &SamplingParams, slack: f64) -> Vec<u32> {
        let mx = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let t = p.temperature as f64;
        let mut c: Vec<(u32, f64)> = l
            .iter()
            .enumerate()
            .map(|(i, &v)| (i as u32, ((v as f64 - mx) / t).exp()))
            .collect();
        c.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if p.top_k > 0 {
            c.truncate(p.top_k);
        }
        let sum: f64 = c.iter().map(|x| x.1).sum();
        let mut keep = c.len();
        if p.min_p > 0.0 {
            let floor = p.min_p as f64 * c[0].1 * (1.0 - slack);
            keep = keep.min(c.iter().take_while(|x| x.1 >= floor).count().max(1));
        }
        if p.top_p < 1.0 {
            let goal = p.top_p as f64 * (1.0 + slack);
            let mut acc = 0.0;
            let n = c
                .iter()
                .take_while(|x| {
                    let b = acc;
                    acc += x.1 / sum;
                    b < goal
                })
                .count();
            keep = keep.min(n.max(1));
        }
        c[..keep].iter().map(|x| x.0).collect()
    }

    #[test]
    fn cuts_keep_what_the_definition_keeps() {
        // Fresh random logits each run, every pair at least spread / vocab apart (so no
        // two weights round together): the tokens `cut` keeps lie between what the
        // definition keeps with its min-p / top-p cuts narrowed and widened by 1e-5.
        // Vocabularies of 3000 and V4's 129280; flat and peaked (one token far above a
        // heavy tail, so the candidate floor has to fall); then draws stay inside.
        let mut rng = StdRng::from_entropy();
        for (vocab, spread, peak) in [
            (3000usize, 8.0f32, 0.0f32),
            (129_280, 0.5, 0.0),
            (129_280, 1.0, 9.0),
        ] {
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            for i in (1..vocab).rev() {
                order.swap(i, rng.gen_range(0..=i));
            }
            let mut l: Vec<f32> = order
                .iter()
                .map(|&r| r as f32 * spread / vocab as f32)
                .collect();
            l[rng.gen_range(0..vocab)] += peak;
            for (top_k, top_p, min_p, temperature) in [
                (0, 1.0, 0.0, 1.0),
                (40, 1.0, 0.0, 0.7),
                (0, 0.9, 0.0, 0.7),
                (0, 0.02, 0.0, 1.5),
                (0, 0.5, 0.0, 1.0),
                (0, 1.0, 0.05, 1.0),
                (0, 1.0, 0.999, 1.0),
                (50, 0.5, 0.2, 1.0),
                (1, 1.0, 0.0, 1.0),
                (5000, 0.95, 0.0, 0.05),
            ] {
                let p = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    seed: Some(rng.gen()),
                    ..Default::default()
                };
                let loose = reference_kept(&l, &p, 1e-5);
                let strict = reference_kept(&l, &p, -1e-5);
                let mx = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut w = vec![0f32; vocab];
                let all = exp_weights(&l, mx, 1.0 / temperature, &mut w);
                if top_k > 0 || top_p < 1.0 || min_p > 0.0 {
                    let ours = cut(&w, all, top_k, top_p, min_p);
                    let set: std::collections::HashSet<u32> = ours.iter().copied().collect();
                    assert!(
                        strict.iter().all(|i| set.contains(i)),
                        "{p:?}: kept {} of the strict {}",
                        ours.len(),
                        strict.len()
                    );
                    assert!(
                        ours.iter().all(|i| loose.contains(i)),
                        "{p:?}: kept {} beyond the loose {}",
                        ours.len(),
                        loose.len()
                    );
                }
                let mut s = Sampler::new(p.clone());
                for _ in 0..50 {
                    let id = s.sample(&l).id;
                    assert!(
                        loose.contains(&id),
                        "{p:?}: drew {id}, not among {} kept",
                        loose.len()
                    );
                }
            }
        }
    }

    #[test]
    fn logprobs_match_an_f64_log_softmax() {
        // Fresh random logits; temperatures 0 (greedy), 1 (the draw's weights reused) and
        // 0.7 (a pass of its own): the chosen token's and the top-5's log p within 2e-6.
        let mut rng = StdRng::from_entropy();
        let l: Vec<f32> = (0..5000).map(|_| rng.gen::<f32>() * 10.0 - 5.0).collect();
        let mx = l.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = l.iter().map(|&v| (v as f64 - mx).exp()).sum::<f64>().ln() + mx;
        for temperature in [0.0, 1.0, 0.7] {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                logprobs: Some(5),
                ..Default::default()
            });
            let r = s.sample(&l);
            let want = l[r.id as usize] as f64 - lse;
            assert!(
                (r.logprob as f64 - want).abs() < 2e-6,
                "t {temperature}: {} vs {want}",
                r.logprob
            );
            for (i, lp) in r.top {
                assert!((lp as f64 - (l[i as usize] as f64 - lse)).abs() < 2e-6);
            }
        }
    }

    #[test]
    fn tiny_temperatures_are_greedy() {
        // 1e-40 is a subnormal f32: 1 / t overflows.
        for temperature in [1e-40f32, 1e-6] {
            let mut s = Sampler::new(SamplingParams {
                temperature,
                min_p: 0.1,
                ..Default::default()
            });
            assert_eq!(s.sample(&logits()).id, 1);
        }
    }

    #[test]
    fn draws_follow_the_softmax() {
        // 60000 draws at temperature 1.3 from fresh random logits: each frequency within
        // 0.012 of its probability (computed in f64; the binomial's sigma is <= 0.002).
        let mut rng = StdRng::from_entropy();
        let l: Vec<f32> = (0..7).map(|_| rng.gen::<f32>() * 3.0).collect();
        let e: Vec<f64> = l.iter().map(|&v| (v as f64 / 1.3).exp()).collect();
        let z: f64 = e.iter().sum();
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.3,
            ..Default::default()
        });
        let mut n = [0usize; 7];
        for _ in 0..60_000 {
            n[s.sample(&l).id as usize] += 1;
        }
        for i in 0..7 {
            let f = n[i] as f64 / 60_000.0;
            assert!(
                (f - e[i] / z).abs() < 0.012,
                "token {i}: {f} vs {}",
                e[i] / z
            );
        }
    }

    #[test]
    fn argmax_takes_the_first_largest_and_skips_nan() {
        let mut rng = StdRng::from_entropy();
        let mut x: Vec<f32> = (0..1001).map(|_| rng.gen::<f32>()).collect();
        let want = x
            .iter()
            .enumerate()
            .fold(0, |b, (i, v)| if *v > x[b] { i } else { b });
        assert_eq!(argmax(&x) as usize, want);
        x[3] = f32::NAN;
        x[700] = 2.0;
        x[900] = 2.0;
        assert_eq!(argmax(&x), 700);
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

    #[test]
    fn logit_bias_bans_and_forces() {
        let greedy = |bias: Vec<(u32, f32)>| {
            Sampler::new(SamplingParams {
                temperature: 0.0,
                logit_bias: bias,
                ..Default::default()
            })
            .sample(&logits())
            .id
        };
        let best = greedy(vec![]);
        assert_ne!(greedy(vec![(best, -100.0)]), best);
        assert_eq!(greedy(vec![(0, 100.0)]), 0);
        // ids past the vocabulary are ignored, not a panic
        assert_eq!(greedy(vec![(1 << 30, 100.0)]), best);
        // sampled at temperature 1, a banned token never comes up
        let mut s = Sampler::new(SamplingParams {
            seed: Some(7),
            logit_bias: vec![(best, -100.0)],
            ..Default::default()
        });
        assert!((0..200).all(|_| s.sample(&logits()).id != best));
    }
}
