//! Parity with Hugging Face transformers.
//!
//! `tests/fixtures/parity/make_fixture.py` built three tiny random models
//! (Llama with an untied lm_head; Llama with tied embeddings and Llama 3
//! RoPE scaling; Qwen2 with q/k/v biases, one kv head and linear RoPE
//! scaling) and recorded, in f32, the logits of a 20-token prompt's last
//! position and of 4 greedy decode steps. Here the engine loads each model
//! directory with its own loader, runs the prompt through the paged KV cache
//! with 4-token blocks (so attention crosses block boundaries, with block
//! ids handed out in a scrambled order), then decodes one token at a time.
//! A fourth model uses dynamic NTK RoPE with a prompt longer than its
//! `max_position_embeddings`; there the reference (a full forward per row)
//! rotates earlier keys with a base no cache can have used, so only its
//! single-chunk prefill is compared.
//!
//! Through the whole engine (scheduler, chunked prefill, prefix cache,
//! greedy sampler), the generated tokens must be transformers' greedy ones.
//!
//! Agreement is measured per logits row as
//! `max_i |engine_i - hf_i| / max(max_i |hf_i|, 1e-6)`: the largest
//! absolute difference relative to the row's largest magnitude, which is
//! what decides sampling. It must stay below 1e-4.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use sluice_engine::backend::cpu::CpuBackend;
use sluice_engine::backend::{Backend, ForwardBatch, ForwardOutput, SeqChunk};
use sluice_engine::model::{Architecture, ModelConfig, RopeScaling};
use sluice_engine::{EngineConfig, EngineHandle, Request, SamplingParams, SchedulerConfig};

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 23;
const TOLERANCE: f32 = 1e-4;
const CASES: [&str; 4] = ["llama_untied", "llama3_tied", "qwen2_tied", "llama_dynamic"];

#[derive(Deserialize)]
struct Reference {
    cases: std::collections::HashMap<String, Case>,
}

#[derive(Deserialize)]
struct Case {
    /// False where the reference's full-forward rows differ from any KV
    /// cache's by construction (dynamic NTK RoPE): only the single-chunk
    /// prefill is compared.
    cache_consistent: bool,
    prompt: Vec<u32>,
    prefill_logits: Vec<f32>,
    decode: Vec<Step>,
}

#[derive(Deserialize)]
struct Step {
    token: u32,
    logits: Vec<f32>,
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parity")
}

fn reference() -> Reference {
    let text =
        std::fs::read_to_string(fixture_dir().join("reference.json")).expect("reference.json");
    serde_json::from_str(&text).expect("valid reference.json")
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "logits row length");
    let diff = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0, f32::max).max(1e-6);
    diff / scale
}

fn assert_parity(got: &[f32], want: &[f32], what: &str) {
    assert_within(got, want, TOLERANCE, what);
}

fn assert_within(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    let err = rel_err(got, want);
    assert!(
        err < tolerance,
        "{what}: relative error {err:e} ≥ {tolerance:e}"
    );
}

/// A minimal stand-in for the scheduler: one growing block table per
/// sequence, block ids taken from a scrambled free list.
struct Driver {
    backend: CpuBackend,
    free: Vec<u32>,
}

/// One sequence as the driver tracks it.
#[derive(Default)]
struct Seq {
    len: usize,
    table: Vec<u32>,
}

impl Driver {
    fn new(case: &str) -> Self {
        Self::at(&fixture_dir().join(case))
    }

    /// A driver over the model at `path` (a directory or a GGUF file).
    fn at(path: &Path) -> Self {
        let backend = CpuBackend::from_path(path, NUM_BLOCKS, BLOCK_SIZE).expect("load fixture");
        // 5 and 23 are coprime: every id once, never in order.
        let free = (0..NUM_BLOCKS as u32)
            .map(|i| (i * 5 + 3) % NUM_BLOCKS as u32)
            .rev()
            .collect();
        Driver { backend, free }
    }

    /// The chunk computing `tokens` after what `seq` holds, growing its table.
    fn chunk(&mut self, seq: &mut Seq, tokens: &[u32], needs_logits: bool) -> SeqChunk {
        let start_pos = seq.len;
        seq.len += tokens.len();
        while seq.table.len() * BLOCK_SIZE < seq.len {
            seq.table
                .push(self.free.pop().expect("fixture fits the pool"));
        }
        SeqChunk {
            tokens: tokens.to_vec(),
            start_pos,
            block_table: seq.table.clone(),
            needs_logits,
        }
    }

