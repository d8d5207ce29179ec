use std::collections::HashMap;
use std::sync::Arc;

use super::*;
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::mocker::{MockerBackend, MockerConfig, decode_ms, prefill_ms};
use crate::kv::{KvEvent, KvEventLog};
use crate::sampler::SamplingParams;

const BS: usize = 4;

fn sched(cfg: SchedulerConfig, num_blocks: usize) -> Scheduler {
    let kv = KvCache::new(num_blocks, BS, true, Arc::new(KvEventLog::new(1024)));
    Scheduler::new(cfg, kv, vec![0])
}

fn cfg(max_num_seqs: usize, budget: usize, policy: SchedulingPolicy) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs,
        max_num_batched_tokens: budget,
        max_model_len: 1024,
        policy,
        ..SchedulerConfig::default()
    }
}

fn req(prompt_len: usize, max_tokens: usize, priority: i32) -> Request {
    req_with(prompt_len, max_tokens, priority, 1)
}

fn req_with(prompt_len: usize, max_tokens: usize, priority: i32, base: u32) -> Request {
    Request {
        request_id: String::new(),
        prompt: (0..prompt_len as u32).map(|t| t + base).collect(),
        sampling: SamplingParams {
            max_tokens: Some(max_tokens),
            ..SamplingParams::greedy()
        },
        priority,
        constraint: None,
        first_token_by: None,
        tpot_target: None,
    }
}

/// Runs one step with a backend that always answers token 7.
fn step(s: &mut Scheduler) -> (ScheduledStep, Vec<StepOutput>) {
    let st = s.schedule();
    let rows = st.seqs.iter().filter(|x| x.needs_logits).count();
    let out = s
        .update(&st, ForwardOutput::Tokens(vec![7; rows]))
        .expect("rows match");
    s.check_invariants().expect("invariants");
    (st, out)
}

fn run_to_completion(s: &mut Scheduler) -> Vec<StepOutput> {
    let mut all = Vec::new();
    for _ in 0..10_000 {
        if !s.has_unfinished() {
            return all;
        }
        all.extend(step(s).1);
    }
    panic!("scheduler did not finish");
}

fn finished(outs: &[StepOutput], id: SeqId) -> Option<Finished> {
    outs.iter()
        .filter(|o| o.seq_id == id)
        .find_map(|o| o.finished)
}

#[test]
fn fcfs_admits_in_arrival_order_up_to_max_num_seqs() {
    let mut s = sched(cfg(2, 100, SchedulingPolicy::Fcfs), 64);
    for id in 1..=3 {
        s.add(id, req(4, 2, 0)).expect("valid");
    }
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, vec![1, 2]);
    assert_eq!(s.num_waiting(), 1);
}

#[test]
fn long_prompt_is_prefilled_in_chunks_within_budget() {
    let mut s = sched(cfg(4, 4, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(10, 2, 0)).expect("valid");
    let chunks: Vec<(usize, bool)> = (0..4)
        .map(|_| {
            let (st, _) = step(&mut s);
            (st.seqs[0].num_new_tokens, st.seqs[0].needs_logits)
        })
        .collect();
    assert_eq!(chunks, vec![(4, false), (4, false), (2, true), (1, true)]);
    assert!(!s.has_unfinished());
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn running_sequences_are_scheduled_before_waiting_ones() {
    let mut s = sched(cfg(4, 5, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(4, 10, 0)).expect("valid");
    step(&mut s);
    s.add(2, req(20, 10, 0)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(
        st.seqs[0],
        ScheduledSeq {
            seq_id: 1,
            num_new_tokens: 1,
            needs_logits: true
        }
    );
    assert_eq!(
        st.seqs[1].num_new_tokens, 4,
        "the prefill gets what the decode left"
    );
    assert!(st.num_batched_tokens() <= 5);
}

#[test]
fn repeated_prompt_is_served_from_prefix_cache() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(18, 1, 0)).expect("valid");
    let outs = run_to_completion(&mut s);
    assert_eq!(finished(&outs, 1).expect("done").usage.cached_tokens, 0);
    s.add(2, req(18, 1, 0)).expect("valid");
    let (st, outs) = step(&mut s);
    assert_eq!(st.seqs[0].num_new_tokens, 2, "16 of 18 tokens cached");
    assert_eq!(finished(&outs, 2).expect("done").usage.cached_tokens, 16);
}

#[test]
fn fully_cached_prompt_recomputes_its_last_block() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(16, 1, 0)).expect("valid");
    run_to_completion(&mut s);
    s.add(2, req(16, 1, 0)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.seqs[0].num_new_tokens, 4);
    assert_eq!(st.batch.seqs[0].start_pos, 12);
}

#[test]
fn priority_admits_higher_priority_first_and_fcfs_within() {
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req(4, 1, 0)).expect("valid");
    s.add(2, req(4, 1, 5)).expect("valid");
    s.add(3, req(4, 1, 5)).expect("valid");
    s.add(4, req(4, 1, -1)).expect("valid");
    let order: Vec<SeqId> = (0..8).flat_map(|_| step(&mut s).0.admitted).collect();
    assert_eq!(order, vec![2, 3, 1, 4]);
}

#[test]
fn kv_pressure_preempts_lowest_priority_latest_arrival() {
    // 6 blocks of 4 tokens; three sequences of 8 prompt tokens use all six.
    let mut s = sched(cfg(8, 100, SchedulingPolicy::Priority), 6);
    s.add(1, req_with(8, 20, 1, 100)).expect("valid");
    s.add(2, req_with(8, 20, 0, 200)).expect("valid");
    s.add(3, req_with(8, 20, 0, 300)).expect("valid");
    step(&mut s);
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![3], "priority 0, latest arrival");
    assert_eq!(s.num_waiting(), 1);
    run_to_completion(&mut s);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn the_load_says_whether_waiting_sequences_go_by_priority() {
    let fcfs = sched(cfg(4, 32, SchedulingPolicy::Fcfs), 8);
    let priority = sched(cfg(4, 32, SchedulingPolicy::Priority), 8);
    assert!(!fcfs.load().priority_scheduling);
    assert!(priority.load().priority_scheduling);
}

#[test]
fn fcfs_kv_pressure_preempts_latest_admitted_and_recompute_reuses_prefix() {
    let mut s = sched(cfg(8, 100, SchedulingPolicy::Fcfs), 5);
    s.add(1, req_with(8, 6, 0, 100)).expect("valid");
    s.add(2, req_with(8, 6, 0, 200)).expect("valid");
    step(&mut s);
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![2]);
    let outs = run_to_completion(&mut s);
    assert_eq!(
        finished(&outs, 2).expect("done").reason,
        FinishReason::Length
    );
    assert_eq!(s.load().preemptions, 1);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn waiting_higher_priority_preempts_at_seq_limit_when_enabled() {
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req(4, 50, 0)).expect("valid");
    step(&mut s);
    s.add(2, req(4, 5, 9)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![1]);
    assert_eq!(st.admitted, vec![2]);

    let mut off = cfg(1, 100, SchedulingPolicy::Priority);
    off.preempt_on_seq_limit = false;
    let mut s = sched(off, 64);
    s.add(1, req(4, 50, 0)).expect("valid");
    step(&mut s);
    s.add(2, req(4, 5, 9)).expect("valid");
    let (st, _) = step(&mut s);
    assert!(st.preempted.is_empty() && st.admitted.is_empty());
}

