//! The DeepSeek-V4 glue ops (`ops::NORM_ROPE` .. `ops::TRANSPOSE12`, SWIGLU with a
//! clamp, MATMUL_ID for the dense weight types): argument checks and launches of the
//! `kernels/gpu/ds4.cu` kernels. Shapes are innermost first, as in the ABI.

use moe_plugin_api::{ops, types, OpParams, TensorRef};

use crate::{
    kargs,
    ops::{
        dense_align, dense_parts, dense_row_bytes, dense_rows, expect, id_input, q8_decode,
        q8_rows, quantize, to_i32, Gpu, Launch, Q8_BYTES,
    },
};

/// Limits the kernels are written for (their shared-memory and register arrays).
pub const HC_MAX: u64 = 8;
pub const COMP_MAX_DIM: u64 = 1024;
pub const HEAD_MAX: u64 = 512;
/// `ds4_attention_heads`: heads a block, warps a block (DS4_ATH_HEADS, DS4_ATH_WARPS).
const ATT_HEADS_PER_BLOCK: u64 = 16;
const ATT_HEADS_WARPS: u32 = 8;
/// `ds4_attention_heads4`: heads a block (8 warps x DS4_ATH4_HPW).
const ATT_HEADS4_PER_BLOCK: u64 = 32;
/// `ds4_attention_tc`: heads a block, keys a tile, threads a block (DS4_ATC_HEADS,
/// DS4_ATC_KEYS, 32 * DS4_ATC_WARPS).
const ATT_TC_HEADS: u64 = 64;
const ATT_TC_KEYS: u64 = 16;
const ATT_TC_THREADS: u32 = 256;
/// `ds4_attention_grp`: heads a block, warps a block (DS4_ATG_HEADS, DS4_ATG_WARPS).
const ATT_GRP_HEADS: u64 = 4;
const ATT_GRP_WARPS: u32 = 8;
/// `ds4_attention_merge`'s most splits and threads (DS4_ATM_MAX_SPLITS, DS4_ATM_THREADS).
const ATT_MAX_SPLITS: u64 = 64;
const ATT_MERGE_THREADS: u32 = 512;
/// The split attention's partial sums stay within this much scratch (one token at 64
/// splits of 64 heads of 512: 8.4 MB); larger steps keep `ds4_attention`.
const ATT_SPLIT_MAX_BYTES: u64 = 16 << 20;
pub const IDX_Q_MAX: u64 = 8192;
pub const IDX_DIM_MAX: u64 = 256;
pub const TOPK_MAX: u64 = 16;
pub const ROUTER_MAX_EXPERTS: u64 = 1024;

/// Kernel arguments as 8-byte slots: the launch reads each parameter's own size from
/// its slot (little-endian), so i32 / f32 sit in the low half.
#[derive(Default)]
struct KArgs(Vec<u64>);

impl KArgs {
    fn p(mut self, v: u64) -> Self {
        self.0.push(v);
        self
    }
    fn i(mut self, v: i32) -> Self {
        self.0.push(v as u32 as u64);
        self
    }
    fn f(mut self, v: f32) -> Self {
        self.0.push(v.to_bits() as u64);
        self
    }
    /// `more`'s slots after these.
    fn extend(mut self, more: KArgs) -> Self {
        self.0.extend(more.0);
        self
    }
    /// # Safety
    /// The slots must match the kernel's parameters and point at valid memory.
    unsafe fn launch(
        self,
        gpu: &impl Gpu,
        name: &'static str,
        grid: (u64, u64, u64),
        block: u32,
    ) -> Result<(), String> {
        self.launch_smem(gpu, name, grid, block, 0)
    }

    /// [`KArgs::launch`] with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    /// As [`KArgs::launch`].
    unsafe fn launch_smem(
        mut self,
        gpu: &impl Gpu,
        name: &'static str,
        grid: (u64, u64, u64),
        block: u32,
        smem: u32,
    ) -> Result<(), String> {
        if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Ok(()); // nothing to do (an empty chunk)
        }
        // y and z are limited to 65535 blocks (CUDA and HIP); callers split longer chunks.
        let g = |v: u64, what: &str, max: u64| {
            u32::try_from(v)
                .ok()
                .filter(|&x| x as u64 <= max)
                .ok_or_else(|| format!("{name}: grid {what} = {v} is more than {max} blocks"))
        };
        let l = Launch {
            name,
            grid: (
                g(grid.0, "x", u32::MAX as u64)?,
                g(grid.1, "y", 65535)?,
                g(grid.2, "z", 65535)?,
            ),
            block,
        };
        let ptrs: Vec<*mut std::ffi::c_void> =
            self.0.iter_mut().map(|v| v as *mut u64 as *mut _).collect();
        gpu.launch_smem(l, smem, &ptrs)
    }
}

fn args<const N: usize>(a: &[TensorRef], op: &str) -> Result<[TensorRef; N], String> {
    a.try_into()
        .map_err(|_| format!("{op}: expected {N} tensor arguments, got {}", a.len()))
}

/// `t` is F32 (or `ty`) and holds at least `n` values.
fn holds(t: &TensorRef, ty: u32, n: u64, what: &str) -> Result<(), String> {
    expect(t, ty, what)?;
    if t.numel() < n {
        return Err(format!("{what}: {} values, need {n}", t.numel()));
    }
    Ok(())
}

fn f32p(gpu: &impl Gpu, t: &TensorRef) -> Result<u64, String> {
    gpu.ptr(t, 4)
}

/// Runs one of the DeepSeek-V4 glue ops; None when `op` is not one of them.
pub fn run(gpu: &impl Gpu, op: u32, p: &OpParams, a: &[TensorRef]) -> Option<Result<(), String>> {
    // SAFETY (all launches): every tensor is checked to hold what the kernel touches,
    // pointers come from `gpu.ptr` (range-checked), slots follow the kernel signatures.
    let r = unsafe {
        match op {
            ops::NORM_ROPE => norm_rope(gpu, p, a),
            ops::HC_PRE => hc_pre(gpu, p, a),
            ops::HC_POST => hc_post(gpu, a),
            ops::HC_SINKHORN => hc_sinkhorn(gpu, p, a),
            ops::COMPRESS => compress(gpu, p, a),
            ops::INDEX_SCORES => index_scores(gpu, p, a),
            ops::TOPK_ROWS => topk_rows(gpu, p, a),
            ops::SPARSE_ATTENTION => sparse_attention(gpu, p, a),
            ops::ROUTER => router(gpu, p, a),
            ops::SWIGLU => swiglu(gpu, p, a),
            ops::MOE_COMBINE => moe_combine(gpu, a),
            ops::TRANSPOSE12 => transpose12(gpu, a),
            _ => return None,
        }
    };
    Some(r)
}

unsafe fn norm_rope(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let [x, w, inv, pos, out] = args(a, "norm_rope")?;
    let (d, heads) = (x.dims[0], x.dims[1]);
    let n = x.dims[2] * x.dims[3];
    let (norm, pairs, inverse) = (p.i[0], p.i[1].max(0) as u64, p.i[2]);
    if !d.is_multiple_of(2) || 2 * pairs > d || !(0..=2).contains(&norm) {
        return Err(format!(
            "norm_rope: row of {d} with {pairs} rotated pairs, norm mode {norm}"
        ));
    }
    holds(&x, types::F32, 0, "norm_rope input")?;
    holds(&out, types::F32, x.numel(), "norm_rope output")?;
    holds(
        &w,
        types::F32,
        if norm == 2 { d } else { 0 },
        "norm_rope weight",
    )?;
    holds(&inv, types::F32, pairs, "norm_rope frequencies")?;
    // (read only where pairs are rotated: NORM_MATMUL's norm passes another tensor)
    if pairs > 0 {
        holds(&pos, types::I32, n, "norm_rope positions")?;
    }
    KArgs::default()
        .p(f32p(gpu, &x)?)
        .p(f32p(gpu, &w)?)
        .i(norm as i32)
        .f(p.f[0])
        .i(to_i32(d, "d")?)
        .i(to_i32(heads, "heads")?)
        .p(f32p(gpu, &inv)?)
        .i(pairs as i32)
        .f(p.f[1])
        .i(inverse as i32)
        .p(gpu.ptr(&pos, 4)?)
        .p(f32p(gpu, &out)?)
        .launch(gpu, "ds4_norm_rope", (heads, n, 1), 128)
}

/// (d, hc, n, mixes per token) of the mHC streams `s` ([d, hc, n]).
fn hc_dims(s: &TensorRef, head: bool) -> Result<(u64, u64, u64, u64), String> {
    let (d, hc, n) = (s.dims[0], s.dims[1], s.dims[2] * s.dims[3]);
    if hc == 0 || hc > HC_MAX {
        return Err(format!("mHC: {hc} streams (1..={HC_MAX})"));
    }
    Ok((d, hc, n, if head { hc } else { 2 * hc + hc * hc }))
}

unsafe fn hc_pre(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let [s, mix, scale, base, norm_w, out, wts] = args(a, "hc_pre")?;
    let head = p.i[1] != 0;
    let (d, hc, n, nm) = hc_dims(&s, head)?;
    holds(&s, types::F32, 0, "hc_pre streams")?;
    holds(&mix, types::F32, nm * n, "hc_pre mixes")?;
    holds(&scale, types::F32, if head { 1 } else { 3 }, "hc_pre scale")?;
    holds(&base, types::F32, nm, "hc_pre base")?;
    holds(&norm_w, types::F32, d, "hc_pre norm")?;
    holds(&out, types::F32, d * n, "hc_pre output")?;
    holds(&wts, types::F32, nm * n, "hc_pre weights")?;
    // Site mode, a decode step's few tokens: a second block per token runs the Sinkhorn
    // (where the kernel's fast path applies: up to 4 streams, not MOE_GPU_HC_FAST=0;
    // otherwise that block would return at once). 20:19 UTC, 43 layers, depth 0: tg32
    // 122.1 / 121.4 vs 119.2 / 118.8 tok/s without; a prefill pass (512 tokens) was ~1%
    // slower with it (each extra block repeats the streams' reduction), so it keeps one
    // block a token.
    let defer = !head && p.i[2] != 0;
    let split = !head && !defer && n <= 4 && hc <= 4 && !hc_fast_off() && !hc_split_off();
    hc_params(gpu, [s, mix, scale, base, norm_w, out, wts], d, hc, p, head)?
        .i(!hc_fast_off() as i32)
        .i(split as i32)
        .i(defer as i32)
        .launch(gpu, "ds4_hc_pre", (n, 1 + split as u64, 1), 1024)
}

/// The leading parameters of `ds4_hc_pre` and `ds4_hc_post_pre`: the streams, the mixes
/// (or their weights), scale, base, norm, out and weights, around d, hc, the
/// iterations, eps, the weights' eps and the head flag.
fn hc_params(
    gpu: &impl Gpu,
    t: [TensorRef; 7],
    d: u64,
    hc: u64,
    p: &OpParams,
    head: bool,
) -> Result<KArgs, String> {
    let [s, m, scale, base, norm, out, wts] = t.map(|t| f32p(gpu, &t));
    Ok(KArgs::default()
        .p(s?)
        .p(m?)
        .p(scale?)
        .p(base?)
        .p(norm?)
        .i(to_i32(d, "d")?)
        .i(hc as i32)
        .i(p.i[0] as i32)
        .f(p.f[0])
        .f(p.f[1])
        .i(head as i32)
        .p(out?)
        .p(wts?))
}

/// The MoE's outputs as mHC post takes them (HC_POST, HC_POST_PRE of `op`): y [d, k, n],
/// its routing weights [k, n] and the optional shared expert's [d, n], checked against
/// streams of d x n; their pointers and k (the shared expert's 0 without one).
fn moe_post_inputs(
    gpu: &impl Gpu,
    op: &str,
    d: u64,
    n: u64,
    y: &TensorRef,
    rw: &TensorRef,
    shared: Option<&TensorRef>,
) -> Result<(u64, u64, i32, u64), String> {
    let k = y.dims[1];
    if y.dims[0] != d || y.dims[2] * y.dims[3] != n {
        return Err(format!(
            "{op}: expert outputs {:?} do not match streams of {d} x {n}",
            y.dims
        ));
    }
    holds(y, types::F32, d * k * n, &format!("{op} expert outputs"))?;
    holds(rw, types::F32, k * n, &format!("{op} routing weights"))?;
    let ps = match shared {
        Some(sh) => {
            holds(sh, types::F32, d * n, &format!("{op} shared expert"))?;
            f32p(gpu, sh)?
        }
        None => 0,
    };
    Ok((f32p(gpu, y)?, f32p(gpu, rw)?, to_i32(k, "k")?, ps))
}

/// `MOE_GPU_HC_SPLIT=0`: mHC pre's Sinkhorn stays on the collapsing block (read once).
fn hc_split_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_HC_SPLIT"))
}

/// Whether environment variable `name` is "0" (turns a fast path off for A/B runs).
pub fn env_off(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| v == "0")
}

/// An A/B switch that forces a choice either way: Some(false) for `name=0`, Some(true)
/// for `name=1`, None (the default choice) otherwise.
fn env_force(name: &str) -> Option<bool> {
    match std::env::var(name).as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    }
}

/// A kernel switch that device tests can force: `force` 1 on, 2 off, 0 as `name` says
/// (env_force, read once into `mode`), else `default`.
fn forced_switch(
    force: &std::sync::atomic::AtomicU8,
    mode: &std::sync::OnceLock<Option<bool>>,
    name: &str,
    default: bool,
) -> bool {
    match force.load(std::sync::atomic::Ordering::Relaxed) {
        0 => mode.get_or_init(|| env_force(name)).unwrap_or(default),
        forced => forced == 1,
    }
}

/// `MOE_GPU_HC_FAST=0`: mHC pre's general path (read once).
fn hc_fast_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_HC_FAST"))
}

unsafe fn hc_post(gpu: &impl Gpu, a: &[TensorRef]) -> Result<(), String> {
    let (s, block, wts) = match a {
        [s, block, wts] | [s, block, wts, _] | [s, block, wts, _, _] => (*s, *block, *wts),
        _ => {
            return Err(format!(
                "hc_post: expected 3 to 5 tensor arguments, got {}",
                a.len()
            ))
        }
    };
    let (d, hc, n, nm) = hc_dims(&s, false)?;
    holds(&s, types::F32, 0, "hc_post streams")?;
    holds(&wts, types::F32, nm * n, "hc_post weights")?;
    // With 4 or 5 arguments the block output is the MoE's: y [d, k, n], its routing
    // weights [k, n] and the optional shared expert's [d, n], combined by the kernel.
    let (pb, py, prw, k, pshared) = if a.len() == 3 {
        holds(&block, types::F32, d * n, "hc_post block output")?;
        (f32p(gpu, &block)?, 0, 0, 0, 0)
    } else {
        let (py, prw, k, ps) = moe_post_inputs(gpu, "hc_post", d, n, &block, &a[3], a.get(4))?;
        (0, py, prw, k, ps)
    };
    KArgs::default()
        .p(f32p(gpu, &s)?)
        .p(pb)
        .p(f32p(gpu, &wts)?)
        .i(to_i32(d, "d")?)
        .i(hc as i32)
        .p(py)
        .p(prw)
        .i(k)
        .p(pshared)
        .launch(gpu, "ds4_hc_post", (d.div_ceil(256), n, 1), 256)
}

