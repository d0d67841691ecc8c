//! "Q8_S": an example third-party quant format, type id 200. A block is 32 weights:
//! an f32 scale followed by 32 int8 codes, value = scale * code.

use moe_plugin_api::{
    abi_stable::{
        export_root_module,
        prefix_type::PrefixTypeTrait,
        std_types::{RResult, RSlice, RSliceMut, RString, RVec},
    },
    defaults, dot_shape, guard, single_variant, AbiVersion, BlockQ8_1, Plugin, PluginInfo,
    PluginKind, PluginRef, QuantFormat,
};

pub const TYPE_ID: u32 = 200;
const BW: usize = 32;
const BB: usize = 36;

#[export_root_module]
pub fn get_root_module() -> PluginRef {
    Plugin {
        abi: AbiVersion::CURRENT,
        info,
        configure: defaults::accept_any_settings,
        quant_formats,
        backend: defaults::no_backend,
        policies: defaults::no_policies,
    }
    .leak_into_prefix()
}

extern "C" fn info() -> PluginInfo {
    PluginInfo {
        name: "q8s-example".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        kind: PluginKind::QuantFormat,
        description: "example third-party format: f32 scale + 32 x int8".into(),
    }
}

extern "C" fn quant_formats() -> RVec<QuantFormat> {
    RVec::from(vec![QuantFormat {
        type_id: TYPE_ID,
        name: "Q8_S".into(),
        block_weights: BW as u32,
        block_bytes: BB as u32,
        resolve_variant: single_variant,
        validate,
        decode,
        encode,
        dot_q8,
    }])
}

fn scale(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn whole(len: usize) -> Result<usize, String> {
    if !len.is_multiple_of(BB) {
        return Err(format!("Q8_S: {len} bytes are not whole {BB}-byte blocks"));
    }
    Ok(len / BB)
}

extern "C" fn validate(_v: u64, blocks: RSlice<'_, u8>) -> RResult<(), RString> {
    guard("Q8_S validate", || {
        whole(blocks.len())?;
        match blocks.chunks_exact(BB).position(|b| !scale(b).is_finite()) {
            Some(i) => Err(format!("Q8_S block {i}: scale is not finite")),
            None => Ok(()),
        }
    })
}

extern "C" fn decode(
    _v: u64,
    blocks: RSlice<'_, u8>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard("Q8_S decode", || {
        if whole(blocks.len())? * BW != out.len() {
            return Err("Q8_S decode: output length mismatch".into());
        }
        for (b, o) in blocks.chunks_exact(BB).zip(out.chunks_exact_mut(BW)) {
            let d = scale(b);
            for (o, q) in o.iter_mut().zip(&b[4..]) {
                *o = d * (*q as i8) as f32;
            }
        }
        Ok(())
    })
}

extern "C" fn encode(
    _v: u64,
    input: RSlice<'_, f32>,
    mut out: RSliceMut<'_, u8>,
) -> RResult<(), RString> {
    guard("Q8_S encode", || {
        if !input.len().is_multiple_of(BW) || input.len() / BW * BB != out.len() {
            return Err("Q8_S encode: length mismatch".into());
        }
        for (x, b) in input.chunks_exact(BW).zip(out.chunks_exact_mut(BB)) {
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            b[..4].copy_from_slice(&d.to_le_bytes());
            for (q, v) in b[4..].iter_mut().zip(x) {
                *q = if d > 0.0 {
                    (v / d).round() as i8 as u8
                } else {
                    0
                };
            }
        }
        Ok(())
    })
}

extern "C" fn dot_q8(
    _v: u64,
    rows: RSlice<'_, u8>,
    k: u64,
    act: RSlice<'_, BlockQ8_1>,
    mut out: RSliceMut<'_, f32>,
) -> RResult<(), RString> {
    guard("Q8_S dot_q8", || {
        let (row_bytes, n_rows, _) =
            dot_shape(BW as u32, BB as u32, rows.len(), k, act.len(), out.len())?;
        let per_col = k as usize / 32;
        for (i, o) in out.iter_mut().enumerate() {
            let (c, r) = (i / n_rows, i % n_rows);
            let row = &rows[r * row_bytes..(r + 1) * row_bytes];
            let col = &act[c * per_col..(c + 1) * per_col];
            *o = row
                .chunks_exact(BB)
                .zip(col)
                .map(|(b, a)| {
                    let s: i32 = b[4..]
                        .iter()
                        .zip(&a.qs)
                        .map(|(w, x)| (*w as i8) as i32 * *x as i32)
                        .sum();
                    scale(b) * a.d * s as f32
                })
                .sum();
        }
        Ok(())
    })
}
