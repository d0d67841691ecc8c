//! The DeepSeek-V4 forward with activations and every cache (sliding window, compressor
//! rings and rows, indexer rows, mHC streams) resident on the device: a step is a
//! queue of backend ops (weight products and the glue ops of ABI 1.1) between one
//! upload (token ids, positions) and one download (logits). Single-token steps of a
//! slot are recorded once as a graph and replayed, where the backend can.
//!
//! Used when the backend runs the glue ops (probed at load); otherwise the host glue
//! in `super` runs. Same maths; summation orders differ (see docs/notes).

use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use moe_plugin_api::{ops, OpParams, TensorRef};

use super::{math::Rope, CompWeights, Deepseek4, Ds4Params, Indexer, Layer, GATING_SIGMOID};
use crate::device::{Device, Tensor};

mod mark;
mod mtp;
use mark::Mark;
use mtp::{DevMtp, MtpWork};

/// A graph key per slot; decode steps of one token replay it.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum GraphState {
    /// Not run yet at this shape: run directly once so scratch memory settles.
    Cold,
    /// Ran once: record the next step.
    Warm,
    Recorded,
    /// Recording or replay failed: run directly from now on.
    Off,
}

struct DevComp {
    ape: Tensor,
    norm: Tensor,
}

struct DevLayer {
    attn_norm: Tensor,
    ffn_norm: Tensor,
    hc_attn: (Tensor, Tensor),
    hc_ffn: (Tensor, Tensor),
    q_a_norm: Tensor,
    kv_norm: Tensor,
    sinks: Tensor,
    comp: Option<DevComp>,
    idx: Option<DevComp>,
    bias: Option<Tensor>,
    tid2eid: Option<Tensor>,
}

/// A compressor's state: the last 2 * ratio projected inputs and the rows so far.
struct CompState {
    ring_kv: Tensor,
    ring_g: Tensor,
    rows: Tensor,
}

struct LayerState {
    /// K=V rows of the last `window` positions, position q at q % window.
    ring: Tensor,
    comp: Option<CompState>,
    idx: Option<CompState>,
}

/// Activations of a chunk of up to `cap` tokens.
struct Work {
    cap: usize,
    /// Rows of logits it holds (a prefill chunk wants one; a drafted pass all of its).
    logit_rows: usize,
    tok_rep: Tensor,
    tokens: Tensor,
    pos: Tensor,
    want: Tensor,
    streams: Tensor,
    /// mHC post + pre's block counts (HC_POST_PRE), zero between ops.
    hc_sync: Tensor,
    /// The decode attention's barrier words (a word per 16 heads), zero at first.
    att_sync: Tensor,
    /// ROUTER's block counts (with its product, ABI 1.7), zero between ops.
    router_sync: Tensor,
    /// MOE_ROUTED's barrier word (zero at first, kept between steps).
    moe_sync: Tensor,
    /// TOPK_ROWS's work words (zero, kept between steps; see `topk_work`).
    topk_work: Tensor,
    mix: Tensor,
    wts: Tensor,
    x: Tensor,
    /// x quantised by the MoE's mHC site for its grouped products (one token's worth;
    /// HC_POST_PRE's and MATMUL_ID_MULTI's xq, see `probe_xq`).
    xq: Tensor,
    q_res: Tensor,
    /// NORM_MATMUL's normed input, where the backend stores it (see `norm_mm`).
    q_resn: Tensor,
    q: Tensor,
    kv: Tensor,
    ck: Tensor,
    cg: Tensor,
    ik: Tensor,
    ig: Tensor,
    iq: Tensor,
    iw: Tensor,
    scores: Tensor,
    sel: Tensor,
    att: Tensor,
    att_t: Tensor,
    mid: Tensor,
    mid_t: Tensor,
    ao: Tensor,
    rl: Tensor,
    rids: Tensor,
    rw: Tensor,
    eg: Tensor,
    eu: Tensor,
    ea: Tensor,
    ey: Tensor,
    sg: Tensor,
    su: Tensor,
    sa: Tensor,
    sy: Tensor,
    mo: Tensor,
    hidden: Tensor,
    hsel: Tensor,
    logits: Tensor,
    /// The MTP block's inputs, where a drafter is loaded.
    mtp: Option<MtpWork>,
}

/// Tokens per device pass (see `GpuPath::run`): 16 routed experts x 2048 < 65535.
const MAX_CHUNK: usize = 2048;
/// Steps reaching this position (their last one at least this), or whose indexer selects
/// (see StepKind), send SPARSE_ATTENTION's long-context hint: the GPU backends then split
/// a decode step's keys over blocks where their heads kernel applies (2026-12-01 A/Bs
/// with the split forced at every depth: +5-7% decode at 4096, flat at depth 0). Steps
/// on either side of it replay graphs of their own (see `GpuPath::graph_id`).
const ATT_LONG_FROM: usize = 4096;

/// What a step's recorded ops depend on besides its shapes: `long`, the step reaches
/// ATT_LONG_FROM (SPARSE_ATTENTION's long-context hint); `short`, every token of it sees
/// at most the indexer's top-k compressed rows, so the indexer would select all of them
/// in order: its layers then attend to every visible row (SPARSE_ATTENTION mode 1, the
/// same keys in the same order) and skip the indexer's query and head-weight products,
/// scores and top-k (its compressor still runs): depth-0 decode +12%, pp512 +3% on the
/// 43-layer V4-Flash shape (H200, 2026-12-01). `MOE_DS4_IDX_SHORT=0` turns it off (A/B
/// runs). `wide_topk`: a token of it sees more than TOPK_WIDE_FROM_ROWS compressed rows,
/// so the indexer's top-k gets its work words (TOPK_ROWS on many blocks).
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
struct StepKind {
    long: bool,
    short: bool,
    wide_topk: bool,
}

/// Visible compressed rows from which a decode step's top-k runs on many blocks: alone
/// on the H200 (2026-12-04, scripts/device/topk_bench.sh) the many-block form takes ~17
/// us at any size, one block 11.4 us at 1024 rows and 20.4 at 8192 (even at ~5000-5500
/// if linear; the sizes between were not timed, so they keep one block).
const TOPK_WIDE_FROM_ROWS: usize = 6144;

impl StepKind {
    /// A number per kind, 0 - 7 (graph ids).
    fn code(self) -> usize {
        self.long as usize | (self.short as usize) << 1 | (self.wide_topk as usize) << 2
    }

    /// The kind of a step of `n` tokens from position `p0`, with indexer layers of
    /// compression `idx_ratio` at the least (0: none) choosing `top_k` rows.
    fn of(idx_ratio: usize, top_k: usize, p0: usize, n: usize) -> StepKind {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var_os("MOE_DS4_IDX_SHORT").is_none_or(|v| v != "0"));
        StepKind::decide(on, idx_ratio, top_k, p0, n)
    }

    fn decide(on: bool, idx_ratio: usize, top_k: usize, p0: usize, n: usize) -> StepKind {
        // Token p sees (p + 1) / ratio compressed rows; the last token sees the most.
        let few_rows = idx_ratio > 0 && (p0 + n) / idx_ratio <= top_k;
        StepKind {
            // Once the indexer selects, a scoring layer's token attends to its window and
            // all top_k rows: as many keys as far into a long context, where the split
            // form pays (H100, 20 layers, positions 2048+: +2.1% and +4.1% decode).
            long: p0 + n > ATT_LONG_FROM || (idx_ratio > 0 && !few_rows),
            short: on && few_rows,
            wide_topk: idx_ratio > 0 && (p0 + n) / idx_ratio > TOPK_WIDE_FROM_ROWS,
        }
    }
}

pub(super) struct GpuPath {
    layers: Vec<DevLayer>,
    /// The MTP drafter's block, where one is loaded.
    mtp: Option<DevMtp>,
    head: (Tensor, Tensor),
    out_norm: Tensor,
    inv_main: (Tensor, f32),
    inv_comp: (Tensor, f32),
    slots: Vec<Option<Vec<LayerState>>>,
    /// Per graph id (see [`GpuPath::graph_id`]: one a slot, length and step kind): its
    /// state.
    graphs: std::collections::HashMap<usize, GraphState>,
    /// The state a graph starts in (Off with `MOE_DS4_NO_GRAPH=1`: every step op by op).
    graph_start: GraphState,
    /// Drafted passes are recorded and replayed as graphs too, one a slot and pass length
    /// (`MOE_DS4_DRAFT_GRAPH=0` runs them op by op: H100 2026-12-06, 4-token passes
    /// 11% faster as graphs, the fixtures' drafted logits the same bits either way).
    draft_graphs: bool,
    /// Activations of drafted passes that run as graphs (never reallocated: a graph
    /// keeps their addresses).
    work_d: Option<Work>,
    /// The least compression of a layer with an indexer (0: none; see StepKind).
    idx_ratio: usize,
    work: Option<Work>,
    work1: Option<Work>,
    /// Largest compressed-row count (n_ctx / ratio + 1) per layer.
    idx_cap: usize,
    /// 0..o_groups: a single token's grouped output projection is one MATMUL_ID with
    /// group g as "expert" g; its first element (0) is the shared expert's one id in
    /// [`GpuPath::shexp_down`].
    group_ids: Tensor,
    /// Those two products mark `group_ids` fixed (i[0] = 1, ABI 1.12: uploaded here,
    /// never written), so a backend may stream their weights before the ops ahead of
    /// them finish (`MOE_DS4_FIXED_IDS=0`: unmarked; A/B runs).
    fixed_ids: i64,
    /// The backend runs MATMUL_MULTI and MATMUL_ID_MULTI (ABI 1.2; probed with the
    /// first): one op for the products of one input.
    multi: bool,
    /// The backend runs SWIGLU_MATMUL_ID (ABI 1.3): the routed experts' down product
    /// takes their gate and up outputs, the SwiGLU fused where the backend can.
    swiglu_id: bool,
    /// The shared expert's SwiGLU and down product of a decode step as one
    /// SWIGLU_MATMUL_ID too (`MOE_DS4_SHEXP_SWIGLU=0`: SWIGLU, then MATMUL; A/B runs).
    shexp_swiglu_id: bool,
    /// The backend's HC_POST combines the MoE's outputs itself (ABI 1.3): no
    /// MOE_COMBINE op.
    post_combine: bool,
    /// The backend runs HC_POST_PRE (ABI 1.4): mHC post, the next site's mixes and
    /// mHC pre as one op.
    hc_fused: bool,
    /// A site's Sinkhorn (HC_SINKHORN, ABI 1.4) runs on its own side stream (SIDE_HC),
    /// off the main stream's path: only the next site's post reads the comb matrix.
    hc_defer: bool,
    /// q's norm and rotary, and the output's inverse rotary, in the attention kernel
    /// (SPARSE_ATTENTION's inv_freq, ABI 1.4; opt-in, see `probe_att_rope`).
    att_rope: bool,
    /// SPARSE_ATTENTION takes its sync words (ABI 1.5: a decode step's attention in one
    /// launch, see `probe_att_sync`).
    att_sync: bool,
    /// TOPK_ROWS takes its work words (ABI 1.6: one token's selection on many blocks,
    /// see `probe_topk_work`).
    topk_work: bool,
    /// ROUTER takes x and the router's weights (ABI 1.7): the product and the selection
    /// as one op (see `probe_router_mm`).
    router_mm: bool,
    /// A decode step's MoE site quantises x for the routed experts' gate and up
    /// products (HC_POST_PRE's xq, ABI 1.10), which then skip their own quantisation
    /// launch (see `probe_xq`).
    xq: bool,
    /// A decode step's router, routed gate + up and down as one op (MOE_ROUTED, ABI
    /// 1.13: one launch on CUDA; opt-in, `MOE_DS4_MOE_ROUTED=1`: see
    /// `probe_moe_routed`).
    moe_routed: bool,
    /// A decode step's MoE site routes too (HC_POST_PRE's routing, ABI 1.11): the
    /// router's product and selection in the site's launch, not one of their own
    /// (opt-in, `MOE_DS4_SITE_ROUTE=1`: see `probe_site_route`).
    site_route: bool,
    /// q_a's norm inside `wq_b`'s product (NORM_MATMUL, ABI 1.8) where no indexer reads
    /// the normed q_res (opt-in, `MOE_DS4_NORM_MM=1`: see `probe_norm_mm`).
    norm_mm: bool,
    /// The indexer queries' rotary in the scoring kernel (INDEX_SCORES' inv_freq, ABI
    /// 1.4; opt-in, see `probe_idx_rope`).
    idx_rope: bool,
    /// Streams for the branches of a layer that do not depend on each other (the
    /// compressor, and the indexer, next to the queries; the shared expert next to the
    /// routed ones; the mHC sites' Sinkhorns next to what follows them): their kernels,
    /// each too small to fill the device, overlap. Empty:
    /// every op on the main stream (`MOE_DS4_BRANCHES=0`, or no more streams).
    sides: Vec<Arc<Device>>,
    /// Bit i: branch i is forked and not joined yet (a failed step joins these); bit
    /// PF: the prefetch stream.
    open: std::cell::Cell<u8>,
    /// Which weights a decode step asks into L2 ahead of their products, on `pf`.
    prefetch: Prefetch,
    pf: Option<Arc<Device>>,
    /// A PREFETCH failed (warned once).
    pf_failed: std::cell::Cell<bool>,
    /// The most tokens a drafted pass may hold: the fewest rows of any ring, so a pass
    /// writes no ring row twice.
    pub(super) pass_cap: usize,
    /// 0, 1, 2 ..: the row ids of the copies that restore ring rows, and of a prompt
    /// mark's whole-ring copies (as many as the longest ring, or the MTP block's tail of
    /// pass_cap + 1 rows, has).
    iota: Tensor,
    /// Per slot: the ring rows its last drafted pass overwrote (see [`Rollback`]).
    rollback: Vec<Option<Rollback>>,
    /// Per slot: its rings at the end of its latest prefill chunk (see [`Mark`]).
    marks: Vec<Option<Mark>>,
}