    /// Runs one step; returns one logits row per chunk with `needs_logits`.
    fn step(&mut self, seqs: Vec<SeqChunk>) -> Vec<Vec<f32>> {
        let batch = ForwardBatch {
            seqs,
            ..ForwardBatch::default()
        };
        match self.backend.forward(&batch).expect("forward") {
            ForwardOutput::Logits { vocab_size, data } => {
                data.chunks(vocab_size).map(<[f32]>::to_vec).collect()
            }
            ForwardOutput::Tokens(_) => panic!("the CPU backend returns logits"),
        }
    }
}

/// Prefills `case`'s prompt in chunks of the given lengths, then decodes,
/// checking every logits row against transformers.
fn check_case(name: &str, case: &Case, chunks: &[usize]) {
    check_model(&fixture_dir().join(name), name, case, chunks, TOLERANCE);
}

/// [`check_case`] for the model at `path`, within `tolerance`.
fn check_model(path: &Path, name: &str, case: &Case, chunks: &[usize], tolerance: f32) {
    let mut driver = Driver::at(path);
    let mut seq = Seq::default();
    let mut done = 0;
    for (i, &len) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let chunk = driver.chunk(&mut seq, &case.prompt[done..done + len], last);
        let rows = driver.step(vec![chunk]);
        assert_eq!(rows.len(), usize::from(last), "{name}: rows for chunk {i}");
        if last {
            assert_within(
                &rows[0],
                &case.prefill_logits,
                tolerance,
                &format!("{name} prefill {chunks:?}"),
            );
        }
        done += len;
    }
    assert_eq!(done, case.prompt.len());
    if !case.cache_consistent {
        return;
    }
    for (i, step) in case.decode.iter().enumerate() {
        let chunk = driver.chunk(&mut seq, &[step.token], true);
        let rows = driver.step(vec![chunk]);
        assert_within(
            &rows[0],
            &step.logits,
            tolerance,
            &format!("{name} decode step {i}"),
        );
    }
}

#[test]
fn full_prefill_and_decode_steps_match_transformers() {
    let reference = reference();
    for name in CASES {
        let case = &reference.cases[name];
        check_case(name, case, &[case.prompt.len()]);
    }
}

#[test]
fn chunked_prefill_matches_transformers() {
    let reference = reference();
    for name in CASES {
        let case = &reference.cases[name];
        if !case.cache_consistent {
            continue;
        }
        // 7 + 13: the chunk boundary falls inside a block.
        check_case(name, case, &[7, case.prompt.len() - 7]);
    }
}

#[test]
fn batched_sequences_match_transformers() {
    let reference = reference();
    let name = "llama_untied";
    let case = &reference.cases[name];
    let mut driver = Driver::new(name);
    let (mut a, mut b) = (Seq::default(), Seq::default());
    // Step 1: a prefills whole; b prefills its first 9 tokens.
    let seqs = vec![
        driver.chunk(&mut a, &case.prompt, true),
        driver.chunk(&mut b, &case.prompt[..9], false),
    ];
    let rows = driver.step(seqs);
    assert_eq!(rows.len(), 1);
    assert_parity(&rows[0], &case.prefill_logits, "a prefill");
    // Step 2: a decodes its first token while b finishes its prompt.
    let first = &case.decode[0];
    let seqs = vec![
        driver.chunk(&mut a, &[first.token], true),
        driver.chunk(&mut b, &case.prompt[9..], true),
    ];
    let rows = driver.step(seqs);
    assert_parity(&rows[0], &first.logits, "a decode 0");
    assert_parity(&rows[1], &case.prefill_logits, "b prefill");
    // Then both decode together, b one step behind a.
    for i in 1..case.decode.len() {
        let seqs = vec![
            driver.chunk(&mut a, &[case.decode[i].token], true),
            driver.chunk(&mut b, &[case.decode[i - 1].token], true),
        ];
        let rows = driver.step(seqs);
        assert_parity(&rows[0], &case.decode[i].logits, &format!("a decode {i}"));
        assert_parity(
            &rows[1],
            &case.decode[i - 1].logits,
            &format!("b decode {}", i - 1),
        );
    }
}

