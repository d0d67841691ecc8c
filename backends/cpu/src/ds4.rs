//! The DeepSeek-V4 glue ops of ABI 1.1 on the CPU, over `moe_ds4_math` (the same f32
//! maths the engine's host glue runs), so the engine's device-resident forward runs here
//! too and CI checks it against the transformers fixtures. Positions come from the `pos`
//! tensor; caches (rings, rows) are the caller's buffers, as on the GPU.

use moe_ds4_math::{self as math, HcWeights, Rope};
use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::{
    buffers::{tensor_bytes, Buffers},
    formats,
    kernels::{args, matmul_slices, CpuKernel},
};

fn rope(inv: &[f32], pairs: usize, mscale: f32) -> Result<Rope, String> {
    Ok(Rope {
        inv_freq: inv
            .get(..pairs)
            .ok_or_else(|| format!("{pairs} rotated pairs, {} frequencies", inv.len()))?
            .to_vec(),
        mscale,
    })
}

fn positions(b: &Buffers, pos: &TensorRef, n: usize, op: &str) -> Result<Vec<usize>, String> {
    let p = b.i32s(pos)?;
    if p.len() < n || p[..n].iter().any(|&v| v < 0) {
        return Err(format!("{op}: {} positions for {n} tokens", p.len()));
    }
    Ok(p[..n].iter().map(|&v| v as usize).collect())
}

fn same(a: &TensorRef, b: &TensorRef) -> bool {
    a.buffer == b.buffer && a.offset == b.offset
}

inventory::submit! { CpuKernel { op: ops::NORM_ROPE, name: "ds4_norm_rope", run: norm_rope } }
fn norm_rope(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [x, w, inv, pos, out] = args::<5>(a, "norm_rope")?;
    let d = x.dims[0] as usize;
    let rows = (x.numel() as usize) / d.max(1);
    let n = (x.dims[2] * x.dims[3]) as usize;
    let (norm, pairs, inverse) = (p.i[0], p.i[1].max(0) as usize, p.i[2] != 0);
    if d == 0 || !d.is_multiple_of(2) || 2 * pairs > d || !(0..=2).contains(&norm) {
        return Err(format!(
            "norm_rope: row of {d} with {pairs} rotated pairs, norm mode {norm}"
        ));
    }
    let o = b.f32s_mut(&out)?;
    if o.len() != rows * d {
        return Err(format!(
            "norm_rope: output of {} values for {}",
            o.len(),
            rows * d
        ));
    }
    if !same(&x, &out) {
        o.copy_from_slice(b.f32s(&x)?);
    }
    let wv = if norm == 2 {
        Some(&b.f32s(&w)?[..d])
    } else {
        None
    };
    let r = rope(b.f32s(&inv)?, pairs, p.f[1])?;
    let pos = if pairs > 0 {
        positions(b, &pos, n, "norm_rope")?
    } else {
        vec![0; n]
    };
    let heads = rows / n.max(1);
    for (i, row) in o.chunks_exact_mut(d).enumerate() {
        if norm > 0 {
            math::rms_norm(row, d, wv, p.f[0]);
        }
        if pairs > 0 {
            r.apply(row, d, pos[i / heads.max(1)] as u32, inverse);
        }
    }
    Ok("ds4_norm_rope")
}

