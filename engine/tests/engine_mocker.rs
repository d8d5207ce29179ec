//! The engine API end to end over the mocker backend: streams, prefix reuse,
//! cancellation, KV events, seeds, disaggregation hooks, balance, shutdown.

use std::time::Duration;

use sluice_engine::backend::mocker::{MockerOutput, MockerTiming};
use sluice_engine::kv::KvEvent;
use sluice_engine::{
    BalanceGroup, EngineConfig, EngineError, EngineHandle, FinishReason, MockerBackend,
    MockerConfig, Request, SamplingParams, SchedulerConfig, SchedulingPolicy,
};

const BS: usize = 4;

fn mocker_cfg(num_blocks: usize) -> MockerConfig {
    MockerConfig {
        vocab_size: 1024,
        block_size: BS,
        num_blocks,
        timing: MockerTiming::Instant,
        avoid_token_ids: vec![0],
        ..MockerConfig::default()
    }
}

fn engine_cfg() -> EngineConfig {
    EngineConfig {
        block_size: BS,
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            ..SchedulerConfig::default()
        },
        eos_token_ids: vec![0],
        event_ring_capacity: 256,
        ..EngineConfig::default()
    }
}

fn spawn_with(m: MockerConfig, cfg: EngineConfig) -> EngineHandle {
    let backend = MockerBackend::new(m).expect("valid mocker");
    EngineHandle::spawn(Box::new(backend), cfg).expect("engine starts")
}

fn spawn(num_blocks: usize) -> EngineHandle {
    spawn_with(mocker_cfg(num_blocks), engine_cfg())
}

fn req(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        request_id: "t".into(),
        prompt,
        sampling: SamplingParams {
            max_tokens: Some(max_tokens),
            ..SamplingParams::greedy()
        },
        priority: 0,
        constraint: None,
        first_token_by: None,
        tpot_target: None,
    }
}

async fn wait_idle(e: &EngineHandle) {
    let mut load = e.load();
    tokio::time::timeout(
        Duration::from_secs(5),
        load.wait_for(|l| l.active_blocks == 0 && l.running == 0 && l.waiting == 0),
    )
    .await
    .expect("engine went idle in time")
    .expect("engine alive");
}

#[tokio::test]
async fn generate_streams_tokens_and_finishes_with_usage() {
    let e = spawn(64);
    let mut stream = e.generate(req((1..=10).collect(), 5)).expect("valid");
    let mut tokens = Vec::new();
    let mut finish = None;
    while let Some(out) = stream.recv().await {
        assert_eq!(out.token_ids.len(), 1);
        tokens.extend(out.token_ids);
        finish = out.finished;
    }
    let f = finish.expect("finished");
    assert_eq!(tokens.len(), 5);
    assert_eq!(f.reason, FinishReason::Length);
    assert_eq!((f.usage.prompt_tokens, f.usage.completion_tokens), (10, 5));
    wait_idle(&e).await;
}

#[tokio::test]
async fn repeated_prompt_is_served_mostly_from_cache() {
    let e = spawn(64);
    let prompt: Vec<u32> = (1..=33).collect();
    let (first, f1) = e
        .generate(req(prompt.clone(), 4))
        .expect("valid")
        .collect()
        .await;
    let (second, f2) = e
        .generate(req(prompt.clone(), 4))
        .expect("valid")
        .collect()
        .await;
    assert_eq!(first, second, "mocker tokens are deterministic");
    assert_eq!(f1.expect("done").usage.cached_tokens, 0);
    assert_eq!(f2.expect("done").usage.cached_tokens, 32);
    assert_eq!(e.cached_prefix_tokens(&prompt), 32);
}

#[tokio::test]
async fn dropping_the_stream_aborts_and_frees_blocks() {
    let m = MockerConfig {
        timing: MockerTiming::Polynomial,
        speedup_ratio: 20.0,
        ..mocker_cfg(64)
    };
    let e = spawn_with(m, engine_cfg());
    let mut stream = e.generate(req((1..=20).collect(), 1000)).expect("valid");
    stream.recv().await.expect("first token");
    assert!(e.load().borrow().active_blocks > 0);
    drop(stream);
    wait_idle(&e).await;
}

