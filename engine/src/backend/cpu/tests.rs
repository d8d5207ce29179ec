//! The CPU backend against a dense, unpaged reference forward pass written
//! as plainly as possible, under many batch shapes and block layouts.

use super::*;
use crate::backend::SeqChunk;
use crate::model::Linear;
use crate::model::test_support::tiny_config;

/// Dense reference: logits at every position of `tokens`, one sequence,
/// no KV cache, no fusion, textbook loops.
fn reference_logits(model: &Model, tokens: &[u32]) -> Vec<Vec<f32>> {
    let c = &model.config;
    let w = &model.weights;
    let (hd, nh, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
    let hidden = c.hidden_size;
    let linear = |l: &Linear, x: &[f32]| -> Vec<f32> {
        let weight = l.weight.dense();
        let (out, inp) = (weight.shape[0], weight.shape[1]);
        (0..out)
            .map(|j| {
                let dot: f64 = (0..inp)
                    .map(|i| f64::from(weight.data[j * inp + i]) * f64::from(x[i]))
                    .sum();
                dot as f32 + l.bias.as_ref().map_or(0.0, |b| b[j])
            })
            .collect()
    };
    let norm = |x: &[f32], weight: &[f32]| -> Vec<f32> {
        let ms = x.iter().map(|v| f64::from(*v) * f64::from(*v)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + f64::from(c.rms_norm_eps)).sqrt();
        x.iter()
            .zip(weight)
            .map(|(v, w)| (f64::from(*v) * inv) as f32 * w)
            .collect()
    };
    let rope = |v: &mut [f32], pos: usize| {
        for head in v.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let freq = 1.0 / f64::from(c.rope_theta).powf(2.0 * i as f64 / hd as f64);
                let (s, co) = (pos as f64 * freq).sin_cos();
                let (a, b) = (f64::from(head[i]), f64::from(head[i + hd / 2]));
                head[i] = (a * co - b * s) as f32;
                head[i + hd / 2] = (b * co + a * s) as f32;
            }
        }
    };
    let embed = w.embed_tokens.dense();
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| embed.data[t as usize * hidden..(t as usize + 1) * hidden].to_vec())
        .collect();
    for layer in &w.layers {
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = norm(x, &layer.input_layernorm);
            let mut q = linear(&layer.q_proj, &h);
            let mut k = linear(&layer.k_proj, &h);
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(linear(&layer.v_proj, &h));
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut attn = vec![0.0f32; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|j| {
                        let k = &ks[j][g * hd..(g + 1) * hd];
                        q.iter()
                            .zip(k)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for d in 0..hd {
                    let v: f64 = (0..=pos)
                        .map(|j| exps[j] * f64::from(vs[j][g * hd + d]))
                        .sum();
                    attn[head * hd + d] = (v / total) as f32;
                }
            }
            let o = linear(&layer.o_proj, &attn);
            for (x, o) in x.iter_mut().zip(&o) {
                *x += o;
            }
            let h = norm(x, &layer.post_attention_layernorm);
            let gate = linear(&layer.gate_proj, &h);
            let up = linear(&layer.up_proj, &h);
            let act: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let down = linear(&layer.down_proj, &act);
            for (x, d) in x.iter_mut().zip(&down) {
                *x += d;
            }
        }
    }
    let head = Linear {
        weight: w.lm_head.clone().unwrap_or_else(|| w.embed_tokens.clone()),
        bias: None,
    };
    xs.iter()
        .map(|x| linear(&head, &norm(x, &w.norm)))
        .collect()
}

/// `max |a - b| / max(max |b|, 1e-6)`.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    let scale = b.iter().map(|y| y.abs()).fold(0.0, f32::max).max(1e-6);
    diff / scale
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    let err = rel_err(got, want);
    assert!(err < 1e-4, "{what}: relative error {err}");
}

fn logits(out: ForwardOutput) -> Vec<f32> {
    match out {
        ForwardOutput::Logits { data, .. } => data,
        ForwardOutput::Tokens(_) => panic!("the CPU backend returns logits"),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + salt * 13 + 3) % 40)
        .collect()
}

fn chunk(tokens: &[u32], start_pos: usize, block_table: &[u32], needs_logits: bool) -> SeqChunk {
    SeqChunk {
        tokens: tokens.to_vec(),
        start_pos,
        block_table: block_table.to_vec(),
        needs_logits,
    }
}

fn batch(seqs: Vec<SeqChunk>) -> ForwardBatch {
    ForwardBatch {
        seqs,
        ..ForwardBatch::default()
    }
}