inventory::submit! { CpuKernel { op: ops::HC_PRE, name: "ds4_hc_pre", run: hc_pre } }
fn hc_pre(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [s, mix, scale, base, norm_w, out, wts] = args::<7>(a, "hc_pre")?;
    let (d, hc, n) = (
        s.dims[0] as usize,
        s.dims[1] as usize,
        (s.dims[2] * s.dims[3]) as usize,
    );
    let head = p.i[1] != 0;
    let nm = if head { hc } else { 2 * hc + hc * hc };
    let (sv, mv, sc, bs, nw) = (
        b.f32s(&s)?,
        b.f32s(&mix)?,
        b.f32s(&scale)?,
        b.f32s(&base)?,
        b.f32s(&norm_w)?,
    );
    let (ov, wv) = (b.f32s_mut(&out)?, b.f32s_mut(&wts)?);
    if mv.len() < nm * n
        || bs.len() < nm
        || sc.len() < if head { 1 } else { 3 }
        || nw.len() < d
        || ov.len() < d * n
        || wv.len() < nm * n
        || sv.len() < hc * d * n
    {
        return Err(format!(
            "hc_pre: tensors too small for {hc} streams of {d} x {n} tokens"
        ));
    }
    let (eps, hc_eps) = (p.f[0], p.f[1]);
    for t in 0..n {
        let st = &sv[t * hc * d..(t + 1) * hc * d];
        // The mixes were projected from the raw streams: apply their RMS factor here.
        let r = 1.0 / (st.iter().map(|v| v * v).sum::<f32>() / (hc * d) as f32 + eps).sqrt();
        let m: Vec<f32> = mv[t * nm..(t + 1) * nm].iter().map(|v| v * r).collect();
        let wt = &mut wv[t * nm..(t + 1) * nm];
        let pre = if head {
            for i in 0..hc {
                wt[i] = math::sigmoid(m[i] * sc[0] + bs[i]) + hc_eps;
            }
            wt[..hc].to_vec()
        } else {
            let w = math::hc_weights(&m, sc, bs, hc, p.i[0].max(0) as usize, hc_eps);
            wt[..hc].copy_from_slice(&w.pre);
            wt[hc..2 * hc].copy_from_slice(&w.post);
            wt[2 * hc..].copy_from_slice(&w.comb);
            w.pre
        };
        let x = &mut ov[t * d..(t + 1) * d];
        math::hc_collapse(st, &pre, d, x);
        math::rms_norm(x, d, Some(&nw[..d]), eps);
    }
    Ok("ds4_hc_pre")
}

inventory::submit! { CpuKernel { op: ops::HC_POST, name: "ds4_hc_post", run: hc_post } }
fn hc_post(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [s, block, wts] = args::<3>(a, "hc_post")?;
    let (d, hc, n) = (
        s.dims[0] as usize,
        s.dims[1] as usize,
        (s.dims[2] * s.dims[3]) as usize,
    );
    let nm = 2 * hc + hc * hc;
    let (bv, wv, sv) = (b.f32s(&block)?, b.f32s(&wts)?, b.f32s_mut(&s)?);
    if bv.len() < d * n || wv.len() < nm * n || sv.len() < hc * d * n {
        return Err(format!(
            "hc_post: tensors too small for {hc} streams of {d} x {n} tokens"
        ));
    }
    for t in 0..n {
        let w = &wv[t * nm..(t + 1) * nm];
        let hw = HcWeights {
            pre: w[..hc].to_vec(),
            post: w[hc..2 * hc].to_vec(),
            comb: w[2 * hc..].to_vec(),
        };
        math::hc_expand(
            &mut sv[t * hc * d..(t + 1) * hc * d],
            &bv[t * d..(t + 1) * d],
            &hw,
            d,
        );
    }
    Ok("ds4_hc_post")
}

