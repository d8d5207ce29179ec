//! Placement quality on a prefix-sharing trace: 8 mocker engines (the real
//! scheduler and KV cache, compute replaced by Dynamo's timing polynomial)
//! replay a mooncake-style trace (`hash_ids`: requests built from shared
//! document blocks plus their own tail). The router's pool is fed by each
//! engine's KV events and load, in process, exactly as `workers` feeds it
//! from gRPC. Compared: `kv`, `round-robin`, `random`, `least-loaded`,
//! `approx`, and an oracle that asks every engine for its cached prefix.
//!
//! Reports, per mode: prefix-cache hit rate (cached prompt tokens ÷ prompt
//! tokens, from the engines' own usage), mean and p90 TTFT (wall clock, at
//! the mocker's `speedup_ratio`), and the max/min ratio of requests and of
//! computed (uncached) prompt tokens per worker.
//!
//! `cargo bench -p sluice-router --bench trace` (the engine is optimised
//! even in the dev profile, so `--profile dev` gives the same figures).
//! `SLUICE_BENCH_QUICK=1` runs a short trace; `SLUICE_BENCH_RATE` sets the
//! arrival rate in requests per second (default 60), `SLUICE_BENCH_SPEEDUP`
//! the mocker's speedup ratio (default 10).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_engine::{
    EngineConfig, EngineHandle, GenerateStream, KvEvent as EngineEvent, MockerBackend,
    MockerConfig, Request, SamplingParams, SchedulerConfig,
};
use sluice_router::{
    Commit, KvEvent, KvEventKind, LoadReport, MemberInfo, PlacementKey, PlacementState, PoolConfig,
    PoolKind, RouteInput, RouterMode, WorkerPool,
};
use sluice_runtime::RequestDescription;
use sluice_runtime::discovery::WorkerRank;
use sluice_tokens::sequence_block_hashes;

const WORKERS: usize = 8;
const BLOCK: usize = 16;
/// KV blocks per engine: the documents fit across the cluster, not in one.
const BLOCKS_PER_WORKER: usize = 1024;

/// One trace line, mooncake-style.
#[derive(Debug, Clone)]
struct TraceRequest {
    /// Arrival, from the start of the trace.
    at: Duration,
    hash_ids: Vec<u64>,
    output_len: usize,
}

/// `docs` shared documents with Zipf(1) popularity; each request is one
/// document's blocks (a prefix of it, ≥ half) plus 1..=8 blocks of its own.
fn trace(requests: usize, docs: usize, rate_per_s: f64, seed: u64) -> Vec<TraceRequest> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next_id = 0u64;
    let mut fresh = |n: usize| {
        let v: Vec<u64> = (next_id..next_id + n as u64).collect();
        next_id += n as u64;
        v
    };
    let documents: Vec<Vec<u64>> = (0..docs)
        .map(|_| {
            let n = rng.random_range(16..48);
            fresh(n)
        })
        .collect();
    let weights: Vec<f64> = (1..=docs).map(|k| 1.0 / k as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut t = 0.0f64;
    (0..requests)
        .map(|_| {
            t += -(1.0 - rng.random::<f64>()).ln() / rate_per_s;
            let mut x = rng.random::<f64>() * total;
            let mut d = 0;
            while d + 1 < docs && x >= weights[d] {
                x -= weights[d];
                d += 1;
            }
            let doc = &documents[d];
            let keep = rng.random_range(doc.len() / 2..=doc.len());
            let mut hash_ids = doc[..keep].to_vec();
            hash_ids.extend(fresh(rng.random_range(1..=8)));
            TraceRequest {
                at: Duration::from_secs_f64(t),
                hash_ids,
                output_len: rng.random_range(16..64),
            }
        })
        .collect()
}

/// Block id → its 16 tokens, so equal ids give equal blocks (and hashes).
fn tokens_of(hash_ids: &[u64]) -> Vec<u32> {
    hash_ids
        .iter()
        .flat_map(|id| {
            (0..BLOCK as u64).map(move |i| ((id * 7919 + i * 104_729) % 31_000) as u32 + 1)
        })
        .collect()
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Router(RouterMode),
    Oracle,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Router(m) => m.as_str(),
            Mode::Oracle => "oracle",
        }
    }
}

struct Outcome {
    prompt_tokens: usize,
    cached_tokens: usize,
    ttft: Duration,
    worker: usize,
}

fn speedup() -> f64 {
    std::env::var("SLUICE_BENCH_SPEEDUP")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|s: &f64| *s > 0.0)
        .unwrap_or(10.0)
}

