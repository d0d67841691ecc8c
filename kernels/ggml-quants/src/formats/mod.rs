//! The ggml tensor types this plugin provides.
//!
//! Quantised types implement [`Block`] (one block: check, unpack, decode, encode, dot);
//! the float types implement [`Format`] directly. Decoding and the dot product share the
//! bit-unpacking helpers, so the bit-exact decode tests against gguf-py also pin down the
//! layout the dot kernels read (and tests/dot_q8.rs compares the two).

pub mod float;
pub mod kquants;
pub mod legacy;
pub mod mxfp4;

use moe_plugin_api::BlockQ8_1;

use crate::dot::{self, DotUnit, Isa, Shape};

/// Table-level operations; lengths are checked by the ABI layer before these run.
pub trait Format: 'static {
    const ID: u32;
    const NAME: &'static str;
    /// Weights per block (1 for float types).
    const BW: usize;
    /// Bytes per block.
    const BB: usize;
    fn validate(blocks: &[u8]) -> Result<(), String>;
    fn decode(blocks: &[u8], out: &mut [f32]);
    fn encode(input: &[f32], out: &mut [u8]) -> Result<(), String>;
    fn dot(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]);
}

/// One block of a quantised type. `DotUnit::DW`/`DB` are the block's weights/bytes.
pub trait Block: DotUnit {
    const ID: u32;
    const NAME: &'static str;
    /// Checks one block's scale fields; the error says which field and why.
    fn check(b: &[u8]) -> Result<(), String>;
    /// Decodes one block (`out.len() == DW`) with the same f32 operations, in the same
    /// order, as gguf-py's numpy dequantiser.
    fn decode_block(b: &[u8], out: &mut [f32]);
    /// Reference quantiser for one block (`x.len() == DW`, `out.len() == DB`); inputs are
    /// finite (checked by the caller).
    fn encode_block(x: &[f32], out: &mut [u8]) -> Result<(), String>;
}

impl<T: Block> Format for T {
    const ID: u32 = <T as Block>::ID;
    const NAME: &'static str = <T as Block>::NAME;
    const BW: usize = T::DW;
    const BB: usize = T::DB;

    fn validate(blocks: &[u8]) -> Result<(), String> {
        for (i, b) in blocks.chunks_exact(T::DB).enumerate() {
            T::check(b).map_err(|e| format!("{} block {i}: {e}", <T as Block>::NAME))?;
        }
        Ok(())
    }

    fn decode(blocks: &[u8], out: &mut [f32]) {
        for (b, o) in blocks.chunks_exact(T::DB).zip(out.chunks_exact_mut(T::DW)) {
            T::decode_block(b, o);
        }
    }

    fn encode(input: &[f32], out: &mut [u8]) -> Result<(), String> {
        for (i, (x, o)) in input
            .chunks_exact(T::DW)
            .zip(out.chunks_exact_mut(T::DB))
            .enumerate()
        {
            if let Some(j) = x.iter().position(|v| !v.is_finite()) {
                return Err(format!(
                    "{}: input value {} (block {i}) is {}: only finite values can be quantised",
                    <T as Block>::NAME,
                    i * T::DW + j,
                    x[j]
                ));
            }
            T::encode_block(x, o).map_err(|e| format!("{} block {i}: {e}", <T as Block>::NAME))?;
        }
        Ok(())
    }

    fn dot(isa: Isa, rows: &[u8], s: Shape, act: &[BlockQ8_1], out: &mut [f32]) {
        dot::run::<T>(isa, rows, s, act, out)
    }
}

/// The value with the largest magnitude (the first one on ties), sign kept.
pub(crate) fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0f32;
    for &v in x {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

pub(crate) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}
