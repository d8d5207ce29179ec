//! The engine's knobs: scheduling policy and limits, KV cache shape, event
//! ring depth, EOS ids, data-parallel balance. Workers fill one
//! [`EngineConfig`] from their command line; nothing here parses flags.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::error::EngineError;

/// Which waiting request is admitted first and which running one is preempted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// Arrival order; under KV pressure the latest admitted is preempted.
    #[default]
    Fcfs,
    /// Higher `priority` first, FCFS within a priority; under pressure the
    /// cheapest sufficient running sequence of the lowest priority is
    /// preempted, keeping its computed KV (see [`crate::scheduler`]).
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
    /// With chunked prefill: a prefill chunk takes at most this many tokens
    /// until every other scheduled sequence and admissible waiting one has
    /// had its turn; what is left of the step's budget then tops the held
    /// chunks up. Prompts longer than this prefill one at a time, in order
    /// (vLLM's `max_long_partial_prefills` 1); shorter ones go next to
    /// them. A short prompt is not starved behind a long one's prefill, a
    /// long prefill alone still fills the step, and long ones are not
    /// interleaved. 0 = off (vLLM's `long_prefill_token_threshold`, made
    /// work-conserving).
    pub long_prefill_token_threshold: usize,
    /// Admissions share prefill steps: when more prompts wait than slots
    /// are free (or, with no more, fewer than a quarter of the slots are
    /// free), no running sequence is prefilling and a running one
    /// reaches its `max_tokens` within this many steps, waiting prompts that
    /// outrank no running sequence wait (at most this many steps in a row)
    /// to be admitted with the slots about to free, in one prefill step
    /// instead of one each. Each step with a prefill pays that prefill's
    /// fixed cost; this keeps slots that fell out of step with the others
    /// (after a preemption, or prompts admitted a step apart) from paying it
    /// alone ever after. 0 = off (vLLM's behaviour; TensorRT-LLM's
    /// `batch_wait_timeout_iters` is the like of it).
    pub admission_wait_steps: usize,
    /// Prefill first: while prompts wait or are mid-prefill, up to this
    /// many steps in a row leave the decoding sequences' rows out, so the
    /// prompts get the whole step and a step that does not also pay the
    /// decode rows' attention over their contexts (SGLang's default
    /// prefill priority; the mocker charges a mixed step the sum of both,
    /// as Dynamo's does). Each such step stalls every decoding sequence
    /// one step; after one, only a prefill in progress leaves them out
    /// again (prompts arriving meanwhile join the next mixed step
    /// together rather than each taking a prompt step). Rows above the
    /// prompts' priority or with a TPOT target never sit out, and a step
    /// that carries one carries every row (it pays for a decode pass
    /// anyway). Only while the
    /// free slots take every waiting sequence: an engine at capacity mixes
    /// every step, so the prompts that trickle into freed slots share
    /// steps instead of each paying a prompt step's fixed cost. 0 = off:
    /// every step carries every decode row (vLLM's v1).
    pub prefill_first_steps: usize,
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
            long_prefill_token_threshold: 0,
            admission_wait_steps: 0,
            prefill_first_steps: 0,
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
    /// Compiles the grammars of structured outputs for this model's
    /// vocabulary; `None`: requests with one are refused.
    pub grammars: Option<sluice_tokens::grammar::Grammars>,
    /// Bytes of the second KV tier (blocks evicted from KV memory, kept in
    /// host memory and restored on a prefix hit); 0: none.
    pub kv_tier_bytes: u64,
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
            kv_tier_bytes: 0,
            grammars: None,
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

/// The data-parallel ranks of one worker: running counts shared for
/// balance scheduling (each rank publishes its count every step and reads the
/// largest; counts lag by at most one step of the slowest rank), and,
/// optionally, a lockstep barrier.
///
/// In lockstep (as data-parallel ranks of an MoE model run in vLLM) every
/// rank takes part in every step while any rank has work: an idle rank runs
/// an empty step, and each step ends when the slowest rank's does. The
/// barrier never deadlocks: a rank that waits longer than the step timeout
/// moves on (and logs), and a stopped engine leaves the group. Every rank
/// of a lockstep group must run an engine; an idle rank polls its commands
/// every millisecond so it can join its peers' steps.
#[derive(Debug)]
pub struct BalanceGroup {
    running: Vec<AtomicUsize>,
    lockstep: Option<Lockstep>,
}

#[derive(Debug)]
struct Lockstep {
    state: Mutex<LockstepState>,
    cv: Condvar,
    timeout: Duration,
}

#[derive(Debug)]
struct LockstepState {
    generation: u64,
    arrived: usize,
    members: usize,
    busy: Vec<bool>,
    left: Vec<bool>,
    /// Steps completed together.
    steps: u64,
}

impl BalanceGroup {
    /// A group of `num_ranks` ranks, all at 0 running; ranks step independently.
    pub fn new(num_ranks: usize) -> Arc<Self> {
        Arc::new(Self {
            running: (0..num_ranks).map(|_| AtomicUsize::new(0)).collect(),
            lockstep: None,
        })
    }