#[tokio::test]
async fn kv_events_are_gap_free_and_replay_to_the_snapshot() {
    let e = spawn(12);
    let mut sub = e.subscribe_kv_events(0).expect("nothing dropped yet");
    for i in 0..6u32 {
        e.generate(req((0..16).map(|t| t + 100 * i).collect(), 2))
            .expect("valid")
            .collect()
            .await;
    }
    let mut records = sub.backlog;
    while let Ok(r) = sub.live.try_recv() {
        records.push(r);
    }
    let seqs: Vec<u64> = records.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=seqs.len() as u64).collect::<Vec<_>>(),
        "gap-free from 1"
    );
    let mut cached = std::collections::HashSet::new();
    let (mut stored, mut removed) = (0, 0);
    for r in &records {
        match &r.event {
            KvEvent::Stored { block_hashes, .. } => {
                stored += block_hashes.len();
                cached.extend(block_hashes.iter().copied());
            }
            KvEvent::Removed { block_hashes } => {
                removed += block_hashes.len();
                for h in block_hashes {
                    assert!(cached.remove(h), "removed a hash never stored");
                }
            }
            KvEvent::Moved { .. } => {}
            KvEvent::Cleared => cached.clear(),
        }
    }
    assert!(
        stored > 0 && removed > 0,
        "12 blocks cannot hold six 4-block prompts"
    );
    let snap = e.kv_snapshot();
    assert_eq!(snap.seq, *seqs.last().expect("events"));
    assert_eq!(
        snap.block_hashes
            .iter()
            .copied()
            .collect::<std::collections::HashSet<_>>(),
        cached
    );
}

#[tokio::test]
async fn too_late_subscriber_resyncs_from_a_snapshot() {
    let cfg = EngineConfig {
        event_ring_capacity: 4,
        ..engine_cfg()
    };
    let e = spawn_with(mocker_cfg(12), cfg);
    for i in 0..6u32 {
        e.generate(req((0..16).map(|t| t + 100 * i).collect(), 2))
            .expect("valid")
            .collect()
            .await;
    }
    let err = e
        .subscribe_kv_events(1)
        .expect_err("ring holds only 4 events");
    let snap = e.kv_snapshot();
    assert!(snap.seq >= err.last);
    assert!(
        e.subscribe_kv_events(snap.seq)
            .expect("snapshot seq is in range")
            .backlog
            .is_empty()
    );
    let late = e
        .subscribe_kv_events(snap.seq - 2)
        .expect("last events still in the ring");
    assert_eq!(late.backlog.len(), 2);
}