/// Whether `id` is preempted within `steps` steps.
fn preempted_within(s: &mut Scheduler, id: SeqId, steps: usize) -> bool {
    (0..steps).any(|_| step(s).0.preempted.contains(&id))
}

/// A request still waiting to start when its first token is due is
/// refused, whether it never ran or was preempted in its prefill; one
/// whose prefill is underway, or that has had a token, goes on, as does
/// one whose deadline is still ahead.
#[test]
fn a_request_not_started_when_its_first_token_is_due_is_refused() {
    use std::time::{Duration, Instant};
    let t0 = Instant::now();
    let due = |secs| {
        let mut r = req(10, 3, 0);
        r.first_token_by = Some(t0 + Duration::from_secs(secs));
        r
    };
    let mut s = sched(cfg(1, 4, SchedulingPolicy::Priority), 64);
    s.add(1, due(1)).expect("valid");
    step(&mut s);
    let late = t0 + Duration::from_secs(2);
    assert!(
        s.refuse_late_starts(late).is_empty(),
        "its prefill is underway"
    );

    // A higher priority preempts it in its prefill: it waits again, with
    // no token, and is refused once due; one due later stays.
    s.add(2, req(4, 50, 5)).expect("valid");
    assert!(preempted_within(&mut s, 1, 4), "2 preempts 1");
    s.add(3, due(10)).expect("valid");
    assert!(s.refuse_late_starts(t0).is_empty(), "nothing is due yet");
    let refused = s.refuse_late_starts(late);
    assert_eq!(refused.len(), 1);
    assert_eq!(refused[0].0, 1);
    assert_eq!(refused[0].1.reason, FinishReason::TtftTargetMissed);
    assert_eq!(refused[0].1.usage.completion_tokens, 0);
    assert!(!s.contains(1) && s.contains(3));
    s.check_invariants().expect("invariants");

    // Once it has had a token, a preempted request is never refused.
    let mut outs = Vec::new();
    for _ in 0..200 {
        outs.extend(step(&mut s).1);
        if outs.iter().any(|o| o.seq_id == 3) {
            break;
        }
    }
    assert!(outs.iter().any(|o| o.seq_id == 3), "3 had its first token");
    s.add(4, req(4, 50, 9)).expect("valid");
    assert!(preempted_within(&mut s, 3, 4), "4 preempts 3");
    assert!(
        s.refuse_late_starts(t0 + Duration::from_secs(60))
            .is_empty()
    );
    assert!(s.contains(3));
}

#[test]
fn equal_priority_never_preempts_at_seq_limit() {
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req(4, 5, 3)).expect("valid");
    step(&mut s);
    s.add(2, req(4, 5, 3)).expect("valid");
    let (st, _) = step(&mut s);
    assert!(st.preempted.is_empty());
}

fn preempted_order(keep: bool) -> Vec<SeqId> {
    let mut c = cfg(1, 100, SchedulingPolicy::Priority);
    c.keep_preempted_order = keep;
    let mut s = sched(c, 64);
    s.add(1, req_with(4, 3, 0, 10)).expect("valid");
    step(&mut s);
    s.add(2, req_with(4, 3, 0, 20)).expect("valid"); // same priority, arrives later
    s.add(3, req_with(4, 3, 5, 30)).expect("valid"); // preempts 1
    let mut order = Vec::new();
    for _ in 0..40 {
        order.extend(step(&mut s).0.admitted);
    }
    order
}

#[test]
fn preempted_sequence_keeps_its_place_when_flag_on() {
    assert_eq!(preempted_order(true), vec![3, 1, 2]);
    assert_eq!(preempted_order(false), vec![3, 2, 1]);
}

#[test]
fn abort_frees_blocks_in_every_state() {
    let mut s = sched(cfg(1, 6, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(20, 5, 0)).expect("valid");
    s.add(2, req(20, 5, 0)).expect("valid");
    step(&mut s); // 1 mid-prefill, 2 waiting
    assert!(s.kv().num_used() > 0);
    assert!(s.abort(1).is_some());
    assert!(s.abort(2).is_some());
    assert!(s.abort(2).is_none());
    assert_eq!(s.kv().num_used(), 0);
    s.check_invariants().expect("invariants");
}

#[test]
fn balance_scheduling_holds_admission_while_a_rank_is_nearly_full() {
    let mut c = cfg(4, 100, SchedulingPolicy::Fcfs);
    c.balance_scheduling = true;
    let mut s = sched(c, 64);
    s.add(1, req(4, 5, 0)).expect("valid");
    s.set_peer_running_max(3);
    let (st, _) = step(&mut s);
    assert!(st.admitted.is_empty() && st.balance_held);
    s.set_peer_running_max(2);
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, vec![1]);
    assert_eq!(s.load().balance_held_steps, 1);
}

#[test]
fn eos_stops_unless_ignored_and_max_tokens_gives_length() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(4, 5, 0)).expect("valid");
    let mut ignore = req(4, 3, 0);
    ignore.sampling.ignore_eos = true;
    s.add(2, ignore).expect("valid");
    let mut min = req(4, 5, 0);
    min.sampling.min_tokens = 2;
    s.add(3, min).expect("valid");
    let st = s.schedule();
    let outs = s
        .update(&st, ForwardOutput::Tokens(vec![0, 0, 0]))
        .expect("rows match");
    assert_eq!(finished(&outs, 1).expect("eos").reason, FinishReason::Stop);
    assert!(finished(&outs, 2).is_none());
    assert!(finished(&outs, 3).is_none(), "min_tokens not reached");
    let outs = run_to_completion(&mut s);
    assert_eq!(
        finished(&outs, 2).expect("done").reason,
        FinishReason::Length
    );
    assert_eq!(finished(&outs, 2).expect("done").usage.completion_tokens, 3);
}

#[test]
fn stop_token_id_stops() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    let mut r = req(4, 5, 0);
    r.sampling.stop_token_ids = vec![7];
    s.add(1, r).expect("valid");
    let (_, outs) = step(&mut s);
    assert_eq!(finished(&outs, 1).expect("stop").reason, FinishReason::Stop);
}

#[test]
fn invalid_requests_are_rejected() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 4);
    assert!(s.add(1, req(0, 5, 0)).is_err());
    assert!(
        s.add(1, req(16, 5, 0)).is_err(),
        "needs more than the pool can hold"
    );
    s.add(1, req(4, 5, 0)).expect("valid");
    assert!(s.add(1, req(4, 5, 0)).is_err(), "duplicate id");
}

#[test]
fn sequence_at_kv_capacity_finishes_with_length() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 2);
    let mut r = req(4, 100, 0);
    r.sampling.max_tokens = None;
    s.add(1, r).expect("valid");
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 1).expect("done");
    assert_eq!(
        (f.reason, f.usage.completion_tokens),
        (FinishReason::Length, 4)
    );
}