inventory::submit! { CpuKernel { op: ops::COMPRESS, name: "ds4_compress", run: compress } }
fn compress(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [kv, gate, pos, ape, norm_w, inv, ring_kv, ring_g, rows] = args::<9>(a, "compress")?;
    let (ratio, overlap, pairs) = (p.i[0].max(0) as usize, p.i[1] != 0, p.i[2].max(0) as usize);
    let dim = rows.dims[0] as usize;
    let width = if overlap { 2 * dim } else { dim };
    let (kvv, gv) = (b.f32s(&kv)?, b.f32s(&gate)?);
    let n = kvv.len() / width.max(1);
    let (apev, nv) = (b.f32s(&ape)?, b.f32s(&norm_w)?);
    let (rk, rg, rv) = (
        b.f32s_mut(&ring_kv)?,
        b.f32s_mut(&ring_g)?,
        b.f32s_mut(&rows)?,
    );
    let ring = 2 * ratio;
    if ratio == 0
        || dim == 0
        || gv.len() < n * width
        || apev.len() < ratio * width
        || nv.len() < dim
        || rk.len() < ring * width
        || rg.len() < ring * width
    {
        return Err(format!(
            "compress: ratio {ratio}, rows of {dim}, inputs of {width} x {n}"
        ));
    }
    let r = rope(b.f32s(&inv)?, pairs, p.f[1])?;
    let pos = positions(b, &pos, n, "compress")?;
    let p0 = pos.first().copied().unwrap_or(0);
    let cap = rv.len() / dim;
    // Projected input of position q, column col: this chunk's, or the ring's.
    let at = |src: &[f32], rng: &[f32], q: usize, col: usize| {
        if q >= p0 {
            src[(q - p0) * width + col]
        } else {
            rng[(q % ring) * width + col]
        }
    };
    for w in p0 / ratio..(p0 + n) / ratio {
        if w >= cap {
            return Err(format!("compress: row {w} outside the {cap} rows"));
        }
        let mut row = vec![0.0; dim];
        if overlap {
            // The previous window's first halves (masked for the first), then this one's second.
            let mut skv = vec![0.0; 2 * ratio * dim];
            let mut sg = vec![f32::NEG_INFINITY; 2 * ratio * dim];
            for j in 0..ratio {
                for c in 0..dim {
                    if w > 0 {
                        let q = (w - 1) * ratio + j;
                        skv[j * dim + c] = at(kvv, rk, q, c);
                        sg[j * dim + c] = at(gv, rg, q, c) + apev[j * width + c];
                    }
                    let q = w * ratio + j;
                    skv[(ratio + j) * dim + c] = at(kvv, rk, q, dim + c);
                    sg[(ratio + j) * dim + c] = at(gv, rg, q, dim + c) + apev[j * width + dim + c];
                }
            }
            math::pool(&skv, &sg, dim, &mut row);
        } else {
            let mut skv = vec![0.0; ratio * dim];
            let mut sg = vec![0.0; ratio * dim];
            for j in 0..ratio {
                for c in 0..dim {
                    let q = w * ratio + j;
                    skv[j * dim + c] = at(kvv, rk, q, c);
                    sg[j * dim + c] = at(gv, rg, q, c) + apev[j * width + c];
                }
            }
            math::pool(&skv, &sg, dim, &mut row);
        }
        math::rms_norm(&mut row, dim, Some(&nv[..dim]), p.f[0]);
        r.apply(&mut row, dim, (w * ratio) as u32, false);
        rv[w * dim..(w + 1) * dim].copy_from_slice(&row);
    }
    for t in n.saturating_sub(ring)..n {
        let slot = (p0 + t) % ring;
        rk[slot * width..(slot + 1) * width].copy_from_slice(&kvv[t * width..(t + 1) * width]);
        rg[slot * width..(slot + 1) * width].copy_from_slice(&gv[t * width..(t + 1) * width]);
    }
    Ok("ds4_compress")
}

inventory::submit! { CpuKernel { op: ops::INDEX_SCORES, name: "ds4_index_scores", run: index_scores } }
fn index_scores(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [q, w, rows, pos, out] = args::<5>(a, "index_scores")?;
    let (id, ih, n) = (
        q.dims[0] as usize,
        q.dims[1] as usize,
        (q.dims[2] * q.dims[3]) as usize,
    );
    let ratio = p.i[0].max(0) as usize;
    let (qv, wv, rv) = (b.f32s(&q)?, b.f32s(&w)?, b.f32s(&rows)?);
    let cap = rv.len() / id.max(1);
    let ov = b.f32s_mut(&out)?;
    if ratio == 0 || id == 0 || wv.len() < ih * n || ov.len() < cap * n || qv.len() < id * ih * n {
        return Err(format!(
            "index_scores: {ih} heads x {id}, ratio {ratio}, {cap} rows"
        ));
    }
    let pos = positions(b, &pos, n, "index_scores")?;
    let (sm, ws) = (p.f[0], p.f[1]);
    for t in 0..n {
        let visible = ((pos[t] + 1) / ratio).min(cap);
        for s in 0..visible {
            let k = &rv[s * id..(s + 1) * id];
            ov[t * cap + s] = (0..ih)
                .map(|h| {
                    let qh = &qv[(t * ih + h) * id..(t * ih + h + 1) * id];
                    let dot: f32 = qh.iter().zip(k).map(|(a, b)| a * b).sum();
                    dot.max(0.0) * sm * (wv[t * ih + h] * ws)
                })
                .sum();
        }
    }
    Ok("ds4_index_scores")
}

