//! The CPU kernels, one per op code, registered with `inventory` so adding an op is
//! adding a file-local `submit!`; the dispatcher sorts them by op code at first use.

use moe_plugin_api::{into_result, ops, types, BlockQ8_1, OpParams, TensorRef};

use crate::{
    buffers::{tensor_bytes, Buffers},
    formats, par_for, settings, ActivationMode,
};

/// One kernel: runs an op and returns the name of the code path it took (counted).
pub struct CpuKernel {
    pub op: u32,
    pub name: &'static str,
    pub run: fn(&Buffers, &OpParams, &[TensorRef]) -> Result<&'static str, String>,
}

inventory::collect!(CpuKernel);

/// The kernel table, sorted by op code (inventory's order differs between builds).
pub fn table() -> &'static [&'static CpuKernel] {
    static TABLE: std::sync::OnceLock<Vec<&'static CpuKernel>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut v: Vec<&'static CpuKernel> = inventory::iter::<CpuKernel>.into_iter().collect();
        v.sort_by_key(|k| k.op);
        v
    })
}

pub(crate) fn args<const N: usize>(a: &[TensorRef], op: &str) -> Result<[TensorRef; N], String> {
    a.try_into()
        .map_err(|_| format!("{op}: expected {N} tensor arguments, got {}", a.len()))
}

pub(crate) fn same_len(op: &str, a: usize, b: usize) -> Result<(), String> {
    if a != b {
        return Err(format!("{op}: shape mismatch ({a} vs {b} values)"));
    }
    Ok(())
}

