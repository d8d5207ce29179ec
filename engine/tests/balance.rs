//! Balance scheduling across data-parallel ranks (vLLM-Ascend patch 5212):
//! with it on, no rank admits a waiting request while any rank runs
//! `max_num_seqs - 1` or more sequences; with it off, peers' counts change
//! nothing. Checked on schedulers stepped in lockstep by hand (every step,
//! every rank sees every count) and on mocker engines in a lockstep group.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use proptest::prelude::*;
use sluice_engine::backend::ForwardOutput;
use sluice_engine::backend::mocker::MockerTiming;
use sluice_engine::kv::{KvCache, KvEventLog};
use sluice_engine::scheduler::Scheduler;
use sluice_engine::{
    BalanceGroup, EngineConfig, EngineHandle, GenerateStream, MockerBackend, MockerConfig, Request,
    SamplingParams, SchedulerConfig,
};

const BS: usize = 4;

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        request_id: String::new(),
        prompt,
        sampling: SamplingParams {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..SamplingParams::greedy()
        },
        priority: 0,
        constraint: None,
        first_token_by: None,
        tpot_target: None,
    }
}

fn scheduler(max_num_seqs: usize, budget: usize, balance: bool) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 256,
        balance_scheduling: balance,
        ..SchedulerConfig::default()
    };
    let kv = KvCache::new(512, BS, true, Arc::new(KvEventLog::new(1 << 12)));
    Scheduler::new(cfg, kv, vec![])
}

/// One request arriving at `step` on `rank`.
#[derive(Debug, Clone)]
struct Arrival {
    step: usize,
    rank: usize,
    prompt_len: usize,
    max_tokens: usize,
}

fn arrivals(ranks: usize) -> impl Strategy<Value = Vec<Arrival>> {
    prop::collection::vec(
        (0usize..40, 0..ranks, 1usize..24, 1usize..30).prop_map(
            |(step, rank, prompt_len, max_tokens)| Arrival {
                step,
                rank,
                prompt_len,
                max_tokens,
            },
        ),
        1..40,
    )
}

/// What one rank's scheduler did in one lockstep step.
#[derive(Debug, Clone, PartialEq, Eq)]
struct StepTrace {
    admitted: Vec<u64>,
    scheduled: Vec<(u64, usize)>,
    held: bool,
}