/// What a slot needs to go back into its last pass (speculative decoding drops the
/// drafts the model did not choose). Every cache of the device path is positional: the
/// window's ring (position q at row q % window), the compressors' rings of their last
/// 2 x ratio inputs (row q % (2 ratio)) and the compressed rows (row q / ratio, which a
/// later pass writes again before any position can see it). So going back to position
/// `to` only needs the ring rows the pass overwrote from `to` on, copied before it ran;
/// a pass holds at most as many tokens as the smallest ring has rows, so no row is
/// written twice.
struct Rollback {
    /// The saved pass's first position and length.
    p0: usize,
    n: usize,
    /// Per layer: copies of the ring rows of positions p0..p0 + n before the pass, one
    /// a ring of [`rings`].
    rows: Vec<Vec<Tensor>>,
    /// Per ring length: which rows positions p0.. take in such a ring.
    ids: Vec<(usize, Tensor)>,
}

/// Weights a decode step asks into the device's L2 (PREFETCH, ABI 1.9) on a stream of
/// their own while the memory would otherwise idle under the glue before them: `q` (the
/// query / KV products, at the mHC site before attention), `o` (the output products,
/// once `wq_b` is queued: under the attention; `ob` the second one, `wo_b`, alone: the
/// first loads its own rows while it waits) and `moe` (the router's and the shared
/// expert's, at the mHC site before the MoE) and `qn` (the next layer's query / KV
/// products, at the mHC site before the MoE too: the MoE's glue is longer than its own
/// weights take). `MOE_DS4_PREFETCH`: 1 (q, o, moe), 0 or unset (none: the default
/// until measured), or a list such as `qn,o,moe`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Prefetch {
    q: bool,
    o: bool,
    ob: bool,
    moe: bool,
    qn: bool,
}

impl Prefetch {
    fn from_env() -> Result<Prefetch> {
        let Ok(v) = std::env::var("MOE_DS4_PREFETCH") else {
            return Ok(Prefetch::default());
        };
        Self::parse(&v).ok_or_else(|| {
            anyhow!("MOE_DS4_PREFETCH={v}: expected 0, 1 or a list of q, o, ob, moe and qn")
        })
    }

    fn parse(v: &str) -> Option<Prefetch> {
        match v.trim() {
            "" | "0" => return Some(Prefetch::default()),
            "1" => {
                return Some(Prefetch {
                    q: true,
                    o: true,
                    moe: true,
                    ..Prefetch::default()
                })
            }
            _ => {}
        }
        let mut p = Prefetch::default();
        for part in v.split(',').map(str::trim) {
            match part {
                "q" => p.q = true,
                "o" => p.o = true,
                "ob" => p.ob = true,
                "moe" => p.moe = true,
                "qn" => p.qn = true,
                _ => return None,
            }
        }
        Some(p)
    }

    fn any(&self) -> bool {
        self.q || self.o || self.ob || self.moe || self.qn
    }
}

/// Largest chunk whose rotaries run inside the attention / scoring kernels (decode
/// steps; a prefill chunk's many blocks would each repeat the sines and cosines).
const FUSED_ROPE_MAX_TOKENS: usize = 16;

/// Side streams of [`GpuPath`] (`MOE_DS4_BRANCHES=N`: N of them, at most 3; with fewer,
/// the branches past the last stream share it).
const SIDES: usize = 3;
/// The GGUF type id of ROCmFP4 (docs: the ROCmFPx spec), whose shared-expert down product
/// takes the fused SwiGLU.
const TYPE_ROCMFP4: u32 = 100;
/// The compressor's branch, and the shared expert's.
const SIDE_COMP: usize = 0;
/// The indexer's branch.
const SIDE_IDX: usize = 1;
/// The mHC sites' deferred Sinkhorns. On a stream of their own: on the compressor's
/// they held up the shared expert (and the compressor's products) by the Sinkhorn's
/// ~4.5 us, which start as the site ends (H100 trace, 2026-12-06 10:51).
const SIDE_HC: usize = 2;
/// The prefetch stream's bit in `open` (see [`Prefetch`]).
const PF: usize = SIDES;

fn upload(dev: &Arc<Device>, v: &[f32]) -> Result<Tensor> {
    let t = dev.f32([v.len().max(1) as u64, 1, 1, 1])?;
    if !v.is_empty() {
        t.upload_f32(v)?;
    }
    Ok(t)
}

fn zeros_i32(dev: &Arc<Device>, n: usize) -> Result<Tensor> {
    let t = dev.i32(n)?;
    t.upload_i32(&vec![0; n])?;
    Ok(t)
}

fn f32s(dev: &Arc<Device>, n: usize) -> Result<Tensor> {
    dev.f32([n.max(1) as u64, 1, 1, 1])
}

/// `t` seen as `dims` from f32/i32 element `at`.
fn at(t: &Tensor, at: usize, dims: [usize; 4]) -> TensorRef {
    TensorRef {
        offset: t.r.offset + 4 * at as u64,
        dims: dims.map(|d| d as u64),
        ..t.r
    }
}

fn v(t: &Tensor, dims: [usize; 4]) -> TensorRef {
    at(t, 0, dims)
}

/// The [k, m] product view of a weight (its leading two dims).
fn wv(t: &Tensor) -> TensorRef {
    TensorRef {
        dims: [t.r.dims[0], t.r.dims[1], 1, 1],
        ..t.r
    }
}

/// See [`GpuPath::graph_id`] (`slots` slots; the MTP chain's ids are below these).
fn graph_key(slots: usize, slot: usize, n: usize, kind: StepKind) -> usize {
    ((kind.code() + 1) * (MAX_CHUNK + 1) + n) * slots + slot
}

fn pr(f: &[f32], i: &[i64]) -> OpParams {
    let mut p = OpParams::default();
    p.f[..f.len()].copy_from_slice(f);
    p.i[..i.len()].copy_from_slice(i);
    p
}

impl GpuPath {
    /// Device copies of the small tensors, or None when the backend does not run the
    /// glue ops (the probe's "not supported").
    pub(super) fn new(m: &Deepseek4) -> Result<Option<GpuPath>> {
        let dev = &m.dev;
        if std::env::var_os("MOE_DS4_HOST_GLUE").is_some_and(|v| v == "1") || !probe(dev) {
            return Ok(None);
        }
        let layers = m
            .layers
            .iter()
            .map(|l| dev_layer(dev, l))
            .collect::<Result<Vec<_>>>()?;
        let inv = |r: &Rope| -> Result<(Tensor, f32)> { Ok((upload(dev, &r.inv_freq)?, r.mscale)) };
        let want = match std::env::var("MOE_DS4_BRANCHES") {
            Ok(v) => v
                .parse::<usize>()
                .ok()
                .filter(|&n| n <= SIDES)
                .ok_or_else(|| anyhow!("MOE_DS4_BRANCHES={v}: expected 0 to {SIDES}"))?,
            Err(_) => SIDES,
        };
        let sides: Vec<Arc<Device>> = (0..want)
            .map_while(|_| {
                dev.another_stream()
                    .inspect_err(|e| tracing::debug!("deepseek4: fewer streams: {e:#}"))
                    .ok()
            })
            .collect();
        let min_ratio =
            m.p.ratios
                .iter()
                .filter(|&&r| r > 0)
                .min()
                .copied()
                .unwrap_or(1);
        let swiglu_id = probe_swiglu_id(dev);
        let (multi, hc_fused) = (probe_multi(dev), probe_hc_fused(dev));
        let mut prefetch = Prefetch::from_env()?;
        let pf = match prefetch.any() {
            true if !probe_prefetch(dev) => {
                tracing::warn!("MOE_DS4_PREFETCH: the backend cannot prefetch here; off");
                None
            }
            true => dev
                .another_stream()
                .inspect_err(|e| tracing::warn!("MOE_DS4_PREFETCH: no stream for it: {e:#}"))
                .ok(),
            false => None,
        };
        if pf.is_none() {
            prefetch = Prefetch::default();
        }
        Ok(Some(GpuPath {
            layers,
            mtp: None,
            head: (upload(dev, &m.hc_head.1)?, upload(dev, &m.hc_head.2)?),
            out_norm: upload(dev, &m.out_norm)?,
            inv_main: inv(&m.rope_main)?,
            inv_comp: inv(&m.rope_comp)?,
            slots: (0..m.slots.len()).map(|_| None).collect(),
            graphs: Default::default(),
            // MOE_DS4_NO_GRAPH=1 (profiling): every step launched op by op.
            graph_start: if std::env::var_os("MOE_DS4_NO_GRAPH").is_some_and(|v| v == "1") {
                GraphState::Off
            } else {
                GraphState::Cold
            },
            draft_graphs: std::env::var_os("MOE_DS4_DRAFT_GRAPH").is_none_or(|v| v != "0"),
            work_d: None,
            idx_ratio: m
                .layers
                .iter()
                .filter_map(|l| l.indexer.as_ref().map(|ix| ix.comp.ratio))
                .min()
                .unwrap_or(0),
            work: None,
            work1: None,
            idx_cap: m.n_ctx / min_ratio + 1,
            group_ids: {
                let ids: Vec<i32> = (0..m.p.o_groups as i32).collect();
                let t = dev.i32(ids.len())?;
                t.upload_i32(&ids)?;
                t
            },
            fixed_ids: i64::from(std::env::var_os("MOE_DS4_FIXED_IDS").is_none_or(|v| v != "0")),
            multi,
            swiglu_id,
            shexp_swiglu_id: swiglu_id
                && std::env::var_os("MOE_DS4_SHEXP_SWIGLU").is_none_or(|v| v != "0"),
            post_combine: probe_post_combine(dev),
            hc_fused,
            xq: hc_fused && multi && probe_xq(dev),
            site_route: hc_fused && probe_site_route(dev),
            att_rope: probe_att_rope(dev),
            att_sync: probe_att_sync(dev),
            topk_work: probe_topk_work(dev),
            router_mm: probe_router_mm(dev),
            moe_routed: multi && swiglu_id && probe_moe_routed(dev),
            norm_mm: probe_norm_mm(dev),
            idx_rope: probe_idx_rope(dev),
            hc_defer: !sides.is_empty() && probe_hc_sinkhorn(dev),
            sides,
            open: Default::default(),
            prefetch,
            pf,
            pf_failed: Default::default(),
            pass_cap: pass_cap(m),
            iota: {
                let n = ring_lengths(m).max().unwrap_or(1).max(pass_cap(m) + 1);
                let ids: Vec<i32> = (0..n as i32).collect();
                let t = dev.i32(n)?;
                t.upload_i32(&ids)?;
                t
            },
            rollback: (0..m.slots.len()).map(|_| None).collect(),
            marks: (0..m.slots.len()).map(|_| None).collect(),
        }))
    }

    /// Before a pass of `n` tokens of `slot` from `p0`: with `drafts`, copies the ring
    /// rows the pass will overwrite so the slot can go back into it ([`Rollback`]);
    /// without, forgets the last copy (the slot has moved past it).
    pub(super) fn checkpoint(
        m: &mut Deepseek4,
        slot: usize,
        p0: usize,
        n: usize,
        drafts: bool,
    ) -> Result<()> {
        Self::with_path(m, |g, m| {
            if !drafts {
                g.forget(slot);
                return Ok(());
            }
            // (the mod.rs forward holds drafted passes to `pass_cap` tokens)
            let cap = g.pass_cap;
            // (the copies' buffers are kept from one drafted pass to the next: a recorded
            // pass reads and writes them in place)
            let (rows, ids) = match g.rollback[slot].take() {
                Some(r) => (r.rows, r.ids),
                None => {
                    let st = g.state(m, slot)?;
                    let dev = &m.dev;
                    let rows = st
                        .iter()
                        .map(|ls| {
                            rings(ls)
                                .iter()
                                .map(|t| dev.f32([t.r.dims[0], cap as u64, 1, 1]))
                                .collect::<Result<Vec<_>>>()
                        })
                        .collect::<Result<Vec<_>>>()
                        .context("allocating the copies of the ring rows")?;
                    let mut lens: Vec<usize> = ring_lengths(m).collect();
                    lens.sort_unstable();
                    lens.dedup();
                    let ids = lens
                        .into_iter()
                        .map(|len| Ok((len, dev.i32(cap)?)))
                        .collect::<Result<Vec<_>>>()?;
                    (rows, ids)
                }
            };
            // Each ring's rows of positions p0..p0 + n, for the pass to copy first.
            for (len, t) in &ids {
                let v: Vec<i32> = (0..cap).map(|i| ((p0 + i) % len) as i32).collect();
                t.upload_i32(&v)?;
            }
            g.rollback[slot] = Some(Rollback { p0, n, rows, ids });
            Ok(())
        })
    }

