//! The next-token-prediction (MTP) block on the device path: the drafter of speculative
//! decoding. Every target pass also feeds the block the pass's tokens ("catch-up": token p
//! with the target's mHC streams at p - 1) as far as its window needs them, so the window
//! holds a row for every position, as llama.cpp's `draft-mtp` driver keeps it; drafting
//! then chains single-token steps from the last position, each feeding the block's own
//! output streams and greedy token to the next.

use anyhow::{anyhow, Context, Result};
use moe_plugin_api::{ops, OpParams, TensorRef};

use std::cell::Cell;

use super::{at, dev_layer, upload, v, wv, GpuPath, GraphState, LayerState, StepKind, Work};
use crate::deepseek4::Deepseek4;
use crate::device::Tensor;
use crate::sampling::argmax;

/// The block's device tensors and per-slot state.
pub(super) struct DevMtp {
    layer: super::DevLayer,
    enorm: Tensor,
    hnorm: Tensor,
    head: (Tensor, Tensor),
    head_norm: Tensor,
    /// Per slot: the target's streams ([d hc] a row) at the last `cap` positions of its
    /// last pass, then one row of zeros (the state before a sequence's first token).
    tails: Vec<Tensor>,
    /// Per slot: the position of the tail's first row and how many rows it holds.
    tail_at: Vec<(usize, usize)>,
    /// A draft step's activations (one token).
    work: Option<Work>,
    /// The window rows a draft chain overwrites, put back after it ([head_dim, cap]),
    /// and the ids of those rows.
    saved: Tensor,
    save_ids: Tensor,
    /// Per slot: its chain step's graph state and the kind it was recorded for.
    graphs: Vec<Cell<(GraphState, StepKind)>>,
}

/// A pass's inputs of the block (allocated with its [`Work`] when a drafter is loaded).
pub(super) struct MtpWork {
    /// Row ids: [0] the tail row of the state before the pass (or the zero row),
    /// [1..n) the pass's own rows 0..n-2, [n..n + 2 hc n) the join's, then the pass's
    /// rows that become the tail.
    ids: Tensor,
    /// The embedding rows, then the streams each token pairs with ([d hc] a token, see
    /// [`MtpWork::states`]): [d, n + hc n], each row normed in place.
    src: Tensor,
    /// [2d, hc n]: per stream, its token's normed embedding and its normed state.
    cat: Tensor,
}

impl MtpWork {
    pub(super) fn alloc(m: &Deepseek4, cap: usize, tail: usize) -> Result<MtpWork> {
        let (d, hc, n, dev) = (m.p.d, m.p.hc, cap, &m.dev);
        let f = |len: usize| dev.f32([len as u64, 1, 1, 1]);
        Ok(MtpWork {
            ids: dev.i32(n + 2 * hc * n + tail)?,
            src: f(d * (n + hc * n))?,
            cat: f(2 * d * hc * n)?,
        })
    }
}

impl MtpWork {
    /// Rows `first..first + rows` of the streams a pass of `n` tokens pairs with (rows
    /// of d hc values, after the pass's n embedding rows of d).
    fn states(&self, (d, hc): (usize, usize), n: usize, first: usize, rows: usize) -> TensorRef {
        at(&self.src, d * (n + first * hc), [d * hc, rows, 1, 1])
    }
}

impl DevMtp {
    /// The tail row holding position `q`'s state for `slot`, or the zero row.
    fn row_of(&self, slot: usize, q: Option<usize>, cap: usize) -> usize {
        let (first, rows) = self.tail_at[slot];
        match q {
            Some(q) if (first..first + rows).contains(&q) => q - first,
            _ => cap,
        }
    }
}

/// The join's row ids for `n` tokens: stream s of token t gets rows (t, n + t hc + s)
/// of the source (its normed embedding, its normed state).
fn join_ids(n: usize, hc: usize) -> impl Iterator<Item = i32> {
    (0..n).flat_map(move |t| (0..hc).flat_map(move |s| [t as i32, (n + t * hc + s) as i32]))
}

