//! The small per-token pieces of the DeepSeek-V4 forward (norms, rotary, mHC mixing,
//! Sinkhorn, windowed pooling, sparse attention with sinks, routing), written once in
//! f32 over slices: the engine's host glue and the CPU backend's glue ops run them, and
//! kernels/gpu/ds4.cu computes the same (summation orders aside).

/// Weighted (w = Some) or plain RMS norm of each `d`-sized row, in place.
pub fn rms_norm(x: &mut [f32], d: usize, w: Option<&[f32]>, eps: f32) {
    for row in x.chunks_exact_mut(d) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let r = 1.0 / (ms + eps).sqrt();
        match w {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, g)| *v = g * (*v * r)),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    }
}

/// Inverse frequencies of one rotary table (one per rotated pair), as f32 like the oracle.
#[derive(Debug, Clone)]
pub struct Rope {
    pub inv_freq: Vec<f32>,
    /// YaRN's attention factor (1 for plain RoPE), multiplied into cos and sin.
    pub mscale: f32,
}

#[derive(Debug, Clone, Copy)]
pub struct YarnParams {
    pub factor: f32,
    pub original_ctx: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub attn_factor: f32,
}

impl Rope {
    pub fn plain(base: f32, dim: usize) -> Rope {
        let inv_freq = (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        Rope {
            inv_freq,
            mscale: 1.0,
        }
    }

    /// YaRN: interpolate low frequencies by `factor`, keep high ones, with a linear ramp
    /// between the dims where `beta_fast` and `beta_slow` rotations fit the original
    /// context (bounds floored/ceiled, as transformers does by default).
    pub fn yarn(base: f32, dim: usize, y: YarnParams) -> Rope {
        let corr = |rot: f32| {
            (dim as f32 * (y.original_ctx / (rot * 2.0 * std::f32::consts::PI)).ln())
                / (2.0 * base.ln())
        };
        let low = corr(y.beta_fast).floor().max(0.0);
        let mut high = corr(y.beta_slow).ceil().min(dim as f32 - 1.0);
        if low == high {
            high += 0.001;
        }
        let inv_freq = (0..dim / 2)
            .map(|i| {
                let pos_freq = base.powf((2 * i) as f32 / dim as f32);
                let extra = 1.0 / pos_freq;
                let inter = 1.0 / (y.factor * pos_freq);
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                inter * (1.0 - keep) + extra * keep
            })
            .collect();
        Rope {
            inv_freq,
            mscale: y.attn_factor,
        }
    }

    /// Rotates the trailing `2 * inv_freq.len()` values of each `d`-sized row (interleaved
    /// pairs) by position `pos`; `inverse` rotates back (sin negated).
    pub fn apply(&self, row: &mut [f32], d: usize, pos: u32, inverse: bool) {
        let rd = 2 * self.inv_freq.len();
        for head in row.chunks_exact_mut(d) {
            let tail = &mut head[d - rd..];
            for (i, f) in self.inv_freq.iter().enumerate() {
                let a = pos as f32 * f;
                let (c, mut s) = (a.cos() * self.mscale, a.sin() * self.mscale);
                if inverse {
                    s = -s;
                }
                let (x0, x1) = (tail[2 * i], tail[2 * i + 1]);
                tail[2 * i] = x0 * c - x1 * s;
                tail[2 * i + 1] = x1 * c + x0 * s;
            }
        }
    }
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// torch's softplus (beta 1, linear above 20).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// The weights of one mHC site for one token: `pre` collapses the streams into the
/// block input, `post` spreads the block output back, `comb` (row i -> column j) mixes
/// the old streams after Sinkhorn normalisation.
pub struct HcWeights {
    pub pre: Vec<f32>,
    pub post: Vec<f32>,
    pub comb: Vec<f32>,
}

/// From the projected mixes (`2*hc + hc*hc` values) of one token.
pub fn hc_weights(
    mix: &[f32],
    scale: &[f32],
    base: &[f32],
    hc: usize,
    iters: usize,
    eps: f32,
) -> HcWeights {
    let pre = (0..hc)
        .map(|i| sigmoid(mix[i] * scale[0] + base[i]) + eps)
        .collect();
    let post = (0..hc)
        .map(|i| 2.0 * sigmoid(mix[hc + i] * scale[1] + base[hc + i]))
        .collect();
    let mut comb: Vec<f32> = (0..hc * hc)
        .map(|i| mix[2 * hc + i] * scale[2] + base[2 * hc + i])
        .collect();
    for row in comb.chunks_exact_mut(hc) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut s = 0.0;
        for v in row.iter_mut() {
            *v = (*v - m).exp();
            s += *v;
        }
        row.iter_mut().for_each(|v| *v = *v / s + eps);
    }
    let norm_cols = |c: &mut [f32]| {
        for j in 0..hc {
            let s: f32 = (0..hc).map(|i| c[i * hc + j]).sum::<f32>() + eps;
            (0..hc).for_each(|i| c[i * hc + j] /= s);
        }
    };
    norm_cols(&mut comb);
    for _ in 1..iters {
        for row in comb.chunks_exact_mut(hc) {
            let s: f32 = row.iter().sum::<f32>() + eps;
            row.iter_mut().for_each(|v| *v /= s);
        }
        norm_cols(&mut comb);
    }
    HcWeights { pre, post, comb }
}

/// sum_h w_h * stream_h for one token (`streams` is hc rows of d).
pub fn hc_collapse(streams: &[f32], w: &[f32], d: usize, out: &mut [f32]) {
    out.iter_mut().for_each(|v| *v = 0.0);
    for (h, s) in streams.chunks_exact(d).enumerate() {
        out.iter_mut().zip(s).for_each(|(o, x)| *o += w[h] * x);
    }
}

/// new_k = post_k * block + sum_j comb[j][k] * old_j, in place on one token's streams.
pub fn hc_expand(streams: &mut [f32], block: &[f32], w: &HcWeights, d: usize) {
    let hc = w.pre.len();
    let old = streams.to_vec();
    for k in 0..hc {
        let dst = &mut streams[k * d..(k + 1) * d];
        for (i, v) in dst.iter_mut().enumerate() {
            let mut acc = w.post[k] * block[i];
            for j in 0..hc {
                acc += w.comb[j * hc + k] * old[j * d + i];
            }
            *v = acc;
        }
    }
}

/// Softmax-gated pooling over `slots` rows of `d` (per channel), skipping -inf gates.
pub fn pool(kv: &[f32], gate: &[f32], d: usize, out: &mut [f32]) {
    for c in 0..d {
        let m = gate
            .chunks_exact(d)
            .map(|g| g[c])
            .fold(f32::NEG_INFINITY, f32::max);
        let (mut num, mut den) = (0.0f32, 0.0f32);
        for (k, g) in kv.chunks_exact(d).zip(gate.chunks_exact(d)) {
            if g[c] == f32::NEG_INFINITY {
                continue;
            }
            let e = (g[c] - m).exp();
            num += e * k[c];
            den += e;
        }
        out[c] = num / den;
    }
}

/// One head of attention with a sink logit over `keys` (rows of d, K = V).
pub fn attend(q: &[f32], keys: &[&[f32]], scale: f32, sink: f32, out: &mut [f32]) {
    let logits: Vec<f32> = keys
        .iter()
        .map(|k| q.iter().zip(k.iter()).map(|(a, b)| a * b).sum::<f32>() * scale)
        .collect();
    let m = logits.iter().copied().fold(sink, f32::max);
    let den: f32 = logits.iter().map(|l| (l - m).exp()).sum::<f32>() + (sink - m).exp();
    out.iter_mut().for_each(|v| *v = 0.0);
    for (l, k) in logits.iter().zip(keys) {
        let p = (l - m).exp() / den;
        out.iter_mut().zip(k.iter()).for_each(|(o, x)| *o += p * x);
    }
}

/// Indices of the `k` largest scores (ties: lower index first).
pub fn top_k(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_makes_comb_doubly_stochastic() {
        let hc = 4;
        let mix: Vec<f32> = (0..2 * hc + hc * hc)
            .map(|i| ((i * 7) % 5) as f32 - 2.0)
            .collect();
        let w = hc_weights(&mix, &[1.0, 0.5, 2.0], &vec![0.1; mix.len()], hc, 20, 1e-6);
        for i in 0..hc {
            let row: f32 = (0..hc).map(|j| w.comb[i * hc + j]).sum();
            let col: f32 = (0..hc).map(|j| w.comb[j * hc + i]).sum();
            // Ends on a column step: columns exact, rows still converging.
            assert!(
                (row - 1.0).abs() < 1e-2 && (col - 1.0).abs() < 1e-4,
                "{row} {col}"
            );
        }
    }

    #[test]
    fn rope_inverse_undoes_rope() {
        let r = Rope::plain(10000.0, 8);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.3 - 1.0).collect();
        let mut x = orig.clone();
        r.apply(&mut x, 16, 37, false);
        assert!(x[..8] == orig[..8] && x[8..] != orig[8..]);
        r.apply(&mut x, 16, 37, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }

    #[test]
    fn pool_ignores_masked_slots_and_sink_takes_mass() {
        let mut out = [0.0; 2];
        pool(
            &[9.0, 9.0, 1.0, 3.0],
            &[f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0],
            2,
            &mut out,
        );
        assert_eq!(out, [1.0, 3.0]);
        let k = [1.0f32, 0.0];
        attend(&[0.0, 0.0], &[&k], 1.0, 0.0, &mut out);
        assert!((out[0] - 0.5).abs() < 1e-6);
        assert_eq!(top_k(&[0.5, 2.0, 2.0, -1.0], 2), vec![1, 2]);
    }
}