fn backend(model: &Model, num_blocks: usize, block_size: usize) -> CpuBackend {
    CpuBackend::new(model.clone(), num_blocks, block_size).expect("backend")
}

#[test]
fn full_prefill_matches_dense_reference() {
    let model = Model::random(tiny_config(false), 11).expect("model");
    let tokens = prompt(11, 0);
    let want = reference_logits(&model, &tokens);
    let mut cpu = backend(&model, 8, 4);
    let out = cpu
        .forward(&batch(vec![chunk(&tokens, 0, &[5, 2, 7], true)]))
        .expect("forward");
    assert_close(&logits(out), &want[10], "prefill");
}

#[test]
fn decode_steps_through_paged_cache_match_reference_at_every_position() {
    let model = Model::random(tiny_config(true), 12).expect("model");
    let tokens = prompt(14, 1);
    let want = reference_logits(&model, &tokens);
    let table = [3, 0, 6, 1];
    let mut cpu = backend(&model, 8, 4);
    let out = cpu
        .forward(&batch(vec![chunk(&tokens[..5], 0, &table[..2], true)]))
        .expect("prefill");
    assert_close(&logits(out), &want[4], "prefill");
    for pos in 5..tokens.len() {
        let blocks = (pos + 1).div_ceil(4);
        let out = cpu
            .forward(&batch(vec![chunk(
                &tokens[pos..=pos],
                pos,
                &table[..blocks],
                true,
            )]))
            .expect("decode");
        assert_close(&logits(out), &want[pos], &format!("decode at {pos}"));
    }
}

#[test]
fn chunked_prefill_matches_single_prefill() {
    let model = Model::random(tiny_config(false), 13).expect("model");
    let tokens = prompt(13, 2);
    let table = [1, 2, 3, 4];
    let mut whole = backend(&model, 5, 4);
    let one = logits(
        whole
            .forward(&batch(vec![chunk(&tokens, 0, &table, true)]))
            .expect("forward"),
    );
    let mut split = backend(&model, 5, 4);
    let first = split
        .forward(&batch(vec![chunk(&tokens[..6], 0, &table[..2], false)]))
        .expect("chunk 1");
    assert!(logits(first).is_empty(), "no logits for a non-final chunk");
    let two = logits(
        split
            .forward(&batch(vec![chunk(&tokens[6..], 6, &table, true)]))
            .expect("chunk 2"),
    );
    assert_close(&two, &one, "chunked prefill");
}

#[test]
fn mixed_batch_matches_each_sequence_run_alone() {
    let model = Model::random(tiny_config(false), 14).expect("model");
    let (a, b, c) = (prompt(9, 3), prompt(6, 4), prompt(12, 5));
    let (ref_a, ref_b, ref_c) = (
        reference_logits(&model, &a),
        reference_logits(&model, &b),
        reference_logits(&model, &c),
    );
    let mut cpu = backend(&model, 16, 4);
    let (ta, tb, tc) = ([0, 1, 2], [3, 4], [5, 6, 7]);
    // Step 1: a's first chunk, b's whole prompt but its last token.
    let out = cpu
        .forward(&batch(vec![
            chunk(&a[..4], 0, &ta[..1], false),
            chunk(&b[..5], 0, &tb, true),
        ]))
        .expect("step 1");
    assert_close(&logits(out), &ref_b[4], "b prefill");
    // Step 2: a finishes its prompt, b decodes, c prefills whole.
    let out = logits(
        cpu.forward(&batch(vec![
            chunk(&a[4..], 4, &ta, true),
            chunk(&b[5..6], 5, &tb, true),
            chunk(&c, 0, &tc, true),
        ]))
        .expect("step 2"),
    );
    assert_eq!(out.len(), 3 * 40);
    assert_close(&out[..40], &ref_a[8], "a prefill end");
    assert_close(&out[40..80], &ref_b[5], "b decode");
    assert_close(&out[80..], &ref_c[11], "c prefill");
}

#[test]
fn shared_prefix_blocks_are_read_by_two_sequences() {
    let model = Model::random(tiny_config(false), 15).expect("model");
    let mut long = prompt(8, 6);
    let mut cpu = backend(&model, 8, 4);
    cpu.forward(&batch(vec![chunk(&long, 0, &[0, 1], false)]))
        .expect("prefill prefix");
    // Two sequences share both full prefix blocks and diverge after.
    let mut other = long.clone();
    long.push(9);
    other.push(17);
    let out = logits(
        cpu.forward(&batch(vec![
            chunk(&long[8..], 8, &[0, 1, 2], true),
            chunk(&other[8..], 8, &[0, 1, 3], true),
        ]))
        .expect("diverge"),
    );
    assert_close(&out[..40], &reference_logits(&model, &long)[8], "first");
    assert_close(&out[40..], &reference_logits(&model, &other)[8], "second");
}