inventory::submit! { CpuKernel { op: ops::TOPK_ROWS, name: "ds4_topk_rows", run: topk_rows } }
fn topk_rows(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [scores, pos, sel] = args::<3>(a, "topk_rows")?;
    let cap = scores.dims[0] as usize;
    let (k, ratio) = (sel.dims[0] as usize, p.i[0].max(0) as usize);
    let sv = b.f32s(&scores)?;
    let n = sv.len() / cap.max(1);
    if ratio == 0 || k == 0 {
        return Err(format!("topk_rows: ratio {ratio}, {k} per token"));
    }
    let pos = positions(b, &pos, n, "topk_rows")?;
    let mut out = vec![-1i32; k * n];
    for t in 0..n {
        let visible = ((pos[t] + 1) / ratio).min(cap);
        for (j, s) in math::top_k(&sv[t * cap..t * cap + visible], k.min(visible))
            .into_iter()
            .enumerate()
        {
            out[t * k + j] = s as i32;
        }
    }
    write_i32(b, &sel, &out)?;
    Ok("ds4_topk_rows")
}

/// Writes i32 values into an I32 tensor.
fn write_i32(b: &Buffers, t: &TensorRef, v: &[i32]) -> Result<(), String> {
    if t.type_id != types::I32 || (t.numel() as usize) < v.len() {
        return Err(format!(
            "expected an I32 tensor of at least {} values",
            v.len()
        ));
    }
    let p = b.raw(t, v.len() * 4)?;
    // SAFETY: bounds checked by `raw`; the op's outputs overlap no input (run_op).
    unsafe { std::ptr::copy_nonoverlapping(v.as_ptr() as *const u8, p, v.len() * 4) };
    Ok(())
}

inventory::submit! { CpuKernel { op: ops::SPARSE_ATTENTION, name: "ds4_sparse_attention", run: sparse_attention } }
fn sparse_attention(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [q, kv, ring, rows, sel, sinks, pos, out] = args::<8>(a, "sparse_attention")?;
    let (hd, heads, n) = (
        q.dims[0] as usize,
        q.dims[1] as usize,
        (q.dims[2] * q.dims[3]) as usize,
    );
    let (ratio, mode) = (p.i[0].max(0) as usize, p.i[1]);
    let (qv, kvv, sk) = (b.f32s(&q)?, b.f32s(&kv)?, b.f32s(&sinks)?);
    let rv: &[f32] = if mode > 0 { b.f32s(&rows)? } else { &[] };
    let sel: Vec<i32> = if mode == 2 {
        b.i32s(&sel)?.to_vec()
    } else {
        Vec::new()
    };
    let k_sel = if mode == 2 { sel.len() / n.max(1) } else { 0 };
    let cap = rv.len() / hd.max(1);
    let ringv = b.f32s_mut(&ring)?;
    let window = ringv.len() / hd.max(1);
    if hd == 0
        || window == 0
        || !(0..=2).contains(&mode)
        || (mode > 0 && ratio == 0)
        || kvv.len() < hd * n
        || sk.len() < heads
        || qv.len() < hd * heads * n
    {
        return Err(format!(
            "sparse_attention: heads of {hd}, window {window}, mode {mode}, ratio {ratio}"
        ));
    }
    let pos = positions(b, &pos, n, "sparse_attention")?;
    let p0 = pos.first().copied().unwrap_or(0);
    let ov = b.f32s_mut(&out)?;
    for t in 0..n {
        let pt = pos[t];
        let row_at = |qp: usize| -> &[f32] {
            if qp >= p0 {
                &kvv[(qp - p0) * hd..(qp - p0 + 1) * hd]
            } else {
                &ringv[(qp % window) * hd..(qp % window + 1) * hd]
            }
        };
        let mut keys: Vec<&[f32]> = ((pt + 1).saturating_sub(window)..=pt).map(row_at).collect();
        match mode {
            1 => keys.extend((0..((pt + 1) / ratio).min(cap)).map(|s| &rv[s * hd..(s + 1) * hd])),
            2 => keys.extend(
                sel[t * k_sel..(t + 1) * k_sel]
                    .iter()
                    .filter(|&&s| s >= 0 && (s as usize) < cap)
                    .map(|&s| &rv[s as usize * hd..(s as usize + 1) * hd]),
            ),
            _ => {}
        }
        for (h, &sink) in sk[..heads].iter().enumerate() {
            let o = (t * heads + h) * hd;
            math::attend(&qv[o..o + hd], &keys, p.f[0], sink, &mut ov[o..o + hd]);
        }
    }
    for t in n.saturating_sub(window)..n {
        let slot = (p0 + t) % window;
        ringv[slot * hd..(slot + 1) * hd].copy_from_slice(&kvv[t * hd..(t + 1) * hd]);
    }
    Ok("ds4_sparse_attention")
}