/// Steps `ranks` schedulers in lockstep as the engine does: every rank
/// publishes its running count, each reads the largest, then all step.
/// `peer_max` overrides the count fed to the schedulers (None: the true
/// largest). Calls `check(step_max, traces)` after every step.
fn run_lockstep(
    ranks: usize,
    max_num_seqs: usize,
    balance: bool,
    arrivals: &[Arrival],
    peer_max: Option<usize>,
    mut check: impl FnMut(usize, &[StepTrace]) -> Result<(), TestCaseError>,
) -> Result<Vec<Vec<StepTrace>>, TestCaseError> {
    let mut s: Vec<Scheduler> = (0..ranks)
        .map(|_| scheduler(max_num_seqs, 32, balance))
        .collect();
    let mut all = Vec::new();
    for step in 0..10_000 {
        for (i, a) in arrivals.iter().enumerate().filter(|(_, a)| a.step == step) {
            let prompt = (0..a.prompt_len as u32).map(|t| t + 1 + 100 * i as u32);
            s[a.rank]
                .add(i as u64, request(prompt.collect(), a.max_tokens))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        let pending = arrivals.iter().any(|a| a.step > step);
        if !pending && s.iter().all(|r| !r.has_unfinished()) {
            return Ok(all);
        }
        let step_max = s.iter().map(Scheduler::num_running).max().unwrap_or(0);
        let mut traces = Vec::with_capacity(ranks);
        for r in &mut s {
            r.set_peer_running_max(peer_max.unwrap_or(step_max));
            let st = r.schedule();
            let rows = st.seqs.iter().filter(|x| x.needs_logits).count();
            r.update(&st, ForwardOutput::Tokens(vec![7; rows]))
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            traces.push(StepTrace {
                admitted: st.admitted.clone(),
                scheduled: st
                    .seqs
                    .iter()
                    .map(|x| (x.seq_id, x.num_new_tokens))
                    .collect(),
                held: st.balance_held,
            });
        }
        check(step_max, &traces)?;
        all.push(traces);
    }
    Err(TestCaseError::fail("ranks did not finish"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn balance_on_no_rank_admits_while_any_rank_is_within_one_of_full(
        ranks in 2usize..5,
        max_num_seqs in 2usize..7,
        arr in arrivals(4),
    ) {
        let arr: Vec<Arrival> = arr.into_iter().map(|a| Arrival { rank: a.rank % ranks, ..a }).collect();
        run_lockstep(ranks, max_num_seqs, true, &arr, None, |step_max, traces| {
            let open = step_max + 1 < max_num_seqs;
            for (rank, t) in traces.iter().enumerate() {
                prop_assert!(
                    open || t.admitted.is_empty(),
                    "rank {} admitted {:?} while a rank ran {} of {}",
                    rank, t.admitted, step_max, max_num_seqs
                );
                prop_assert!(!t.held || !open, "held while every rank had room");
            }
            Ok(())
        })?;
        // run_lockstep errs unless every request finished.
    }

    #[test]
    fn balance_off_ignores_peer_counts(
        ranks in 2usize..5,
        max_num_seqs in 1usize..7,
        arr in arrivals(4),
    ) {
        let arr: Vec<Arrival> = arr.into_iter().map(|a| Arrival { rank: a.rank % ranks, ..a }).collect();
        let no_check = |_: usize, t: &[StepTrace]| {
            prop_assert!(t.iter().all(|x| !x.held));
            Ok(())
        };
        let fed = run_lockstep(ranks, max_num_seqs, false, &arr, None, no_check)?;
        let full = run_lockstep(ranks, max_num_seqs, false, &arr, Some(usize::MAX / 2), no_check)?;
        let zero = run_lockstep(ranks, max_num_seqs, false, &arr, Some(0), no_check)?;
        prop_assert_eq!(&fed, &full);
        prop_assert_eq!(&fed, &zero);
    }
}

#[test]
fn balance_on_holds_until_every_rank_has_two_free_slots_then_all_admit() {
    // Rank 0 is full, rank 1 has one request waiting.
    let mut a = scheduler(4, 64, true);
    let mut b = scheduler(4, 64, true);
    for id in 0..4 {
        a.add(id, request(vec![1 + id as u32; 3], 3 + id as usize))
            .expect("valid");
    }
    let st = a.schedule();
    a.update(&st, ForwardOutput::Tokens(vec![7; 4]))
        .expect("rows");
    assert_eq!(a.num_running(), 4);
    b.add(10, request(vec![9; 3], 2)).expect("valid");
    let mut admitted_at = None;
    for step in 0..10 {
        let max = a.num_running().max(b.num_running());
        a.set_peer_running_max(max);
        b.set_peer_running_max(max);
        for s in [&mut a, &mut b] {
            let st = s.schedule();
            let rows = st.seqs.iter().filter(|x| x.needs_logits).count();
            s.update(&st, ForwardOutput::Tokens(vec![7; rows]))
                .expect("rows");
            if st.admitted.contains(&10) {
                admitted_at = Some((step, max));
            }
        }
        if admitted_at.is_some() {
            break;
        }
    }
    // Rank 0's requests finish after 2, 3, 4, 5 more tokens: it runs 4, 4,
    // 3, 2 at the start of steps 0..4, so rank 1 admits at step 3.
    assert_eq!(admitted_at, Some((3, 2)));
    assert_eq!(b.load().balance_held_steps, 3);
}

/// Tokens per step of the lockstep ranks: W's prompt, one step's prefill
/// (longer than rank 1's step that admits D and E, so rank 0 reaches the
/// barrier last and starts the next step first).
const BUDGET: usize = 1024;

fn lockstep_rank(group: &Arc<BalanceGroup>, rank: usize, balance: bool) -> EngineHandle {
    let m = MockerConfig {
        // Holds every id `prompt` makes: the engine refuses ids outside it.
        vocab_size: 16_384,
        block_size: BS,
        num_blocks: 512,
        timing: MockerTiming::Polynomial,
        speedup_ratio: 5.0,
        avoid_token_ids: vec![0],
        ..MockerConfig::default()
    };
    let cfg = EngineConfig {
        block_size: BS,
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: BUDGET,
            balance_scheduling: balance,
            ..SchedulerConfig::default()
        },
        eos_token_ids: vec![0],
        balance_group: Some((group.clone(), rank)),
        ..EngineConfig::default()
    };
    let backend = MockerBackend::new(m).expect("valid mocker");
    EngineHandle::spawn(Box::new(backend), cfg).expect("engine starts")
}

fn prompt(tag: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| 1 + tag * 1000 + i).collect()
}

/// Whether `stream` already holds its finishing output (without waiting).
fn finished_already(stream: &mut GenerateStream) -> bool {
    let mut cx = Context::from_waker(Waker::noop());
    while let Poll::Ready(Some(out)) = stream.poll_recv(&mut cx) {
        if out.finished.is_some() {
            return true;
        }
    }
    false
}

async fn wait_load(e: &EngineHandle, what: &str, f: impl Fn(usize, usize) -> bool) {
    let mut load = e.load();
    tokio::time::timeout(
        Duration::from_secs(10),
        load.wait_for(|l| f(l.running, l.waiting)),
    )
    .await
    .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    .expect("engine alive");
}

/// Two lockstep ranks, `max_num_seqs` 4. Rank 1 runs A, B (long) and C;
/// D, E wait on rank 1, W (a prompt of exactly one step's budget) and W2
/// wait on rank 0. Dropping C opens admission: rank 1 fills to 4 with D, E.
/// W2 can only be admitted in a later step than W; with balance on, rank 1
/// is full then, so W2 waits until A and B finish.
async fn fill_one_rank_then_admit_on_the_other(balance: bool) -> (bool, u64) {
    let group = BalanceGroup::lockstep(2, Duration::from_secs(10));
    let r0 = lockstep_rank(&group, 0, balance);
    let r1 = lockstep_rank(&group, 1, balance);
    let mut a = r1.generate(request(prompt(1, 8), 60)).expect("valid");
    let b = r1.generate(request(prompt(2, 8), 60)).expect("valid");
    let c = r1.generate(request(prompt(3, 8), 1000)).expect("valid");
    wait_load(&r1, "A, B, C running", |run, _| run == 3).await;
    let d = r1.generate(request(prompt(4, 8), 60)).expect("valid");
    let e = r1.generate(request(prompt(5, 8), 60)).expect("valid");
    let w = r0.generate(request(prompt(6, BUDGET), 60)).expect("valid");
    let w2 = r0.generate(request(prompt(7, 8), 1)).expect("valid");
    if balance {
        // Rank 1 at max_num_seqs - 1 holds every rank.
        wait_load(&r1, "D, E waiting", |run, wait| run == 3 && wait == 2).await;
        wait_load(&r0, "W, W2 waiting", |run, wait| run == 0 && wait == 2).await;
    }
    drop(c);
    let (w2_tokens, _) = w2.collect().await;
    assert_eq!(w2_tokens.len(), 1);
    let a_done_first = finished_already(&mut a);
    for s in [b, d, e, w] {
        let (tokens, _) = s.collect().await;
        assert_eq!(tokens.len(), 60);
    }
    let held = r0.load().borrow().balance_held_steps + r1.load().borrow().balance_held_steps;
    (a_done_first, held)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockstep_balance_on_no_rank_admits_in_the_step_after_a_peer_filled_up() {
    for _ in 0..3 {
        let (a_done_first, held) = fill_one_rank_then_admit_on_the_other(true).await;
        assert!(
            a_done_first,
            "W2 was admitted while rank 1 ran max_num_seqs sequences"
        );
        assert!(held > 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lockstep_balance_off_admits_regardless_of_peers() {
    let (a_done_first, held) = fill_one_rank_then_admit_on_the_other(false).await;
    assert!(!a_done_first, "without balance W2 runs at once");
    assert_eq!(held, 0);
}
