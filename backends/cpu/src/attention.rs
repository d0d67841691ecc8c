//! ATTENTION on the CPU: each token's query heads over its slot's cached rows, causal.
//!
//! Work goes out by (token, span of positions), every head in a task: the query heads
//! that share a kv head are done together, so each cached key / value row is read once
//! per group. A decode step (one token) still spreads over the pool: its positions split
//! into spans whose partial results (max score, sum of exps, unnormalised output) are
//! merged after, the split-K form GPU decoders use. Spans start at whole multiples of
//! SPAN, so a token's arithmetic depends on its own position alone: the same bits in a
//! prefill, in decode, beside other requests and on any number of threads. Scores are
//! taken four positions at a time and values added four rows at a time, so no chain of
//! dependent adds sets the pace.

use moe_plugin_api::{ops, OpParams, TensorRef};

use crate::{
    buffers::Buffers,
    kernels::{args, cache_row, same_len, sub_mut, CpuKernel},
    par_for,
};

/// Positions a span covers (the last of a token's spans fewer): a multiple of the four
/// positions a step and of the exp's eight lanes.
const SPAN: usize = 256;

inventory::submit! { CpuKernel { op: ops::ATTENTION, name: "attention", run: attention } }
fn attention(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [q, kc, vc, slot, pos, out] = args::<6>(a, "attention")?;
    let (hd, heads) = (q.dims[0] as usize, q.dims[1] as usize);
    let kvh = kc.dims[1] as usize;
    if kc.dims != vc.dims || kc.dims[0] as usize != hd || kvh == 0 || heads % kvh != 0 {
        return Err("attention: q / k cache / v cache shapes disagree".into());
    }
    let (qs, ks, vs) = (b.f32s(&q)?, b.f32s(&kc)?, b.f32s(&vc)?);
    let (ss, ps, out) = (b.i32s(&slot)?, b.i32s(&pos)?, b.f32s_mut(&out)?);
    same_len("attention", out.len(), qs.len())?;
    same_len("attention", ss.len() * hd * heads, qs.len())?;
    same_len("attention", ss.len(), ps.len())?;
    // Validate every (slot, pos) up front so the parallel part cannot fail.
    let mut bases = Vec::with_capacity(ss.len());
    for (&s, &ps_) in ss.iter().zip(ps) {
        cache_row(&kc, s, ps_)?;
        bases.push(cache_row(&kc, s, 0)?);
    }
    let call = Call {
        qs,
        ks,
        vs,
        bases: &bases,
        ps,
        heads,
        kvh,
        hd,
        scale: p.f[0],
    };
    attend(&call, out)?;
    Ok("attention")
}

/// One checked call: queries [tokens][heads][hd]; caches whose rows for token t start
/// at bases[t] (position j at bases[t] + j kvh hd); token t attends positions 0..=ps[t].
#[derive(Clone, Copy)]
struct Call<'a> {
    qs: &'a [f32],
    ks: &'a [f32],
    vs: &'a [f32],
    bases: &'a [usize],
    ps: &'a [i32],
    heads: usize,
    kvh: usize,
    hd: usize,
    scale: f32,
}

impl Call<'_> {
    /// Query heads a kv head serves.
    fn group(&self) -> usize {
        self.heads / self.kvh
    }
    /// Floats from one position's cached row to the next.
    fn row(&self) -> usize {
        self.hd * self.kvh
    }
}

