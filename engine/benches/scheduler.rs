//! Scheduler overhead per step, without compute: how long `schedule` +
//! `update` take for a batch of decoding sequences, and one prefix-cached
//! admission. The engine's step budget is milliseconds; this should stay
//! in microseconds.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use sluice_engine::backend::ForwardOutput;
use sluice_engine::kv::{KvCache, KvEventLog};
use sluice_engine::scheduler::{Request, Scheduler};
use sluice_engine::{SamplingParams, SchedulerConfig};

/// A scheduler kept full of `num_seqs` decoding sequences of 256-token
/// prompts and at most 512 output tokens (a finished one is replaced by a
/// new request, served from the prefix cache).
struct Bench {
    s: Scheduler,
    next_id: u64,
}

impl Bench {
    fn new(num_seqs: usize) -> Self {
        let cfg = SchedulerConfig {
            max_num_seqs: num_seqs,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            ..SchedulerConfig::default()
        };
        let kv = KvCache::new(1 << 16, 16, true, Arc::new(KvEventLog::new(1 << 14)));
        let mut b = Self {
            s: Scheduler::new(cfg, kv, vec![]),
            next_id: 0,
        };
        for _ in 0..num_seqs {
            b.add();
        }
        // Prefill everything so the benchmark measures decode steps.
        while b.s.load().pending_prefill_tokens > 0 {
            b.step();
        }
        b
    }

    fn add(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let prompt: Vec<u32> = (0..256).map(|t| t + (id % 64) as u32 * 7).collect();
        let sampling = SamplingParams {
            max_tokens: Some(512),
            ..SamplingParams::greedy()
        };
        let req = Request {
            request_id: String::new(),
            prompt,
            sampling,
            priority: 0,
            constraint: None,
            first_token_by: None,
            tpot_target: None,
        };
        self.s.add(id, req).expect("valid request");
    }

    /// One step; returns how many sequences finished.
    fn step_once(&mut self) -> usize {
        let st = self.s.schedule();
        let rows = st.seqs.iter().filter(|x| x.needs_logits).count();
        let outs = self
            .s
            .update(&st, ForwardOutput::Tokens(vec![1; rows]))
            .expect("rows match");
        outs.iter().filter(|o| o.finished.is_some()).count()
    }

    /// One step, refilling the batch.
    fn step(&mut self) {
        for _ in 0..self.step_once() {
            self.add();
        }
    }
}

fn decode_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("scheduler_decode_step");
    for n in [1usize, 32, 256] {
        let mut bench = Bench::new(n);
        group.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter(|| black_box(&mut bench).step());
        });
    }
    group.finish();
}

fn cached_admission(c: &mut Criterion) {
    let mut bench = Bench::new(1);
    let prompt: Vec<u32> = (0..1024).collect();
    let sampling = SamplingParams {
        max_tokens: Some(1),
        ..SamplingParams::greedy()
    };
    let mut id = 1_000_000u64;
    c.bench_function("scheduler_prefix_cached_admission_1024_tokens", |b| {
        b.iter(|| {
            id += 1;
            let req = Request {
                request_id: String::new(),
                prompt: prompt.clone(),
                sampling: sampling.clone(),
                priority: 0,
                constraint: None,
                first_token_by: None,
                tpot_target: None,
            };
            bench.s.add(id, req).expect("valid request");
            bench.step_once();
            bench.s.abort(id);
        });
    });
}

criterion_group!(benches, decode_step, cached_admission);
criterion_main!(benches);
