//! The engine thread: drain commands, drop sequences whose consumer left,
//! schedule a step, run the backend, hand tokens to their streams, publish
//! load. Blocks on the command channel when there is nothing to run.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};

use super::{AbortOnDrop, Command, HeldBlocks, Output, PrefillOutput, RemoteSlot};
use crate::backend::{Backend, ForwardBatch, ForwardOutput, validate_seq};
use crate::config::BalanceGroup;
use crate::error::EngineError;
use crate::kv::SeqId;
use crate::kv::TierOp;
use crate::scheduler::{FinishReason, Finished, LoadStats, ScheduledStep, Scheduler, StepOutput};

/// How long a stalled engine (work queued, nothing schedulable: blocks held
/// elsewhere, or balance holding admission) waits before trying again.
const STALL_POLL: Duration = Duration::from_millis(2);

/// How often an idle rank of a lockstep group looks for busy peers.
const LOCKSTEP_IDLE_POLL: Duration = Duration::from_millis(1);

pub(super) struct EngineCore {
    backend: Box<dyn Backend>,
    sched: Scheduler,
    /// For the guards the engine hands out.
    tx: std_mpsc::Sender<Command>,
    load_tx: watch::Sender<LoadStats>,
    balance: Option<(Arc<BalanceGroup>, usize)>,
    streams: HashMap<SeqId, mpsc::UnboundedSender<Output>>,
    prefills: HashMap<SeqId, oneshot::Sender<Result<PrefillOutput, EngineError>>>,
    /// Reserved slot → blocks the sender skips (not writable).
    reserved: HashMap<SeqId, usize>,
    /// Prefixes held for a peer to read (no sequence of their own).
    held_prefixes: std::collections::HashSet<SeqId>,
    /// Blocks restored from the second tier outside a step (reservations,
    /// holds), for the next step's timing model.
    restored_pending: usize,
    shutting_down: bool,
    /// Mean duration of a decode step (every row one token: no prompt
    /// tokens), in µs (an exponential average; 0 before the first). What a
    /// request's output costs per token: prefill steps, the longest at a
    /// burst's start, would make a cold mesh predict waits many times too
    /// long (`step_time_us` in the load report).
    step_us: f64,
    /// What a step's prompt tokens cost beyond the decode step they ride
    /// with, if any, as a fixed part per step and a part per token (fitted
    /// over recent steps with prompt tokens): with [`Self::step_us`] and
    /// the scheduler's prefill-first state, what a router predicts a
    /// prompt's time to first token from.
    prefill_fit: LineFit,
    /// A decode step's time against its batch size (rows), fitted over
    /// recent decode steps: what a router predicts a request's time per
    /// output token from, with it in the batch.
    decode_fit: LineFit,
}

/// Weight of the newest step in [`EngineCore::step_us`] and
/// [`LineFit`].
const STEP_EWMA: f64 = 0.2;

/// A least-squares line `µs = fixed + per_unit × units` over recent steps
/// (units: a step's prompt tokens, or its decode rows), each older step
/// weighing [`STEP_EWMA`] less (the sums decay, so the line follows a
/// worker whose speed changes). One size seen so far gives no slope: the
/// mean cost per unit, no fixed part.
#[derive(Debug, Default, Clone, Copy)]
struct LineFit {
    w: f64,
    n: f64,
    nn: f64,
    y: f64,
    ny: f64,
}

impl LineFit {
    fn add(&mut self, tokens: f64, extra_us: f64) {
        let keep = 1.0 - STEP_EWMA;
        self.w = self.w * keep + 1.0;
        self.n = self.n * keep + tokens;
        self.nn = self.nn * keep + tokens * tokens;
        self.y = self.y * keep + extra_us;
        self.ny = self.ny * keep + tokens * extra_us;
    }

    /// (fixed µs per step, µs per token), both at least 0; (0, 0) before
    /// the first step.
    fn line(&self) -> (f64, f64) {
        if self.n <= 0.0 {
            return (0.0, 0.0);
        }
        let var = self.w * self.nn - self.n * self.n;
        // Sizes that barely vary: no slope to read (relative to their spread).
        if var <= 1e-9 * self.w * self.nn {
            return (0.0, (self.y / self.n).max(0.0));
        }
        let slope = (self.w * self.ny - self.n * self.y) / var;
        if slope < 0.0 {
            return (0.0, (self.y / self.n).max(0.0));
        }
        let fixed = (self.y - slope * self.n) / self.w;
        if fixed < 0.0 {
            // Through the origin.
            return (0.0, (self.ny / self.nn).max(0.0));
        }
        (fixed, slope)
    }
}