    /// A group whose ranks step in lockstep; a rank waits at most
    /// `step_timeout` for the others.
    pub fn lockstep(num_ranks: usize, step_timeout: Duration) -> Arc<Self> {
        Arc::new(Self {
            running: (0..num_ranks).map(|_| AtomicUsize::new(0)).collect(),
            lockstep: Some(Lockstep {
                state: Mutex::new(LockstepState {
                    generation: 0,
                    arrived: 0,
                    members: num_ranks,
                    busy: vec![false; num_ranks],
                    left: vec![false; num_ranks],
                    steps: 0,
                }),
                cv: Condvar::new(),
                timeout: step_timeout,
            }),
        })
    }

    /// Ranks in the group.
    pub fn num_ranks(&self) -> usize {
        self.running.len()
    }

    /// Whether the ranks step in lockstep.
    pub fn is_lockstep(&self) -> bool {
        self.lockstep.is_some()
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

    /// Lockstep steps completed by all ranks together (0 without lockstep).
    pub fn lockstep_steps(&self) -> u64 {
        self.lockstep.as_ref().map_or(0, |l| l.state.lock().steps)
    }

    /// Lockstep: records whether `rank` has work and says whether it must
    /// take part in the next step (some rank has work or is already waiting).
    /// Always true without lockstep.
    pub(crate) fn should_step(&self, rank: usize, has_work: bool) -> bool {
        let Some(l) = &self.lockstep else { return true };
        let mut g = l.state.lock();
        if let Some(b) = g.busy.get_mut(rank) {
            *b = has_work;
        }
        g.arrived > 0 || g.busy.iter().any(|&b| b)
    }

    /// Lockstep: whether any rank has work or waits at the barrier.
    pub(crate) fn any_busy(&self) -> bool {
        self.lockstep.as_ref().is_some_and(|l| {
            let g = l.state.lock();
            g.arrived > 0 || g.busy.iter().any(|&b| b)
        })
    }

    /// Lockstep: waits until every rank has finished this step (or the step
    /// timeout passes). Returns immediately without lockstep.
    pub(crate) fn end_step(&self, rank: usize) {
        let Some(l) = &self.lockstep else { return };
        let mut g = l.state.lock();
        let generation = g.generation;
        g.arrived += 1;
        if g.arrived >= g.members {
            complete_generation(&mut g, &l.cv);
            return;
        }
        while g.generation == generation {
            if l.cv.wait_for(&mut g, l.timeout).timed_out() {
                if g.generation == generation {
                    g.arrived -= 1;
                    tracing::warn!(rank, "lockstep: peers did not finish the step in time");
                }
                return;
            }
        }
    }

    /// Lockstep: `rank`'s engine stopped; the others stop waiting for it.
    pub(crate) fn leave(&self, rank: usize) {
        let Some(l) = &self.lockstep else { return };
        let mut g = l.state.lock();
        if g.left.get(rank).copied().unwrap_or(true) {
            return;
        }
        g.left[rank] = true;
        g.busy[rank] = false;
        g.members = g.members.saturating_sub(1);
        if g.arrived > 0 && g.arrived >= g.members {
            complete_generation(&mut g, &l.cv);
        }
    }
}

fn complete_generation(g: &mut LockstepState, cv: &Condvar) {
    g.arrived = 0;
    g.generation += 1;
    g.steps += 1;
    cv.notify_all();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lockstep_step_ends_when_every_rank_arrives() {
        let g = BalanceGroup::lockstep(3, Duration::from_secs(10));
        // Rank 0 has work before any idle rank asks; otherwise an idle rank
        // could ask first, be told to skip, and leave its peers to time out.
        assert!(g.should_step(0, true));
        let handles: Vec<_> = (0..3)
            .map(|r| {
                let g = g.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        assert!(g.should_step(r, r == 0));
                        g.end_step(r);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("rank thread");
        }
        assert_eq!(g.lockstep_steps(), 50);
    }

    #[test]
    fn lockstep_idle_group_does_not_step_and_a_leaver_releases_waiters() {
        let g = BalanceGroup::lockstep(2, Duration::from_secs(10));
        assert!(!g.should_step(0, false));
        assert!(!g.should_step(1, false));
        assert!(g.should_step(0, true));
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || g2.end_step(0));
        std::thread::sleep(Duration::from_millis(20));
        g.leave(1);
        waiter.join().expect("released");
        assert_eq!(g.lockstep_steps(), 1);
    }

    #[test]
    fn lockstep_wait_times_out_instead_of_hanging() {
        let g = BalanceGroup::lockstep(2, Duration::from_millis(20));
        assert!(g.should_step(0, true));
        g.end_step(0);
        assert_eq!(g.lockstep_steps(), 0);
        assert!(g.any_busy(), "rank 0 still has work");
    }

    #[test]
    fn policy_parses_and_displays() {
        assert_eq!(
            "priority".parse::<SchedulingPolicy>().expect("known"),
            SchedulingPolicy::Priority
        );
        assert_eq!(SchedulingPolicy::Fcfs.to_string(), "fcfs");
        assert!("lifo".parse::<SchedulingPolicy>().is_err());
    }
}