#[tokio::test]
async fn same_seed_gives_same_tokens_through_the_engine() {
    let m = MockerConfig {
        output: MockerOutput::Logits,
        ..mocker_cfg(64)
    };
    let e = spawn_with(m, engine_cfg());
    let sampled = |seed| {
        let mut r = req((1..=8).collect(), 24);
        r.sampling = SamplingParams {
            max_tokens: Some(24),
            temperature: 3.0,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        e.generate(r).expect("valid")
    };
    let (a, _) = sampled(7).collect().await;
    let (b, _) = sampled(7).collect().await;
    let (c, _) = sampled(8).collect().await;
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[tokio::test]
async fn logprobs_are_returned_when_asked() {
    let m = MockerConfig {
        output: MockerOutput::Logits,
        ..mocker_cfg(64)
    };
    let e = spawn_with(m, engine_cfg());
    let mut r = req((1..=8).collect(), 3);
    r.sampling.top_logprobs = 2;
    let mut s = e.generate(r).expect("valid");
    let out = s.recv().await.expect("a token");
    assert_eq!(out.logprobs.len(), 1);
    assert_eq!(out.logprobs[0].top.len(), 2);
    assert_eq!(out.logprobs[0].chosen.token_id, out.token_ids[0]);
}

#[tokio::test]
async fn remote_prefill_continues_like_local_generation() {
    let prefill_engine = spawn(64);
    let decode_engine = spawn(64);
    let prompt: Vec<u32> = (1..=14).collect();
    let (local, _) = spawn(64)
        .generate(req(prompt.clone(), 6))
        .expect("valid")
        .collect()
        .await;

    let p = prefill_engine
        .prefill(req(prompt.clone(), 6))
        .await
        .expect("prefill");
    assert_eq!(p.blocks.block_ids().len(), 4);
    assert_eq!(p.blocks.num_tokens(), 14);
    let slot = decode_engine
        .reserve_remote(req(prompt.clone(), 6))
        .await
        .expect("fits");
    assert_eq!((slot.block_ids().len(), slot.skip_blocks()), (4, 0));
    let mut data = prefill_engine
        .read_blocks(p.blocks.block_ids().to_vec())
        .await
        .expect("read");
    for (i, d) in data.iter_mut().enumerate() {
        d.fill(i as u8 + 1);
    }
    let writes: Vec<(u32, Vec<u8>)> = slot.block_ids().iter().copied().zip(data.clone()).collect();
    decode_engine
        .write_blocks(slot.id(), writes)
        .await
        .expect("write");
    let back = decode_engine
        .read_blocks(slot.block_ids().to_vec())
        .await
        .expect("read back");
    assert_eq!(back, data);
    drop(p);
    wait_idle(&prefill_engine).await;

    let stream = decode_engine.commit_remote(slot, 5, None).expect("commit");
    let (remote, f) = stream.collect().await;
    // The first token is the remote one; from there the mocker continues.
    assert_eq!(remote.len(), 6);
    assert_eq!(remote[0], 5);
    assert_eq!(f.expect("done").usage.completion_tokens, 6);
    let first = p_first(&prompt);
    let stream = decode_engine
        .commit_remote(
            decode_engine
                .reserve_remote(req(prompt.clone(), 6))
                .await
                .expect("fits"),
            first,
            None,
        )
        .expect("commit");
    let (remote, f) = stream.collect().await;
    assert_eq!(remote, local);
    assert_eq!(
        f.expect("done").usage.cached_tokens,
        12,
        "prompt blocks were cached at commit"
    );
    wait_idle(&decode_engine).await;
}

/// A peer's cached prefix imported: the holder holds its cached blocks
/// while they are read, the importer reserves only the blocks it lacks,
/// and once written they are its own cached prefix (stored in its KV
/// events), which the prompt then hits like one it computed; blocks past
/// those written are freed, not cached; dropping a hold or an uncommitted
/// slot frees everything.
#[tokio::test]
async fn an_imported_prefix_is_cached_like_a_computed_one() {
    let holder = spawn(64);
    let importer = spawn(64);
    let prompt: Vec<u32> = (1..=14).collect();
    // The holder computed the prompt: 3 full blocks cached (of 4 tokens).
    let (want, _) = holder
        .generate(req(prompt.clone(), 6))
        .expect("valid")
        .collect()
        .await;
    wait_idle(&holder).await;
    let held = holder.hold_prefix(prompt.clone(), 8).await.expect("held");
    assert_eq!((held.block_ids().len(), held.num_tokens()), (3, 12));
    let mut load = holder.load();
    tokio::time::timeout(
        Duration::from_secs(5),
        load.wait_for(|l| l.active_blocks == 3),
    )
    .await
    .expect("the held blocks are in use while read")
    .expect("engine alive");
    // The importer has the first block already (a shorter prompt).
    let _ = importer
        .generate(req(prompt[..5].to_vec(), 1))
        .expect("valid")
        .collect()
        .await;
    wait_idle(&importer).await;
    let events = importer.kv_snapshot().block_hashes.len();
    let slot = importer
        .reserve_import(req(prompt.clone(), 6), 3)
        .await
        .expect("fits");
    assert_eq!((slot.block_ids().len(), slot.skip_blocks()), (3, 1));
    let data = holder
        .read_blocks(held.block_ids()[1..].to_vec())
        .await
        .expect("read");
    let writes: Vec<(u32, Vec<u8>)> = slot.block_ids()[1..].iter().copied().zip(data).collect();
    importer
        .write_blocks(slot.id(), writes)
        .await
        .expect("write");
    drop(held);
    wait_idle(&holder).await;
    let cached = importer.commit_import(slot, 2).await.expect("commit");
    assert_eq!(cached, 12);
    wait_idle(&importer).await;
    assert_eq!(
        importer.kv_snapshot().block_hashes.len(),
        events + 2,
        "the imported blocks are in the KV events"
    );
    let (got, f) = importer
        .generate(req(prompt.clone(), 6))
        .expect("valid")
        .collect()
        .await;
    assert_eq!(got, want, "the same tokens as where it was computed");
    assert_eq!(f.expect("done").usage.cached_tokens, 12);
    wait_idle(&importer).await;

    // Only what was written is cached; an uncommitted slot frees all.
    let other: Vec<u32> = (100..=113).collect();
    let slot = importer
        .reserve_import(req(other.clone(), 6), 3)
        .await
        .expect("fits");
    assert_eq!(importer.commit_import(slot, 1).await.expect("commit"), 4);
    let slot = importer
        .reserve_import(req((200..=213).collect(), 6), 3)
        .await
        .expect("fits");
    drop(slot);
    wait_idle(&importer).await;
    assert_eq!(importer.cached_prefix_tokens(&other), 4);
    // Nothing cached, nothing held.
    let none = holder.hold_prefix(other, 8).await.expect("held");
    assert_eq!(none.block_ids().len(), 0);
}

/// The mocker's first token for `prompt` (what a prefill worker returns).
fn p_first(prompt: &[u32]) -> u32 {
    let m = MockerBackend::new(mocker_cfg(4)).expect("valid");
    m.next_token(*prompt.last().expect("non-empty"), prompt.len() - 1)
}

#[tokio::test]
async fn dropped_slot_and_held_blocks_are_released() {
    let e = spawn(64);
    let slot = e
        .reserve_remote(req((1..=9).collect(), 4))
        .await
        .expect("fits");
    let p = e
        .prefill(req((50..=58).collect(), 4))
        .await
        .expect("prefill");
    assert_eq!(e.load().borrow().active_blocks, 6);
    drop(slot);
    drop(p);
    wait_idle(&e).await;
}

#[tokio::test]
async fn writes_outside_the_slot_or_into_cached_blocks_are_refused() {
    let e = spawn(64);
    let prompt: Vec<u32> = (1..=9).collect();
    e.generate(req(prompt.clone(), 1))
        .expect("valid")
        .collect()
        .await;
    let slot = e.reserve_remote(req(prompt, 4)).await.expect("fits");
    assert_eq!(slot.skip_blocks(), 2);
    let bytes = e.kv_layout().block_bytes();
    let cached = slot.block_ids()[0];
    let err = e
        .write_blocks(slot.id(), vec![(cached, vec![0; bytes])])
        .await;
    assert!(matches!(err, Err(EngineError::BlockNotReserved { .. })));
    let own = slot.block_ids()[2];
    assert!(
        e.write_blocks(slot.id(), vec![(own, vec![0; bytes - 1])])
            .await
            .is_err()
    );
    assert!(
        e.write_blocks(slot.id(), vec![(own, vec![0; bytes])])
            .await
            .is_ok()
    );
}

#[tokio::test]
async fn invalid_requests_are_rejected_up_front() {
    let e = spawn(8);
    assert!(matches!(
        e.generate(req(vec![], 4)),
        Err(EngineError::InvalidRequest(_))
    ));
    assert!(matches!(
        e.generate(req(vec![1; 40], 4)),
        Err(EngineError::InvalidRequest(_))
    ));
    let mut r = req(vec![1, 2], 4);
    r.sampling.top_p = 2.0;
    assert!(e.generate(r).is_err());
}

#[tokio::test]
async fn balance_group_holds_admission_while_a_peer_is_full() {
    let group = BalanceGroup::new(2);
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 4,
            balance_scheduling: true,
            ..engine_cfg().scheduler
        },
        balance_group: Some((group.clone(), 0)),
        ..engine_cfg()
    };
    let e = spawn_with(mocker_cfg(64), cfg);
    group.publish(1, 3);
    let mut s = e.generate(req(vec![1, 2, 3], 2)).expect("valid");
    let early = tokio::time::timeout(Duration::from_millis(100), s.recv()).await;
    assert!(early.is_err(), "rank 1 at max_num_seqs - 1 holds admission");
    assert!(e.load().borrow().balance_held_steps > 0);
    group.publish(1, 2);
    let (tokens, _) = s.collect().await;
    assert_eq!(tokens.len(), 2);
}