unsafe fn hc_sinkhorn(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let [wts] = args(a, "hc_sinkhorn")?;
    let hc = p.i[1];
    if !(1..=HC_MAX as i64).contains(&hc) {
        return Err(format!("hc_sinkhorn: {hc} streams (1..={HC_MAX})"));
    }
    let nm = (2 * hc + hc * hc) as u64;
    let n = wts.numel() / nm;
    expect(&wts, types::F32, "hc_sinkhorn weights")?;
    if n * nm != wts.numel() {
        return Err(format!(
            "hc_sinkhorn: {} weights are not whole tokens of {nm}",
            wts.numel()
        ));
    }
    KArgs::default()
        .p(f32p(gpu, &wts)?)
        .i(hc as i32)
        .i(p.i[0] as i32)
        .f(p.f[1])
        .launch(gpu, "ds4_hc_sinkhorn", (n, 1, 1), 32)
}

/// Most tokens HC_POST_PRE's kernel takes (decode steps; longer chunks run its parts).
const HCF_MAX_TOKENS: u64 = 16;
/// Widest stream `ds4_hc_post_pre` takes (DS4_HCF_MAX_D).
const HCF_MAX_D: u64 = 8192;
/// Threads of a `ds4_hc_post_pre` block (DS4_HCF_THREADS).
const HCF_THREADS: u64 = 512;
/// Most blocks of a `ds4_hc_post_pre` launch that wait for each other (gsync;
/// DS4_HCF_GSYNC_BLOCKS). They must all be resident at once: the host also keeps them
/// to the device's multiprocessors (one 512-thread block each at the least), so a
/// device of unknown size, or a small one, gets the last-block form.
const HCF_GSYNC_BLOCKS: u64 = 64;

/// Overrides `MOE_GPU_HC_GSYNC` when set (tests): 1 on, 2 off, 0 as the variable says.
pub static FORCE_HC_GSYNC: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether one token's `ds4_hc_post_pre` blocks wait for each other and each writes its
/// own columns of x (the default: depth-0 / 4096 decode +2-3% on the 43-layer V4-Flash
/// shape, H200 2026-12-03), instead of the last block to finish writing all of them.
/// `MOE_GPU_HC_GSYNC=0` turns it off (A/B runs; read once).
fn hc_gsync() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    match FORCE_HC_GSYNC.load(std::sync::atomic::Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => *ON.get_or_init(|| !env_off("MOE_GPU_HC_GSYNC")),
    }
}

/// The ops HC_POST_PRE stands for, where its kernel does not apply: HC_POST (when it
/// has post inputs), MATMUL (the mixes) and HC_PRE, in that order.
pub struct PostPreParts {
    pub post: Option<Vec<TensorRef>>,
    pub mix: [TensorRef; 3],
    pub pre: [TensorRef; 7],
    /// With xq: x (out) and xq, for [`quantize_into`] after the pre.
    pub quant: Option<XQuant>,
}

/// x quantised into HC_POST_PRE's xq (ABI 1.10): q8_1 blocks in the type-107
/// mat-vecs' plane order, as `quantize_q8_1` stores them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct XQuant {
    pub x: u64,
    pub xq: u64,
    pub values: u64,
}

/// HC_POST_PRE's routing (ABI 1.11, i[4] = 1): ROUTER's nine arguments with its
/// product (x is the site's out) and its params (f[0] from f[2], i[0..3] from i[5..8]).
pub struct SiteRoute {
    pub args: [TensorRef; 9],
    pub params: OpParams,
}

/// HC_POST_PRE's arguments without the routing's, and the routing (i[4] = 1: ROUTER's
/// nine arguments come last), every routing argument checked as ROUTER with its product
/// checks them, so that nothing launches before a refusal.
pub fn hc_route_split<'a>(
    gpu: &impl Gpu,
    a: &'a [TensorRef],
    p: &OpParams,
) -> Result<(&'a [TensorRef], Option<SiteRoute>), String> {
    if p.i[4] == 0 {
        return Ok((a, None));
    }
    let n = ops::ROUTER_MM_ARGS;
    if a.len() < n {
        return Err(format!(
            "hc_post_pre: its routing (i[4] = 1) needs ROUTER's {n} arguments last, got {} in all",
            a.len()
        ));
    }
    let (site, route) = a.split_at(a.len() - n);
    let mut params = OpParams::default();
    params.f[0] = p.f[2];
    params.i[..3].copy_from_slice(&p.i[5..8]);
    let args: [TensorRef; 9] = route
        .try_into()
        .map_err(|_| "hc_post_pre: routing arguments".to_string())?;
    router_mm(gpu, &params, &args)?;
    Ok((site, Some(SiteRoute { args, params })))
}

/// Most experts `ds4_hc_post_pre` routes itself (DS4_HCF_ROUTE_MAX).
const HCF_ROUTE_MAX_EXPERTS: u64 = 256;

/// The `ds4_hc_post_pre` limits above by their names in kernels/gpu/ds4.cu (a test
/// checks the two agree).
#[cfg(test)]
pub(crate) const HCF_LIMITS: [(&str, u64); 4] = [
    ("DS4_HCF_THREADS", HCF_THREADS),
    ("DS4_HCF_MAX_D", HCF_MAX_D),
    ("DS4_HCF_GSYNC_BLOCKS", HCF_GSYNC_BLOCKS),
    ("DS4_HCF_ROUTE_MAX", HCF_ROUTE_MAX_EXPERTS),
];

/// `ds4_hc_post_pre`'s routing arguments (its experts' count last, for the scratch)
/// where the site can route itself (`r` from [`hc_route_split`]): scored experts (not
/// the hash table), at most HCF_ROUTE_MAX_EXPERTS, F32 router weights of whole
/// 128-column blocks and x the site's out. None: the caller runs ROUTER after the site.
/// `MOE_GPU_SITE_ROUTE=0` keeps ROUTER (A/B runs).
fn site_route_kargs(
    gpu: &impl Gpu,
    r: &SiteRoute,
    out: u64,
) -> Result<Option<(KArgs, u64)>, String> {
    let [logits, bias, _, _, ids, w, x, wr, _] = r.args;
    let (gating, norm_topk, mode) = (r.params.i[0], r.params.i[1], r.params.i[2]);
    let e = logits.dims[0];
    // (a block's 128 columns of every row: d a multiple of 128)
    if mode == 2
        || e > HCF_ROUTE_MAX_EXPERTS
        || !wr.dims[0].is_multiple_of(128)
        || wr.type_id != types::F32
        || f32p(gpu, &x)? != out
        || site_route_off()
    {
        return Ok(None);
    }
    Ok(Some((
        KArgs::default()
            .p(gpu.ptr(&wr, 16)?)
            .p(if mode == 1 { f32p(gpu, &bias)? } else { 0 })
            .i(e as i32)
            .i(ids.dims[0] as i32)
            .i(gating as i32)
            .i((norm_topk != 0) as i32)
            .f(r.params.f[0])
            .i(mode as i32)
            .p(f32p(gpu, &logits)?)
            .p(gpu.ptr(&ids, 4)?)
            .p(f32p(gpu, &w)?),
        e,
    )))
}

fn site_route_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_SITE_ROUTE"))
}

/// What HC_POST_PRE ran: one launch (`routed`: the routing inside it, see
/// [`hc_route_split`]), or nothing yet: the ops it stands for.
pub enum PostPre {
    Launched { routed: bool },
    Parts(Box<PostPreParts>),
}

/// Launches `quantize_q8_1` of `q.x` into `q.xq` (planes = 1).
///
/// # Safety
/// As [`Gpu::launch`]: `q` from [`hc_post_pre`]'s checks.
pub unsafe fn quantize_into(gpu: &impl Gpu, q: XQuant) -> Result<(), String> {
    let (l, mut n_blocks) = quantize(q.values, 1);
    let (mut px, mut pq, mut planes) = (q.x, q.xq, 1i32);
    gpu.launch(l, &kargs!(px, pq, n_blocks, planes))
}

/// HC_POST_PRE (ABI 1.4): checks its tensors, then launches `ds4_hc_post_pre`, or
/// returns the ops it stands for (more than 4 streams or HCF_MAX_TOKENS tokens, mix
/// weights (fn) not F32, streams not whole float4s or not 16-byte aligned, the head's weights for
/// more than one token, `MOE_GPU_HC_FAST=0`).
///
/// # Safety
/// As [`Gpu::launch`].
pub unsafe fn hc_post_pre(
    gpu: &impl Gpu,
    p: &OpParams,
    a: &[TensorRef],
    route: Option<&SiteRoute>,
) -> Result<PostPre, String> {
    // i[3] = 1 (ABI 1.10): xq comes last.
    let (a, xq) = match (p.i[3] != 0, a.split_last()) {
        (true, Some((xq, rest))) => (rest, Some(*xq)),
        _ => (a, None),
    };
    if a.len() < 9 || a.len() > 12 {
        return Err(format!(
            "hc_post_pre: expected 9 to 12 tensor arguments{}, got {}",
            if xq.is_some() { " before xq" } else { "" },
            a.len()
        ));
    }
    let [s, fnw, scale, base, norm_w, out, wts, mix, sync] = args::<9>(&a[..9], "hc_post_pre")?;
    let post = &a[9..];
    let head = p.i[1] != 0;
    let (d, hc, n, nm) = hc_dims(&s, head)?;
    let site_nm = 2 * hc + hc * hc;
    holds(&s, types::F32, d * hc * n, "hc_post_pre streams")?;
    if fnw.dims[0] != hc * d || fnw.dims[1] * fnw.dims[2] * fnw.dims[3] != nm {
        return Err(format!(
            "hc_post_pre: mix weights {:?}, expected [{}, {nm}]",
            fnw.dims,
            hc * d
        ));
    }
    holds(
        &scale,
        types::F32,
        if head { 1 } else { 3 },
        "hc_post_pre scale",
    )?;
    holds(&base, types::F32, nm, "hc_post_pre base")?;
    holds(&norm_w, types::F32, d, "hc_post_pre norm")?;
    holds(&out, types::F32, d * n, "hc_post_pre output")?;
    // With post inputs the weights hold the previous site's (site_nm >= nm a token).
    let w_len = if post.is_empty() { nm } else { site_nm };
    holds(&wts, types::F32, w_len * n, "hc_post_pre weights")?;
    holds(&mix, types::F32, nm * n, "hc_post_pre mixes")?;
    holds(&sync, types::I32, n, "hc_post_pre counters")?;
    let quant = match xq {
        Some(xq) => {
            if !d.is_multiple_of(32) {
                return Err(format!(
                    "hc_post_pre: xq needs rows of a multiple of 32 values, got {d}"
                ));
            }
            holds(&xq, types::I32, (d * n).div_ceil(2), "hc_post_pre xq")?;
            Some(XQuant {
                x: f32p(gpu, &out)?,
                xq: gpu.ptr(&xq, 4)?,
                values: d * n,
            })
        }
        None => None,
    };
    // The post inputs: none, the block's output, or the MoE's (as HC_POST takes them).
    let (mode, pb, py, prw, k, pshared) = match post {
        [] => (0, 0, 0, 0, 0, 0),
        [block] => {
            holds(block, types::F32, d * n, "hc_post_pre block output")?;
            (1, f32p(gpu, block)?, 0, 0, 0, 0)
        }
        [y, rw, rest @ ..] => {
            let (py, prw, k, ps) = moe_post_inputs(gpu, "hc_post_pre", d, n, y, rw, rest.first())?;
            (2, 0, py, prw, k, ps)
        }
    };
    let (ps, pout, pnorm) = (f32p(gpu, &s)?, f32p(gpu, &out)?, f32p(gpu, &norm_w)?);
    let fused = fnw.type_id == types::F32
        && hc <= 4
        && d <= HCF_MAX_D
        && d.is_multiple_of(4)
        && [ps, pout, pnorm].iter().all(|p| p.is_multiple_of(16))
        && (1..=HCF_MAX_TOKENS).contains(&n)
        && (!head || n == 1)
        && !hc_fast_off();
    if !fused {
        let view = |t: &TensorRef, dims: [u64; 4]| TensorRef { dims, ..*t };
        let flat = view(&s, [hc * d, n, 1, 1]);
        let mix = view(&mix, [nm, n, 1, 1]);
        return Ok(PostPre::Parts(Box::new(PostPreParts {
            post: (!post.is_empty()).then(|| {
                let mut v = vec![s, post[0], view(&wts, [site_nm, n, 1, 1])];
                v.extend_from_slice(&post[1..]);
                v
            }),
            mix: [fnw, flat, mix],
            pre: [s, mix, scale, base, norm_w, out, view(&wts, [nm, n, 1, 1])],
            quant,
        })));
    }
    let hcp = hc.next_power_of_two();
    let nb = d.div_ceil(HCF_THREADS / hcp);
    let gsync = n == 1 && nb <= HCF_GSYNC_BLOCKS.min(gpu.multiprocessors() as u64) && hc_gsync();
    // A block's share: the mixes, the sum of squares, with gsync the Gram entries.
    let share = nm + 1 + if gsync { hc * (hc + 1) / 2 } else { 0 };
    let part_bytes = nb * n * share * 4;
    // The routing inside the site: gsync blocks of 128 columns (hcp = 4).
    let routing = match route {
        Some(r) if gsync && hcp == 4 => site_route_kargs(gpu, r, pout)?,
        _ => None,
    };
    // With routing, the blocks' parts of the logits ([nb, E, 4]) after the shares,
    // 256-byte aligned.
    let route_at = part_bytes.next_multiple_of(256);
    let route_bytes = routing.as_ref().map_or(0, |(_, e)| route_at + nb * e * 16);
    let part = gpu.scratch(part_bytes.max(route_bytes) as usize)?;
    let ka = hc_params(gpu, [s, fnw, scale, base, norm_w, out, wts], d, hc, p, head)?
        .p(part)
        .p(gpu.ptr(&sync, 4)?)
        .i(mode)
        .p(pb)
        .p(py)
        .p(prw)
        .i(k)
        .p(pshared)
        .i((!head && p.i[2] != 0) as i32)
        .i(gsync as i32)
        // (its blocks store xq themselves with gsync; otherwise a launch after it does)
        .p(quant.filter(|_| gsync).map_or(0, |q| q.xq));
    let routed = routing.is_some();
    let ka = match routing {
        Some((r, _)) => ka.extend(r).p(part + route_at),
        // No routing: its twelve parameters zero (wr null), whatever their types.
        None => ka.extend(KArgs(vec![0; 12])),
    };
    ka.launch(gpu, "ds4_hc_post_pre", (nb, n, 1), HCF_THREADS as u32)?;
    if let Some(q) = quant.filter(|_| !gsync) {
        quantize_into(gpu, q)?;
    }
    Ok(PostPre::Launched { routed })
}