impl GpuPath {
    /// Puts the model's MTP block (see `Deepseek4::attach_mtp`) on the device.
    pub(in crate::deepseek4) fn attach_mtp(m: &mut Deepseek4) -> Result<()> {
        Self::with_path(m, |g, m| {
            let mt = m.mtp.as_ref().ok_or_else(|| anyhow!("no MTP block"))?;
            let dev = &m.dev;
            let (p, cap) = (&m.p, g.pass_cap);
            let row = p.d * p.hc;
            let tails = (0..g.slots.len())
                .map(|_| {
                    let t = dev.f32([row as u64, cap as u64 + 1, 1, 1])?;
                    t.upload_f32(&vec![0.0; row * (cap + 1)])?;
                    Ok(t)
                })
                .collect::<Result<Vec<_>>>()?;
            g.mtp = Some(DevMtp {
                layer: dev_layer(dev, &mt.layer)?,
                enorm: upload(dev, &mt.enorm)?,
                hnorm: upload(dev, &mt.hnorm)?,
                head: (upload(dev, &mt.hc_head.1)?, upload(dev, &mt.hc_head.2)?),
                head_norm: upload(dev, &mt.head_norm)?,
                tails,
                tail_at: vec![(0, 0); g.slots.len()],
                work: None,
                saved: dev.f32([p.head_dim as u64, cap as u64, 1, 1])?,
                save_ids: dev.i32(cap)?,
                graphs: (0..g.slots.len())
                    .map(|_| {
                        let start = match g.draft_graphs {
                            true => g.graph_start,
                            false => GraphState::Off,
                        };
                        Cell::new((start, StepKind::default()))
                    })
                    .collect(),
            });
            // Work buffers allocated before have no room for the block's inputs, and the
            // slots' states get the block's window (allocated with them): both anew, with
            // whatever graphs and ring copies were made of the old ones.
            (g.work, g.work1, g.work_d) = (None, None, None);
            g.slots.iter_mut().for_each(|s| *s = None);
            g.rollback.iter_mut().for_each(|r| *r = None);
            g.graphs.clear();
            Ok(())
        })
    }

    /// Before a pass of `n` tokens of `slot` from `p0`: uploads the block's row ids
    /// (see [`MtpWork::ids`]).
    pub(super) fn mtp_ids(
        &self,
        m: &Deepseek4,
        w: &Work,
        slot: usize,
        p0: usize,
        n: usize,
    ) -> Result<()> {
        let cap = self.pass_cap;
        let Some(mt) = self.mtp.as_ref() else {
            return Ok(());
        };
        let t = n.min(cap);
        let mut ids = vec![mt.row_of(slot, p0.checked_sub(1), cap) as i32];
        ids.extend(0..n as i32 - 1);
        ids.extend(join_ids(n, m.p.hc));
        ids.extend((n - t..n).map(|r| r as i32));
        mtp_work(w)?.ids.upload_i32(&ids)
    }

    /// After that pass: the tail holds its last positions.
    pub(super) fn mtp_passed(&mut self, slot: usize, p0: usize, n: usize) {
        let t = n.min(self.pass_cap);
        if let Some(mt) = self.mtp.as_mut() {
            mt.tail_at[slot] = (p0 + n - t, t);
        }
    }

    /// `slot`'s tail of target states and (its first position, rows), where a drafter
    /// is loaded (a prompt mark copies it).
    pub(super) fn mtp_tail(&self, slot: usize) -> Option<(&Tensor, (usize, usize))> {
        let mt = self.mtp.as_ref()?;
        Some((mt.tails.get(slot)?, *mt.tail_at.get(slot)?))
    }

    pub(super) fn set_mtp_tail_at(&mut self, slot: usize, at_: (usize, usize)) {
        if let Some(a) = self.mtp.as_mut().and_then(|mt| mt.tail_at.get_mut(slot)) {
            *a = at_;
        }
    }

    /// Forgets `slot`'s tail (a seek: the positions it holds are not the new ones').
    pub(in crate::deepseek4) fn mtp_forget(&mut self, slot: usize) {
        if let Some(mt) = self.mtp.as_mut() {
            mt.tail_at[slot] = (0, 0);
        }
    }