#[tokio::test]
async fn shutdown_aborts_unfinished_streams() {
    let m = MockerConfig {
        timing: MockerTiming::Polynomial,
        speedup_ratio: 50.0,
        ..mocker_cfg(64)
    };
    let e = spawn_with(m, engine_cfg());
    let s = e.generate(req(vec![1, 2, 3], 10_000)).expect("valid");
    let e2 = e.clone();
    tokio::task::spawn_blocking(move || e2.shutdown())
        .await
        .expect("joined");
    let (_, f) = s.collect().await;
    assert_eq!(f.expect("final").reason, FinishReason::Abort);
    assert!(matches!(
        e.generate(req(vec![1], 2)),
        Err(EngineError::Shutdown)
    ));
}

#[tokio::test]
async fn clear_prefix_cache_publishes_cleared() {
    let e = spawn(64);
    e.generate(req((1..=8).collect(), 1))
        .expect("valid")
        .collect()
        .await;
    e.clear_prefix_cache().expect("alive");
    let mut load = e.load();
    tokio::time::timeout(
        Duration::from_secs(5),
        load.wait_for(|l| l.cached_blocks == 0),
    )
    .await
    .expect("in time")
    .expect("alive");
    assert!(e.kv_snapshot().block_hashes.is_empty());
    let events = e.subscribe_kv_events(0).expect("ring").backlog;
    assert_eq!(events.last().map(|r| &r.event), Some(&KvEvent::Cleared));
}