#[test]
fn prefill_only_holds_prompt_blocks_until_released() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add_prefill_only(1, req(10, 50, 0)).expect("valid");
    let (_, outs) = step(&mut s);
    assert!(finished(&outs, 1).is_some());
    assert_eq!(s.block_table(1).len(), 3);
    assert!(!s.has_unfinished());
    assert_eq!(s.kv().num_used(), 3);
    s.abort(1);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn remote_reservation_skips_cached_prefix_and_decodes_after_commit() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(8, 1, 0)).expect("valid");
    run_to_completion(&mut s);
    let r = s.reserve_remote(2, req(10, 3, 0)).expect("fits");
    assert_eq!(
        (r.block_ids.len(), r.skip_blocks, r.cached_tokens),
        (3, 2, 8)
    );
    assert!(!s.has_unfinished());
    let first = s.commit_remote(2, 9, None).expect("reserved");
    assert_eq!((first.token, first.finished), (9, None));
    let (st, _) = step(&mut s);
    assert_eq!(
        st.seqs[0],
        ScheduledSeq {
            seq_id: 2,
            num_new_tokens: 1,
            needs_logits: true
        }
    );
    assert_eq!(st.batch.seqs[0].start_pos, 10);
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 2).expect("done");
    assert_eq!((f.usage.completion_tokens, f.usage.cached_tokens), (3, 8));
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn dropped_reservation_frees_its_blocks() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 8);
    s.reserve_remote(1, req(10, 3, 0)).expect("fits");
    assert_eq!(s.kv().num_used(), 3);
    assert!(
        s.reserve_remote(2, req(24, 3, 0)).is_err(),
        "6 more blocks do not fit"
    );
    s.abort(1);
    assert_eq!(s.kv().num_used(), 0);
    s.check_invariants().expect("invariants");
}

#[test]
fn backend_row_mismatch_is_an_error() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(4, 5, 0)).expect("valid");
    let st = s.schedule();
    let err = s
        .update(&st, ForwardOutput::Tokens(vec![]))
        .expect_err("one row expected");
    assert!(matches!(
        err,
        EngineError::BackendRows {
            expected: 1,
            actual: 0
        }
    ));
    let failed = s.fail_step(&st);
    assert_eq!(failed[0].1.reason, FinishReason::Error);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn logits_output_is_sampled_per_sequence() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    let mut r = req(4, 1, 0);
    r.sampling.logprobs = true;
    s.add(1, r).expect("valid");
    let st = s.schedule();
    let out = ForwardOutput::Logits {
        vocab_size: 3,
        data: vec![0.0, 5.0, 1.0],
    };
    let outs = s.update(&st, out).expect("rows match");
    assert_eq!(outs[0].token, 1);
    assert!(outs[0].logprobs.is_some());
}

#[test]
fn committed_remote_sequence_waiting_gives_blocks_back_under_pressure() {
    // 5 blocks; the committed slot holds 1 while it waits behind a sequence
    // that needs all 5.
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Fcfs), 5);
    s.add(1, req_with(12, 8, 0, 100)).expect("valid");
    s.reserve_remote(2, req_with(3, 2, 0, 200)).expect("fits");
    s.commit_remote(2, 9, None).expect("reserved");
    let outs = run_to_completion(&mut s);
    assert_eq!(finished(&outs, 1).expect("done").usage.completion_tokens, 8);
    assert_eq!(finished(&outs, 2).expect("done").usage.completion_tokens, 2);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn abort_between_schedule_and_update_keeps_rows_aligned() {
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Fcfs), 64);
    s.add(1, req(4, 5, 0)).expect("valid");
    s.add(2, req(4, 5, 0)).expect("valid");
    let st = s.schedule();
    s.abort(1);
    let outs = s
        .update(&st, ForwardOutput::Tokens(vec![11, 22]))
        .expect("rows match");
    assert_eq!((outs.len(), outs[0].seq_id, outs[0].token), (1, 2, 22));
    s.check_invariants().expect("invariants");
}

/// Runs `s` until `id` is admitted again (or finishes), returning the step
/// that (re)admitted it.
fn step_until_admitted(s: &mut Scheduler, id: SeqId) -> ScheduledStep {
    for _ in 0..1_000 {
        let (st, _) = step(s);
        if st.admitted.contains(&id) {
            return st;
        }
    }
    panic!("sequence {id} was never admitted again");
}

fn chunk_of(st: &ScheduledStep, id: SeqId) -> (usize, usize) {
    let i = st
        .seqs
        .iter()
        .position(|x| x.seq_id == id)
        .expect("scheduled");
    (st.batch.seqs[i].start_pos, st.seqs[i].num_new_tokens)
}