    /// Queues the copies of the ring rows a drafted pass of `n` tokens is about to
    /// overwrite (one GET_ROWS a ring, the rows named by the ids [`checkpoint`] wrote):
    /// the pass's first ops, so a recorded pass makes them too.
    ///
    /// [`checkpoint`]: GpuPath::checkpoint
    fn save_ring_rows(&self, dev: &Device, st: &[LayerState], slot: usize, n: usize) -> Result<()> {
        let r = self.rollback[slot]
            .as_ref()
            .ok_or_else(|| anyhow!("slot {slot}: a drafted pass with no checkpoint"))?;
        let ids = |len: usize| -> Result<TensorRef> {
            let (_, t) = r
                .ids
                .iter()
                .find(|(l, _)| *l == len)
                .ok_or_else(|| anyhow!("no row ids for a ring of {len}"))?;
            Ok(v(t, [n, 1, 1, 1]))
        };
        for (ls, saved) in st.iter().zip(&r.rows) {
            for (ring, to) in rings(ls).into_iter().zip(saved) {
                let (w, len) = (ring.r.dims[0] as usize, ring.r.dims[1] as usize);
                dev.op(
                    ops::GET_ROWS,
                    OpParams::default(),
                    &[v(ring, [w, len, 1, 1]), ids(len)?, v(to, [w, n, 1, 1])],
                )
                .context("copying ring rows")?;
            }
        }
        Ok(())
    }

    /// Whether `slot` can go back to position `to` (inside its last drafted pass).
    pub(super) fn can_return(&self, slot: usize, to: usize) -> bool {
        self.rollback
            .get(slot)
            .and_then(Option::as_ref)
            .is_some_and(|r| r.p0 <= to && to < r.p0 + r.n)
    }

    /// Puts `slot` back at position `to` of its last drafted pass: the ring rows of
    /// positions `to` onward get what they held before the pass.
    pub(super) fn rewind(m: &mut Deepseek4, slot: usize, to: usize) -> Result<()> {
        Self::with_path(m, |g, m| {
            if !g.can_return(slot, to) {
                bail!("slot {slot} cannot go back to position {to}");
            }
            let r = g.rollback[slot].take().expect("checked above");
            let st = g.slots[slot]
                .as_ref()
                .ok_or_else(|| anyhow!("slot state"))?;
            let count = r.p0 + r.n - to;
            for (ls, saved) in st.iter().zip(&r.rows) {
                for (ring, from) in rings(ls).into_iter().zip(saved) {
                    g.restore_ring_rows(&m.dev, ring, from, r.p0, to, count)?;
                }
            }
            // (the buffers stay for the next drafted pass)
            g.rollback[slot] = Some(Rollback { p0: 0, n: 0, ..r });
            Ok(())
        })
    }

    /// Forgets what `slot` could go back to (a new sequence, a seek, a failed pass).
    pub(super) fn forget(&mut self, slot: usize) {
        if let Some(r) = self.rollback.get_mut(slot).and_then(Option::as_mut) {
            r.n = 0;
        }
    }

    /// Puts back the rows of positions `from..from + count` of a positional ring (rows
    /// of `ring.dims[0]` values, position q at row q % ring.dims[1]) from `saved`
    /// (position q at row q - base): one GET_ROWS, two where the range wraps around the
    /// ring's end.
    fn restore_ring_rows(
        &self,
        dev: &Device,
        ring: &Tensor,
        saved: &Tensor,
        base: usize,
        from: usize,
        count: usize,
    ) -> Result<()> {
        let (width, len) = (ring.r.dims[0] as usize, ring.r.dims[1] as usize);
        let cap = saved.r.dims[1] as usize;
        let mut done = 0;
        while done < count {
            let q = from + done;
            let (r, s) = (q % len, q - base);
            let k = (count - done).min(len - r);
            let table = v(saved, [width, cap, 1, 1]);
            let out = at(ring, r * width, [width, k, 1, 1]);
            let ids = at(&self.iota, s, [k, 1, 1, 1]);
            dev.op(ops::GET_ROWS, OpParams::default(), &[table, ids, out])
                .context("copying ring rows")?;
            done += k;
        }
        Ok(())
    }

    fn slot_state(m: &Deepseek4, slot: usize) -> Result<Vec<LayerState>> {
        let (p, dev) = (&m.p, &m.dev);
        let comp = |c: &CompWeights| -> Result<CompState> {
            let width = if c.overlap { 2 * c.dim } else { c.dim };
            Ok(CompState {
                ring_kv: dev.f32([width as u64, 2 * c.ratio as u64, 1, 1])?,
                ring_g: dev.f32([width as u64, 2 * c.ratio as u64, 1, 1])?,
                rows: dev.f32([c.dim as u64, (m.n_ctx / c.ratio + 1) as u64, 1, 1])?,
            })
        };
        // (the MTP block's window after the layers', where a drafter is loaded)
        m.layers
            .iter()
            .chain(m.mtp.as_ref().map(|t| &t.layer))
            .map(|l| {
                Ok(LayerState {
                    ring: dev.f32([p.head_dim as u64, p.window as u64, 1, 1])?,
                    comp: l.comp.as_ref().map(comp).transpose()?,
                    idx: l.indexer.as_ref().map(|i| comp(&i.comp)).transpose()?,
                })
            })
            .collect::<Result<_>>()
            .with_context(|| format!("allocating the device state of slot {slot}"))
    }

