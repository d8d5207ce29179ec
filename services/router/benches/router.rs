//! Router micro-benchmark: events applied per second, index lookups and full
//! route decisions per second with p50/p99 latency, and index memory per
//! entry, at 16/64/256 workers × 100k/1M indexed (worker, block) entries.
//!
//! `cargo bench -p sluice-router --bench router` (release). Set
//! `SLUICE_BENCH_QUICK=1` for a fast smoke run. Prints a markdown table.
//!
//! Workload: 1024-token prompts (64 blocks of 16): 32 blocks from one of 64
//! shared "system prompts", then 32 blocks of their own. Workers receive
//! them as `Stored` events of 16 blocks (parent chained) until the index
//! holds the target number of entries. Queries: 80% repeat a stored prompt
//! (with a fresh tail), 20% share only a system prompt.
//!
//! Timing is per call with `Instant::now()`, single thread, on whatever else
//! the machine is doing: treat absolute figures as this machine's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_router::{
    Commit, KvEvent, KvEventKind, KvIndexer, LoadReport, MemberInfo, PlacementKey, PlacementState,
    PoolConfig, PoolKind, RouteInput, TargetId, WorkerPool,
};
use sluice_runtime::RequestDescription;
use sluice_runtime::discovery::WorkerRank;
use sluice_tokens::block_hash::chain_hash;

const BLOCK: u32 = 16;
const PROMPT_BLOCKS: usize = 64;
const SYSTEM_BLOCKS: usize = 32;
const SYSTEMS: usize = 64;
const EVENT_BLOCKS: usize = 16;

struct Corpus {
    systems: Vec<Vec<u64>>,
    /// (worker, full chain) of every stored prompt.
    prompts: Vec<(usize, Vec<u64>)>,
}

fn chain(prefix: &[u64], extra: usize, rng: &mut StdRng) -> Vec<u64> {
    let mut out = prefix.to_vec();
    for _ in 0..extra {
        let local: u64 = rng.random();
        out.push(chain_hash(out.last().copied(), local));
    }
    out
}

fn corpus(workers: usize, entries: usize, rng: &mut StdRng) -> Corpus {
    let systems: Vec<Vec<u64>> = (0..SYSTEMS)
        .map(|_| chain(&[], SYSTEM_BLOCKS, rng))
        .collect();
    let mut prompts = Vec::new();
    // System blocks repeat per worker, so count them once per (worker, system).
    let mut seen = std::collections::HashSet::new();
    let mut total = 0usize;
    let mut i = 0usize;
    while total < entries {
        let w = i % workers;
        let s = rng.random_range(0..SYSTEMS);
        let p = chain(&systems[s], PROMPT_BLOCKS - SYSTEM_BLOCKS, rng);
        total += PROMPT_BLOCKS - SYSTEM_BLOCKS;
        if seen.insert((w, s)) {
            total += SYSTEM_BLOCKS;
        }
        prompts.push((w, p));
        i += 1;
    }
    Corpus { systems, prompts }
}

fn events_of(chain: &[u64]) -> Vec<KvEventKind> {
    chain
        .chunks(EVENT_BLOCKS)
        .enumerate()
        .map(|(i, c)| KvEventKind::Stored {
            parent: (i > 0).then(|| chain[i * EVENT_BLOCKS - 1]),
            hashes: c.to_vec(),
        })
        .collect()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx]
}

fn query(c: &Corpus, rng: &mut StdRng) -> Vec<u64> {
    if rng.random_bool(0.8) {
        let (_, p) = &c.prompts[rng.random_range(0..c.prompts.len())];
        chain(p, 4, rng)
    } else {
        chain(
            &c.systems[rng.random_range(0..SYSTEMS)],
            PROMPT_BLOCKS - SYSTEM_BLOCKS,
            rng,
        )
    }
}

struct Row {
    workers: usize,
    entries: usize,
    events_per_s: f64,
    blocks_per_s: f64,
    lookups_per_s: f64,
    lookup_p50: Duration,
    lookup_p99: Duration,
    routes_per_s: f64,
    route_p50: Duration,
    route_p99: Duration,
    bytes_per_entry: f64,
}

/// Applies every prompt's stored events as its worker's (single writer):
/// returns the events, the blocks they stored, and the seconds it took.
fn apply_corpus(
    idx: &KvIndexer,
    ids: &[TargetId],
    c: &Corpus,
    workers: usize,
) -> (usize, usize, f64) {
    let events: Vec<(usize, KvEventKind)> = c
        .prompts
        .iter()
        .flat_map(|(w, p)| events_of(p).into_iter().map(move |e| (*w, e)))
        .collect();
    let mut seqs = vec![0u64; workers];
    let mut blocks = 0usize;
    let started = Instant::now();
    for (w, kind) in &events {
        seqs[*w] += 1;
        if let KvEventKind::Stored { hashes, .. } = kind {
            blocks += hashes.len();
        }
        let ev = KvEvent {
            seq: seqs[*w],
            kind: kind.clone(),
        };
        let _ = idx.apply(ids[*w], &ev);
    }
    (events.len(), blocks, started.elapsed().as_secs_f64())
}