#[test]
fn seq_limit_victim_parks_its_blocks_and_resumes_with_only_its_next_token() {
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req_with(10, 20, 0, 100)).expect("valid");
    for _ in 0..4 {
        step(&mut s); // prefill, then 3 decodes: 14 tokens, 13 computed
    }
    let table = s.block_table(1).to_vec();
    s.add(2, req_with(4, 2, 5, 200)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(
        (st.preempted.clone(), st.admitted.clone()),
        (vec![1], vec![2])
    );
    assert_eq!(s.block_table(1), &table[..], "the victim keeps its blocks");
    let st = step_until_admitted(&mut s, 1);
    assert_eq!(chunk_of(&st, 1), (13, 1), "only the next token is computed");
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 1).expect("done");
    assert_eq!(f.usage.completion_tokens, 20);
    assert_eq!(
        f.usage.preemption,
        Preemption {
            count: 1,
            recomputed_tokens: 0
        }
    );
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn kv_victim_recomputes_at_most_its_partial_block_when_nothing_was_evicted() {
    // 6 blocks of 4. Seq 1 (priority 0) computes 10 tokens (2 full blocks
    // and 2 tokens of a third); seq 2 (priority 5) needs 4 blocks with 3 free.
    let mut c = cfg(4, 100, SchedulingPolicy::Priority);
    c.max_model_len = 24;
    let mut s = sched(c, 6);
    s.add(1, req_with(9, 8, 0, 100)).expect("valid");
    step(&mut s);
    step(&mut s);
    s.add(2, req_with(16, 1, 5, 200)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(
        (st.preempted.clone(), st.admitted.clone()),
        (vec![1], vec![2])
    );
    assert!(s.block_table(1).is_empty(), "blocks went back to the pool");
    assert_eq!(
        s.kv()
            .cached_prefix_len(&sluice_tokens::sequence_block_hashes(
                &req_with(9, 0, 0, 100).prompt,
                BS
            )),
        2,
        "its full blocks stay cached"
    );
    let st = step_until_admitted(&mut s, 1);
    let (start, n) = chunk_of(&st, 1);
    assert_eq!((start, n), (8, 3), "2 recomputed tokens and the next one");
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 1).expect("done");
    assert_eq!(f.usage.completion_tokens, 8);
    assert_eq!(f.usage.preemption.recomputed_tokens, 2);
    assert!(f.usage.preemption.recomputed_tokens < BS);
    assert_eq!(s.load().recomputed_tokens, 2);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn parked_blocks_go_back_before_a_running_sequence_is_preempted() {
    // Seq 1 is parked by seq 2 at the slot limit; seq 2 then needs one block
    // more than are free: seq 1's parked blocks are released (its partial
    // block serves seq 2, its full ones stay cached), nobody running is
    // preempted.
    let mut c = cfg(1, 100, SchedulingPolicy::Priority);
    c.max_model_len = 40;
    let mut s = sched(c, 10);
    s.add(1, req_with(12, 20, 0, 100)).expect("valid"); // 3 blocks, 4 with its first decode
    step(&mut s);
    step(&mut s);
    s.add(2, req_with(14, 12, 5, 200)).expect("valid"); // 4 blocks, 7 by its end
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![1]);
    assert!(!s.block_table(1).is_empty());
    let mut preempted = Vec::new();
    while s.contains(2) {
        preempted.extend(step(&mut s).0.preempted);
    }
    assert!(preempted.is_empty(), "no running sequence was preempted");
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 1).expect("done");
    assert_eq!(f.usage.completion_tokens, 20);
    assert_eq!(f.usage.preemption.count, 1);
    assert!(f.usage.preemption.recomputed_tokens < BS);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn evicted_victim_recomputes_what_it_lost_and_completes() {
    // Seq 1's blocks go back under pressure, then seq 2 and 3 take every
    // block of the pool: seq 1 resumes from scratch.
    let mut c = cfg(4, 100, SchedulingPolicy::Priority);
    c.max_model_len = 32;
    let mut s = sched(c, 8);
    s.add(1, req_with(12, 10, 0, 100)).expect("valid");
    step(&mut s);
    step(&mut s); // 13 computed
    s.add(2, req_with(24, 1, 5, 200)).expect("valid"); // 6 blocks
    s.add(3, req_with(6, 8, 4, 300)).expect("valid"); // 2 blocks, 4 by its end
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 1).expect("done");
    assert_eq!(f.reason, FinishReason::Length);
    assert_eq!(f.usage.completion_tokens, 10);
    assert!(f.usage.preemption.count >= 1);
    assert!(
        f.usage.preemption.recomputed_tokens >= 12,
        "its cached blocks were evicted: {:?}",
        f.usage.preemption
    );
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn victim_is_the_cheapest_not_the_latest_arrival() {
    // Three priority-0 sequences of 8, 6 and 7 prompt tokens: after their
    // prefill seq 1's tokens fill whole cached blocks (nothing to recompute),
    // seq 2 and 3 would recompute 2 and 3.
    let mut s = sched(cfg(3, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req_with(8, 20, 0, 100)).expect("valid");
    s.add(2, req_with(6, 20, 0, 200)).expect("valid");
    s.add(3, req_with(7, 20, 0, 300)).expect("valid");
    step(&mut s);
    s.add(4, req_with(4, 2, 5, 400)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![1]);
}

#[test]
fn victim_must_free_enough_blocks_to_be_chosen() {
    // Seq 1 (priority 0) shares its two full blocks with seq 3 (priority 9):
    // preempting it frees one block. Seq 2 (priority 0) would recompute more
    // but frees two, which seq 4 needs.
    let mut s = sched(cfg(4, 100, SchedulingPolicy::Priority), 6);
    s.add(1, req_with(9, 20, 0, 100)).expect("valid");
    s.add(2, req_with(6, 20, 0, 200)).expect("valid");
    step(&mut s);
    s.add(3, req_with(9, 20, 9, 100)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, vec![3]);
    assert_eq!(s.kv().num_free(), 0);
    assert_eq!(s.kv().exclusive_blocks(1), 1);
    s.add(4, req_with(8, 2, 5, 400)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![2]);
    assert_eq!(st.admitted, vec![4]);
}

#[test]
fn sequence_finishing_next_step_is_not_preempted() {
    // Seq 2 (latest, cheapest) produces its last token next step: seq 1
    // gives way instead.
    let mut s = sched(cfg(2, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req_with(6, 20, 0, 100)).expect("valid");
    s.add(2, req_with(8, 2, 0, 200)).expect("valid");
    step(&mut s);
    s.add(3, req_with(4, 2, 5, 300)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![1]);

    // With only a finishing one running, the newcomer waits one step.
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req_with(8, 2, 0, 100)).expect("valid");
    step(&mut s);
    s.add(2, req_with(4, 2, 5, 200)).expect("valid");
    let (st, outs) = step(&mut s);
    assert!(st.preempted.is_empty() && st.admitted.is_empty());
    assert!(finished(&outs, 1).is_some());
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, vec![2]);
}

#[test]
fn preempted_generated_blocks_are_stored_under_their_chain() {
    // Seq 1's decoded tokens fill a block before it is preempted for blocks;
    // that block was published with its parent and serves the resume.
    let mut c = cfg(4, 100, SchedulingPolicy::Priority);
    c.max_model_len = 24;
    let mut s = sched(c, 6);
    s.add(1, req_with(4, 10, 0, 100)).expect("valid");
    for _ in 0..6 {
        step(&mut s); // 4 prompt + 5 decoded tokens computed: 2 full blocks
    }
    let events = s
        .kv()
        .events()
        .subscribe(0)
        .expect("ring")
        .backlog
        .into_iter()
        .map(|r| r.event)
        .collect::<Vec<_>>();
    let prompt = req_with(4, 0, 0, 100).prompt;
    let h0 = sluice_tokens::sequence_block_hashes(&prompt, BS)[0];
    let stored_second = events.iter().find_map(|e| match e {
        KvEvent::Stored {
            parent_hash: Some(p),
            block_hashes,
        } if *p == h0 => Some(block_hashes[0]),
        _ => None,
    });
    let h1 = stored_second.expect("the decoded block was stored under its parent");
    s.add(2, req_with(16, 1, 5, 200)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![1]);
    assert_eq!(s.kv().cached_prefix_len(&[h0, h1]), 2);
    let st = step_until_admitted(&mut s, 1);
    assert_eq!(chunk_of(&st, 1).0, 8, "both blocks came from the cache");
    run_to_completion(&mut s);
    assert_eq!(s.kv().num_used(), 0);
}

#[test]
fn tokens_computed_again_after_a_preemption_are_counted() {
    // Without prefix caching a sequence preempted for blocks recomputes
    // everything it had computed: 8 prompt tokens.
    let kv = KvCache::new(5, BS, false, Arc::new(KvEventLog::new(64)));
    let mut s = Scheduler::new(cfg(8, 100, SchedulingPolicy::Fcfs), kv, vec![0]);
    s.add(1, req_with(8, 6, 0, 100)).expect("valid");
    s.add(2, req_with(8, 6, 0, 200)).expect("valid");
    step(&mut s);
    let (st, _) = step(&mut s);
    assert_eq!(st.preempted, vec![2]);
    let outs = run_to_completion(&mut s);
    let f = finished(&outs, 2).expect("done");
    assert_eq!(
        f.usage.preemption,
        Preemption {
            count: 1,
            recomputed_tokens: 8
        }
    );
    let last = outs.iter().rfind(|o| o.seq_id == 2).expect("outputs");
    assert_eq!(last.preemption, f.usage.preemption);
    assert_eq!(
        finished(&outs, 1).expect("done").usage.preemption,
        Preemption::default()
    );
    assert_eq!((s.load().preemptions, s.load().recomputed_tokens), (1, 8));
}