inventory::submit! { CpuKernel { op: ops::GET_ROWS, name: "get_rows", run: get_rows } }
fn get_rows(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [table, ids, out] = args::<3>(a, "get_rows")?;
    let ids = b.i32s(&ids)?;
    let out = b.f32s_mut(&out)?;
    let (cols, rows) = (table.dims[0] as usize, table.dims[1] as usize);
    same_len("get_rows", out.len(), cols * ids.len())?;
    let fmts = formats();
    let fmt = fmts.get(&table.type_id);
    let all = b.bytes(&table, tensor_bytes(&table, fmt)?)?;
    let row_bytes = all.len() / rows.max(1);
    for (i, &id) in ids.iter().enumerate() {
        let r = usize::try_from(id)
            .ok()
            .filter(|&r| r < rows)
            .ok_or_else(|| format!("get_rows: row id {id} outside 0..{rows}"))?;
        let src = &all[r * row_bytes..(r + 1) * row_bytes];
        let dst = &mut out[i * cols..(i + 1) * cols];
        match fmt {
            _ if table.type_id == types::F32 => {
                for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            Some(f) => into_result((f.decode)(table.variant, src.into(), dst.into()))?,
            None => return Err(format!("get_rows: no format for type {}", table.type_id)),
        }
    }
    Ok("get_rows")
}

fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise the reduction.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

inventory::submit! { CpuKernel { op: ops::MATMUL, name: "matmul", run: matmul } }
fn matmul(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [w, x, out] = args::<3>(a, "matmul")?;
    let (k, m) = (w.dims[0] as usize, w.dims[1] as usize);
    let xs = b.f32s(&x)?;
    let out = b.f32s_mut(&out)?;
    if k == 0 || xs.len() % k != 0 {
        return Err(format!(
            "matmul: input of {} values is not columns of {k}",
            xs.len()
        ));
    }
    let n = xs.len() / k;
    same_len("matmul", out.len(), m * n)?;
    let fmts = formats();
    let wb = b.bytes(&w, tensor_bytes(&w, fmts.get(&w.type_id))?)?;
    matmul_slices(wb, w.type_id, w.variant, k, m, xs, out)
}

/// out[c * m + r] = W[r] . x[c] for weights `wb` ([k, m] of type `ty`) and n = xs / k
/// columns: MATMUL on slices (MATMUL_ID runs it per expert).
pub(crate) fn matmul_slices(
    wb: &[u8],
    ty: u32,
    variant: u64,
    k: usize,
    m: usize,
    xs: &[f32],
    out: &mut [f32],
) -> Result<&'static str, String> {
    let n = xs.len() / k.max(1);
    let fmts = formats();
    let fmt = fmts.get(&ty);
    let row_bytes = wb.len() / m.max(1);
    let is_f32 = ty == types::F32;
    let f = match fmt {
        Some(f) => Some(f),
        None if is_f32 => None,
        None => return Err(format!("matmul: no quant format for type {ty}")),
    };
    let use_q8 = !is_f32 && settings().activation == ActivationMode::Q8 && k.is_multiple_of(32);

    let mut act = Vec::new();
    if use_q8 {
        act.resize(n * k / 32, BlockQ8_1::default());
        let act_addr = act.as_mut_ptr() as usize;
        par_for(n, 64, |cols| {
            for c in cols {
                // SAFETY: each column owns its own k/32 blocks of `act`.
                let dst = unsafe { sub_mut::<BlockQ8_1>(act_addr, c * k / 32, k / 32) };
                for (d, x) in dst.iter_mut().zip(xs[c * k..(c + 1) * k].chunks_exact(32)) {
                    *d = BlockQ8_1::quantize(x);
                }
            }
            Ok(())
        })?;
    }

    // Tiles of (rows x columns): a tile's weights and activations stay in cache while
    // every pair in it is computed; enough tiles to keep the pool busy.
    let col_tile = if n <= 8 { n } else { 32 };
    let n_ct = n.div_ceil(col_tile);
    let threads = crate::threads().max(1);
    let row_tile = (m * n_ct / (threads * 8)).clamp(1, 64).min(m.max(1));
    let n_rt = m.div_ceil(row_tile);
    let macs = (m * n * k) as f64;
    let grain = if macs < 2e5 { n_rt * n_ct } else { 1 };
    let out_addr = out.as_mut_ptr() as usize;
    par_for(n_rt * n_ct, grain, |tiles| {
        let mut tmp = Vec::new();
        let mut deq = Vec::new();
        for tile in tiles {
            let (r0, c0) = ((tile / n_ct) * row_tile, (tile % n_ct) * col_tile);
            let (rows, cols) = (row_tile.min(m - r0), col_tile.min(n - c0));
            tmp.clear();
            tmp.resize(rows * cols, 0f32);
            let src = &wb[r0 * row_bytes..(r0 + rows) * row_bytes];
            if use_q8 {
                let f = f.expect("q8 path has a format");
                let a = &act[c0 * k / 32..(c0 + cols) * k / 32];
                into_result((f.dot_q8)(
                    variant,
                    src.into(),
                    k as u64,
                    a.into(),
                    tmp.as_mut_slice().into(),
                ))?;
            } else {
                let wrows: &[f32] = match f {
                    None => bytemuck_f32(src)?,
                    Some(f) => {
                        deq.resize(rows * k, 0f32);
                        into_result((f.decode)(variant, src.into(), deq.as_mut_slice().into()))?;
                        &deq
                    }
                };
                for c in 0..cols {
                    let xc = &xs[(c0 + c) * k..(c0 + c + 1) * k];
                    for r in 0..rows {
                        tmp[c * rows + r] = dot_f32(&wrows[r * k..(r + 1) * k], xc);
                    }
                }
            }
            for c in 0..cols {
                // SAFETY: this tile owns rows r0..r0+rows of columns c0..c0+cols.
                let dst = unsafe { sub_mut::<f32>(out_addr, (c0 + c) * m + r0, rows) };
                dst.copy_from_slice(&tmp[c * rows..(c + 1) * rows]);
            }
        }
        Ok(())
    })?;
    Ok(match (use_q8, is_f32) {
        (true, _) => "matmul_q8_dot",
        (false, true) => "matmul_f32",
        (false, false) => "matmul_decode_f32",
    })
}

