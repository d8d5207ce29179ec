//! The built-in model: a small Llama-architecture model with seeded random
//! weights and a real byte-level BPE tokenizer, written in the Hugging Face
//! layout so the engine, the frontend and transformers all load it the same
//! way (`sluice model init`, and `sluice up` without `--model`).
//!
//! Owns the two sizes ([`BuiltinSize`]), the embedded training text of the
//! tokenizer (`builtin/corpus.txt`, written for Sluice), and the writer
//! ([`write_builtin_model`]). It does not own loading: that is `model` for the
//! weights and `sluice-tokens` for the tokenizer and chat template.
//!
//! Invariant: the output is a pure function of the size. Tokenizer training
//! is deterministic, weights come from one `StdRng` seeded with 0 drawn in a
//! fixed tensor order, JSON objects are built in a fixed key order, so writing
//! twice gives the same bytes.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use serde_json::json;
use sluice_tokens::{FALLBACK_CHAT_TEMPLATE, Tokenizer, train_byte_level_bpe};

use crate::error::EngineError;

/// English text the built-in tokenizer is trained on.
const CORPUS: &str = include_str!("builtin/corpus.txt");
/// Upper bound on the trained vocabulary (special tokens and bytes included).
const TOKENIZER_VOCAB_LIMIT: usize = 4096;
/// Seed of the weight generator.
const WEIGHT_SEED: u64 = 0;
/// Standard deviation of every random matrix (transformers' `initializer_range`).
const INIT_STD: f64 = 0.02;

/// `<|begin_of_text|>`: prepended when encoding with special tokens, and by the chat template.
pub const BOS_TOKEN: &str = "<|begin_of_text|>";
/// `<|end_of_text|>`: end of a document; also ends generation.
pub const END_OF_TEXT_TOKEN: &str = "<|end_of_text|>";
/// `<|im_start|>`: opens a chat turn.
pub const IM_START_TOKEN: &str = "<|im_start|>";
/// `<|im_end|>`: closes a chat turn; the model's `eos_token`.
pub const IM_END_TOKEN: &str = "<|im_end|>";
/// The special tokens, in id order (ids 0 to 3).
pub const SPECIAL_TOKENS: [&str; 4] = [BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN];

/// Which built-in model to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BuiltinSize {
    /// ~4M parameters, f32: hidden 256, 4 layers, 8 heads (4 KV), vocab =
    /// the tokenizer's. Fast enough for tests and the default `sluice up`.
    Tiny,
    /// ~100M parameters, bf16: hidden 768, 12 layers, 12 heads (4 KV),
    /// intermediate 2048, vocab padded to 32000 (the padded embedding rows
    /// are zero, so greedy decoding emits real tokens). For benchmarks.
    Small,
}

impl BuiltinSize {
    /// The name the model is served under (`sluice-tiny`, `sluice-small`).
    pub fn model_name(self) -> &'static str {
        match self {
            BuiltinSize::Tiny => "sluice-tiny",
            BuiltinSize::Small => "sluice-small",
        }
    }

    fn spec(self) -> Spec {
        match self {
            BuiltinSize::Tiny => Spec {
                hidden: 256,
                layers: 4,
                heads: 8,
                kv_heads: 4,
                intermediate: 768,
                vocab: None,
                dtype: WeightDtype::F32,
            },
            BuiltinSize::Small => Spec {
                hidden: 768,
                layers: 12,
                heads: 12,
                kv_heads: 4,
                intermediate: 2048,
                vocab: Some(32_000),
                dtype: WeightDtype::Bf16,
            },
        }
    }
}

impl fmt::Display for BuiltinSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BuiltinSize::Tiny => "tiny",
            BuiltinSize::Small => "small",
        })
    }
}

impl FromStr for BuiltinSize {
    type Err = EngineError;

    /// `tiny` or `small`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tiny" => Ok(BuiltinSize::Tiny),
            "small" => Ok(BuiltinSize::Small),
            other => Err(EngineError::InvalidRequest(format!(
                "unknown built-in model size {other:?} (expected tiny or small)"
            ))),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WeightDtype {
    F32,
    Bf16,
}

impl WeightDtype {
    fn torch_name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "float32",
            WeightDtype::Bf16 => "bfloat16",
        }
    }

    fn safetensors(self) -> Dtype {
        match self {
            WeightDtype::F32 => Dtype::F32,
            WeightDtype::Bf16 => Dtype::BF16,
        }
    }

    fn push(self, out: &mut Vec<u8>, value: f32) {
        match self {
            WeightDtype::F32 => out.extend_from_slice(&value.to_le_bytes()),
            WeightDtype::Bf16 => out.extend_from_slice(&half::bf16::from_f32(value).to_le_bytes()),
        }
    }
}

