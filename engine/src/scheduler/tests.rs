use std::sync::Arc;

use super::*;
use crate::kv::KvEventLog;
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