/// A mutable view of `len` items starting at item `start` of the array at `addr`.
///
/// # Safety
/// The range must lie inside one live allocation that no one else touches meanwhile.
pub(crate) unsafe fn sub_mut<'a, T>(addr: usize, start: usize, len: usize) -> &'a mut [T] {
    std::slice::from_raw_parts_mut((addr as *mut T).add(start), len)
}

fn bytemuck_f32(b: &[u8]) -> Result<&[f32], String> {
    if !(b.as_ptr() as usize).is_multiple_of(4) || !b.len().is_multiple_of(4) {
        return Err("f32 weights misaligned".into());
    }
    // SAFETY: alignment and length checked; every bit pattern is a valid f32.
    Ok(unsafe { std::slice::from_raw_parts(b.as_ptr() as *const f32, b.len() / 4) })
}

inventory::submit! { CpuKernel { op: ops::RMS_NORM, name: "rms_norm", run: rms_norm } }
fn rms_norm(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [x, w, out] = args::<3>(a, "rms_norm")?;
    let d = x.dims[0] as usize;
    let (xs, ws, out) = (b.f32s(&x)?, b.f32s(&w)?, b.f32s_mut(&out)?);
    same_len("rms_norm", ws.len(), d)?;
    same_len("rms_norm", out.len(), xs.len())?;
    let eps = p.f[0];
    let out_addr = out.as_mut_ptr() as usize;
    par_for(xs.len() / d.max(1), (1 << 15) / d.max(1), |rows| {
        for r in rows {
            let x = &xs[r * d..(r + 1) * d];
            // SAFETY: row r of the output belongs to this task alone.
            let o = unsafe { sub_mut::<f32>(out_addr, r * d, d) };
            let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let s = 1.0 / (ms + eps).sqrt();
            for ((o, x), w) in o.iter_mut().zip(x).zip(ws) {
                *o = x * s * w;
            }
        }
        Ok(())
    })?;
    Ok("rms_norm")
}