fn attend(c: &Call, out: &mut [f32]) -> Result<(), String> {
    let Call {
        qs,
        bases,
        ps,
        heads,
        hd,
        ..
    } = *c;
    let tokens = ps.len();
    if tokens == 0 || hd == 0 {
        return Ok(());
    }
    // Tasks (token, span); tokens of several spans get their partials' place.
    let spans = |t: usize| (ps[t] as usize + 1).div_ceil(SPAN);
    let mut tasks = Vec::new();
    let mut part_at = vec![0usize; tokens];
    let mut n_parts = 0;
    for (t, at) in part_at.iter_mut().enumerate() {
        tasks.extend((0..spans(t)).map(|sp| (t, sp)));
        if spans(t) > 1 {
            *at = n_parts;
            n_parts += spans(t) * heads;
        }
    }
    let work: usize = ps.iter().map(|&p| (p as usize + 1) * hd * heads).sum();
    let grain = if work < (1 << 16) { tasks.len() } else { 1 };
    // Per (token, head, span) of a token of several spans: its max, its sum of exps, then
    // hd unnormalised output values.
    let part_len = hd + 2;
    let mut parts = vec![0f32; n_parts * part_len];
    let (out_addr, parts_addr) = (out.as_mut_ptr() as usize, parts.as_mut_ptr() as usize);
    par_for(tasks.len(), grain, |range| {
        let mut sc = Scratch::default();
        for &(t, span) in &tasks[range] {
            let n_pos = ps[t] as usize + 1;
            let (j0, j1) = (span * SPAN, ((span + 1) * SPAN).min(n_pos));
            let q0 = t * heads * hd;
            sc.run(c, &qs[q0..q0 + heads * hd], bases[t], j0, j1);
            for h in 0..heads {
                let o = &sc.o[h * hd..(h + 1) * hd];
                let (m, l) = (sc.max[h], sc.sum[h]);
                if spans(t) == 1 {
                    // SAFETY: (token, head)'s output belongs to this task alone.
                    let dst = unsafe { sub_mut::<f32>(out_addr, (t * heads + h) * hd, hd) };
                    let inv = 1.0 / l;
                    for (d, v) in dst.iter_mut().zip(o) {
                        *d = v * inv;
                    }
                } else {
                    let at = (part_at[t] + h * spans(t) + span) * part_len;
                    // SAFETY: (token, head, span)'s partial belongs to this task alone.
                    let dst = unsafe { sub_mut::<f32>(parts_addr, at, part_len) };
                    dst[0] = m;
                    dst[1] = l;
                    dst[2..].copy_from_slice(o);
                }
            }
        }
        Ok(())
    })?;
    if n_parts > 0 {
        let split: Vec<(usize, usize)> = (0..tokens)
            .filter(|&t| spans(t) > 1)
            .map(|t| (t, spans(t)))
            .collect();
        merge_spans(&parts, &part_at, &split, heads, hd, out)?;
    }
    Ok(())
}

/// out = sum_s o_s e^(m_s - M) / sum_s l_s e^(m_s - M), M the largest m_s, for every
/// head of each token in `split` (token, its spans), whose partials start at part_at.
fn merge_spans(
    parts: &[f32],
    part_at: &[usize],
    split: &[(usize, usize)],
    heads: usize,
    hd: usize,
    out: &mut [f32],
) -> Result<(), String> {
    let part_len = hd + 2;
    let out_addr = out.as_mut_ptr() as usize;
    par_for(split.len() * heads, 64, |range| {
        for i in range {
            let ((t, n), h) = (split[i / heads], i % heads);
            let at = (part_at[t] + h * n) * part_len;
            let ps = &parts[at..at + n * part_len];
            let mx = ps
                .chunks_exact(part_len)
                .fold(f32::NEG_INFINITY, |m, p| m.max(p[0]));
            // SAFETY: (token, head)'s output belongs to this task alone.
            let o = unsafe { sub_mut::<f32>(out_addr, (t * heads + h) * hd, hd) };
            o.fill(0.0);
            let mut l = 0.0;
            for p in ps.chunks_exact(part_len) {
                let w = (p[0] - mx).exp();
                l += p[1] * w;
                for (o, v) in o.iter_mut().zip(&p[2..]) {
                    *o += w * v;
                }
            }
            let inv = 1.0 / l;
            for v in o.iter_mut() {
                *v *= inv;
            }
        }
        Ok(())
    })
}

