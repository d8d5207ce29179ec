//! Property tests of the scheduler and KV cache: random arrivals, aborts,
//! priorities, prefill-only holds, remote reservations and KV pressure; every
//! step must keep the pool's invariants, the token budget and `max_num_seqs`,
//! admit in policy order, and everything must drain without leaking a block.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use proptest::prelude::*;
use sluice_engine::backend::ForwardOutput;
use sluice_engine::kv::{KvCache, KvEvent, KvEventLog, SeqId};
use sluice_engine::scheduler::{Request, Scheduler};
use sluice_engine::{SamplingParams, SchedulerConfig, SchedulingPolicy};

const EOS: u32 = 0;

#[derive(Debug, Clone)]
enum Op {
    /// A request: prompt family (shared prefixes), length, max tokens, priority.
    Add {
        family: u8,
        len: usize,
        max_tokens: usize,
        priority: i32,
        ignore_eos: bool,
    },
    PrefillOnly {
        family: u8,
        len: usize,
    },
    Reserve {
        family: u8,
        len: usize,
    },
    Commit {
        pick: usize,
    },
    Abort {
        pick: usize,
    },
    Release {
        pick: usize,
    },
    Steps {
        n: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u8..4, 1usize..40, 1usize..24, -2i32..3, any::<bool>()).prop_map(
            |(family, len, max_tokens, priority, ignore_eos)| Op::Add {
                family, len, max_tokens, priority, ignore_eos
            }
        ),
        1 => (0u8..4, 1usize..30).prop_map(|(family, len)| Op::PrefillOnly { family, len }),
        1 => (0u8..4, 1usize..30).prop_map(|(family, len)| Op::Reserve { family, len }),
        1 => any::<usize>().prop_map(|pick| Op::Commit { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Release { pick }),
        6 => (1usize..6).prop_map(|n| Op::Steps { n }),
    ]
}

#[derive(Debug, Clone)]
struct Setup {
    policy: SchedulingPolicy,
    block_size: usize,
    num_blocks: usize,
    max_num_seqs: usize,
    budget: usize,
    chunked: bool,
    preempt_on_seq_limit: bool,
    caching: bool,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        prop_oneof![
            Just(SchedulingPolicy::Fcfs),
            Just(SchedulingPolicy::Priority)
        ],
        prop_oneof![Just(2usize), Just(4), Just(8)],
        8usize..40,
        1usize..6,
        8usize..48,
        any::<bool>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(
                policy,
                block_size,
                num_blocks,
                max_num_seqs,
                budget,
                chunked,
                seq_limit,
                caching,
            )| {
                Setup {
                    policy,
                    block_size,
                    num_blocks,
                    max_num_seqs,
                    budget,
                    chunked,
                    preempt_on_seq_limit: seq_limit,
                    caching,
                }
            },
        )
}

fn prompt(family: u8, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 1 + u32::from(family) * 1000 + i)
        .collect()
}

/// The fake backend: next token from the last one and its position.
fn next_token(last: u32, pos: usize) -> u32 {
    ((u64::from(last) * 31 + pos as u64 * 7) % 23) as u32
}

struct Harness {
    s: Scheduler,
    cfg: SchedulerConfig,
    block_size: usize,
    /// Admission key per sequence (policy order; lower is admitted first).
    keys: HashMap<SeqId, (i64, u64)>,
    held: Vec<SeqId>,
    reserved: Vec<(SeqId, usize)>,
    next_id: SeqId,
    events: Arc<KvEventLog>,
}

impl Harness {
    fn new(st: &Setup) -> Self {
        let cfg = SchedulerConfig {
            max_num_seqs: st.max_num_seqs,
            // Without chunked prefill the budget must cover a whole sequence
            // (EngineConfig::validate insists on it).
            max_num_batched_tokens: if st.chunked { st.budget } else { 64 },
            max_model_len: 64,
            policy: st.policy,
            enable_chunked_prefill: st.chunked,
            preempt_on_seq_limit: st.preempt_on_seq_limit,
            keep_preempted_order: true,
            balance_scheduling: false,
        };
        let events = Arc::new(KvEventLog::new(1 << 16));
        let kv = KvCache::new(st.num_blocks, st.block_size, st.caching, events.clone());
        Self {
            s: Scheduler::new(cfg.clone(), kv, vec![EOS]),
            cfg,
            block_size: st.block_size,
            keys: HashMap::new(),
            held: Vec::new(),
            reserved: Vec::new(),
            next_id: 1,
            events,
        }
    }