#[test]
fn fixture_configs_parse_as_written_by_transformers() {
    let dir = fixture_dir();
    let llama = ModelConfig::from_dir(&dir.join("llama_untied")).expect("llama config");
    assert_eq!(llama.architecture, Architecture::Llama);
    assert!(!llama.tie_word_embeddings);
    assert_eq!(
        (
            llama.num_attention_heads,
            llama.num_key_value_heads,
            llama.head_dim
        ),
        (4, 2, 16)
    );
    assert_eq!(llama.eos_token_ids, vec![2]);
    let llama3 = ModelConfig::from_dir(&dir.join("llama3_tied")).expect("llama3 config");
    assert!(llama3.tie_word_embeddings);
    assert_eq!(llama3.eos_token_ids, vec![2, 3]);
    assert!(matches!(
        llama3.rope_scaling,
        Some(RopeScaling::Llama3 {
            original_max_position_embeddings: 8,
            ..
        })
    ));
    let qwen2 = ModelConfig::from_dir(&dir.join("qwen2_tied")).expect("qwen2 config");
    assert_eq!(qwen2.architecture, Architecture::Qwen2);
    assert!(qwen2.qkv_bias);
    assert_eq!(
        qwen2.rope_scaling,
        Some(RopeScaling::Linear { factor: 2.0 })
    );
    assert_eq!(qwen2.rope_theta, 1_000_000.0);
    let dynamic = ModelConfig::from_dir(&dir.join("llama_dynamic")).expect("dynamic config");
    assert_eq!(
        dynamic.rope_scaling,
        Some(RopeScaling::Dynamic { factor: 2.0 })
    );
    assert_eq!(dynamic.max_position_embeddings, 12);
}

/// The greedy continuation transformers produced: the recorded decode
/// tokens, then the argmax of the last recorded logits.
fn greedy_tokens(case: &Case) -> Vec<u32> {
    let last = &case.decode[case.decode.len() - 1].logits;
    let next = last
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i as u32)
        .expect("non-empty logits");
    case.decode.iter().map(|s| s.token).chain([next]).collect()
}

#[tokio::test]
async fn engine_greedy_generation_reproduces_transformers_tokens() {
    let reference = reference();
    for name in ["llama_untied", "qwen2_tied"] {
        greedy_case(name, &reference.cases[name]).await;
    }
}

/// Through the whole engine, two requests at once (batched, chunked) then
/// one from the prefix cache must generate transformers' greedy tokens.
async fn greedy_case(name: &str, case: &Case) {
    {
        let want = greedy_tokens(case);
        let backend =
            CpuBackend::from_path(&fixture_dir().join(name), 32, BLOCK_SIZE).expect("load fixture");
        let cfg = EngineConfig {
            block_size: BLOCK_SIZE,
            // Prompts of 20 tokens prefill in chunks of at most 6.
            scheduler: SchedulerConfig {
                max_num_batched_tokens: 6,
                ..SchedulerConfig::default()
            },
            ..EngineConfig::default()
        };
        let engine = EngineHandle::spawn(Box::new(backend), cfg).expect("engine starts");
        let request = |id: &str| Request {
            request_id: id.to_owned(),
            prompt: case.prompt.clone(),
            sampling: SamplingParams {
                max_tokens: Some(want.len()),
                ..SamplingParams::greedy()
            },
            priority: 0,
            constraint: None,
            first_token_by: None,
            tpot_target: None,
        };
        // Two at once (batched, chunked), then one served from the prefix cache.
        let first = engine.generate(request("a")).expect("valid request");
        let second = engine.generate(request("b")).expect("valid request");
        let (a, b) = tokio::join!(first.collect(), second.collect());
        let third = engine.generate(request("c")).expect("valid request");
        let (c, finished) = third.collect().await;
        for (who, got) in [("a", &a.0), ("b", &b.0), ("c", &c)] {
            assert_eq!(got, &want, "{name}: request {who}");
        }
        let usage = finished.expect("finished").usage;
        assert!(
            usage.cached_tokens >= 16,
            "{name}: repeated prompt cached {usage:?}"
        );
        engine.shutdown();
    }
}

/// The families beyond Llama and Qwen2 (`make_families.py`,
/// `FAMILIES.md`): 32 decode steps each.
const FAMILY_CASES: [&str; 5] = [
    "qwen3_tied",
    "mistral_sliding",
    "phi3_fused",
    "gemma2_softcap",
    "gemma3_text",
];

fn families() -> Reference {
    let text = std::fs::read_to_string(fixture_dir().join("families.json")).expect("families.json");
    serde_json::from_str(&text).expect("valid families.json")
}

#[test]
fn families_match_transformers_for_32_decode_steps() {
    let reference = families();
    for name in FAMILY_CASES {
        let case = &reference.cases[name];
        assert_eq!(case.decode.len(), 32, "{name}");
        check_case(name, case, &[case.prompt.len()]);
        // A chunk boundary inside a block and, for the sliding window (8),
        // a chunk that starts beyond the window of its first token.
        check_case(name, case, &[3, 10, 7]);
    }
}

