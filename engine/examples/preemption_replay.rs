//! A deterministic replay of one worker's share of the queue bench's burst
//! (`tests/bench/queue/run.sh`, section 1) through the real scheduler and
//! KV cache on a virtual clock timed by the mocker's model: what engine
//! priority and its preemptions cost in modelled time, with no machine
//! noise. For reading bench results, not a test.
//!
//! Requests of `--isl` prompt tokens and `--osl` output tokens arrive spread
//! evenly at random over `--spread-ms`, in four equal priority tiers; each
//! policy (fcfs, priority, priority without preemption at the seq limit)
//! serves the same arrivals on one engine with `--max-num-seqs 16`, 2048
//! blocks of 16 tokens and the mocker's timing at `--speedup 2`. Printed per
//! policy: modelled makespan and output throughput, steps and steps with a
//! prefill row (each pays the prefill polynomial's constant), preemptions,
//! recomputed tokens, and the tier-3 / tier-0 mean-TTFT ratio. With
//! `--admission-wait-steps N` every policy also runs with admissions
//! waiting up to N steps to share a prefill step
//! (`SchedulerConfig::admission_wait_steps`).
//!
//! `cargo run --release -p sluice-engine --example preemption_replay -- --spread-ms 200`

use std::collections::HashMap;
use std::sync::Arc;

use sluice_engine::backend::mocker::{MockerBackend, MockerConfig, MockerTiming, prefill_ms};
use sluice_engine::backend::{Backend, ForwardBatch};
use sluice_engine::kv::{KvCache, KvEventLog};
use sluice_engine::scheduler::{Request, Scheduler};
use sluice_engine::{EngineError, SamplingParams, SchedulerConfig, SchedulingPolicy};

