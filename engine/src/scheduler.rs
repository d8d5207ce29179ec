//! Continuous batching in the manner of vLLM's v1 scheduler: every step
//! spends a token budget (`max_num_batched_tokens`) on running sequences
//! first (decode tokens and unfinished prefill chunks), then admits waiting
//! ones (chunked prefill) up to `max_num_seqs`, reusing cached prefixes.
//!
//! Policies: `Fcfs` (arrival order; under KV pressure the latest admitted
//! running sequence is preempted) and `Priority` (higher priority first, FCFS
//! within; a waiting request may preempt a strictly lower-priority running
//! one when blocks or — flag `preempt_on_seq_limit` — `max_num_seqs` are the
//! limit).
//!
//! Preemption keeps the victim's work:
//! - A victim preempted for a *slot* (`max_num_seqs`) keeps its blocks while
//!   it waits ("parked"): its full blocks stay in the prefix cache under
//!   their chained hashes, shareable by others, and its resume computes only
//!   its next token. The KV stays where the backend keeps it (host or device
//!   memory alike), so no backend has to copy anything.
//! - Parked blocks are the first to go under memory pressure: before any
//!   running sequence is preempted, the least important parked sequence (last
//!   in admission order) gives its blocks back to the pool, where its full
//!   blocks stay cached and evictable like any freed prefix.
//! - A victim preempted for *blocks* gives them back the same way. Either
//!   way a resume takes its cached blocks like any prefix hit and recomputes
//!   at most its last partial block, unless pressure evicted more.
//! - The victim is the cheapest sufficient one among the running sequences of
//!   the lowest priority: one that frees enough blocks (when blocks are the
//!   need) and would recompute the fewest tokens if its blocks went back to
//!   the cache, latest arrival among equals. A sequence that finishes within
//!   the next step is never preempted while another candidate exists: it
//!   frees its slot and blocks a step later anyway. A preempted sequence keeps
//!   its original arrival (flag `keep_preempted_order`, on by default), so it
//!   resumes ahead of later arrivals of its priority.
//!
//! Admissions may wait (`admission_wait_steps`): each step with a prefill
//! pays that prefill's fixed cost, and slots that fell out of step with the
//! others (after a preemption at the slot limit, above all) would otherwise
//! admit alone ever after. When more prompts wait than slots are free (the
//! slots about to free take the rest of them, however many are free now) or
//! the engine is nearly full, nothing is
//! prefilling and running sequences reach `max_tokens` within the wait, a
//! prompt that outranks no running sequence waits for their slots and
//! shares their prefill step.
//!
//! Prefill first (`prefill_first_steps`): while prompts wait or are
//! mid-prefill, up to that many steps in a row leave decode rows out, so a
//! prompt's steps do not also pay the decode rows' attention over their
//! contexts (the mocker charges a mixed step the sum of both, as Dynamo's
//! does). Only rows at or below the prompts' priority and without a TPOT
//! target sit out, and only when every decoding row is such (a step that
//! decodes one anyway carries them all); not while more wait than slots
//! are free, and a second step in a row only for a prefill in progress. A
//! step that starts no prompt decodes as any other, and after admission
//! nothing is preempted for a decode row (a victim could be a sequence
//! admitted that step).
//!
//! Abort at any point frees every block. Tokens computed again after a
//! preemption are counted per sequence ([`Preemption`]) and in [`LoadStats`].
//!
//! The scheduler owns the [`KvCache`] bookkeeping and the sequences' samplers;
//! it never touches KV memory (the backend does) and never blocks.

mod sequence;

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap};
use std::ops::Bound::{Excluded, Unbounded};
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;

use sluice_tokens::grammar::{Allowed, Constraint, GrammarError};

pub use sequence::{FinishReason, Finished, Preemption, Request, StepOutput, Usage};
use sequence::{Sequence, Status};

use crate::backend::{ForwardBatch, ForwardOutput, SeqChunk};
use crate::config::{SchedulerConfig, SchedulingPolicy};
use crate::error::EngineError;
use crate::kv::{KvCache, SeqId};
use crate::sampler::{PositionLogprobs, SampleContext};

/// A constraint back from computing its mask, with the mask.
type Masked = (Constraint, Result<Allowed, GrammarError>);

/// How long `update` waits for a row's grammar mask.
const MASK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// One sequence's share of a scheduled step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq_id: SeqId,
    /// Tokens computed for it this step.
    pub num_new_tokens: usize,
    /// Whether this step produces its next token.
    pub needs_logits: bool,
}

/// What one call to [`Scheduler::schedule`] decided.
#[derive(Debug, Clone, Default)]
pub struct ScheduledStep {
    /// In batch order (the order of `batch.seqs`).
    pub seqs: Vec<ScheduledSeq>,
    /// What the backend computes.
    pub batch: ForwardBatch,
    /// Sequences preempted this step (back to waiting; parked or with their
    /// blocks given back to the pool).
    pub preempted: Vec<SeqId>,
    /// Sequences moved from waiting to running this step, in admission order.
    pub admitted: Vec<SeqId>,
    /// Waiting prompts passed over this step because a long prefill is in
    /// progress (long prefills go one at a time); prompts behind them could
    /// still be admitted.
    pub passed_over: Vec<SeqId>,
    /// Whether balance scheduling held admission back this step.
    pub balance_held: bool,
    /// Whether admission waited this step for slots about to free
    /// (`SchedulerConfig::admission_wait_steps`).
    pub admission_held: bool,
}

impl ScheduledStep {
    /// Tokens computed this step.
    pub fn num_batched_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_new_tokens).sum()
    }

    /// Whether the step computes nothing.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
}

/// Load of one engine, as workers report it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct LoadStats {
    pub running: usize,
    pub waiting: usize,
    /// Blocks referenced by sequences (running, held or reserved).
    pub active_blocks: usize,
    pub total_blocks: usize,
    /// `active_blocks / total_blocks`.
    pub kv_usage: f64,
    /// Prompt (or recompute) tokens admitted or waiting but not yet computed.
    pub pending_prefill_tokens: usize,
    /// Blocks currently cached under a hash.
    pub cached_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// The scheduler orders waiting sequences by priority
    /// (`SchedulingPolicy::Priority`): a lower-priority prompt waiting here
    /// does not delay a higher one's prefill.
    pub priority_scheduling: bool,
    /// Prompts with more than this many tokens left to prefill go one at a
    /// time, and a shorter one waiting behind one is admitted next to it
    /// (0 = no such rule; see [`SchedulerConfig`]).
    pub long_prefill_token_threshold: usize,
    /// Steps scheduled so far.
    pub steps: u64,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Tokens computed again after a preemption so far (see [`Preemption`]).
    pub recomputed_tokens: u64,
    /// Steps where balance scheduling held admission back.
    pub balance_held_steps: u64,
    /// Steps that left the decoding sequences' rows out for prefill
    /// (`SchedulerConfig::prefill_first_steps`).
    pub decode_stalled_steps: u64,
    /// The engine's recent mean decode step time in µs (0 before the first;
    /// set by the engine loop, not the scheduler).
    pub step_time_us: u32,
    /// The engine's recent mean prefill cost per prompt token in ns, beyond
    /// the decode step it rides with, if any (0 before the first prompt;
    /// set by the engine loop).
    pub prefill_ns_per_token: u32,
    /// Its fixed part per step with prompt tokens, in µs.
    pub prefill_step_us: u32,
    /// Prefill first as it stands: the steps in a row a prompt step may
    /// leave decode rows out (`SchedulerConfig::prefill_first_steps`; 0
    /// while more sequences wait than slots are free, and while a decoding
    /// sequence has a TPOT target, since its row never sits out and a step
    /// that decodes one carries them all).
    pub prefill_first_steps: usize,
    /// The steps in a row that have left them out (0 after a step that
    /// decoded).
    pub stalled_in_a_row: usize,
    /// Running sequences with prompt tokens left: a prefill in progress
    /// may leave the rows out again after such a step; prompts that just
    /// arrived may not.
    pub prefilling: usize,
    /// A decode step's time as `decode_base_us + rows ×
    /// decode_ns_per_seq / 1000` (fitted over recent decode steps; set by
    /// the engine loop).
    pub decode_base_us: u32,
    pub decode_ns_per_seq: u32,
    /// Steps where admission waited for slots about to free.
    pub admission_held_steps: u64,
    /// Blocks the second KV tier holds, and blocks restored from it so far.
    pub tier_blocks: usize,
    pub tier_restored_blocks: u64,
}