    /// The block's input streams for the `n` tokens of `w`, each paired with its state
    /// ([`MtpWork::states`], copied in before): per stream, eh_proj over
    /// [enorm(embedding) | hnorm(state)].
    fn mtp_input(&self, m: &Deepseek4, w: &Work, n: usize) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, hc) = (p.d, p.hc);
        let (mt, mw) = (self.dev_mtp()?, mtp_work(w)?);
        let mtp = m.mtp.as_ref().ok_or_else(|| anyhow!("no MTP block"))?;
        let ids = |off: usize, len: usize| at(&mw.ids, off, [len, 1, 1, 1]);
        let get = |table: TensorRef, ids: TensorRef, out: TensorRef| {
            dev.op(ops::GET_ROWS, OpParams::default(), &[table, ids, out])
        };
        // A weighted RMS norm of each d-row: NORM_ROPE with no rotary pairs (the glue op
        // every device backend runs; RMS_NORM is the CPU's llama path's).
        let pos = v(&w.pos, [n, 1, 1, 1]);
        let norm = |x: TensorRef, wt: &Tensor, out: TensorRef| {
            let prm = super::pr(&[p.eps, 1.0], &[2, 0, 0]);
            dev.op(ops::NORM_ROPE, prm, &[x, wt.r, self.inv_main.0.r, pos, out])
        };
        get(
            m.embd.r,
            v(&w.tokens, [n, 1, 1, 1]),
            v(&mw.src, [d, n, 1, 1]),
        )?;
        let emb = v(&mw.src, [d, 1, n, 1]);
        norm(emb, &mt.enorm, emb)?;
        let states = at(&mw.src, d * n, [d, hc, n, 1]);
        norm(states, &mt.hnorm, states)?;
        get(
            v(&mw.src, [d, n + hc * n, 1, 1]),
            ids(n, 2 * hc * n),
            v(&mw.cat, [d, 2 * hc * n, 1, 1]),
        )?;
        dev.op(
            ops::MATMUL,
            OpParams::default(),
            &[
                wv(&mtp.eh_proj),
                v(&mw.cat, [2 * d, hc * n, 1, 1]),
                v(&w.streams, [d, hc * n, 1, 1]),
            ],
        )
        .context("the MTP block's input product")?;
        Ok(())
    }

    /// After a target pass's last block (its streams in `w`): the tail and the block's
    /// window get this pass's positions. `st`: the slot's state (the block's last).
    pub(super) fn mtp_catch_up(
        &self,
        m: &Deepseek4,
        st: &[LayerState],
        w: &Work,
        n: usize,
        kind: StepKind,
        slot: usize,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (row, cap) = (p.d * p.hc, self.pass_cap);
        let (mt, mw) = (self.dev_mtp()?, mtp_work(w)?);
        let tail = &mt.tails[slot];
        let ids = |off: usize, len: usize| at(&mw.ids, off, [len, 1, 1, 1]);
        let get = |table: TensorRef, ids: TensorRef, out: TensorRef| {
            dev.op(ops::GET_ROWS, OpParams::default(), &[table, ids, out])
        };
        let streams = v(&w.streams, [row, n, 1, 1]);
        let dh = (p.d, p.hc);
        get(
            v(tail, [row, cap + 1, 1, 1]),
            ids(0, 1),
            mw.states(dh, n, 0, 1),
        )?;
        if n > 1 {
            get(streams, ids(1, n - 1), mw.states(dh, n, 1, n - 1))?;
        }
        let t = n.min(cap);
        get(streams, ids(n + 2 * p.hc * n, t), v(tail, [row, t, 1, 1]))
            .context("the MTP block's states")?;
        self.mtp_input(m, w, n)?;
        let mtp = m.mtp.as_ref().ok_or_else(|| anyhow!("no MTP block"))?;
        let ls = st
            .get(m.layers.len())
            .ok_or_else(|| anyhow!("no MTP state"))?;
        self.mtp_window(m, (&mtp.layer, &mt.layer, ls), w, n, kind)
            .context("the MTP block's window")?;
        self.join_open(dev)
    }

    /// What of the block a catch-up needs: its window's rows for the pass's positions.
    /// A row is the attention's K=V vector (kv product of the normed mHC pre, its norm
    /// and rotary), which SPARSE_ATTENTION stores into the ring; the op's output, the
    /// query path and the MoE are not needed (the attention reads the last layer's
    /// queries and its output is dropped).
    fn mtp_window(
        &self,
        m: &Deepseek4,
        (lay, dl, ls): (&super::Layer, &super::DevLayer, &LayerState),
        w: &Work,
        n: usize,
        kind: StepKind,
    ) -> Result<()> {
        let (p, dev) = (&m.p, &m.dev);
        let (d, hd, nh) = (p.d, p.head_dim, p.n_head);
        let x = v(&w.x, [d, n, 1, 1]);
        self.site(
            m,
            w,
            n,
            (&[], &lay.hc_attn.0, &dl.hc_attn, &dl.attn_norm, false),
            x,
            None,
            None,
        )?;
        let kv = v(&w.kv, [hd, n, 1, 1]);
        dev.op(ops::MATMUL, OpParams::default(), &[wv(&lay.kv), x, kv])?;
        // (the block attends its window only: the main rotary, as attention() picks)
        let (inv, ms) = &self.inv_main;
        let (pos, pairs) = (v(&w.pos, [n, 1, 1, 1]), (p.rope_dim / 2) as i64);
        let kv3 = v(&w.kv, [hd, 1, n, 1]);
        dev.op(
            ops::NORM_ROPE,
            super::pr(&[p.eps, *ms], &[2, pairs, 0]),
            &[kv3, dl.kv_norm.r, inv.r, pos, kv3],
        )?;
        let (q, att) = (v(&w.q, [hd, nh, n, 1]), v(&w.att, [hd, nh, n, 1]));
        let a = [q, kv, ls.ring.r, kv, pos, dl.sinks.r, pos, att];
        let prm = super::pr(&[(hd as f32).powf(-0.5)], &[0, 0, 0, kind.long as i64]);
        dev.op(ops::SPARSE_ATTENTION, prm, &a)?;
        Ok(())
    }

    /// The graph id of `slot`'s chain steps (below every `graph_id`, which start past
    /// these: see `graph_key`).
    fn mtp_graph_id(&self, slot: usize) -> usize {
        (super::MAX_CHUNK + 1) * self.slots.len() + slot
    }

    fn dev_mtp(&self) -> Result<&DevMtp> {
        self.mtp
            .as_ref()
            .ok_or_else(|| anyhow!("no MTP block on the device"))
    }

    /// Drafts: from `token` at position `pos` of `slot` (whose last pass ran the target
    /// through pos - 1), up to `k` chained steps of the block; each step's logits, the next
    /// step's token being the greedy choice of the one before. The chain ends before a
    /// step whose greedy choice has a probability below `p_min`.
    pub(in crate::deepseek4) fn mtp_draft(
        m: &mut Deepseek4,
        slot: usize,
        token: u32,
        (pos, k, p_min): (usize, usize, f32),
    ) -> Result<Vec<Vec<f32>>> {
        Self::with_path(m, |g, m| g.mtp_draft_inner(m, slot, token, (pos, k, p_min)))
    }

    fn mtp_draft_inner(
        &mut self,
        m: &Deepseek4,
        slot: usize,
        token: u32,
        (pos, k, p_min): (usize, usize, f32),
    ) -> Result<Vec<Vec<f32>>> {
        let (p, dev) = (&m.p, &m.dev);
        let cap = self.pass_cap;
        if k == 0 || k > cap || pos + k > m.n_ctx {
            anyhow::bail!("a draft of {k} tokens from position {pos} (at most {cap}, inside the context of {})", m.n_ctx);
        }
        self.state(m, slot)?;
        if self.dev_mtp()?.work.is_none() {
            let w = Self::alloc_work(m, 1, 1, self.idx_cap)?;
            self.mtp.as_mut().expect("checked above").work = Some(w);
        }
        let st = self.slots[slot]
            .as_deref()
            .ok_or_else(|| anyhow!("slot state"))?;
        let mt = self.dev_mtp()?;
        let w = mt.work.as_ref().expect("allocated above");
        let mw = mtp_work(w)?;
        let mtp = m.mtp.as_ref().ok_or_else(|| anyhow!("no MTP block"))?;
        let l = m.layers.len();
        let ls = st.get(l).ok_or_else(|| anyhow!("no MTP state"))?;
        let (row, win, hd) = (p.d * p.hc, p.window, p.head_dim);
        // The window rows of positions pos + 1 .. pos + k - 1 hold positions the next
        // target pass still sees: kept, and put back after the chain.
        if k > 1 {
            let ids: Vec<i32> = (1..k).map(|i| ((pos + i) % win) as i32).collect();
            mt.save_ids.upload_i32(&ids)?;
            dev.op(
                ops::GET_ROWS,
                OpParams::default(),
                &[
                    v(&ls.ring, [hd, win, 1, 1]),
                    v(&mt.save_ids, [k - 1, 1, 1, 1]),
                    v(&mt.saved, [hd, k - 1, 1, 1]),
                ],
            )?;
        }
        let mut out = Vec::with_capacity(k);
        let mut tok = token;
        let run = |i: usize, tok: u32| -> Result<Vec<f32>> {
            w.tokens.upload_i32(&[tok as i32])?;
            w.pos.upload_i32(&[(pos + i) as i32])?;
            // The state this step pairs with: the target's at pos - 1, then the block's own.
            let (src, r) = if i == 0 {
                (
                    v(&mt.tails[slot], [row, cap + 1, 1, 1]),
                    mt.row_of(slot, pos.checked_sub(1), cap),
                )
            } else {
                (v(&w.streams, [row, 1, 1, 1]), 0)
            };
            let mut ids = vec![r as i32];
            ids.extend(join_ids(1, p.hc));
            mw.ids.upload_i32(&ids)?;
            dev.op(
                ops::GET_ROWS,
                OpParams::default(),
                &[
                    src,
                    at(&mw.ids, 0, [1, 1, 1, 1]),
                    mw.states((p.d, p.hc), 1, 0, 1),
                ],
            )?;
            // The rest reads only what was uploaded or copied above: one graph a slot
            // (unless `MOE_DS4_DRAFT_GRAPH=0`, as drafted passes), recorded on its second step.
            let kind = StepKind::of(self.idx_ratio, p.idx_topk, pos + i, 1);
            let (mut state, recorded) = mt.graphs[slot].get();
            if recorded != kind && matches!(state, GraphState::Recorded | GraphState::Warm) {
                state = GraphState::Cold;
            }
            let key = super::pr(&[], &[self.mtp_graph_id(slot) as i64]);
            let step = || {
                self.mtp_input(m, w, 1)?;
                let mut post = Vec::new();
                self.block(m, l, (&mtp.layer, &mt.layer, ls), w, 1, kind, &mut post)?;
                let hidden = v(&w.hidden, [p.d, 1, 1, 1]);
                let head = (&post[..], &*mtp.hc_head.0, &mt.head, &mt.head_norm, true);
                self.site(m, w, 1, head, hidden, None, None)?;
                dev.op(
                    ops::MATMUL,
                    OpParams::default(),
                    &[wv(&m.output), hidden, v(&w.logits, [p.n_vocab, 1, 1, 1])],
                )?;
                self.join_open(dev)
            };
            let next = self.graph_run(dev, state, key, || {
                step().inspect_err(|_| {
                    let _ = self.join_open(dev);
                })
            });
            mt.graphs[slot].set((next.as_ref().copied().unwrap_or(GraphState::Off), kind));
            next?;
            dev.sync()?;
            w.logits.download_f32(p.n_vocab)
        };
        let mut failed = None;
        for i in 0..k {
            match run(i, tok).with_context(|| format!("MTP draft step {i}")) {
                Ok(logits) => {
                    tok = argmax(&logits);
                    if p_min > 0.0 && top_probability(&logits) < p_min {
                        break; // unsure: no draft from here on
                    }
                    out.push(logits);
                }
                Err(e) => {
                    // (branches a failed step left open join here, not in a later capture)
                    let _ = self.join_open(dev);
                    failed = Some(e);
                    break;
                }
            }
        }
        let restored = match k > 1 {
            true => self
                .restore_ring_rows(dev, &ls.ring, &mt.saved, pos + 1, pos + 1, k - 1)
                .context("putting back the MTP block's window"),
            false => Ok(()),
        };
        // (a step's error first: a restore failing after it says less)
        match failed {
            Some(e) => Err(e),
            None => restored.map(|()| out),
        }
    }
}

/// The softmax probability of the largest logit.
fn top_probability(logits: &[f32]) -> f32 {
    let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    1.0 / logits.iter().map(|&l| (l - top).exp()).sum::<f32>()
}

fn mtp_work(w: &Work) -> Result<&MtpWork> {
    w.mtp
        .as_ref()
        .ok_or_else(|| anyhow!("no MTP inputs in the work buffers"))
}