unsafe fn compress(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let [kv, gate, pos, ape, norm_w, inv, ring_kv, ring_g, rows] = args(a, "compress")?;
    let (ratio, overlap, pairs) = (p.i[0].max(0) as u64, p.i[1] != 0, p.i[2].max(0) as u64);
    let (dim, cap) = (rows.dims[0], rows.dims[1] * rows.dims[2] * rows.dims[3]);
    let width = if overlap { 2 * dim } else { dim };
    let n = kv.numel() / width.max(1);
    if ratio == 0
        || dim == 0
        || dim > COMP_MAX_DIM
        || !dim.is_multiple_of(2)
        || 2 * pairs > dim
        || kv.dims[0] != width
    {
        return Err(format!(
            "compress: ratio {ratio}, rows of {dim} (even, <= {COMP_MAX_DIM}), {pairs} rotated pairs, input rows of {} (expected {width})",
            kv.dims[0]
        ));
    }
    holds(&kv, types::F32, 0, "compress kv")?;
    holds(&gate, types::F32, n * width, "compress gate")?;
    holds(&pos, types::I32, n, "compress positions")?;
    holds(&ape, types::F32, ratio * width, "compress ape")?;
    holds(&norm_w, types::F32, dim, "compress norm")?;
    holds(&inv, types::F32, pairs, "compress frequencies")?;
    holds(&ring_kv, types::F32, 2 * ratio * width, "compress kv ring")?;
    holds(&ring_g, types::F32, 2 * ratio * width, "compress gate ring")?;
    holds(&rows, types::F32, 0, "compress rows")?;
    let (pkv, pg, pp) = (f32p(gpu, &kv)?, f32p(gpu, &gate)?, gpu.ptr(&pos, 4)?);
    let (prk, prg) = (f32p(gpu, &ring_kv)?, f32p(gpu, &ring_g)?);
    let (ni, ri, wi) = (
        to_i32(n, "n")?,
        to_i32(ratio, "ratio")?,
        to_i32(width, "width")?,
    );
    KArgs::default()
        .p(pkv)
        .p(pg)
        .p(pp)
        .i(ni)
        .p(prk)
        .p(prg)
        .p(f32p(gpu, &ape)?)
        .p(f32p(gpu, &norm_w)?)
        .p(f32p(gpu, &inv)?)
        .i(pairs as i32)
        .f(p.f[1])
        .i(ri)
        .i(dim as i32)
        .i(overlap as i32)
        .f(p.f[0])
        .i(to_i32(cap, "rows")?)
        .p(f32p(gpu, &rows)?)
        .launch(gpu, "ds4_comp_pool", (n.div_ceil(ratio), 1, 1), 256)?;
    KArgs::default()
        .p(pkv)
        .p(pg)
        .p(pp)
        .i(ni)
        .i(ri)
        .i(wi)
        .p(prk)
        .p(prg)
        .launch(
            gpu,
            "ds4_comp_store",
            (width.div_ceil(256), n.min(2 * ratio), 1),
            256,
        )
}

/// `a` less its last tensor when it has `n` (an optional trailing argument), and that one.
fn split_extra(a: &[TensorRef], n: usize) -> (&[TensorRef], Option<TensorRef>) {
    match a.split_last() {
        Some((last, head)) if a.len() == n => (head, Some(*last)),
        _ => (a, None),
    }
}

/// An op's optional rotary inside its kernel: (pairs, inv_freq pointer) for the
/// inv_freq tensor and the pairs parameter, checked against rows of `width`; (0, 0)
/// without one.
fn rotary(
    gpu: &impl Gpu,
    inv: Option<TensorRef>,
    pairs: i64,
    width: u64,
    op: &str,
) -> Result<(u64, u64), String> {
    // (From ABI 1.5 an inv_freq of no values stands for none: SPARSE_ATTENTION's sync
    // after it without the rotary.)
    let Some(t) = inv.filter(|t| t.numel() > 0) else {
        return Ok((0, 0));
    };
    let pairs = pairs.max(0) as u64;
    if 2 * pairs > width {
        return Err(format!("{op}: {pairs} rotated pairs in heads of {width}"));
    }
    holds(&t, types::F32, pairs, &format!("{op} frequencies"))?;
    Ok((pairs, f32p(gpu, &t)?))
}

unsafe fn index_scores(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    // From ABI 1.4 a 6th tensor, inv_freq: the queries' rotary happens in the kernel.
    let (a, inv) = split_extra(a, 6);
    let [q, w, rows, pos, scores] = args(a, "index_scores")?;
    let (id, ih, n) = (q.dims[0], q.dims[1], q.dims[2] * q.dims[3]);
    let cap = rows.numel() / id.max(1);
    let ratio = p.i[0].max(0) as u64;
    if id == 0
        || id > IDX_DIM_MAX
        || !id.is_multiple_of(2)
        || id * ih > IDX_Q_MAX
        || ih > IDX_Q_MAX / 32
        || rows.dims[0] != id
        || ratio == 0
    {
        return Err(format!(
            "index_scores: {ih} heads x {id} (at most {IDX_DIM_MAX} wide, {IDX_Q_MAX} in all), rows of {}, ratio {ratio}",
            rows.dims[0]
        ));
    }
    holds(&q, types::F32, 0, "index_scores queries")?;
    holds(&w, types::F32, ih * n, "index_scores head weights")?;
    holds(&rows, types::F32, 0, "index_scores rows")?;
    holds(&pos, types::I32, n, "index_scores positions")?;
    holds(&scores, types::F32, cap * n, "index_scores output")?;
    let (pairs, pinv) = rotary(gpu, inv, p.i[1], id, "index_scores")?;
    let (pq, prows) = (f32p(gpu, &q)?, f32p(gpu, &rows)?);
    // The two kernels' common leading parameters.
    let base = KArgs::default()
        .p(pq)
        .p(f32p(gpu, &w)?)
        .p(prows)
        .p(gpu.ptr(&pos, 4)?)
        .i(ih as i32)
        .i(id as i32)
        .i(to_i32(ratio, "ratio")?)
        .i(to_i32(cap, "rows")?)
        .f(p.f[0])
        .f(p.f[1])
        .p(f32p(gpu, &scores)?);
    // A decode step (or a few tokens) seeing at most IDX_FEW_MAX_ROWS rows (i[2], the
    // engine's bound for every position the op may be replayed at, or the cache's
    // size): four rows a block over the device.
    let bound = match p.i[2] {
        b if b > 0 => (b as u64).min(cap),
        _ => cap,
    };
    if n < IDX_MM_MIN_TOKENS
        && bound <= IDX_FEW_MAX_ROWS
        && !idx_few_off()
        && id.is_multiple_of(4)
        && id <= IDX_DIM_MAX
        && ih <= 64
        && id * ih <= IDX_Q_MAX
        && pq.is_multiple_of(16)
        && prows.is_multiple_of(16)
    {
        let sms = match gpu.multiprocessors() {
            0 => 132,
            m => m as u64,
        };
        let blocks = bound.div_ceil(IDX_FEW_ROWS).clamp(1, 2 * sms);
        return base.p(pinv).i(pairs as i32).f(p.f[2]).launch(
            gpu,
            "ds4_index_scores_few",
            (blocks, n, 1),
            256,
        );
    }
    // A prefill chunk: the tiled product (whole tokens of a 128-query tile, 32-dim
    // chunks, 16-byte aligned, no rotary inside).
    if idx_mm(n, cap, ih)
        && pinv == 0
        && ih > 0
        && ih.is_multiple_of(8)
        && 128 % ih == 0
        && id.is_multiple_of(32)
        && pq.is_multiple_of(16)
        && prows.is_multiple_of(16)
    {
        let mm = base.i(to_i32(n, "tokens")?);
        if let Some((name, smem)) = idx_tcs(gpu, ih, id)? {
            let per_block = idx_tcs_tiles(n);
            return mm.i(per_block as i32).launch_smem(
                gpu,
                name,
                (
                    cap.div_ceil(128).div_ceil(per_block),
                    (n * ih).div_ceil(128),
                    1,
                ),
                256,
                smem,
            );
        }
        return mm.launch(
            gpu,
            idx_mm_kernel(),
            (cap.div_ceil(128), (n * ih).div_ceil(128), 1),
            256,
        );
    }
    // Decode steps choose by the rows visible (0); a prefill chunk's many tokens keep 64
    // rows a block (half the query staging).
    base.i(if n > 16 { 4 } else { idx_groups() as i32 })
        .p(pinv)
        .i(pairs as i32)
        .f(p.f[2])
        .launch(gpu, "ds4_index_scores", (cap.div_ceil(64), n, 1), 256)
}

/// The most rows a decode step's tokens may see for `ds4_index_scores_few` (its rows
/// a block, DS4_IDF_ROWS): up to the bound where the engine's top-k moves to many blocks
/// (TOPK_WIDE_FROM_ROWS), at most two blocks a multiprocessor striding over them.
const IDX_FEW_MAX_ROWS: u64 = 6144;
const IDX_FEW_ROWS: u64 = 4;

/// `MOE_GPU_IDX_FEW=0`: decode steps keep the row-a-lane / tiled kernels (A/B runs).
fn idx_few_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_IDX_FEW"))
}

/// Chunks of at least this many tokens score through `ds4_index_scores_mm`.
const IDX_MM_MIN_TOKENS: u64 = 16;

/// Decode steps score through the tiled kernel once the compressed cache has room for
/// this many rows (a context of 16K+ tokens at ratio 4; rows not yet written are
/// skipped by tile): on CUDA's tensor cores 32K / 128K decode +2-5%, 4K even
/// (2026-12-01, four runs each). HIP builds the same kernel on f32 FMAs, whose decode
/// form measured even with the row-a-lane kernel (on CUDA, 04:21).
const IDX_MM_DECODE_MIN_ROWS: u64 = 4096;

/// Whether `n` tokens of `ih` heads over a cache of `cap` rows score through the tiled
/// `ds4_index_scores_mm(_tc)`, not `ds4_index_scores` (a row a lane): chunks of
/// IDX_MM_MIN_TOKENS or more; decode steps over a cache of IDX_MM_DECODE_MIN_ROWS or
/// more rows when the tiled kernel is the tensor-core one (heads a multiple of 32); or as
/// `MOE_GPU_IDX_MM=0|1` says (0: never, 1: always). Read once.
fn idx_mm(n: u64, cap: u64, ih: u64) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let mode = MODE.get_or_init(|| env_force("MOE_GPU_IDX_MM"));
    let decode_tc =
        cap >= IDX_MM_DECODE_MIN_ROWS && ih.is_multiple_of(32) && idx_mm_kernel().ends_with("_tc");
    mode.unwrap_or(n >= IDX_MM_MIN_TOKENS || decode_tc)
}

/// The tiled index kernel: `ds4_index_scores_mm_tc`, its products on the tensor cores
/// where it can (CUDA sm_80+, heads a multiple of 32; three TF32 products a pair of f32
/// values, about f32's accuracy: 8.6e-7 of f64 in gpu_kernels), or with
/// `MOE_GPU_IDX_TC=0` `ds4_index_scores_mm`, all in f32 FMAs (A/B runs; 128K prefill
/// +6% with the tensor cores, 2026-12-01). Read once.
fn idx_mm_kernel() -> &'static str {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *OFF.get_or_init(|| env_off("MOE_GPU_IDX_TC")) {
        "ds4_index_scores_mm"
    } else {
        "ds4_index_scores_mm_tc"
    }
}

/// Row tiles of 128 a `ds4_index_scores_mm_tcs` block takes for `n` tokens: 16 in a
/// prefill chunk (its many query tiles fill the device; each block's queries load
/// once for 2048 rows), 1 in a decode step (its one query tile: a block a row tile, as
/// many blocks as the device holds at 128K).
fn idx_tcs_tiles(n: u64) -> u64 {
    if n >= IDX_MM_MIN_TOKENS {
        16
    } else {
        1
    }
}

/// Dynamic shared memory the streamed index kernel takes for index width `id`
/// (DS4_IXS_SMEM): the queries at row stride id + 4, two 32-dim row chunks at stride 36,
/// the warps' sums. Either precision.
fn idx_tcs_smem(id: u64) -> u64 {
    4 * (128 * (id + 4) + 2 * 128 * 36 + 4 * 128)
}

/// The streamed index kernel for the indexer's precision: `ds4_index_scores_mm_tcs` (f32,
/// the default: the oracle's selection), or in bf16 `ds4_index_scores_mm_tcs_bf16`
/// (queries and rows rounded to bf16, products summed in f32: reduced precision as
/// DeepSeek's own inference, which scores in fp8; other rows may win the top-k near its
/// ties). See [`precision`] for where the choice comes from.
fn idx_tcs_name() -> Result<&'static str, String> {
    static ENV: std::sync::OnceLock<Result<Option<bool>, String>> = std::sync::OnceLock::new();
    let bf16 = precision(&FORCE_IDX_BF16, &ENV, "MOE_GPU_IDX_PREC", &CONFIG_IDX_BF16)?;
    Ok(match bf16 {
        true => "ds4_index_scores_mm_tcs_bf16",
        false => "ds4_index_scores_mm_tcs",
    })
}

/// The indexer's and a prefill chunk's attention precision as a backend's plugins.toml
/// settings give them (`indexer_precision`, `attention_precision`): 0 not set, 1 bf16,
/// 2 f32. The backend's `configure` stores them ([`set_precision`]).
static CONFIG_IDX_BF16: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
static CONFIG_ATT_BF16: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Stores the plugins.toml precisions (None: not set; Some(true): bf16).
pub fn set_precision(indexer: Option<bool>, attention: Option<bool>) {
    let code = |v: Option<bool>| match v {
        None => 0,
        Some(true) => 1,
        Some(false) => 2,
    };
    CONFIG_IDX_BF16.store(code(indexer), std::sync::atomic::Ordering::Relaxed);
    CONFIG_ATT_BF16.store(code(attention), std::sync::atomic::Ordering::Relaxed);
}

/// Whether a precision switch means bf16: a device test's force (1 bf16, 2 f32), else
/// the environment variable `var` where set (A/B runs; read once into `env`), else the
/// plugins.toml setting, else f32.
fn precision(
    force: &std::sync::atomic::AtomicU8,
    env: &std::sync::OnceLock<Result<Option<bool>, String>>,
    var: &str,
    config: &std::sync::atomic::AtomicU8,
) -> Result<bool, String> {
    let code = |a: &std::sync::atomic::AtomicU8| a.load(std::sync::atomic::Ordering::Relaxed);
    Ok(match code(force) {
        0 => match env.get_or_init(|| prec_env(var)).clone()? {
            Some(bf16) => bf16,
            None => code(config) == 1,
        },
        forced => forced == 1,
    })
}

/// The precision switches (`MOE_GPU_IDX_PREC`, `MOE_GPU_ATT_PREC`) checked when a
/// backend loads its kernels, so that a bad value stops the load with its message
/// rather than the first long prompt.
pub fn check_prec() -> Result<(), String> {
    for var in ["MOE_GPU_IDX_PREC", "MOE_GPU_ATT_PREC"] {
        prec_env(var)?;
    }
    Ok(())
}

/// Precision switch `var` as "bf16 products" (None: unset).
fn prec_env(var: &str) -> Result<Option<bool>, String> {
    std::env::var(var)
        .ok()
        .map(|v| prec_bf16(var, &v))
        .transpose()
}

/// A precision switch `var`'s value as "bf16 products".
pub fn prec_bf16(var: &str, v: &str) -> Result<bool, String> {
    match v {
        "f32" => Ok(false),
        "bf16" => Ok(true),
        v => Err(format!(
            "{var}={v}: the precision is \"f32\" (the default) or \"bf16\""
        )),
    }
}