#[tokio::test]
async fn higher_priority_request_preempts_and_finishes_first() {
    let m = MockerConfig {
        timing: MockerTiming::Polynomial,
        speedup_ratio: 10.0,
        ..mocker_cfg(256)
    };
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 1,
            policy: SchedulingPolicy::Priority,
            ..engine_cfg().scheduler
        },
        ..engine_cfg()
    };
    let e = spawn_with(m, cfg);
    let mut low = e.generate(req(vec![1, 2, 3], 400)).expect("valid");
    low.recv().await.expect("low is running");
    let mut high_req = req(vec![4, 5, 6], 3);
    high_req.priority = 10;
    let high = e.generate(high_req).expect("valid");
    let low_task = tokio::spawn(async move {
        let (tokens, f) = low.collect().await;
        (tokens.len() + 1, f, std::time::Instant::now())
    });
    let (_, fh) = high.collect().await;
    let high_done = std::time::Instant::now();
    let (low_len, fl, low_done) = low_task.await.expect("joined");
    assert_eq!(fh.expect("done").reason, FinishReason::Length);
    assert_eq!(
        (low_len, fl.expect("done").reason),
        (400, FinishReason::Length)
    );
    assert!(
        high_done < low_done,
        "the high-priority request finished first"
    );
    assert!(e.load().borrow().preemptions >= 1);
}