    fn alloc_work(m: &Deepseek4, cap: usize, logit_rows: usize, idx_cap: usize) -> Result<Work> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, hc, n) = (p.d, p.hc, cap);
        let nm = 2 * hc + hc * hc;
        let ff = m
            .layers
            .first()
            .map_or(1, |l| l.gate_exps.r.dims[1] as usize);
        let sf = m
            .layers
            .iter()
            .filter_map(|l| l.shexp.as_ref().map(|s| s.0.r.dims[1] as usize))
            .max()
            .unwrap_or(1);
        let attn = p.n_head * p.head_dim;
        let k = p.n_used;
        let f = |len: usize| f32s(dev, len);
        Ok(Work {
            cap,
            tok_rep: dev.i32(hc * n)?,
            tokens: dev.i32(n)?,
            pos: dev.i32(n)?,
            want: dev.i32(n)?,
            streams: f(d * hc * n)?,
            hc_sync: zeros_i32(dev, n)?,
            att_sync: zeros_i32(
                dev,
                ops::sparse_attention_sync_words(p.n_head as u64) as usize,
            )?,
            router_sync: zeros_i32(dev, n)?,
            moe_sync: zeros_i32(dev, 1)?,
            topk_work: zeros_i32(dev, ops::TOPK_ROWS_WORK_WORDS as usize)?,
            mix: f(nm * n)?,
            wts: f(nm * n)?,
            x: f(d * n)?,
            xq: dev.i32(d.div_ceil(2))?,
            q_res: f(p.q_lora * n)?,
            // (one value where the engine never sends NORM_MATMUL)
            q_resn: f(if norm_mm_wanted() { p.q_lora * n } else { 1 })?,
            q: f(attn * n)?,
            kv: f(p.head_dim * n)?,
            ck: f(2 * p.head_dim * n)?,
            cg: f(2 * p.head_dim * n)?,
            ik: f(2 * p.idx_dim * n)?,
            ig: f(2 * p.idx_dim * n)?,
            iq: f(p.idx_heads * p.idx_dim * n)?,
            iw: f(p.idx_heads * n)?,
            scores: f(idx_cap * n)?,
            sel: dev.i32(p.idx_topk.max(1) * n)?,
            att: f(attn * n)?,
            att_t: f(attn * n)?,
            mid: f(p.o_groups * p.o_lora * n)?,
            mid_t: f(p.o_groups * p.o_lora * n)?,
            ao: f(d * n)?,
            rl: f(p.n_expert * n)?,
            rids: dev.i32(k * n)?,
            rw: f(k * n)?,
            eg: f(ff * k * n)?,
            eu: f(ff * k * n)?,
            ea: f(ff * k * n)?,
            ey: f(d * k * n)?,
            sg: f(sf * n)?,
            su: f(sf * n)?,
            sa: f(sf * n)?,
            sy: f(d * n)?,
            mo: f(d * n)?,
            hidden: f(d * n)?,
            hsel: f(d * n)?,
            // (vocabulary x rows: 0.5 MB a row at V4-Flash's 129280, so only as many
            // rows as wanted)
            logits: f(p.n_vocab * logit_rows.clamp(1, cap))?,
            logit_rows: logit_rows.clamp(1, cap),
            mtp: m
                .mtp
                .is_some()
                .then(|| MtpWork::alloc(m, cap, pass_cap(m)))
                .transpose()?,
        })
    }

    /// Benchmarks (`seek`): fills `slot`'s caches as `pos` tokens would have, so a step
    /// at that depth reads a filled context: the window's rows and the compressed and
    /// indexer rows those positions close get unit-variance pseudo-random values (the
    /// size of the RMS-normed rows a real context stores; a context of zeros ties every
    /// index score at 0, which the top-k handles quicker than real scores), seeded by
    /// layer. The compressors' partial windows stay as they are.
    pub(super) fn fill(m: &mut Deepseek4, slot: usize, pos: usize) -> Result<()> {
        Self::with_path(m, |g, m| g.fill_inner(m, slot, pos))
    }

    /// Runs `f` on the model's device path (taken out of `m` meanwhile, so `f` can read
    /// the model while it changes the path).
    fn with_path<T>(
        m: &mut Deepseek4,
        f: impl FnOnce(&mut GpuPath, &Deepseek4) -> Result<T>,
    ) -> Result<T> {
        let mut g = m.gpu.take().ok_or_else(|| anyhow!("no device path"))?;
        let r = f(&mut g, m);
        m.gpu = Some(g);
        r
    }

    /// `slot`'s device state, allocated on first use.
    fn state(&mut self, m: &Deepseek4, slot: usize) -> Result<&[LayerState]> {
        if self.slots[slot].is_none() {
            self.slots[slot] = Some(Self::slot_state(m, slot)?);
        }
        Ok(self.slots[slot].as_deref().expect("set above"))
    }

    fn fill_inner(&mut self, m: &Deepseek4, slot: usize, pos: usize) -> Result<()> {
        let st = self.state(m, slot)?;
        // The first `rows` rows of t (rows of t.dims[0] values; capped at its capacity).
        let fill = |t: &Tensor, rows: usize, seed: u64| -> Result<()> {
            let dims = t.r.dims;
            let n = rows.min(dims[1] as usize) * dims[0] as usize;
            if n > 0 {
                t.upload_f32(&unit_noise(n, seed))?;
            }
            Ok(())
        };
        // (the MTP block's window too, where one is loaded: its lay is the block's)
        let lays = m.layers.iter().chain(m.mtp.as_ref().map(|t| &t.layer));
        for (l, (ls, lay)) in st.iter().zip(lays).enumerate() {
            let seed = 0x5eed_0000 + 4 * l as u64;
            fill(&ls.ring, pos.min(m.p.window), seed)
                .with_context(|| format!("layer {l}: filling the window"))?;
            if let (Some(cs), Some(c)) = (&ls.comp, &lay.comp) {
                fill(&cs.rows, pos / c.ratio, seed + 1)
                    .with_context(|| format!("layer {l}: filling the compressed rows"))?;
            }
            if let (Some(cs), Some(ix)) = (&ls.idx, &lay.indexer) {
                fill(&cs.rows, pos / ix.comp.ratio, seed + 2)
                    .with_context(|| format!("layer {l}: filling the indexer's rows"))?;
            }
        }
        Ok(())
    }

    /// Runs `tokens` of `slot` from position `p0`; returns the logits of the tokens
    /// whose chunk index is in `want` (ascending). `drafted`: a pass of a token and its
    /// drafts (speculative decoding), which may replay a graph of its own.
    pub(super) fn run(
        m: &mut Deepseek4,
        slot: usize,
        tokens: &[u32],
        p0: usize,
        want: &[usize],
        drafted: bool,
    ) -> Result<Vec<Vec<f32>>> {
        // Kernels put a chunk's tokens (MATMUL_ID: tokens x routed experts) on grid y,
        // at most 65535 blocks: longer chunks run as consecutive pieces (the caches carry
        // over, so this equals one pass).
        if tokens.len() > MAX_CHUNK {
            let mut out = Vec::new();
            for (i, part) in tokens.chunks(MAX_CHUNK).enumerate() {
                let start = i * MAX_CHUNK;
                let mine: Vec<usize> = want
                    .iter()
                    .filter(|&&t| (start..start + part.len()).contains(&t))
                    .map(|&t| t - start)
                    .collect();
                out.extend(Self::run(m, slot, part, p0 + start, &mine, false)?);
            }
            return Ok(out);
        }
        Self::with_path(m, |g, m| g.run_inner(m, slot, tokens, p0, want, drafted))
    }

    /// The graph a step of `n` tokens of `kind` replays: one per slot, length (a single
    /// token's, a drafted pass's) and kind, so a slot whose steps change kind (a new
    /// request back at position 0, a context crossing the indexer's top-k) replays the
    /// graph it recorded before instead of recording again. Above the MTP chain's ids.
    fn graph_id(&self, slot: usize, n: usize, kind: StepKind) -> usize {
        graph_key(self.slots.len(), slot, n, kind)
    }

    fn run_inner(
        &mut self,
        m: &Deepseek4,
        slot: usize,
        tokens: &[u32],
        p0: usize,
        want: &[usize],
        drafted: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let (p, dev) = (&m.p, &m.dev);
        let n = tokens.len();
        self.state(m, slot)?;
        let single = n == 1 && want == [0];
        let kind = StepKind::of(self.idx_ratio, p.idx_topk, p0, n);
        // A drafted pass wanting every row, replayed as a graph of its own length.
        let pass = !single
            && drafted
            && self.draft_graphs
            && n <= self.pass_cap
            && want.iter().copied().eq(0..n);
        let gid = (single || pass).then(|| self.graph_id(slot, n, kind));
        if let Some(id) = gid {
            // (a kind's first step runs directly: its scratch may grow)
            self.graphs.entry(id).or_insert(self.graph_start);
        }
        let work_slot = if single {
            &mut self.work1
        } else if pass {
            &mut self.work_d
        } else {
            &mut self.work
        };
        if work_slot
            .as_ref()
            .is_none_or(|w| w.cap < n || w.logit_rows < want.len())
        {
            let (cap, rows) = match work_slot.as_ref() {
                _ if pass => (self.pass_cap, self.pass_cap),
                Some(w) => (
                    w.cap.max(n.next_power_of_two()),
                    w.logit_rows.max(want.len()),
                ),
                None => (n.next_power_of_two(), want.len()),
            };
            *work_slot = None;
            *work_slot = Some(Self::alloc_work(m, cap, rows, self.idx_cap)?);
        }
        let w = if single {
            &self.work1
        } else if pass {
            &self.work_d
        } else {
            &self.work
        };
        let w = w.as_ref().ok_or_else(|| anyhow!("work buffers"))?;
        let rep: Vec<i32> = tokens
            .iter()
            .flat_map(|&t| std::iter::repeat_n(t as i32, p.hc))
            .collect();
        w.tok_rep.upload_i32(&rep)?;
        w.tokens
            .upload_i32(&tokens.iter().map(|&t| t as i32).collect::<Vec<_>>())?;
        w.pos
            .upload_i32(&(0..n).map(|t| (p0 + t) as i32).collect::<Vec<_>>())?;
        if !single {
            w.want
                .upload_i32(&want.iter().map(|&t| t as i32).collect::<Vec<_>>())?;
        }
        self.mtp_ids(m, w, slot, p0, n)?;
        let st = self.slots[slot]
            .as_ref()
            .ok_or_else(|| anyhow!("slot state"))?;
        let state = gid.map_or(GraphState::Off, |id| self.graphs[&id]);
        let key = pr(&[], &[gid.unwrap_or(0) as i64]);
        // A step joins each branch it forks; after an op failed mid-branch, the branches
        // still open join the main stream here, so a graph capture ends with none open.
        let step = |w: &Work| {
            if drafted {
                self.save_ring_rows(dev, st, slot, n)?;
            }
            self.enqueue(m, st, w, (slot, n), want.len(), single, kind)
                .inspect_err(|_| {
                    let _ = self.join_open(dev);
                })
        };
        let next = self.graph_run(dev, state, key, || step(w))?;
        if let Some(e) = gid.and_then(|id| self.graphs.get_mut(&id)) {
            *e = next;
        }
        dev.sync()?;
        let all = w.logits.download_f32(want.len() * p.n_vocab)?;
        self.mtp_passed(slot, p0, n);
        if want.len() == 1 {
            return Ok(vec![all]); // (a decode step: no copy)
        }
        Ok(all.chunks_exact(p.n_vocab).map(<[f32]>::to_vec).collect())
    }

    /// Runs `step` as graph `key` in `state` (see [`GraphState`]): directly when cold or
    /// off, recorded when warm, replayed when recorded. Returns the next state.
    fn graph_run(
        &self,
        dev: &Device,
        state: GraphState,
        key: OpParams,
        step: impl Fn() -> Result<()>,
    ) -> Result<GraphState> {
        Ok(match state {
            GraphState::Recorded => {
                if dev.op(ops::GRAPH_LAUNCH, key, &[]).is_ok() {
                    GraphState::Recorded
                } else {
                    step()?;
                    GraphState::Warm
                }
            }
            GraphState::Warm => {
                // A backend without graphs says so at GRAPH_BEGIN: run op by op from now on.
                if dev.op(ops::GRAPH_BEGIN, key, &[]).is_err() {
                    step()?;
                    GraphState::Off
                } else {
                    let rec = step();
                    let end = dev.op(ops::GRAPH_END, key, &[]);
                    match (rec, end) {
                        (Ok(()), Ok(())) => {
                            dev.op(ops::GRAPH_LAUNCH, key, &[])?;
                            GraphState::Recorded
                        }
                        (rec, end) => {
                            tracing::warn!(
                                "deepseek4: recording a step failed ({}); running it directly",
                                rec.err()
                                    .or(end.err())
                                    .map(|e| format!("{e:#}"))
                                    .unwrap_or_default()
                            );
                            step()?;
                            GraphState::Off
                        }
                    }
                }
            }
            GraphState::Cold => {
                step()?;
                GraphState::Warm
            }
            GraphState::Off => {
                step()?;
                GraphState::Off
            }
        })
    }

    /// Queues one chunk's ops (embedding .. logits of the `n_want` wanted rows).
    /// `kind`: see [`StepKind`].
    #[allow(clippy::too_many_arguments)]
    fn enqueue(
        &self,
        m: &Deepseek4,
        st: &[LayerState],
        w: &Work,
        (slot, n): (usize, usize),
        n_want: usize,
        single: bool,
        kind: StepKind,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, hc) = (p.d, p.hc);
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        op(
            ops::GET_ROWS,
            OpParams::default(),
            &[
                m.embd.r,
                v(&w.tok_rep, [hc * n, 1, 1, 1]),
                v(&w.streams, [d, hc * n, 1, 1]),
            ],
        )
        .context("embedding")?;
        let mut post: Vec<TensorRef> = Vec::new();
        for (l, (lay, dl)) in m.layers.iter().zip(&self.layers).enumerate() {
            self.block(m, l, (lay, dl, &st[l]), w, n, kind, &mut post)?;
        }
        if n_want == 0 && self.mtp.is_none() {
            // Nothing reads the last layer's streams; the Sinkhorn branch joins.
            return self.join_open(dev);
        }
        let hidden = v(&w.hidden, [d, n, 1, 1]);
        self.site(
            m,
            w,
            n,
            (&post, &m.hc_head.0, &self.head, &self.out_norm, true),
            hidden,
            None,
            None,
        )
        .context("output head")?;
        if n_want > 0 {
            let hsel = if single || n_want == n {
                v(&w.hidden, [d, n_want, 1, 1])
            } else {
                let out = v(&w.hsel, [d, n_want, 1, 1]);
                op(
                    ops::GET_ROWS,
                    OpParams::default(),
                    &[
                        v(&w.hidden, [d, n, 1, 1]),
                        v(&w.want, [n_want, 1, 1, 1]),
                        out,
                    ],
                )?;
                out
            };
            op(
                ops::MATMUL,
                OpParams::default(),
                &[wv(&m.output), hsel, v(&w.logits, [p.n_vocab, n_want, 1, 1])],
            )
            .context("output projection")?;
        }
        if self.mtp.is_some() {
            // (the block reads the streams the last layer's post left: every branch joins)
            self.join_open(dev)?;
            self.mtp_catch_up(m, st, w, n, kind, slot)?;
        }
        // (the prefetch stream, whose branch nothing else joins)
        self.join_open(dev)
    }

    /// An mHC site: the post of the block before it (`post`: its inputs as HC_POST takes
    /// them after the streams; none before the first layer), the site's mixes and pre
    /// (the head's: pre only) into `out`. One HC_POST_PRE where the backend has it.
    /// `at`: (post, the site's mix weights, its scale and base, norm, the head?); `route`:
    /// ROUTER's arguments and params where the site's op also routes (ABI 1.11).
    #[allow(clippy::too_many_arguments)]
    fn site(
        &self,
        m: &Deepseek4,
        w: &Work,
        n: usize,
        at: (&[TensorRef], &Tensor, &(Tensor, Tensor), &Tensor, bool),
        out: TensorRef,
        xq: Option<TensorRef>,
        route: Option<(Vec<TensorRef>, OpParams)>,
    ) -> Result<()> {
        let (post, fnw, sb, norm, head) = at;
        let (p, dev) = (&m.p, &m.dev);
        let (d, hc) = (p.d, p.hc);
        let nm = 2 * hc + hc * hc;
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        let streams = v(&w.streams, [d, hc, n, 1]);
        let wts = v(&w.wts, [nm, n, 1, 1]);
        let here = if head { hc } else { nm };
        let iters = if head { 0 } else { p.hc_iters as i64 };
        let defer = self.hc_defer && !head;
        let with_xq = xq.is_some() && self.hc_fused;
        let mut prm = pr(
            &[p.eps, p.hc_eps],
            &[iters, head as i64, defer as i64, with_xq as i64],
        );
        let mix = v(&w.mix, [here, n, 1, 1]);
        let (scale, base) = (sb.0.r, sb.1.r);
        // The post reads the last site's comb matrix: its Sinkhorn branch joins.
        if !post.is_empty() {
            self.join_sides(dev)?;
        }
        if self.hc_fused {
            let sync = v(&w.hc_sync, [n, 1, 1, 1]);
            let mut a = vec![streams, wv(fnw), scale, base, norm.r, out, wts, mix, sync];
            a.extend_from_slice(post);
            a.extend(xq);
            if let Some((ra, rp)) = &route {
                // ROUTER's arguments and params after the site's (ABI 1.11)
                a.extend_from_slice(ra);
                prm.i[4] = 1;
                prm.f[2] = rp.f[0];
                prm.i[5..8].copy_from_slice(&rp.i[..3]);
            }
            op(ops::HC_POST_PRE, prm, &a)?;
        } else {
            if let Some((first, rest)) = post.split_first() {
                let mut a = vec![streams, *first, wts];
                a.extend_from_slice(rest);
                op(ops::HC_POST, OpParams::default(), &a)?;
            }
            let flat = v(&w.streams, [hc * d, n, 1, 1]);
            op(ops::MATMUL, OpParams::default(), &[wv(fnw), flat, mix])?;
            let wh = v(&w.wts, [here, n, 1, 1]);
            op(
                ops::HC_PRE,
                prm,
                &[streams, mix, scale, base, norm.r, out, wh],
            )?;
            if let Some((ra, rp)) = &route {
                op(ops::ROUTER, *rp, ra)?;
            }
        }
        if defer {
            // The comb matrix's Sinkhorn next to the block that follows.
            let sd = self.fork(dev, SIDE_HC)?;
            let prm = pr(&[0.0, p.hc_eps], &[iters, hc as i64]);
            sd.op(ops::HC_SINKHORN, prm, &[wts])?;
        }
        Ok(())
    }

    /// One block (layer `l`, or the MTP block): mHC before the attention, the attention,
    /// mHC before the MoE, the MoE; `post` becomes what the next site's post takes.
    #[allow(clippy::too_many_arguments)]
    fn block(
        &self,
        m: &Deepseek4,
        l: usize,
        (lay, dl, ls): (&Layer, &DevLayer, &LayerState),
        w: &Work,
        n: usize,
        kind: StepKind,
        post: &mut Vec<TensorRef>,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let d = p.d;
        let x = v(&w.x, [d, n, 1, 1]);
        self.prefetch(dev, self.prefetch.q, n, &q_weights(lay))
            .with_context(|| format!("layer {l}: prefetch"))?;
        self.site(
            m,
            w,
            n,
            (post, &lay.hc_attn.0, &dl.hc_attn, &dl.attn_norm, false),
            x,
            None,
            None,
        )
        .with_context(|| format!("layer {l}: mHC before attention"))?;
        self.attention(m, l, lay, dl, ls, w, n, kind)
            .with_context(|| format!("layer {l}: attention"))?;
        *post = vec![v(&w.ao, [d, n, 1, 1])];
        if self.prefetch.moe {
            let mut moe_w = vec![wv(&lay.router)];
            if let Some((g, u, dn)) = &lay.shexp {
                moe_w.extend([wv(g), wv(u), wv(dn)]);
            }
            self.prefetch(dev, true, n, &moe_w)
                .with_context(|| format!("layer {l}: prefetch"))?;
        }
        if let Some(next) = m.layers.get(l + 1) {
            self.prefetch(dev, self.prefetch.qn, n, &q_weights(next))
                .with_context(|| format!("layer {l}: prefetch"))?;
        }
        let routed = self.routes_in_site(dl, n);
        self.site(
            m,
            w,
            n,
            (post, &lay.hc_ffn.0, &dl.hc_ffn, &dl.ffn_norm, false),
            x,
            self.moe_xq(w, n),
            routed.then(|| self.router_args(m, lay, dl, w, n)),
        )
        .with_context(|| format!("layer {l}: mHC before the MoE"))?;
        self.moe(m, l, lay, dl, w, n)
            .with_context(|| format!("layer {l}: MoE"))?;
        *post = if self.post_combine {
            // The MoE's outputs go to mHC post uncombined: it combines them itself.
            let k = p.n_used;
            let mut a = vec![v(&w.ey, [d, k, n, 1]), v(&w.rw, [k, n, 1, 1])];
            if lay.shexp.is_some() {
                a.push(v(&w.sy, [d, n, 1, 1]));
            }
            a
        } else {
            vec![v(&w.mo, [d, n, 1, 1])]
        };
        Ok(())
    }

    /// Side stream `i` (the last one when there are fewer), or None without any; PF:
    /// the prefetch stream.
    fn side(&self, i: usize) -> Option<&Device> {
        if i == PF {
            return self.pf.as_deref();
        }
        self.sides.get(i).or(self.sides.last()).map(|s| &**s)
    }

    /// The stream for branch `i`: its side stream, made to wait for everything queued
    /// on `main` so far, or `main` itself without side streams.
    fn fork<'a>(&'a self, main: &'a Device, i: usize) -> Result<&'a Device> {
        match self.side(i) {
            Some(s) => {
                s.wait_for(main).context("forking a branch")?;
                self.open.set(self.open.get() | 1 << i);
                Ok(s)
            }
            None => Ok(main),
        }
    }

    /// `main` waits for branch `i` (nothing without side streams).
    fn join(&self, main: &Device, i: usize) -> Result<()> {
        match self.side(i) {
            Some(s) => {
                main.wait_for(s).context("joining a branch")?;
                self.open.set(self.open.get() & !(1 << i));
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Whether branch `i` is forked and not joined yet.
    fn is_open(&self, i: usize) -> bool {
        self.open.get() & (1 << i) != 0
    }

    /// `main` waits for every branch still open, the prefetch stream's too.
    fn join_open(&self, main: &Device) -> Result<()> {
        (0..=PF)
            .filter(|&i| self.is_open(i))
            .try_for_each(|i| self.join(main, i))
    }

    /// `main` waits for every side stream's branch still open (not the prefetch
    /// stream's: nothing reads what it does, so only a step's end waits for it).
    fn join_sides(&self, main: &Device) -> Result<()> {
        (0..SIDES)
            .filter(|&i| self.is_open(i))
            .try_for_each(|i| self.join(main, i))
    }

    /// Asks L2 for `ts` on the prefetch stream, forked from `main` here (so it starts
    /// as `main` reaches this point, and is recorded with the step's graph) where `on`
    /// and the step is a decode step's size (see [`Prefetch`]).
    fn prefetch(&self, main: &Device, on: bool, n: usize, ts: &[TensorRef]) -> Result<()> {
        if !on || n > FUSED_ROPE_MAX_TOKENS || ts.is_empty() {
            return Ok(());
        }
        if self.pf.is_none() {
            return Ok(());
        }
        let pf = self.fork(main, PF)?;
        // (a hint: one that fails costs its speed-up, not the step)
        if let Err(e) = pf.op(ops::PREFETCH, OpParams::default(), ts) {
            if !self.pf_failed.replace(true) {
                tracing::warn!("deepseek4: prefetch failed, going on without it: {e:#}");
            }
        }
        Ok(())
    }

    /// Products of x for branch `i`: on its side stream (forked here), or added to the
    /// main stream's `main_x` without side streams.
    fn branch_x(
        &self,
        main: &Device,
        i: usize,
        x: TensorRef,
        main_x: &mut Vec<(TensorRef, TensorRef)>,
        pairs: &[(TensorRef, TensorRef)],
    ) -> Result<()> {
        if self.sides.is_empty() {
            main_x.extend_from_slice(pairs);
            return Ok(());
        }
        let s = self.fork(main, i)?;
        self.mm_multi(s, x, pairs)
    }

    /// out_i = w_i x for each (w_i, out_i): one MATMUL_MULTI (the backend fuses what its
    /// kernels can), or one MATMUL each where the backend lacks it.
    fn mm_multi(&self, dev: &Device, x: TensorRef, pairs: &[(TensorRef, TensorRef)]) -> Result<()> {
        if self.multi {
            let mut args = vec![x];
            for (w, out) in pairs {
                args.extend([*w, *out]);
            }
            return dev.op(ops::MATMUL_MULTI, OpParams::default(), &args);
        }
        for (w, out) in pairs {
            dev.op(ops::MATMUL, OpParams::default(), &[*w, x, *out])?;
        }
        Ok(())
    }

    /// The shared expert's SwiGLU and down product (`dn`) into `sy`: one token's of
    /// ROCmFP4 weights as one SWIGLU_MATMUL_ID with one "expert" (id 0; the backend
    /// then needs no SwiGLU launch), else SWIGLU, then MATMUL (the other types' plain
    /// products keep their own single-column kernels).
    fn shexp_down(
        &self,
        on: &Device,
        clamp: f32,
        dn: TensorRef,
        [sg, su, sa, sy]: [TensorRef; 4],
        n: usize,
    ) -> Result<()> {
        if self.shexp_swiglu_id && n == 1 && dn.type_id == TYPE_ROCMFP4 {
            let one = v(&self.group_ids, [1, 1, 1, 1]);
            let args = [dn, sg, su, one, sy, sa];
            return on.op(
                ops::SWIGLU_MATMUL_ID,
                pr(&[clamp], &[self.fixed_ids]),
                &args,
            );
        }
        on.op(ops::SWIGLU, pr(&[clamp], &[]), &[sg, su, sa])?;
        on.op(ops::MATMUL, OpParams::default(), &[dn, sa, sy])
    }

    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        m: &Deepseek4,
        l: usize,
        lay: &Layer,
        dl: &DevLayer,
        st: &LayerState,
        w: &Work,
        n: usize,
        kind: StepKind,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (hd, nh, d) = (p.head_dim, p.n_head, p.d);
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        let mm = |wt: TensorRef, x: TensorRef, out: TensorRef| {
            op(ops::MATMUL, OpParams::default(), &[wt, x, out])
        };
        let x = v(&w.x, [d, n, 1, 1]);
        let pos = v(&w.pos, [n, 1, 1, 1]);
        let ratio = p.ratios[l];
        let (inv, ms) = if ratio == 0 {
            &self.inv_main
        } else {
            &self.inv_comp
        };
        let (cinv, cms) = &self.inv_comp;
        let pairs = (p.rope_dim / 2) as i64;
        let q_res = v(&w.q_res, [p.q_lora, n, 1, 1]);
        let width = |c: &CompWeights| if c.overlap { 2 * c.dim } else { c.dim };
        let comp_views = |c: &CompWeights, kvb: &Tensor, gb: &Tensor| {
            (v(kvb, [width(c), n, 1, 1]), v(gb, [width(c), n, 1, 1]))
        };
        // The compressor's and the indexer's products of x branch off to side streams:
        // nothing on the query path reads what they write before the attention.
        let mut of_x = vec![
            (wv(&lay.q_a), q_res),
            (wv(&lay.kv), v(&w.kv, [hd, n, 1, 1])),
        ];
        if let (Some(c), Some(_)) = (&lay.comp, &st.comp) {
            let (kvr, gr) = comp_views(c, &w.ck, &w.cg);
            self.branch_x(
                dev,
                SIDE_COMP,
                x,
                &mut of_x,
                &[(wv(&c.kv), kvr), (wv(&c.gate), gr)],
            )?;
        }
        // A short step's indexer layers attend to every visible row (see StepKind): the
        // indexer only keeps its compressed rows, its head weights are not needed.
        let scoring = |ix: &Indexer| !(kind.short && ix.comp.ratio == ratio);
        if let (Some(ix), Some(_)) = (&lay.indexer, &st.idx) {
            let (kvr, gr) = comp_views(&ix.comp, &w.ik, &w.ig);
            let mut idx_x = vec![(wv(&ix.comp.kv), kvr), (wv(&ix.comp.gate), gr)];
            if scoring(ix) {
                idx_x.push((wv(&ix.proj), v(&w.iw, [p.idx_heads, n, 1, 1])));
            }
            self.branch_x(dev, SIDE_IDX, x, &mut of_x, &idx_x)?;
        }
        self.mm_multi(dev, x, &of_x)?;
        let stream = |i: usize| {
            if self.is_open(i) {
                self.side(i).unwrap_or(dev)
            } else {
                &**dev
            }
        };
        let compress = |on: &Device,
                        c: &CompWeights,
                        dc: &DevComp,
                        cs: &CompState,
                        kvb: &Tensor,
                        gb: &Tensor|
         -> Result<()> {
            let (kvr, gr) = comp_views(c, kvb, gb);
            on.op(
                ops::COMPRESS,
                pr(&[p.eps, *cms], &[c.ratio as i64, c.overlap as i64, pairs]),
                &[
                    kvr,
                    gr,
                    pos,
                    dc.ape.r,
                    dc.norm.r,
                    cinv.r,
                    cs.ring_kv.r,
                    cs.ring_g.r,
                    cs.rows.r,
                ],
            )
        };
        if let (Some(c), Some(dc), Some(cs)) = (&lay.comp, &dl.comp, &st.comp) {
            compress(stream(SIDE_COMP), c, dc, cs, &w.ck, &w.cg).context("compressor")?;
        }
        let idx = match (&lay.indexer, &dl.idx, &st.idx) {
            (Some(ix), Some(dc), Some(cs)) => {
                compress(stream(SIDE_IDX), &ix.comp, dc, cs, &w.ik, &w.ig)
                    .context("indexer compressor")?;
                Some((ix, cs))
            }
            _ => None,
        };
        // The kv norm and rotary wait only for the main stream's kv product: on side
        // stream 0, after the compressor's work (the query path is the longer one).
        let kv3 = v(&w.kv, [hd, 1, n, 1]);
        let ks = self.fork(dev, SIDE_COMP)?;
        ks.op(
            ops::NORM_ROPE,
            pr(&[p.eps, *ms], &[2, pairs, 0]),
            &[kv3, dl.kv_norm.r, inv.r, pos, kv3],
        )?;
        let qr3 = v(&w.q_res, [p.q_lora, 1, n, 1]);
        // q_a's norm inside wq_b's product where no indexer scores from the normed q_res.
        let norm_in_qb = self.norm_mm && !idx.is_some_and(|(ix, _)| scoring(ix));
        if !norm_in_qb {
            op(
                ops::NORM_ROPE,
                pr(&[p.eps, 1.0], &[2, 0, 0]),
                &[qr3, dl.q_a_norm.r, inv.r, pos, qr3],
            )?;
        }
        let mut mode = if lay.comp.is_some() { 1 } else { 0 };
        if let Some((ix, cs)) = idx.filter(|(ix, _)| scoring(ix)) {
            // The indexer's queries come from the normed q_res: its stream waits for it,
            // then scores and selects while the main stream runs wq_b.
            let sd = self.fork(dev, SIDE_IDX)?;
            let (ih, id) = (p.idx_heads, p.idx_dim);
            let iq = v(&w.iq, [id, ih, n, 1]);
            sd.op(
                ops::MATMUL,
                OpParams::default(),
                &[wv(&ix.q_b), q_res, v(&w.iq, [id * ih, n, 1, 1])],
            )?;
            let cap = cs.rows.r.dims[1] as usize;
            let scores = v(&w.scores, [cap, n, 1, 1]);
            let mut a = vec![iq, v(&w.iw, [ih, n, 1, 1]), cs.rows.r, pos, scores];
            let (sm, ws) = ((id as f32).powf(-0.5), (ih as f32).powf(-0.5));
            let ratio = ix.comp.ratio as i64;
            // The most rows a token of this step kind sees (0: no bound), whatever
            // position a recorded step is replayed at.
            let bound = if kind.wide_topk {
                0
            } else {
                TOPK_WIDE_FROM_ROWS as i64
            };
            if self.idx_rope && n <= FUSED_ROPE_MAX_TOKENS {
                // The queries' rotary inside the scoring op.
                a.push(cinv.r);
                sd.op(
                    ops::INDEX_SCORES,
                    pr(&[sm, ws, *cms], &[ratio, pairs, bound]),
                    &a,
                )?;
            } else {
                sd.op(
                    ops::NORM_ROPE,
                    pr(&[p.eps, *cms], &[0, pairs, 0]),
                    &[iq, dl.q_a_norm.r, cinv.r, pos, iq],
                )?;
                sd.op(ops::INDEX_SCORES, pr(&[sm, ws], &[ratio, 0, bound]), &a)?;
            }
            let mut a = vec![scores, pos, v(&w.sel, [p.idx_topk, n, 1, 1])];
            if self.topk_work && kind.wide_topk {
                a.push(w.topk_work.r);
            }
            sd.op(ops::TOPK_ROWS, pr(&[], &[ix.comp.ratio as i64]), &a)?;
            mode = 2;
        }
        if norm_in_qb {
            let a = [
                wv(&lay.q_b),
                q_res,
                dl.q_a_norm.r,
                v(&w.q, [nh * hd, n, 1, 1]),
                v(&w.q_resn, [p.q_lora, n, 1, 1]),
            ];
            op(ops::NORM_MATMUL, pr(&[p.eps], &[]), &a)?;
        } else {
            mm(wv(&lay.q_b), q_res, v(&w.q, [nh * hd, n, 1, 1]))?;
        }
        // The output products' weights (or the second's alone), under the attention.
        let o = [wv(&lay.out_a), wv(&lay.out_b)];
        let o = if self.prefetch.o { &o[..] } else { &o[1..] };
        self.prefetch(dev, self.prefetch.o || self.prefetch.ob, n, o)?;
        let q = v(&w.q, [hd, nh, n, 1]);
        // Decode steps: the rotaries inside the attention (a prefill chunk's many blocks
        // would each repeat q's norm; its separate launches cost little there).
        let att_rope = self.att_rope && n <= FUSED_ROPE_MAX_TOKENS;
        if !att_rope {
            op(
                ops::NORM_ROPE,
                pr(&[p.eps, *ms], &[1, pairs, 0]),
                &[q, dl.q_a_norm.r, inv.r, pos, q],
            )?;
        }
        self.join_sides(dev)?;
        // Without compressed rows (mode 0) any tensor other than the ring stands in.
        let rows = st
            .comp
            .as_ref()
            .map_or(v(&w.kv, [hd, n, 1, 1]), |c| c.rows.r);
        let sel = if mode == 2 {
            v(&w.sel, [p.idx_topk, n, 1, 1])
        } else {
            pos
        };
        let att = v(&w.att, [hd, nh, n, 1]);
        let kv = v(&w.kv, [hd, n, 1, 1]);
        let mut a = vec![q, kv, st.ring.r, rows, sel, dl.sinks.r, pos, att];
        let scale = (hd as f32).powf(-0.5);
        let long = kind.long as i64;
        // The words the op's one-launch decode form waits on, where the backend takes them.
        let sync = self.att_sync.then(|| {
            v(
                &w.att_sync,
                [
                    ops::sparse_attention_sync_words(nh as u64) as usize,
                    1,
                    1,
                    1,
                ],
            )
        });
        if att_rope {
            // q's norm + rotary and the output's inverse rotary in the attention op.
            a.push(inv.r);
            a.extend(sync);
            let prm = pr(&[scale, p.eps, *ms], &[ratio as i64, mode, pairs, long]);
            op(ops::SPARSE_ATTENTION, prm, &a)?;
        } else {
            // (a decode step: the sync words after an inv_freq of no values)
            if let (Some(sync), 1) = (sync, n) {
                a.extend([v(&w.att_sync, [0, 1, 1, 1]), sync]);
            }
            op(
                ops::SPARSE_ATTENTION,
                pr(&[scale], &[ratio as i64, mode, 0, long]),
                &a,
            )?;
            op(
                ops::NORM_ROPE,
                pr(&[p.eps, *ms], &[0, pairs, 1]),
                &[att, dl.sinks.r, inv.r, pos, att],
            )?;
        }
        // Grouped output projection: group g's heads through its own block of rows.
        let (g_n, gw, gr) = (p.o_groups, nh * hd / p.o_groups, p.o_lora);
        let per_group = lay.out_a.bytes / g_n as u64;
        let group_w = |g: usize| TensorRef {
            offset: lay.out_a.r.offset + per_group * g as u64,
            dims: [gw as u64, gr as u64, 1, 1],
            ..lay.out_a.r
        };
        let mid = if n == 1 {
            // The groups as the "experts" of one grouped product, each with its own input.
            let groups = TensorRef {
                dims: [gw as u64, gr as u64, g_n as u64, 1],
                ..lay.out_a.r
            };
            op(
                ops::MATMUL_ID,
                pr(&[], &[self.fixed_ids]),
                &[
                    groups,
                    v(&w.att, [gw, g_n, 1, 1]),
                    v(&self.group_ids, [g_n, 1, 1, 1]),
                    v(&w.mid, [gr, g_n, 1, 1]),
                ],
            )?;
            v(&w.mid, [g_n * gr, 1, 1, 1])
        } else {
            op(
                ops::TRANSPOSE12,
                OpParams::default(),
                &[v(&w.att, [gw, g_n, n, 1]), v(&w.att_t, [gw, n, g_n, 1])],
            )?;
            for g in 0..g_n {
                mm(
                    group_w(g),
                    at(&w.att_t, g * gw * n, [gw, n, 1, 1]),
                    at(&w.mid, g * gr * n, [gr, n, 1, 1]),
                )?;
            }
            op(
                ops::TRANSPOSE12,
                OpParams::default(),
                &[v(&w.mid, [gr, n, g_n, 1]), v(&w.mid_t, [gr, g_n, n, 1])],
            )?;
            v(&w.mid_t, [g_n * gr, n, 1, 1])
        };
        mm(wv(&lay.out_b), mid, v(&w.ao, [d, n, 1, 1]))
    }

    /// Whether the MoE site's op also routes: decode steps of scored layers (not the
    /// hash table's), with `site_route` and ROUTER's product.
    fn routes_in_site(&self, dl: &DevLayer, n: usize) -> bool {
        self.site_route && self.router_mm && n == 1 && dl.tid2eid.is_none()
    }

    /// ROUTER's arguments (with its product where `router_mm`) and params for `n`
    /// tokens of x.
    fn router_args(
        &self,
        m: &Deepseek4,
        lay: &Layer,
        dl: &DevLayer,
        w: &Work,
        n: usize,
    ) -> (Vec<TensorRef>, OpParams) {
        let p = &m.p;
        let (d, k, e) = (p.d, p.n_used, p.n_expert);
        let rl = v(&w.rl, [e, n, 1, 1]);
        let (mode, bias, table) = match (&dl.tid2eid, &dl.bias) {
            (Some(t), _) => (2, rl, t.r),
            (None, Some(b)) => (1, b.r, w.tokens.r),
            (None, None) => (0, rl, w.tokens.r),
        };
        let gating = if p.gating == GATING_SIGMOID { 2 } else { 4 };
        let (ids, rw) = (v(&w.rids, [k, n, 1, 1]), v(&w.rw, [k, n, 1, 1]));
        let mut ra = vec![rl, bias, table, v(&w.tokens, [n, 1, 1, 1]), ids, rw];
        if self.router_mm {
            let x = v(&w.x, [d, n, 1, 1]);
            ra.extend([x, wv(&lay.router), v(&w.router_sync, [n, 1, 1, 1])]);
        }
        let prm = pr(&[p.routed_scale], &[gating, p.norm_topk as i64, mode]);
        (ra, prm)
    }

    /// HC_POST_PRE's and MATMUL_ID_MULTI's xq for a step of `n` tokens: decode steps
    /// only (the products of more tokens quantise x in another layout).
    fn moe_xq(&self, w: &Work, n: usize) -> Option<TensorRef> {
        (self.xq && n == 1).then_some(w.xq.r)
    }

    fn moe(
        &self,
        m: &Deepseek4,
        l: usize,
        lay: &Layer,
        dl: &DevLayer,
        w: &Work,
        n: usize,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, k, e) = (p.d, p.n_used, p.n_expert);
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        let x = v(&w.x, [d, n, 1, 1]);
        let rl = v(&w.rl, [e, n, 1, 1]);
        // The router's product of x (with the shared expert's in the same op when there
        // are no side streams).
        let sf = lay
            .shexp
            .as_ref()
            .map_or(0, |(g, _, _)| g.r.dims[1] as usize);
        let (sg, su, sa) = (
            v(&w.sg, [sf, n, 1, 1]),
            v(&w.su, [sf, n, 1, 1]),
            v(&w.sa, [sf, n, 1, 1]),
        );
        // (or in ROUTER, ABI 1.7)
        let mut of_x = if self.router_mm {
            vec![]
        } else {
            vec![(wv(&lay.router), rl)]
        };
        let sy = v(&w.sy, [d, n, 1, 1]);
        // The shared expert branches off to the side stream (it reads only x), or
        // shares the router's op without one.
        let branched = match (&lay.shexp, self.sides.is_empty()) {
            (Some((g, u, dn)), false) => {
                let sd = self.fork(dev, SIDE_COMP)?;
                self.mm_multi(sd, x, &[(wv(g), sg), (wv(u), su)])?;
                self.shexp_down(sd, p.clamp_shexp[l], wv(dn), [sg, su, sa, sy], n)?;
                true
            }
            (Some((g, u, _)), true) => {
                of_x.extend([(wv(g), sg), (wv(u), su)]);
                false
            }
            (None, _) => false,
        };
        if !of_x.is_empty() {
            self.mm_multi(dev, x, &of_x)?;
        }
        let ff = lay.gate_exps.r.dims[1] as usize;
        let (eg, eu, ea) = (
            v(&w.eg, [ff, k * n, 1, 1]),
            v(&w.eu, [ff, k * n, 1, 1]),
            v(&w.ea, [ff, k * n, 1, 1]),
        );
        let ey = v(&w.ey, [d, k * n, 1, 1]);
        let clamp = pr(&[p.clamp_exp[l]], &[]);
        let in_site = self.routes_in_site(dl, n);
        let routed = self.moe_routed && self.router_mm && !in_site;
        if let (true, Some(xq)) = (routed, self.moe_xq(w, n)) {
            // The router, gate + up and down as one op.
            let (mut a, mut prm) = self.router_args(m, lay, dl, w, n);
            a.extend([xq, lay.gate_exps.r, eg, lay.up_exps.r, eu]);
            a.extend([lay.down_exps.r, ey, ea, w.moe_sync.r]);
            prm.f[1] = p.clamp_exp[l];
            op(ops::MOE_ROUTED, prm, &a)?;
        } else {
            // (the MoE site's op routed where it could)
            if !in_site {
                let (ra, rp) = self.router_args(m, lay, dl, w, n);
                op(ops::ROUTER, rp, &ra)?;
            }
            self.moe_experts(m, lay, w, n, [eg, eu, ea, ey], clamp)?;
        }
        self.moe_end(m, l, lay, w, n, branched, [sg, su, sa, sy])
    }

    /// The routed experts' products after ROUTER (`moe`): gate and up, then down on their
    /// SwiGLU.
    fn moe_experts(
        &self,
        m: &Deepseek4,
        lay: &Layer,
        w: &Work,
        n: usize,
        [eg, eu, ea, ey]: [TensorRef; 4],
        clamp: OpParams,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, k) = (p.d, p.n_used);
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        let x = v(&w.x, [d, n, 1, 1]);
        let ids = v(&w.rids, [k, n, 1, 1]);
        if self.multi {
            // Gate and up on one quantisation of x (one launch for a decode step), the
            // one the mHC site made where it made one.
            let (prm, mut a) = match self.moe_xq(w, n) {
                Some(xq) => (pr(&[], &[1]), vec![x, ids, xq]),
                None => (OpParams::default(), vec![x, ids]),
            };
            a.extend([lay.gate_exps.r, eg, lay.up_exps.r, eu]);
            op(ops::MATMUL_ID_MULTI, prm, &a)?;
        } else {
            op(
                ops::MATMUL_ID,
                OpParams::default(),
                &[lay.gate_exps.r, x, ids, eg],
            )?;
            op(
                ops::MATMUL_ID,
                OpParams::default(),
                &[lay.up_exps.r, x, ids, eu],
            )?;
        }
        if self.swiglu_id {
            let args = [lay.down_exps.r, eg, eu, ids, ey, ea];
            op(ops::SWIGLU_MATMUL_ID, clamp, &args)
        } else {
            op(ops::SWIGLU, clamp, &[eg, eu, ea])?;
            op(
                ops::MATMUL_ID,
                OpParams::default(),
                &[lay.down_exps.r, ea, ids, ey],
            )
        }
    }

    /// The MoE's end (`moe`): the shared expert joined (or run here without side
    /// streams), and the combine where mHC post does not take it.
    #[allow(clippy::too_many_arguments)]
    fn moe_end(
        &self,
        m: &Deepseek4,
        l: usize,
        lay: &Layer,
        w: &Work,
        n: usize,
        branched: bool,
        [sg, su, sa, sy]: [TensorRef; 4],
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, k) = (p.d, p.n_used);
        let op = |code: u32, prm: OpParams, args: &[TensorRef]| dev.op(code, prm, args);
        let rw = v(&w.rw, [k, n, 1, 1]);
        let out = v(&w.mo, [d, n, 1, 1]);
        let y = v(&w.ey, [d, k, n, 1]);
        let shared = match &lay.shexp {
            Some((_, _, dn)) => {
                if branched {
                    self.join(dev, SIDE_COMP)?;
                } else {
                    self.shexp_down(dev, p.clamp_shexp[l], wv(dn), [sg, su, sa, sy], n)?;
                }
                Some(sy)
            }
            None => None,
        };
        if self.post_combine {
            return Ok(()); // mHC post combines y, rw and sy
        }
        match shared {
            Some(sy) => op(ops::MOE_COMBINE, OpParams::default(), &[y, rw, out, sy]),
            None => op(ops::MOE_COMBINE, OpParams::default(), &[y, rw, out]),
        }
    }
}

