//! CPU backend forward-step throughput.
//!
//! A whole 64-token reply at batch 1, prefill of a 128-token prompt and one
//! decode step at batch 1, 8 and 32
//! (every sequence holding 128 tokens of context), on random weights of the
//! built-in model's shape (`tiny`: hidden 256, 4 layers, 8 heads over 4 kv
//! heads, intermediate 768, vocab 4096). `SLUICE_BENCH_SMALL=1` adds the
//! ~100M-parameter `small` shape (hidden 768, 12 layers, vocab 32000).
//! Throughput is reported in tokens per second.
//!
//! Before criterion runs, a table puts decode tokens/s at batch 1, 8 and 32
//! and prefill tokens/s beside the memory-bandwidth roofline measured in the
//! same run: a decode step must read every weight once, so at best it takes
//! (weight bytes + KV bytes read) / copy bandwidth. The goal is batch-1
//! decode within 2x of that bound. `SLUICE_BENCH_SMALL=0` skips `small` in
//! the table (it is always skipped by criterion unless set to 1).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group};
use sluice_engine::backend::cpu::CpuBackend;
use sluice_engine::backend::{Backend, ForwardBatch, ForwardOutput, SeqChunk};
use sluice_engine::model::{Architecture, Model, ModelConfig};

const BLOCK_SIZE: usize = 16;
const CONTEXT: usize = 128;
const BATCHES: [usize; 3] = [1, 8, 32];

fn config(
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    inter: usize,
    vocab: usize,
) -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim: hidden / heads,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: true,
        vocab_size: vocab,
        max_position_embeddings: 2048,
        qkv_bias: false,
        o_bias: false,
        mlp_bias: false,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
        variant: Default::default(),
    }
}

fn tokens(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 31 + salt * 977 + 5) % vocab) as u32)
        .collect()
}

/// One sequence's blocks: a contiguous run of ids, `seq` picks which.
fn table(seq: usize, len: usize) -> Vec<u32> {
    let per_seq = (CONTEXT + 1).div_ceil(BLOCK_SIZE);
    (0..len.div_ceil(BLOCK_SIZE))
        .map(|b| (seq * per_seq + b) as u32)
        .collect()
}

/// A whole-prompt prefill of sequence 0's context.
fn prefill_batch(vocab: usize) -> ForwardBatch {
    ForwardBatch {
        seqs: vec![SeqChunk {
            tokens: tokens(CONTEXT, 0, vocab),
            start_pos: 0,
            block_table: table(0, CONTEXT),
            needs_logits: true,
        }],
        ..ForwardBatch::default()
    }
}

/// Fills every sequence's context once; decode steps then rewrite slot CONTEXT.
fn fill_contexts(cpu: &mut CpuBackend, vocab: usize) {
    for seq in 0..BATCHES[BATCHES.len() - 1] {
        let batch = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: tokens(CONTEXT, seq, vocab),
                start_pos: 0,
                block_table: table(seq, CONTEXT),
                needs_logits: false,
            }],
            ..ForwardBatch::default()
        };
        cpu.forward(&batch).expect("fill context");
    }
}

/// One decode token for each of `batch_size` sequences holding CONTEXT tokens.
fn decode_batch(batch_size: usize, vocab: usize) -> ForwardBatch {
    ForwardBatch {
        seqs: (0..batch_size)
            .map(|seq| SeqChunk {
                tokens: tokens(1, seq + 7, vocab),
                start_pos: CONTEXT,
                block_table: table(seq, CONTEXT + 1),
                needs_logits: true,
            })
            .collect(),
        ..ForwardBatch::default()
    }
}

fn bench_model(c: &mut Criterion, name: &str, config: ModelConfig) {
    let vocab = config.vocab_size;
    let model = Model::random(config, 1).expect("random model");
    let max_batch = BATCHES[BATCHES.len() - 1];
    let num_blocks = max_batch * (CONTEXT + 1).div_ceil(BLOCK_SIZE);
    let mut cpu = CpuBackend::new(model, num_blocks, BLOCK_SIZE).expect("backend");

    let mut group = c.benchmark_group(format!("{name}/prefill"));
    group.sample_size(10);
    group.throughput(Throughput::Elements(CONTEXT as u64));
    let prefill = prefill_batch(vocab);
    group.bench_function(BenchmarkId::from_parameter(CONTEXT), |b| {
        b.iter(|| black_box(cpu.forward(&prefill).expect("prefill")))
    });
    group.finish();

    fill_contexts(&mut cpu, vocab);
    let mut group = c.benchmark_group(format!("{name}/decode"));
    group.sample_size(10);
    for batch_size in BATCHES {
        let decode = decode_batch(batch_size, vocab);
        group.throughput(Throughput::Elements(batch_size as u64));
        group.bench_function(BenchmarkId::from_parameter(batch_size), |b| {
            b.iter(|| black_box(cpu.forward(&decode).expect("decode")))
        });
    }
    group.finish();
}

