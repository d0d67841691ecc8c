//! Continuous batching: one thread owns the model; every step it packs the next token
//! of each decoding sequence and chunks of waiting prompts into ONE forward pass.

use std::{
    collections::VecDeque,
    sync::{
        atomic::{AtomicU64, AtomicUsize, Ordering},
        mpsc, Arc,
    },
    time::Instant,
};

use anyhow::Result;
use moe_tokenizer::{StreamDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::{
    model::{BatchEntry, CausalLm, LoadedModel},
    sampling::{argmax, Sampled, Sampler, SamplingParams},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Per-request timings (the fields the API reports).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Timings {
    pub prefill_ms: f64,
    pub decode_ms: f64,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose cache rows an earlier sequence in the slot left (not
    /// prefilled again).
    pub cached_prefix_tokens: usize,
    /// Speculative decoding ran for this sequence (it was eligible and on).
    pub spec_decode_ran: bool,
    /// Drafted tokens checked, and how many of them the model's own choice matched.
    pub draft_offered: usize,
    pub draft_accepted: usize,
}

#[derive(Debug, Clone)]
pub enum Event {
    /// Text released by one step (empty while a multi-byte character or a possible
    /// stop string is held back), and the tokens whose text it completes: a token's
    /// logprobs go out with its text, so none is reported for text a stop string cut.
    Token {
        text: String,
        tokens: Vec<Emitted>,
    },
    Done {
        reason: FinishReason,
        timings: Timings,
    },
    Error(String),
}

/// A sampled token as the client sees it.
#[derive(Debug, Clone)]
pub struct Emitted {
    pub sampled: Sampled,
    /// Byte offset in the completion text where the token's text begins.
    pub offset: usize,
}

/// A sampled token whose text is not yet released: its text spans bytes
/// `start..end` of the sequence's text (`end` as far as the text was decoded).
#[derive(Debug)]
struct Pending {
    start: usize,
    end: usize,
    sampled: Sampled,
}

pub struct GenRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Already clamped by the caller; also capped here by the context.
    pub max_tokens: usize,
    pub stop: Vec<String>,
    /// May the prompt reuse cache rows an earlier sequence left in a slot (when the
    /// scheduler's `prefix_cache` is on too).
    pub cache_prompt: bool,
    pub events: UnboundedSender<Event>,
}

#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Most tokens in one forward pass (prefill chunks fill what decoding leaves); 0:
    /// by device, 256 on the CPU (a long prompt's pass holds up the sequences decoding
    /// beside it for less) and 2048 on a GPU, as the upstream profile (the routed
    /// experts' tiles get more of a chunk's tokens each).
    pub max_batch_tokens: usize,
    /// Bounded prefill: past this position a prompt's chunks are at most
    /// `prefill_long_chunk` tokens (deep chunks need the most attention scratch); a
    /// chunk that would cross it stops there, and the cap stays for the request. 0: no
    /// bound.
    pub prefill_long_from: usize,
    pub prefill_long_chunk: usize,
    /// A prompt's last piece shorter than this (and than a quarter of the batch) runs
    /// with the chunk before it where the pass has room for both (past
    /// `prefill_long_from`, where chunks are shorter than the batch).
    pub prefill_min_tail: usize,
    /// A slot keeps the tokens its last sequence fed, and a new prompt that starts
    /// with them skips prefilling what the model can keep ([`CausalLm::keep_prefix`]).
    pub prefix_cache: bool,
    /// Speculative decoding: up to this many drafted tokens checked a step (0 = off).
    /// Drafts come from the model's own drafter ([`CausalLm::draft_logits`]) or the
    /// sequence's own text ([`lookup_draft`]) and are checked in the step's forward
    /// pass, on models that can rewind ([`CausalLm::max_draft`]); greedy and sampled
    /// sequences alike, with the same output as without drafts.
    pub draft_max: usize,
    /// A model drafting with a block of its own stops its chain before a guess less
    /// likely than this (0: never), as llama.cpp's `--draft-p-min`.
    pub draft_p_min: f32,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        SchedulerOptions {
            max_batch_tokens: 256,
            prefill_long_from: 32768,
            prefill_long_chunk: 1024,
            prefill_min_tail: 512,
            prefix_cache: true,
            draft_max: 0,
            draft_p_min: 0.0,
        }
    }
}