#[test]
fn blocks_copied_with_read_and_write_continue_the_sequence() {
    let model = Model::random(tiny_config(false), 16).expect("model");
    let tokens = prompt(10, 7);
    let want = reference_logits(&model, &tokens);
    let mut prefill = backend(&model, 4, 4);
    prefill
        .forward(&batch(vec![chunk(&tokens[..9], 0, &[0, 1, 2], false)]))
        .expect("prefill");
    let mut decode = backend(&model, 8, 4);
    let mut buf = vec![0u8; prefill.kv_layout().block_bytes()];
    for (src, dst) in [(0, 6), (1, 4), (2, 5)] {
        prefill.read_block(src, &mut buf).expect("read");
        decode.write_block(dst, &buf).expect("write");
    }
    let out = decode
        .forward(&batch(vec![chunk(&tokens[9..], 9, &[6, 4, 5], true)]))
        .expect("decode");
    assert_close(&logits(out), &want[9], "decode after transfer");
}

#[test]
fn biases_of_qwen2_and_llama_attention_bias_are_applied() {
    let mut config = tiny_config(false);
    config.architecture = crate::model::Architecture::Qwen2;
    config.qkv_bias = true;
    for (o_bias, mlp_bias) in [(false, false), (true, true)] {
        config.o_bias = o_bias;
        config.mlp_bias = mlp_bias;
        let model = Model::random(config.clone(), 17).expect("model");
        let tokens = prompt(7, 8);
        let want = reference_logits(&model, &tokens);
        let mut cpu = backend(&model, 4, 4);
        let out = cpu
            .forward(&batch(vec![chunk(&tokens, 0, &[2, 0], true)]))
            .expect("forward");
        assert_close(&logits(out), &want[6], "biased prefill");
    }
}

#[test]
fn batch_errors_are_classified() {
    let model = Model::random(tiny_config(true), 18).expect("model");
    let mut cpu = backend(&model, 4, 4);
    let short_table = cpu.forward(&batch(vec![chunk(&prompt(5, 0), 0, &[0], true)]));
    assert!(matches!(short_table, Err(EngineError::InvalidRequest(_))));
    let bad_block = cpu.forward(&batch(vec![chunk(&prompt(5, 0), 0, &[0, 4], true)]));
    assert!(matches!(
        bad_block,
        Err(EngineError::BlockOutOfRange {
            id: 4,
            num_blocks: 4
        })
    ));
    let bad_token = cpu.forward(&batch(vec![chunk(&[40], 0, &[0], true)]));
    assert!(matches!(bad_token, Err(EngineError::InvalidRequest(_))));
    let empty = cpu.forward(&batch(vec![chunk(&[], 0, &[0], true)]));
    assert!(matches!(empty, Err(EngineError::InvalidRequest(_))));
    assert!(CpuBackend::new(model, 0, 4).is_err());
}

#[test]
fn empty_batch_returns_no_rows() {
    let model = Model::random(tiny_config(true), 19).expect("model");
    let mut cpu = backend(&model, 4, 4);
    let out = cpu.forward(&ForwardBatch::default()).expect("empty step");
    assert!(matches!(out, ForwardOutput::Logits { vocab_size: 40, ref data } if data.is_empty()));
    assert_eq!(cpu.kv_layout().block_bytes(), 2 * 2 * 4 * 2 * 8 * 4);
    assert_eq!(cpu.num_blocks(), 4);
    assert_eq!(cpu.name(), "cpu");
}

#[test]
fn backends_sharing_weights_keep_separate_kv_memory() {
    let model = Model::random(tiny_config(false), 20).expect("model");
    let tokens = prompt(9, 9);
    let want = reference_logits(&model, &tokens);
    let mut first = backend(&model, 4, 4);
    let mut second = CpuBackend::with_weights(first.weights().clone(), 4, 4).expect("shared");
    assert_eq!(Arc::strong_count(first.weights()), 2);
    first
        .forward(&batch(vec![chunk(&tokens[..8], 0, &[0, 1], false)]))
        .expect("prefill first");
    // The second backend's block 0 and 1 are still zero: it must prefill itself.
    second
        .forward(&batch(vec![chunk(&prompt(8, 3), 0, &[0, 1], false)]))
        .expect("prefill second");
    let out = first
        .forward(&batch(vec![chunk(&tokens[8..], 8, &[0, 1, 2], true)]))
        .expect("decode");
    assert_close(
        &logits(out),
        &want[8],
        "first backend after the second wrote its own blocks",
    );
}