inventory::submit! { CpuKernel { op: ops::ROUTER, name: "ds4_router", run: router } }
fn router(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [logits, bias, table, tokens, ids, w] = args::<6>(a, "router")?;
    let e = logits.dims[0] as usize;
    let (k, mode, gating) = (ids.dims[0] as usize, p.i[2], p.i[0]);
    let lv = b.f32s(&logits)?;
    let n = lv.len() / e.max(1);
    if e == 0 || k == 0 || k > e || !(0..=2).contains(&mode) || ![2, 4].contains(&gating) {
        return Err(format!(
            "router: {k} of {e} experts, mode {mode}, gating {gating}"
        ));
    }
    let bv: &[f32] = if mode == 1 { b.f32s(&bias)? } else { &[] };
    let (tab, toks): (&[i32], &[i32]) = if mode == 2 {
        (b.i32s(&table)?, b.i32s(&tokens)?)
    } else {
        (&[], &[])
    };
    let mut out_ids = vec![0i32; k * n];
    let wv = b.f32s_mut(&w)?;
    if wv.len() < k * n || (mode == 1 && bv.len() < e) || (mode == 2 && toks.len() < n) {
        return Err("router: tensors too small".into());
    }
    for t in 0..n {
        let scores: Vec<f32> = lv[t * e..(t + 1) * e]
            .iter()
            .map(|&v| {
                if gating == 2 {
                    math::sigmoid(v)
                } else {
                    math::softplus(v).sqrt()
                }
            })
            .collect();
        let chosen: Vec<usize> = match mode {
            2 => {
                let tok = toks[t].max(0) as usize;
                let row = tab
                    .get(tok * k..(tok + 1) * k)
                    .ok_or_else(|| format!("router: token {tok} outside the hash table"))?;
                row.iter()
                    .map(|&x| (x.max(0) as usize).min(e - 1))
                    .collect()
            }
            1 => math::top_k(
                &scores
                    .iter()
                    .zip(bv)
                    .map(|(s, b)| s + b)
                    .collect::<Vec<_>>(),
                k,
            ),
            _ => math::top_k(&scores, k),
        };
        let mut ws: Vec<f32> = chosen.iter().map(|&x| scores[x]).collect();
        if p.i[1] != 0 {
            let s: f32 = ws.iter().sum::<f32>() + 1e-20;
            ws.iter_mut().for_each(|v| *v /= s);
        }
        for (j, (&x, v)) in chosen.iter().zip(ws).enumerate() {
            out_ids[t * k + j] = x as i32;
            wv[t * k + j] = v * p.f[0];
        }
    }
    write_i32(b, &ids, &out_ids)?;
    Ok("ds4_router")
}

