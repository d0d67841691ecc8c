//! Prompt marks: a copy of a slot's rings taken at the end of its latest prefill chunk,
//! so a later prompt that shares those positions, but not all the slot went on to hold,
//! goes back there instead of starting over (the prefix cache's other case: the same
//! prompt again, a chat whose template rewrote the last answer, a shorter stop).
//!
//! The rings are the only state a later position overwrites; every other cache is
//! positional (the compressed rows, the indexer's keys: row q / ratio), and the rows past
//! the mark are written again by the new prompt's passes before any position can see
//! them, as after a rewind into a drafted pass.

use anyhow::{anyhow, Context, Result};
use moe_plugin_api::{ops, OpParams};

use super::{at, rings, v, GpuPath};
use crate::deepseek4::Deepseek4;
use crate::device::{Device, Tensor};

/// A slot's mark: its buffers are kept from one mark to the next.
pub(super) struct Mark {
    /// The position the copies hold the state at (None: no mark).
    pos: Option<usize>,
    /// Per layer (the MTP block's last, where one is loaded): a copy of each ring of
    /// [`rings`].
    rings: Vec<Vec<Tensor>>,
    /// A copy of the MTP block's tail of target states and where it starts.
    tail: Option<(Tensor, (usize, usize))>,
    /// The logits of the token before the mark, where its pass wanted them.
    logits: Option<Vec<f32>>,
}

impl GpuPath {
    /// The position `slot` can go back to with [`GpuPath::back_to_mark`], if any.
    pub(in crate::deepseek4) fn mark_pos(&self, slot: usize) -> Option<usize> {
        self.marks.get(slot)?.as_ref()?.pos
    }

    /// The logits of the token before `slot`'s mark, where the mark is at `len`.
    pub(in crate::deepseek4) fn mark_logits(&self, slot: usize, len: usize) -> Option<&[f32]> {
        let mk = self.marks.get(slot)?.as_ref()?;
        (mk.pos == Some(len))
            .then_some(mk.logits.as_deref())
            .flatten()
    }

    /// Drops `slot`'s mark (a new sequence from position 0, a seek, a failed pass).
    pub(in crate::deepseek4) fn forget_mark(&mut self, slot: usize) {
        if let Some(Some(mk)) = self.marks.get_mut(slot) {
            mk.pos = None;
        }
    }

    /// Marks `slot` at `pos`, the position its last pass ended at: copies every ring
    /// (queued after that pass on the device's stream); `logits`, the last token's.
    pub(in crate::deepseek4) fn mark(
        m: &mut Deepseek4,
        slot: usize,
        pos: usize,
        logits: Option<Vec<f32>>,
    ) -> Result<()> {
        Self::with_path(m, |g, m| {
            g.state(m, slot)?;
            let tail = g.mtp_tail(slot).is_some();
            if g.marks[slot]
                .as_ref()
                .is_none_or(|mk| mk.tail.is_some() != tail)
            {
                g.marks[slot] = Some(g.alloc_mark(m, slot)?);
            }
            let mut mk = g.marks[slot].take().expect("allocated above");
            let done = g.copy_mark(m, slot, &mk, true);
            if let (Ok(Some(now)), Some((_, at_))) = (&done, mk.tail.as_mut()) {
                *at_ = *now;
            }
            mk.pos = done.is_ok().then_some(pos);
            mk.logits = logits;
            g.marks[slot] = Some(mk);
            done.map(|_| ()).context("marking the end of a prompt")
        })
    }

    /// Puts `slot` back at its mark: the rings (and the MTP block's tail) as they were
    /// there, the last drafted pass forgotten. Returns the mark's position.
    pub(in crate::deepseek4) fn back_to_mark(m: &mut Deepseek4, slot: usize) -> Result<usize> {
        Self::with_path(m, |g, m| {
            let mk = g.marks[slot]
                .take()
                .ok_or_else(|| anyhow!("slot {slot} has no mark"))?;
            let done = mk
                .pos
                .ok_or_else(|| anyhow!("slot {slot} has no mark"))
                .and_then(|pos| g.copy_mark(m, slot, &mk, false).map(|_| pos));
            g.marks[slot] = Some(mk);
            g.forget(slot);
            done.context("going back to the end of an earlier prompt")
        })
    }

    fn alloc_mark(&self, m: &Deepseek4, slot: usize) -> Result<Mark> {
        let st = self.slots[slot]
            .as_deref()
            .ok_or_else(|| anyhow!("slot state"))?;
        let dev = &m.dev;
        let rings = st
            .iter()
            .map(|ls| {
                rings(ls)
                    .iter()
                    .map(|t| dev.f32(t.r.dims))
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()
            .context("allocating a prompt mark")?;
        let tail = match self.mtp_tail(slot) {
            Some((t, at)) => Some((dev.f32(t.r.dims)?, at)),
            None => None,
        };
        Ok(Mark {
            pos: None,
            rings,
            tail,
            logits: None,
        })
    }

    /// Copies the slot's rings (and the MTP block's tail) into the mark (`save`; returns
    /// where the tail starts) or back out of it.
    fn copy_mark(
        &mut self,
        m: &Deepseek4,
        slot: usize,
        mk: &Mark,
        save: bool,
    ) -> Result<Option<(usize, usize)>> {
        let (dev, ids) = (&m.dev, &self.iota);
        let st = self.slots[slot]
            .as_deref()
            .ok_or_else(|| anyhow!("slot state"))?;
        for (ls, copies) in st.iter().zip(&mk.rings) {
            for (ring, copy) in rings(ls).into_iter().zip(copies) {
                let (from, to) = if save { (ring, copy) } else { (copy, ring) };
                copy_whole(dev, from, to, ids)?;
            }
        }
        let Some(((copy, saved_at), (tail, now))) = mk.tail.as_ref().zip(self.mtp_tail(slot))
        else {
            return Ok(None);
        };
        let (from, to) = if save { (tail, copy) } else { (copy, tail) };
        copy_whole(dev, from, to, ids)?;
        if save {
            return Ok(Some(now));
        }
        self.set_mtp_tail_at(slot, *saved_at);
        Ok(None)
    }
}

/// Every row of `from` into `to` (the same shape): one GET_ROWS over rows 0..n.
fn copy_whole(dev: &Device, from: &Tensor, to: &Tensor, ids: &Tensor) -> Result<()> {
    let (w, n) = (from.r.dims[0] as usize, from.r.dims[1] as usize);
    dev.op(
        ops::GET_ROWS,
        OpParams::default(),
        &[
            v(from, [w, n, 1, 1]),
            at(ids, 0, [n, 1, 1, 1]),
            v(to, [w, n, 1, 1]),
        ],
    )
    .context("copying a ring")
}