/// Architecture of one size; `vocab: None` means "the tokenizer's size".
#[derive(Debug, Clone, Copy)]
struct Spec {
    hidden: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: Option<usize>,
    dtype: WeightDtype,
}

impl Spec {
    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Every tensor as (HF name, shape, initialisation), in generation
    /// order. Embedding rows past `tokenizer_vocab` (padding) are zero.
    fn tensors(&self, vocab: usize, tokenizer_vocab: usize) -> Vec<(String, Vec<usize>, Init)> {
        let (h, q, kv, inter) = (
            self.hidden,
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
            self.intermediate,
        );
        let embed_init = Init::NormalThenZeros {
            random: vocab.min(tokenizer_vocab) * h,
        };
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![vocab, h],
            embed_init,
        )];
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            for (name, shape) in [
                ("self_attn.q_proj", [q, h]),
                ("self_attn.k_proj", [kv, h]),
                ("self_attn.v_proj", [kv, h]),
                ("self_attn.o_proj", [h, q]),
                ("mlp.gate_proj", [inter, h]),
                ("mlp.up_proj", [inter, h]),
                ("mlp.down_proj", [h, inter]),
            ] {
                out.push((format!("{p}.{name}.weight"), shape.to_vec(), Init::Normal));
            }
            out.push((format!("{p}.input_layernorm.weight"), vec![h], Init::Ones));
            out.push((
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::Ones,
            ));
        }
        out.push(("model.norm.weight".to_string(), vec![h], Init::Ones));
        out
    }

    #[cfg(test)]
    fn parameter_count(&self, vocab: usize) -> usize {
        self.tensors(vocab, vocab)
            .iter()
            .map(|(_, shape, _)| shape.iter().product::<usize>())
            .sum()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Init {
    /// Normal(0, [`INIT_STD`]).
    Normal,
    /// Normal for the first `random` values, zero after: the embedding rows
    /// of padded ids, so that with tied embeddings their logit is exactly 0
    /// and greedy decoding picks real tokens (the best of ~2000 random
    /// logits is positive).
    NormalThenZeros { random: usize },
    /// All 1.0 (RMSNorm weights).
    Ones,
}

/// The built-in tokenizer: byte-level BPE trained on the embedded corpus,
/// with [`SPECIAL_TOKENS`] at ids 0–3 and [`BOS_TOKEN`] prepended when
/// encoding with special tokens.
///
/// # Errors
/// [`EngineError::BadModelFile`] if training fails (a bug: the input is fixed).
pub fn builtin_tokenizer() -> Result<Tokenizer, EngineError> {
    let lines: Vec<&str> = CORPUS.lines().filter(|l| !l.trim().is_empty()).collect();
    train_byte_level_bpe(
        &lines,
        TOKENIZER_VOCAB_LIMIT,
        &SPECIAL_TOKENS,
        Some(BOS_TOKEN),
    )
    .map_err(|e| {
        bad_file(
            PathBuf::from(TOKENIZER_JSON),
            "training the built-in tokenizer",
            &e,
        )
    })
}

/// The chat template of the built-in model: [`BOS_TOKEN`], then ChatML turns
/// (`<|im_start|>role\ncontent<|im_end|>\n`), then `<|im_start|>assistant\n`
/// with `add_generation_prompt`.
pub fn builtin_chat_template() -> String {
    format!("{{{{- bos_token }}}}{FALLBACK_CHAT_TEMPLATE}")
}

const CONFIG_JSON: &str = "config.json";
const GENERATION_CONFIG_JSON: &str = "generation_config.json";
const TOKENIZER_JSON: &str = "tokenizer.json";
const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
const MODEL_SAFETENSORS: &str = "model.safetensors";
const MAX_POSITION_EMBEDDINGS: usize = 2048;

/// Writes the built-in model of `size` into `dir` (created if needed):
/// `config.json`, `generation_config.json`, `model.safetensors`,
/// `tokenizer.json` and `tokenizer_config.json`, in the Hugging Face layout
/// (loadable by transformers' `AutoModelForCausalLM` and `AutoTokenizer`).
/// Existing files of those names are overwritten.
///
/// # Errors
/// [`EngineError::Io`] naming the path that could not be created or written.
pub fn write_builtin_model(dir: &Path, size: BuiltinSize) -> Result<(), EngineError> {
    std::fs::create_dir_all(dir).map_err(|source| EngineError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let spec = size.spec();
    let tokenizer = builtin_tokenizer()?;
    let id = |token: &str| {
        tokenizer
            .token_to_id(token)
            .expect("the built-in tokenizer is trained with every special token")
    };
    let (bos, eot, im_end) = (id(BOS_TOKEN), id(END_OF_TEXT_TOKEN), id(IM_END_TOKEN));
    let vocab = spec
        .vocab
        .unwrap_or_else(|| tokenizer.vocab_size())
        .max(tokenizer.vocab_size());

    let tokenizer_json = tokenizer
        .to_json(true)
        .map_err(|e| bad_file(dir.join(TOKENIZER_JSON), "serializing the tokenizer", &e))?;
    write_file(&dir.join(TOKENIZER_JSON), tokenizer_json.as_bytes())?;

    let added_tokens: serde_json::Map<String, serde_json::Value> = SPECIAL_TOKENS
        .iter()
        .map(|t| {
            let entry = json!({
                "content": t, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": true,
            });
            (id(t).to_string(), entry)
        })
        .collect();
    let tokenizer_config = json!({
        "added_tokens_decoder": added_tokens,
        "bos_token": BOS_TOKEN,
        "chat_template": builtin_chat_template(),
        "clean_up_tokenization_spaces": false,
        "eos_token": IM_END_TOKEN,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": END_OF_TEXT_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    write_json(&dir.join(TOKENIZER_CONFIG_JSON), &tokenizer_config)?;

    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "bos_token_id": bos,
        "eos_token_id": [im_end, eot],
        "head_dim": spec.head_dim(),
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": INIT_STD,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "mlp_bias": false,
        "num_attention_heads": spec.heads,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "pad_token_id": eot,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_scaling": null,
        "rope_theta": 10000.0,
        "tie_word_embeddings": true,
        "torch_dtype": spec.dtype.torch_name(),
        "use_cache": true,
        "vocab_size": vocab,
    });
    write_json(&dir.join(CONFIG_JSON), &config)?;

    let generation_config = json!({
        "bos_token_id": bos,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
    });
    write_json(&dir.join(GENERATION_CONFIG_JSON), &generation_config)?;

    let weights = dir.join(MODEL_SAFETENSORS);
    write_weights(&weights, &spec, vocab, tokenizer.vocab_size())?;
    // safetensors creates the file owner-only; give it the permissions the
    // other files got from the umask, so a model dir is shared as a whole.
    let permissions = std::fs::metadata(dir.join(CONFIG_JSON))
        .map_err(|source| EngineError::Io {
            path: dir.join(CONFIG_JSON),
            source,
        })?
        .permissions();
    std::fs::set_permissions(&weights, permissions).map_err(|source| EngineError::Io {
        path: weights,
        source,
    })
}

/// Draws every tensor from one seeded generator and writes them with
/// `safetensors::serialize_to_file` (metadata `format: pt`, as transformers expects).
fn write_weights(
    path: &Path,
    spec: &Spec,
    vocab: usize,
    tokenizer_vocab: usize,
) -> Result<(), EngineError> {
    let mut rng = StdRng::seed_from_u64(WEIGHT_SEED);
    let mut normal = NormalSampler::default();
    let tensors = spec.tensors(vocab, tokenizer_vocab);
    let mut buffers = Vec::with_capacity(tensors.len());
    for (name, shape, init) in &tensors {
        let n: usize = shape.iter().product();
        let mut bytes = Vec::with_capacity(n * 4);
        for i in 0..n {
            let value = match *init {
                Init::Normal => (normal.sample(&mut rng) * INIT_STD) as f32,
                Init::NormalThenZeros { random } if i < random => {
                    (normal.sample(&mut rng) * INIT_STD) as f32
                }
                Init::NormalThenZeros { .. } => 0.0,
                Init::Ones => 1.0,
            };
            spec.dtype.push(&mut bytes, value);
        }
        buffers.push((name.clone(), shape.clone(), bytes));
    }
    let views = buffers
        .iter()
        .map(|(name, shape, bytes)| {
            TensorView::new(spec.dtype.safetensors(), shape.clone(), bytes)
                .map(|view| (name.clone(), view))
                .map_err(|e| bad_file(path.to_path_buf(), &format!("building tensor {name}"), &e))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        safetensors::SafeTensorError::IoError(source) => EngineError::Io {
            path: path.to_path_buf(),
            source,
        },
        other => bad_file(path.to_path_buf(), "writing safetensors", &other),
    })
}

/// Standard normal samples by the Box–Muller transform, two per draw pair.
#[derive(Debug, Default)]
struct NormalSampler {
    spare: Option<f64>,
}

impl NormalSampler {
    fn sample(&mut self, rng: &mut StdRng) -> f64 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        // 1 - U is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - rng.random::<f64>();
        let u2 = rng.random::<f64>();
        let radius = (-2.0 * u1.ln()).sqrt();
        let angle = std::f64::consts::TAU * u2;
        self.spare = Some(radius * angle.sin());
        radius * angle.cos()
    }
}

fn write_file(path: &Path, bytes: &[u8]) -> Result<(), EngineError> {
    std::fs::write(path, bytes).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<(), EngineError> {
    let mut text = serde_json::to_string_pretty(value)
        .map_err(|e| bad_file(path.to_path_buf(), "serializing", &e))?;
    text.push('\n');
    write_file(path, text.as_bytes())
}

/// A [`EngineError::BadModelFile`] whose message carries the error chain.
fn bad_file(path: PathBuf, doing: &str, error: &dyn std::error::Error) -> EngineError {
    let mut message = format!("{doing}: {error}");
    let mut source = error.source();
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    EngineError::BadModelFile { path, message }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;
    use sluice_tokens::{ChatMessage, ChatTemplate};

    /// A fresh directory under the system temp dir, removed on drop.
    struct ScratchDir(PathBuf);

    impl ScratchDir {
        fn new(tag: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let path = std::env::temp_dir()
                .join(format!("sluice-builtin-{tag}-{}-{n}", std::process::id()));
            let _ = std::fs::remove_dir_all(&path);
            Self(path)
        }
    }

    impl Drop for ScratchDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn read_json(path: &Path) -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(path).expect("file written")).expect("valid JSON")
    }

    #[test]
    fn builtin_tokenizer_has_special_tokens_first_and_a_useful_vocab() {
        let tok = builtin_tokenizer().expect("trains");
        for (i, t) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(t), Some(i as u32), "{t}");
        }
        let vocab = tok.vocab_size();
        assert!(
            (2048..=TOKENIZER_VOCAB_LIMIT).contains(&vocab),
            "vocab {vocab}"
        );
        let text = "The keeper opens the sluice when there is room.";
        let ids = tok.encode(text, false).expect("encode");
        assert!(
            ids.len() < text.len() / 3,
            "merges compress English: {} ids",
            ids.len()
        );
        assert_eq!(tok.decode(&ids, false).expect("decode"), text);
    }

    #[test]
    fn tiny_model_dir_loads_with_tokenizer_and_chat_template() {
        let dir = ScratchDir::new("load");
        write_builtin_model(&dir.0, BuiltinSize::Tiny).expect("writes");

        let tok = Tokenizer::from_dir(&dir.0).expect("tokenizer loads");
        let (bos, eot, im_end) = (
            tok.token_to_id(BOS_TOKEN).expect("bos"),
            tok.token_to_id(END_OF_TEXT_TOKEN).expect("eot"),
            tok.token_to_id(IM_END_TOKEN).expect("im_end"),
        );
        assert_eq!(tok.bos_token_id(), Some(bos));
        assert_eq!(tok.eos_token_ids(), &[im_end, eot]);
        let config = read_json(&dir.0.join(CONFIG_JSON));
        assert_eq!(config["vocab_size"].as_u64(), Some(tok.vocab_size() as u64));

        let template = ChatTemplate::from_dir(&dir.0).expect("template loads");
        assert!(!template.is_fallback());
        let messages = [
            ChatMessage::new("system", "Be kind."),
            ChatMessage::new("user", "Hello!"),
        ];
        let prompt = template.render(&messages, true).expect("renders");
        assert_eq!(
            prompt,
            "<|begin_of_text|><|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
        );
        let ids = tok.encode(&prompt, false).expect("encode");
        assert_eq!(ids[0], bos, "the template's bos is one special token");
        assert_eq!(ids.iter().filter(|&&i| i == im_end).count(), 2);
        assert_eq!(tok.decode(&ids, false).expect("decode"), prompt);
    }

    #[test]
    fn tiny_model_dir_loads_with_the_engine_model_loader() {
        let dir = ScratchDir::new("engine-load");
        write_builtin_model(&dir.0, BuiltinSize::Tiny).expect("writes");
        let model = crate::model::Model::load(&dir.0).expect("the engine loads the built-in model");
        let c = &model.config;
        assert_eq!(
            (c.hidden_size, c.num_hidden_layers, c.head_dim),
            (256, 4, 32)
        );
        assert_eq!((c.num_attention_heads, c.num_key_value_heads), (8, 4));
        assert!(c.tie_word_embeddings);
        let tok = Tokenizer::from_dir(&dir.0).expect("tokenizer loads");
        assert_eq!(c.vocab_size, tok.vocab_size());
        assert_eq!(c.eos_token_ids, tok.eos_token_ids());
    }

    #[test]
    fn tiny_config_json_has_llama_keys() {
        let dir = ScratchDir::new("config");
        write_builtin_model(&dir.0, BuiltinSize::Tiny).expect("writes");
        let c = read_json(&dir.0.join(CONFIG_JSON));
        assert_eq!(c["architectures"], json!(["LlamaForCausalLM"]));
        assert_eq!(c["model_type"], "llama");
        assert_eq!(c["hidden_size"], 256);
        assert_eq!(c["num_hidden_layers"], 4);
        assert_eq!(c["num_attention_heads"], 8);
        assert_eq!(c["num_key_value_heads"], 4);
        assert_eq!(c["head_dim"], 32);
        assert_eq!(c["intermediate_size"], 768);
        assert_eq!(c["max_position_embeddings"], 2048);
        assert_eq!(c["rope_theta"].as_f64(), Some(10000.0));
        assert_eq!(c["rms_norm_eps"].as_f64(), Some(1e-5));
        assert_eq!(c["tie_word_embeddings"], true);
        assert_eq!(c["torch_dtype"], "float32");
        assert_eq!(c["hidden_act"], "silu");
        let g = read_json(&dir.0.join(GENERATION_CONFIG_JSON));
        assert_eq!(g["eos_token_id"], c["eos_token_id"]);
        let t = read_json(&dir.0.join(TOKENIZER_CONFIG_JSON));
        assert_eq!(t["eos_token"], IM_END_TOKEN);
        assert_eq!(t["bos_token"], BOS_TOKEN);
        assert_eq!(t["model_max_length"], 2048);
    }

    #[test]
    fn tiny_weights_have_hf_names_shapes_and_init() {
        let dir = ScratchDir::new("weights");
        write_builtin_model(&dir.0, BuiltinSize::Tiny).expect("writes");
        let bytes = std::fs::read(dir.0.join(MODEL_SAFETENSORS)).expect("weights written");
        let st = SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let vocab = read_json(&dir.0.join(CONFIG_JSON))["vocab_size"]
            .as_u64()
            .expect("vocab") as usize;
        let spec = BuiltinSize::Tiny.spec();
        assert_eq!(st.len(), spec.tensors(vocab, vocab).len());
        assert!(st.tensor("lm_head.weight").is_err(), "embeddings are tied");
        let shape = |name: &str| st.tensor(name).expect(name).shape().to_vec();
        assert_eq!(shape("model.embed_tokens.weight"), vec![vocab, 256]);
        assert_eq!(
            shape("model.layers.3.self_attn.q_proj.weight"),
            vec![256, 256]
        );
        assert_eq!(
            shape("model.layers.0.self_attn.k_proj.weight"),
            vec![128, 256]
        );
        assert_eq!(
            shape("model.layers.0.self_attn.v_proj.weight"),
            vec![128, 256]
        );
        assert_eq!(
            shape("model.layers.0.self_attn.o_proj.weight"),
            vec![256, 256]
        );
        assert_eq!(shape("model.layers.0.mlp.gate_proj.weight"), vec![768, 256]);
        assert_eq!(shape("model.layers.0.mlp.down_proj.weight"), vec![256, 768]);
        assert_eq!(shape("model.norm.weight"), vec![256]);

        let f32s = |name: &str| -> Vec<f32> {
            let t = st.tensor(name).expect(name);
            assert_eq!(t.dtype(), Dtype::F32);
            t.data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        assert!(
            f32s("model.layers.1.input_layernorm.weight")
                .iter()
                .all(|&x| x == 1.0)
        );
        let w = f32s("model.layers.2.mlp.up_proj.weight");
        let mean = w.iter().map(|&x| f64::from(x)).sum::<f64>() / w.len() as f64;
        let std = (w
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / w.len() as f64)
            .sqrt();
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((std - INIT_STD).abs() < 1e-3, "std {std}");

        let meta = SafeTensors::read_metadata(&bytes).expect("header").1;
        assert_eq!(
            meta.metadata()
                .as_ref()
                .and_then(|m| m.get("format"))
                .map(String::as_str),
            Some("pt")
        );
    }

    #[test]
    fn writing_twice_yields_identical_bytes() {
        let (a, b) = (ScratchDir::new("det-a"), ScratchDir::new("det-b"));
        write_builtin_model(&a.0, BuiltinSize::Tiny).expect("writes");
        write_builtin_model(&b.0, BuiltinSize::Tiny).expect("writes");
        for name in [
            CONFIG_JSON,
            GENERATION_CONFIG_JSON,
            TOKENIZER_JSON,
            TOKENIZER_CONFIG_JSON,
            MODEL_SAFETENSORS,
        ] {
            let (x, y) = (
                std::fs::read(a.0.join(name)).expect("a"),
                std::fs::read(b.0.join(name)).expect("b"),
            );
            assert!(x == y, "{name} differs between two writes");
        }
    }

    #[test]
    fn small_is_about_100m_parameters_with_padded_vocab() {
        let spec = BuiltinSize::Small.spec();
        let tokenizer_vocab = builtin_tokenizer().expect("trains").vocab_size();
        let vocab = spec
            .vocab
            .expect("small pads its vocab")
            .max(tokenizer_vocab);
        assert_eq!(vocab, 32_000);
        let params = spec.parameter_count(vocab);
        assert!(
            (90_000_000..115_000_000).contains(&params),
            "{params} parameters"
        );
        assert_eq!(spec.head_dim(), 64);
        assert_eq!(spec.dtype, WeightDtype::Bf16);
    }

    #[test]
    fn padded_embedding_rows_are_zero_and_real_rows_random() {
        let spec = BuiltinSize::Small.spec();
        let tensors = spec.tensors(32_000, 2073);
        let (name, shape, init) = &tensors[0];
        assert_eq!(name, "model.embed_tokens.weight");
        assert_eq!(shape, &vec![32_000, 768]);
        assert_eq!(*init, Init::NormalThenZeros { random: 2073 * 768 });
        let unpadded = BuiltinSize::Tiny.spec().tensors(2073, 2073);
        assert_eq!(unpadded[0].2, Init::NormalThenZeros { random: 2073 * 256 });
    }

    #[test]
    fn tiny_is_small_enough_for_fast_cpu_decode() {
        let spec = BuiltinSize::Tiny.spec();
        let params = spec.parameter_count(builtin_tokenizer().expect("trains").vocab_size());
        assert!(params < 6_000_000, "{params} parameters");
    }

    #[test]
    fn size_parses_and_displays() {
        assert_eq!(
            "tiny".parse::<BuiltinSize>().expect("tiny"),
            BuiltinSize::Tiny
        );
        assert_eq!(
            "small".parse::<BuiltinSize>().expect("small"),
            BuiltinSize::Small
        );
        assert!("huge".parse::<BuiltinSize>().is_err());
        assert_eq!(BuiltinSize::Small.to_string(), "small");
        assert_eq!(BuiltinSize::Tiny.model_name(), "sluice-tiny");
    }

    #[test]
    fn write_into_a_file_path_names_the_path() {
        let dir = ScratchDir::new("notdir");
        std::fs::create_dir_all(&dir.0).expect("mkdir");
        let file = dir.0.join("plain-file");
        std::fs::write(&file, b"x").expect("write");
        let err = write_builtin_model(&file, BuiltinSize::Tiny).expect_err("not a directory");
        assert!(err.to_string().contains("plain-file"), "{err}");
    }
}