inventory::submit! { CpuKernel { op: ops::MOE_COMBINE, name: "ds4_moe_combine", run: moe_combine } }
fn moe_combine(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let (y, w, out, shared) = moe_plugin_api::moe_combine_args(a)?;
    let (d, k, n) = (
        y.dims[0] as usize,
        y.dims[1] as usize,
        (y.dims[2] * y.dims[3]) as usize,
    );
    let (yv, wv) = (b.f32s(&y)?, b.f32s(&w)?);
    let sv = shared.map(|s| b.f32s(&s)).transpose()?;
    let ov = b.f32s_mut(&out)?;
    if yv.len() < d * k * n
        || wv.len() < k * n
        || ov.len() < d * n
        || sv.is_some_and(|s| s.len() < d * n)
    {
        return Err("moe_combine: tensors too small".into());
    }
    for t in 0..n {
        let o = &mut ov[t * d..(t + 1) * d];
        o.iter_mut().for_each(|v| *v = 0.0);
        for j in 0..k {
            let wt = wv[t * k + j];
            o.iter_mut()
                .zip(&yv[(t * k + j) * d..(t * k + j + 1) * d])
                .for_each(|(o, v)| *o += wt * v);
        }
        if let Some(s) = sv {
            o.iter_mut()
                .zip(&s[t * d..(t + 1) * d])
                .for_each(|(o, v)| *o += v);
        }
    }
    Ok("ds4_moe_combine")
}

inventory::submit! { CpuKernel { op: ops::TRANSPOSE12, name: "transpose12", run: transpose12 } }
fn transpose12(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [x, out] = args::<2>(a, "transpose12")?;
    let (d0, d1, d2) = (
        x.dims[0] as usize,
        x.dims[1] as usize,
        (x.dims[2] * x.dims[3]) as usize,
    );
    let (xv, ov) = (b.f32s(&x)?, b.f32s_mut(&out)?);
    if ov.len() < xv.len() {
        return Err("transpose12: output too small".into());
    }
    for z in 0..d2 {
        for y in 0..d1 {
            let src = d0 * (y + d1 * z);
            let dst = d0 * (z + d2 * y);
            ov[dst..dst + d0].copy_from_slice(&xv[src..src + d0]);
        }
    }
    Ok("transpose12")
}

inventory::submit! { CpuKernel { op: ops::MATMUL_ID, name: "matmul_id", run: matmul_id } }
/// Grouped product: the pairs of each expert gathered into one MATMUL of its weights.
fn matmul_id(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [w, x, ids, out] = args::<4>(a, "matmul_id")?;
    let (k, m, experts) = (
        w.dims[0] as usize,
        w.dims[1] as usize,
        (w.dims[2] * w.dims[3]) as usize,
    );
    let (slots, tok) = (
        ids.dims[0] as usize,
        (ids.dims[1] * ids.dims[2] * ids.dims[3]) as usize,
    );
    let pairs = slots * tok;
    let (xv, idv) = (b.f32s(&x)?, b.i32s(&ids)?.to_vec());
    let per_pair = if xv.len() == k * tok {
        false
    } else if xv.len() == k * pairs {
        true
    } else {
        return Err(format!(
            "matmul_id: input of {} values is neither {tok} nor {pairs} columns of {k}",
            xv.len()
        ));
    };
    let wb = b.bytes(&w, tensor_bytes(&w, formats().get(&w.type_id))?)?;
    let per_expert = wb.len() / experts.max(1);
    let ov = b.f32s_mut(&out)?;
    if ov.len() < m * pairs {
        return Err(format!(
            "matmul_id: output holds {}, expected {m} x {pairs}",
            ov.len()
        ));
    }
    let mut path = "matmul_id";
    for e in 0..experts {
        let mine: Vec<usize> = (0..pairs).filter(|&p| idv[p] == e as i32).collect();
        if mine.is_empty() {
            continue;
        }
        let xs: Vec<f32> = mine
            .iter()
            .flat_map(|&p| {
                let c = if per_pair { p } else { p / slots };
                xv[c * k..(c + 1) * k].iter().copied()
            })
            .collect();
        let mut ys = vec![0.0; m * mine.len()];
        path = matmul_slices(
            &wb[e * per_expert..(e + 1) * per_expert],
            w.type_id,
            w.variant,
            k,
            m,
            &xs,
            &mut ys,
        )?;
        for (i, &p) in mine.iter().enumerate() {
            ov[p * m..(p + 1) * m].copy_from_slice(&ys[i * m..(i + 1) * m]);
        }
    }
    for p in (0..pairs).filter(|&p| idv[p] < 0 || idv[p] as usize >= experts) {
        ov[p * m..(p + 1) * m].iter_mut().for_each(|v| *v = 0.0);
    }
    Ok(path)
}
