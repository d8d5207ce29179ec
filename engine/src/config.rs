//! The engine's knobs: scheduling policy and limits, KV cache shape, event
//! ring depth, EOS ids, data-parallel balance. Workers fill one
//! [`EngineConfig`] from their command line; nothing here parses flags.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::EngineError;

/// Which waiting request is admitted first and which running one is preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// Arrival order; under KV pressure the latest admitted is preempted.
    #[default]
    Fcfs,
    /// Higher `priority` first, FCFS within a priority; under KV pressure the
    /// lowest-priority running sequence (latest arrival among equals) is preempted.
    Priority,
}

impl FromStr for SchedulingPolicy {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            other => Err(EngineError::InvalidRequest(format!(
                "unknown scheduling policy {other:?} (expected fcfs or priority)"
            ))),
        }
    }
}

impl fmt::Display for SchedulingPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Fcfs => "fcfs",
            Self::Priority => "priority",
        })
    }
}

/// Limits and policy of the continuous-batching scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens computed per step, prefill chunks and decode tokens together.
    pub max_num_batched_tokens: usize,
    /// Prompt plus output tokens of one sequence.
    pub max_model_len: usize,
    pub policy: SchedulingPolicy,
    /// Split long prompts across steps (otherwise a prompt waits until it fits whole).
    pub enable_chunked_prefill: bool,
    /// Priority only: a waiting request may preempt a lower-priority running
    /// one when `max_num_seqs` (not KV blocks) is the limit (vLLM issue 40004).
    pub preempt_on_seq_limit: bool,
    /// Priority only: a preempted sequence keeps its original arrival order,
    /// ahead of later arrivals of its priority (vLLM issue 41951).
    pub keep_preempted_order: bool,
    /// Data-parallel balance: admit only while the largest running count
    /// across ranks is below `max_num_seqs - 1` (vLLM-Ascend patch 5212).
    pub balance_scheduling: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 2048,
            max_model_len: 4096,
            policy: SchedulingPolicy::Fcfs,
            enable_chunked_prefill: true,
            preempt_on_seq_limit: true,
            keep_preempted_order: true,
            balance_scheduling: false,
        }
    }
}

/// Everything an engine needs besides its backend.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Tokens per KV block; must equal the backend's layout.
    pub block_size: usize,
    /// KV blocks to manage; `None` = all the backend holds.
    pub num_blocks: Option<usize>,
    pub scheduler: SchedulerConfig,
    pub enable_prefix_caching: bool,
    /// KV events kept for replay to late subscribers.
    pub event_ring_capacity: usize,
    /// The model's end-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// Data-parallel balance group and this engine's rank in it (used when
    /// `scheduler.balance_scheduling` is on).
    pub balance_group: Option<(Arc<BalanceGroup>, usize)>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: None,
            scheduler: SchedulerConfig::default(),
            enable_prefix_caching: true,
            event_ring_capacity: 10_000,
            eos_token_ids: Vec::new(),
            balance_group: None,
        }
    }
}

impl EngineConfig {
    /// Rejects values the engine cannot run with, naming the field.
    pub fn validate(&self) -> Result<(), EngineError> {
        let bad = |m: &str| Err(EngineError::InvalidConfig(m.to_string()));
        let s = &self.scheduler;
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        if s.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if s.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be at least 1");
        }
        if s.max_model_len < 2 {
            return bad("max_model_len must be at least 2");
        }
        if !s.enable_chunked_prefill && s.max_num_batched_tokens < s.max_model_len {
            return bad("without chunked prefill, max_num_batched_tokens must be >= max_model_len");
        }
        if let Some((group, rank)) = &self.balance_group
            && *rank >= group.num_ranks()
        {
            return bad("balance_group rank is out of range");
        }
        Ok(())
    }
}

/// Running counts shared by the data-parallel ranks of one worker, for
/// balance scheduling: each rank publishes its count every step and reads the
/// largest. Counts lag by at most one step of the slowest rank.
#[derive(Debug)]
pub struct BalanceGroup {
    running: Vec<AtomicUsize>,
}

impl BalanceGroup {
    /// A group of `num_ranks` ranks, all at 0 running.
    pub fn new(num_ranks: usize) -> Arc<Self> {
        Arc::new(Self {
            running: (0..num_ranks).map(|_| AtomicUsize::new(0)).collect(),
        })
    }

    /// Ranks in the group.
    pub fn num_ranks(&self) -> usize {
        self.running.len()
    }

    /// Publishes `rank`'s running count.
    pub fn publish(&self, rank: usize, running: usize) {
        if let Some(slot) = self.running.get(rank) {
            slot.store(running, Ordering::Relaxed);
        }
    }

    /// The largest running count across ranks.
    pub fn max_running(&self) -> usize {
        self.running
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .max()
            .unwrap_or(0)
    }

    /// Every rank's running count, by rank.
    pub fn running_counts(&self) -> Vec<usize> {
        self.running
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect()
    }
}