/// Index lookups of every query: total seconds, p50 and p99.
fn lookups(idx: &KvIndexer, qs: &[Vec<u64>]) -> (f64, Duration, Duration) {
    let mut lat = Vec::with_capacity(qs.len());
    let started = Instant::now();
    for q in qs {
        let t = Instant::now();
        std::hint::black_box(idx.find_matches(q));
        lat.push(t.elapsed());
    }
    let secs = started.elapsed().as_secs_f64();
    lat.sort_unstable();
    (secs, percentile(&lat, 0.5), percentile(&lat, 0.99))
}

/// Full route decisions (lookup + load + cost over every worker + commit),
/// with every worker reporting every 64 decisions and 64 requests live
/// (each placement released 64 decisions later): total seconds and the
/// sorted latencies.
fn routes(pool: &WorkerPool, qs: &[Vec<u64>], workers: usize) -> (f64, Vec<Duration>) {
    let mut now = Instant::now();
    let tokens = (PROMPT_BLOCKS as u32 + 4) * BLOCK;
    let mut lat = Vec::with_capacity(qs.len());
    let started = Instant::now();
    for (i, q) in qs.iter().enumerate() {
        if i % 64 == 0 {
            now += Duration::from_millis(100);
            for w in 0..workers {
                pool.record_load(
                    &WorkerRank::new(format!("worker-{w}"), 0),
                    LoadReport {
                        running: (i % 7) as u32,
                        active_blocks: (w * 13 % 300) as u64,
                        ..LoadReport::default()
                    },
                    now,
                );
            }
        }
        let key = |id: usize| PlacementKey {
            client: Arc::from("bench"),
            id: id as u64,
        };
        let input = RouteInput {
            desc: RequestDescription {
                request_id: "bench".into(),
                model: "m".into(),
                prompt_tokens: tokens,
                block_hashes: q.as_slice().into(),
                block_size: BLOCK,
                ..RequestDescription::default()
            },
            commit: Commit::Held {
                key: key(i),
                session: 1,
            },
        };
        let t = Instant::now();
        let d = pool.route(&input, now);
        lat.push(t.elapsed());
        std::hint::black_box(d.is_ok());
        if i >= 64 {
            pool.update(&key(i - 64), PlacementState::Released);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    lat.sort_unstable();
    (secs, lat)
}

fn run(workers: usize, entries: usize, queries: usize, seed: u64) -> Row {
    let mut rng = StdRng::seed_from_u64(seed);
    let c = corpus(workers, entries, &mut rng);
    let pool = WorkerPool::with_seed(PoolKind::Decode, PoolConfig::default(), seed);
    let ids: Vec<_> = (0..workers)
        .map(|w| {
            pool.add_member(MemberInfo {
                target: WorkerRank::new(format!("worker-{w}"), 0),
                endpoint: format!("10.0.0.{w}:9000"),
                model: "m".into(),
                role: sluice_runtime::discovery::WorkerRole::Decode,
                kv_block_bytes: 0,
            })
        })
        .collect();
    let idx: &KvIndexer = pool.indexer();
    let (events, blocks, apply_time) = apply_corpus(idx, &ids, &c, workers);
    let stats = idx.stats();
    let qs: Vec<Vec<u64>> = (0..queries).map(|_| query(&c, &mut rng)).collect();
    let (lookup_time, lookup_p50, lookup_p99) = lookups(idx, &qs);
    let (route_time, lat) = routes(&pool, &qs, workers);

    Row {
        workers,
        entries: stats.entries,
        events_per_s: events as f64 / apply_time,
        blocks_per_s: blocks as f64 / apply_time,
        lookups_per_s: queries as f64 / lookup_time,
        lookup_p50,
        lookup_p99,
        routes_per_s: queries as f64 / route_time,
        route_p50: percentile(&lat, 0.5),
        route_p99: percentile(&lat, 0.99),
        bytes_per_entry: stats.bytes_per_entry,
    }
}

fn main() {
    // `cargo bench` passes `--bench`; other arguments are ignored.
    let quick = std::env::var("SLUICE_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    let sizes: &[usize] = if quick {
        &[20_000]
    } else {
        &[100_000, 1_000_000]
    };
    let queries = if quick { 2_000 } else { 20_000 };
    println!(
        "| workers | entries | events/s (16 blk) | blocks/s | lookups/s | lookup p50 | lookup p99 | routes/s | route p50 | route p99 | bytes/entry |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for &workers in &[16usize, 64, 256] {
        for &entries in sizes {
            let r = run(workers, entries, queries, 42 + workers as u64);
            println!(
                "| {} | {} | {:.0} | {:.0} | {:.0} | {:.1} µs | {:.1} µs | {:.0} | {:.1} µs | {:.1} µs | {:.1} |",
                r.workers,
                r.entries,
                r.events_per_s,
                r.blocks_per_s,
                r.lookups_per_s,
                r.lookup_p50.as_secs_f64() * 1e6,
                r.lookup_p99.as_secs_f64() * 1e6,
                r.routes_per_s,
                r.route_p50.as_secs_f64() * 1e6,
                r.route_p99.as_secs_f64() * 1e6,
                r.bytes_per_entry,
            );
        }
    }
}
