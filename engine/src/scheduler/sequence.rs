//! One request's life inside the scheduler: its tokens, how many of them are
//! in the KV cache (and the most that ever were, so work done twice after a
//! preemption is counted), its sampler, and the request-facing types
//! (request, finish reason, usage, preemption cost) the engine hands back.

use std::time::{Duration, Instant};

use sluice_tokens::BlockHashes;
use sluice_tokens::grammar::Constraint;

use crate::sampler::{PositionLogprobs, Sampler, SamplingParams};

/// A tokenized request as the engine takes it.
#[derive(Debug, Clone, Default)]
pub struct Request {
    /// Caller's id, for logs.
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Higher = more important (used by [`SchedulingPolicy::Priority`](crate::SchedulingPolicy)).
    pub priority: i32,
    /// The grammar its output must stay within (structured outputs, tool
    /// calls): every token outside it is masked before sampling.
    pub constraint: Option<Constraint>,
    /// When its first token is due (its TTFT target): a request still
    /// waiting to start then is refused ([`FinishReason::TtftTargetMissed`])
    /// rather than served late behind the work that kept it waiting.
    pub first_token_by: Option<Instant>,
    /// Its time per output token target: its decode row goes in every
    /// step, never left out for another prompt's prefill
    /// (`SchedulerConfig::prefill_first_steps`).
    pub tpot_target: Option<Duration>,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token id.
    Stop,
    /// `max_tokens` or the model/KV length limit.
    Length,
    /// Aborted by the caller (stream dropped) or by shutdown.
    Abort,
    /// The backend failed during the sequence's step.
    Error,
    /// Refused before its first token: still waiting to start when its
    /// [`Request::first_token_by`] passed. A refusal, like the queue's
    /// `ttft_target_missed`, not a failure.
    TtftTargetMissed,
}

/// What preemption has cost one request so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Preemption {
    /// Times the sequence was preempted.
    pub count: usize,
    /// Tokens whose K/V the sequence had computed once, lost, and computed
    /// again (after a preemption, or after its blocks were taken back while
    /// it waited).
    pub recomputed_tokens: usize,
}

/// Token accounting for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_tokens: usize,
    pub preemption: Preemption,
    /// Steps its admission waited for slots about to free, to share their
    /// prefill step (`SchedulerConfig::admission_wait_steps`).
    pub admission_held_steps: usize,
}

/// The end of a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub usage: Usage,
}

/// One token produced for one sequence in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    pub seq_id: u64,
    pub token: u32,
    pub logprobs: Option<PositionLogprobs>,
    /// Set when this token ends the sequence.
    pub finished: Option<Finished>,
    /// The sequence's preemptions and recomputed tokens up to this token.
    pub preemption: Preemption,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Status {
    Waiting,
    Running,
    /// Prefill-only sequence done; its prompt blocks stay held for reading.
    Held,
    /// Remote-prefill destination: blocks allocated, waiting for KV and the first token.
    Reserved,
}

#[derive(Debug)]
pub(crate) struct Sequence {
    pub(crate) tokens: Vec<u32>,
    pub(crate) prompt_len: usize,
    pub(crate) hashes: BlockHashes,
    /// Tokens whose K/V are in the cache.
    pub(crate) num_computed: usize,
    /// The most tokens ever computed (or taken from the cache): computing
    /// below it again is recompute.
    pub(crate) computed_high: usize,
    /// Tokens to (re)compute before the sequence decodes (for pending-prefill load).
    pub(crate) prefill_end: usize,
    pub(crate) sampling: SamplingParams,
    pub(crate) sampler: Sampler,
    pub(crate) priority: i32,
    /// Arrival order (kept or renewed on preemption, per config).
    pub(crate) arrival: u64,
    pub(crate) cached_tokens: Option<usize>,
    /// Steps its admission was held back by the admission wait.
    pub(crate) admission_held_steps: usize,
    pub(crate) status: Status,
    /// Prefill only: keep the blocks when the first token is out.
    pub(crate) hold_on_finish: bool,
    pub(crate) preemption: Preemption,
    /// Its grammar; `None` while its mask is being computed beside the
    /// forward pass (see [`crate::scheduler::Scheduler::schedule`]).
    pub(crate) constraint: Option<Constraint>,
    /// Whether it has a grammar at all.
    pub(crate) constrained: bool,
    /// See [`Request::first_token_by`].
    pub(crate) first_token_by: Option<Instant>,
    /// See [`Request::tpot_target`].
    pub(crate) tpot_target: Option<Duration>,
}

impl Sequence {
    pub(crate) fn new(req: Request, block_size: usize, arrival: u64, hold_on_finish: bool) -> Self {
        let mut hashes = BlockHashes::new(block_size);
        hashes.extend(&req.prompt);
        let prompt_len = req.prompt.len();
        Self {
            sampler: Sampler::new(req.sampling.seed),
            tokens: req.prompt,
            prompt_len,
            hashes,
            num_computed: 0,
            computed_high: 0,
            prefill_end: prompt_len,
            sampling: req.sampling,
            priority: req.priority,
            arrival,
            cached_tokens: None,
            admission_held_steps: 0,
            status: Status::Waiting,
            hold_on_finish,
            preemption: Preemption::default(),
            constrained: req.constraint.is_some(),
            constraint: req.constraint,
            first_token_by: req.first_token_by,
            tpot_target: req.tpot_target,
        }
    }

    pub(crate) fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    pub(crate) fn push_token(&mut self, token: u32) {
        self.tokens.push(token);
        self.hashes.extend(&[token]);
    }

    pub(crate) fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_len,
            completion_tokens: self.num_generated(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
            preemption: self.preemption,
            admission_held_steps: self.admission_held_steps,
        }
    }

    /// Commits `n` newly computed tokens; returns how many of them had been
    /// computed before (recompute).
    pub(crate) fn commit_computed(&mut self, n: usize) -> usize {
        let start = self.num_computed;
        self.num_computed += n;
        let again = self
            .computed_high
            .min(self.num_computed)
            .saturating_sub(start);
        self.computed_high = self.computed_high.max(self.num_computed);
        self.preemption.recomputed_tokens += again;
        again
    }

    /// Decoding with no TPOT target, at most `priority`: its row may sit
    /// out a step for the prefill of prompts of that priority
    /// (`SchedulerConfig::prefill_first_steps`).
    pub(crate) fn may_stall_for(&self, priority: i32) -> bool {
        self.pending_prefill() == 0 && self.tpot_target.is_none() && self.priority <= priority
    }

    /// Prompt (or recompute) tokens still to be computed before decoding.
    pub(crate) fn pending_prefill(&self) -> usize {
        self.prefill_end.saturating_sub(self.num_computed)
    }
}