fn engine() -> EngineHandle {
    let backend = MockerBackend::new(MockerConfig {
        block_size: BLOCK,
        num_blocks: BLOCKS_PER_WORKER,
        speedup_ratio: speedup(),
        ..MockerConfig::default()
    })
    .expect("mocker config");
    EngineHandle::spawn(
        Box::new(backend),
        EngineConfig {
            block_size: BLOCK,
            num_blocks: Some(BLOCKS_PER_WORKER),
            scheduler: SchedulerConfig {
                max_num_seqs: 64,
                max_num_batched_tokens: 2048,
                max_model_len: 8192,
                ..SchedulerConfig::default()
            },
            ..EngineConfig::default()
        },
    )
    .expect("engine")
}

fn target(i: usize) -> WorkerRank {
    WorkerRank::new(format!("w{i}"), 0)
}

/// Feeds one engine's KV events and load into the pool until `stop`.
fn follow(
    engine: &EngineHandle,
    pool: &Arc<WorkerPool>,
    i: usize,
    stop: &tokio_util::sync::CancellationToken,
) {
    let id = pool.kv_id(&target(i)).expect("member");
    let sub = engine
        .subscribe_kv_events(0)
        .expect("fresh engine subscribes from 0");
    let (p, s) = (Arc::clone(pool), stop.clone());
    tokio::spawn(async move {
        let apply = |rec: sluice_engine::KvEventRecord| {
            let kind = match rec.event {
                EngineEvent::Stored {
                    parent_hash,
                    block_hashes,
                } => KvEventKind::Stored {
                    parent: parent_hash,
                    hashes: block_hashes,
                },
                EngineEvent::Removed { block_hashes } => KvEventKind::Removed {
                    hashes: block_hashes,
                },
                EngineEvent::Moved { block_hashes, tier } => KvEventKind::Moved {
                    hashes: block_hashes,
                    tier,
                },
                EngineEvent::Cleared => KvEventKind::Cleared,
            };
            let _ = p.indexer().apply(id, &KvEvent { seq: rec.seq, kind });
        };
        for rec in sub.backlog {
            apply(rec);
        }
        let mut live = sub.live;
        loop {
            tokio::select! {
                _ = s.cancelled() => return,
                r = live.recv() => match r {
                    Ok(rec) => apply(rec),
                    Err(_) => return,
                },
            }
        }
    });
    let mut load = engine.load();
    let (p, s) = (Arc::clone(pool), stop.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = s.cancelled() => return,
                r = load.changed() => if r.is_err() { return },
            }
            let l = *load.borrow_and_update();
            p.record_load(
                &target(i),
                LoadReport {
                    running: l.running as u32,
                    waiting: l.waiting as u32,
                    active_blocks: l.active_blocks as u64,
                    total_blocks: l.total_blocks as u64,
                    pending_prefill_tokens: l.pending_prefill_tokens as u64,
                    max_num_seqs: l.max_num_seqs as u32,
                    max_num_batched_tokens: l.max_num_batched_tokens as u32,
                    ..LoadReport::default()
                },
                Instant::now(),
            );
        }
    });
}

/// The pool the replay places with: `mode`'s (the oracle scores with kv's
/// cost), every worker a member.
fn pool_of(mode: Mode) -> Arc<WorkerPool> {
    let router_mode = match mode {
        Mode::Router(m) => m,
        Mode::Oracle => RouterMode::Kv,
    };
    let pool = Arc::new(WorkerPool::with_seed(
        PoolKind::Decode,
        PoolConfig {
            mode: router_mode,
            ..PoolConfig::default()
        },
        7,
    ));
    for i in 0..WORKERS {
        pool.add_member(MemberInfo {
            target: target(i),
            endpoint: format!("w{i}"),
            model: String::new(),
            role: sluice_runtime::discovery::WorkerRole::Decode,
            kv_block_bytes: 0,
        });
    }
    pool
}

/// Reads a placed request's stream to its end, telling the pool when it
/// started and ended (as the queue's lease does): its TTFT and the prompt
/// tokens it found cached.
async fn follow_stream(
    mut stream: GenerateStream,
    pool: &WorkerPool,
    key: &PlacementKey,
    sent: Instant,
) -> (Duration, usize) {
    let mut ttft = None;
    let mut cached = 0;
    while let Some(out) = stream.recv().await {
        if ttft.is_none() && !out.token_ids.is_empty() {
            ttft = Some(sent.elapsed());
            pool.update(key, PlacementState::Started);
        }
        if let Some(f) = out.finished {
            cached = f.usage.cached_tokens;
        }
    }
    pool.update(key, PlacementState::Released);
    (ttft.unwrap_or_else(|| sent.elapsed()), cached)
}

