//! Placement-policy plugins: which device holds each tensor (and expert slice).

use abi_stable::{
    std_types::{ROption, RResult, RString, RVec},
    StableAbi,
};

use crate::backend::DeviceInfo;

#[repr(u8)]
#[derive(StableAbi, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Prefill,
    Decode,
}

/// One weight tensor of the model.
#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct TensorMeta {
    pub name: RString,
    /// GGUF order: `shape[0]` is the innermost (contiguous) dimension.
    pub shape: RVec<u64>,
    pub type_id: u32,
    pub bytes: u64,
    /// Transformer block index, -1 for tensors outside the blocks.
    pub layer: i32,
    /// Number of experts stacked in this tensor (its outermost dim), 0 if not an expert tensor.
    pub n_experts: u32,
    /// What the tensor does: "embedding", "attention", "norm", "dense_ffn", "router",
    /// "shared_expert", "routed_experts", "output", "other".
    pub role: RString,
}

#[repr(C)]
#[derive(StableAbi, Clone, Debug)]
pub struct PlacementRequest {
    pub devices: RVec<DeviceInfo>,
    pub tensors: RVec<TensorMeta>,
    pub phase: Phase,
    /// Optional routing profile (the hotness CSV, see docs/placement.md).
    pub routing_profile: ROption<RString>,
    /// The `[placement.settings]` table of plugins.toml, as TOML.
    pub settings_toml: RString,
}

/// Where one tensor, or one expert of a stacked expert tensor, lives.
#[repr(C)]
#[derive(StableAbi, Clone, Debug, PartialEq)]
pub struct Assignment {
    pub tensor: RString,
    /// -1 = the whole tensor; otherwise this expert's slice.
    pub expert: i32,
    /// Index into `PlacementRequest::devices`.
    pub device: u32,
    pub reason: RString,
}

#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct PlacementPolicy {
    pub name: RString,
    pub description: RString,
    pub place: extern "C" fn(request: &PlacementRequest) -> RResult<RVec<Assignment>, RString>,
}

impl std::fmt::Debug for PlacementPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PlacementPolicy({})", self.name)
    }
}
