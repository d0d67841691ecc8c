//! Tensors of a safetensors checkpoint (one file or shards), read through mmap and
//! decoded to f32: F32 / F16 / BF16, FP8-e4m3 with e8m0 128x128 block scales, and
//! packed MXFP4 (e2m1 pairs + e8m0 per 32) repacked losslessly to ggml's MXFP4 blocks.

use std::{collections::BTreeMap, fs::File, path::Path};

use anyhow::{anyhow, bail, Context, Result};
use memmap2::Mmap;
use safetensors::{tensor::TensorInfo, Dtype, SafeTensors};

pub struct Source {
    shards: Vec<(String, Mmap, usize)>,
    /// name -> (shard, info)
    index: BTreeMap<String, (usize, TensorInfo)>,
}

pub struct Raw<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl Source {
    pub fn open(dir: &Path) -> Result<Source> {
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            bail!("{}: no .safetensors files", dir.display());
        }
        let mut shards = Vec::new();
        let mut index = BTreeMap::new();
        for (i, p) in files.iter().enumerate() {
            let f = File::open(p).with_context(|| format!("opening {}", p.display()))?;
            // SAFETY: the checkpoint is read-only input; we never write through the map.
            let m = unsafe { Mmap::map(&f) }.with_context(|| format!("mapping {}", p.display()))?;
            let (header, meta) = SafeTensors::read_metadata(&m)
                .map_err(|e| anyhow!("{}: not a valid safetensors file: {e}", p.display()))?;
            for (name, info) in meta.tensors() {
                if index.insert(name.clone(), (i, info.clone())).is_some() {
                    bail!(
                        "tensor '{name}' appears in two shards (second: {})",
                        p.display()
                    );
                }
            }
            shards.push((p.display().to_string(), m, 8 + header));
        }
        Ok(Source { shards, index })
    }

    /// Renames every tensor by `f`, dropping those it maps to None (`convert --mtp`
    /// reads the MTP block under a layer's names). Fails if two names meet.
    pub fn rename(&mut self, f: impl Fn(&str) -> Result<Option<String>>) -> Result<()> {
        let mut index = BTreeMap::new();
        for (name, v) in std::mem::take(&mut self.index) {
            if let Some(to) = f(&name)? {
                if index.insert(to.clone(), v).is_some() {
                    bail!("two checkpoint tensors map to '{to}' (the second: '{name}')");
                }
            }
        }
        self.index = index;
        Ok(())
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    pub fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn raw(&self, name: &str) -> Result<Raw<'_>> {
        let (s, info) = self
            .index
            .get(name)
            .ok_or_else(|| anyhow!("the checkpoint has no tensor '{name}'"))?;
        let (file, m, base) = &self.shards[*s];
        let (a, b) = info.data_offsets;
        let data = m
            .get(base + a..base + b)
            .ok_or_else(|| anyhow!("{file}: tensor '{name}' runs past the end of the file"))?;
        Ok(Raw {
            dtype: info.dtype,
            shape: info.shape.clone(),
            data,
        })
    }

    /// A float tensor as f32; FP8 weights are scaled by their `.scale` companion.
    pub fn f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>)> {
        let r = self.raw(name)?;
        let v = match r.dtype {
            Dtype::F32 => r
                .data
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::F16 => r
                .data
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => r
                .data
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F8_E4M3 => return self.fp8_scaled(name, &r),
            other => {
                bail!("tensor '{name}': dtype {other:?} is not a float type this converter decodes")
            }
        };
        Ok((r.shape, v))
    }

    fn fp8_scaled(&self, name: &str, r: &Raw<'_>) -> Result<(Vec<usize>, Vec<f32>)> {
        let sname = format!("{}.scale", name.strip_suffix(".weight").unwrap_or(name));
        if r.shape.len() != 2 {
            bail!(
                "tensor '{name}': FP8 weights must be 2-D, found {:?}",
                r.shape
            );
        }
        let s = self
            .raw(&sname)
            .with_context(|| format!("FP8 tensor '{name}' needs its block scales"))?;
        let (rows, cols) = (r.shape[0], r.shape[1]);
        let (br, bc) = (rows.div_ceil(128), cols.div_ceil(128));
        let scales = e8m0_values(&s, &sname)?;
        if s.shape != [br, bc] {
            bail!(
                "'{sname}': scale shape {:?}, expected [{br}, {bc}] for a {rows}x{cols} weight",
                s.shape
            );
        }
        if scales.len() != br * bc {
            bail!("'{sname}': {} scales for a {rows}x{cols} weight (expected {br}x{bc} blocks of 128x128)", scales.len());
        }
        let mut v = Vec::with_capacity(rows * cols);
        for i in 0..rows {
            for j in 0..cols {
                v.push(fp8_e4m3(r.data[i * cols + j]) * scales[(i / 128) * bc + j / 128]);
            }
        }
        Ok((r.shape.clone(), v))
    }

    /// An integer table (tid2eid) as i32.
    pub fn i32(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>)> {
        let r = self.raw(name)?;
        let v: Vec<i32> = match r.dtype {
            Dtype::I64 => r
                .data
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap()))
                .map(|x| {
                    i32::try_from(x)
                        .map_err(|_| anyhow!("tensor '{name}': value {x} does not fit i32"))
                })
                .collect::<Result<_>>()?,
            Dtype::I32 => r
                .data
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            other => bail!("tensor '{name}': expected an integer table, found {other:?}"),
        };
        Ok((r.shape, v))
    }

    /// A packed-MXFP4 weight (`[rows, cols/2]` bytes + `[rows, cols/32]` e8m0 scales)
    /// as ggml MXFP4 blocks (scale byte, then 16 bytes: element j low nibble, j+16 high).
    /// Returns None when `name` is not stored that way.
    pub fn mxfp4_blocks(&self, name: &str) -> Result<Option<(usize, usize, Vec<u8>)>> {
        let r = self.raw(name)?;
        if !matches!(r.dtype, Dtype::I8 | Dtype::U8) {
            return Ok(None);
        }
        let sname = format!("{}.scale", name.strip_suffix(".weight").unwrap_or(name));
        let s = self
            .raw(&sname)
            .with_context(|| format!("packed 4-bit tensor '{name}' needs its scales"))?;
        if r.shape.len() != 2 {
            bail!("'{name}': packed MXFP4 must be 2-D, found {:?}", r.shape);
        }
        let (rows, cols) = (r.shape[0], r.shape[1] * 2);
        if cols % 32 != 0 || s.data.len() != rows * cols / 32 || s.shape != [rows, cols / 32] {
            bail!(
                "'{name}': {rows}x{cols} MXFP4 weight with {} scale bytes (expected {})",
                s.data.len(),
                rows * cols / 32
            );
        }
        if !matches!(s.dtype, Dtype::U8 | Dtype::I8 | Dtype::F8_E8M0) {
            bail!(
                "'{sname}': MXFP4 scales must be e8m0 bytes, found {:?}",
                s.dtype
            );
        }
        let mut out = Vec::with_capacity(rows * cols / 32 * 17);
        for (b, scale) in s.data.iter().enumerate() {
            let src = &r.data[b * 16..b * 16 + 16];
            let code = |e: usize| (src[e / 2] >> (4 * (e % 2))) & 0x0f;
            out.push(*scale);
            for j in 0..16 {
                out.push(code(j) | (code(j + 16) << 4));
            }
        }
        Ok(Some((rows, cols, out)))
    }
}