/// Where a remote prefill must write a prompt's KV.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteReservation {
    /// One destination block per full or partial prompt block, in order.
    pub block_ids: Vec<u32>,
    /// Leading blocks already cached locally: the sender skips them.
    pub skip_blocks: usize,
    /// Prompt tokens covered by those blocks.
    pub cached_tokens: usize,
}

/// The continuous-batching scheduler of one engine.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    /// Grammar masks of this step's constrained rows, computed on
    /// `mask_pool` while the backend runs the forward pass; taken in
    /// `update`.
    masks: HashMap<SeqId, std_mpsc::Receiver<Masked>>,
    /// Where masks are computed: the backend's own pool when it has one
    /// (see [`Scheduler::compute_masks_on`]), else rayon's global pool.
    mask_pool: Option<Arc<rayon::ThreadPool>>,
    eos_token_ids: Vec<u32>,
    kv: KvCache,
    /// `min(max_model_len, KV capacity in tokens)`.
    max_len: usize,
    seqs: HashMap<SeqId, Sequence>,
    /// Ordered by policy key; the first entry is admitted next.
    waiting: BTreeMap<(i64, u64), SeqId>,
    /// In admission order.
    running: Vec<SeqId>,
    next_arrival: u64,
    peer_running_max: usize,
    steps: u64,
    preemptions: u64,
    recomputed_tokens: u64,
    balance_held_steps: u64,
    admission_held_steps: u64,
    /// Steps in a row admission has waited for slots about to free.
    admission_waited: usize,
    /// Steps in a row that left decode rows out for prefill
    /// (`SchedulerConfig::prefill_first_steps`).
    decode_stalled: usize,
    /// Steps that left decode rows out, in all.
    decode_stalled_steps: u64,
}

impl Scheduler {
    /// A scheduler over `kv` stopping sequences at any of `eos_token_ids`.
    pub fn new(cfg: SchedulerConfig, kv: KvCache, eos_token_ids: Vec<u32>) -> Self {
        let max_len = cfg.max_model_len.min(kv.num_blocks() * kv.block_size());
        Self {
            masks: HashMap::new(),
            mask_pool: None,
            cfg,
            eos_token_ids,
            kv,
            max_len,
            seqs: HashMap::new(),
            waiting: BTreeMap::new(),
            running: Vec::new(),
            next_arrival: 0,
            peer_running_max: 0,
            steps: 0,
            preemptions: 0,
            recomputed_tokens: 0,
            balance_held_steps: 0,
            admission_held_steps: 0,
            admission_waited: 0,
            decode_stalled: 0,
            decode_stalled_steps: 0,
        }
    }

    /// The scheduler's configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The KV bookkeeping.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }

    /// The KV cache, for the engine thread's second-tier replay.
    pub fn kv_mut(&mut self) -> &mut KvCache {
        &mut self.kv
    }

    /// Drops every cached prefix (publishes `Cleared`).
    pub fn clear_prefix_cache(&mut self) {
        self.kv.clear_prefix_cache();
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.kv.block_size()
    }

    /// Longest sequence (prompt + output) this engine can hold.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Queues a request for generation.
    pub fn add(&mut self, id: SeqId, req: Request) -> Result<(), EngineError> {
        self.add_inner(id, req, false)
    }

    /// Queues a prefill-only request: it stops after its first token and
    /// keeps its prompt blocks (status held) until [`Scheduler::abort`].
    pub fn add_prefill_only(&mut self, id: SeqId, mut req: Request) -> Result<(), EngineError> {
        req.sampling.max_tokens = Some(1);
        req.sampling.min_tokens = 0;
        self.add_inner(id, req, true)
    }

    fn add_inner(&mut self, id: SeqId, req: Request, hold: bool) -> Result<(), EngineError> {
        self.validate(id, &req)?;
        let arrival = self.bump_arrival();
        let seq = Sequence::new(req, self.kv.block_size(), arrival, hold);
        self.waiting.insert(self.key(&seq), id);
        self.seqs.insert(id, seq);
        Ok(())
    }

    fn validate(&self, id: SeqId, req: &Request) -> Result<(), EngineError> {
        if self.seqs.contains_key(&id) {
            return Err(EngineError::InvalidRequest(format!(
                "sequence id {id} is already in use"
            )));
        }
        if req.prompt.is_empty() {
            return Err(EngineError::InvalidRequest("prompt is empty".into()));
        }
        if req.prompt.len() >= self.max_len {
            return Err(EngineError::InvalidRequest(format!(
                "prompt has {} tokens; this engine holds at most {} per sequence including output",
                req.prompt.len(),
                self.max_len
            )));
        }
        req.sampling.validate()
    }

    /// Removes a sequence in any state and frees its blocks. Returns its
    /// usage, or `None` if it is unknown (already finished).
    pub fn abort(&mut self, id: SeqId) -> Option<Usage> {
        self.masks.remove(&id);
        let seq = self.seqs.remove(&id)?;
        match seq.status {
            Status::Waiting => {
                self.waiting.remove(&self.key(&seq));
            }
            Status::Running => self.running.retain(|&r| r != id),
            Status::Held | Status::Reserved => {}
        }
        self.kv.free(id);
        Some(seq.usage())
    }