/// Whether the tiled scores of `ih` heads x `id` (a prefill chunk, or a decode step over
/// a long context) run as `ds4_index_scores_mm_tcs` (the rows streamed past resident
/// queries; the same bits as `ds4_index_scores_mm_tc`, 1.37x faster on a 128K chunk
/// on an H100, 2026-12-07; or its bf16 form, see [`idx_tcs_name`]) wherever that
/// tensor-core kernel would run and the backend
/// gives the kernel its shared memory, unless `MOE_GPU_IDX_TCS=0` (read once;
/// FORCE_IDX_TCS overrides). The kernel ([`idx_tcs_name`]) and the dynamic shared
/// memory to launch it with.
fn idx_tcs(gpu: &impl Gpu, ih: u64, id: u64) -> Result<Option<(&'static str, u32)>, String> {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let on = forced_switch(&FORCE_IDX_TCS, &MODE, "MOE_GPU_IDX_TCS", true);
    let smem = idx_tcs_smem(id);
    let runs = on
        && ih.is_multiple_of(32)
        && id.is_multiple_of(32)
        && idx_mm_kernel().ends_with("_tc")
        && smem <= gpu.ds4_tc_smem() as u64;
    Ok(match runs {
        true => Some((idx_tcs_name()?, smem as u32)),
        false => None,
    })
}

/// `ds4_index_scores_mm_tcs` for prefill chunks in device tests: 0 as configured, 1 on
/// where it runs, 2 off.
pub static FORCE_IDX_TCS: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The streamed index kernel's precision in device tests: 0 as configured
/// (`MOE_GPU_IDX_PREC`), 1 bf16, 2 f32.
pub static FORCE_IDX_BF16: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Head groups of a decode step's `ds4_index_scores` (its warps' split of the heads;
/// 256 / groups rows a block): `MOE_GPU_IDX_GROUPS` (4 or 8, for A/B runs; read once),
/// else 0: the kernel takes 8 while few rows are visible, else 4. The grid is sized for
/// 4 (64 rows a block); a block takes further chunks when it has fewer.
fn idx_groups() -> u64 {
    static G: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *G.get_or_init(|| {
        std::env::var("MOE_GPU_IDX_GROUPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|g| matches!(g, 4 | 8))
            .unwrap_or(0)
    })
}

/// `ds4_topk_rows`'s block (DS4_TOPK_THREADS).
const TOPK_ROWS_THREADS: u32 = 1024;
/// `ds4_topk_rows_wide`: threads and most blocks (DS4_TOPKW_THREADS, _MAX_BLOCKS), the
/// work words it needs (DS4_TOPKW_WORDS), and the visible rows a block is sized for.
const TOPKW_THREADS: u32 = 256;
const TOPKW_MAX_BLOCKS: u64 = 64;
const TOPKW_WORDS: u64 = 132 + 4096 + 2 * 1024;
const _: () = assert!(TOPKW_WORDS <= ops::TOPK_ROWS_WORK_WORDS);
const TOPKW_ROWS_PER_BLOCK: u64 = 512;

/// Whether one token's selection may run on many blocks (`ds4_topk_rows_wide`, the
/// default where the op has its work words); `MOE_GPU_TOPK_WIDE=0`: one block (A/B
/// runs; read once).
fn topk_wide() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !env_off("MOE_GPU_TOPK_WIDE"))
}

/// TOPK_ROWS: one block a token (`ds4_topk_rows`), or for one token with its work words
/// (ABI 1.6, a 4th argument) and a capacity worth splitting, `ds4_topk_rows_wide` on
/// up to TOPKW_MAX_BLOCKS blocks (no more than the multiprocessors: they wait for each
/// other, so all must be resident at once).
unsafe fn topk_rows(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let (scores, pos, sel, work) = match a {
        [s, p, o] => (*s, *p, *o, None),
        [s, p, o, w] => (*s, *p, *o, Some(*w)),
        _ => {
            return Err(format!(
                "topk_rows: expected 3 or 4 tensor arguments, got {}",
                a.len()
            ))
        }
    };
    let (cap, n, k) = (
        scores.dims[0],
        scores.numel() / scores.dims[0].max(1),
        sel.dims[0],
    );
    let ratio = p.i[0].max(0) as u64;
    if ratio == 0 || k == 0 || sel.numel() < k * n {
        return Err(format!(
            "topk_rows: ratio {ratio}, {k} per token for {n} tokens"
        ));
    }
    holds(&scores, types::F32, 0, "topk_rows scores")?;
    holds(&pos, types::I32, n, "topk_rows positions")?;
    holds(&sel, types::I32, k * n, "topk_rows output")?;
    if let Some(w) = &work {
        holds(w, types::I32, TOPKW_WORDS, "topk_rows work words")?;
    }
    let blocks = cap
        .div_ceil(TOPKW_ROWS_PER_BLOCK)
        .min(TOPKW_MAX_BLOCKS)
        .min(gpu.multiprocessors() as u64);
    let args = KArgs::default()
        .p(f32p(gpu, &scores)?)
        .p(gpu.ptr(&pos, 4)?)
        .i(to_i32(ratio, "ratio")?)
        .i(to_i32(cap, "rows")?)
        .i(to_i32(k, "k")?)
        .p(gpu.ptr(&sel, 4)?);
    match work {
        Some(w) if n == 1 && blocks >= 2 && topk_wide() => args.p(gpu.ptr(&w, 16)?).launch(
            gpu,
            "ds4_topk_rows_wide",
            (blocks, 1, 1),
            TOPKW_THREADS,
        ),
        _ => args.launch(gpu, "ds4_topk_rows", (n, 1, 1), TOPK_ROWS_THREADS),
    }
}

/// `MOE_GPU_ATT_STORE=0`: a decode step's window store stays a launch of its own (A/B
/// runs; read once).
fn att_store_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_ATT_STORE"))
}

/// `MOE_GPU_ATT_HEADS=0`: prefill chunks through `ds4_attention` (a block a head), not
/// `ds4_attention_heads` (A/B runs; read once).
fn att_heads_off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| env_off("MOE_GPU_ATT_HEADS"))
}

/// The heads kernel a prefill chunk takes and its heads a block: `ds4_attention_heads`
/// (two heads a warp), or with four `ds4_attention_heads4` (four a warp, its key
/// staging a pipeline).
fn att_heads_prefill(four: bool) -> (&'static str, u64) {
    if four {
        ("ds4_attention_heads4", ATT_HEADS4_PER_BLOCK)
    } else {
        ("ds4_attention_heads", ATT_HEADS_PER_BLOCK)
    }
}

/// `MOE_GPU_ATT_HPW=4`: prefill chunks off the tensor cores take `ds4_attention_heads4`
/// (opt-in: +2.5% prefill at 32K on an H100, 2026-12-07; read once); tests may force it
/// (FORCE_ATT_HPW4).
fn att_hpw4_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCE_ATT_HPW4.load(std::sync::atomic::Ordering::Relaxed)
        || *ON.get_or_init(|| std::env::var("MOE_GPU_ATT_HPW").is_ok_and(|v| v.trim() == "4"))
}

/// Dynamic shared memory `ds4_attention_tc` takes for head width `hd` (DS4_ATC_SMEM):
/// the queries and two key tiles at row stride hd + 4, the warps' partial logits (8
/// floats a thread), the keys' flags.
fn att_tc_smem(hd: u64) -> u64 {
    4 * ((ATT_TC_HEADS + 2 * ATT_TC_KEYS) * (hd + 4) + 8 * ATT_TC_THREADS as u64 + 2 * ATT_TC_KEYS)
}

/// Whether a prefill chunk's attention runs on the tensor cores (`ds4_attention_tc`):
/// by default (`MOE_GPU_ATT_TC=0` keeps the heads kernels; read once; FORCE_ATT_TC
/// overrides), where the head width is a multiple of 16 and the backend gives the
/// kernel its shared memory. With the dynamic shared memory to launch it with.
fn att_tc(gpu: &impl Gpu, hd: u64) -> Option<u32> {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let on = forced_switch(&FORCE_ATT_TC, &MODE, "MOE_GPU_ATT_TC", true);
    let smem = att_tc_smem(hd);
    (on && hd.is_multiple_of(16) && smem <= gpu.ds4_tc_smem() as u64).then_some(smem as u32)
}

/// `ds4_attention_tc` for prefill chunks in device tests: 0 as configured, 1 on where
/// it runs, 2 off.
pub static FORCE_ATT_TC: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The tensor-core attention's precision in device tests: 0 as configured
/// (`MOE_GPU_ATT_PREC`), 1 bf16, 2 f32.
pub static FORCE_ATT_BF16: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// The tensor-core attention for head width `hd`: `ds4_attention_tc` (f32 products, the
/// default), or in bf16 with `hd` a multiple of 32 `ds4_attention_tc_bf16` (queries, keys
/// and the softmax weights rounded to bf16 for the products, sums and softmax in f32, as
/// bf16 inference runs attention). See [`precision`] for where the choice comes from.
fn att_tc_name(hd: u64) -> Result<&'static str, String> {
    static ENV: std::sync::OnceLock<Result<Option<bool>, String>> = std::sync::OnceLock::new();
    let bf16 = precision(&FORCE_ATT_BF16, &ENV, "MOE_GPU_ATT_PREC", &CONFIG_ATT_BF16)?;
    Ok(match bf16 && hd.is_multiple_of(32) {
        true => "ds4_attention_tc_bf16",
        false => "ds4_attention_tc",
    })
}

/// Forces `ds4_attention_heads4` for prefill chunks (device tests).
pub static FORCE_ATT_HPW4: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Whether a decode step's attention runs as `ds4_attention_heads` over key splits +
/// `ds4_attention_merge`, not `ds4_attention` (a block a head): with the op's
/// long-context hint, or as `MOE_GPU_ATT_SPLIT=0|1` says (A/B runs; read once).
fn att_split(hint: bool) -> bool {
    static MODE: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let mode = MODE.get_or_init(|| env_force("MOE_GPU_ATT_SPLIT"));
    mode.unwrap_or(hint)
}

/// The fewest keys a split of a decode step's split attention takes (one staged tile,
/// DS4_ATH_TILE): a tile more a block cost ~7 us on the H200 against ~9.5 us for a
/// block's first (scripts/device/att_decode_bench.cu, 2026-12-01), so splits stay at
/// one tile until there are more tiles than splits.
const ATT_SPLIT_MIN_KEYS: u64 = 16;

/// Keys a split takes at the least, and splits a head group, for a decode step's split
/// attention: a split per ATT_SPLIT_MIN_KEYS of the most keys a token can have, at most
/// ATT_MAX_SPLITS. The kernel shares the token's actual keys out over them (a replayed
/// graph serves every position).
fn att_splits(max_keys: u64) -> (u64, u64) {
    (
        ATT_SPLIT_MIN_KEYS,
        max_keys
            .div_ceil(ATT_SPLIT_MIN_KEYS)
            .clamp(1, ATT_MAX_SPLITS),
    )
}

/// `MOE_GPU_ATT_DEC=1`: a decode step's split attention (the long-context hint) in one
/// launch, `ds4_attention_dec`, instead of the heads kernel + `ds4_attention_merge`.
/// Opt-in: alone on the H200 it is faster at 640 keys, but in the replayed decode graph
/// at depth 131072 it measured 3% slower (2026-12-04, docs/notes/ds4-gpu-h200.md). Read
/// once; tests may force it (FORCE_ATT_DEC).
fn att_dec_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCE_ATT_DEC.load(std::sync::atomic::Ordering::Relaxed)
        || *ON.get_or_init(|| env_force("MOE_GPU_ATT_DEC") == Some(true))
}

/// Forces `ds4_attention_dec` on for a decode step's split attention (device tests).
pub static FORCE_ATT_DEC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Splits a head group for `ds4_attention_dec`: as [`att_splits`], but the whole grid
/// (groups x splits) within two blocks a multiprocessor (DS4_ATD_MIN_BLOCKS), so that
/// every block is resident while the group's blocks wait for each other; None where that
/// leaves no split (or the backend reports no multiprocessor count: HIP keeps the
/// launches apart).
fn att_dec_splits(max_keys: u64, groups: u64, multiprocessors: u32) -> Option<u64> {
    let fit = 2 * multiprocessors as u64 / groups.max(1);
    (fit >= 1).then(|| att_splits(max_keys).1.min(fit))
}

/// `MOE_GPU_ATT_GRP=1`: a decode step's attention short of the long-context split as
/// `ds4_attention_grp` (four heads a block, the keys split over blocks, the group's last
/// block merging), not `ds4_attention` (a block a head). Opt-in until measured in the
/// decode graph. Read once; tests may force it (FORCE_ATT_GRP).
fn att_grp_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    FORCE_ATT_GRP.load(std::sync::atomic::Ordering::Relaxed)
        || *ON.get_or_init(|| env_force("MOE_GPU_ATT_GRP") == Some(true))
}