#[test]
fn family_configs_parse_as_written_by_transformers() {
    let dir = fixture_dir();
    let qwen3 = ModelConfig::from_dir(&dir.join("qwen3_tied")).expect("qwen3 config");
    assert_eq!(qwen3.architecture, Architecture::Qwen3);
    assert!(qwen3.variant.qk_norm && !qwen3.qkv_bias);
    assert_eq!(qwen3.head_dim, 16, "explicit head_dim, not hidden / heads");
    assert_eq!(qwen3.variant.window(0), None);
    let mistral = ModelConfig::from_dir(&dir.join("mistral_sliding")).expect("mistral config");
    assert_eq!(mistral.architecture, Architecture::Mistral);
    assert_eq!(
        (mistral.variant.window(0), mistral.variant.window(1)),
        (Some(8), Some(8))
    );
    let phi3 = ModelConfig::from_dir(&dir.join("phi3_fused")).expect("phi3 config");
    assert_eq!(phi3.architecture, Architecture::Phi3);
    assert!(phi3.variant.fused_projections);
    assert_eq!(phi3.variant.window(0), None);
    let gemma2 = ModelConfig::from_dir(&dir.join("gemma2_softcap")).expect("gemma2 config");
    assert_eq!(gemma2.architecture, Architecture::Gemma2);
    let g = gemma2.variant.gemma.as_ref().expect("gemma block");
    assert_eq!((g.attn_softcap, g.final_softcap), (Some(4.0), Some(3.0)));
    assert_eq!(
        g.attn_scale,
        1.0 / 32f32.sqrt(),
        "query_pre_attn_scalar, not head_dim"
    );
    let windows: Vec<_> = (0..3).map(|l| gemma2.variant.window(l)).collect();
    assert_eq!(windows, [Some(8), None, Some(8)]);
    let gemma3 = ModelConfig::from_dir(&dir.join("gemma3_text")).expect("gemma3 config");
    assert_eq!(gemma3.architecture, Architecture::Gemma3);
    assert!(gemma3.variant.qk_norm);
    let g = gemma3.variant.gemma.as_ref().expect("gemma block");
    assert_eq!(g.attn_softcap, None, "Gemma 3 never soft-caps attention");
    assert_eq!(g.local_rope, Some((10_000.0, None)));
    assert_eq!(
        (gemma3.rope_theta, gemma3.rope_scaling),
        (1_000_000.0, Some(RopeScaling::Linear { factor: 8.0 }))
    );
    let windows: Vec<_> = (0..4).map(|l| gemma3.variant.window(l)).collect();
    assert_eq!(windows, [Some(8), Some(8), None, Some(8)]);
}

#[tokio::test]
async fn families_greedy_generation_reproduces_transformers_tokens() {
    let reference = families();
    for name in FAMILY_CASES {
        greedy_case(name, &reference.cases[name]).await;
    }
}

/// The same models as GGUF files, written the way llama.cpp's converter
/// writes them (`tests/fixtures/gguf/make_family_ggufs.py`: names, q/k row
/// permutation, `rope_freqs` for Llama 3 scaling, linear scaling keys,
/// Phi-3's fused tensors, Gemma's norms stored with their 1 added, the
/// window and pattern keys llama.cpp reads; the script also ran llama.cpp
/// on each, bar Mistral's window, and it matched transformers): in
/// f32 they must match transformers as the directories do; in Q8_0 (weights
/// computed on 8-bit blocks, activations quantized) within 5% (measured:
/// 1.1% at the prompt, up to 2.1% after a few decode steps, these random
/// weights being far from what quantization is tuned for; a wrong row
/// permutation or scale is off by the order of the logits themselves).
#[test]
fn gguf_files_of_the_fixtures_match_transformers() {
    let gguf = fixture_dir().join("../gguf");
    let (reference, families) = (reference(), families());
    let cases = [
        ("llama_untied", &reference),
        ("llama3_tied", &reference),
        ("qwen2_tied", &reference),
        ("qwen3_tied", &families),
        ("mistral_sliding", &families),
        ("phi3_fused", &families),
        ("gemma2_softcap", &families),
        ("gemma3_text", &families),
    ];
    for (name, file) in cases {
        let case = &file.cases[name];
        let path = gguf.join(format!("{name}.gguf"));
        check_model(&path, name, case, &[case.prompt.len()], TOLERANCE);
        check_model(&path, name, case, &[7, case.prompt.len() - 7], TOLERANCE);
    }
    let case = &reference.cases["llama_untied"];
    let q8 = gguf.join("llama_untied.q8_0.gguf");
    check_model(&q8, "llama_untied q8_0", case, &[case.prompt.len()], 5e-2);
}