    /// Allocates the destination blocks of a remote prefill for `req`,
    /// reusing the locally cached prefix. The sequence waits (status
    /// reserved) until [`Scheduler::commit_remote`] or [`Scheduler::abort`].
    pub fn reserve_remote(
        &mut self,
        id: SeqId,
        req: Request,
    ) -> Result<RemoteReservation, EngineError> {
        self.validate(id, &req)?;
        let arrival = self.bump_arrival();
        let mut seq = Sequence::new(req, self.kv.block_size(), arrival, false);
        let hits = self.kv.acquire_prefix(id, seq.hashes.hashes());
        while let Err(e) = self.kv.allocate(id, seq.prompt_len) {
            if !self.release_parked(None) {
                self.kv.free(id);
                return Err(e);
            }
        }
        let cached_tokens = (hits * self.kv.block_size()).min(seq.prompt_len);
        seq.status = Status::Reserved;
        seq.cached_tokens = Some(cached_tokens);
        self.seqs.insert(id, seq);
        Ok(RemoteReservation {
            block_ids: self.kv.block_table(id).to_vec(),
            skip_blocks: hits,
            cached_tokens,
        })
    }

    /// The prompt's KV has been written into a reserved sequence's blocks and
    /// its first token computed remotely: register the prompt's blocks in the
    /// prefix cache, take the first token, and queue the sequence to decode.
    pub fn commit_remote(
        &mut self,
        id: SeqId,
        first_token: u32,
        logprobs: Option<PositionLogprobs>,
    ) -> Result<StepOutput, EngineError> {
        let seq = self
            .seqs
            .get_mut(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if seq.status != Status::Reserved {
            return Err(EngineError::InvalidRequest(format!(
                "sequence {id} is not a reserved slot"
            )));
        }
        seq.num_computed = seq.prompt_len;
        seq.computed_high = seq.prompt_len;
        seq.prefill_end = seq.prompt_len;
        self.kv
            .cache_full_blocks(id, seq.hashes.hashes(), seq.num_computed);
        seq.push_token(first_token);
        let reason = stop_reason(seq, first_token, &self.eos_token_ids, self.max_len);
        let mut out = StepOutput {
            seq_id: id,
            token: first_token,
            logprobs,
            finished: None,
            preemption: seq.preemption,
        };
        if let Some(reason) = reason {
            out.finished = Some(Finished {
                reason,
                usage: seq.usage(),
            });
            self.seqs.remove(&id);
            self.kv.free(id);
        } else {
            seq.status = Status::Waiting;
            let key = self.key(&self.seqs[&id]);
            self.waiting.insert(key, id);
        }
        Ok(out)
    }

    /// Allocates blocks for the first `blocks` full blocks of `req`'s prompt
    /// (reusing the locally cached ones) for a peer to write its cached
    /// prefix into. The slot waits (status reserved) until
    /// [`Scheduler::commit_import`] or [`Scheduler::abort`].
    pub fn reserve_import(
        &mut self,
        id: SeqId,
        mut req: Request,
        blocks: usize,
    ) -> Result<RemoteReservation, EngineError> {
        let bs = self.kv.block_size();
        // Full blocks only, and never the prompt's last token (it is
        // computed for its logits).
        let blocks = blocks.min(req.prompt.len().saturating_sub(1) / bs);
        req.prompt.truncate(blocks * bs);
        if blocks == 0 {
            return Err(EngineError::InvalidRequest(
                "nothing to import: the prompt has no full block before its last token".into(),
            ));
        }
        self.reserve_remote(id, req)
    }

    /// A peer wrote the first `written` blocks past the reserved slot's
    /// cached ones: they enter the prefix cache (and the KV events) as if
    /// computed here, and the slot is released, its blocks kept cached like
    /// any freed prefix. Blocks past those written are freed uncached.
    pub fn commit_import(&mut self, id: SeqId, written: usize) -> Result<usize, EngineError> {
        let seq = self.seqs.get(&id).ok_or(EngineError::UnknownSequence(id))?;
        if seq.status != Status::Reserved {
            return Err(EngineError::InvalidRequest(format!(
                "sequence {id} is not a reserved slot"
            )));
        }
        let bs = self.kv.block_size();
        let skip = seq.cached_tokens.unwrap_or(0) / bs;
        let tokens = ((skip + written) * bs).min(seq.prompt_len);
        self.kv.cache_full_blocks(id, seq.hashes.hashes(), tokens);
        self.abort(id);
        Ok(tokens)
    }

    /// Takes references on the cached prefix of `prompt` (its leading full
    /// blocks, at most `max_blocks`) for a peer to read, under `id` (no
    /// sequence); [`Scheduler::release_table`] lets go. The blocks, in order.
    pub fn hold_prefix(&mut self, id: SeqId, prompt: &[u32], max_blocks: usize) -> Vec<u32> {
        let hashes = sluice_tokens::sequence_block_hashes(prompt, self.kv.block_size());
        let hits = self
            .kv
            .acquire_prefix(id, &hashes[..hashes.len().min(max_blocks)]);
        self.kv.block_table(id)[..hits].to_vec()
    }

    /// Releases blocks held by [`Scheduler::hold_prefix`].
    pub fn release_table(&mut self, id: SeqId) {
        if !self.seqs.contains_key(&id) && self.kv.has_table(id) {
            self.kv.free(id);
        }
    }

    /// Feeds the largest running count among the other data-parallel ranks
    /// (for balance scheduling).
    pub fn set_peer_running_max(&mut self, n: usize) {
        self.peer_running_max = n;
    }

    /// Sequences running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences waiting (including preempted ones).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Running sequences, in admission order.
    pub fn running_ids(&self) -> &[SeqId] {
        &self.running
    }

    /// Waiting sequences, the next to be admitted first.
    pub fn waiting_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.waiting.values().copied()
    }

    /// Whether any sequence is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Whether `id` is known (waiting, running, held or reserved).
    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// The sequence's physical blocks (empty if unknown).
    pub fn block_table(&self, id: SeqId) -> &[u32] {
        self.kv.block_table(id)
    }

    /// Whether `id` is a reserved remote-prefill slot.
    pub fn is_reserved(&self, id: SeqId) -> bool {
        self.seqs
            .get(&id)
            .is_some_and(|s| s.status == Status::Reserved)
    }

