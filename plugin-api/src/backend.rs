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
    /// out = silu(gate) * up. args: gate, up, out (F32, same shape).
    pub const SWIGLU: u32 = 7;
    /// out = a + b. args: a, b, out (F32, same shape).
    pub const ADD: u32 = 8;
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