/// The Llama fixture of `tests/parity.rs` (2 layers, vocab 256, random
/// weights) on the CPU backend, with `num_blocks` blocks of `BS` tokens.
fn cpu_model(num_blocks: usize) -> CpuBackend {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parity/llama_untied");
    CpuBackend::from_path(&dir, num_blocks, BS).expect("the fixture model loads")
}

/// A greedy request on the fixture model that ignores EOS, so every run
/// produces `max_tokens` tokens.
fn cpu_req(prompt_len: usize, max_tokens: usize, priority: i32, base: u32) -> Request {
    let mut r = req_with(prompt_len, max_tokens, priority, base);
    r.sampling.ignore_eos = true;
    r
}

/// Steps `s` on the real model until `stop` holds (or nothing is left),
/// appending every sequence's tokens to `out`.
fn run_cpu(
    s: &mut Scheduler,
    model: &mut CpuBackend,
    out: &mut HashMap<SeqId, Vec<u32>>,
    stop: impl Fn(&Scheduler) -> bool,
) {
    for _ in 0..2_000 {
        if !s.has_unfinished() || stop(s) {
            return;
        }
        let st = s.schedule();
        let logits = model.forward(&st.batch).expect("forward");
        for o in s.update(&st, logits).expect("rows match") {
            out.entry(o.seq_id).or_default().push(o.token);
        }
        s.check_invariants().expect("invariants");
    }
    panic!("the model run did not finish");
}

/// Each request alone on an idle engine: the tokens a preempted run must reproduce.
fn cpu_reference(reqs: &[Request]) -> Vec<Vec<u32>> {
    reqs.iter()
        .map(|r| {
            let mut s = sched(cfg(1, 100, SchedulingPolicy::Fcfs), 64);
            let mut model = cpu_model(64);
            let mut out = HashMap::new();
            s.add(1, r.clone()).expect("valid");
            run_cpu(&mut s, &mut model, &mut out, |_| false);
            out.remove(&1).expect("tokens")
        })
        .collect()
}

/// Runs `reqs` (ids 1, 2, …) on the real model: request `i` is added once
/// `start[i]` steps have run. Returns every request's tokens and usage.
fn cpu_preempted_run(
    c: SchedulerConfig,
    num_blocks: usize,
    reqs: &[Request],
    start: &[usize],
) -> (Vec<Vec<u32>>, Vec<Usage>) {
    let mut s = sched(c, num_blocks);
    let mut model = cpu_model(num_blocks);
    let mut out: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let mut usage = HashMap::new();
    let mut steps = 0;
    for (i, r) in reqs.iter().enumerate() {
        while steps < start[i] {
            let st = s.schedule();
            let logits = model.forward(&st.batch).expect("forward");
            for o in s.update(&st, logits).expect("rows match") {
                out.entry(o.seq_id).or_default().push(o.token);
                if let Some(f) = o.finished {
                    usage.insert(o.seq_id, f.usage);
                }
            }
            s.check_invariants().expect("invariants");
            steps += 1;
        }
        s.add(i as SeqId + 1, r.clone()).expect("valid");
    }
    while s.has_unfinished() {
        let st = s.schedule();
        let logits = model.forward(&st.batch).expect("forward");
        for o in s.update(&st, logits).expect("rows match") {
            out.entry(o.seq_id).or_default().push(o.token);
            if let Some(f) = o.finished {
                usage.insert(o.seq_id, f.usage);
            }
        }
        s.check_invariants().expect("invariants");
    }
    assert_eq!(s.kv().num_used(), 0);
    (1..=reqs.len() as SeqId)
        .map(|id| (out.remove(&id).expect("tokens"), usage[&id]))
        .unzip()
}

/// One preemption scenario on the real model.
struct CpuCase {
    what: &'static str,
    cfg: SchedulerConfig,
    num_blocks: usize,
    reqs: Vec<Request>,
    /// Steps run before each request is added.
    start: Vec<usize>,
    /// What the first request's usage must show.
    check: fn(&Usage) -> bool,
}

#[test]
fn preempted_sequences_generate_the_unpreempted_tokens_on_the_cpu_model() {
    let prio = |n: usize, budget: usize, m: usize| {
        let mut c = cfg(n, budget, SchedulingPolicy::Priority);
        c.max_model_len = m;
        c
    };
    let cases = [
        CpuCase {
            what: "parked at the slot limit while decoding",
            cfg: prio(1, 100, 1024),
            num_blocks: 64,
            reqs: vec![cpu_req(10, 24, 0, 10), cpu_req(7, 6, 5, 40)],
            start: vec![0, 5],
            check: |u| u.preemption.count == 1 && u.preemption.recomputed_tokens == 0,
        },
        CpuCase {
            what: "parked at the slot limit mid-prefill (chunks of 4)",
            cfg: prio(1, 4, 1024),
            num_blocks: 64,
            reqs: vec![cpu_req(14, 10, 0, 10), cpu_req(5, 4, 5, 40)],
            start: vec![0, 2],
            check: |u| u.preemption.count == 1 && u.preemption.recomputed_tokens == 0,
        },
        CpuCase {
            what: "blocks given back, resumed from the prefix cache",
            cfg: prio(4, 100, 24),
            num_blocks: 6,
            reqs: vec![cpu_req(9, 8, 0, 10), cpu_req(16, 1, 5, 40)],
            start: vec![0, 2],
            check: |u| u.preemption.count == 1 && u.preemption.recomputed_tokens == 2,
        },
        CpuCase {
            what: "blocks given back, then evicted by others",
            cfg: prio(4, 100, 32),
            num_blocks: 8,
            reqs: vec![
                cpu_req(12, 10, 0, 10),
                cpu_req(24, 1, 5, 40),
                cpu_req(6, 8, 4, 80),
            ],
            start: vec![0, 2, 2],
            check: |u| u.preemption.count >= 1 && u.preemption.recomputed_tokens >= 12,
        },
    ];
    for c in cases {
        let want = cpu_reference(&c.reqs);
        let (got, usage) = cpu_preempted_run(c.cfg, c.num_blocks, &c.reqs, &c.start);
        assert_eq!(got, want, "{}", c.what);
        assert!((c.check)(&usage[0]), "{}: {:?}", c.what, usage[0]);
    }
}