/// A whole 64-token reply at batch 1: a 16-token prompt, then 64 greedy
/// decode steps (argmax of the logits, as the sampler's greedy mode does).
fn bench_reply(c: &mut Criterion, name: &str, config: ModelConfig) {
    const PROMPT: usize = 16;
    const REPLY: usize = 64;
    let vocab = config.vocab_size;
    let model = Model::random(config, 2).expect("random model");
    let mut cpu =
        CpuBackend::new(model, (PROMPT + REPLY).div_ceil(BLOCK_SIZE), BLOCK_SIZE).expect("backend");
    let all_blocks = table(0, PROMPT + REPLY);
    let mut group = c.benchmark_group(format!("{name}/reply"));
    group.sample_size(10);
    group.throughput(Throughput::Elements(REPLY as u64));
    group.bench_function(BenchmarkId::from_parameter(REPLY), |b| {
        b.iter(|| {
            let mut tokens = tokens(PROMPT, 3, vocab);
            let mut start_pos = 0;
            for _ in 0..REPLY {
                let seq = SeqChunk {
                    tokens: tokens[start_pos..].to_vec(),
                    start_pos,
                    block_table: all_blocks.clone(),
                    needs_logits: true,
                };
                start_pos = tokens.len();
                let batch = ForwardBatch {
                    seqs: vec![seq],
                    ..ForwardBatch::default()
                };
                let ForwardOutput::Logits { data, .. } = cpu.forward(&batch).expect("step") else {
                    panic!("the CPU backend returns logits");
                };
                let next = data
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32)
                    .expect("non-empty logits");
                tokens.push(next);
            }
            black_box(tokens)
        })
    });
    group.finish();
}

fn forward(c: &mut Criterion) {
    bench_reply(c, "tiny", config(256, 4, 8, 4, 768, 4096));
    bench_model(c, "tiny", config(256, 4, 8, 4, 768, 4096));
    if std::env::var_os("SLUICE_BENCH_SMALL").is_some() {
        bench_model(c, "small", config(768, 12, 12, 4, 2048, 32_000));
    }
}

/// Best-of-several copy bandwidth of a buffer much larger than the caches, in bytes/s
/// (bytes read + bytes written, as a decode step only reads: reported per byte read).
fn copy_bandwidth() -> f64 {
    // A copy reads and writes each byte; count both, as a streaming read would.
    2.0 * sluice_engine::backend::copy_bandwidth(256 << 20, 5)
}

/// Median time of `iters` calls of `f`.
fn median(iters: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn roofline_rows(name: &str, config: ModelConfig, bandwidth: f64) {
    let vocab = config.vocab_size;
    let kv_bytes_per_token =
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4;
    let weight_bytes = config.num_parameters() * 4;
    let model = Model::random(config, 1).expect("random model");
    let max_batch = BATCHES[BATCHES.len() - 1];
    let num_blocks = max_batch * (CONTEXT + 1).div_ceil(BLOCK_SIZE);
    let mut cpu = CpuBackend::new(model, num_blocks, BLOCK_SIZE).expect("backend");
    fill_contexts(&mut cpu, vocab);
    let prefill = prefill_batch(vocab);
    let t = median(5, || {
        black_box(cpu.forward(&prefill).expect("prefill"));
    });
    println!(
        "| {name} | prefill {CONTEXT} | {:>10.0} | {:>10} | {:>6} |",
        CONTEXT as f64 / t.as_secs_f64(),
        "-",
        "-"
    );
    for batch_size in BATCHES {
        let decode = decode_batch(batch_size, vocab);
        let t = median(15, || {
            black_box(cpu.forward(&decode).expect("decode"));
        });
        let bytes = weight_bytes + batch_size * (CONTEXT + 1) * kv_bytes_per_token;
        let bound = bytes as f64 / bandwidth;
        let measured = batch_size as f64 / t.as_secs_f64();
        let roofline = batch_size as f64 / bound;
        println!(
            "| {name} | decode b={batch_size} | {measured:>10.0} | {roofline:>10.0} | {:>5.2}x |",
            roofline / measured
        );
    }
}

/// The roofline table (tokens/s measured beside the bandwidth bound).
fn roofline_table() {
    let bandwidth = copy_bandwidth();
    println!();
    println!("copy bandwidth measured now: {:.1} GB/s", bandwidth / 1e9);
    println!("| model | step | measured tok/s | roofline tok/s | gap |");
    println!("|---|---|---:|---:|---:|");
    roofline_rows("tiny", config(256, 4, 8, 4, 768, 4096), bandwidth);
    if std::env::var("SLUICE_BENCH_SMALL").as_deref() != Ok("0") {
        roofline_rows("small", config(768, 12, 12, 4, 2048, 32_000), bandwidth);
    }
    println!();
}

criterion_group!(benches, forward);

fn main() {
    roofline_table();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