/// `mean` moved towards `sample` by [`STEP_EWMA`]; the first sample as is.
fn ewma(mean: f64, sample: f64) -> f64 {
    if mean == 0.0 {
        sample
    } else {
        mean + STEP_EWMA * (sample - mean)
    }
}

impl EngineCore {
    pub(super) fn new(
        backend: Box<dyn Backend>,
        mut sched: Scheduler,
        tx: std_mpsc::Sender<Command>,
        load_tx: watch::Sender<LoadStats>,
        balance: Option<(Arc<BalanceGroup>, usize)>,
    ) -> Self {
        sched.compute_masks_on(backend.thread_pool());
        Self {
            backend,
            sched,
            tx,
            load_tx,
            balance,
            streams: HashMap::new(),
            prefills: HashMap::new(),
            reserved: HashMap::new(),
            held_prefixes: Default::default(),
            restored_pending: 0,
            shutting_down: false,
            step_us: 0.0,
            prefill_fit: LineFit::default(),
            decode_fit: LineFit::default(),
        }
    }

    pub(super) fn run(mut self, rx: std_mpsc::Receiver<Command>) {
        let lockstep = self
            .balance
            .as_ref()
            .filter(|(g, _)| g.is_lockstep())
            .cloned();
        let mut stalled = false;
        while !self.shutting_down {
            let idle = !self.sched.has_unfinished();
            let waited = if let Some((group, _)) = &lockstep {
                // In lockstep an idle rank polls, so it can join the steps
                // of busy peers.
                if idle && !group.any_busy() {
                    self.publish_balance();
                    rx.recv_timeout(LOCKSTEP_IDLE_POLL)
                } else {
                    Err(std_mpsc::RecvTimeoutError::Timeout)
                }
            } else if idle {
                self.publish_balance();
                rx.recv()
                    .map_err(|_| std_mpsc::RecvTimeoutError::Disconnected)
            } else if stalled {
                rx.recv_timeout(STALL_POLL)
            } else {
                Err(std_mpsc::RecvTimeoutError::Timeout)
            };
            match waited {
                Ok(cmd) => self.handle(cmd),
                Err(std_mpsc::RecvTimeoutError::Disconnected) => break,
                Err(std_mpsc::RecvTimeoutError::Timeout) => {}
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(std_mpsc::TryRecvError::Empty) => break,
                    Err(std_mpsc::TryRecvError::Disconnected) => {
                        self.shutting_down = true;
                        break;
                    }
                }
            }
            if self.shutting_down {
                break;
            }
            self.drop_abandoned();
            self.publish_balance();
            match &lockstep {
                Some((group, rank)) => {
                    if group.should_step(*rank, self.sched.has_unfinished()) {
                        self.step();
                        self.publish_load();
                        // The count this step left, before the barrier: the
                        // rank that reaches it last starts the next step at
                        // once and must not read a peer's count from before
                        // that peer's admissions (it would admit while the
                        // peer is full).
                        self.publish_balance();
                        group.end_step(*rank);
                    }
                }
                None => {
                    stalled = !self.step();
                    self.publish_load();
                }
            }
        }
        if let Some((group, rank)) = &lockstep {
            group.leave(*rank);
        }
        self.abort_all();
    }

    /// Runs one step; false if nothing could be scheduled.
    ///
    /// One sequence's fault ends that sequence only: a chunk no backend
    /// can compute (a token outside the vocabulary, a block table that does
    /// not cover its positions) is failed before the step, and when the
    /// backend fails a batch of several, each sequence is computed alone to
    /// find the ones it fails on; the rest of the batch goes on. Only a
    /// failure of every sequence fails them all.
    fn step(&mut self) -> bool {
        if !self.sched.has_unfinished() {
            return true;
        }
        let late = self.sched.refuse_late_starts(std::time::Instant::now());
        if !late.is_empty() {
            tracing::debug!(
                refused = late.len(),
                "requests still waiting to start when their first token was due"
            );
            for (id, finished) in late {
                self.end_stream(id, finished);
                if let Some(reply) = self.prefills.remove(&id) {
                    let _ = reply.send(Err(EngineError::FirstTokenLate));
                }
            }
            self.publish_load();
        }
        let mut step = self.sched.schedule();
        step.batch.restored_blocks =
            self.replay_tier_ops() + std::mem::take(&mut self.restored_pending);
        if step.is_empty() {
            return false;
        }
        let layout = self.backend.kv_layout();
        let (vocab, blocks) = (self.backend.vocab_size(), self.backend.num_blocks());
        let invalid: Vec<(usize, EngineError)> = step
            .batch
            .seqs
            .iter()
            .enumerate()
            .filter_map(|(i, seq)| {
                validate_seq(i, seq, vocab, layout.block_size, blocks)
                    .err()
                    .map(|e| (i, e))
            })
            .collect();
        self.fail_alone(&mut step, invalid);
        if step.is_empty() {
            self.publish_load();
            return true;
        }
        let decode_only = step.seqs.iter().all(|s| s.num_new_tokens == 1);
        let decodes = step.seqs.iter().any(|s| s.num_new_tokens == 1);
        // Prompt tokens in the step (rows with more than one new token).
        let prompt_tokens: usize = step
            .seqs
            .iter()
            .map(|s| s.num_new_tokens)
            .filter(|&n| n > 1)
            .sum();
        let started = std::time::Instant::now();
        let result = self
            .forward_isolating(&mut step)
            .and_then(|out| self.sched.update(&step, out));
        let us = started.elapsed().as_secs_f64() * 1e6;
        if decode_only {
            self.step_us = ewma(self.step_us, us);
            self.decode_fit.add(step.seqs.len() as f64, us);
        } else if prompt_tokens > 0 {
            // What the step took beyond the decode step it carried, if any
            // (prefill first leaves the rows out of most prompt steps).
            let decode_us = if decodes { self.step_us } else { 0.0 };
            self.prefill_fit
                .add(prompt_tokens as f64, (us - decode_us).max(0.0));
        }
        // Load first, so whoever sees an output also sees the state after it.
        self.publish_load();
        match result {
            Ok(outputs) => {
                for out in outputs {
                    self.dispatch(out);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, backend = self.backend.name(), "engine step failed");
                let failed = self.sched.fail_step(&step);
                self.publish_load();
                for (id, finished) in failed {
                    self.finish_with(id, finished, &e);
                }
            }
        }
        true
    }

    /// Runs the backend on `step`; if it fails on a batch of several
    /// sequences, computes each alone (a step's K/V writes are idempotent:
    /// the same tokens at the same positions), fails those it still fails
    /// on, drops them from `step` and returns the others' output in batch
    /// order. Fails like the backend when every sequence fails.
    fn forward_isolating(
        &mut self,
        step: &mut ScheduledStep,
    ) -> Result<ForwardOutput, EngineError> {
        let err = match self.backend.forward(&step.batch) {
            Ok(out) => return Ok(out),
            Err(e) if step.seqs.len() > 1 => e,
            Err(e) => return Err(e),
        };
        tracing::warn!(error = %err, seqs = step.seqs.len(), backend = self.backend.name(), "engine step failed; computing its sequences one by one to find the cause");
        let mut outputs = Vec::with_capacity(step.seqs.len());
        let mut failed = Vec::new();
        for (i, seq) in step.batch.seqs.iter().enumerate() {
            let alone = ForwardBatch {
                seqs: vec![seq.clone()],
                active_kv_tokens: step.batch.active_kv_tokens,
                total_kv_tokens: step.batch.total_kv_tokens,
                restored_blocks: 0,
            };
            match self.backend.forward(&alone) {
                Ok(out) => outputs.push(out),
                Err(e) => failed.push((i, e)),
            }
        }
        if outputs.is_empty() {
            return Err(err);
        }
        self.fail_alone(step, failed);
        merge_outputs(outputs)
    }

    /// Ends each `(batch index, error)` sequence of `step` with an error,
    /// frees it and removes it from the step.
    fn fail_alone(&mut self, step: &mut ScheduledStep, failed: Vec<(usize, EngineError)>) {
        for (i, e) in failed.into_iter().rev() {
            let id = step.seqs.remove(i).seq_id;
            step.batch.seqs.remove(i);
            tracing::warn!(seq = id, error = %e, "one sequence failed its step; the rest of the batch goes on");
            if let Some(usage) = self.sched.abort(id) {
                let finished = Finished {
                    reason: FinishReason::Error,
                    usage,
                };
                self.finish_with(id, finished, &e);
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate { id, req, tx } => match self.sched.add(id, req) {
                Ok(()) => {
                    self.streams.insert(id, tx);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "request rejected by the scheduler");
                    let usage = Default::default();
                    let fin = Finished {
                        reason: FinishReason::Error,
                        usage,
                    };
                    let _ = tx.send(Output {
                        token_ids: vec![],
                        logprobs: vec![],
                        finished: Some(fin),
                        preemption: Default::default(),
                    });
                }
            },
            Command::Prefill { id, req, reply } => match self.sched.add_prefill_only(id, req) {
                Ok(()) => {
                    self.prefills.insert(id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            },
            Command::Reserve { id, req, reply } => {
                let res = self.sched.reserve_remote(id, req);
                let res = self.reserved_slot(id, res);
                self.publish_load();
                // A dropped receiver drops the slot, whose guard releases it.
                let _ = reply.send(res);
            }
            Command::ReserveImport {
                id,
                req,
                blocks,
                reply,
            } => {
                let res = self.sched.reserve_import(id, req, blocks);
                let res = self.reserved_slot(id, res);
                let _ = reply.send(res);
            }
            Command::CommitImport { id, written, reply } => {
                self.reserved.remove(&id);
                let res = self.sched.commit_import(id, written);
                if res.is_err() {
                    self.sched.abort(id);
                }
                let _ = reply.send(res);
            }
            Command::HoldPrefix {
                id,
                prompt,
                max_blocks,
                reply,
            } => {
                let block_ids = self.sched.hold_prefix(id, &prompt, max_blocks);
                // Restored blocks hold their bytes before a peer reads them.
                self.restored_pending += self.replay_tier_ops();
                self.held_prefixes.insert(id);
                let num_tokens = block_ids.len() * self.sched.block_size();
                // A dropped receiver drops the blocks, whose guard releases them.
                let _ = reply.send(HeldBlocks {
                    block_ids,
                    num_tokens,
                    _release: AbortOnDrop::new(id, self.tx.clone()),
                });
            }
            Command::WriteBlocks { id, blocks, reply } => {
                let blocks = blocks.iter().map(|(b, d)| (*b, d.as_slice()));
                let _ = reply.send(self.write_blocks(id, blocks));
            }
            Command::ReadBlocks { ids, reply } => {
                let bytes = self.backend.kv_layout().block_bytes();
                let res = ids
                    .iter()
                    .map(|&id| {
                        let mut buf = vec![0u8; bytes];
                        self.backend.read_block(id, &mut buf).map(|()| buf)
                    })
                    .collect();
                let _ = reply.send(res);
            }
            Command::Commit {
                id,
                first_token,
                logprobs,
                tx,
            } => {
                self.reserved.remove(&id);
                match self.sched.commit_remote(id, first_token, logprobs) {
                    Ok(out) => {
                        self.streams.insert(id, tx);
                        self.publish_load();
                        self.dispatch(out);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, seq = id, "commit of a remote slot failed");
                        self.sched.abort(id);
                        let fin = Finished {
                            reason: FinishReason::Error,
                            usage: Default::default(),
                        };
                        let _ = tx.send(Output {
                            token_ids: vec![],
                            logprobs: vec![],
                            finished: Some(fin),
                            preemption: Default::default(),
                        });
                    }
                }
            }
            Command::Abort(id) => self.abort(id),
            Command::ClearPrefixCache => self.sched.clear_prefix_cache(),
            Command::Shutdown => self.shutting_down = true,
        }
        self.publish_load();
    }

    fn write_blocks<'a>(
        &mut self,
        id: SeqId,
        blocks: impl Iterator<Item = (u32, &'a [u8])> + Clone,
    ) -> Result<(), EngineError> {
        let skip = *self
            .reserved
            .get(&id)
            .ok_or(EngineError::UnknownSequence(id))?;
        let writable = &self.sched.block_table(id)[skip..];
        if let Some((bad, _)) = blocks.clone().find(|(b, _)| !writable.contains(b)) {
            return Err(EngineError::BlockNotReserved { seq: id, id: bad });
        }
        for (block, data) in blocks {
            self.backend.write_block(block, data)?;
        }
        Ok(())
    }

    fn dispatch(&mut self, out: StepOutput) {
        let id = out.seq_id;
        if let Some(tx) = self.streams.get(&id) {
            let msg = Output {
                token_ids: vec![out.token],
                logprobs: out.logprobs.into_iter().collect(),
                finished: out.finished,
                preemption: out.preemption,
            };
            let gone = tx.send(msg).is_err();
            if out.finished.is_some() {
                self.streams.remove(&id);
            } else if gone {
                self.abort(id);
            }
        } else if let Some(reply) = self.prefills.remove(&id) {
            let blocks = HeldBlocks {
                block_ids: self.sched.block_table(id).to_vec(),
                num_tokens: out.finished.map_or(0, |f| f.usage.prompt_tokens),
                _release: AbortOnDrop::new(id, self.tx.clone()),
            };
            let cached_tokens = out.finished.map_or(0, |f| f.usage.cached_tokens);
            // If the caller is gone, dropping the output releases the blocks.
            let _ = reply.send(Ok(PrefillOutput {
                first_token: out.token,
                logprobs: out.logprobs,
                cached_tokens,
                blocks,
            }));
        }
    }

    fn finish_with(&mut self, id: SeqId, finished: Finished, err: &EngineError) {
        self.end_stream(id, finished);
        if let Some(reply) = self.prefills.remove(&id) {
            let _ = reply.send(Err(EngineError::StepFailed(err.to_string())));
        }
    }

    /// Ends `id`'s stream, if it has one, with `finished` and no tokens.
    fn end_stream(&mut self, id: SeqId, finished: Finished) {
        if let Some(tx) = self.streams.remove(&id) {
            let _ = tx.send(Output {
                token_ids: vec![],
                logprobs: vec![],
                finished: Some(finished),
                preemption: finished.usage.preemption,
            });
        }
    }

    /// The handle of a slot the scheduler reserved (a remote prefill's or an
    /// import's), once the second tier's moves it caused are made: before
    /// a transport can write its blocks.
    fn reserved_slot(
        &mut self,
        id: SeqId,
        res: Result<crate::scheduler::RemoteReservation, EngineError>,
    ) -> Result<RemoteSlot, EngineError> {
        self.restored_pending += self.replay_tier_ops();
        res.map(|r| {
            self.reserved.insert(id, r.skip_blocks);
            RemoteSlot {
                id,
                block_ids: r.block_ids,
                skip_blocks: r.skip_blocks,
                cached_tokens: r.cached_tokens,
                release: AbortOnDrop::new(id, self.tx.clone()),
            }
        })
    }

    /// Moves block bytes between KV memory and the second tier as the
    /// cache's last calls decided, in order (see `kv::TierOp`), before
    /// anything else can touch the blocks; the blocks restored. A timing
    /// backend keeps no bytes. Blocks the second tier drops to make room
    /// are published as removed.
    fn replay_tier_ops(&mut self) -> usize {
        let ops = self.sched.kv_mut().take_tier_ops();
        if ops.is_empty() {
            return 0;
        }
        let mut restored = 0;
        let mut dropped = Vec::new();
        for op in ops {
            let backend = &mut self.backend;
            let Some(tier) = self.sched.kv_mut().tier_mut() else {
                continue;
            };
            match op {
                TierOp::Demote { hash, block, reuse } => {
                    // The bytes go straight from KV memory into the tier's
                    // slot (a timing backend's tier keeps none and never
                    // asks for them).
                    let (gone, read) =
                        tier.insert(hash, reuse, |slot| backend.read_block(block, slot));
                    if let Err(e) = read {
                        tracing::warn!(error = %e, block, "KV block not kept in the second tier");
                    }
                    dropped.extend(gone);
                }
                TierOp::Restore { block, slot } => {
                    restored += 1;
                    let Some(slot) = slot else { continue };
                    let written = match tier.bytes(slot) {
                        Some(data) => backend.write_block(block, data),
                        None => Ok(()),
                    };
                    tier.release(slot);
                    if let Err(e) = written {
                        // The block's hash is registered: a wrong restore
                        // would serve wrong K/V, so the cache forgets it.
                        tracing::error!(error = %e, block, "restoring a KV block from the second tier failed; clearing the prefix cache");
                        self.sched.clear_prefix_cache();
                    }
                }
            }
        }
        self.sched.kv_mut().tier_dropped(dropped);
        restored
    }

    fn abort(&mut self, id: SeqId) {
        self.sched.abort(id);
        self.streams.remove(&id);
        self.prefills.remove(&id);
        self.reserved.remove(&id);
        if self.held_prefixes.remove(&id) {
            self.sched.release_table(id);
        }
    }

    /// Aborts sequences whose stream or prefill caller is gone.
    fn drop_abandoned(&mut self) {
        let gone: Vec<SeqId> = self
            .streams
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .chain(
                self.prefills
                    .iter()
                    .filter(|(_, r)| r.is_closed())
                    .map(|(&id, _)| id),
            )
            .collect();
        for id in gone {
            self.abort(id);
        }
    }

    fn abort_all(&mut self) {
        for (id, tx) in std::mem::take(&mut self.streams) {
            let usage = self.sched.abort(id).unwrap_or_default();
            let fin = Finished {
                reason: FinishReason::Abort,
                usage,
            };
            let _ = tx.send(Output {
                token_ids: vec![],
                logprobs: vec![],
                finished: Some(fin),
                preemption: usage.preemption,
            });
        }
        for (id, reply) in std::mem::take(&mut self.prefills) {
            self.sched.abort(id);
            let _ = reply.send(Err(EngineError::Shutdown));
        }
        self.publish_load();
    }

    fn publish_balance(&mut self) {
        if let Some((group, rank)) = &self.balance {
            group.publish(*rank, self.sched.num_running());
            self.sched.set_peer_running_max(group.max_running());
        }
    }

    fn publish_load(&self) {
        let mut load = self.sched.load();
        load.step_time_us = self.step_us.round().min(f64::from(u32::MAX)) as u32;
        let (step_us, per_token_us) = self.prefill_fit.line();
        load.prefill_step_us = step_us.round().min(f64::from(u32::MAX)) as u32;
        load.prefill_ns_per_token = (per_token_us * 1e3).round().min(f64::from(u32::MAX)) as u32;
        let (base_us, per_seq_us) = self.decode_fit.line();
        load.decode_base_us = base_us.round().min(f64::from(u32::MAX)) as u32;
        load.decode_ns_per_seq = (per_seq_us * 1e3).round().min(f64::from(u32::MAX)) as u32;
        self.load_tx.send_replace(load);
    }
}