/// The free slots and what each one's cache holds.
struct Slots {
    free: Vec<u32>,
    /// Per slot: the tokens its cache holds, in position order (kept while free).
    held: Vec<Vec<u32>>,
    /// Per slot: when it was last given back (a tick), so misses take the stalest.
    freed_at: Vec<u64>,
    tick: u64,
}

impl Slots {
    fn new(n: usize) -> Self {
        Slots {
            free: (0..n as u32).rev().collect(),
            held: vec![Vec::new(); n],
            freed_at: vec![0; n],
            tick: 0,
        }
    }

    /// Gives a slot back; its cache holds `tokens` (empty: unknown, keep nothing).
    fn give_back(&mut self, slot: u32, tokens: Vec<u32>) {
        self.tick += 1;
        self.held[slot as usize] = tokens;
        self.freed_at[slot as usize] = self.tick;
        self.free.push(slot);
    }

    /// Takes the free slot that keeps the most of `prompt` (`keep(slot, cached,
    /// matching)`, at most all but the prompt's last token, whose logits must be
    /// computed; all of it where the slot holds the whole prompt and `replay(slot)` says
    /// the model kept that last token's logits), the stalest on a tie; returns it, the
    /// tokens kept and whether they are the whole prompt.
    fn take(
        &mut self,
        prompt: &[u32],
        keep: impl Fn(u32, usize, usize) -> usize,
        replay: impl Fn(u32) -> bool,
    ) -> Option<(u32, usize, bool)> {
        let head = &prompt[..prompt.len().saturating_sub(1)];
        let kept = |slot: u32| {
            let held = &self.held[slot as usize];
            if !prompt.is_empty() && held.starts_with(prompt) && replay(slot) {
                return prompt.len();
            }
            let matching = held.iter().zip(head).take_while(|(a, b)| a == b).count();
            keep(slot, held.len(), matching).min(matching)
        };
        let (best, n) = (0..self.free.len())
            .map(|i| (i, kept(self.free[i])))
            .max_by_key(|&(i, n)| (n, std::cmp::Reverse(self.freed_at[self.free[i] as usize])))?;
        let slot = self.free.swap_remove(best);
        self.held[slot as usize].clear();
        Some((slot, n, n > 0 && n == prompt.len()))
    }
}

/// Counters the server exports as metrics.
#[derive(Default, Debug)]
pub struct Stats {
    pub requests: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens a slot's cache already held (not prefilled).
    pub cached_prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub draft_offered: AtomicU64,
    pub draft_accepted: AtomicU64,
    pub forward_passes: AtomicU64,
    pub forward_us: AtomicU64,
    pub active: AtomicUsize,
    pub waiting: AtomicUsize,
}

/// Handle to the scheduler thread.
pub struct Scheduler {
    tx: mpsc::Sender<GenRequest>,
    pub stats: Arc<Stats>,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub n_ctx: usize,
    pub n_slots: usize,
}

impl Scheduler {
    /// Starts the scheduler thread; the model must carry a tokenizer.
    pub fn start(m: LoadedModel, mut opts: SchedulerOptions) -> anyhow::Result<Scheduler> {
        if opts.max_batch_tokens == 0 {
            let dev = m.model.device().name();
            opts.max_batch_tokens = if dev.starts_with("cpu") { 256 } else { 2048 };
            tracing::info!("batch of {} tokens a pass ({dev})", opts.max_batch_tokens);
        }
        let tokenizer = m.tokenizer.clone().ok_or_else(|| {
            anyhow::anyhow!(
                "model '{}' has no tokenizer in its GGUF metadata; it can be evaluated (logits) but not served",
                m.name
            )
        })?;
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let (n_ctx, n_slots) = (m.model.n_ctx(), m.model.n_slots());
        let st = stats.clone();
        let tok = tokenizer.clone();
        std::thread::Builder::new()
            .name("scheduler".into())
            .spawn(move || run(m.model, tok, rx, opts, st))
            .expect("spawning the scheduler thread");
        Ok(Scheduler {
            tx,
            stats,
            tokenizer,
            model_name: m.name,
            n_ctx,
            n_slots,
        })
    }