#[tokio::test]
async fn many_streams_dropped_at_random_points_leak_no_blocks() {
    let m = MockerConfig {
        timing: MockerTiming::Polynomial,
        speedup_ratio: 200.0,
        ..mocker_cfg(40)
    };
    let cfg = EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            ..engine_cfg().scheduler
        },
        ..engine_cfg()
    };
    let e = spawn_with(m, cfg);
    let mut tasks = Vec::new();
    for i in 0..40u32 {
        let prompt: Vec<u32> = (0..(5 + i % 23)).map(|t| 1 + t + (i % 3) * 100).collect();
        let mut s = e.generate(req(prompt, 30)).expect("valid");
        let keep = (i * 7) % 11;
        tasks.push(tokio::spawn(async move {
            for _ in 0..keep {
                if s.recv().await.is_none() {
                    break;
                }
            }
        }));
    }
    for t in tasks {
        t.await.expect("joined");
    }
    wait_idle(&e).await;
    assert_eq!(e.load().borrow().active_blocks, 0);
}

#[tokio::test]
async fn lockstep_ranks_step_together_and_a_stopped_rank_leaves() {
    let group = BalanceGroup::lockstep(2, Duration::from_secs(10));
    let rank = |r: usize| {
        let m = MockerConfig {
            timing: MockerTiming::Polynomial,
            speedup_ratio: 50.0,
            ..mocker_cfg(64)
        };
        let cfg = EngineConfig {
            balance_group: Some((group.clone(), r)),
            ..engine_cfg()
        };
        spawn_with(m, cfg)
    };
    let (r0, r1) = (rank(0), rank(1));
    // Only rank 0 has work: idle rank 1 still joins every step.
    let (tokens, _) = r0
        .generate(req(vec![1, 2, 3], 20))
        .expect("valid")
        .collect()
        .await;
    assert_eq!(tokens.len(), 20);
    // The last token leaves before its step's barrier completes.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while group.lockstep_steps() < 20 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let after_one = group.lockstep_steps();
    assert!(after_one >= 20, "{after_one} lockstep steps");
    let a = r0.generate(req(vec![4, 5, 6], 10)).expect("valid");
    let b = r1.generate(req(vec![7, 8, 9], 10)).expect("valid");
    let ((ta, _), (tb, _)) = tokio::join!(a.collect(), b.collect());
    assert_eq!((ta.len(), tb.len()), (10, 10));
    // Rank 1 stops; rank 0 goes on alone without waiting for it.
    tokio::task::spawn_blocking(move || r1.shutdown())
        .await
        .expect("joined");
    let started = std::time::Instant::now();
    let (tokens, _) = r0
        .generate(req(vec![1, 2, 3], 5))
        .expect("valid")
        .collect()
        .await;
    assert_eq!(tokens.len(), 5);
    assert!(started.elapsed() < Duration::from_secs(5));
}

/// The mocker, failing every step that computes a prompt holding `poison`.
fn poisoned(inner: MockerBackend, poison: u32) -> impl sluice_engine::backend::Backend {
    sluice_engine::backend::BeforeStep {
        inner,
        hook: move |_: &MockerBackend, batch: &sluice_engine::backend::ForwardBatch| {
            if batch
                .seqs
                .iter()
                .any(|s| s.start_pos == 0 && s.tokens.contains(&poison))
            {
                return Err(EngineError::StepFailed("poisoned".into()));
            }
            Ok(())
        },
    }
}

#[tokio::test]
async fn a_sequence_that_fails_its_step_fails_alone_and_the_batch_goes_on() {
    let backend = poisoned(
        MockerBackend::new(mocker_cfg(256)).expect("valid mocker"),
        63,
    );
    let e = EngineHandle::spawn(Box::new(backend), engine_cfg()).expect("engine starts");
    // Six healthy streams, then one whose prompt the backend fails on,
    // batched with them.
    let healthy: Vec<_> = (0..6)
        .map(|i| {
            let prompt: Vec<u32> = (1..=8).map(|t| t + i).collect();
            e.generate(req(prompt, 20)).expect("valid")
        })
        .collect();
    let poison = e.generate(req(vec![5, 63, 7], 20)).expect("valid ids");
    let (tokens, finish) = poison.collect().await;
    assert!(tokens.is_empty());
    assert_eq!(finish.map(|f| f.reason), Some(FinishReason::Error));
    for s in healthy {
        let (tokens, finish) = s.collect().await;
        assert_eq!(finish.map(|f| f.reason), Some(FinishReason::Length));
        assert_eq!(tokens.len(), 20);
    }
    wait_idle(&e).await;
}