#[derive(Debug, Clone, Copy)]
struct Opts {
    requests: usize,
    isl: usize,
    osl: usize,
    spread_ms: f64,
    speedup: f64,
    seed: u64,
    admission_wait_steps: usize,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        requests: 200,
        isl: 512,
        osl: 64,
        spread_ms: 200.0,
        speedup: 2.0,
        seed: 1,
        admission_wait_steps: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--requests" => o.requests = value.parse().map_err(|e| bad(&e))?,
            "--isl" => o.isl = value.parse().map_err(|e| bad(&e))?,
            "--osl" => o.osl = value.parse().map_err(|e| bad(&e))?,
            "--spread-ms" => o.spread_ms = value.parse().map_err(|e| bad(&e))?,
            "--speedup" => o.speedup = value.parse().map_err(|e| bad(&e))?,
            "--seed" => o.seed = value.parse().map_err(|e| bad(&e))?,
            "--admission-wait-steps" => {
                o.admission_wait_steps = value.parse().map_err(|e| bad(&e))?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(o)
}

/// xorshift64: a fixed, seedable sequence.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

/// Whether the mocker charges `batch` a prefill (any row but a decode).
fn prefill_tokens(batch: &ForwardBatch) -> usize {
    batch
        .seqs
        .iter()
        .filter(|c| !(c.tokens.len() == 1 && c.start_pos > 0 && c.needs_logits))
        .map(|c| c.tokens.len())
        .sum()
}

fn replay(
    o: Opts,
    policy: SchedulingPolicy,
    seq_limit: bool,
    admission_wait_steps: usize,
) -> Result<String, EngineError> {
    let block_size = 16;
    let num_blocks = 2048;
    let cfg = SchedulerConfig {
        max_num_seqs: 16,
        max_num_batched_tokens: 2048,
        max_model_len: num_blocks * block_size,
        policy,
        preempt_on_seq_limit: seq_limit,
        admission_wait_steps,
        ..SchedulerConfig::default()
    };
    let kv = KvCache::new(
        num_blocks,
        block_size,
        true,
        Arc::new(KvEventLog::new(1 << 20)),
    );
    let mut sched = Scheduler::new(cfg, kv, Vec::new());
    let mocker = |timing| {
        MockerBackend::new(MockerConfig {
            block_size,
            num_blocks,
            speedup_ratio: o.speedup,
            timing,
            ..MockerConfig::default()
        })
    };
    let clock = mocker(MockerTiming::Polynomial)?;
    let mut tokens = mocker(MockerTiming::Instant)?;

    let mut state = o.seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut arrivals: Vec<(f64, u64, i32)> = (0..o.requests)
        .map(|i| {
            let at = (next(&mut state) % 1_000_000) as f64 / 1e6 * o.spread_ms;
            let priority = (next(&mut state) % 4) as i32;
            (at, i as u64 + 1, priority)
        })
        .collect();
    arrivals.sort_by(|a, b| a.0.total_cmp(&b.0));
    let arrived: HashMap<u64, (f64, i32)> = arrivals.iter().map(|a| (a.1, (a.0, a.2))).collect();

    let (mut now, mut next_arrival) = (0.0f64, 0);
    let (mut steps, mut prefill_steps) = (0u64, 0u64);
    let mut first_token: HashMap<u64, f64> = HashMap::new();
    while next_arrival < arrivals.len() || sched.has_unfinished() {
        while next_arrival < arrivals.len() && arrivals[next_arrival].0 <= now {
            let (_, id, priority) = arrivals[next_arrival];
            let prompt = (0..o.isl as u32).map(|j| id as u32 * 100_000 + j + 5);
            sched.add(
                id,
                Request {
                    request_id: String::new(),
                    prompt: prompt.collect(),
                    sampling: SamplingParams {
                        max_tokens: Some(o.osl),
                        ignore_eos: true,
                        ..SamplingParams::greedy()
                    },
                    priority,
                    constraint: None,
                    first_token_by: None,
                    tpot_target: None,
                },
            )?;
            next_arrival += 1;
        }
        let step = sched.schedule();
        if step.is_empty() {
            // Idle (or stalled) until the next arrival.
            now = match arrivals.get(next_arrival) {
                Some(a) => a.0.max(now + 0.01),
                None => now + 0.01,
            };
            continue;
        }
        steps += 1;
        if prefill_tokens(&step.batch) > 0 {
            prefill_steps += 1;
        }
        now += clock.step_duration(&step.batch).as_secs_f64() * 1000.0;
        let out = tokens.forward(&step.batch)?;
        for o in sched.update(&step, out)? {
            first_token.entry(o.seq_id).or_insert(now);
        }
    }
    let mut ttft = [(0.0f64, 0usize); 4];
    for (id, at) in &first_token {
        let (arrival, p) = arrived[id];
        let t = &mut ttft[p as usize];
        t.0 += at - arrival;
        t.1 += 1;
    }
    let mean = |p: usize| ttft[p].0 / ttft[p].1.max(1) as f64;
    let load = sched.load();
    Ok(format!(
        "makespan {now:.0} ms, {:.0} out tok/s, {steps} steps ({prefill_steps} with prefill, \
         {:.0} ms of prefill constant), {} preemptions, {} recomputed tokens, ratio 3/0 {:.3}",
        (o.requests * o.osl) as f64 / now * 1000.0,
        prefill_steps as f64 * prefill_ms(0) / o.speedup,
        load.preemptions,
        load.recomputed_tokens,
        mean(3) / mean(0)
    ))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let o = parse()?;
    println!(
        "{} requests ({} + {} tokens) over {} ms, seed {}, mocker speed-up {}",
        o.requests, o.isl, o.osl, o.spread_ms, o.seed, o.speedup
    );
    let waits = if o.admission_wait_steps > 0 {
        vec![0, o.admission_wait_steps]
    } else {
        vec![0]
    };
    for wait in waits {
        if wait > 0 {
            println!("with --admission-wait-steps {wait}:");
        }
        for (name, policy, seq_limit) in [
            ("fcfs", SchedulingPolicy::Fcfs, true),
            ("priority", SchedulingPolicy::Priority, true),
            (
                "priority --no-preempt-on-seq-limit",
                SchedulingPolicy::Priority,
                false,
            ),
        ] {
            println!("  {name:36} {}", replay(o, policy, seq_limit, wait)?);
        }
    }
    Ok(())
}