#[test]
fn mocker_charges_a_resume_only_for_the_tokens_it_computes() {
    let mocker = MockerBackend::new(MockerConfig {
        block_size: BS,
        ..MockerConfig::default()
    })
    .expect("valid");
    let ms = |st: &ScheduledStep| mocker.step_duration(&st.batch).as_secs_f64() * 1000.0;

    // Parked at the slot limit: the resume is one decode row.
    let mut s = sched(cfg(1, 100, SchedulingPolicy::Priority), 64);
    s.add(1, req_with(10, 20, 0, 100)).expect("valid");
    for _ in 0..4 {
        step(&mut s);
    }
    s.add(2, req_with(4, 1, 5, 200)).expect("valid");
    step(&mut s);
    let st = step_until_admitted(&mut s, 1);
    assert_eq!(st.seqs.len(), 1);
    let a = st.batch.active_kv_tokens as f64 / st.batch.total_kv_tokens as f64;
    assert!((ms(&st) - decode_ms(a)).abs() < 1e-5, "{} ms", ms(&st));

    // Given back under pressure: the resume prefills its 3 uncached tokens,
    // not its 11.
    let mut c = cfg(4, 100, SchedulingPolicy::Priority);
    c.max_model_len = 24;
    let mut s = sched(c, 6);
    s.add(1, req_with(9, 8, 0, 100)).expect("valid");
    step(&mut s);
    step(&mut s);
    s.add(2, req_with(16, 1, 5, 200)).expect("valid");
    step(&mut s);
    let st = step_until_admitted(&mut s, 1);
    assert_eq!(st.seqs.len(), 1);
    assert!((ms(&st) - prefill_ms(3)).abs() < 1e-5, "{} ms", ms(&st));
}

fn new_tokens(st: &ScheduledStep, id: SeqId) -> usize {
    st.seqs
        .iter()
        .find(|s| s.seq_id == id)
        .map_or(0, |s| s.num_new_tokens)
}