    pub fn submit(&self, r: GenRequest) -> Result<(), SubmitError> {
        if r.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if r.prompt.len() >= self.n_ctx {
            return Err(SubmitError::PromptTooLong {
                tokens: r.prompt.len(),
                n_ctx: self.n_ctx,
            });
        }
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        self.tx.send(r).map_err(|_| SubmitError::Stopped)
    }
}

/// Why [`Scheduler::submit`] refused a request: the first two are the request's fault,
/// the last the server's.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {tokens} tokens; the context holds {n_ctx}")]
    PromptTooLong { tokens: usize, n_ctx: usize },
    #[error("the scheduler has stopped")]
    Stopped,
}

struct Seq {
    req: GenRequest,
    slot: u32,
    sampler: Sampler,
    /// Tokens written into the cache so far.
    fed: usize,
    generated: Vec<u32>,
    decoder: StreamDecoder,
    text: String,
    emitted: usize,
    max_tokens: usize,
    started: Instant,
    first_token: Option<Instant>,
    /// A stop string ended the text (nothing held back is sent then).
    stop_string_hit: bool,
    /// Sampled tokens whose text has not all been released.
    pending: VecDeque<Pending>,
    /// Prompt tokens the slot's cache already held.
    cached: usize,
    /// Whether this sequence drafts (drafting on, a model that can rewind).
    speculative: bool,
    /// The tokens drafted for this step (checked after the sequence's last token).
    drafts: Vec<u32>,
    draft_offered: usize,
    draft_accepted: usize,
    /// Steps whose drafter failed (the step ran without drafts), and steps it ran on:
    /// a sequence whose every drafting step failed reports that drafting did not run.
    draft_failures: usize,
    draft_steps: usize,
    /// The whole prompt was in the slot's cache with its last token's logits: its first
    /// token comes from these, with no pass.
    replay: Option<Vec<f32>>,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.fed < self.req.prompt.len()
    }

    /// Takes one sampled token: text, stop strings, limits. Returns why the sequence
    /// ends, if it does.
    fn take_token(
        &mut self,
        sampled: Sampled,
        tok: &Tokenizer,
        n_ctx: usize,
    ) -> Option<FinishReason> {
        let id = sampled.id;
        self.sampler.accept(id);
        self.first_token.get_or_insert_with(Instant::now);
        if tok.is_end_of_generation(id) {
            return Some(FinishReason::Stop);
        }
        self.generated.push(id);
        let start = self.text.len();
        self.text.push_str(&self.decoder.push(tok, id));
        self.pending.push_back(Pending {
            start,
            end: self.text.len(),
            sampled,
        });
        let (release, stop_hit) = release_text(&self.text, self.emitted, &self.req.stop);
        if stop_hit {
            self.text.truncate(release);
        }
        let text = self.text[self.emitted..release].to_string();
        self.emitted = release;
        let tokens = self.take_released(release, stop_hit);
        if !text.is_empty() || !tokens.is_empty() {
            let _ = self.req.events.send(Event::Token { text, tokens });
        }
        if stop_hit {
            self.stop_string_hit = true;
            Some(FinishReason::Stop)
        } else if self.generated.len() >= self.max_tokens
            || self.req.prompt.len() + self.generated.len() >= n_ctx
        {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// The tokens the slot's cache now holds: every one fed to the model.
    fn fed_tokens(&self) -> Vec<u32> {
        let p = &self.req.prompt;
        let mut v = p[..self.fed.min(p.len())].to_vec();
        v.extend(&self.generated[..self.fed.saturating_sub(p.len())]);
        v
    }

    /// The pending tokens the text up to `release` completes; after a stop string
    /// (`cut`), the ones that put any text before it, and the rest are dropped.
    fn take_released(&mut self, release: usize, cut: bool) -> Vec<Emitted> {
        let emit = |p: Pending| Emitted {
            sampled: p.sampled,
            offset: p.start,
        };
        if cut {
            return self
                .pending
                .drain(..)
                .filter(|p| p.start < release)
                .map(emit)
                .collect();
        }
        let mut out = Vec::new();
        while self.pending.front().is_some_and(|p| p.end <= release) {
            out.extend(self.pending.pop_front().map(emit));
        }
        out
    }
}

fn run(
    mut model: Box<dyn CausalLm>,
    tok: Arc<Tokenizer>,
    rx: mpsc::Receiver<GenRequest>,
    opts: SchedulerOptions,
    stats: Arc<Stats>,
) {
    let n_ctx = model.n_ctx();
    let mut waiting: VecDeque<GenRequest> = VecDeque::new();
    let mut active: Vec<Seq> = Vec::new();
    let mut slots = Slots::new(model.n_slots());
    loop {
        if active.is_empty() && waiting.is_empty() {
            match rx.recv() {
                Ok(r) => waiting.push_back(r),
                Err(_) => return, // every handle dropped: shut down
            }
        }
        while let Ok(r) = rx.try_recv() {
            waiting.push_back(r);
        }
        // A client that went away stops its generation here, within one step.
        waiting.retain(|r| !r.events.is_closed());
        active.retain(|s| {
            let gone = s.req.events.is_closed();
            if gone {
                slots.give_back(s.slot, s.fed_tokens());
            }
            !gone
        });
        while !waiting.is_empty() && !slots.free.is_empty() {
            let req = waiting.pop_front().expect("non-empty");
            let reuse = opts.prefix_cache && req.cache_prompt;
            let n = req.prompt.len();
            let (slot, mut cached, whole) = slots
                .take(
                    &req.prompt,
                    |s, c, m| if reuse { model.keep_prefix(s, c, m) } else { 0 },
                    |s| reuse && model.replay_logits(s, n).is_some(),
                )
                .expect("a free slot");
            // The whole prompt held, its last token's logits kept: nothing to prefill.
            let replay = whole
                .then(|| model.replay_logits(slot, n).map(<[f32]>::to_vec))
                .flatten();
            if whole && replay.is_none() {
                cached = 0;
            }
            stats
                .prompt_tokens
                .fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
            stats
                .cached_prompt_tokens
                .fetch_add(cached as u64, Ordering::Relaxed);
            let max_tokens = req.max_tokens.min(n_ctx - req.prompt.len());
            // Sampled requests draft too: a drafted row is sampled only once every draft
            // before it matched, one draw a kept token (penalties counted as they are
            // taken), so the output is plain decoding's, seed for seed; a draft is kept
            // with the model's own probability of it, which is all a one-guess drafter
            // can get (speculative sampling's min(1, p / q) with q = 1).
            let speculative = opts.draft_max > 0 && model.max_draft() > 0;
            active.push(Seq {
                speculative,
                drafts: Vec::new(),
                draft_offered: 0,
                draft_accepted: 0,
                draft_failures: 0,
                draft_steps: 0,
                replay,
                sampler: Sampler::new(req.sampling.clone()),
                req,
                slot,
                fed: cached,
                cached,
                generated: Vec::new(),
                decoder: StreamDecoder::new(),
                text: String::new(),
                emitted: 0,
                max_tokens,
                started: Instant::now(),
                first_token: None,
                stop_string_hit: false,
                pending: VecDeque::new(),
            });
        }
        stats.active.store(active.len(), Ordering::Relaxed);
        stats.waiting.store(waiting.len(), Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }

        // Decoding sequences first (one token each, and their drafts), then prompt
        // chunks.
        let mut batch = Vec::new();
        // (sequence, logits rows) in batch order: a decoding sequence has one row for
        // its last token and one a draft; a prompt's last chunk one
        let mut owner: Vec<(usize, usize)> = Vec::new();
        let decoding: Vec<bool> = active
            .iter()
            .map(|s| !s.prefilling() && s.replay.is_none())
            .collect();
        let n_decoding = decoding.iter().filter(|&&d| d).count();
        // Every decoding sequence's own token comes first; drafts share what is left,
        // and leave half of it to prompt chunks when any wait.
        let mut budget = opts.max_batch_tokens.max(1).saturating_sub(n_decoding);
        let mut draft_budget = if decoding.iter().all(|&d| d) {
            budget
        } else {
            budget / 2
        };
        for (i, s) in active.iter_mut().enumerate().filter(|(i, _)| decoding[*i]) {
            let last = *s.generated.last().expect("decoding seqs have a token");
            s.drafts.clear();
            if s.speculative {
                // Drafts never run past the output limit, the context or the budget.
                let room = (s.max_tokens.saturating_sub(s.generated.len() + 1))
                    .min(n_ctx.saturating_sub(s.fed + 1))
                    .min(draft_budget)
                    .min(opts.draft_max)
                    .min(model.max_draft());
                s.draft_steps += usize::from(room > 0);
                if room > 0 && model.has_drafter() {
                    // The model's own drafter (deepseek4's MTP block): its greedy chain.
                    let p_min = opts.draft_p_min;
                    s.drafts = match model.draft_logits(s.slot, last, s.fed, room, p_min) {
                        Ok(rows) => rows.unwrap_or_default().iter().map(|r| argmax(r)).collect(),
                        Err(e) => {
                            s.draft_failures += 1;
                            tracing::warn!("drafting failed, this step runs without drafts: {e:#}");
                            Vec::new()
                        }
                    };
                } else if room > 0 {
                    let mut history = s.req.prompt.clone();
                    history.extend(&s.generated);
                    s.drafts = lookup_draft(&history, DRAFT_NGRAM, room);
                }
            }
            budget -= s.drafts.len();
            draft_budget -= s.drafts.len();
            s.draft_offered += s.drafts.len();
            stats
                .draft_offered
                .fetch_add(s.drafts.len() as u64, Ordering::Relaxed);
            for (j, &token) in std::iter::once(&last).chain(&s.drafts).enumerate() {
                batch.push(BatchEntry {
                    token,
                    slot: s.slot,
                    pos: (s.fed + j) as u32,
                    want_logits: true,
                    draft: j > 0,
                });
            }
            owner.push((i, 1 + s.drafts.len()));
        }
        let mut fed_now = vec![0usize; active.len()];
        for (i, s) in active
            .iter_mut()
            .enumerate()
            .filter(|(_, s)| s.prefilling())
        {
            if budget == 0 {
                break;
            }
            let left = s.req.prompt.len() - s.fed;
            let n = prefill_chunk(&opts, s.fed, left, budget);
            budget = budget.saturating_sub(n);
            for j in 0..n {
                let pos = s.fed + j;
                let last = pos + 1 == s.req.prompt.len();
                batch.push(BatchEntry {
                    token: s.req.prompt[pos],
                    slot: s.slot,
                    pos: pos as u32,
                    want_logits: last,
                    draft: false,
                });
                if last {
                    owner.push((i, 1));
                }
            }
            fed_now[i] = n;
        }
        let t0 = Instant::now();
        // (a step of replayed prompts only runs no pass)
        let result = match batch.is_empty() {
            true => Ok(Vec::new()),
            false => model.forward(&batch),
        };
        if !batch.is_empty() {
            stats.forward_passes.fetch_add(1, Ordering::Relaxed);
            stats
                .forward_us
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        let mut logits = match result {
            Ok(l) => l,
            Err(e) => {
                tracing::error!("forward pass failed: {e:#}");
                for s in active.drain(..) {
                    let _ = s.req.events.send(Event::Error(format!("{e:#}")));
                    // (what a failed pass left in the caches is unknown)
                    slots.give_back(s.slot, Vec::new());
                }
                continue;
            }
        };
        for (i, s) in active.iter_mut().enumerate() {
            s.fed += fed_now[i];
            // A replayed prompt's row goes after the pass's rows.
            if let Some(row) = s.replay.take() {
                owner.push((i, 1));
                logits.push(row);
            }
        }
        let mut finished = vec![None; active.len()];
        let mut rows = logits.iter();
        for &(i, n) in &owner {
            let s = &mut active[i];
            let group: Vec<&Vec<f32>> = rows.by_ref().take(n).collect();
            // Row j is the model's choice after the last token and drafts 0..j: it
            // counts only while every earlier draft was that choice.
            let mut used = 0;
            for (j, row) in group.into_iter().enumerate() {
                used = j + 1;
                let sampled = s.sampler.sample(row);
                let id = sampled.id;
                stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                finished[i] = s.take_token(sampled, &tok, n_ctx);
                if finished[i].is_some() || s.drafts.get(j) != Some(&id) {
                    break;
                }
                s.draft_accepted += 1;
                stats.draft_accepted.fetch_add(1, Ordering::Relaxed);
            }
            if decoding[i] {
                // the last token and the drafts that matched are in the cache; the
                // rows of the others are overwritten before anything reads them
                s.fed += used;
            }
        }
        let mut i = 0;
        active.retain_mut(|s| {
            let done = finished[i];
            i += 1;
            let Some(reason) = done else { return true };
            // Flush what was held back (a tail that could have begun a stop string,
            // open UTF-8) unless a stop string cut the text there.
            if !s.stop_string_hit {
                s.text.push_str(&s.decoder.finish());
                let text = s.text[s.emitted..].to_string();
                s.emitted = s.text.len();
                let tokens = s.take_released(s.text.len(), false);
                if !text.is_empty() || !tokens.is_empty() {
                    let _ = s.req.events.send(Event::Token { text, tokens });
                }
            }
            let now = Instant::now();
            let first = s.first_token.unwrap_or(now);
            let timings = Timings {
                prefill_ms: (first - s.started).as_secs_f64() * 1e3,
                decode_ms: (now - first).as_secs_f64() * 1e3,
                prompt_tokens: s.req.prompt.len(),
                completion_tokens: s.generated.len(),
                cached_prefix_tokens: s.cached,
                spec_decode_ran: s.speculative
                    && (s.draft_steps == 0 || s.draft_failures < s.draft_steps),
                draft_offered: s.draft_offered,
                draft_accepted: s.draft_accepted,
            };
            let _ = s.req.events.send(Event::Done { reason, timings });
            slots.give_back(s.slot, s.fed_tokens());
            false
        });
        // Keep the gauges true while idle too (the loop may now block for work).
        stats.active.store(active.len(), Ordering::Relaxed);
        stats.waiting.store(waiting.len(), Ordering::Relaxed);
    }
}

/// Longest suffix the drafter looks up (it tries this many tokens, then fewer, down to
/// two).
const DRAFT_NGRAM: usize = 3;

/// Prompt-lookup drafting: up to `k` tokens that followed the latest earlier place
/// where `history` holds its own last `n` tokens (n from `max_n` down to 2); none when
/// no such place exists. Text that repeats itself (lists, code being edited, the
/// prompt quoted back) drafts well; anything else costs nothing but the lookup.
pub fn lookup_draft(history: &[u32], max_n: usize, k: usize) -> Vec<u32> {
    let len = history.len();
    for n in (2..=max_n.min(len.saturating_sub(1))).rev() {
        let tail = &history[len - n..];
        // latest start first, not the tail itself
        for start in (0..len - n).rev() {
            if &history[start..start + n] == tail {
                let from = start + n;
                return history[from..(from + k).min(len)].to_vec();
            }
        }
    }
    Vec::new()
}

/// How much of `text` may be sent now: everything up to a stop string (and whether one
/// was hit), or everything except a tail that could still become one.
pub fn release_text(text: &str, emitted: usize, stops: &[String]) -> (usize, bool) {
    let longest = stops.iter().map(String::len).max().unwrap_or(0);
    let mut from = emitted.saturating_sub(longest);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    let hit = stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text[from..].find(s.as_str()).map(|p| from + p))
        .min();
    if let Some(at) = hit {
        return (at.max(emitted), true);
    }
    let mut hold = 0;
    let last = text.as_bytes().last().copied();
    for s in stops {
        for (k, _) in s.char_indices().skip(1) {
            // (the byte test first: a token's check stays linear in the stop's length)
            if Some(s.as_bytes()[k - 1]) == last && text.ends_with(&s[..k]) {
                hold = hold.max(k);
            }
        }
    }
    ((text.len() - hold).max(emitted), false)
}

/// How many of a prompt's `left` tokens (from position `fed`) to prefill in a pass with
/// `budget` tokens free: the budget, bounded past `prefill_long_from` (see
/// [`SchedulerOptions`]; `fed` only grows, so once past it a request stays bounded), and
/// a short last piece taken along where the budget has room.
fn prefill_chunk(o: &SchedulerOptions, fed: usize, left: usize, budget: usize) -> usize {
    let bounded = o.prefill_long_from > 0;
    let long = bounded && fed >= o.prefill_long_from;
    let cap = match (bounded, long) {
        (true, true) => budget.min(o.prefill_long_chunk.max(1)),
        (true, false) => budget.min(o.prefill_long_from - fed),
        _ => budget,
    };
    let n = left.min(cap);
    let tail = left - n;
    let min_tail = o.prefill_min_tail.min(o.max_batch_tokens / 4);
    let crosses = bounded && !long && fed + left > o.prefill_long_from;
    if n > 0 && tail > 0 && tail < min_tail && !crosses && left <= budget {
        left
    } else {
        n
    }
}

#[cfg(test)]
mod tests {
    use super::{prefill_chunk, release_text, SchedulerOptions, Slots};

    #[test]
    fn prefill_chunks_are_bounded_past_the_long_position() {
        let o = SchedulerOptions {
            max_batch_tokens: 64,
            prefill_long_from: 100,
            prefill_long_chunk: 16,
            prefill_min_tail: 8,
            ..Default::default()
        };
        // The chunks of a 150-token prompt, each pass with the whole batch free.
        let (mut fed, mut chunks) = (0, Vec::new());
        while fed < 150 {
            let n = prefill_chunk(&o, fed, 150 - fed, 64);
            chunks.push(n);
            fed += n;
        }
        // 64, then up to the long position, then 16s; the last 2 ride along.
        assert_eq!(chunks, [64, 36, 16, 16, 18]);
        // A short tail never crosses the position, nor runs past the pass's budget.
        assert_eq!(prefill_chunk(&o, 60, 45, 64), 40);
        assert_eq!(prefill_chunk(&o, 110, 20, 19), 16);
        // No bound: the budget alone; a tail rides along only within the budget.
        let o = SchedulerOptions {
            prefill_long_from: 0,
            ..o
        };
        assert_eq!(prefill_chunk(&o, 0, 70, 64), 64);
        assert_eq!(prefill_chunk(&o, 0, 90, 64), 64);
        assert_eq!(prefill_chunk(&o, 0, 90, 0), 0);
    }

    #[test]
    fn lookup_drafts_what_followed_the_latest_match() {
        use super::lookup_draft;
        // "7 8" last appeared before "9 1": the draft is what followed it there
        let h = [7, 8, 1, 2, 7, 8, 9, 1, 5, 7, 8];
        assert_eq!(lookup_draft(&h, 3, 3), [9, 1, 5]);
        assert_eq!(lookup_draft(&h, 3, 1), [9]);
        // the longest suffix that matches wins: "5 7 8" has no earlier match, "7 8" does
        assert_eq!(lookup_draft(&h, 2, 2), [9, 1]);
        // a draft stops at the history's end
        assert_eq!(lookup_draft(&[4, 4, 4], 3, 5), [4]);
        // nothing repeats, or too short: no draft
        assert!(lookup_draft(&[1, 2, 3, 4], 3, 3).is_empty());
        assert!(lookup_draft(&[1], 3, 3).is_empty());
        assert!(lookup_draft(&[], 3, 3).is_empty());
    }

    #[test]
    fn slots_keep_the_longest_prefix_the_model_allows() {
        let any = |_: u32, _: usize, m: usize| m;
        let no = |_: u32| false;
        let whole = |_: u32, c: usize, m: usize| if m == c { c } else { 0 };
        let mut s = Slots::new(3);
        // nothing held: the stalest slot, nothing kept
        let (a, k, _) = s.take(&[1, 2, 3], any, no).unwrap();
        assert_eq!(k, 0);
        s.give_back(a, vec![1, 2, 3, 4]);
        // the slot that matches most, never the prompt's last token
        assert_eq!(s.take(&[1, 2, 3], any, no), Some((a, 2, false)));
        s.give_back(a, vec![1, 2, 3, 4]);
        assert_eq!(s.take(&[1, 2, 3, 4, 5], any, no), Some((a, 4, false)));
        s.give_back(a, vec![1, 2, 3, 4]);
        assert_eq!(s.take(&[1, 2, 9, 9], any, no), Some((a, 2, false)));
        s.give_back(a, vec![1, 2, 3, 4]);
        // a model that keeps only the whole held sequence
        let (b, k, _) = s.take(&[1, 2, 9, 9], whole, no).unwrap();
        assert_eq!(k, 0);
        assert_ne!(
            b, a,
            "a miss takes the stalest slot, not the one with a cache"
        );
        s.give_back(b, Vec::new());
        assert_eq!(s.take(&[1, 2, 3, 4, 7], whole, no), Some((a, 4, false)));
        // reuse off (keep 0 everywhere)
        s.give_back(a, vec![5, 6]);
        let (_, k, _) = s.take(&[5, 6, 7], |_, _, _| 0, no).unwrap();
        assert_eq!(k, 0);
        // a model that keeps a mark of its own per slot (deepseek4's prompt end): the
        // slot's number reaches it
        s.give_back(a, vec![1, 2, 3, 4, 5]);
        let mark = |slot: u32, c: usize, m: usize| match (m == c, slot == a) {
            (true, _) => c,
            (false, true) => 3.min(m),
            (false, false) => 0,
        };
        assert_eq!(s.take(&[1, 2, 3, 8, 9], mark, no), Some((a, 3, false)));
        // the whole prompt held, its last logits kept by the model: all of it, before
        // any slot that keeps less
        s.give_back(a, vec![1, 2, 3, 8, 9, 4]);
        assert_eq!(
            s.take(&[1, 2, 3, 8, 9], any, |x| x == a),
            Some((a, 5, true))
        );
        // nothing free
        let mut one = Slots::new(1);
        one.take(&[1], any, no).unwrap();
        assert_eq!(one.take(&[1], any, no), None);
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let stops = vec!["END".to_string(), "\n\n".to_string()];
        assert_eq!(release_text("hello", 0, &stops), (5, false));
        assert_eq!(release_text("hello E", 0, &stops), (6, false));
        assert_eq!(release_text("hello EN", 6, &stops), (6, false));
        assert_eq!(release_text("hello END more", 6, &stops), (6, true));
        assert_eq!(release_text("a\n\nb", 0, &stops), (1, true));
        assert_eq!(release_text("héllo", 0, &[]), ("héllo".len(), false));
    }
}