/// One task's working memory, reused across its pool chunk's tasks.
#[derive(Default)]
struct Scratch {
    /// Scores then exps, [head][span positions].
    s: Vec<f32>,
    /// Unnormalised outputs, [head][hd].
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

impl Scratch {
    /// A token's query heads `q` ([heads][hd]) over positions j0..j1 of the cached rows
    /// starting at `base`: fills `max`, `sum` (of exps relative to max) and `o`. Whole
    /// cached rows (every kv head) are taken in position order, so both passes read
    /// memory front to back.
    fn run(&mut self, g: &Call, q: &[f32], base: usize, j0: usize, j1: usize) {
        let (hd, n, heads, group) = (g.hd, j1 - j0, g.heads, g.group());
        let (ks, vs) = (g.ks, g.vs);
        self.s.clear();
        self.s.resize(heads * n, 0.0);
        self.o.clear();
        self.o.resize(heads * hd, 0.0);
        self.max.clear();
        self.sum.clear();
        // Row of position j, kv head kv.
        let at = |j: usize, kv: usize| base + j * g.row() + kv * hd;
        let qh = |h: usize| &q[h * hd..(h + 1) * hd];
        // Scores four positions at a time, every head of a kv head's group against its
        // rows while they are in L1.
        let sc = &mut self.s;
        let i = quads(g, ks, base, j0, n, |i, kv, k| {
            for h in kv * group..(kv + 1) * group {
                let d = simd::dots4(qh(h), k);
                for (s, d) in sc[h * n + i..h * n + i + 4].iter_mut().zip(d) {
                    *s = d * g.scale;
                }
            }
        });
        for i in i..n {
            for h in 0..heads {
                let a = at(j0 + i, h / group);
                self.s[h * n + i] = dot8(qh(h), &ks[a..a + hd]) * g.scale;
            }
        }
        for s in self.s.chunks_exact_mut(n) {
            let mx = s.iter().fold(f32::NEG_INFINITY, |m, v| m.max(*v));
            self.max.push(mx);
            self.sum.push(simd::exp_less(s, mx));
        }
        // o_h += sum_j p_h[j] v_j, four value rows at a time.
        let (sc, o) = (&self.s, &mut self.o);
        let i = quads(g, vs, base, j0, n, |i, kv, v| {
            for h in kv * group..(kv + 1) * group {
                axpy4(
                    &mut o[h * hd..(h + 1) * hd],
                    &sc[h * n + i..h * n + i + 4],
                    v,
                );
            }
        });
        for i in i..n {
            for h in 0..heads {
                let (a, w) = (at(j0 + i, h / group), self.s[h * n + i]);
                for (o, v) in self.o[h * hd..(h + 1) * hd].iter_mut().zip(&vs[a..a + hd]) {
                    *o += w * v;
                }
            }
        }
    }
}

/// f(i, kv, rows) for each whole quad of positions j0 + i .. j0 + i + 4 (i < n) and each
/// kv head, `rows` being that kv head's four rows of `cache` (rows start at `base`, one
/// position `g.row()` floats on); the rows 16 positions on are asked for meanwhile. Returns
/// the first i not in a whole quad.
#[inline(always)]
fn quads<'a>(
    g: &Call,
    cache: &'a [f32],
    base: usize,
    j0: usize,
    n: usize,
    mut f: impl FnMut(usize, usize, [&'a [f32]; 4]),
) -> usize {
    let at = |j: usize, kv: usize| base + j * g.row() + kv * g.hd;
    let mut i = 0;
    while i + 4 <= n {
        prefetch_rows(cache, at(j0 + i + AHEAD, 0), 4 * g.row());
        for kv in 0..g.kvh {
            let a = [0, 1, 2, 3].map(|d| at(j0 + i + d, kv));
            f(i, kv, a.map(|a| &cache[a..a + g.hd]));
        }
        i += 4;
    }
    i
}

/// Positions ahead of the one being read whose rows are asked for early.
const AHEAD: usize = 16;

/// Asks for the cache lines of `len` floats from `at` (clipped to the slice): the
/// hardware prefetchers fall behind a loop that streams one cache's rows between
/// others' and the weights'.
#[inline(always)]
fn prefetch_rows(x: &[f32], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let end = (at + len).min(x.len());
        let mut i = at;
        while i < end {
            // SAFETY: i < x.len(); a prefetch never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(x.as_ptr().add(i).cast()) };
            i += 16;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, at, len);
}

/// A dot product in one serial chain of fused multiply-adds (a span's last few
/// positions).
#[inline(always)]
fn dot8(q: &[f32], k: &[f32]) -> f32 {
    let mut s = 0.0;
    for (x, y) in q.iter().zip(k) {
        s = x.mul_add(*y, s);
    }
    s
}

/// o += p0 v0 + p1 v1 + p2 v2 + p3 v3.
#[inline(always)]
fn axpy4(o: &mut [f32], p: &[f32], v: [&[f32]; 4]) {
    simd::axpy4(o, [p[0], p[1], p[2], p[3]], v)
}

/// The two inner loops in AVX2 + FMA where the build targets it (the workspace's
/// x86-64-v3 default): LLVM's own vectorisation of them shuffled lanes needlessly.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
mod simd {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    #[inline(always)]
    pub fn dots4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
        // SAFETY: this module is compiled only for builds that target AVX2 and FMA.
        unsafe { dots4_avx2(q, k) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn dots4_avx2(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
        let n = q.len();
        let k = k.map(|r| &r[..n]);
        let n8 = n / 8 * 8;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut c = 0;
        while c < n8 {
            // SAFETY: c + 8 <= n8 <= n, the length of q and of every k row.
            unsafe {
                let qv = _mm256_loadu_ps(q.as_ptr().add(c));
                for (a, r) in acc.iter_mut().zip(&k) {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r.as_ptr().add(c)), *a);
                }
            }
            c += 8;
        }
        let mut out = [0f32; 4];
        for ((o, a), r) in out.iter_mut().zip(acc).zip(&k) {
            let mut s = hsum(a);
            for (x, y) in q[n8..].iter().zip(&r[n8..]) {
                s = x.mul_add(*y, s);
            }
            *o = s;
        }
        out
    }

    /// s = e^(s - m) in place, returning the sum. e^x by the usual reduction: x is n ln2
    /// plus r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes' expf
    /// coefficients; within a few ulp), times 2^n through the exponent bits. x is
    /// taken at -87 or above (e^-87 ~ 1.6e-38 adds nothing next to the largest score's
    /// 1); NaN stays NaN.
    #[inline(always)]
    pub fn exp_less(s: &mut [f32], m: f32) -> f32 {
        // SAFETY: as above.
        unsafe { exp_less_avx2(s, m) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp_less_avx2(s: &mut [f32], m: f32) -> f32 {
        let n8 = s.len() / 8 * 8;
        let mv = _mm256_set1_ps(m);
        let mut sum = _mm256_setzero_ps();
        let mut c = 0;
        while c < n8 {
            // SAFETY: c + 8 <= n8 <= s.len().
            unsafe {
                let at = s.as_mut_ptr().add(c);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(at), mv));
                _mm256_storeu_ps(at, e);
                sum = _mm256_add_ps(sum, e);
            }
            c += 8;
        }
        let mut l = hsum(sum);
        for v in &mut s[n8..] {
            *v = (*v - m).exp();
            l += *v;
        }
        l
    }

    /// e^x for x <= 0 (scores less their span's largest; above ~88 the exponent bits
    /// would overflow).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn exp8(x: __m256) -> __m256 {
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        // max(c, x) returns x when x is NaN; the mask below restores it as NaN.
        let x = _mm256_max_ps(_mm256_set1_ps(-87.0), x);
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
        );
        // ln 2 in two parts, so n ln2 is subtracted without rounding away r's bits.
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_2e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        let r2 = _mm256_mul_ps(r, r);
        let e = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.0));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_or_ps(_mm256_mul_ps(e, pow2), nan)
    }

    #[inline(always)]
    pub fn axpy4(o: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        // SAFETY: as above.
        unsafe { axpy4_avx2(o, p, v) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn axpy4_avx2(o: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        let n = o.len();
        let v = v.map(|r| &r[..n]);
        let n8 = n / 8 * 8;
        let pv = p.map(|x| _mm256_set1_ps(x));
        let mut c = 0;
        while c < n8 {
            // SAFETY: c + 8 <= n8 <= n, the length of o and of every v row.
            unsafe {
                let at = o.as_mut_ptr().add(c);
                let mut acc = _mm256_loadu_ps(at);
                for (pv, r) in pv.iter().zip(&v) {
                    acc = _mm256_fmadd_ps(*pv, _mm256_loadu_ps(r.as_ptr().add(c)), acc);
                }
                _mm256_storeu_ps(at, acc);
            }
            c += 8;
        }
        for (i, o) in o.iter_mut().enumerate().skip(n8) {
            *o += (p[0] * v[0][i] + p[1] * v[1][i]) + (p[2] * v[2][i] + p[3] * v[3][i]);
        }
    }
}

/// The same loops in plain Rust for other targets.
#[cfg(not(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
)))]
mod simd {
    #[inline(always)]
    pub fn dots4(q: &[f32], k: [&[f32]; 4]) -> [f32; 4] {
        k.map(|r| q.iter().zip(r).fold(0.0, |s, (x, y)| x.mul_add(*y, s)))
    }