#[test]
fn a_short_prompt_is_not_starved_behind_a_long_prefill_and_a_long_one_alone_fills_the_step() {
    let mut c = cfg(4, 32, SchedulingPolicy::Fcfs);
    c.long_prefill_token_threshold = 8;
    let mut s = sched(c, 64);
    // Routers read the rule from the load report.
    assert_eq!(s.load().long_prefill_token_threshold, 8);
    s.add(1, req_with(100, 1, 0, 1)).expect("valid");
    // Alone, the long prefill takes the whole budget (the top-up).
    let (st, _) = step(&mut s);
    assert_eq!(new_tokens(&st, 1), 32);
    // A 5-token prompt arrives: it is prefilled in the next step, next to
    // the long one, which gets its 8 and then what is left (32 − 8 − 5).
    s.add(2, req_with(5, 1, 0, 500)).expect("valid");
    let (st, out) = step(&mut s);
    assert_eq!((new_tokens(&st, 1), new_tokens(&st, 2)), (27, 5));
    assert!(
        out.iter().any(|o| o.seq_id == 2),
        "the short prompt has its first token"
    );
    // A second long prompt waits for the first long prefill to finish
    // instead of sharing the steps with it.
    s.add(3, req_with(60, 1, 0, 900)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!((new_tokens(&st, 1), new_tokens(&st, 3)), (32, 0));
    assert_eq!(st.passed_over, [3]);
    // A short prompt queued behind that waiting long one is not held up
    // by it: it goes next to the long prefill in progress.
    s.add(4, req_with(5, 1, 0, 1300)).expect("valid");
    let (st, out) = step(&mut s);
    assert_eq!(
        (new_tokens(&st, 1), new_tokens(&st, 3), new_tokens(&st, 4)),
        (9, 0, 5)
    );
    assert_eq!(st.passed_over, [3], "passed over, and said so");
    assert!(
        out.iter().any(|o| o.seq_id == 4),
        "first token of the short one"
    );
    s.check_invariants()
        .expect("the passed-over prompt holds no blocks");

    // Without the threshold the short prompt waits for the long prefill.
    let mut s = sched(cfg(4, 32, SchedulingPolicy::Fcfs), 64);
    s.add(1, req_with(100, 1, 0, 1)).expect("valid");
    step(&mut s);
    s.add(2, req_with(5, 1, 0, 500)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!((new_tokens(&st, 1), new_tokens(&st, 2)), (32, 0));
}

/// An engine with one sequence running per output length in `lengths` (ids
/// from 1) and one more that ended after its second token, leaving one slot
/// free after two steps; then the `waiting` prompts (id, priority) arrive.
fn nearly_full(c: SchedulerConfig, lengths: &[usize], waiting: &[(SeqId, i32)]) -> Scheduler {
    let mut s = sched(c, 1024);
    for (i, &len) in lengths.iter().enumerate() {
        s.add(i as SeqId + 1, req_with(4, len, 0, 10 * i as u32))
            .expect("valid");
    }
    s.add(lengths.len() as SeqId + 1, req(4, 2, 0))
        .expect("valid");
    step(&mut s);
    step(&mut s);
    assert_eq!(s.num_running(), lengths.len(), "one slot is free");
    for &(id, priority) in waiting {
        s.add(id, req_with(4, 3, priority, 1000 + id as u32))
            .expect("valid");
    }
    s
}

#[test]
fn admission_waits_for_slots_about_to_free_to_share_their_prefill_step() {
    let waiting: Vec<(SeqId, i32)> = (9..=16).map(|id| (id, 0)).collect();
    // Off: the prompt takes the free slot at once, in a prefill step of its
    // own; the seven freed two steps later make another.
    let mut off = nearly_full(cfg(8, 1000, SchedulingPolicy::Fcfs), &[5; 7], &waiting);
    let (st, _) = step(&mut off);
    assert_eq!(st.admitted, vec![9]);
    assert!(!st.admission_held);

    // On: the seven running ones end within three steps; the prompt waits
    // for them and all eight are admitted in one step.
    let mut c = cfg(8, 1000, SchedulingPolicy::Fcfs);
    c.admission_wait_steps = 3;
    let mut s = nearly_full(c, &[5; 7], &waiting);
    for _ in 0..3 {
        let (st, _) = step(&mut s);
        assert!(st.admitted.is_empty() && st.admission_held);
    }
    assert_eq!(s.num_running(), 0);
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, (9..=16).collect::<Vec<_>>());
    assert_eq!(s.load().admission_held_steps, 3);
    let outs = run_to_completion(&mut s);
    // The one free slot held back the first prompt; its usage says so.
    let held = |id| finished(&outs, id).map(|f| f.usage.admission_held_steps);
    assert_eq!(held(9), Some(3));
    assert!((10..=16).all(|id| held(id) == Some(0)));
}

#[test]
fn more_prompts_than_free_slots_wait_for_the_slots_about_to_free_however_many_are_free() {
    // Half the slots free and four running ones ending within three steps.
    let mut c = cfg(8, 1000, SchedulingPolicy::Fcfs);
    c.admission_wait_steps = 3;
    // No more prompts than free slots: waiting would add no one to their
    // prefill step; they go at once.
    let fit: Vec<(SeqId, i32)> = (9..=12).map(|id| (id, 0)).collect();
    let mut s = nearly_full(c.clone(), &[5; 4], &fit);
    assert_eq!(step(&mut s).0.admitted, (9..=12).collect::<Vec<_>>());
    // Twice as many: the four about to free take the other half, so all
    // eight share one prefill step instead of two.
    let more: Vec<(SeqId, i32)> = (9..=16).map(|id| (id, 0)).collect();
    let mut s = nearly_full(c, &[5; 4], &more);
    for _ in 0..3 {
        let (st, _) = step(&mut s);
        assert!(st.admitted.is_empty() && st.admission_held);
    }
    assert_eq!(step(&mut s).0.admitted, (9..=16).collect::<Vec<_>>());
}

#[test]
fn admission_does_not_wait_when_no_slot_frees_soon_or_past_its_limit() {
    // Nothing running ends within the wait: admitted at once.
    let mut c = cfg(8, 1000, SchedulingPolicy::Fcfs);
    c.admission_wait_steps = 3;
    let mut s = nearly_full(c, &[20; 7], &[(9, 0)]);
    assert_eq!(step(&mut s).0.admitted, vec![9]);

    // Running sequences end one a step, so one always ends soon: the prompt
    // still waits no more than the limit.
    let mut c = cfg(64, 1000, SchedulingPolicy::Fcfs);
    c.admission_wait_steps = 2;
    let lengths: Vec<usize> = (4..4 + 63).collect();
    let mut s = nearly_full(c, &lengths, &[(100, 0)]);
    for _ in 0..2 {
        assert!(step(&mut s).0.admission_held);
    }
    assert_eq!(step(&mut s).0.admitted, vec![100]);
    assert_eq!(s.load().admission_held_steps, 2);
}

#[test]
fn a_prompt_above_every_running_sequence_never_waits_for_a_slot() {
    let mut c = cfg(8, 1000, SchedulingPolicy::Priority);
    c.admission_wait_steps = 3;
    let mut s = nearly_full(c.clone(), &[5; 7], &[(9, 1)]);
    assert_eq!(step(&mut s).0.admitted, vec![9]);
    // Of the running sequences' priority, it waits like under fcfs.
    let mut s = nearly_full(c.clone(), &[5; 7], &[(9, 0)]);
    assert!(step(&mut s).0.admission_held);
    // With work of its own priority running too (a busy band above lower
    // work), it waits for its peers' slots like them.
    c.max_num_seqs = 9;
    let mut s = nearly_full(c, &[5; 7], &[(9, 1)]);
    assert_eq!(step(&mut s).0.admitted, vec![9], "alone above everything");
    s.add(10, req_with(4, 3, 1, 1010)).expect("valid");
    let (st, _) = step(&mut s);
    assert!(
        st.admitted.is_empty() && st.admission_held,
        "priority 1 runs now: it waits for the slots about to free"
    );
}

#[test]
fn a_parked_victim_leaves_its_slot_to_the_work_that_outranks_it_then_resumes_at_once() {
    let mut c = cfg(8, 1000, SchedulingPolicy::Priority);
    c.admission_wait_steps = 3;
    let mut s = sched(c, 1024);
    for id in 1..=6 {
        s.add(id, req_with(4, 5, 0, 10 * id as u32)).expect("valid");
    }
    s.add(7, req_with(4, 2, 0, 70)).expect("valid");
    s.add(8, req_with(4, 20, 0, 80)).expect("valid");
    step(&mut s);
    // A higher priority takes the last arrival's slot; 7 ends in the same step.
    s.add(9, req_with(4, 2, 1, 90)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(
        (st.preempted.as_slice(), st.admitted.as_slice()),
        (&[8][..], &[9][..])
    );
    // A slot is free, but 9 (priority 1) still runs: 8 leaves the slot to
    // that work's next prompt rather than resume and be preempted again.
    let (st, _) = step(&mut s);
    assert!(st.admitted.is_empty() && st.admission_held);
    s.add(10, req_with(4, 1, 1, 100)).expect("valid");
    // The prompt takes the free slot (no preemption, its prefill shared
    // with no victim's churn); 9 has ended meanwhile, and in the same pass
    // 8 resumes in the slot it left, without waiting for the six about to
    // end: a decode row has no prefill step to share.
    let (st, _) = step(&mut s);
    assert_eq!(st.admitted, vec![10, 8]);
    assert!(st.preempted.is_empty() && !st.admission_held);
}

#[test]
fn a_grammar_masks_every_token_and_holds_across_steps() {
    use sluice_tokens::grammar::{GrammarSpec, Grammars};
    use sluice_tokens::{SpecialTokens, Tokenizer, train_byte_level_bpe};
    let trained =
        train_byte_level_bpe(&["aaaa bbbb abab baba"], 280, &["<eos>"], None).expect("trained");
    let eos = trained.token_to_id("<eos>").expect("eos");
    let tok = Tokenizer::from_parts(
        trained.inner().clone(),
        SpecialTokens {
            eos_token_ids: vec![eos],
            ..Default::default()
        },
    );
    let vocab = tok.vocab_size();
    let grammars = Grammars::new(&tok, vocab).expect("grammars");
    let mut s = Scheduler::new(
        cfg(4, 100, SchedulingPolicy::Fcfs),
        KvCache::new(64, BS, true, Arc::new(KvEventLog::new(64))),
        vec![eos],
    );
    let mut r = req(4, 12, 0);
    r.constraint = Some(
        grammars
            .constrain(&GrammarSpec::Regex("b{2,6}".into()))
            .expect("compiles"),
    );
    s.add(1, r).expect("valid");
    // Logits that favour token 7 (not a `b`) every step: the mask, computed
    // beside the "forward pass", leaves only what the grammar allows.
    let mut tokens = Vec::new();
    let mut fin = None;
    for _ in 0..64 {
        if !s.has_unfinished() {
            break;
        }
        let st = s.schedule();
        let rows = st.seqs.iter().filter(|x| x.needs_logits).count();
        let mut data = vec![0.0f32; rows * vocab];
        for row in 0..rows {
            data[row * vocab + 7] = 10.0;
        }
        let outs = s
            .update(
                &st,
                ForwardOutput::Logits {
                    vocab_size: vocab,
                    data,
                },
            )
            .expect("rows match");
        for o in outs {
            tokens.push(o.token);
            fin = fin.or(o.finished);
        }
    }
    let fin = fin.expect("finished");
    let text = tok.decode(&tokens, true).expect("decoded");
    assert!(
        (2..=6).contains(&text.len()) && text.chars().all(|c| c == 'b'),
        "{text:?} {tokens:?}"
    );
    assert_eq!(fin.reason, FinishReason::Stop, "ended by EOS once complete");
}

/// The sequences a step computes, (id, tokens) each, in step order.
fn rows(st: &ScheduledStep) -> Vec<(SeqId, usize)> {
    st.seqs
        .iter()
        .map(|x| (x.seq_id, x.num_new_tokens))
        .collect()
}

/// A scheduler of budget 8 with `prefill_first_steps` = `steps`, running
/// `decoding` (ids from 1) past their prefill.
fn decoding_with_prefill_first(
    max_num_seqs: usize,
    policy: SchedulingPolicy,
    steps: usize,
    decoding: Vec<Request>,
) -> Scheduler {
    let mut c = cfg(max_num_seqs, 8, policy);
    c.prefill_first_steps = steps;
    let mut s = sched(c, 64);
    for (id, r) in (1..).zip(decoding) {
        s.add(id, r).expect("valid");
    }
    step(&mut s);
    s
}

#[test]
fn prefill_first_leaves_decode_rows_out_at_most_its_steps_in_a_row() {
    // Budget 8: a 20-token prompt takes three steps. Two sequences decode.
    let run = |prefill_first_steps| {
        let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
        let mut s =
            decoding_with_prefill_first(8, SchedulingPolicy::Fcfs, prefill_first_steps, decoding);
        s.add(3, req_with(20, 2, 0, 100)).expect("valid");
        let steps: Vec<_> = (0..4).map(|_| rows(&step(&mut s).0)).collect();
        (steps, s.load().decode_stalled_steps)
    };
    // What the load report says after each step, for a router to follow the
    // rule: (steps in a row that left the rows out, prompts mid-prefill).
    let reported = |prefill_first_steps| {
        let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
        let mut s =
            decoding_with_prefill_first(8, SchedulingPolicy::Fcfs, prefill_first_steps, decoding);
        s.add(3, req_with(20, 2, 0, 100)).expect("valid");
        (0..3)
            .map(|_| {
                step(&mut s);
                let l = s.load();
                (l.prefill_first_steps, l.stalled_in_a_row, l.prefilling)
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(reported(0), vec![(0, 0, 1), (0, 0, 1), (0, 0, 1)]);
    assert_eq!(reported(2), vec![(2, 1, 1), (2, 2, 1), (2, 0, 0)]);
    // Off: every step carries both decode rows, the prompt the rest.
    let (off, stalled) = run(0);
    assert_eq!(
        off,
        vec![
            vec![(1, 1), (2, 1), (3, 6)],
            vec![(1, 1), (2, 1), (3, 6)],
            vec![(1, 1), (2, 1), (3, 6)],
            vec![(1, 1), (2, 1), (3, 2)],
        ]
    );
    assert_eq!(stalled, 0);
    // Two steps in a row: the prompt gets the whole step twice, then the
    // decode rows ride with its last chunk; its first token comes a step
    // sooner.
    let (on, stalled) = run(2);
    assert_eq!(
        on,
        vec![
            vec![(3, 8)],
            vec![(3, 8)],
            vec![(1, 1), (2, 1), (3, 4)],
            vec![(1, 1), (2, 1), (3, 1)],
        ]
    );
    assert_eq!(stalled, 2);
}

#[test]
fn prefill_first_leaves_rows_out_again_only_for_a_prefill_in_progress() {
    // A 4-token prompt has a step to itself; one arriving after it does
    // not stall the decode rows a second time: it rides with them.
    let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
    let mut s = decoding_with_prefill_first(8, SchedulingPolicy::Fcfs, 2, decoding);
    s.add(3, req_with(4, 5, 0, 100)).expect("valid");
    assert_eq!(rows(&step(&mut s).0), vec![(3, 4)]);
    // Reported: one step has left the rows out, and no prompt is mid-prefill.
    let l = s.load();
    assert_eq!((l.stalled_in_a_row, l.prefilling), (1, 0));
    s.add(4, req_with(4, 5, 0, 200)).expect("valid");
    assert_eq!(rows(&step(&mut s).0), vec![(1, 1), (2, 1), (3, 1), (4, 4)]);
    assert_eq!(s.load().decode_stalled_steps, 1);
}

#[test]
fn prefill_first_decodes_when_no_prompt_can_start() {
    // One slot left to no one: the waiting prompt cannot be admitted, so
    // the step decodes rather than stall for nothing.
    let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
    let mut s = decoding_with_prefill_first(2, SchedulingPolicy::Fcfs, 4, decoding);
    s.add(3, req_with(20, 2, 0, 100)).expect("valid");
    for _ in 0..3 {
        let (st, _) = step(&mut s);
        assert_eq!(rows(&st), vec![(1, 1), (2, 1)]);
    }
    assert_eq!(s.load().decode_stalled_steps, 0);
}

#[test]
fn prefill_first_mixes_while_more_wait_than_slots_are_free() {
    // Three slots, two decoding, two prompts waiting: at capacity, the
    // prompt that takes the free slot rides with the decode rows.
    let run = |prompts: u64| {
        let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
        let mut s = decoding_with_prefill_first(3, SchedulingPolicy::Fcfs, 2, decoding);
        for id in 3..3 + prompts {
            s.add(id, req_with(4, 2, 0, 100 + 10 * id as u32))
                .expect("valid");
        }
        let (st, _) = step(&mut s);
        (rows(&st), s.load().decode_stalled_steps)
    };
    assert_eq!(run(2), (vec![(1, 1), (2, 1), (3, 4)], 0));
    // Reported as no prefill first while more wait than slots are free.
    let decoding = vec![req(3, 50, 0), req(3, 50, 0)];
    let mut s = decoding_with_prefill_first(3, SchedulingPolicy::Fcfs, 2, decoding);
    s.add(3, req_with(4, 2, 0, 130)).expect("valid");
    assert_eq!(s.load().prefill_first_steps, 2);
    s.add(4, req_with(4, 2, 0, 140)).expect("valid");
    assert_eq!(s.load().prefill_first_steps, 0);
    // One waiting, one slot free: the prompt gets the step alone.
    assert_eq!(run(1), (vec![(3, 4)], 1));
}

#[test]
fn prefill_first_keeps_the_rows_of_higher_priorities_and_tpot_targets() {
    // Budget 8, a 20-token prompt of priority 1 arrives while three
    // sequences decode: one below it, one above it, one with a TPOT target.
    // The two that may not sit out decode, so the step pays for a decode
    // pass anyway and the row below rides along: an ordinary mixed step.
    let steady = Request {
        tpot_target: Some(std::time::Duration::from_millis(50)),
        ..req(3, 50, 0)
    };
    let decoding = vec![req(3, 50, 0), req(3, 50, 5), steady];
    let mut s = decoding_with_prefill_first(8, SchedulingPolicy::Priority, 2, decoding);
    s.add(4, req_with(20, 2, 1, 100)).expect("valid");
    let (st, _) = step(&mut s);
    let mut got = rows(&st);
    got.sort_unstable();
    assert_eq!(got, vec![(1, 1), (2, 1), (3, 1), (4, 5)]);
    assert_eq!(s.load().decode_stalled_steps, 0);
    // Reported as no prefill first while the TPOT-bound row decodes.
    assert_eq!(s.load().prefill_first_steps, 0);
    // A prompt above every decoding sequence has the step to itself.
    let decoding = vec![req(3, 50, 0), req(3, 50, 1)];
    let mut s = decoding_with_prefill_first(8, SchedulingPolicy::Priority, 2, decoding);
    s.add(3, req_with(20, 2, 3, 100)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(rows(&st), vec![(3, 8)]);
    assert_eq!(s.load().decode_stalled_steps, 1);
    // A prompt below every decoding sequence stalls none of them.
    let mut s = decoding_with_prefill_first(8, SchedulingPolicy::Priority, 2, vec![req(3, 50, 3)]);
    s.add(2, req_with(20, 2, 0, 100)).expect("valid");
    let (st, _) = step(&mut s);
    assert_eq!(rows(&st), vec![(1, 1), (2, 7)]);
    assert_eq!(s.load().decode_stalled_steps, 0);
}