inventory::submit! { CpuKernel { op: ops::ROPE, name: "rope", run: rope } }
fn rope(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [x, pos, out] = args::<3>(a, "rope")?;
    let (hd, heads) = (x.dims[0] as usize, x.dims[1] as usize);
    let (xs, ps, out) = (b.f32s(&x)?, b.i32s(&pos)?, b.f32s_mut(&out)?);
    same_len("rope", out.len(), xs.len())?;
    same_len("rope", ps.len() * hd * heads, xs.len())?;
    let (base, scale) = (p.f[0], p.f[1]);
    let n_rot = (p.i[0] as usize).min(hd);
    let neox = p.i[1] == 2;
    if n_rot % 2 != 0 {
        return Err(format!("rope: rotated dims {n_rot} must be even"));
    }
    let row = hd * heads;
    let out_addr = out.as_mut_ptr() as usize;
    par_for(ps.len(), (1 << 14) / row.max(1), |toks| {
        for t in toks {
            let (x, pos) = (&xs[t * row..(t + 1) * row], ps[t]);
            // SAFETY: token t's output row belongs to this task alone.
            let o = unsafe { sub_mut::<f32>(out_addr, t * row, row) };
            o.copy_from_slice(x);
            // The angles depend on the position only: compute them once per token.
            let rot: Vec<(f32, f32)> = (0..n_rot / 2)
                .map(|i| (pos as f32 * scale * base.powf(-2.0 * i as f32 / n_rot as f32)).sin_cos())
                .collect();
            for h in 0..heads {
                let (o, x) = (&mut o[h * hd..(h + 1) * hd], &x[h * hd..(h + 1) * hd]);
                for (i, &(sin, cos)) in rot.iter().enumerate() {
                    let (a, bb) = if neox {
                        (i, i + n_rot / 2)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    o[a] = x[a] * cos - x[bb] * sin;
                    o[bb] = x[a] * sin + x[bb] * cos;
                }
            }
        }
        Ok(())
    })?;
    Ok("rope")
}

/// Cache geometry [hd, kv_heads, ctx, slots] and a (slot, pos) -> row offset check.
pub(crate) fn cache_row(cache: &TensorRef, slot: i32, pos: i32) -> Result<usize, String> {
    let (row, ctx, slots) = (
        (cache.dims[0] * cache.dims[1]) as usize,
        cache.dims[2] as usize,
        cache.dims[3] as usize,
    );
    let (s, p) = (slot as usize, pos as usize);
    if slot < 0 || pos < 0 || s >= slots || p >= ctx {
        return Err(format!(
            "slot {slot} / position {pos} outside a cache of {slots} x {ctx}"
        ));
    }
    Ok((s * ctx + p) * row)
}

inventory::submit! { CpuKernel { op: ops::KV_STORE, name: "kv_store", run: kv_store } }
fn kv_store(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [src, cache, slot, pos] = args::<4>(a, "kv_store")?;
    let row = (cache.dims[0] * cache.dims[1]) as usize;
    let (xs, cs, ss, ps) = (
        b.f32s(&src)?,
        b.f32s_mut(&cache)?,
        b.i32s(&slot)?,
        b.i32s(&pos)?,
    );
    same_len("kv_store", xs.len(), row * ss.len())?;
    same_len("kv_store", ss.len(), ps.len())?;
    for (t, (&s, &p)) in ss.iter().zip(ps).enumerate() {
        let at = cache_row(&cache, s, p)?;
        cs[at..at + row].copy_from_slice(&xs[t * row..(t + 1) * row]);
    }
    Ok("kv_store")
}

inventory::submit! { CpuKernel { op: ops::SWIGLU, name: "swiglu", run: swiglu } }
fn swiglu(b: &Buffers, p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [g, u, out] = args::<3>(a, "swiglu")?;
    // f[0] = lim > 0: gate clamped above at lim, up to [-lim, lim] (DeepSeek-V4).
    let lim = p.f[0];
    let (gs, us, out) = (b.f32s(&g)?, b.f32s(&u)?, b.f32s_mut(&out)?);
    same_len("swiglu", gs.len(), us.len())?;
    same_len("swiglu", out.len(), gs.len())?;
    let out_addr = out.as_mut_ptr() as usize;
    par_for(gs.len(), 1 << 15, |r| {
        // SAFETY: the range r of the output belongs to this task alone.
        let o = unsafe { sub_mut::<f32>(out_addr, r.start, r.len()) };
        for ((o, &g), &u) in o.iter_mut().zip(&gs[r.clone()]).zip(&us[r]) {
            let (g, u) = if lim > 0.0 {
                (g.min(lim), u.clamp(-lim, lim))
            } else {
                (g, u)
            };
            *o = g / (1.0 + (-g).exp()) * u;
        }
        Ok(())
    })?;
    Ok("swiglu")
}

inventory::submit! { CpuKernel { op: ops::ADD, name: "add", run: add } }
fn add(b: &Buffers, _p: &OpParams, a: &[TensorRef]) -> Result<&'static str, String> {
    let [x, y, out] = args::<3>(a, "add")?;
    let (xs, ys, out) = (b.f32s(&x)?, b.f32s(&y)?, b.f32s_mut(&out)?);
    same_len("add", xs.len(), ys.len())?;
    same_len("add", out.len(), xs.len())?;
    let out_addr = out.as_mut_ptr() as usize;
    par_for(xs.len(), 1 << 15, |r| {
        // SAFETY: the range r of the output belongs to this task alone.
        let o = unsafe { sub_mut::<f32>(out_addr, r.start, r.len()) };
        for ((o, x), y) in o.iter_mut().zip(&xs[r.clone()]).zip(&ys[r]) {
            *o = x + y;
        }
        Ok(())
    })?;
    Ok("add")
}