    /// Current load.
    pub fn load(&self) -> LoadStats {
        // One pass over the running sequences: their prompt tokens left,
        // how many are mid-prefill, and whether a decoding one has a TPOT
        // target (its row never sits out).
        let (mut pending, mut prefilling, mut pinned) = (0, 0, false);
        for s in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            let left = s.pending_prefill();
            pending += left;
            if left > 0 {
                prefilling += 1;
            } else {
                pinned |= s.tpot_target.is_some();
            }
        }
        pending += self
            .waiting
            .values()
            .filter_map(|id| self.seqs.get(id))
            .map(Sequence::pending_prefill)
            .sum::<usize>();
        let prefill_first_steps = if pinned || self.waiting.len() > self.free_slots() {
            0
        } else {
            self.cfg.prefill_first_steps
        };
        let (tier_blocks, tier_restored_blocks) = self.kv.tier_figures();
        LoadStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            active_blocks: self.kv.num_used(),
            total_blocks: self.kv.num_blocks(),
            kv_usage: self.kv.usage(),
            pending_prefill_tokens: pending,
            cached_blocks: self.kv.num_cached_blocks(),
            max_num_seqs: self.cfg.max_num_seqs,
            max_num_batched_tokens: self.cfg.max_num_batched_tokens,
            priority_scheduling: self.cfg.policy == SchedulingPolicy::Priority,
            long_prefill_token_threshold: self.long_prefill_cap().unwrap_or(0),
            steps: self.steps,
            preemptions: self.preemptions,
            recomputed_tokens: self.recomputed_tokens,
            balance_held_steps: self.balance_held_steps,
            decode_stalled_steps: self.decode_stalled_steps,
            admission_held_steps: self.admission_held_steps,
            step_time_us: 0,
            prefill_ns_per_token: 0,
            prefill_step_us: 0,
            prefill_first_steps,
            stalled_in_a_row: self.decode_stalled,
            prefilling,
            decode_base_us: 0,
            decode_ns_per_seq: 0,
            tier_blocks,
            tier_restored_blocks,
        }
    }

    /// Decides the next step: which sequences compute how many tokens, and
    /// the forward batch for the backend. Sequences admitted or preempted
    /// change state now; computed tokens are committed by [`Scheduler::update`].
    pub fn schedule(&mut self) -> ScheduledStep {
        self.steps += 1;
        let mut plan = Plan {
            budget: self.cfg.max_num_batched_tokens,
            sched: Vec::new(),
            step: ScheduledStep::default(),
        };
        let mut prompt_priority = self.prefill_first_priority();
        let rows = prompt_priority.map_or(Rows::All, |up_to| Rows::Prefill { up_to });
        let mut deferred = self.schedule_running(&mut plan, rows);
        if let Some(up_to) = prompt_priority
            && plan
                .sched
                .iter()
                .any(|(id, _)| self.seqs[id].pending_prefill() == 0)
        {
            // Rows that may not sit out (above the prompts, or with a TPOT
            // target) decode this step: it pays for a decode pass anyway,
            // so every row rides along, as in any mixed step.
            deferred |= self.schedule_running(&mut plan, Rows::Decode { up_to });
            prompt_priority = None;
        }
        self.admit_waiting(&mut plan, deferred);
        self.top_up(&mut plan);
        if let Some(up_to) = prompt_priority {
            let prefilling = plan
                .sched
                .iter()
                .any(|(id, _)| self.seqs[id].pending_prefill() > 0);
            if !prefilling {
                // No prompt could start (slots, KV memory, a held
                // admission): the step decodes as any other.
                self.schedule_running(&mut plan, Rows::Decode { up_to });
            }
            let stalled = prefilling
                && self
                    .running
                    .iter()
                    .any(|id| self.seqs[id].may_stall_for(up_to));
            if stalled {
                self.decode_stalled += 1;
                self.decode_stalled_steps += 1;
            } else {
                self.decode_stalled = 0;
            }
        } else {
            self.decode_stalled = 0;
        }
        let step = self.build_batch(plan);
        self.start_masks(&step);
        step
    }

    /// Slots no running sequence holds.
    fn free_slots(&self) -> usize {
        self.cfg.max_num_seqs.saturating_sub(self.running.len())
    }

    /// Prefill first: the priority of the prompts this step leaves decode
    /// rows out for (rows at or below it, without a TPOT target), or `None`
    /// for a step that carries every row. At most `prefill_first_steps`
    /// steps in a row, and only while the free slots take every waiting
    /// sequence: with more waiting the engine is at capacity, each waits for
    /// a slot far longer than a step, and prompts trickling into the slots
    /// as they free would each pay a prompt step's fixed cost again (mixed
    /// steps let them share one). After a step that left rows out, only a
    /// prefill in progress leaves them out again, for the same reason:
    /// prompts that arrived while it ran join the next mixed step together.
    fn prefill_first_priority(&self) -> Option<i32> {
        if self.decode_stalled >= self.cfg.prefill_first_steps
            || self.waiting.len() > self.free_slots()
        {
            return None;
        }
        let arrived = (self.decode_stalled == 0).then_some(&self.waiting);
        arrived
            .into_iter()
            .flat_map(|w| w.values())
            .chain(
                self.running
                    .iter()
                    .filter(|id| self.seqs[*id].pending_prefill() > 0),
            )
            .map(|id| self.seqs[id].priority)
            .max()
    }

    /// Starts computing the grammar mask of every constrained row that
    /// samples this step, off the engine thread, so it overlaps the
    /// forward pass (the mask depends only on tokens already chosen).
    fn start_masks(&mut self, step: &ScheduledStep) {
        for s in step.seqs.iter().filter(|s| s.needs_logits) {
            let Some(seq) = self.seqs.get_mut(&s.seq_id) else {
                continue;
            };
            let Some(mut constraint) = seq.constraint.take() else {
                continue;
            };
            let (tx, rx) = std_mpsc::channel();
            let job = move || {
                let allowed = constraint.allowed();
                let _ = tx.send((constraint, allowed));
            };
            // On the pool the forward pass runs on: its threads are warm
            // from it, so a mask starts at once (a pool of the masks' own,
            // or rayon's global one beside a backend with its own, costs a
            // thread wake-up per step: ~15% of a batch-1 step here).
            match &self.mask_pool {
                Some(pool) => pool.spawn(job),
                None => rayon::spawn(job),
            }
            self.masks.insert(s.seq_id, rx);
        }
    }

    /// Computes grammar masks on `pool` (the backend's, so they run on
    /// threads its forward pass keeps warm); `None`: rayon's global pool.
    pub fn compute_masks_on(&mut self, pool: Option<Arc<rayon::ThreadPool>>) {
        self.mask_pool = pool;
    }

    /// The mask started for `id` this step, its constraint back in place.
    fn take_mask(&mut self, id: SeqId) -> Option<Result<Allowed, GrammarError>> {
        let rx = self.masks.remove(&id)?;
        // A mask is micro- to milliseconds; one that takes longer than this
        // ends its request rather than stall every sequence of the batch.
        let (constraint, allowed) = match rx.recv_timeout(MASK_DEADLINE) {
            Ok(done) => done,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                return Some(Err(GrammarError::Rejected(format!(
                    "its token mask took over {} s",
                    MASK_DEADLINE.as_secs()
                ))));
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return None,
        };
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.constraint = Some(constraint);
        }
        Some(allowed)
    }

    /// `long_prefill_token_threshold` where it applies: set, with chunked
    /// prefill (see [`SchedulerConfig`]).
    fn long_prefill_cap(&self) -> Option<usize> {
        let threshold = self.cfg.long_prefill_token_threshold;
        (threshold > 0 && self.cfg.enable_chunked_prefill).then_some(threshold)
    }

    /// The tokens a sequence with `remaining` to compute takes in a step's
    /// first pass: what the budget allows, and for a prefill chunk at most
    /// the long-prefill cap.
    fn first_pass_tokens(&self, remaining: usize, budget: usize) -> usize {
        let n = remaining.min(budget);
        match self.long_prefill_cap() {
            Some(cap) if remaining > 1 => n.min(cap),
            _ => n,
        }
    }

    /// Whether a waiting prompt with `remaining` tokens to prefill must wait
    /// for the long prefill this step already carries: long prefills (more
    /// than the threshold) go one at a time, in order, so they are not
    /// interleaved into each other's way; short prompts go next to them,
    /// also those queued behind a long prompt that waits.
    fn waits_for_long_prefill(&self, plan: &Plan, remaining: usize) -> bool {
        self.long_prefill_cap().is_some_and(|cap| {
            remaining > cap
                && plan.sched.iter().any(|(id, _)| {
                    let s = &self.seqs[id];
                    s.tokens.len() - s.num_computed > cap
                })
        })
    }

    /// Gives what is left of the step's budget to the prefill chunks the
    /// first pass held back, in schedule order, as far as KV memory allows
    /// without preempting anyone.
    fn top_up(&mut self, plan: &mut Plan) {
        if self.long_prefill_cap().is_none() {
            return;
        }
        for entry in &mut plan.sched {
            if plan.budget == 0 {
                break;
            }
            let (id, n) = *entry;
            let seq = &self.seqs[&id];
            let start = seq.num_computed + n;
            let extra = (seq.tokens.len() - start).min(plan.budget);
            if extra > 0 && self.kv.allocate(id, start + extra).is_ok() {
                entry.1 += extra;
                plan.budget -= extra;
            }
        }
    }

    /// Schedules the running sequences' next tokens, in admission order,
    /// preempting (or deferring) where KV memory runs out. Whether one was
    /// deferred (it waits for blocks that this step frees).
    fn schedule_running(&mut self, plan: &mut Plan, rows: Rows) -> bool {
        let mut deferred = false;
        let mut i = 0;
        while i < self.running.len() && plan.budget > 0 {
            let id = self.running[i];
            let seq = &self.seqs[&id];
            let n = self.first_pass_tokens(seq.tokens.len() - seq.num_computed, plan.budget);
            let skip = match rows {
                Rows::All => false,
                Rows::Prefill { up_to } => seq.may_stall_for(up_to),
                // A parked sequence resumed this step is in already.
                Rows::Decode { up_to } => {
                    !seq.may_stall_for(up_to) || plan.step.admitted.contains(&id)
                }
            };
            if n == 0 || skip {
                i += 1;
                continue;
            }
            let target = seq.num_computed + n;
            loop {
                if self.kv.allocate(id, target).is_ok() {
                    plan.sched.push((id, n));
                    plan.budget -= n;
                    i += 1;
                    break;
                }
                if self.release_parked(None) {
                    continue;
                }
                if matches!(rows, Rows::Decode { .. }) && !plan.step.admitted.is_empty() {
                    // Nothing is preempted for a sequence admitted this
                    // step (the victim could be it): the row waits a step,
                    // while the admitted ones run.
                    deferred = true;
                    i += 1;
                    break;
                }
                let deficit = self.deficit(id, target);
                let Some(victim) = self.pick_victim(Room::ForRunning {
                    requester: id,
                    deficit,
                }) else {
                    // Every sequence that would give way finishes this step
                    // and frees its blocks: this one waits a step instead.
                    deferred = true;
                    i += 1;
                    break;
                };
                let victim_pos = self.running.iter().position(|&r| r == victim).unwrap_or(i);
                plan.budget += unschedule(&mut plan.sched, victim);
                self.preempt(victim, false);
                plan.step.preempted.push(victim);
                if victim == id {
                    break;
                }
                if victim_pos < i {
                    i -= 1;
                }
            }
        }

        deferred
    }

    /// Admits waiting sequences in policy order while the token budget,
    /// the slots and KV memory allow (none when this step already had to
    /// preempt or defer, or balance scheduling holds back), preempting
    /// lower priorities under `priority` scheduling.
    fn admit_waiting(&mut self, plan: &mut Plan, deferred: bool) {
        let bs = self.kv.block_size();
        let balance_ok = !self.cfg.balance_scheduling
            || self.peer_running_max.max(self.running.len()) + 1 < self.cfg.max_num_seqs;
        if !balance_ok && !self.waiting.is_empty() {
            plan.step.balance_held = true;
            self.balance_held_steps += 1;
        }
        let priority = self.cfg.policy == SchedulingPolicy::Priority;
        let mut admit = plan.step.preempted.is_empty() && !deferred && balance_ok;
        if admit && self.admission_waits(plan) {
            plan.step.admission_held = true;
            self.admission_held_steps += 1;
            self.admission_waited += 1;
            admit = false;
            // The prompts the free slots would have taken this step.
            let free = self.free_slots();
            let held: Vec<SeqId> = self.waiting.values().take(free).copied().collect();
            for id in held {
                if let Some(seq) = self.seqs.get_mut(&id) {
                    seq.admission_held_steps += 1;
                }
            }
        } else if admit {
            // Admission goes ahead: the next wait starts afresh. A step held
            // for another reason (a preemption, balance) does not reset it,
            // so waits between admissions add up to the limit at most.
            self.admission_waited = 0;
        }
        // A waiting sequence whose cached prefix this step took references
        // on; released if it is not admitted after all.
        let mut acquired_for: Option<SeqId> = None;
        // Waiting prompts passed over this step: only long ones that must
        // wait for the long prefill in progress; everything else that
        // cannot go stops the pass (FCFS for slots and memory).
        let mut after = None;
        while admit && plan.budget > 0 {
            let next = match after {
                None => self.waiting.first_key_value(),
                Some(k) => self.waiting.range((Excluded(k), Unbounded)).next(),
            };
            let Some((&key, &id)) = next else {
                break;
            };
            if plan.step.preempted.contains(&id) {
                break;
            }
            let prio = self.seqs[&id].priority;
            if self.running.len() >= self.cfg.max_num_seqs {
                if priority
                    && self.cfg.preempt_on_seq_limit
                    && let Some(v) = self.pick_victim(Room::Slot { for_priority: prio })
                {
                    plan.budget += unschedule(&mut plan.sched, v);
                    // Only the slot is needed: the victim parks its blocks.
                    self.preempt(v, true);
                    plan.step.preempted.push(v);
                    restart_pass(&mut after);
                    continue;
                }
                break;
            }
            if !self.kv.has_table(id) {
                let seq = self.seqs.get_mut(&id).expect("waiting ids are known");
                let max_hit = (seq.tokens.len() - 1) / bs;
                let hashes = seq.hashes.hashes();
                let hits = self
                    .kv
                    .acquire_prefix(id, &hashes[..hashes.len().min(max_hit)]);
                seq.num_computed = hits * bs;
                acquired_for = Some(id);
            }
            let seq = &self.seqs[&id];
            let remaining = seq.tokens.len() - seq.num_computed;
            if self.waits_for_long_prefill(plan, remaining) {
                // Shorter prompts behind it still go next to the long one.
                if acquired_for.take() == Some(id) {
                    self.give_back_prefix(id);
                }
                if !plan.step.passed_over.contains(&id) {
                    plan.step.passed_over.push(id);
                }
                after = Some(key);
                continue;
            }
            let n = self.first_pass_tokens(remaining, plan.budget);
            let target = seq.num_computed + n;
            let fits_whole = n == remaining || self.cfg.enable_chunked_prefill;
            if fits_whole && self.kv.allocate(id, target).is_ok() {
                self.waiting.remove(&key);
                let seq = self.seqs.get_mut(&id).expect("waiting ids are known");
                if seq.cached_tokens.is_none() {
                    seq.cached_tokens = Some(seq.num_computed.min(seq.prompt_len));
                }
                seq.status = Status::Running;
                self.running.push(id);
                plan.sched.push((id, n));
                plan.budget -= n;
                plan.step.admitted.push(id);
                // Passed over earlier in the step, before a restart.
                plan.step.passed_over.retain(|&p| p != id);
                acquired_for = None;
                continue;
            }
            // Blocks parked by other waiting sequences (preempted ones,
            // remote-prefilled ones queued to decode) go back first, least
            // important first: their full blocks stay in the cache.
            if fits_whole && self.release_parked(Some(id)) {
                continue;
            }
            if fits_whole
                && priority
                && self.preemption_could_fit(id, target, prio)
                && let Some(v) = self.pick_victim(Room::ForWaiting {
                    for_priority: prio,
                    deficit: self.deficit(id, target),
                })
            {
                plan.budget += unschedule(&mut plan.sched, v);
                self.preempt(v, false);
                plan.step.preempted.push(v);
                restart_pass(&mut after);
                continue;
            }
            break;
        }

        if let Some(id) = acquired_for
            && self
                .seqs
                .get(&id)
                .is_some_and(|s| s.status == Status::Waiting)
        {
            self.give_back_prefix(id);
        }
    }

    /// Whether this step's admissions wait for the slots about to free, to
    /// share their prefill step (see `SchedulerConfig::admission_wait_steps`):
    /// more prompts wait than slots are free or the engine is nearly full,
    /// nothing running is prefilling, a running
    /// sequence ends within the wait, the wait has not run out, and the
    /// next waiting sequence is a prompt to prefill (a parked victim or a
    /// remotely prefilled sequence resumes in a decode row, which costs no
    /// prefill step) that is not above every running sequence: a prompt
    /// alone at the top goes at once (an interactive request beside batch
    /// work), one with work of its priority running batches with its peers
    /// like any other (lower ones running too would otherwise make every
    /// prompt of a busy band prefill alone). A parked victim
    /// waits the same while higher-priority work runs, leaving the slot to
    /// that work's next prompt.
    fn admission_waits(&self, plan: &Plan) -> bool {
        let wait = self.cfg.admission_wait_steps;
        let max = self.cfg.max_num_seqs;
        let free = self.free_slots();
        let Some(head) = self.waiting.values().next().map(|id| &self.seqs[id]) else {
            return false;
        };
        let prefill = head.tokens.len() - head.num_computed > 1;
        // More waiting than free slots: the slots about to free take the
        // rest of them, so a wait grows this step's group however many are
        // free. Otherwise only a nearly full engine waits (what arrives next
        // would take the few slots about to free one prefill step each).
        let slot_limited = self.waiting.len() > free;
        if wait == 0
            || self.admission_waited >= wait
            || free == 0
            || (!slot_limited && free * 4 >= max)
        {
            return false;
        }
        let running = || self.running.iter().map(|id| &self.seqs[id]);
        if !prefill {
            // A parked victim resumes in a decode row, no prefill step; but
            // while work that outranks it still runs, the slot is most
            // likely about to be taken by a prompt of that work, which would
            // preempt it again at once and, outranking it, prefill alone
            // instead of joining the next admissions. (A remotely prefilled
            // sequence goes at once.)
            return self.cfg.policy == SchedulingPolicy::Priority
                && head.preemption.count > 0
                && running().any(|s| s.priority > head.priority);
        }
        let prefilling = plan
            .sched
            .iter()
            .any(|(id, _)| self.seqs[id].pending_prefill() > 0);
        let above_all = self.cfg.policy == SchedulingPolicy::Priority
            && running().all(|s| s.priority < head.priority);
        let slot_frees_soon = running().any(|s| {
            s.sampling
                .max_tokens
                .is_some_and(|m| s.num_generated() + wait >= m)
        });
        !prefilling && !above_all && slot_frees_soon
    }

    /// A waiting sequence not admitted after all gives back the cached
    /// prefix this step took references on.
    fn give_back_prefix(&mut self, id: SeqId) {
        self.kv.free(id);
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.num_computed = 0;
        }
    }

    /// The step's batch: each scheduled sequence's new tokens, positions
    /// and block table.
    fn build_batch(&self, mut plan: Plan) -> ScheduledStep {
        let bs = self.kv.block_size();
        let mut active = 0;
        for &(id, n) in &plan.sched {
            let seq = &self.seqs[&id];
            let end = seq.num_computed + n;
            active += end;
            let needs_logits = end == seq.tokens.len();
            plan.step.seqs.push(ScheduledSeq {
                seq_id: id,
                num_new_tokens: n,
                needs_logits,
            });
            plan.step.batch.seqs.push(SeqChunk {
                tokens: seq.tokens[seq.num_computed..end].to_vec(),
                start_pos: seq.num_computed,
                block_table: self.kv.block_table(id).to_vec(),
                needs_logits,
            });
        }
        plan.step.batch.active_kv_tokens = active;
        plan.step.batch.total_kv_tokens = self.kv.num_blocks() * bs;
        plan.step
    }

    /// Commits a step's computed tokens, takes each finishing row's next
    /// token (sampled from logits, or given by the backend), checks stop
    /// conditions and frees finished sequences.
    pub fn update(
        &mut self,
        step: &ScheduledStep,
        out: ForwardOutput,
    ) -> Result<Vec<StepOutput>, EngineError> {
        let rows = step.seqs.iter().filter(|s| s.needs_logits).count();
        let actual = match &out {
            ForwardOutput::Tokens(t) => t.len(),
            ForwardOutput::Logits { vocab_size, data } => {
                if *vocab_size == 0 {
                    0
                } else {
                    data.len() / vocab_size
                }
            }
        };
        if actual != rows {
            return Err(EngineError::BackendRows {
                expected: rows,
                actual,
            });
        }
        let mut outputs = Vec::with_capacity(rows);
        let mut next_row = 0;
        for s in &step.seqs {
            // Rows follow the batch order of sequences that need logits.
            let row = next_row;
            if s.needs_logits {
                next_row += 1;
            }
            let Some(seq) = self.seqs.get_mut(&s.seq_id) else {
                continue; // aborted since `schedule`: its row is skipped
            };
            self.recomputed_tokens += seq.commit_computed(s.num_new_tokens) as u64;
            self.kv
                .cache_full_blocks(s.seq_id, seq.hashes.hashes(), seq.num_computed);
            if !s.needs_logits {
                continue;
            }
            let mask = self.take_mask(s.seq_id);
            let Some(seq) = self.seqs.get_mut(&s.seq_id) else {
                continue;
            };
            let allowed = match mask {
                Some(Ok(allowed)) => Some(allowed),
                Some(Err(e)) => {
                    tracing::warn!(seq = s.seq_id, error = %e, "grammar failed; the request ends");
                    None
                }
                None => None,
            };
            let grammar_failed =
                seq.constrained && allowed.is_none() && matches!(out, ForwardOutput::Logits { .. });
            let (token, logprobs) = match &out {
                // A backend that picks its tokens (the mocker) samples
                // nothing: workers give it no grammar.
                ForwardOutput::Tokens(t) => (t[row], None),
                ForwardOutput::Logits { vocab_size, data } => {
                    let logits = &data[row * vocab_size..(row + 1) * vocab_size];
                    let ctx = SampleContext {
                        history: &seq.tokens,
                        num_generated: seq.num_generated(),
                        eos_token_ids: &self.eos_token_ids,
                        allowed: allowed.as_ref(),
                    };
                    let sampled = seq.sampler.sample(logits, &seq.sampling, ctx);
                    (sampled.token, sampled.logprobs)
                }
            };
            let rejected = match (&allowed, seq.constraint.as_mut(), &out) {
                (Some(_), Some(c), ForwardOutput::Logits { .. }) => c.accept(token).is_err(),
                _ => false,
            };
            seq.push_token(token);
            let reason = if grammar_failed || rejected {
                Some(FinishReason::Error)
            } else {
                stop_reason(seq, token, &self.eos_token_ids, self.max_len)
            };
            let finished = reason.map(|reason| Finished {
                reason,
                usage: seq.usage(),
            });
            outputs.push(StepOutput {
                seq_id: s.seq_id,
                token,
                logprobs,
                finished,
                preemption: seq.preemption,
            });
            if finished.is_some() {
                self.finish(s.seq_id);
            }
        }
        Ok(outputs)
    }

    /// The backend failed on `step`: every sequence in it ends with
    /// [`FinishReason::Error`] and is freed.
    pub fn fail_step(&mut self, step: &ScheduledStep) -> Vec<(SeqId, Finished)> {
        step.seqs
            .iter()
            .filter_map(|s| {
                let usage = self.abort(s.seq_id)?;
                Some((
                    s.seq_id,
                    Finished {
                        reason: FinishReason::Error,
                        usage,
                    },
                ))
            })
            .collect()
    }

    /// Refuses every sequence still waiting for its first token at `now`
    /// past its [`Request::first_token_by`]: it ends with
    /// [`FinishReason::TtftTargetMissed`] and its blocks are freed (what it
    /// computed stays in the prefix cache, for a retry). A sequence that
    /// is running (its prefill underway), has produced a token, or waits
    /// on a transfer (reserved) goes on.
    pub fn refuse_late_starts(&mut self, now: std::time::Instant) -> Vec<(SeqId, Finished)> {
        let late: Vec<SeqId> = self
            .waiting
            .values()
            .copied()
            .filter(|id| {
                self.seqs.get(id).is_some_and(|s| {
                    s.num_generated() == 0 && s.first_token_by.is_some_and(|by| by <= now)
                })
            })
            .collect();
        late.into_iter()
            .filter_map(|id| {
                let usage = self.abort(id)?;
                Some((
                    id,
                    Finished {
                        reason: FinishReason::TtftTargetMissed,
                        usage,
                    },
                ))
            })
            .collect()
    }

    /// Checks the scheduler's and the pool's invariants (for tests).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.kv.check_invariants()?;
        if self.running.len() > self.cfg.max_num_seqs {
            return Err(format!("{} running > max_num_seqs", self.running.len()));
        }
        for id in &self.running {
            if self.seqs.get(id).map(|s| s.status) != Some(Status::Running) {
                return Err(format!("running {id} is not in running state"));
            }
        }
        for (key, id) in &self.waiting {
            let seq = self.seqs.get(id).ok_or(format!("waiting {id} unknown"))?;
            if seq.status != Status::Waiting || self.key(seq) != *key {
                return Err(format!("waiting {id} has the wrong state or key"));
            }
        }
        let bs = self.kv.block_size();
        for id in self.running.iter().chain(self.waiting.values()) {
            let seq = &self.seqs[id];
            let held = self.kv.block_table(*id).len() * bs;
            // A parked (or remote-committed) waiting sequence keeps what it
            // computed; one without blocks starts over from the cache.
            if seq.num_computed > held
                || (seq.status == Status::Waiting
                    && !self.kv.has_table(*id)
                    && seq.num_computed != 0)
            {
                return Err(format!(
                    "{id}: {} tokens computed, blocks for {held}",
                    seq.num_computed
                ));
            }
        }
        let listed = self.running.len() + self.waiting.len();
        let active = self
            .seqs
            .values()
            .filter(|s| matches!(s.status, Status::Running | Status::Waiting));
        if active.count() != listed {
            return Err("a sequence is in no queue or in two".into());
        }
        Ok(())
    }

    fn finish(&mut self, id: SeqId) {
        self.running.retain(|&r| r != id);
        let hold = self.seqs.get(&id).is_some_and(|s| s.hold_on_finish);
        if hold {
            if let Some(seq) = self.seqs.get_mut(&id) {
                seq.status = Status::Held;
            }
        } else {
            self.seqs.remove(&id);
            self.kv.free(id);
        }
    }

    fn bump_arrival(&mut self) -> u64 {
        let a = self.next_arrival;
        self.next_arrival += 1;
        a
    }

    fn key(&self, seq: &Sequence) -> (i64, u64) {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => (0, seq.arrival),
            SchedulingPolicy::Priority => (-i64::from(seq.priority), seq.arrival),
        }
    }

    /// The running sequence to preempt for `room`, or `None` when none should
    /// give way (see the module docs for the rule).
    fn pick_victim(&self, room: Room) -> Option<SeqId> {
        let by_priority = self.cfg.policy == SchedulingPolicy::Priority;
        let (below, requester, deficit) = match room {
            Room::Slot { for_priority } => (Some(for_priority), None, None),
            Room::ForRunning { requester, deficit } => (None, Some(requester), Some(deficit)),
            Room::ForWaiting {
                for_priority,
                deficit,
            } => (Some(for_priority), None, Some(deficit)),
        };
        // In admission order; FCFS treats every sequence as one priority.
        let level = |s: &Sequence| if by_priority { s.priority } else { 0 };
        let eligible: Vec<(SeqId, &Sequence)> = self
            .running
            .iter()
            .map(|&id| (id, &self.seqs[&id]))
            .filter(|(_, s)| !by_priority || below.is_none_or(|p| s.priority < p))
            .collect();
        let lowest = eligible.iter().map(|(_, s)| level(s)).min()?;
        let at_lowest = eligible.into_iter().filter(|(_, s)| level(s) == lowest);
        // One that finishes within the next step frees its slot and blocks
        // then anyway: it gives way only to its own need.
        let candidates: Vec<(SeqId, &Sequence)> = at_lowest
            .filter(|&(id, s)| Some(id) == requester || !self.finishes_next_step(s))
            .collect();
        if candidates.is_empty() {
            // All of them finish next step: the slot, the waiting sequence
            // or the running requester (above them, or it would be among
            // them) waits a step instead.
            return None;
        }
        if !by_priority {
            return candidates.last().map(|&(id, _)| id);
        }
        // Blocks the victim would give back; the requester itself needs none
        // once preempted.
        let freed = |id: SeqId| {
            if Some(id) == requester {
                usize::MAX
            } else {
                self.kv.exclusive_blocks(id)
            }
        };
        let sufficient = candidates
            .iter()
            .filter(|&&(id, _)| deficit.is_none_or(|d| freed(id) >= d))
            .min_by_key(|&&(id, s)| (self.recompute_cost(id, s), Reverse(s.arrival)));
        let victim = match sufficient {
            Some(&(id, _)) => id,
            // None frees enough alone: the one that frees the most.
            None => candidates
                .iter()
                .max_by_key(|&&(id, s)| (freed(id), Reverse(self.recompute_cost(id, s)), s.arrival))
                .map(|&(id, _)| id)?,
        };
        Some(victim)
    }

    /// Tokens `seq` would compute again if its blocks went back to the pool
    /// now and nothing were evicted: its computed tokens past the full blocks
    /// the prefix cache holds for it (all of them without prefix caching).
    fn recompute_cost(&self, id: SeqId, seq: &Sequence) -> usize {
        let kept = self.kv.cached_blocks_of(id) * self.kv.block_size();
        seq.num_computed.saturating_sub(kept)
    }

    /// Whether `seq` produces its last token in the next step: what it has
    /// left to compute fits one step and the token it then gets ends it.
    fn finishes_next_step(&self, seq: &Sequence) -> bool {
        let pending = seq.tokens.len() - seq.num_computed;
        let last = seq
            .sampling
            .max_tokens
            .is_some_and(|m| seq.num_generated() + 1 >= m)
            || seq.tokens.len() + 1 >= self.max_len;
        pending <= self.cfg.max_num_batched_tokens && last
    }

    /// Blocks `id` lacks to reach `target` tokens beyond those free.
    fn deficit(&self, id: SeqId, target: usize) -> usize {
        self.kv
            .blocks_needed(id, target)
            .saturating_sub(self.kv.num_free())
    }

    /// Gives the blocks of one parked sequence back to the pool: the waiting
    /// sequence holding blocks that is admitted last (never `except`). Its
    /// full blocks stay cached; it recomputes from the cache when admitted.
    /// Returns whether one was released. (A backend with a host-memory tier
    /// would copy the blocks out here and back on admission instead of
    /// recomputing; none has one yet.)
    fn release_parked(&mut self, except: Option<SeqId>) -> bool {
        let Some(w) = self
            .waiting
            .values()
            .rev()
            .copied()
            .find(|&w| Some(w) != except && self.kv.has_table(w))
        else {
            return false;
        };
        self.kv.free(w);
        let seq = self.seqs.get_mut(&w).expect("waiting ids are known");
        seq.num_computed = 0;
        seq.prefill_end = seq.tokens.len();
        tracing::debug!(seq = w, "parked blocks released");
        true
    }

    /// Whether preempting every running sequence below `prio` could free
    /// enough blocks for `id` to reach `target` tokens.
    fn preemption_could_fit(&self, id: SeqId, target: usize, prio: i32) -> bool {
        let needed = self.kv.blocks_needed(id, target);
        let reclaimable: usize = self
            .running
            .iter()
            .filter(|r| self.seqs[r].priority < prio)
            .map(|r| self.kv.exclusive_blocks(*r))
            .sum();
        needed <= self.kv.num_free() + reclaimable
    }

    /// Moves running `id` back to waiting. With `keep_blocks` it parks its
    /// blocks and computed tokens; otherwise they go back to the pool (full
    /// blocks stay cached) and it recomputes from the cache when admitted.
    fn preempt(&mut self, id: SeqId, keep_blocks: bool) {
        self.running.retain(|&r| r != id);
        if !keep_blocks {
            self.kv.free(id);
        }
        let renew = self.cfg.policy == SchedulingPolicy::Priority && !self.cfg.keep_preempted_order;
        let arrival = if renew {
            Some(self.bump_arrival())
        } else {
            None
        };
        let seq = self
            .seqs
            .get_mut(&id)
            .expect("preempted sequence is running");
        if !keep_blocks {
            seq.num_computed = 0;
            seq.prefill_end = seq.tokens.len();
        }
        seq.status = Status::Waiting;
        seq.preemption.count += 1;
        if let Some(a) = arrival {
            seq.arrival = a;
        }
        let key = self.key(&self.seqs[&id]);
        self.waiting.insert(key, id);
        self.preemptions += 1;
        tracing::debug!(seq = id, keep_blocks, "preempted");
    }
}

