//! Kernel-backend plugins: devices, buffers, streams and events, and the ops models run.

use abi_stable::{
    std_types::{RResult, RSlice, RSliceMut, RString, RVec, Tuple2},
    StableAbi,
};

use crate::quant::QuantFormat;

/// Type ids the backends understand natively (the ggml numbering).
pub mod types {
    pub const F32: u32 = 0;
    pub const F16: u32 = 1;
    pub const Q8_0: u32 = 8;
    pub const I32: u32 = 26;
    pub const BF16: u32 = 30;
    pub const MXFP4: u32 = 39;
}

#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct DeviceInfo {
    /// Index within its backend.
    pub index: u32,
    pub name: RString,
    /// `cpu`, `sm_90`, `gfx1100`, `gfx1151`, ...
    pub arch: RString,
    pub memory_bytes: u64,
    /// Sustained memory bandwidth (bytes/s), measured or nominal.
    pub bandwidth_bytes_per_s: f64,
    /// The device reads host memory directly (CPU, APUs such as Strix Halo).
    pub unified_memory: bool,
}

/// Opaque handles, meaningful only to the backend that issued them.
pub type BufferId = u64;
pub type StreamId = u64;
pub type EventId = u64;

/// A view of a buffer as a tensor, dims innermost first (GGUF/ggml order), contiguous.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq)]
pub struct TensorRef {
    pub buffer: BufferId,
    /// Byte offset into the buffer.
    pub offset: u64,
    pub type_id: u32,
    /// Per-file meaning of `type_id` (see `QuantFormat::resolve_variant`).
    pub variant: u64,
    pub dims: [u64; 4],
}

impl TensorRef {
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// Operation codes for [`Backend::run_op`]. New ops get new codes in later minor
/// versions; a backend answers an unknown code with a "not supported" error.
pub mod ops {
    /// args: table (any type, [cols, rows]), ids (I32 [n]), out (F32 [cols, n]).
    pub const GET_ROWS: u32 = 1;
    /// out = W x per column. args: w ([k, m]), x (F32 [k, n]), out (F32 [m, n]).
    pub const MATMUL: u32 = 2;
    /// f[0] = eps. args: x (F32 [d, n]), w (F32 [d]), out (F32 [d, n]).
    pub const RMS_NORM: u32 = 3;
    /// Rotary embedding in place-free form. f[0] = freq_base, f[1] = freq_scale,
    /// i[0] = rotated dims per head, i[1] = mode (0: adjacent pairs, 2: halves / NeoX).
    /// args: x (F32 [head_dim, heads, n]), pos (I32 [n]), out (same as x).
    pub const ROPE: u32 = 4;
    /// Writes new keys/values into a cache. args: src (F32 [hd, kv_heads, n]),
    /// cache (F32 [hd, kv_heads, ctx, slots]), slot (I32 [n]), pos (I32 [n]).
    pub const KV_STORE: u32 = 5;
    /// Causal attention over cached keys/values: token t attends to positions
    /// 0..=pos[t] of cache slot slot[t]. f[0] = scale.
    /// args: q (F32 [hd, heads, n]), k_cache, v_cache (F32 [hd, kv_heads, ctx, slots]),
    /// slot (I32 [n]), pos (I32 [n]), out (F32 [hd, heads, n]).
    pub const ATTENTION: u32 = 6;
    /// out = silu(gate) * up; with f[0] = lim > 0, gate is first clamped above at lim
    /// and up to [-lim, lim]. args: gate, up, out (F32, same shape).
    pub const SWIGLU: u32 = 7;
    /// out = a + b. args: a, b, out (F32, same shape).
    pub const ADD: u32 = 8;
    /// Grouped (MoE) product: pair p = token * slots + slot multiplies expert ids[p].
    /// args: w ([k, m, experts]), x (F32 [k, tokens] or [k, pairs]), ids (I32
    /// [slots, tokens], -1 = none: zeros), out (F32 [m, pairs]). From ABI 1.12, i[0] = 1:
    /// the ids are fixed (uploaded before the model runs, written by no op), so the
    /// backend may read them, and start on their experts' weights, before the ops queued
    /// ahead of this one have finished; 0: they may be an earlier op's output.
    pub const MATMUL_ID: u32 = 9;

