//! Backend-only decode speed of a model file (directory or GGUF): one
//! decode step at batch 1 and 8 with 128 tokens of context, in tokens/s.
//!
//!     cargo run --release -p sluice-engine --example gguf_decode -- MODEL [STEPS] [BATCH,...] [f32]
//!
//! With `f32`, quantized weights are de-quantized at load (the f32 path).

use std::time::Instant;

use sluice_engine::backend::cpu::CpuBackend;
use sluice_engine::backend::{Backend, ForwardBatch, SeqChunk};
use sluice_engine::model::{Model, Weight};

const BLOCK: usize = 16;
const CONTEXT: usize = 128;

fn table(seq: usize, len: usize) -> Vec<u32> {
    let per = (CONTEXT + BLOCK) / BLOCK;
    (0..len.div_ceil(BLOCK))
        .map(|b| (seq * per + b) as u32)
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: gguf_decode MODEL [STEPS]")?;
    let steps: usize = args.next().map_or(Ok(64), |s| s.parse())?;
    let batches: Vec<usize> = match args.next() {
        Some(list) => list.split(',').map(str::parse).collect::<Result<_, _>>()?,
        None => vec![1, 8],
    };
    let f32_path = args.next().as_deref() == Some("f32");
    let t = Instant::now();
    let mut model = Model::load(path.as_ref())?;
    if f32_path {
        let w = &mut model.weights;
        let dense = |w: &mut Weight| *w = w.dense().into_owned().into();
        dense(&mut w.embed_tokens);
        if let Some(h) = &mut w.lm_head {
            dense(h);
        }
        for l in &mut w.layers {
            for lin in l.linears_mut() {
                dense(&mut lin.weight);
            }
        }
    }
    let mut cpu = CpuBackend::new(model, 8 * (CONTEXT / BLOCK + 1), BLOCK)?;
    eprintln!("loaded in {:.2}s", t.elapsed().as_secs_f64());
    let vocab = cpu.config().vocab_size as u32;
    for seq in 0..8 {
        let batch = ForwardBatch {
            seqs: vec![SeqChunk {
                tokens: (0..CONTEXT as u32)
                    .map(|i| (i * 31 + seq as u32) % vocab)
                    .collect(),
                start_pos: 0,
                block_table: table(seq, CONTEXT),
                needs_logits: false,
            }],
            ..ForwardBatch::default()
        };
        cpu.forward(&batch)?;
    }
    for batch_size in batches {
        let batch = ForwardBatch {
            seqs: (0..batch_size)
                .map(|seq| SeqChunk {
                    tokens: vec![7 + seq as u32],
                    start_pos: CONTEXT,
                    block_table: table(seq, CONTEXT + 1),
                    needs_logits: true,
                })
                .collect(),
            ..ForwardBatch::default()
        };
        cpu.forward(&batch)?;
        let t = Instant::now();
        for _ in 0..steps {
            cpu.forward(&batch)?;
        }
        let per_step = t.elapsed().as_secs_f64() / steps as f64;
        println!(
            "batch {batch_size}: {:.2} ms/step, {:.1} tokens/s",
            per_step * 1e3,
            batch_size as f64 / per_step
        );
    }
    Ok(())
}