    fn key(&self, id: SeqId, priority: i32) -> (i64, u64) {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => (0, id),
            SchedulingPolicy::Priority => (-i64::from(priority), id),
        }
    }

    fn request(prompt: Vec<u32>, max_tokens: usize, priority: i32, ignore_eos: bool) -> Request {
        Request {
            request_id: String::new(),
            prompt,
            sampling: SamplingParams {
                max_tokens: Some(max_tokens),
                ignore_eos,
                ..SamplingParams::greedy()
            },
            priority,
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Add {
                family,
                len,
                max_tokens,
                priority,
                ignore_eos,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                let req = Self::request(prompt(family, len), max_tokens, priority, ignore_eos);
                let too_long = len >= self.s.max_len();
                match self.s.add(id, req) {
                    Ok(()) => {
                        prop_assert!(!too_long);
                        let key = self.key(id, priority);
                        self.keys.insert(id, key);
                    }
                    Err(_) => prop_assert!(too_long),
                }
            }
            Op::PrefillOnly { family, len } => {
                let id = self.next_id;
                self.next_id += 1;
                if self
                    .s
                    .add_prefill_only(id, Self::request(prompt(family, len), 1, 0, false))
                    .is_ok()
                {
                    let key = self.key(id, 0);
                    self.keys.insert(id, key);
                    self.held.push(id);
                }
            }
            Op::Reserve { family, len } => {
                let id = self.next_id;
                self.next_id += 1;
                let p = prompt(family, len);
                let last = *p.last().expect("len >= 1");
                if let Ok(r) = self.s.reserve_remote(id, Self::request(p, 8, 0, false)) {
                    prop_assert_eq!(r.block_ids.len(), len.div_ceil(self.block_size));
                    prop_assert!(r.skip_blocks * self.block_size <= len);
                    self.reserved.push((id, next_token(last, len - 1) as usize));
                }
            }
            Op::Commit { pick } => {
                if !self.reserved.is_empty() {
                    let (id, first) = self.reserved.remove(pick % self.reserved.len());
                    let out = self.s.commit_remote(id, first as u32, None);
                    prop_assert!(out.is_ok());
                    let key = self.key(id, 0);
                    self.keys.insert(id, key);
                }
            }
            Op::Abort { pick } => {
                let ids: Vec<SeqId> = self
                    .s
                    .running_ids()
                    .iter()
                    .copied()
                    .chain(self.s.waiting_ids())
                    .collect();
                if !ids.is_empty() {
                    prop_assert!(self.s.abort(ids[pick % ids.len()]).is_some());
                }
            }
            Op::Release { pick } => {
                if !self.held.is_empty() {
                    let id = self.held.remove(pick % self.held.len());
                    self.s.abort(id);
                }
                if !self.reserved.is_empty() {
                    let (id, _) = self.reserved.remove(pick % self.reserved.len());
                    self.s.abort(id);
                }
            }
            Op::Steps { n } => {
                for _ in 0..n {
                    self.step()?;
                }
            }
        }
        self.s.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    }

    fn step(&mut self) -> Result<(), TestCaseError> {
        let st = self.s.schedule();
        prop_assert!(st.num_batched_tokens() <= self.cfg.max_num_batched_tokens);
        prop_assert!(st.seqs.len() <= self.cfg.max_num_seqs);
        prop_assert!(self.s.num_running() <= self.cfg.max_num_seqs);
        for c in &st.batch.seqs {
            prop_assert!(c.block_table.len() * self.block_size >= c.start_pos + c.tokens.len());
            prop_assert!(!c.tokens.is_empty());
        }
        // Admission follows the policy: nothing admitted ranks below a
        // sequence left waiting.
        let waiting: Vec<SeqId> = self.s.waiting_ids().collect();
        for a in &st.admitted {
            for w in &waiting {
                prop_assert!(
                    self.keys[a] < self.keys[w],
                    "admitted {} {:?} ahead of waiting {} {:?}",
                    a,
                    self.keys[a],
                    w,
                    self.keys[w]
                );
            }
        }
        let tokens: Vec<u32> = st
            .batch
            .seqs
            .iter()
            .filter(|c| c.needs_logits)
            .map(|c| {
                let last = *c.tokens.last().expect("non-empty");
                next_token(last, c.start_pos + c.tokens.len() - 1)
            })
            .collect();
        self.s
            .update(&st, ForwardOutput::Tokens(tokens))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        self.s.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    }

    fn drain(&mut self) -> Result<(), TestCaseError> {
        for id in std::mem::take(&mut self.held) {
            self.s.abort(id);
        }
        for (id, _) in std::mem::take(&mut self.reserved) {
            self.s.abort(id);
        }
        let mut steps = 0;
        while self.s.has_unfinished() {
            self.step()?;
            steps += 1;
            prop_assert!(steps < 20_000, "did not drain");
        }
        prop_assert_eq!(self.s.kv().num_used(), 0, "blocks leaked");
        prop_assert_eq!(self.s.kv().num_free(), self.s.kv().num_blocks());
        Ok(())
    }

    /// The snapshot equals the events replayed into a set.
    fn check_events(&self) -> Result<(), TestCaseError> {
        let sub = self
            .events
            .subscribe(0)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut cached = HashSet::new();
        for (i, r) in sub.backlog.iter().enumerate() {
            prop_assert_eq!(r.seq, i as u64 + 1);
            match &r.event {
                KvEvent::Stored { block_hashes, .. } => {
                    for h in block_hashes {
                        prop_assert!(cached.insert(*h), "stored twice");
                    }
                }
                KvEvent::Removed { block_hashes } => {
                    for h in block_hashes {
                        prop_assert!(cached.remove(h), "removed unknown");
                    }
                }
                KvEvent::Cleared => cached.clear(),
            }
        }
        let snap: HashSet<u64> = self.events.snapshot().block_hashes.into_iter().collect();
        prop_assert_eq!(snap, cached);
        prop_assert_eq!(
            self.s.kv().num_cached_blocks(),
            self.events.snapshot().block_hashes.len()
        );
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_invariants_and_drain_without_leaks(
        st in setup(),
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let mut h = Harness::new(&st);
        for op in &ops {
            h.apply(op)?;
        }
        h.drain()?;
        h.check_events()?;
    }
}