/// A layer's small tensors on the device.
fn dev_layer(dev: &Arc<Device>, l: &Layer) -> Result<DevLayer> {
    let comp = |c: &CompWeights| -> Result<DevComp> {
        Ok(DevComp {
            ape: upload(dev, &c.ape)?,
            norm: upload(dev, &c.norm)?,
        })
    };
    let tid2eid = match &l.tid2eid {
        Some(t) => {
            let d = dev.i32(t.len())?;
            d.upload_i32(t)?;
            Some(d)
        }
        None => None,
    };
    Ok(DevLayer {
        attn_norm: upload(dev, &l.attn_norm)?,
        ffn_norm: upload(dev, &l.ffn_norm)?,
        hc_attn: (upload(dev, &l.hc_attn.1)?, upload(dev, &l.hc_attn.2)?),
        hc_ffn: (upload(dev, &l.hc_ffn.1)?, upload(dev, &l.hc_ffn.2)?),
        q_a_norm: upload(dev, &l.q_a_norm)?,
        kv_norm: upload(dev, &l.kv_norm)?,
        sinks: upload(dev, &l.sinks)?,
        comp: l.comp.as_ref().map(comp).transpose()?,
        idx: l.indexer.as_ref().map(|i| comp(&i.comp)).transpose()?,
        bias: l.bias.as_deref().map(|b| upload(dev, b)).transpose()?,
        tid2eid,
    })
}