#[tokio::test]
async fn token_ids_outside_the_vocabulary_are_refused_before_they_reach_a_step() {
    let e = spawn(64);
    let err = e
        .generate(req(vec![1, u32::MAX], 4))
        .expect_err("outside the vocabulary");
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
    assert_eq!(e.vocab_size(), 1024);
}

/// The step time a worker reports is its decode step's: a burst's first
/// steps are its longest (prompts), and a queue predicting waits from them
/// refused requests it would have served in time (issue 34's burst).
#[tokio::test]
async fn the_reported_step_time_is_a_decode_steps_not_a_prefills() {
    let m = MockerConfig {
        timing: MockerTiming::Polynomial,
        ..mocker_cfg(4096)
    };
    let mut cfg = engine_cfg();
    cfg.scheduler.max_num_batched_tokens = 4096;
    let e = spawn_with(m, cfg);
    let prefill = sluice_engine::backend::mocker::prefill_ms(4000);
    let decode = sluice_engine::backend::mocker::decode_ms(0.0);
    assert!(prefill > 10.0 * decode, "{prefill} ms vs {decode} ms");
    e.generate(req((1..=4000).map(|t| 1 + t % 1000).collect(), 3))
        .expect("valid")
        .collect()
        .await;
    let step_ms = f64::from(e.load().borrow().step_time_us) / 1000.0;
    // Two decode steps of ~6 ms after one prefill step of ~84 ms: the
    // prefill must not count (with it, the mean would still be ~56 ms).
    assert!(
        step_ms > 0.0 && step_ms < prefill / 4.0,
        "reported {step_ms} ms; decode {decode} ms, prefill {prefill} ms"
    );
    // The prompt's own cost is reported apart, per token: the prefill step
    // less a decode step, over its 4,000 tokens (within the noise of one
    // measured step).
    let per_token_ms = f64::from(e.load().borrow().prefill_ns_per_token) / 1e6;
    let want = (prefill - decode) / 4000.0;
    assert!(
        per_token_ms > want * 0.5 && per_token_ms < want * 2.0,
        "reported {per_token_ms} ms a prompt token; the mocker's prefill is {want} ms"
    );
    // And a decode step's line against its batch (one sequence here: its
    // mean, no slope to read).
    let l = *e.load().borrow();
    let one = f64::from(l.decode_base_us) / 1e3 + f64::from(l.decode_ns_per_seq) / 1e6;
    assert!(
        one > 0.0 && one < prefill / 4.0,
        "a step of one sequence {one} ms; decode {decode} ms"
    );
}

#[tokio::test]
async fn a_prefill_not_started_by_its_first_token_deadline_is_refused_not_left_waiting() {
    let e = spawn(64);
    let mut late = req((1..=10).collect(), 1);
    late.first_token_by = Some(std::time::Instant::now());
    let refused = tokio::time::timeout(Duration::from_secs(5), e.prefill(late))
        .await
        .expect("answered, not left waiting")
        .err();
    assert!(
        matches!(refused, Some(EngineError::FirstTokenLate)),
        "{refused:?}"
    );
    wait_idle(&e).await;
    // With time left it is computed.
    let mut due_later = req((1..=10).collect(), 1);
    due_later.first_token_by = Some(std::time::Instant::now() + Duration::from_secs(60));
    let out = e.prefill(due_later).await.expect("prefill");
    assert_eq!(out.blocks.num_tokens(), 10);
}
