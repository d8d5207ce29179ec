//! Property tests of the scheduler and KV cache: random arrivals, aborts,
//! priorities, prefill-only holds, remote reservations and KV pressure; every
//! step must keep the pool's invariants, the token budget and `max_num_seqs`,
//! admit in policy order, and everything must drain without leaking a block.
//!
//! A shadow of the KV memory checks what the backend would read: each slot
//! a step writes records the hash of the sequence prefix it holds, and every
//! chunk's earlier positions must hold its own sequence's prefix — across
//! preemption (parked or released blocks), prefix sharing, eviction and
//! remote prefill. Tokens computed twice are counted and must match the
//! sequence's reported recompute.

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
    /// `long_prefill_token_threshold` (0 = off).
    long_prefill: usize,
    /// `admission_wait_steps` (0 = off).
    admission_wait: usize,
    /// `prefill_first_steps` (0 = off).
    prefill_first: usize,
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
        prop_oneof![Just(0usize), Just(1), Just(3), Just(8)],
        prop_oneof![Just(0usize), Just(2)],
        prop_oneof![Just(0usize), Just(1), Just(2)],
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
                long_prefill,
                admission_wait,
                prefill_first,
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
                    long_prefill,
                    admission_wait,
                    prefill_first,
                }
            },
        )
}

fn prompt(family: u8, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 1 + u32::from(family) * 1000 + i)
        .collect()
}

/// Chains a prefix's hash with its next token (any well-mixed function will do).
fn prefix_hash(h: u64, token: u32) -> u64 {
    (h ^ u64::from(token))
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .rotate_left(29)
        ^ 0x94d0_49bb_1331_11eb
}

/// The fake backend: next token from the last one and its position.
fn next_token(last: u32, pos: usize) -> u32 {
    ((u64::from(last) * 31 + pos as u64 * 7) % 23) as u32
}