/// Whether `run` (one tiny op, then a sync) succeeds: the backend has the op. `lacks`
/// says what falls back when it does not (debug log).
fn probe_op(dev: &Arc<Device>, lacks: &str, run: impl FnOnce() -> Result<()>) -> bool {
    run()
        .and_then(|()| dev.sync())
        .inspect_err(|e| tracing::debug!("deepseek4: {lacks}: {e:#}"))
        .is_ok()
}

/// Whether the backend runs the glue ops: one tiny NORM_ROPE.
fn probe(dev: &Arc<Device>) -> bool {
    probe_op(dev, "the backend does not run the glue ops", || {
        let (x, w, inv) = (
            dev.f32([2, 1, 1, 1])?,
            dev.f32([2, 1, 1, 1])?,
            dev.f32([1, 1, 1, 1])?,
        );
        let pos = dev.i32(1)?;
        dev.op(
            ops::NORM_ROPE,
            pr(&[1e-6, 1.0], &[1, 0, 0]),
            &[x.r, w.r, inv.r, pos.r, x.r],
        )
    })
}

/// Whether the backend runs MATMUL_MULTI (ABI 1.2): one tiny f32 product through it.
fn probe_multi(dev: &Arc<Device>) -> bool {
    probe_op(dev, "one MATMUL per product", || {
        let (x, w, out) = (
            dev.f32([2, 1, 1, 1])?,
            dev.f32([2, 1, 1, 1])?,
            dev.f32([1, 1, 1, 1])?,
        );
        dev.op(ops::MATMUL_MULTI, OpParams::default(), &[x.r, w.r, out.r])
    })
}

