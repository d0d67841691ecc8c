//! Quant-format plugins: one [`QuantFormat`] per GGUF tensor type id they claim.

use abi_stable::{
    std_types::{RResult, RSlice, RSliceMut, RStr, RString},
    StableAbi,
};

use crate::q8::BlockQ8_1;

/// Per-file meaning of a type id (e.g. ROCmFP2 two-scale vs affine). 0 = the only one.
pub type Variant = u64;

/// One GGUF tensor type, as a table of functions over packed blocks.
///
/// All functions work on whole blocks: `blocks.len()` is a multiple of `block_bytes`.
#[repr(C)]
#[derive(StableAbi, Clone)]
pub struct QuantFormat {
    /// The `ggml_type` id stored in GGUF tensor infos.
    pub type_id: u32,
    pub name: RString,
    /// Weights per block (1 for plain float types).
    pub block_weights: u32,
    pub block_bytes: u32,
    /// Picks the meaning of this type for one file from its metadata (a JSON object of
    /// the file's scalar key/values). Formats with one meaning return 0.
    pub resolve_variant: extern "C" fn(metadata_json: RStr<'_>) -> RResult<Variant, RString>,
    /// Checks every block; the error names the first bad block and why.
    pub validate: extern "C" fn(variant: Variant, blocks: RSlice<'_, u8>) -> RResult<(), RString>,
    /// Decodes blocks to f32 (`out.len() == n_blocks * block_weights`).
    pub decode: extern "C" fn(
        variant: Variant,
        blocks: RSlice<'_, u8>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), RString>,
    /// Reference encoder from f32 (`input.len()` a multiple of `block_weights`).
    pub encode: extern "C" fn(
        variant: Variant,
        input: RSlice<'_, f32>,
        out: RSliceMut<'_, u8>,
    ) -> RResult<(), RString>,
    /// Dot products of weight rows with q8_1 activation columns.
    ///
    /// `rows` holds `n_rows` rows of `k` weights each; `act` holds `n_cols` columns of
    /// `k / 32` blocks each; `out[c * n_rows + r] = dot(row r, column c)`.
    pub dot_q8: extern "C" fn(
        variant: Variant,
        rows: RSlice<'_, u8>,
        k: u64,
        act: RSlice<'_, BlockQ8_1>,
        out: RSliceMut<'_, f32>,
    ) -> RResult<(), RString>,
}

impl QuantFormat {
    /// Bytes of one row of `k` weights.
    pub fn row_bytes(&self, k: u64) -> Result<u64, String> {
        let bw = self.block_weights as u64;
        if bw == 0 || !k.is_multiple_of(bw) {
            return Err(format!(
                "{} rows of {k} weights are not a whole number of {bw}-weight blocks",
                self.name
            ));
        }
        Ok(k / bw * self.block_bytes as u64)
    }
}

impl std::fmt::Debug for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "QuantFormat({} id={} {}w/{}B)",
            self.name, self.type_id, self.block_weights, self.block_bytes
        )
    }
}

/// Checks the shape of a `dot_q8` call and returns `(row_bytes, n_rows, n_cols)`.
pub fn dot_shape(
    block_weights: u32,
    block_bytes: u32,
    rows: usize,
    k: u64,
    act: usize,
    out: usize,
) -> Result<(usize, usize, usize), String> {
    let k = k as usize;
    if k == 0 || !k.is_multiple_of(32) || !k.is_multiple_of(block_weights as usize) {
        return Err(format!(
            "dot_q8: k = {k} is not a multiple of 32 and of the block size {block_weights}"
        ));
    }
    let row_bytes = k / block_weights as usize * block_bytes as usize;
    if !rows.is_multiple_of(row_bytes) {
        return Err(format!(
            "dot_q8: {rows} weight bytes are not whole rows of {row_bytes}"
        ));
    }
    let per_col = k / 32;
    if !act.is_multiple_of(per_col) {
        return Err(format!(
            "dot_q8: {act} activation blocks are not whole columns of {per_col}"
        ));
    }
    let (n_rows, n_cols) = (rows / row_bytes, act / per_col);
    if out != n_rows * n_cols {
        return Err(format!(
            "dot_q8: output holds {out} values, expected {n_rows} x {n_cols}"
        ));
    }
    Ok((row_bytes, n_rows, n_cols))
}

/// Every format's `resolve_variant` when the type has one meaning.
pub extern "C" fn single_variant(_metadata_json: RStr<'_>) -> RResult<Variant, RString> {
    RResult::ROk(0)
}