struct Harness {
    s: Scheduler,
    /// Every sequence's tokens so far (prompt, then outputs).
    tokens: HashMap<SeqId, Vec<u32>>,
    /// (block, slot) → hash of the sequence prefix whose K/V it holds.
    shadow: HashMap<(u32, usize), u64>,
    /// Per sequence: most positions computed, and positions computed again.
    computed_high: HashMap<SeqId, usize>,
    recomputed: HashMap<SeqId, usize>,
    /// Reserved slot → its blocks, for the remote prefill's writes.
    reserved_blocks: HashMap<SeqId, Vec<u32>>,
    cfg: SchedulerConfig,
    block_size: usize,
    /// Admission key per sequence (policy order; lower is admitted first).
    keys: HashMap<SeqId, (i64, u64)>,
    held: Vec<SeqId>,
    reserved: Vec<(SeqId, usize)>,
    next_id: SeqId,
    events: Arc<KvEventLog>,
    /// Steps in a row whose admission waited for slots about to free.
    held_in_a_row: usize,
    /// Steps in a row that left decode rows out for prefill.
    stalled_in_a_row: usize,
    /// `decode_stalled_steps` after the last step.
    stalled_total: u64,
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
            long_prefill_token_threshold: st.long_prefill,
            admission_wait_steps: st.admission_wait,
            prefill_first_steps: st.prefill_first,
        };
        let events = Arc::new(KvEventLog::new(1 << 16));
        let kv = KvCache::new(st.num_blocks, st.block_size, st.caching, events.clone());
        Self {
            s: Scheduler::new(cfg.clone(), kv, vec![EOS]),
            tokens: HashMap::new(),
            shadow: HashMap::new(),
            computed_high: HashMap::new(),
            recomputed: HashMap::new(),
            reserved_blocks: HashMap::new(),
            cfg,
            block_size: st.block_size,
            keys: HashMap::new(),
            held: Vec::new(),
            reserved: Vec::new(),
            next_id: 1,
            events,
            held_in_a_row: 0,
            stalled_in_a_row: 0,
            stalled_total: 0,
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
            constraint: None,
            first_token_by: None,
            tpot_target: None,
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
                self.tokens.insert(id, req.prompt.clone());
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
                self.tokens.insert(id, prompt(family, len));
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
                self.tokens.insert(id, p.clone());
                if let Ok(r) = self.s.reserve_remote(id, Self::request(p, 8, 0, false)) {
                    prop_assert_eq!(r.block_ids.len(), len.div_ceil(self.block_size));
                    prop_assert!(r.skip_blocks * self.block_size <= len);
                    // The cached blocks it skips must already hold the prompt.
                    let t = self.tokens[&id].clone();
                    self.check_reads(id, &t, &r.block_ids, r.skip_blocks * self.block_size)?;
                    self.reserved_blocks.insert(id, r.block_ids.clone());
                    self.reserved.push((id, next_token(last, len - 1) as usize));
                }
            }
            Op::Commit { pick } => {
                if !self.reserved.is_empty() {
                    let (id, first) = self.reserved.remove(pick % self.reserved.len());
                    // The remote prefill wrote the prompt into the slot.
                    let blocks = self.reserved_blocks.remove(&id).unwrap_or_default();
                    let t = self.tokens[&id].clone();
                    self.write(&t, &blocks, 0, t.len());
                    self.computed_high.insert(id, t.len());
                    let out = self.s.commit_remote(id, first as u32, None);
                    prop_assert!(out.is_ok());
                    if let Ok(o) = out {
                        self.tokens.entry(id).or_default().push(o.token);
                    }
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
        // sequence left waiting, except a long prompt passed over while
        // this step carries a long prefill (long prefills go one at a
        // time; shorter prompts behind them do not wait for that).
        let cap = (self.cfg.enable_chunked_prefill && self.cfg.long_prefill_token_threshold > 0)
            .then_some(self.cfg.long_prefill_token_threshold);
        let long_in_step = cap.is_some_and(|cap| {
            st.seqs
                .iter()
                .zip(&st.batch.seqs)
                .any(|(s, c)| self.tokens[&s.seq_id].len() - c.start_pos > cap)
        });
        for p in &st.passed_over {
            prop_assert!(
                long_in_step,
                "{p} passed over with no long prefill in the step"
            );
            prop_assert!(
                cap.is_some_and(|cap| self.tokens[p].len() > cap),
                "{p} passed over but not long"
            );
            prop_assert!(
                self.s.waiting_ids().any(|w| w == *p),
                "{p} passed over yet not waiting"
            );
        }
        // A step whose admission waits admits nothing, and waits are bounded.
        if st.admission_held {
            prop_assert!(st.admitted.is_empty());
            self.held_in_a_row += 1;
            prop_assert!(self.held_in_a_row <= self.cfg.admission_wait_steps);
        } else {
            self.held_in_a_row = 0;
        }
        // Decode rows sit out at most `prefill_first_steps` steps in a row.
        let stalled = self.s.load().decode_stalled_steps;
        if stalled > self.stalled_total {
            self.stalled_in_a_row += 1;
            prop_assert!(self.stalled_in_a_row <= self.cfg.prefill_first_steps);
        } else {
            self.stalled_in_a_row = 0;
        }
        self.stalled_total = stalled;
        let waiting: Vec<SeqId> = self
            .s
            .waiting_ids()
            .filter(|w| !st.passed_over.contains(w))
            .collect();
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
        // What the backend reads and writes: every chunk continues its own
        // sequence over K/V that holds its own prefix.
        for (s, c) in st.seqs.iter().zip(&st.batch.seqs) {
            let t = self.tokens[&s.seq_id].clone();
            let end = c.start_pos + c.tokens.len();
            prop_assert_eq!(&c.tokens[..], &t[c.start_pos..end], "seq {}", s.seq_id);
            self.check_reads(s.seq_id, &t, &c.block_table, c.start_pos)?;
        }
        for (s, c) in st.seqs.iter().zip(&st.batch.seqs) {
            let t = self.tokens[&s.seq_id].clone();
            let end = c.start_pos + c.tokens.len();
            self.write(&t, &c.block_table, c.start_pos, end);
            let high = self.computed_high.entry(s.seq_id).or_default();
            let again = (*high).min(end).saturating_sub(c.start_pos);
            *high = (*high).max(end);
            *self.recomputed.entry(s.seq_id).or_default() += again;
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
        let outs = self
            .s
            .update(&st, ForwardOutput::Tokens(tokens))
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        for o in outs {
            self.tokens.entry(o.seq_id).or_default().push(o.token);
            let counted = self.recomputed.get(&o.seq_id).copied().unwrap_or(0);
            prop_assert_eq!(o.preemption.recomputed_tokens, counted, "seq {}", o.seq_id);
            if let Some(f) = o.finished {
                prop_assert_eq!(f.usage.preemption, o.preemption);
            }
        }
        self.s.check_invariants().map_err(TestCaseError::fail)?;
        Ok(())
    }

    /// Positions `0..upto` of `id`'s table must hold `tokens`' prefixes.
    fn check_reads(
        &self,
        id: SeqId,
        tokens: &[u32],
        table: &[u32],
        upto: usize,
    ) -> Result<(), TestCaseError> {
        let mut h = 0u64;
        for (p, &t) in tokens.iter().enumerate().take(upto) {
            h = prefix_hash(h, t);
            let slot = (table[p / self.block_size], p % self.block_size);
            prop_assert_eq!(
                self.shadow.get(&slot),
                Some(&h),
                "seq {} reads position {} from block {} holding another prefix",
                id,
                p,
                slot.0
            );
        }
        Ok(())
    }

    /// Records that positions `from..to` of `tokens` were written into `table`.
    fn write(&mut self, tokens: &[u32], table: &[u32], from: usize, to: usize) {
        let mut h = 0u64;
        for (p, &t) in tokens.iter().enumerate().take(to) {
            h = prefix_hash(h, t);
            if p >= from {
                self.shadow
                    .insert((table[p / self.block_size], p % self.block_size), h);
            }
        }
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
                KvEvent::Moved { block_hashes, .. } => {
                    for h in block_hashes {
                        prop_assert!(cached.contains(h), "moved unknown");
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