/// What a preemption must make room for.
#[derive(Debug, Clone, Copy)]
enum Room {
    /// A slot (`max_num_seqs`) for a waiting sequence of `for_priority`:
    /// only strictly lower priorities give way.
    Slot { for_priority: i32 },
    /// `deficit` more free blocks for running `requester`: the lowest
    /// running priority gives way, the requester included.
    ForRunning { requester: SeqId, deficit: usize },
    /// `deficit` more free blocks for a waiting sequence of `for_priority`:
    /// only strictly lower priorities give way.
    ForWaiting { for_priority: i32, deficit: usize },
}

/// Which running sequences' rows a pass of [`Scheduler::schedule_running`]
/// schedules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rows {
    All,
    /// All but the decode rows that may sit out a step for prompts of
    /// priority `up_to` ([`Sequence::may_stall_for`]): those still
    /// prefilling (a prompt, or a recompute after preemption), and those
    /// decoding above that priority or to a TPOT target.
    Prefill {
        up_to: i32,
    },
    /// The decode rows the `Prefill` pass left out.
    Decode {
        up_to: i32,
    },
}

/// A step being planned: the tokens still in its budget, the sequences
/// scheduled so far with their new-token counts, and the step's record.
struct Plan {
    budget: usize,
    sched: Vec<(SeqId, usize)>,
    step: ScheduledStep,
}

/// A preemption during the admission pass may have taken the step's long
/// prefill out of it: the pass starts over from the first waiting prompt,
/// and the prompts it passed over for that prefill are looked at again
/// (they stay passed over unless admitted now: prompts behind them went
/// ahead of them this step already).
fn restart_pass(after: &mut Option<(i64, u64)>) {
    *after = None;
}

/// Removes `id` from this step's schedule, returning the tokens it had.
fn unschedule(sched: &mut Vec<(SeqId, usize)>, id: SeqId) -> usize {
    match sched.iter().position(|(s, _)| *s == id) {
        Some(pos) => sched.remove(pos).1,
        None => 0,
    }
}

fn stop_reason(seq: &Sequence, token: u32, eos: &[u32], max_len: usize) -> Option<FinishReason> {
    let generated = seq.num_generated();
    let p = &seq.sampling;
    if generated >= p.min_tokens
        && ((!p.ignore_eos && eos.contains(&token)) || p.stop_token_ids.contains(&token))
    {
        return Some(FinishReason::Stop);
    }
    if p.max_tokens.is_some_and(|m| generated >= m) || seq.tokens.len() >= max_len {
        return Some(FinishReason::Length);
    }
    None
}

#[cfg(test)]
mod tests;