/// Whether the backend runs SWIGLU_MATMUL_ID (ABI 1.3): one tiny f32 grouped product.
fn probe_swiglu_id(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_SWIGLU_ID").is_some_and(|v| v == "0") {
        return false; // A/B runs: SWIGLU, then MATMUL_ID
    }
    probe_op(dev, "SWIGLU, then MATMUL_ID", || {
        let f = |k| dev.f32([k, 1, 1, 1]);
        let (w, g, u, act, out) = (f(2)?, f(2)?, f(2)?, f(2)?, f(1)?);
        let ids = dev.i32(1)?;
        let args = [w.r, g.r, u.r, ids.r, out.r, act.r];
        dev.op(ops::SWIGLU_MATMUL_ID, OpParams::default(), &args)
    })
}

/// Whether the backend's HC_POST takes the MoE's outputs (ABI 1.3): one tiny call.
fn probe_post_combine(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_POST_COMBINE").is_some_and(|v| v == "0") {
        return false; // A/B runs: MOE_COMBINE, then HC_POST
    }
    probe_op(dev, "MOE_COMBINE, then HC_POST", || {
        let f = |k| dev.f32([k, 1, 1, 1]);
        // d = 2, one stream (3 mix weights), one expert a token.
        let (s, y, wts, rw) = (f(2)?, f(2)?, f(3)?, f(1)?);
        dev.op(ops::HC_POST, OpParams::default(), &[s.r, y.r, wts.r, rw.r])
    })
}

/// A probe's [k, m] F32 tensor of 0.5s.
fn filled(dev: &Arc<Device>, k: u64, m: u64) -> Result<Tensor> {
    let t = dev.f32([k, m, 1, 1])?;
    t.upload_f32(&vec![0.5; (k * m) as usize])?;
    Ok(t)
}

/// Whether the backend runs HC_POST_PRE (ABI 1.4): one tiny call (one stream of 4).
fn probe_hc_fused(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_HC_FUSED").is_some_and(|v| v == "0") {
        return false; // A/B runs: HC_POST, MATMUL, HC_PRE
    }
    probe_op(dev, "HC_POST, MATMUL, HC_PRE", || {
        let f = |k, m| filled(dev, k, m);
        // d = 4, one stream (3 mix weights), one token.
        let (s, fnw, scale, base) = (f(4, 1)?, f(4, 3)?, f(3, 1)?, f(3, 1)?);
        let (norm, out, wts, mix) = (f(4, 1)?, f(4, 1)?, f(3, 1)?, f(3, 1)?);
        let sync = dev.i32(1)?;
        sync.upload_i32(&[0])?;
        let args = [
            s.r, fnw.r, scale.r, base.r, norm.r, out.r, wts.r, mix.r, sync.r,
        ];
        dev.op(ops::HC_POST_PRE, pr(&[1e-6, 1e-6], &[2, 0]), &args)
    })
}

/// Whether the backend's HC_POST_PRE stores x quantised in an xq (ABI 1.10) for
/// MATMUL_ID_MULTI to read: one tiny call (d = 32, one stream). `MOE_DS4_XQ=0`: the
/// grouped products quantise x themselves (A/B runs).
fn probe_xq(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_XQ").is_some_and(|v| v == "0") {
        return false;
    }
    probe_op(
        dev,
        "a quantising launch in the MoE's grouped products",
        || {
            let f = |k, m| filled(dev, k, m);
            let (s, fnw, scale, base) = (f(32, 1)?, f(32, 3)?, f(3, 1)?, f(3, 1)?);
            let (norm, out, wts, mix) = (f(32, 1)?, f(32, 1)?, f(3, 1)?, f(3, 1)?);
            let (sync, xq) = (zeros_i32(dev, 1)?, dev.i32(16)?);
            let args = [
                s.r, fnw.r, scale.r, base.r, norm.r, out.r, wts.r, mix.r, sync.r, xq.r,
            ];
            dev.op(ops::HC_POST_PRE, pr(&[1e-6, 1e-6], &[2, 0, 0, 1]), &args)
        },
    )
}

/// Whether a decode step's MoE site routes too (HC_POST_PRE's routing, ABI 1.11):
/// `MOE_DS4_SITE_ROUTE=1` (opt-in until measured on the model) and a backend that takes
/// the form. One tiny call (d = 4, one stream, two experts): the op must choose an expert
/// (the backend may route in the site, or run ROUTER after it).
fn probe_site_route(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_SITE_ROUTE").is_none_or(|v| v != "1") {
        return false;
    }
    let mut id = None;
    let ran = probe_op(dev, "the router's own op after the MoE site", || {
        let f = |k, m| filled(dev, k, m);
        let (s, fnw, scale, base) = (f(4, 1)?, f(4, 3)?, f(3, 1)?, f(3, 1)?);
        let (norm, out, wts, mix) = (f(4, 1)?, f(4, 1)?, f(3, 1)?, f(3, 1)?);
        let sync = zeros_i32(dev, 1)?;
        // Expert 1's row is larger where x is positive: filled() gives 0.5s, and pre
        // keeps x's signs.
        let wr = dev.f32([4, 2, 1, 1])?;
        wr.upload_f32(&[0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])?;
        let (logits, bias, w) = (f(2, 1)?, f(2, 1)?, f(1, 1)?);
        let (tokens, rsync) = (zeros_i32(dev, 1)?, zeros_i32(dev, 1)?);
        let ids = dev.i32(1)?;
        ids.upload_i32(&[-1])?;
        let args = [
            s.r, fnw.r, scale.r, base.r, norm.r, out.r, wts.r, mix.r, sync.r, logits.r, bias.r,
            tokens.r, tokens.r, ids.r, w.r, out.r, wr.r, rsync.r,
        ];
        // i[4] = 1: the routing; i[5..8]: sigmoid scores, normalised, no bias.
        let prm = pr(&[1e-6, 1e-6, 1.0], &[2, 0, 0, 0, 1, 2, 1, 0]);
        dev.op(ops::HC_POST_PRE, prm, &args)?;
        dev.sync()?;
        id = Some(ids.download_f32(1)?[0].to_bits());
        Ok(())
    });
    ran && id == Some(1)
}

/// Whether the backend runs HC_SINKHORN (ABI 1.4): one tiny call (one stream).
fn probe_hc_sinkhorn(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_HC_DEFER").is_some_and(|v| v == "0") {
        return false; // A/B runs: the Sinkhorn inside mHC pre
    }
    probe_op(dev, "the Sinkhorn inside mHC pre", || {
        let wts = filled(dev, 3, 1)?;
        dev.op(ops::HC_SINKHORN, pr(&[0.0, 1e-6], &[2, 1]), &[wts.r])
    })
}

/// Whether to fuse the attention's rotaries (`MOE_DS4_ATT_ROPE=1`, off by default: no
/// gain measured at depth 0, 23:48 UTC, and every warp of every block then computes q's
/// sines and cosines, slow at long-context angles) and the backend's SPARSE_ATTENTION
/// takes inv_freq (ABI 1.4): one tiny call.
fn probe_att_rope(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_ATT_ROPE").is_none_or(|v| v != "1") {
        return false; // NORM_ROPE before and after the attention
    }
    probe_op(dev, "NORM_ROPE around the attention", || {
        let f = |k| filled(dev, k, 1);
        // One head of 2, a window of 1, no compressed rows, the one pair rotated.
        let (q, kv, ring, rows, sinks, out, inv) =
            (f(2)?, f(2)?, f(2)?, f(2)?, f(1)?, f(2)?, f(1)?);
        let (sel, pos) = (dev.i32(1)?, dev.i32(1)?);
        sel.upload_i32(&[0])?;
        pos.upload_i32(&[0])?;
        let a = [
            q.r, kv.r, ring.r, rows.r, sel.r, sinks.r, pos.r, out.r, inv.r,
        ];
        dev.op(ops::SPARSE_ATTENTION, pr(&[1.0, 1e-6, 1.0], &[0, 0, 1]), &a)
    })
}

/// Whether the backend's ROUTER takes x and the router's weights (ABI 1.7): one tiny
/// call, its logits and choice read back (`MOE_DS4_ROUTER_MM=0`: MATMUL, then ROUTER;
/// A/B runs).
fn probe_router_mm(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_ROUTER_MM").is_some_and(|v| v == "0") {
        return false;
    }
    // d = 4, x of 0.5s, two experts whose logits are 1 and 2: expert 1, and both logits
    // written (a backend that took only the first six arguments would leave them as they
    // were: that one is told of with a warning).
    let mut got = None;
    let ran = probe_op(dev, "the router's product as its own MATMUL", || {
        let (x, wr) = (filled(dev, 4, 1)?, dev.f32([4, 2, 1, 1])?);
        wr.upload_f32(&[0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 1.0, 1.0])?;
        let (logits, bias, w) = (
            dev.f32([2, 1, 1, 1])?,
            dev.f32([2, 1, 1, 1])?,
            dev.f32([1, 1, 1, 1])?,
        );
        logits.upload_f32(&[0.0, 0.0])?;
        let (tokens, ids, sync) = (zeros_i32(dev, 1)?, zeros_i32(dev, 1)?, zeros_i32(dev, 1)?);
        let a = [
            logits.r, bias.r, tokens.r, tokens.r, ids.r, w.r, x.r, wr.r, sync.r,
        ];
        dev.op(ops::ROUTER, pr(&[1.0], &[2, 1, 0]), &a)?;
        dev.sync()?;
        got = Some((logits.download_f32(2)?, ids.download_f32(1)?[0].to_bits()));
        Ok(())
    });
    match got {
        Some((l, 1)) if ran && l == [1.0, 2.0] => true,
        Some((l, id)) if ran => {
            tracing::warn!(
                "deepseek4: the backend's ROUTER with its product gave logits {l:?} and expert \
                 {id} where 1, 2 and expert 1 were due: MATMUL, then ROUTER"
            );
            false
        }
        _ => false,
    }
}