/// The outputs of sequences computed one by one, as one step's output in
/// their order.
fn merge_outputs(outputs: Vec<ForwardOutput>) -> Result<ForwardOutput, EngineError> {
    let mut tokens: Option<Vec<u32>> = None;
    let mut logits: Option<(usize, Vec<f32>)> = None;
    for out in outputs {
        match out {
            ForwardOutput::Tokens(t) => tokens.get_or_insert_with(Vec::new).extend(t),
            ForwardOutput::Logits { vocab_size, data } => {
                let (v, all) = logits.get_or_insert_with(|| (vocab_size, Vec::new()));
                if *v != vocab_size && !data.is_empty() {
                    return Err(EngineError::StepFailed(
                        "the backend returned rows of different widths for one step".into(),
                    ));
                }
                all.extend(data);
            }
        }
    }
    match (tokens, logits) {
        (Some(t), None) => Ok(ForwardOutput::Tokens(t)),
        (None, Some((vocab_size, data))) => Ok(ForwardOutput::Logits { vocab_size, data }),
        _ => Err(EngineError::StepFailed(
            "the backend returned outputs of different kinds for one step".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::LineFit;

    #[test]
    fn the_prefill_line_recovers_a_fixed_and_a_per_token_cost() {
        let mut fit = LineFit::default();
        assert_eq!(fit.line(), (0.0, 0.0));
        // 2 ms a step and 15 µs a token, chunks of varied sizes.
        for n in [100.0, 1024.0, 300.0, 1024.0, 40.0, 700.0] {
            fit.add(n, 2_000.0 + 15.0 * n);
        }
        let (fixed, per_token) = fit.line();
        assert!((fixed - 2_000.0).abs() < 1e-6, "{fixed}");
        assert!((per_token - 15.0).abs() < 1e-9, "{per_token}");
    }

    #[test]
    fn one_prompt_size_gives_the_mean_per_token_and_no_fixed_part() {
        let mut fit = LineFit::default();
        fit.add(512.0, 5_120.0);
        fit.add(512.0, 5_120.0);
        assert_eq!(fit.line(), (0.0, 10.0));
    }
}