/// Forces `ds4_attention_grp` on for a decode step short of the split (device tests).
pub static FORCE_ATT_GRP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The fewest keys a split of `ds4_attention_grp` takes (the kernel shares a token's keys
/// out over the splits): `MOE_GPU_ATT_GRP_KEYS` (A/B runs; read once), else 16, one
/// batch of two keys for each of a block's eight warps.
fn att_grp_keys() -> u64 {
    static KEYS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *KEYS.get_or_init(|| {
        crate::ops::env_num("MOE_GPU_ATT_GRP_KEYS")
            .filter(|&k| k > 0)
            .unwrap_or(16)
    })
}

/// Splits of `ds4_attention_grp`: the grid within the multiprocessors (its blocks take
/// one each; 8 splits of 16 groups where the backend reports no count), and no more
/// than the most keys need at the fewest a split.
fn att_grp_splits(max_keys: u64, heads: u64, multiprocessors: u32) -> u64 {
    let groups = heads.div_ceil(ATT_GRP_HEADS);
    let fit = match multiprocessors {
        0 => 8,
        m => m as u64 / groups,
    };
    fit.min(max_keys.div_ceil(att_grp_keys()))
        .clamp(1, ATT_MAX_SPLITS)
}

/// Chunks of at least this many tokens take `ds4_attention_heads` (a block per 16 heads
/// of a token, the keys staged once for all of them) in one pass; fewer keep a block per
/// head (16 warps a head while the grid is small), or with the long-context hint the
/// heads kernel over key splits.
const ATT_HEADS_MIN_TOKENS: u64 = 16;

unsafe fn sparse_attention(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    // From ABI 1.4 a 9th tensor, inv_freq: q's norm + rotary and the output's inverse
    // rotary happen in the kernel; from ABI 1.5 a 10th, sync: a word per head group for
    // the one-launch decode form's barrier.
    let (a, sync) = split_extra(a, 10);
    let (a, inv) = split_extra(a, 9);
    let [q, kv, ring, rows, sel, sinks, pos, out] = args(a, "sparse_attention")?;
    let (hd, heads, n) = (q.dims[0], q.dims[1], q.dims[2] * q.dims[3]);
    let window = ring.numel() / hd.max(1);
    let (ratio, mode) = (p.i[0].max(0) as u64, p.i[1]);
    let cap = rows.numel() / hd.max(1);
    if hd == 0
        || hd > HEAD_MAX
        || !hd.is_multiple_of(2)
        || window == 0
        || !(0..=2).contains(&mode)
        || (mode > 0 && ratio == 0)
    {
        return Err(format!(
            "sparse_attention: heads of {hd} (at most {HEAD_MAX}), window {window}, mode {mode}, ratio {ratio}"
        ));
    }
    let k_sel = if mode == 2 { sel.dims[0] } else { 0 };
    holds(&q, types::F32, 0, "sparse_attention queries")?;
    holds(&kv, types::F32, hd * n, "sparse_attention keys")?;
    holds(&ring, types::F32, hd * window, "sparse_attention window")?;
    holds(&rows, types::F32, 0, "sparse_attention rows")?;
    holds(&sel, types::I32, k_sel * n, "sparse_attention selection")?;
    holds(&sinks, types::F32, heads, "sparse_attention sinks")?;
    holds(&pos, types::I32, n, "sparse_attention positions")?;
    holds(&out, types::F32, q.numel(), "sparse_attention output")?;
    let (pairs, pinv) = rotary(gpu, inv, p.i[2], hd, "sparse_attention")?;
    let (pq, pkv, pp, pr) = (
        f32p(gpu, &q)?,
        f32p(gpu, &kv)?,
        gpu.ptr(&pos, 4)?,
        f32p(gpu, &ring)?,
    );
    let (prows, pout) = (f32p(gpu, &rows)?, f32p(gpu, &out)?);
    let (hdi, wi) = (hd as i32, to_i32(window, "window")?);
    let att = KArgs::default()
        .p(pq)
        .p(pkv)
        .p(pr)
        .p(prows)
        .p(gpu.ptr(&sel, 4)?)
        .p(f32p(gpu, &sinks)?)
        .p(pp)
        .i(to_i32(heads, "heads")?)
        .i(hdi)
        .i(wi)
        .i(to_i32(ratio, "ratio")?)
        .i(mode as i32)
        .i(to_i32(k_sel, "k")?)
        .i(to_i32(cap, "rows")?)
        .f(p.f[0])
        .p(pout);
    // The heads kernel (a block per 16 heads, the keys staged once for them) has no
    // rotary inside (with inv_freq: the kernel a head) and needs whole float4s, 16-byte
    // aligned. A chunk of 16 tokens or more: one pass over each token's keys; fewer (a
    // decode step), with the long-context hint (i[3] = 1): the keys split over blocks,
    // then ds4_attention_merge.
    let f4 = hd.is_multiple_of(4)
        && [pq, pkv, pr, prows, pout]
            .iter()
            .all(|p| p.is_multiple_of(16));
    let aligned = f4 && !att_heads_off();
    let heads_ok = pinv == 0 && aligned;
    let grid_heads = heads.div_ceil(ATT_HEADS_PER_BLOCK);
    // One token: its row goes into the ring from the last kernel (its slot is outside
    // the window that kernel reads); more, or MOE_GPU_ATT_STORE=0: ds4_window_store after.
    let store = n == 1 && !att_store_off();
    // The most keys a token can have: the window and every compressed row or selected
    // one (a replayed graph serves any position with the grid sized here).
    let max_keys = window
        + match mode {
            1 => cap,
            2 => k_sel,
            _ => 0,
        };
    // The split form (a decode step far into a long context) in one launch where the
    // backend can keep the whole grid resident.
    let split = att_split(p.i[3] == 1);
    // The one-launch forms' arguments after att's: keys a split, the partial sums (one
    // token's splits of every head), their sync words, the rotary and the store.
    let one_launch = |att: KArgs, keys: u64, splits: u64, words: u64| {
        Ok::<_, String>(
            att.i(to_i32(keys, "keys a split")?)
                .p(gpu.scratch((heads * splits * (hd + 2) * 4) as usize)?)
                .p(words)
                .p(pinv)
                .i(pairs as i32)
                .f(p.f[1])
                .f(p.f[2])
                .i(store as i32),
        )
    };
    if let (Some(sync), true) = (sync, n == 1 && aligned && split && att_dec_on()) {
        if let Some(splits) = att_dec_splits(max_keys, grid_heads, gpu.multiprocessors()) {
            holds(&sync, types::I32, grid_heads, "sparse_attention sync")?;
            let words = gpu.ptr(&sync, 4)?;
            return one_launch(att, ATT_SPLIT_MIN_KEYS, splits, words)?.launch(
                gpu,
                "ds4_attention_dec",
                (grid_heads, 1, splits),
                32 * ATT_HEADS_WARPS,
            );
        }
    }
    // A decode step short of the split: four heads a block over key splits (opt-in),
    // where the sync words hold the groups' counts.
    let grp = sync
        .filter(|s| {
            n == 1
                && f4
                && !split
                && att_grp_on()
                && s.numel() >= ops::sparse_attention_sync_words(heads)
        })
        .map(|s| (s, att_grp_splits(max_keys, heads, gpu.multiprocessors())));
    // A chunk of 16 tokens or more: one pass over each token's keys.
    let chunk = heads_ok && n >= ATT_HEADS_MIN_TOKENS;
    if let Some(smem) = chunk.then(|| att_tc(gpu, hd)).flatten() {
        att.i(0).p(0).launch_smem(
            gpu,
            att_tc_name(hd)?,
            (heads.div_ceil(ATT_TC_HEADS), n, 1),
            ATT_TC_THREADS,
            smem,
        )?;
    } else if chunk {
        let (name, per_block) = att_heads_prefill(att_hpw4_on());
        att.i(0).p(0).launch(
            gpu,
            name,
            (heads.div_ceil(per_block), n, 1),
            32 * ATT_HEADS_WARPS,
        )?;
    } else if let Some((kper, splits)) = (heads_ok && split)
        .then(|| att_splits(max_keys))
        .filter(|&(_, splits)| n * heads * splits * (hd + 2) * 4 <= ATT_SPLIT_MAX_BYTES)
    {
        let part = gpu.scratch((n * heads * splits * (hd + 2) * 4) as usize)?;
        att.i(to_i32(kper, "keys a split")?).p(part).launch(
            gpu,
            "ds4_attention_heads",
            (grid_heads, n, splits),
            32 * ATT_HEADS_WARPS,
        )?;
        KArgs::default()
            .p(part)
            .i(splits as i32)
            .p(f32p(gpu, &sinks)?)
            .i(to_i32(heads, "heads")?)
            .i(hdi)
            .p(pout)
            .p(pkv)
            .p(pp)
            .i(wi)
            .i(store as i32)
            .p(pr)
            .launch(gpu, "ds4_attention_merge", (heads, n, 1), ATT_MERGE_THREADS)?;
        if store {
            return Ok(());
        }
    } else if let Some((sync, splits)) = grp {
        expect(&sync, types::I32, "sparse_attention sync")?;
        // (its words after ds4_attention_dec's)
        let words = gpu.ptr(&sync, 4)? + 4 * grid_heads;
        one_launch(att, att_grp_keys(), splits, words)?.launch(
            gpu,
            "ds4_attention_grp",
            (heads.div_ceil(ATT_GRP_HEADS), 1, splits),
            32 * ATT_GRP_WARPS,
        )?;
        if store {
            return Ok(());
        }
    } else {
        // 16 warps per block when the grid is small (decode), else 8 (DS4_ATT_MAX_WARPS).
        let warps = if heads * n < 512 { 16 } else { 8 };
        att.i(warps)
            .p(pinv)
            .i(pairs as i32)
            .f(p.f[1])
            .f(p.f[2])
            .i(store as i32)
            .launch(gpu, "ds4_attention", (heads, n, 1), 32 * warps as u32)?;
        if store {
            return Ok(());
        }
    }
    KArgs::default()
        .p(pkv)
        .p(pp)
        .i(to_i32(n, "n")?)
        .i(hdi)
        .i(wi)
        .p(pr)
        .launch(
            gpu,
            "ds4_window_store",
            (hd.div_ceil(256), n.min(window), 1),
            256,
        )
}

/// A checked launch, to run once the caller has decided on it.
pub struct Prepared(KArgs, &'static str, (u64, u64, u64), u32);

impl Prepared {
    /// # Safety
    /// As for every launch.
    pub unsafe fn launch(self, gpu: &impl Gpu) -> Result<(), String> {
        self.0.launch(gpu, self.1, self.2, self.3)
    }
}

/// ROUTER with its product (ABI 1.7: 9 arguments), every argument checked before either
/// form launches anything: the 6-argument part as ROUTER takes it, w_r ([d, E]) against
/// the logits' E and x ([d, n]) against their n, and n sync words. Returns the one
/// launch `ds4_router_mm` (the product and the selection, the same bits as the two),
/// for the caller to run where MATMUL would run the product on `matvec_f32_wide`.
pub fn router_mm(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<Prepared, String> {
    let [logits, _, _, _, _, _, x, wr, sync] = args(a, "router")?;
    let (d, e) = (wr.dims[0], logits.dims[0]);
    let n = logits.numel() / e.max(1);
    if d == 0 || wr.numel() != d * e || x.numel() != d * n {
        return Err(format!(
            "router: weights of {} values as [{d}, {e}] against x of {} values for {n} token(s)",
            wr.numel(),
            x.numel()
        ));
    }
    holds(&sync, types::I32, n, "router sync words")?;
    router_kargs(gpu, p, &a[..6], Some((x, wr, sync, d)))
}

/// MOE_ROUTED's one launch, `ds4_moe_routed` (see [`crate::moe_routed`]): ROUTER with
/// its product as [`router_mm`] checks and passes it (less its sync words), then the
/// gate + up pair `gu` (up's weights and outputs `steps` bytes on), reading x's q8_1
/// blocks at `xq`, and the down product `down` on the SwiGLU's q8_1 blocks at `aq`;
/// `sync`: the barriers' word. [`crate::moe_routed::blocks_per_sm`] blocks a
/// multiprocessor.
#[allow(clippy::too_many_arguments)]
pub fn moe_routed(
    gpu: &impl Gpu,
    p: &OpParams,
    router: &[TensorRef],
    gu: &crate::ops::MatmulId,
    steps: (i64, i64),
    xq: u64,
    down: &crate::ops::MatmulId,
    aq: u64,
    sync: u64,
) -> Result<Prepared, String> {
    let Prepared(mut ka, ..) = router_mm(gpu, p, router)?;
    ka.0.pop(); // ds4_router_mm's sync words: the barriers count in their own
    let ka = ka
        .p(gu.w)
        .p(steps.0 as u64)
        .p(gu.expert_bytes as u64)
        .i(gu.m)
        .i(gu.affine)
        .p(xq)
        .p(gu.out)
        .p(steps.1 as u64)
        .p(down.w)
        .p(down.expert_bytes as u64)
        .i(down.affine)
        .f(p.f[1])
        .p(aq)
        .p(down.out)
        .p(sync)
        .i(crate::moe_routed::prefetch_mode());
    let blocks = crate::moe_routed::blocks_per_sm() as u64 * gpu.multiprocessors() as u64;
    // (DS4_MOER_Q8_LOCAL q8_1 blocks of shared memory, kernels/gpu/ds4.cu)
    let local = crate::moe_routed::q8_local() && down.k <= 32 * 128 && blocks >= gu.pairs as u64;
    let ka = ka.i(local as i32);
    // (256 threads: DS4_ROUTER_MM_THREADS, kernels/gpu/ds4.cu)
    Ok(Prepared(ka, "ds4_moe_routed", (blocks, 1, 1), 256))
}

unsafe fn router(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    router_kargs(gpu, p, a, None)?.launch(gpu)
}

/// The checked launch of `ds4_router` on the logits, or with `mm` = (x, w_r, sync, d) of
/// `ds4_router_mm`.
fn router_kargs(
    gpu: &impl Gpu,
    p: &OpParams,
    a: &[TensorRef],
    mm: Option<(TensorRef, TensorRef, TensorRef, u64)>,
) -> Result<Prepared, String> {
    let [logits, bias, table, tokens, ids, w] = args(a, "router")?;
    let (e, n, k) = (
        logits.dims[0],
        logits.numel() / logits.dims[0].max(1),
        ids.dims[0],
    );
    let (gating, norm_topk, mode) = (p.i[0], p.i[1], p.i[2]);
    if e == 0
        || e > ROUTER_MAX_EXPERTS
        || k == 0
        || k > TOPK_MAX.min(e)
        || !(0..=2).contains(&mode)
        || ![2, 4].contains(&gating)
    {
        return Err(format!(
            "router: {k} of {e} experts (at most {TOPK_MAX} of {ROUTER_MAX_EXPERTS}), mode {mode}, gating {gating}"
        ));
    }
    holds(&logits, types::F32, 0, "router logits")?;
    holds(
        &bias,
        types::F32,
        if mode == 1 { e } else { 0 },
        "router bias",
    )?;
    holds(
        &table,
        types::I32,
        if mode == 2 { k } else { 0 },
        "router hash table",
    )?;
    holds(
        &tokens,
        types::I32,
        if mode == 2 { n } else { 0 },
        "router tokens",
    )?;
    holds(&ids, types::I32, k * n, "router ids")?;
    holds(&w, types::F32, k * n, "router weights")?;
    let table_rows = if mode == 2 { table.numel() / k } else { 0 };
    let mut ka = KArgs::default();
    if let Some((x, wr, _, d)) = mm {
        ka = ka
            .p(f32p(gpu, &wr)?)
            .i(to_i32(d, "router input width")?)
            .p(f32p(gpu, &x)?);
    }
    ka = ka
        .p(f32p(gpu, &logits)?)
        .p(f32p(gpu, &bias)?)
        .p(gpu.ptr(&table, 4)?)
        .i(to_i32(table_rows, "hash table rows")?)
        .p(gpu.ptr(&tokens, 4)?)
        .i(e as i32)
        .i(k as i32)
        .i(gating as i32)
        .i((norm_topk != 0) as i32)
        .f(p.f[0])
        .i(mode as i32)
        .p(gpu.ptr(&ids, 4)?)
        .p(f32p(gpu, &w)?);
    Ok(match mm {
        Some((_, _, sync, _)) => Prepared(
            ka.p(gpu.ptr(&sync, 4)?),
            "ds4_router_mm",
            (e.div_ceil(2), 1, 1),
            // DS4_ROUTER_MM_THREADS (kernels/gpu/ds4.cu)
            256,
        ),
        None => Prepared(ka, "ds4_router", (n, 1, 1), 256),
    })
}

unsafe fn swiglu(gpu: &impl Gpu, p: &OpParams, a: &[TensorRef]) -> Result<(), String> {
    let [g, u, out] = args(a, "swiglu")?;
    let n = out.numel();
    holds(&g, types::F32, n, "swiglu gate")?;
    holds(&u, types::F32, n, "swiglu up")?;
    holds(&out, types::F32, n, "swiglu output")?;
    KArgs::default()
        .p(f32p(gpu, &g)?)
        .p(f32p(gpu, &u)?)
        .p(f32p(gpu, &out)?)
        .p(n)
        .f(p.f[0])
        .launch(gpu, "ds4_swiglu", (n.div_ceil(256), 1, 1), 256)
}

unsafe fn moe_combine(gpu: &impl Gpu, a: &[TensorRef]) -> Result<(), String> {
    let (y, w, out, shared) = moe_plugin_api::moe_combine_args(a)?;
    let (d, k) = (y.dims[0], y.dims[1]);
    let n = y.dims[2] * y.dims[3];
    holds(&y, types::F32, 0, "moe_combine expert outputs")?;
    holds(&w, types::F32, k * n, "moe_combine weights")?;
    holds(&out, types::F32, d * n, "moe_combine output")?;
    let ps = match &shared {
        Some(s) => {
            holds(s, types::F32, d * n, "moe_combine shared expert")?;
            f32p(gpu, s)?
        }
        None => 0,
    };
    KArgs::default()
        .p(f32p(gpu, &y)?)
        .p(f32p(gpu, &w)?)
        .p(ps)
        .i(to_i32(d, "d")?)
        .i(to_i32(k, "k")?)
        .p(f32p(gpu, &out)?)
        .launch(gpu, "ds4_moe_combine", (d.div_ceil(256), n, 1), 256)
}

unsafe fn transpose12(gpu: &impl Gpu, a: &[TensorRef]) -> Result<(), String> {
    let [x, out] = args(a, "transpose12")?;
    let (d0, d1, d2) = (x.dims[0], x.dims[1], x.dims[2] * x.dims[3]);
    holds(&x, types::F32, 0, "transpose12 input")?;
    holds(&out, types::F32, x.numel(), "transpose12 output")?;
    KArgs::default()
        .p(f32p(gpu, &x)?)
        .i(to_i32(d0, "a")?)
        .i(to_i32(d1, "b")?)
        .i(to_i32(d2, "c")?)
        .p(f32p(gpu, &out)?)
        .launch(gpu, "transpose12", (d0.div_ceil(256), d1, d2), 256)
}

/// SWIGLU_MATMUL_ID of ROCmFP4 weights for one token, where the runs kernel takes the
/// product: `matvec_fp4_runs_q8_id_swiglu` computes the clamped SwiGLU of gate `g` and
/// up `u` (`lim`) as it quantises its input, so no SwiGLU launch runs (the shared
/// expert's down, one "expert"; `act` is not written). One pair takes the plain
/// product's plan, more the grouped one's. None where it does not apply (other types,
/// more tokens, unaligned, a matrix-unit plan): the caller runs SWIGLU, then MATMUL_ID.
/// The op's params: f[0] the clamp `lim`; i[0] = 1 fixed ids (ABI 1.12), so the kernel
/// asks for its rows before waiting for the previous kernel.
pub fn swiglu_matmul_id_runs(
    gpu: &impl Gpu,
    w: &TensorRef,
    g: &TensorRef,
    u: &TensorRef,
    ids: &TensorRef,
    out: &TensorRef,
    params: &OpParams,
) -> Option<Result<(), String>> {
    let (lim, fixed) = (params.f[0], params.i[0] == 1);
    if w.type_id != crate::ops::TYPE_ROCMFP4 {
        return None;
    }
    let (k, m) = (w.dims[0], w.dims[1]);
    let (n_slots, n_tok) = (ids.dims[0], ids.dims[1] * ids.dims[2] * ids.dims[3]);
    let pairs = n_slots * n_tok;
    let (pw, pg, pu) = (
        gpu.ptr(w, 16).ok()?,
        gpu.ptr(g, 16).ok()?,
        gpu.ptr(u, 16).ok()?,
    );
    let plan = if pairs == 1 {
        crate::ops::fp4_runs(w.type_id, k, m, n_tok, pw, pg)
    } else {
        crate::ops::fp4_runs_id(w.type_id, k, m, pairs, n_tok, pw, pg)
    }
    .filter(|p| !p.mma && n_tok == 1 && pu.is_multiple_of(16))?;
    let row_bytes = dense_row_bytes(w.type_id, k)?;
    // SAFETY: as in `run`; every tensor's range is checked below.
    Some(unsafe {
        swiglu_matmul_id_runs_inner(gpu, plan, row_bytes, [w, g, u, ids, out], lim, fixed)
    })
}

unsafe fn swiglu_matmul_id_runs_inner(
    gpu: &impl Gpu,
    plan: crate::ops::RunsPlan,
    row_bytes: Result<u64, String>,
    [w, g, u, ids, out]: [&TensorRef; 5],
    lim: f32,
    fixed: bool,
) -> Result<(), String> {
    let row_bytes = row_bytes?;
    let (k, m, experts) = (w.dims[0], w.dims[1], w.dims[2] * w.dims[3]);
    let (n_slots, n_tok) = (ids.dims[0], ids.dims[1] * ids.dims[2] * ids.dims[3]);
    let pairs = n_slots * n_tok;
    let per_pair = id_input(g, k, n_tok, pairs)?;
    expect(ids, types::I32, "swiglu_matmul_id ids")?;
    holds(out, types::F32, m * pairs, "swiglu_matmul_id output")?;
    let (pw, pg, pu) = (gpu.ptr(w, 16)?, f32p(gpu, g)?, f32p(gpu, u)?);
    let (pi, po) = (gpu.ptr(ids, 4)?, f32p(gpu, out)?);
    let per_block = crate::ops::fp4_runs_rows_per_block(k, plan);
    KArgs::default()
        .p(pw)
        .p(row_bytes * m)
        .p(row_bytes)
        .i(to_i32(k, "k")?)
        .i(to_i32(m, "m")?)
        .i(to_i32(experts, "experts")?)
        .p(pg)
        .p(pu)
        .f(lim)
        .i(per_pair)
        .i(to_i32(n_slots, "slots")?)
        .p(pi)
        .p(po)
        .i(plan.rows as i32)
        .i(fixed as i32)
        .launch_smem(
            gpu,
            "matvec_fp4_runs_q8_id_swiglu",
            (m.div_ceil(per_block), pairs, 1),
            plan.threads as u32,
            crate::ops::fp4_runs_smem(gpu, k, plan, row_bytes),
        )
}

/// MATMUL_ID with dense weights ([k, m, experts] of f32 / f16 / bf16 / q8_0 / mxfp4 /
/// ROCmFP4): ROCmFP4 in whole runs on `matvec_fp4_runs_q8_id` where
/// [`crate::ops::fp4_runs_id`] takes it, Q8_0 / ROCmFP4 with 256 rows or more on
/// `matvec_dense_rows_id` (a 128-thread block on 2-4 rows of a pair), the rest on
/// `matvec_dense_id` (warps per (row, pair)). `fixed`: the ids never change (MATMUL_ID's
/// i[0], ABI 1.12), so the runs kernel asks for its rows before waiting for the
/// previous kernel (the others read the ids after it either way).
/// None when the weights are not a dense type.
pub fn matmul_id_dense(gpu: &impl Gpu, a: &[TensorRef], fixed: bool) -> Option<Result<(), String>> {
    let w = a.first()?;
    let row_bytes = dense_row_bytes(w.type_id, w.dims[0])?;
    // SAFETY: as in `run`.
    Some(unsafe { matmul_id_dense_inner(gpu, a, row_bytes, fixed) })
}

unsafe fn matmul_id_dense_inner(
    gpu: &impl Gpu,
    a: &[TensorRef],
    row_bytes: Result<u64, String>,
    fixed: bool,
) -> Result<(), String> {
    let row_bytes = row_bytes?;
    let [w, x, ids, out] = args(a, "matmul_id")?;
    let (k, m, experts) = (w.dims[0], w.dims[1], w.dims[2] * w.dims[3]);
    let (n_slots, n_tok) = (ids.dims[0], ids.dims[1] * ids.dims[2] * ids.dims[3]);
    let pairs = n_slots * n_tok;
    let per_pair = id_input(&x, k, n_tok, pairs)?;
    expect(&ids, types::I32, "matmul_id ids")?;
    holds(&x, types::F32, 0, "matmul_id input")?;
    holds(&out, types::F32, m * pairs, "matmul_id output")?;
    let px = f32p(gpu, &x)?;
    let pw = gpu.ptr(&w, dense_align(w.type_id))?;
    let runs = crate::ops::fp4_runs_id(w.type_id, k, m, pairs, n_tok, pw, px);
    // The kernels take the same arguments up to their layout parameter, the runs kernel
    // without the type, the 8-bit one with the quantised input for x.
    let (pi, po) = (gpu.ptr(&ids, 4)?, f32p(gpu, &out)?);
    let common = |x: u64, with_ty: bool| -> Result<KArgs, String> {
        let a = KArgs::default().p(pw).p(row_bytes * m).p(row_bytes);
        let a = if with_ty { a.i(w.type_id as i32) } else { a };
        Ok(a.i(to_i32(k, "k")?)
            .i(to_i32(m, "m")?)
            .i(to_i32(experts, "experts")?)
            .p(x)
            .i(per_pair)
            .i(to_i32(n_slots, "slots")?)
            .p(pi)
            .p(po))
    };
    // ROCmFP4 in whole runs (experts, rows and columns stay 16-byte aligned: 144 bytes per
    // run, k whole runs).
    if let Some(plan) = runs {
        let per_block = crate::ops::fp4_runs_rows_per_block(k, plan);
        let args = common(px, false)?.i(plan.rows as i32);
        // (the matrix-unit form takes no `fixed`: it reads its ids first either way)
        let args = if plan.mma { args } else { args.i(fixed as i32) };
        return args.launch_smem(
            gpu,
            plan.kernel(true),
            (m.div_ceil(per_block), pairs, 1),
            plan.threads as u32,
            crate::ops::fp4_runs_smem(gpu, k, plan, row_bytes),
        );
    }
    // One column per pair: the decode mat-vec layout where it applies (x + col * k stays
    // 16-byte aligned: k is whole 32-value blocks for those types); with
    // MOE_GPU_Q8_DECODE its 8-bit form on the columns quantised once.
    match dense_rows(w.type_id, m, 1, px) {
        Some(_) if q8_decode() => {
            let cols = if per_pair == 1 { pairs } else { n_tok };
            let (q, mut n_blocks) = quantize(k, cols);
            let mut pq = gpu.scratch(n_blocks as usize * Q8_BYTES as usize)?;
            let (mut px, mut planes) = (px, 0i32); // values in order
            gpu.launch(q, &kargs!(px, pq, n_blocks, planes))?;
            common(pq, true)?.i(q8_rows(m)).launch(
                gpu,
                "matvec_dense_q8_id",
                (m.div_ceil(q8_rows(m) as u64), pairs, 1),
                128,
            )
        }
        Some(rows) => common(px, true)?.i(rows as i32).launch(
            gpu,
            "matvec_dense_rows_id",
            (m.div_ceil(rows), pairs, 1),
            128,
        ),
        None => {
            let parts = dense_parts(m * pairs, k);
            common(px, true)?.i(parts as i32).launch(
                gpu,
                "matvec_dense_id",
                (m.div_ceil(8 / parts), pairs, 1),
                256,
            )
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::{cell::RefCell, ffi::c_void};

    use super::*;

    /// One recorded launch: (kernel, grid, block, parameter count).
    pub(crate) type Launched = (&'static str, (u32, u32, u32), u32, usize);

    /// Records launches; reports `.1` multiprocessors (0: unknown, as the trait's default)
    /// and `.2` bytes of shared memory for `ds4_attention_tc` (0: it does not run),
    /// records each launch's dynamic shared memory in `.3`, and reports `.4` as
    /// [`Gpu::grid_sync`] (also the moe_routed tests' recorder).
    #[derive(Default)]
    pub(crate) struct Rec(
        pub(crate) RefCell<Vec<Launched>>,
        u32,
        u32,
        RefCell<Vec<u32>>,
        bool,
    );

    impl Rec {
        /// A recorder reporting `sms` multiprocessors and `tc_smem` bytes for
        /// `ds4_attention_tc`.
        fn on(sms: u32, tc_smem: u32) -> Rec {
            Rec(Default::default(), sms, tc_smem, Default::default(), false)
        }

        /// A recorder of `sms` multiprocessors that launches cooperatively or not.
        pub(crate) fn grid_synced(sms: u32, sync: bool) -> Rec {
            Rec(Default::default(), sms, 0, Default::default(), sync)
        }
    }

    impl Gpu for Rec {
        fn ptr(&self, _t: &TensorRef, _align: u64) -> Result<u64, String> {
            Ok(0x10000)
        }
        fn scratch(&self, _bytes: usize) -> Result<u64, String> {
            Ok(0x100000)
        }
        unsafe fn launch(&self, l: Launch, params: &[*mut c_void]) -> Result<(), String> {
            self.0
                .borrow_mut()
                .push((l.name, l.grid, l.block, params.len()));
            Ok(())
        }
        unsafe fn launch_smem(
            &self,
            l: Launch,
            smem: u32,
            params: &[*mut c_void],
        ) -> Result<(), String> {
            self.3.borrow_mut().push(smem);
            self.launch(l, params)
        }
        fn multiprocessors(&self) -> u32 {
            self.1
        }
        fn ds4_tc_smem(&self) -> u32 {
            self.2
        }
        fn grid_sync(&self) -> bool {
            self.4
        }
    }

    fn f(dims: [u64; 4]) -> TensorRef {
        TensorRef {
            buffer: 1,
            offset: 0,
            type_id: types::F32,
            variant: 0,
            dims,
        }
    }
    fn i(dims: [u64; 4]) -> TensorRef {
        TensorRef {
            type_id: types::I32,
            ..f(dims)
        }
    }
    fn prm(fl: &[f32], il: &[i64]) -> OpParams {
        let mut p = OpParams::default();
        p.f[..fl.len()].copy_from_slice(fl);
        p.i[..il.len()].copy_from_slice(il);
        p
    }

    use crate::kernels::signatures;

    fn run_ok(op: u32, p: OpParams, a: &[TensorRef]) -> Vec<Launched> {
        run_on(Rec::default(), op, p, a)
    }

    fn run_on(g: Rec, op: u32, p: OpParams, a: &[TensorRef]) -> Vec<Launched> {
        run(&g, op, &p, a)
            .expect("an op of this module")
            .unwrap_or_else(|e| panic!("op {op}: {e}"));
        let sig = signatures();
        for &(name, _, _, n) in g.0.borrow().iter() {
            assert_eq!(
                Some(&(n + 1)),
                sig.get(name),
                "{name}: arguments vs the kernel's signature"
            );
        }
        g.0.into_inner()
    }

    #[test]
    fn ops_launch_their_kernels_with_matching_arguments() {
        let (d, hc, n) = (64, 4, 3);
        let nm = 2 * hc + hc * hc;
        let l = run_ok(
            ops::NORM_ROPE,
            prm(&[1e-6, 1.0], &[2, 8, 0]),
            &[
                f([d, 2, n, 1]),
                f([d, 1, 1, 1]),
                f([8, 1, 1, 1]),
                i([n, 1, 1, 1]),
                f([d, 2, n, 1]),
            ],
        );
        assert_eq!((l[0].0, l[0].1, l[0].2), ("ds4_norm_rope", (2, 3, 1), 128));
        let pre = [
            f([d, hc, n, 1]),
            f([nm, n, 1, 1]),
            f([3, 1, 1, 1]),
            f([nm, 1, 1, 1]),
            f([d, 1, 1, 1]),
            f([d, n, 1, 1]),
            f([nm, n, 1, 1]),
        ];
        let l = run_ok(ops::HC_PRE, prm(&[1e-6, 1e-6], &[20, 0]), &pre);
        // Site mode: a second block per token runs the Sinkhorn ...
        assert_eq!(l[0].1, (3, 2, 1));
        // ... unless it is deferred to HC_SINKHORN: a warp per token.
        let l = run_ok(ops::HC_PRE, prm(&[1e-6, 1e-6], &[20, 0, 1]), &pre);
        assert_eq!(l[0].1, (3, 1, 1));
        let sk = prm(&[0.0, 1e-6], &[20, hc as i64]);
        let l = run_ok(ops::HC_SINKHORN, sk, &[f([nm, n, 1, 1])]);
        assert_eq!((l[0].0, l[0].1, l[0].2), ("ds4_hc_sinkhorn", (3, 1, 1), 32));
        for (a, bad, why) in [
            (f([nm, n, 1, 1]), prm(&[], &[20, 0]), "0 streams"),
            (f([nm + 1, n, 1, 1]), sk, "not whole tokens"),
        ] {
            let e = run(&Rec::default(), ops::HC_SINKHORN, &bad, &[a])
                .unwrap()
                .unwrap_err();
            assert!(e.contains(why), "{e}");
        }
        let l = run_ok(
            ops::HC_POST,
            OpParams::default(),
            &[f([d, hc, n, 1]), f([d, n, 1, 1]), f([nm, n, 1, 1])],
        );
        assert_eq!(l[0].1, (1, 3, 1));
        // The MoE's outputs combined by mHC post: 6 experts a token, with and without
        // the shared expert.
        let moe = [
            f([d, hc, n, 1]),
            f([d, 6, n, 1]),
            f([nm, n, 1, 1]),
            f([6, n, 1, 1]),
            f([d, n, 1, 1]),
        ];
        for args in [&moe[..], &moe[..4]] {
            let l = run_ok(ops::HC_POST, OpParams::default(), args);
            assert_eq!((l.len(), l[0].0, l[0].1), (1, "ds4_hc_post", (1, 3, 1)));
        }
        // A chunk of 9 tokens closes at most 3 windows of 4; the rings keep 2 x 4 positions.
        let (dim, ratio) = (32, 4);
        let l = run_ok(
            ops::COMPRESS,
            prm(&[1e-6, 1.0], &[ratio, 1, 4]),
            &[
                f([2 * dim, 9, 1, 1]),
                f([2 * dim, 9, 1, 1]),
                i([9, 1, 1, 1]),
                f([2 * dim, ratio as u64, 1, 1]),
                f([dim, 1, 1, 1]),
                f([4, 1, 1, 1]),
                f([2 * dim, 8, 1, 1]),
                f([2 * dim, 8, 1, 1]),
                f([dim, 40, 1, 1]),
            ],
        );
        assert_eq!(
            l.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            [("ds4_comp_pool", (3, 1, 1)), ("ds4_comp_store", (1, 8, 1)),]
        );
        let idx_args = [
            f([16, 4, n, 1]),
            f([4, n, 1, 1]),
            f([16, 300, 1, 1]),
            i([n, 1, 1, 1]),
            f([300, n, 1, 1]),
        ];
        // A few tokens over a cache of 300 rows: four rows a block.
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4]), &idx_args);
        assert_eq!((l[0].0, l[0].1), ("ds4_index_scores_few", (75, 3, 1)));
        // A prefill chunk of 64 heads x 128: the tiled product, 128 rows x 2 tokens a
        // block; 4 heads do not tile (the row-a-lane kernel).
        let mm_args = [
            f([128, 64, 20, 1]),
            f([64, 20, 1, 1]),
            f([128, 300, 1, 1]),
            i([20, 1, 1, 1]),
            f([300, 20, 1, 1]),
        ];
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4]), &mm_args);
        assert_eq!((l[0].0, l[0].1), ("ds4_index_scores_mm_tc", (3, 10, 1)));
        // With the streamed kernel on and the tensor-core kernels' shared
        // memory, a chunk streams its rows past resident queries: 16 row tiles a block,
        // 106,496 bytes at 128 dims (two blocks an SM fit in 228 KB), in either precision.
        let tcs = idx_tcs_name().unwrap();
        FORCE_IDX_TCS.store(1, std::sync::atomic::Ordering::Relaxed);
        for (bf16, want) in [
            (0, tcs),
            (1, "ds4_index_scores_mm_tcs_bf16"),
            (2, "ds4_index_scores_mm_tcs"),
        ] {
            FORCE_IDX_BF16.store(bf16, std::sync::atomic::Ordering::Relaxed);
            let g = Rec::on(132, 227 * 1024);
            run(&g, ops::INDEX_SCORES, &prm(&[0.1, 0.5], &[4]), &mm_args)
                .expect("an op of this module")
                .unwrap();
            let l = g.0.borrow();
            assert_eq!((l[0].0, l[0].1), (want, (1, 10, 1)));
            assert_eq!(g.3.borrow()[..], [106_496]);
        }
        assert_eq!(idx_tcs_smem(128), 106_496);
        FORCE_IDX_BF16.store(0, std::sync::atomic::Ordering::Relaxed);
        FORCE_IDX_TCS.store(0, std::sync::atomic::Ordering::Relaxed);
        // Where a precision comes from: a force, else the variable, else plugins.toml.
        let (force, config) = (
            std::sync::atomic::AtomicU8::new(0),
            std::sync::atomic::AtomicU8::new(1),
        );
        let env = |v: Option<bool>| {
            let l = std::sync::OnceLock::new();
            l.set(Ok(v)).unwrap();
            l
        };
        assert_eq!(precision(&force, &env(None), "X", &config), Ok(true));
        assert_eq!(
            precision(&force, &env(Some(false)), "X", &config),
            Ok(false)
        );
        config.store(0, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(precision(&force, &env(None), "X", &config), Ok(false));
        force.store(1, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(precision(&force, &env(Some(false)), "X", &config), Ok(true));
        // The precision's values: f32, bf16; anything else says what it takes.
        let v = "MOE_GPU_IDX_PREC";
        assert_eq!(prec_bf16(v, "f32"), Ok(false));
        assert_eq!(prec_bf16(v, "bf16"), Ok(true));
        let e = prec_bf16(v, "fp8").unwrap_err();
        assert!(
            e.contains("MOE_GPU_IDX_PREC=fp8") && e.contains("\"bf16\""),
            "{e}"
        );
        // INDEX_SCORES with the switch forced (1 on, 2 off, 0 as configured) and `room`
        // bytes of the tensor-core kernels' shared memory.
        let forced = |force: u8, room: u32, a: &[TensorRef]| {
            FORCE_IDX_TCS.store(force, std::sync::atomic::Ordering::Relaxed);
            let l = run_on(
                Rec::on(132, room),
                ops::INDEX_SCORES,
                prm(&[0.1, 0.5], &[4]),
                a,
            );
            FORCE_IDX_TCS.store(0, std::sync::atomic::Ordering::Relaxed);
            l
        };
        // Too little room: the tiled kernel.
        let l = forced(1, 100_000, &mm_args);
        assert_eq!(l[0].0, "ds4_index_scores_mm_tc");
        // As configured (on unless MOE_GPU_IDX_TCS=0) with room: the streamed kernel.
        let on = std::env::var("MOE_GPU_IDX_TCS").as_deref() != Ok("0");
        let l = forced(0, 227 * 1024, &mm_args);
        let want = ["ds4_index_scores_mm_tc", tcs][on as usize];
        assert_eq!(l[0].0, want);
        // Off: the tiled kernel, room or not.
        let l = forced(2, 227 * 1024, &mm_args);
        assert_eq!(l[0].0, "ds4_index_scores_mm_tc");
        // A decode token over 6145+ cached rows and no bound: the tiled product; with
        // the engine's bound (i[2]) four rows a block, at most two blocks an SM.
        let mut dec = [
            f([128, 64, 1, 1]),
            f([64, 1, 1, 1]),
            f([128, 8000, 1, 1]),
            i([1, 1, 1, 1]),
            f([8000, 1, 1, 1]),
        ];
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4]), &dec);
        assert_eq!((l[0].0, l[0].1), ("ds4_index_scores_mm_tc", (63, 1, 1)));
        // With the streamed kernel on and its room: a block a row tile.
        let l = forced(1, 227 * 1024, &dec);
        assert_eq!((l[0].0, l[0].1), (tcs, (63, 1, 1)));
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4, 0, 520]), &dec);
        assert_eq!((l[0].0, l[0].1), ("ds4_index_scores_few", (130, 1, 1)));
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4, 0, 6144]), &dec);
        assert_eq!((l[0].0, l[0].1), ("ds4_index_scores_few", (264, 1, 1)));
        dec[2] = f([128, 4000, 1, 1]);
        dec[4] = f([4000, 1, 1, 1]);
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4]), &dec);
        assert_eq!(l[0].0, "ds4_index_scores_few");
        let mut few = mm_args;
        few[0] = f([16, 4, 20, 1]);
        few[1] = f([4, 20, 1, 1]);
        few[2] = f([16, 300, 1, 1]);
        let l = run_ok(ops::INDEX_SCORES, prm(&[0.1, 0.5], &[4]), &few);
        assert_eq!(l[0].0, "ds4_index_scores");
        // With inv_freq the queries' rotary happens in the kernel; more pairs than a head
        // holds are refused.
        let idx = |pairs: i64| {
            let mut a = idx_args.to_vec();
            a.push(f([8, 1, 1, 1]));
            (prm(&[0.1, 0.5, 1.0], &[4, pairs]), a)
        };
        let (pi, a) = idx(4);
        assert_eq!(run_ok(ops::INDEX_SCORES, pi, &a)[0].1, (75, 3, 1));
        let (pi, a) = idx(9);
        let e = run(&Rec::default(), ops::INDEX_SCORES, &pi, &a)
            .unwrap()
            .unwrap_err();
        assert!(e.contains("rotated pairs"), "{e}");
        run_ok(
            ops::TOPK_ROWS,
            prm(&[], &[4]),
            &[f([100, n, 1, 1]), i([n, 1, 1, 1]), i([8, n, 1, 1])],
        );
        // With work words: one token over many blocks (512 rows a block, at most 64 and
        // no more than the multiprocessors); several tokens, or one block's worth of
        // rows, keep a block a token.
        let words = i([ops::TOPK_ROWS_WORK_WORDS, 1, 1, 1]);
        let topk = |cap: u64, n: u64, sms: u32| {
            let a = [f([cap, n, 1, 1]), i([n, 1, 1, 1]), i([512, n, 1, 1]), words];
            let l = run_on(Rec::on(sms, 0), ops::TOPK_ROWS, prm(&[], &[4]), &a);
            (l[0].0, l[0].1 .0)
        };
        assert_eq!(topk(40000, 1, 132), ("ds4_topk_rows_wide", 64));
        assert_eq!(topk(8192, 1, 132), ("ds4_topk_rows_wide", 16));
        assert_eq!(topk(40000, 1, 20), ("ds4_topk_rows_wide", 20));
        assert_eq!(topk(40000, 2, 132), ("ds4_topk_rows", 2));
        assert_eq!(topk(512, 1, 132), ("ds4_topk_rows", 1));
        assert_eq!(topk(40000, 1, 0), ("ds4_topk_rows", 1));
        // q, kv, ring (16 rows), rows (40), sel (8 a token), sinks, pos, out.
        let att_for = |heads: u64, n: u64| {
            [
                f([d, heads, n, 1]),
                f([d, n, 1, 1]),
                f([d, 16, 1, 1]),
                f([d, 40, 1, 1]),
                i([8, n, 1, 1]),
                f([heads, 1, 1, 1]),
                i([n, 1, 1, 1]),
                f([d, heads, n, 1]),
            ]
        };
        let att_args = att_for(8, n);
        let l = run_ok(ops::SPARSE_ATTENTION, prm(&[0.1], &[4, 2]), &att_args);
        assert_eq!(
            l.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            [
                ("ds4_attention", (8, 3, 1)),
                ("ds4_window_store", (1, 3, 1)),
            ]
        );
        // The long-context hint: the keys split over blocks (two tiles' worth here), then
        // the merge.
        let l = run_ok(ops::SPARSE_ATTENTION, prm(&[0.1], &[4, 2, 0, 1]), &att_args);
        assert_eq!(
            l.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            [
                ("ds4_attention_heads", (1, 3, 2)),
                ("ds4_attention_merge", (8, 3, 1)),
                ("ds4_window_store", (1, 3, 1)),
            ]
        );
        // With inv_freq (q's norm + rotary, the output's inverse rotary in the kernel):
        // the same launches; more pairs than the head holds are refused.
        let att = |pairs: i64| {
            let mut a = att_args.to_vec();
            a.push(f([pairs.max(1) as u64, 1, 1, 1]));
            (prm(&[0.1, 1e-6, 1.0], &[4, 2, pairs]), a)
        };
        let (pa, a) = att(16);
        assert_eq!(run_ok(ops::SPARSE_ATTENTION, pa, &a).len(), 2);
        // One token: the attention kernel stores its row in the ring itself.
        let one = att_for(8, 1);
        let l = run_ok(ops::SPARSE_ATTENTION, prm(&[0.1], &[4, 2]), &one);
        assert_eq!(l.len(), 1);
        assert_eq!((l[0].0, l[0].1), ("ds4_attention", (8, 1, 1)));
        let l = run_ok(ops::SPARSE_ATTENTION, prm(&[0.1], &[4, 2, 0, 1]), &one);
        assert_eq!(
            l.iter().map(|x| (x.0, x.1)).collect::<Vec<_>>(),
            [
                ("ds4_attention_heads", (1, 1, 2)),
                ("ds4_attention_merge", (8, 1, 1)),
            ]
        );
        // One token with a sync word a head group (ABI 1.5) on a device that reports its
        // multiprocessors, ds4_attention_dec forced on: one launch, the splits as the split form's
        // (24 keys at most: 2), the ring store inside; with inv_freq or without.
        FORCE_ATT_DEC.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut dec = one.to_vec();
        dec.extend([f([16, 1, 1, 1]), i([1, 1, 1, 1])]);
        let dec_prm = prm(&[0.1, 1e-6, 1.0], &[4, 2, 16, 1]);
        let l = run_on(Rec::on(132, 0), ops::SPARSE_ATTENTION, dec_prm, &dec);
        assert_eq!(
            l.iter().map(|x| (x.0, x.1, x.2)).collect::<Vec<_>>(),
            [("ds4_attention_dec", (1, 1, 2), 256)]
        );
        // An inv_freq of no values: the same launch, no rotary inside.
        let mut plain = one.to_vec();
        plain.extend([f([0, 1, 1, 1]), i([1, 1, 1, 1])]);
        let l = run_on(
            Rec::on(132, 0),
            ops::SPARSE_ATTENTION,
            prm(&[0.1], &[4, 2, 0, 1]),
            &plain,
        );
        assert_eq!((l[0].0, l.len()), ("ds4_attention_dec", 1));
        // Without the long-context hint: a block a head.
        let l = run_on(
            Rec::on(132, 0),
            ops::SPARSE_ATTENTION,
            prm(&[0.1], &[4, 2]),
            &plain,
        );
        assert_eq!((l[0].0, l.len()), ("ds4_attention", 1));
        // Without a multiprocessor count (HIP) the launches stay apart.
        let l = run_on(Rec::default(), ops::SPARSE_ATTENTION, dec_prm, &dec);
        assert_eq!((l[0].0, l.len()), ("ds4_attention", 1));
        // A sync tensor with fewer words than head groups is refused.
        let mut wide = att_for(40, 1).to_vec();
        wide.extend([f([16, 1, 1, 1]), i([2, 1, 1, 1])]);
        let e = run(&Rec::on(132, 0), ops::SPARSE_ATTENTION, &dec_prm, &wide)
            .unwrap()
            .unwrap_err();
        assert!(e.contains("sparse_attention sync"), "{e}");
        FORCE_ATT_DEC.store(false, std::sync::atomic::Ordering::Relaxed);
        // ds4_attention_grp forced on, a decode step without the hint and the grouped
        // form's words after the one-launch form's (8 heads: 1 + 2): four heads a block
        // over key splits (24 keys at most, at least 16 a split: 2), the ring store
        // inside; with the one-launch form's word alone, or with the hint (the split
        // form's, which with the rotaries inside is a block a head), not.
        FORCE_ATT_GRP.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut grp = one.to_vec();
        grp.extend([
            f([16, 1, 1, 1]),
            i([ops::sparse_attention_sync_words(8), 1, 1, 1]),
        ]);
        let short = prm(&[0.1, 1e-6, 1.0], &[4, 2, 16]);
        let on_132 = |p: OpParams, a: &[TensorRef]| {
            run_on(Rec::on(132, 0), ops::SPARSE_ATTENTION, p, a)
                .iter()
                .map(|x| (x.0, x.1, x.2))
                .collect::<Vec<_>>()
        };
        assert_eq!(on_132(short, &grp), [("ds4_attention_grp", (2, 1, 2), 256)]);
        assert_eq!(on_132(short, &dec)[0].0, "ds4_attention");
        assert_eq!(on_132(dec_prm, &grp)[0].0, "ds4_attention");
        FORCE_ATT_GRP.store(false, std::sync::atomic::Ordering::Relaxed);
        // Its splits: within the multiprocessors (8 where none is reported), and no more
        // than the most keys need at 16 a split.
        assert_eq!(att_grp_splits(128 + 512, 64, 132), 8);
        assert_eq!(att_grp_splits(128 + 512, 64, 0), 8);
        assert_eq!(att_grp_splits(24, 64, 132), 2);
        assert_eq!(att_grp_splits(7, 64, 132), 1);
        assert_eq!(att_grp_splits(128 + 512, 1024, 132), 1);
        // The op's words: a word a head group of each form (ds4_attention_dec's, then
        // ds4_attention_grp's).
        assert_eq!(
            ops::sparse_attention_sync_words(64),
            64u64.div_ceil(ATT_HEADS_PER_BLOCK) + 64u64.div_ceil(ATT_GRP_HEADS)
        );
        // Not forced (nor MOE_GPU_ATT_DEC=1): the heads kernel + merge.
        let l = run_on(
            Rec::on(132, 0),
            ops::SPARSE_ATTENTION,
            prm(&[0.1], &[4, 2, 0, 1]),
            &plain,
        );
        assert_eq!(
            l.iter().map(|x| x.0).collect::<Vec<_>>(),
            ["ds4_attention_heads", "ds4_attention_merge"]
        );
        // The one-launch form's splits: the split form's, within the multiprocessors.
        assert_eq!(att_dec_splits(128 + 512, 4, 132), Some(40));
        assert_eq!(att_dec_splits(128 + 32768, 4, 132), Some(64));
        assert_eq!(att_dec_splits(128 + 32768, 8, 132), Some(33));
        assert_eq!(att_dec_splits(24, 4, 132), Some(2));
        assert_eq!(att_dec_splits(24, 4, 0), None);
        assert_eq!(att_dec_splits(24, 300, 132), None);
        // Split sizes: a split a tile of 16 keys, at most 64 splits a head group.
        assert_eq!(att_splits(24), (16, 2));
        assert_eq!(att_splits(128 + 512), (16, 40));
        assert_eq!(att_splits(128 + 1028), (16, 64));
        assert_eq!(att_splits(128 + 262_144), (16, 64));
        // Four heads a warp (MOE_GPU_ATT_HPW=4): 32 heads a block, the same arguments.
        assert_eq!(att_heads_prefill(true), ("ds4_attention_heads4", 32));
        assert_eq!(att_heads_prefill(false), ("ds4_attention_heads", 16));
        let sig = crate::kernels::signatures();
        assert_eq!(sig["ds4_attention_heads4"], sig["ds4_attention_heads"]);
        // A prefill chunk of 16 tokens or more: a block per 16 heads of a token (40 heads:
        // 3), the ring store after; with inv_freq still a block per head.
        let chunk = att_for(40, 20);
        let l = run_ok(ops::SPARSE_ATTENTION, prm(&[0.1], &[4, 2]), &chunk);
        assert_eq!(
            l.iter().map(|x| (x.0, x.1, x.2)).collect::<Vec<_>>(),
            [
                ("ds4_attention_heads", (3, 20, 1), 256),
                ("ds4_window_store", (1, 16, 1), 256),
            ]
        );
        // Where the backend gives ds4_attention_tc its shared memory (queries, two key
        // tiles at stride d + 4, 2048 floats of partial logits, 32 flags): a block per 64
        // heads of a token, that much dynamic shared memory; a byte less, the heads kernel.
        // (f32 forced: the test does not depend on MOE_GPU_ATT_PREC)
        let tc_smem = 4 * (96 * (d as u32 + 4) + 2048 + 32);
        assert_eq!(att_tc_smem(512), 206_464);
        let g = Rec::on(132, tc_smem);
        FORCE_ATT_BF16.store(2, std::sync::atomic::Ordering::Relaxed);
        let r = run(&g, ops::SPARSE_ATTENTION, &prm(&[0.1], &[4, 2]), &chunk);
        FORCE_ATT_BF16.store(0, std::sync::atomic::Ordering::Relaxed);
        r.unwrap().unwrap();
        assert_eq!(
            (g.0.borrow()[0].0, g.0.borrow()[0].1, g.3.borrow()[0]),
            ("ds4_attention_tc", (1, 20, 1), tc_smem)
        );
        assert_eq!(sig["ds4_attention_tc"], sig["ds4_attention_heads"]);
        // Its bf16 form where asked for (the same arguments and room).
        FORCE_ATT_BF16.store(1, std::sync::atomic::Ordering::Relaxed);
        let g = Rec::on(132, tc_smem);
        let r = run(&g, ops::SPARSE_ATTENTION, &prm(&[0.1], &[4, 2]), &chunk);
        FORCE_ATT_BF16.store(0, std::sync::atomic::Ordering::Relaxed);
        r.unwrap().unwrap();
        assert_eq!(
            (g.0.borrow()[0].0, g.3.borrow()[0]),
            ("ds4_attention_tc_bf16", tc_smem)
        );
        assert_eq!(sig["ds4_attention_tc_bf16"], sig["ds4_attention_tc"]);
        let g = Rec::on(132, tc_smem - 1);
        run(&g, ops::SPARSE_ATTENTION, &prm(&[0.1], &[4, 2]), &chunk)
            .unwrap()
            .unwrap();
        assert_eq!(g.0.borrow()[0].0, "ds4_attention_heads");
        let mut roped = chunk.to_vec();
        roped.push(f([16, 1, 1, 1]));
        let l = run_ok(
            ops::SPARSE_ATTENTION,
            prm(&[0.1, 1e-6, 1.0], &[4, 2, 16]),
            &roped,
        );
        assert_eq!((l[0].0, l[0].1), ("ds4_attention", (40, 20, 1)));
        let (pa, a) = att(d as i64 / 2 + 1);
        let e = run(&Rec::default(), ops::SPARSE_ATTENTION, &pa, &a)
            .unwrap()
            .unwrap_err();
        assert!(e.contains("rotated pairs"), "{e}");
        run_ok(
            ops::ROUTER,
            prm(&[1.5], &[4, 1, 1]),
            &[
                f([16, n, 1, 1]),
                f([16, 1, 1, 1]),
                i([1, 1, 1, 1]),
                i([n, 1, 1, 1]),
                i([2, n, 1, 1]),
                f([2, n, 1, 1]),
            ],
        );
        run_ok(ops::SWIGLU, prm(&[7.0], &[]), &[f([10, n, 1, 1]); 3]);
        run_ok(
            ops::MOE_COMBINE,
            OpParams::default(),
            &[
                f([d, 2, n, 1]),
                f([2, n, 1, 1]),
                f([d, n, 1, 1]),
                f([d, n, 1, 1]),
            ],
        );
        let l = run_ok(
            ops::TRANSPOSE12,
            OpParams::default(),
            &[f([300, 2, 3, 1]), f([300, 3, 2, 1])],
        );
        assert_eq!(l[0].1, (2, 2, 3));
        // Dense grouped product: q8_0 experts [64, 10, 4], 2 slots x 3 tokens.
        let g = Rec::default();
        let w = TensorRef {
            type_id: types::Q8_0,
            ..f([64, 10, 4, 1])
        };
        matmul_id_dense(
            &g,
            &[w, f([64, 3, 1, 1]), i([2, 3, 1, 1]), f([10, 6, 1, 1])],
            false,
        )
        .unwrap()
        .unwrap();
        let (name, grid, _, np) = g.0.borrow()[0];
        assert_eq!((name, grid), ("matvec_dense_id", (2, 6, 1)));
        assert_eq!(Some(&(np + 1)), signatures().get(name));
        assert!(matmul_id_dense(&g, &[TensorRef { type_id: 107, ..w }], false).is_none());
        // The launch a grouped product makes, its parameters checked against the kernel.
        let grouped = |a: [TensorRef; 4]| {
            matmul_id_dense(&g, &a, false).unwrap().unwrap();
            let (name, grid, block, np) = *g.0.borrow().last().unwrap();
            assert_eq!(Some(&(np + 1)), signatures().get(name));
            (name, grid, block)
        };
        // 512 rows: a block on two rows per pair.
        let w = TensorRef {
            type_id: types::Q8_0,
            ..f([64, 512, 4, 1])
        };
        assert_eq!(
            grouped([w, f([64, 3, 1, 1]), i([2, 3, 1, 1]), f([512, 6, 1, 1])]),
            ("matvec_dense_rows_id", (256, 6, 1), 128)
        );
        // The output projection's 8 ROCmFP4 groups of 4096 x 1024, one token (a column
        // per pair): the runs kernel, 2 rows x 512 threads = 64 rows a block.
        let w = TensorRef {
            type_id: 100,
            ..f([4096, 1024, 8, 1])
        };
        assert_eq!(
            grouped([w, f([4096, 8, 1, 1]), i([8, 1, 1, 1]), f([1024, 8, 1, 1])]),
            ("matvec_fp4_runs_q8_id", (16, 8, 1), 512)
        );
        // The matrix-unit form takes the same arguments but `fixed` (the host leaves it
        // out there; its counters pointer once read the flag).
        let sig = signatures();
        assert_eq!(
            sig.get("matvec_fp4_runs_q8_id").copied(),
            sig.get("matvec_fp4_mma_id").map(|n| n + 1)
        );
        // Two tokens (a prefill that does not take MMQ): f32 activations, the rows kernel.
        assert_eq!(
            grouped([w, f([4096, 16, 1, 1]), i([8, 2, 1, 1]), f([1024, 16, 1, 1])]),
            ("matvec_dense_rows_id", (512, 16, 1), 128)
        );
    }

    #[test]
    fn bad_shapes_are_refused_with_the_op_named() {
        let g = Rec::default();
        let err = |op, p, a: &[TensorRef]| run(&g, op, &p, a).unwrap().unwrap_err();
        let e = err(ops::NORM_ROPE, prm(&[], &[1, 0, 0]), &[f([63, 1, 1, 1]); 5]);
        assert!(e.starts_with("norm_rope") && e.contains("63"), "{e}");
        let e = err(
            ops::HC_POST,
            OpParams::default(),
            &[f([8, 9, 1, 1]), f([8, 1, 1, 1]), f([99, 1, 1, 1])],
        );
        assert!(e.contains("9 streams"), "{e}");
        let (s, wts) = (f([8, 2, 1, 1]), f([8, 1, 1, 1]));
        let e = err(
            ops::HC_POST,
            OpParams::default(),
            &[s, f([7, 6, 1, 1]), wts, f([6, 1, 1, 1])],
        );
        assert!(e.contains("do not match streams of 8 x 1"), "{e}");
        let e = err(
            ops::HC_POST,
            OpParams::default(),
            &[s, f([8, 6, 1, 1]), wts, f([5, 1, 1, 1])],
        );
        assert!(e.contains("hc_post routing weights"), "{e}");
        let e = err(ops::HC_POST, OpParams::default(), &[s; 6]);
        assert!(e.contains("3 to 5 tensor arguments"), "{e}");
        let e = err(
            ops::SPARSE_ATTENTION,
            prm(&[], &[0, 1]),
            &[f([1024, 1, 1, 1]); 8],
        );
        assert!(e.starts_with("sparse_attention"), "{e}");
        let e = err(
            ops::ROUTER,
            prm(&[], &[4, 1, 0]),
            &[
                f([16, 1, 1, 1]),
                f([16, 1, 1, 1]),
                i([1, 1, 1, 1]),
                i([1, 1, 1, 1]),
                i([17, 1, 1, 1]),
                f([17, 1, 1, 1]),
            ],
        );
        assert!(e.starts_with("router") && e.contains("17"), "{e}");
        let e = err(ops::TOPK_ROWS, prm(&[], &[4]), &[f([10, 1, 1, 1])]);
        assert!(e.contains("expected 3 or 4 tensor arguments"), "{e}");
        let e = err(
            ops::TOPK_ROWS,
            prm(&[], &[4]),
            &[
                f([10, 1, 1, 1]),
                i([1, 1, 1, 1]),
                i([4, 1, 1, 1]),
                i([100, 1, 1, 1]),
            ],
        );
        assert!(e.contains("topk_rows work words"), "{e}");
        let e = err(
            ops::HC_PRE,
            prm(&[], &[20, 0]),
            &[
                f([8, 4, 1, 1]),
                f([24, 1, 1, 1]),
                f([3, 1, 1, 1]),
                f([24, 1, 1, 1]),
                f([8, 1, 1, 1]),
                f([8, 1, 1, 1]),
                i([24, 1, 1, 1]),
            ],
        );
        assert!(e.contains("hc_pre weights"), "{e}");
        assert!(g.0.borrow().is_empty());
        assert!(run(&g, ops::MATMUL, &OpParams::default(), &[]).is_none());
        // More tokens than grid y allows is refused (the engine splits chunks); an empty
        // chunk launches nothing.
        let n = 70000;
        let e = err(
            ops::HC_POST,
            OpParams::default(),
            &[f([8, 2, n, 1]), f([8, n, 1, 1]), f([8, n, 1, 1])],
        );
        assert!(e.contains("grid y = 70000 is more than 65535"), "{e}");
        let none = [f([8, 2, 0, 1]), f([8, 0, 1, 1]), f([8, 0, 1, 1])];
        run(&g, ops::HC_POST, &OpParams::default(), &none)
            .unwrap()
            .unwrap();
        assert!(g.0.borrow().is_empty());
        let e = err(
            ops::INDEX_SCORES,
            prm(&[], &[4]),
            &[
                f([16, 300, 1, 1]),
                f([300, 1, 1, 1]),
                f([16, 10, 1, 1]),
                i([1, 1, 1, 1]),
                f([10, 1, 1, 1]),
            ],
        );
        assert!(e.starts_with("index_scores"), "{e}");
    }
}
