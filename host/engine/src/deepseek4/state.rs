//! What one sequence carries between steps: the sliding window of K=V rows, each
//! compressor's partial window, the previous window's overlap half, and the rows
//! emitted so far.

/// A learned pooling compressor (attention's or the indexer's).
pub struct Compressor {
    ratio: usize,
    dim: usize,
    overlap: bool,
    /// Projected kv / gate of tokens whose window is not complete yet (width per token:
    /// 2*dim with overlap, else dim).
    buf_kv: Vec<f32>,
    buf_gate: Vec<f32>,
    /// The last closed window's first halves (kv, biased gate), ratio x dim each.
    prev: Option<(Vec<f32>, Vec<f32>)>,
    /// Emitted rows (dim each), after norm and rotary.
    pub rows: Vec<f32>,
}

impl Compressor {
    pub fn new(ratio: usize, dim: usize, overlap: bool) -> Compressor {
        Compressor {
            ratio,
            dim,
            overlap,
            buf_kv: Vec::new(),
            buf_gate: Vec::new(),
            prev: None,
            rows: Vec::new(),
        }
    }

    fn width(&self) -> usize {
        if self.overlap {
            2 * self.dim
        } else {
            self.dim
        }
    }

    /// Appends tokens; closes every full window into a row, finished by `finish(row,
    /// position of the window's first token)`.
    pub fn feed(
        &mut self,
        kv: &[f32],
        gate: &[f32],
        ape: &[f32],
        finish: impl Fn(&mut [f32], u32),
    ) {
        let (r, d, w) = (self.ratio, self.dim, self.width());
        self.buf_kv.extend_from_slice(kv);
        self.buf_gate.extend_from_slice(gate);
        while self.buf_kv.len() >= r * w {
            let wkv: Vec<f32> = self.buf_kv.drain(..r * w).collect();
            let mut wg: Vec<f32> = self.buf_gate.drain(..r * w).collect();
            wg.iter_mut().zip(ape).for_each(|(g, b)| *g += b);
            let mut row = vec![0.0; d];
            if self.overlap {
                // Slots: the previous window's first halves, then this window's second halves.
                let mut skv = vec![0.0; 2 * r * d];
                let mut sg = vec![f32::NEG_INFINITY; 2 * r * d];
                if let Some((pk, pg)) = &self.prev {
                    skv[..r * d].copy_from_slice(pk);
                    sg[..r * d].copy_from_slice(pg);
                }
                let (mut ca_k, mut ca_g) = (Vec::with_capacity(r * d), Vec::with_capacity(r * d));
                for j in 0..r {
                    skv[(r + j) * d..(r + j + 1) * d].copy_from_slice(&wkv[j * w + d..(j + 1) * w]);
                    sg[(r + j) * d..(r + j + 1) * d].copy_from_slice(&wg[j * w + d..(j + 1) * w]);
                    ca_k.extend_from_slice(&wkv[j * w..j * w + d]);
                    ca_g.extend_from_slice(&wg[j * w..j * w + d]);
                }
                super::math::pool(&skv, &sg, d, &mut row);
                self.prev = Some((ca_k, ca_g));
            } else {
                super::math::pool(&wkv, &wg, d, &mut row);
            }
            let pos = (self.rows.len() / d * r) as u32;
            finish(&mut row, pos);
            self.rows.extend_from_slice(&row);
        }
    }
}

pub struct LayerState {
    /// The last (window - 1) K=V rows.
    pub window: Vec<f32>,
    pub comp: Option<Compressor>,
    pub idx: Option<Compressor>,
}

pub struct SlotState {
    pub n_past: usize,
    pub layers: Vec<LayerState>,
}

/// (ratio, row width, overlapping windows) of a layer's compressor, if it has one.
pub type Shape = Option<(usize, usize, bool)>;

impl SlotState {
    pub fn new(shapes: &[(Shape, Shape)]) -> SlotState {
        SlotState {
            n_past: 0,
            layers: shapes
                .iter()
                .map(|(c, i)| LayerState {
                    window: Vec::new(),
                    comp: c.map(|(r, d, o)| Compressor::new(r, d, o)),
                    idx: i.map(|(r, d, o)| Compressor::new(r, d, o)),
                })
                .collect(),
        }
    }

    pub fn reset(&mut self) {
        self.n_past = 0;
        for l in &mut self.layers {
            l.window.clear();
            for c in [&mut l.comp, &mut l.idx].into_iter().flatten() {
                *c = Compressor::new(c.ratio, c.dim, c.overlap);
            }
        }
    }
}