async fn replay(mode: Mode, reqs: &[TraceRequest]) -> Vec<Outcome> {
    let engines: Arc<Vec<EngineHandle>> = Arc::new((0..WORKERS).map(|_| engine()).collect());
    let pool = pool_of(mode);
    let stop = tokio_util::sync::CancellationToken::new();
    for (i, e) in engines.iter().enumerate() {
        follow(e, &pool, i, &stop);
    }

    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(reqs.len());
    for (n, r) in reqs.iter().enumerate() {
        tokio::time::sleep_until(start + r.at).await;
        let tokens = tokens_of(&r.hash_ids);
        let hashes = sequence_block_hashes(&tokens, BLOCK);
        let request_id = format!("r{n}");
        // Counted from placement to the request's end, as the queue's lease does.
        let key = PlacementKey {
            client: Arc::from("replay"),
            id: n as u64,
        };
        let input = RouteInput {
            desc: RequestDescription {
                request_id: request_id.clone(),
                prompt_tokens: tokens.len() as u32,
                block_hashes: hashes.into(),
                block_size: BLOCK as u32,
                ..RequestDescription::default()
            },
            commit: Commit::Held {
                key: key.clone(),
                session: 1,
            },
        };
        let decision = match mode {
            Mode::Router(_) => pool.route(&input, Instant::now()),
            Mode::Oracle => {
                let engines = Arc::clone(&engines);
                let tokens = &tokens;
                let overlap = move |t: &WorkerRank| {
                    let i: usize = t.worker_id[1..].parse().expect("w<i>");
                    (engines[i].cached_prefix_tokens(tokens) / BLOCK) as u32
                };
                pool.route_with_overlaps(&input, Instant::now(), &overlap)
            }
        }
        .expect("route");
        let worker: usize = decision.target().target.worker_id[1..]
            .parse()
            .expect("w<i>");
        let prompt_tokens = tokens.len();
        let stream = engines[worker]
            .generate(Request {
                request_id,
                prompt: tokens,
                sampling: SamplingParams {
                    max_tokens: Some(r.output_len),
                    ignore_eos: true,
                    ..SamplingParams::default()
                },
                priority: 0,
                constraint: None,
                first_token_by: None,
                tpot_target: None,
            })
            .expect("generate");
        let sent = Instant::now();
        let pool = Arc::clone(&pool);
        tasks.push(tokio::spawn(async move {
            let (ttft, cached_tokens) = follow_stream(stream, &pool, &key, sent).await;
            Outcome {
                prompt_tokens,
                cached_tokens,
                ttft,
                worker,
            }
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(t.await.expect("request task"));
    }
    stop.cancel();
    for e in engines.iter() {
        e.shutdown();
    }
    outcomes
}

fn ratio(v: &[f64]) -> f64 {
    let max = v.iter().copied().fold(0.0, f64::max);
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    if min <= 0.0 { f64::INFINITY } else { max / min }
}

fn main() {
    let quick = std::env::var("SLUICE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let n = if quick { 150 } else { 800 };
    let rate: f64 = std::env::var("SLUICE_BENCH_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let reqs = trace(n, 48, rate, 2026);
    let prompt_blocks: usize = reqs.iter().map(|r| r.hash_ids.len()).sum();
    println!(
        "{n} requests, {WORKERS} mocker workers × {BLOCKS_PER_WORKER} blocks of {BLOCK}, speedup {}, {rate} req/s, mean prompt {} tokens",
        speedup(),
        prompt_blocks * BLOCK / n
    );
    println!();
    println!(
        "| mode | hit rate | mean TTFT | p90 TTFT | max/min requests | max/min computed tokens |"
    );
    println!("|---|---|---|---|---|---|");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let modes = [
        Mode::Router(RouterMode::Kv),
        Mode::Router(RouterMode::RoundRobin),
        Mode::Router(RouterMode::Random),
        Mode::Router(RouterMode::LeastLoaded),
        Mode::Router(RouterMode::Approx),
        Mode::Oracle,
    ];
    for mode in modes {
        let out = rt.block_on(replay(mode, &reqs));
        let prompt: usize = out.iter().map(|o| o.prompt_tokens).sum();
        let cached: usize = out.iter().map(|o| o.cached_tokens).sum();
        let mut ttfts: Vec<Duration> = out.iter().map(|o| o.ttft).collect();
        ttfts.sort_unstable();
        let mean = ttfts.iter().sum::<Duration>() / ttfts.len().max(1) as u32;
        let p90 = ttfts[(ttfts.len() - 1) * 9 / 10];
        let mut reqs_per = vec![0.0f64; WORKERS];
        let mut computed_per = vec![0.0f64; WORKERS];
        for o in &out {
            reqs_per[o.worker] += 1.0;
            computed_per[o.worker] += (o.prompt_tokens - o.cached_tokens) as f64;
        }
        println!(
            "| {} | {:.1}% | {:.1} ms | {:.1} ms | {:.2} | {:.2} |",
            mode.name(),
            100.0 * cached as f64 / prompt.max(1) as f64,
            mean.as_secs_f64() * 1e3,
            p90.as_secs_f64() * 1e3,
            ratio(&reqs_per),
            ratio(&computed_per),
        );
    }
}