fn e8m0_values(s: &Raw<'_>, name: &str) -> Result<Vec<f32>> {
    match s.dtype {
        Dtype::U8 | Dtype::I8 | Dtype::F8_E8M0 => Ok(s.data.iter().map(|&b| e8m0(b)).collect()),
        Dtype::F32 => Ok(s
            .data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()),
        other => bail!("'{name}': scales of dtype {other:?} are not supported (e8m0 or f32)"),
    }
}

/// e8m0: a biased power of two; 0xff is NaN.
pub fn e8m0(b: u8) -> f32 {
    if b == 0xff {
        f32::NAN
    } else {
        (b as f32 - 127.0).exp2()
    }
}

/// FP8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN), exponent bias 7.
pub fn fp8_e4m3(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0x0f) as i32;
    let m = (b & 0x07) as f32;
    if e == 0x0f && m == 7.0 {
        return f32::NAN;
    }
    let mag = if e == 0 {
        m / 8.0 * (-6f32).exp2()
    } else {
        (1.0 + m / 8.0) * ((e - 7) as f32).exp2()
    };
    sign * mag
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_e4m3_known_values() {
        assert_eq!(fp8_e4m3(0x38), 1.0);
        assert_eq!(fp8_e4m3(0xb8), -1.0);
        assert_eq!(fp8_e4m3(0x7e), 448.0);
        assert_eq!(fp8_e4m3(0x01), (-9f32).exp2());
        assert!(fp8_e4m3(0x7f).is_nan());
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(130), 8.0);
    }
}