    #[inline(always)]
    pub fn exp_less(s: &mut [f32], m: f32) -> f32 {
        let mut l = 0.0;
        for v in s.iter_mut() {
            *v = (*v - m).exp();
            l += *v;
        }
        l
    }

    #[inline(always)]
    pub fn axpy4(o: &mut [f32], p: [f32; 4], v: [&[f32]; 4]) {
        for (i, o) in o.iter_mut().enumerate() {
            *o += (p[0] * v[0][i] + p[1] * v[1][i]) + (p[2] * v[2][i] + p[3] * v[3][i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn seeded() -> StdRng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        println!("seed {seed}");
        StdRng::seed_from_u64(seed)
    }

    /// Softmax attention of each query head over its kv head's rows 0..=pos, in f64.
    fn reference(c: &Call) -> Vec<f64> {
        let (hd, group) = (c.hd, c.heads / c.kvh);
        let mut out = vec![0f64; c.qs.len()];
        for (t, &p) in c.ps.iter().enumerate() {
            for h in 0..c.heads {
                let q = &c.qs[(t * c.heads + h) * hd..][..hd];
                let at = |j: usize| c.bases[t] + j * c.kvh * hd + (h / group) * hd;
                let s: Vec<f64> = (0..=p as usize)
                    .map(|j| {
                        let k = &c.ks[at(j)..at(j) + hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * c.scale as f64
                    })
                    .collect();
                let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = s.iter().map(|v| (v - mx).exp()).sum();
                let o = &mut out[(t * c.heads + h) * hd..][..hd];
                for (j, v) in s.iter().enumerate() {
                    let w = (v - mx).exp() / l;
                    for (o, x) in o.iter_mut().zip(&c.vs[at(j)..at(j) + hd]) {
                        *o += w * *x as f64;
                    }
                }
            }
        }
        out
    }

    /// Random queries and caches of every shape class the kernel splits on: decode
    /// (one token, its positions split into spans), a batch of tokens at scattered
    /// positions in two slots (spans past some tokens' ends), head widths that are not
    /// whole vectors, grouped and plain heads; within 2e-6 of the largest output.
    #[test]
    fn matches_f64_softmax_attention() {
        let mut rng = seeded();
        // (head dim, heads, kv heads, positions of the tokens)
        let cases: [(usize, usize, usize, Vec<i32>); 5] = [
            (64, 9, 3, vec![700]),
            (72, 4, 4, vec![3]),
            (64, 8, 2, vec![0, 5, 63, 64, 200, 901]),
            (13, 6, 1, vec![130, 2]),
            (128, 2, 1, (0..40).collect()),
        ];
        for (hd, heads, kvh, ps) in cases {
            let ctx = 1024;
            let slots = 2;
            let n = ps.len();
            let mut normal = |len: usize, sd: f32| -> Vec<f32> {
                (0..len)
                    .map(|_| (rng.gen::<f32>() - 0.5) * 3.5 * sd)
                    .collect()
            };
            let qs = normal(n * heads * hd, 1.0);
            let ks = normal(slots * ctx * kvh * hd, 1.0);
            let vs = normal(slots * ctx * kvh * hd, 2.0);
            let bases: Vec<usize> = (0..n).map(|t| (t % slots) * ctx * kvh * hd).collect();
            let c = Call {
                qs: &qs,
                ks: &ks,
                vs: &vs,
                bases: &bases,
                ps: &ps,
                heads,
                kvh,
                hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let mut out = vec![f32::NAN; qs.len()];
            attend(&c, &mut out).unwrap();
            let want = reference(&c);
            let big = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                assert!(
                    (*o as f64 - w).abs() <= 2e-6 * big,
                    "hd {hd} heads {heads}/{kvh} positions {ps:?}: [{i}] {o} vs {w}"
                );
            }
        }
    }

    /// A token's output is the same bits alone (decode) and among other tokens (prefill,
    /// or other requests in the step): its spans depend on its position only.
    #[test]
    fn a_token_alone_equals_it_in_a_batch() {
        let mut rng = seeded();
        let (hd, heads, kvh, ctx) = (64, 6, 2, 1024);
        let mut rand = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen::<f32>() - 0.5).collect() };
        let (ks, vs) = (rand(2 * ctx * kvh * hd), rand(2 * ctx * kvh * hd));
        let ps = [300, 5, 700, 129];
        let qs = rand(ps.len() * heads * hd);
        let bases: Vec<usize> = (0..ps.len()).map(|t| (t % 2) * ctx * kvh * hd).collect();
        let call = |ps: &[i32], qs: &[f32], bases: &[usize]| {
            let c = Call {
                qs,
                ks: &ks,
                vs: &vs,
                bases,
                ps,
                heads,
                kvh,
                hd,
                scale: 0.125,
            };
            let mut out = vec![f32::NAN; qs.len()];
            attend(&c, &mut out).unwrap();
            out
        };
        let batch = call(&ps, &qs, &bases);
        let w = heads * hd;
        for t in 0..ps.len() {
            let alone = call(&ps[t..t + 1], &qs[t * w..(t + 1) * w], &bases[t..t + 1]);
            let same = alone
                .iter()
                .zip(&batch[t * w..(t + 1) * w])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "token {t} at position {}", ps[t]);
        }
    }

    /// The vector e^x within 3 ulp of f64's on [-87, 0] (and the tail past -87 below
    /// 2e-38); a NaN score stays NaN.
    #[test]
    fn exp_is_within_a_few_ulp() {
        let mut rng = seeded();
        let mut xs: Vec<f32> = (0..4096).map(|_| -rng.gen::<f32>() * 87.0).collect();
        xs.extend([0.0, -1e-30, -0.5, -87.0, -87.5, -100.0, -1e30]);
        let mut e = xs.clone();
        simd::exp_less(&mut e, 0.0);
        for (x, e) in xs.iter().zip(&e) {
            let want = (*x as f64).exp();
            if *x >= -87.0 {
                let ulp = (want as f32).to_bits().abs_diff(e.to_bits());
                assert!(ulp <= 3, "e^{x}: {e} vs {want} ({ulp} ulp)");
            } else {
                assert!(*e >= 0.0 && *e < 2e-38, "e^{x}: {e}");
            }
        }
        let mut v = [1.0, f32::NAN, 0.0, -3.0, 2.0, 0.5, -1.0, 4.0, f32::NAN];
        simd::exp_less(&mut v, 4.0);
        assert!(v[1].is_nan() && v[8].is_nan() && v[7] == 1.0);
    }
}