    // DeepSeek-V4 glue (ABI 1.1). Positions come from an I32 tensor `pos` ([n], the
    // chunk's first at pos[0]) so a captured step replays at any position.
    /// RMS norm of each d-row (i[0]: 0 none, 1 plain, 2 times w; f[0] = eps), then
    /// rotary on the trailing 2*i[1] values as interleaved pairs at angle pos * inv_freq
    /// (f[1] = cos/sin scale, i[2] = 1: inverse rotation). args: x (F32 [d, heads, n]),
    /// w (F32 [d]), inv_freq (F32 [i[1]]), pos, out (like x; may be x).
    pub const NORM_ROPE: u32 = 16;
    /// mHC pre: mixes = W * streams (un-normalised) -> pre / post / Sinkhorn comb
    /// (i[0] iterations, f[1] = eps of the weights; i[1] = 1: the head, pre only), then
    /// x = sum pre_h * stream_h, RMS-normed (f[0]) times norm. args: streams (F32
    /// [d, hc, n]), mix ([nm, n]), scale ([3] or [1]), base ([nm]), norm ([d]), out
    /// ([d, n]), weights out ([nm, n]); nm = 2hc + hc^2 (hc for the head). From ABI
    /// 1.4, i[2] = 1 (site mode): comb is left as the Sinkhorn's input (the logits
    /// mix * (the streams' RMS factor) * scale + base) for HC_SINKHORN to finish.
    pub const HC_PRE: u32 = 17;
    /// mHC post, in place: stream_k = post_k * block + sum_j comb[j][k] * stream_j.
    /// args: streams (F32 [d, hc, n]), block ([d, n]), weights ([nm, n]). From ABI 1.3
    /// also: streams, y ([d, k, n]), weights, w ([k, n]), optional shared ([d, n]):
    /// block is then MOE_COMBINE's output of (y, w, shared), not stored.
    pub const HC_POST: u32 = 18;
    /// A learned compressor: pools each window of i[0] positions that closes in this
    /// chunk (i[1] = 1: overlapping windows, inputs 2*dim wide) into rows[window],
    /// RMS-normed (f[0]) and rotated on its last 2*i[2] values (f[1] scale), and keeps
    /// the last 2*ratio inputs in the rings. args: kv, gate (F32 [width, n]), pos, ape
    /// ([width, ratio]), norm ([dim]), inv_freq, ring_kv, ring_gate ([width, 2 ratio]),
    /// rows ([dim, capacity]).
    pub const COMPRESS: u32 = 19;
    /// Lightning-indexer scores: out[t][s] = sum_h relu(q_th . row_s) * f[0] * (w_th *
    /// f[1]) for the (pos+1)/i[0] rows visible to token t. args: q (F32 [dim, heads, n]),
    /// w ([heads, n]), rows ([dim, capacity]), pos, out ([capacity, n]); dim even. From
    /// ABI 1.4 a 6th, inv_freq ([i[1]]): q is first rotated as NORM_ROPE (no norm, i[1] pairs,
    /// scale f[2]) would; q is left as it was. i[2] > 0: no token of the op sees more than
    /// i[2] rows (a hint for the kernel's shape; 0: no bound but the capacity).
    pub const INDEX_SCORES: u32 = 20;
    /// Per token, the k best of its (pos+1)/i[0] visible scores (ties: lower index), or
    /// all when no more than k; -1 pads. args: scores (F32 [capacity, n]), pos, out (I32
    /// [k, n]). From ABI 1.6 a 4th, work (I32, at least TOPK_ROWS_WORK_WORDS, 16-byte
    /// aligned, zero before its first use, kept between calls, used by no other op and
    /// by no two calls at once): words a backend may count on to split one token's
    /// selection over parallel work.
    pub const TOPK_ROWS: u32 = 21;
    /// Words of TOPK_ROWS's work argument.
    pub const TOPK_ROWS_WORK_WORDS: u64 = 16384;
    /// Attention with per-head sink logits over one shared K=V head: the sliding window
    /// (ring of `window` rows: positions older than the chunk at pos % window; stored
    /// after) plus compressed rows (i[1]: 0 none, 1 the (pos+1)/i[0] visible, 2 the
    /// selected), scale f[0]. args: q (F32 [hd, heads, n]), kv ([hd, n]), ring ([hd,
    /// window]), rows ([hd, capacity]), sel (I32 [k, n]), sinks ([heads]), pos, out
    /// (like q); hd even. From ABI 1.4 a 9th, inv_freq ([i[2]]): q is first NORM_ROPE'd as (plain
    /// norm, f[1] = eps, i[2] pairs, scale f[2]) and the output inverse-rotated as
    /// NORM_ROPE (no norm, i[2] pairs, scale f[2], inverse) would; q is left as it was.
    /// From ABI 1.5 a 10th, sync (I32 [ceil(heads / 16)] or more, zero before its first
    /// use, kept between calls and used by no other op): words a backend may count on to
    /// let one step's parallel parts wait for each other (the CUDA / HIP backends: with
    /// `sparse_attention_sync_words` a decode step may also count its head groups' key
    /// splits in the later ones); an inv_freq of no values before it stands for none
    /// (no rotary inside).
    /// i[3] = 1 hints that the positions are far into a long context (a backend may then
    /// split each token's keys over more parallel work); any value gives the same result
    /// up to summation order.
    pub const SPARSE_ATTENTION: u32 = 22;
    /// SPARSE_ATTENTION's sync words for `heads` heads that the CUDA / HIP backends use:
    /// ceil(heads / 16) for the one-launch split form, then ceil(heads / 4) for the
    /// grouped decode form's counts.
    pub const fn sparse_attention_sync_words(heads: u64) -> u64 {
        heads.div_ceil(16) + heads.div_ceil(4)
    }
    /// Router: scores sigmoid (i[0] = 2) or sqrt(softplus) (4); experts = the k best
    /// (i[2] = 0), the k best of score + bias (1) or the token's hash-table row (2);
    /// weights = scores, normalised when i[1] = 1, times f[0]. args: logits (F32 [E, n]),
    /// bias ([E]), table (I32 [k, vocab]), tokens (I32 [n]), ids out (I32 [k, n]),
    /// weights out (F32 [k, n]); bias is read only in mode 1 (elsewhere any tensor, even
    /// logits). From ABI 1.7 the product too, with three more: x (F32
    /// [d, n]), the router's weights w_r ([d, E], as MATMUL takes them) and sync (I32
    /// [n], zero before its first use, left zero by each call, used by no other op):
    /// logits is then an output, MATMUL(w_r, x), and a backend may compute it and the
    /// selection in one launch (counting its parts in sync).
    pub const ROUTER: u32 = 23;
    /// ROUTER's arguments with its product (ABI 1.7).
    pub const ROUTER_MM_ARGS: usize = 9;
    /// out[t] = sum_j w[t][j] * y[t][j] (+ shared[t]). args: y (F32 [d, k, n]), w ([k,
    /// n]), out ([d, n]), optional shared ([d, n]).
    pub const MOE_COMBINE: u32 = 24;
    /// out[a, c, b] = x[a, b, c]. args: x (F32 [a, b, c]), out.
    pub const TRANSPOSE12: u32 = 25;
    /// Stream capture: ops queued on the stream between GRAPH_BEGIN and GRAPH_END are
    /// recorded as graph i[0] instead of run; GRAPH_LAUNCH replays it. A backend may
    /// drop its graphs (its scratch memory moved): GRAPH_LAUNCH then fails and the
    /// caller records again. No args.
    pub const GRAPH_BEGIN: u32 = 26;
    pub const GRAPH_END: u32 = 27;
    pub const GRAPH_LAUNCH: u32 = 28;
    /// Several products of one input (ABI 1.2): out_i = W_i x for each pair, each as
    /// MATMUL computes it, in any order or together (a backend may run compatible ones
    /// in one launch), so no output may overlap x or another output; a product that
    /// fails fails the op, possibly after others were written. args: x (F32 [k, n]),
    /// then pairs w_i ([k, m_i]), out_i (F32 [m_i, n]); at least one.
    pub const MATMUL_MULTI: u32 = 29;
    /// Several grouped products of one input and one routing (ABI 1.2): out_i =
    /// MATMUL_ID(w_i, x, ids) for each pair, on the terms of MATMUL_MULTI. args: x, ids,
    /// then pairs w_i ([k, m, experts]), out_i; at least one. A backend that runs
    /// MATMUL_MULTI runs this too. From ABI 1.10, i[0] = 1: xq (I32) follows ids, the
    /// tensor an HC_POST_PRE that wrote x was given as its xq, with nothing written to x
    /// or xq since; the backend may read x's quantisation from it instead of making one.
    pub const MATMUL_ID_MULTI: u32 = 30;
    /// MATMUL_ID of SWIGLU(gate, up) (ABI 1.3; f[0] as SWIGLU's): the routed experts'
    /// down product from their gate and up outputs (or a dense down product as one
    /// expert, id 0), the SwiGLU computed where the backend can fuse it. args: w ([k, m,
    /// experts]), gate, up (F32 [k, pairs]), ids, out (F32 [m, pairs]), act (F32 [k,
    /// pairs]: the backend may store the SwiGLU values there, or leave it as it was).
    /// From ABI 1.12, i[0] = 1: fixed ids, as MATMUL_ID's i[0].
    pub const SWIGLU_MATMUL_ID: u32 = 31;
    /// mHC post, then the next site's mixes and mHC pre, as one op (ABI 1.4): HC_POST
    /// (when post inputs are given), mixes = MATMUL(fn, streams as [hc d, n]), then
    /// HC_PRE (its params). args: streams, fn ([hc d, nm]), scale, base, norm, out (as
    /// HC_PRE's), weights ([max(nm, 2hc + hc^2), n]: the previous site's post / comb are
    /// read where post inputs are given, this site's written, nm a token), mix (F32 [nm,
    /// n]: the backend may store the mixes there), sync (I32 [n]: zero before the first
    /// call, left zero by each; the backend may count blocks there), then the post
    /// inputs as HC_POST takes them after the streams: none, block ([d, n]), or y, w
    /// [, shared]. i[2] = 1 as HC_PRE's. From ABI 1.10, i[3] = 1: one more argument
    /// last, xq (I32, at least d n / 2 values, d a multiple of 32), where the backend
    /// stores out in the quantised form its grouped products read (MATMUL_ID_MULTI's
    /// xq); a backend may also leave it as it was when its products never read it.
    /// From ABI 1.11, i[4] = 1: then ROUTER with its product (ABI 1.7) of the site's x,
    /// its nine arguments last (after xq; their x is `out`), its params in f[2] (f[0] of
    /// ROUTER), i[5], i[6], i[7] (i[0..3] of ROUTER); the backend may sum the logits in
    /// another order than ROUTER's (near ties may then choose differently).
    pub const HC_POST_PRE: u32 = 32;
    /// The Sinkhorn of the comb matrices HC_PRE / HC_POST_PRE left as logits (ABI 1.4),
    /// in place: i[0] iterations, i[1] = hc, f[1] = eps (HC_PRE's). args: weights (F32
    /// [2hc + hc^2, n]).
    pub const HC_SINKHORN: u32 = 33;
    /// A product of RMS-normed x (ABI 1.8): out = MATMUL(w, x / sqrt(mean(x^2) + f[0]) *
    /// g), each column of x normed on its own. args: w ([k, m], as MATMUL takes it), x (F32
    /// [k, n]), g (F32 [k]), out (F32 [m, n]), xn (F32 [k, n]: the backend may store the
    /// normed x there, or leave it as it was). A backend may norm inside the product (its
    /// sum of squares in another order than NORM_ROPE's).
    pub const NORM_MATMUL: u32 = 34;
    /// A hint (ABI 1.9): the backend may start bringing the args' bytes into the
    /// device's cache, so that ops queued after it (on any stream) that read them find
    /// them there. Nothing is written; the op may return before the bytes arrive, and
    /// the stream's later ops need not wait for them. args: 1 to 4 tensors of any type
    /// on one device. A backend that cannot prefetch answers "not supported".
    pub const PREFETCH: u32 = 35;
    /// One token's routed experts as one op (ABI 1.13): ROUTER with its product (ABI
    /// 1.7), then MATMUL_ID_MULTI of the gate and up products on x's quantisation xq
    /// (its i[0] = 1), then SWIGLU_MATMUL_ID of the down product, for the ids ROUTER
    /// chose, with the same results as the three ops. args: ROUTER's nine, xq (as
    /// MATMUL_ID_MULTI takes it), gate w, gate out, up w, up out, down w, down out, act
    /// (SWIGLU_MATMUL_ID's), sync (I32 [1]: zero before the first call, used by no other
    /// op; the backend may count blocks there and leave what its next call expects).
    /// ROUTER's params in f[0] and i[0..3]; f[1] = the SwiGLU's clamp (SWIGLU_MATMUL_ID's
    /// f[0]). A backend may run the three ops, or all of it in one launch.
    pub const MOE_ROUTED: u32 = 36;
    /// MOE_ROUTED's arguments.
    pub const MOE_ROUTED_ARGS: usize = 18;
}

/// MOE_COMBINE's arguments: (y, w, out, optional shared expert output).
pub fn moe_combine_args(
    a: &[TensorRef],
) -> Result<(TensorRef, TensorRef, TensorRef, Option<TensorRef>), String> {
    match a {
        [y, w, out] => Ok((*y, *w, *out, None)),
        [y, w, out, s] => Ok((*y, *w, *out, Some(*s))),
        _ => Err(format!(
            "moe_combine: expected 3 or 4 tensor arguments, got {}",
            a.len()
        )),
    }
}

/// Parameters of one op call.
#[repr(C)]
#[derive(StableAbi, Clone, Copy, Debug, Default, PartialEq)]
pub struct OpParams {
    pub f: [f32; 8],
    pub i: [i64; 8],
}

/// One kernel-backend plugin: a table of functions over its devices.
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct Backend {
    pub name: RString,
    pub devices: extern "C" fn() -> RResult<RVec<DeviceInfo>, RString>,
    /// The host hands over every quant format it loaded, before any op runs.
    pub register_quant_formats: extern "C" fn(formats: RVec<QuantFormat>) -> RResult<(), RString>,
    pub alloc: extern "C" fn(device: u32, bytes: u64) -> RResult<BufferId, RString>,
    pub free: extern "C" fn(buffer: BufferId) -> RResult<(), RString>,
    pub upload:
        extern "C" fn(buffer: BufferId, offset: u64, data: RSlice<'_, u8>) -> RResult<(), RString>,
    pub download: extern "C" fn(
        buffer: BufferId,
        offset: u64,
        out: RSliceMut<'_, u8>,
    ) -> RResult<(), RString>,
    pub stream_create: extern "C" fn(device: u32) -> RResult<StreamId, RString>,
    /// Records an event on a stream: it completes when all work queued before it has.
    pub event_record: extern "C" fn(stream: StreamId) -> RResult<EventId, RString>,
    /// Makes later work on `stream` (possibly of another device) wait for `event`.
    pub stream_wait_event: extern "C" fn(stream: StreamId, event: EventId) -> RResult<(), RString>,
    pub synchronize: extern "C" fn(stream: StreamId) -> RResult<(), RString>,
    /// Queues op `op` (see [`ops`]) on `stream`.
    pub run_op: extern "C" fn(
        stream: StreamId,
        op: u32,
        params: OpParams,
        args: RSlice<'_, TensorRef>,
    ) -> RResult<(), RString>,
    /// How many times each kernel ran since the backend loaded, sorted by name; a
    /// backend may add `<name>.ns` entries with the nanoseconds each kernel took.
    pub kernel_counters: extern "C" fn() -> RVec<Tuple2<RString, u64>>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Backend({})", self.name)
    }
}