/// Whether to send MOE_ROUTED (ABI 1.13; opt-in, `MOE_DS4_MOE_ROUTED=1`, until measured
/// on the model) and the backend runs it: one tiny call in the shape a decode step sends
/// (x of 32 values, type-107 experts, 2 of 2 chosen, so a backend that runs it as one
/// launch does so here too), its choice read back. Told of with a warning when asked
/// for and refused.
fn probe_moe_routed(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_MOE_ROUTED").is_none_or(|v| v != "1") {
        return false;
    }
    let mut id = None;
    let ran = probe_op(dev, "ROUTER, then the routed products", || {
        let (d, e) = (32, 2);
        let x = filled(dev, d, 1)?;
        // Expert 1's logit beats expert 0's: it comes first.
        let wr = dev.f32([d, e, 1, 1])?;
        let mut rows = vec![0.5f32; d as usize];
        rows.extend(vec![1.0f32; d as usize]);
        wr.upload_f32(&rows)?;
        // Zeroed type-107 experts, [32, 32, 2] (one 10-byte block a row), affine.
        let w107 = || -> Result<Tensor> {
            let mut t = dev.tensor(107, [d, d, e, 1], d * e * 10)?;
            t.r.variant = 2;
            Ok(t)
        };
        let (wg, wu, wd) = (w107()?, w107()?, w107()?);
        let (logits, rw) = (f32s(dev, e as usize)?, f32s(dev, e as usize)?);
        let f2 = || dev.f32([d, e, 1, 1]);
        let (g, u, y, act) = (f2()?, f2()?, f2()?, f2()?);
        let i = |n| zeros_i32(dev, n);
        // (xq: x's one q8_1 block, 40 bytes; its values do not change the choice)
        let (tokens, ids, rsync, xq, sync) = (i(1)?, i(2)?, i(1)?, i(10)?, i(1)?);
        let args = [
            logits.r, logits.r, tokens.r, tokens.r, ids.r, rw.r, x.r, wr.r, rsync.r, xq.r, wg.r,
            g.r, wu.r, u.r, wd.r, y.r, act.r, sync.r,
        ];
        dev.op(ops::MOE_ROUTED, pr(&[1.0, 0.0], &[2, 1, 0]), &args)?;
        dev.sync()?;
        id = Some(ids.download_f32(1)?[0].to_bits());
        Ok(())
    });
    let ok = ran && id == Some(1);
    if !ok {
        tracing::warn!(
            "deepseek4: MOE_DS4_MOE_ROUTED=1, but the backend's MOE_ROUTED failed its probe \
             (ran: {ran}, first expert {id:?} where 1 was due): ROUTER, then the products"
        );
    }
    ok
}

/// A layer's positional rings: the window's, then the compressor's and the indexer's kv
/// and gate rings.
fn rings(ls: &LayerState) -> Vec<&Tensor> {
    let comps = [&ls.comp, &ls.idx].into_iter().flatten();
    std::iter::once(&ls.ring)
        .chain(comps.flat_map(|c| [&c.ring_kv, &c.ring_g]))
        .collect()
}

/// Rows of every ring: the window's, then 2 x ratio for each compressor.
fn ring_lengths(m: &Deepseek4) -> impl Iterator<Item = usize> + '_ {
    let comps = m
        .layers
        .iter()
        .flat_map(|l| [l.comp.as_ref(), l.indexer.as_ref().map(|i| &i.comp)])
        .flatten()
        .map(|c| 2 * c.ratio);
    std::iter::once(m.p.window).chain(comps)
}

/// The fewest rows of any ring (see [`GpuPath::pass_cap`]).
fn pass_cap(m: &Deepseek4) -> usize {
    ring_lengths(m).min().unwrap_or(1)
}

/// A layer's query / KV products' weights (`wq_a`, `wkv`, `wq_b`): what [`Prefetch`]'s
/// `q` and `qn` ask for.
fn q_weights(lay: &Layer) -> [TensorRef; 3] {
    [wv(&lay.q_a), wv(&lay.kv), wv(&lay.q_b)]
}

/// Whether the backend runs PREFETCH (ABI 1.9): one call on a tiny tensor.
fn probe_prefetch(dev: &Arc<Device>) -> bool {
    probe_op(dev, "PREFETCH (no weights asked into L2 ahead)", || {
        let t = filled(dev, 64, 4)?;
        dev.op(ops::PREFETCH, OpParams::default(), &[t.r])?;
        dev.sync()
    })
}

/// `MOE_DS4_NORM_MM=1`: q_a's norm inside `wq_b`'s product where the backend runs
/// NORM_MATMUL (off by default: 43 layers on the H200, 2026-12-04 20:50, tg32 165.0 at
/// depth 0 and 145.9 at 32K against 170.5 / 172.5 and 148.9 / 148.7 without).
fn norm_mm_wanted() -> bool {
    std::env::var_os("MOE_DS4_NORM_MM").is_some_and(|v| v == "1")
}

/// Whether to run q_a's norm inside `wq_b`'s product ([`norm_mm_wanted`]) and the
/// backend runs NORM_MATMUL (ABI 1.8): one tiny call (the norm, then an f32 product),
/// its output read back.
fn probe_norm_mm(dev: &Arc<Device>) -> bool {
    if !norm_mm_wanted() {
        return false; // NORM_ROPE, then MATMUL
    }
    probe_op(dev, "NORM_MATMUL", || {
        // x, g and w all 0.5: x normed to 1, times g 0.5, against rows of four 0.5s: 1.
        let (w, x, g, out, xn) = (
            filled(dev, 4, 2)?,
            filled(dev, 4, 1)?,
            filled(dev, 4, 1)?,
            dev.f32([2, 1, 1, 1])?,
            dev.f32([4, 1, 1, 1])?,
        );
        dev.op(
            ops::NORM_MATMUL,
            pr(&[1e-6], &[]),
            &[w.r, x.r, g.r, out.r, xn.r],
        )?;
        dev.sync()?;
        let o = out.download_f32(2)?;
        anyhow::ensure!(
            o.iter().all(|v| (v - 1.0).abs() < 1e-4),
            "outputs {o:?} where 1 was due"
        );
        Ok(())
    })
}

/// Whether the backend's SPARSE_ATTENTION takes sync words after an inv_freq of no
/// values (ABI 1.5; its one-launch decode form's blocks wait on them): one tiny call.
fn probe_att_sync(dev: &Arc<Device>) -> bool {
    probe_op(dev, "SPARSE_ATTENTION's sync words", || {
        let f = |k| filled(dev, k, 1);
        // One head of 2, a window of 1, no compressed rows.
        let (q, kv, ring, rows, sinks, out) = (f(2)?, f(2)?, f(2)?, f(2)?, f(1)?, f(2)?);
        let (sel, pos, sync) = (zeros_i32(dev, 1)?, zeros_i32(dev, 1)?, zeros_i32(dev, 1)?);
        let none = TensorRef {
            dims: [0, 1, 1, 1],
            ..sync.r
        };
        let a = [
            q.r, kv.r, ring.r, rows.r, sel.r, sinks.r, pos.r, out.r, none, sync.r,
        ];
        dev.op(ops::SPARSE_ATTENTION, pr(&[1.0], &[0, 0, 0]), &a)
    })
}

/// Whether the backend's TOPK_ROWS takes work words (ABI 1.6; one token's selection
/// then may run on many blocks): one tiny call.
fn probe_topk_work(dev: &Arc<Device>) -> bool {
    probe_op(dev, "TOPK_ROWS's work words", || {
        let (scores, out) = (filled(dev, 2, 1)?, zeros_i32(dev, 1)?);
        let (pos, work) = (
            zeros_i32(dev, 1)?,
            zeros_i32(dev, ops::TOPK_ROWS_WORK_WORDS as usize)?,
        );
        let a = [scores.r, pos.r, out.r, work.r];
        dev.op(ops::TOPK_ROWS, pr(&[], &[1]), &a)
    })
}

/// Whether to rotate the indexer's queries inside INDEX_SCORES (`MOE_DS4_IDX_ROPE=1`,
/// off by default: no gain measured at depth 0, 23:53 UTC, and each of a token's blocks
/// then computes every head's sines and cosines, slow at long-context angles) and the
/// backend takes inv_freq (ABI 1.4): one tiny call.
fn probe_idx_rope(dev: &Arc<Device>) -> bool {
    if std::env::var_os("MOE_DS4_IDX_ROPE").is_none_or(|v| v != "1") {
        return false; // NORM_ROPE before the scores
    }
    probe_op(dev, "NORM_ROPE before the indexer's scores", || {
        let f = |k| filled(dev, k, 1);
        // One head of 2, one row, the one pair rotated.
        let (q, wh, rows, out, inv) = (f(2)?, f(1)?, f(2)?, f(1)?, f(1)?);
        let pos = dev.i32(1)?;
        pos.upload_i32(&[0])?;
        let a = [q.r, wh.r, rows.r, pos.r, out.r, inv.r];
        dev.op(ops::INDEX_SCORES, pr(&[1.0, 1.0, 1.0], &[1, 1]), &a)
    })
}

/// `n` values of unit variance (uniform on [-sqrt 3, sqrt 3]) from a xorshift64* stream
/// seeded by `seed`: the same values on every run.
fn unit_noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let half = 3f32.sqrt();
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let u = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32 / (1u64 << 24) as f32;
            (2.0 * u - 1.0) * half
        })
        .collect()
}

/// Sizes the device path handles (the kernels' limits); the host glue runs otherwise.
pub(super) fn fits(p: &Ds4Params) -> bool {
    p.hc <= 8
        && p.head_dim <= 512
        && p.head_dim.is_multiple_of(2)
        && p.idx_dim <= 256
        && p.idx_heads * p.idx_dim <= 8192
        && p.idx_heads <= 256
        && p.n_expert <= 1024
        && p.n_used <= 16
        && p.n_used * MAX_CHUNK <= 65535
        && p.q_lora.is_multiple_of(2)
        && p.idx_dim.is_multiple_of(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_noise_has_unit_variance_and_repeats() {
        let v = unit_noise(100_000, 7);
        let mean = v.iter().sum::<f32>() / v.len() as f32;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / v.len() as f32;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.02,
            "mean {mean}, variance {var}"
        );
        assert!(v.iter().all(|x| x.abs() <= 3f32.sqrt()));
        assert_eq!(v[..10], unit_noise(10, 7)[..]);
        assert_ne!(v[..10], unit_noise(10, 8)[..]);
    }

    #[test]
    fn prefetch_setting() {
        let all = Prefetch {
            q: true,
            o: true,
            moe: true,
            ..Prefetch::default()
        };
        assert_eq!(Prefetch::parse("1"), Some(all));
        assert_eq!(Prefetch::parse("0"), Some(Prefetch::default()));
        assert_eq!(Prefetch::parse(""), Some(Prefetch::default()));
        let qo = Prefetch::parse("q, o").unwrap();
        assert!(qo.q && qo.o && !qo.moe && !qo.qn && qo.any());
        assert!(Prefetch::parse("qn").unwrap().qn);
        let ob = Prefetch::parse("ob").unwrap();
        assert!(ob.ob && !ob.o && ob.any());
        assert_eq!(Prefetch::parse("q,x"), None);
        assert_eq!(Prefetch::parse("2"), None);
    }

    #[test]
    fn graph_keys_apart() {
        // Every slot, length and kind its own graph, none an MTP chain's.
        let slots = 3;
        let mtp_max = (MAX_CHUNK + 1) * slots + slots - 1;
        let mut seen = std::collections::HashSet::new();
        for code in 0..8 {
            let kind = StepKind {
                long: code & 1 != 0,
                short: code & 2 != 0,
                wide_topk: code & 4 != 0,
            };
            assert_eq!(kind.code(), code);
            for n in 1..=MAX_CHUNK {
                for slot in 0..slots {
                    let key = graph_key(slots, slot, n, kind);
                    assert!(key > mtp_max && seen.insert(key));
                }
            }
        }
    }

    #[test]
    fn step_kinds() {
        // Token p sees (p + 1) / 4 compressed rows: up to position 2050 at most 512.
        let k = |p0, n| StepKind::decide(true, 4, 512, p0, n);
        assert_eq!(
            k(0, 1),
            StepKind {
                long: false,
                short: true,
                wide_topk: false
            }
        );
        assert!(k(2050, 1).short && !k(2051, 1).short);
        // Once the indexer selects, the keys are as many as deep into a context.
        assert!(!k(2050, 1).long && k(2051, 1).long);
        // (no indexer layers)
        assert!(!StepKind::decide(true, 0, 512, 2051, 1).long);
        // A chunk is short only if its last token is.
        assert!(k(0, 2051).short && !k(0, 2052).short);
        assert_eq!(
            k(4096, 1),
            StepKind {
                long: true,
                short: false,
                wide_topk: false
            }
        );
        // More than 6144 rows (6145 from position 24579) for the many-block top-k.
        assert!(!k(24578, 1).wide_topk && k(24579, 1).wide_topk);
        assert!(!StepKind::decide(true, 0, 512, 0, 1).short); // no indexer layers
        assert!(!StepKind::decide(false, 4, 512, 0, 1).short); // switched off
    }
}
