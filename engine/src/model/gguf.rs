//! A model from one GGUF file: its [`ModelConfig`] from the metadata and its
//! weights under Hugging Face names, quantized matrices kept quantized.
//!
//! llama.cpp's converter renames tensors (`blk.N.attn_q.weight`) and, for
//! the `llama` architecture, permutes the rows of the q and k projections
//! so that its RoPE rotates interleaved pairs; the engine rotates HF's
//! halves, so those rows are put back (rows are whole blocks, so this works
//! on quantized rows too). It stores Gemma's norms as the weights they
//! multiply by (HF: offsets from 1; the source says so to the builder),
//! keeps Phi-3's fused tensors fused, and
//! leaves out what llama.cpp derives instead of reading (which Gemma layers
//! slide, Gemma's attention scale): those follow llama.cpp's rules, with
//! the keys llama.cpp reads where it has one. Architectures and RoPE
//! variants the engine does not compute are start-up errors naming them.

use std::path::Path;
use std::sync::Arc;

use sluice_gguf::{GgufFile, Value};

use super::config::{Architecture, Gemma, ModelConfig, RopeScaling, Variant};
use super::weights::{ModelWeights, QuantTensor, Tensor, Weight, WeightSource};
use crate::error::EngineError;

/// The GGUF architectures the engine serves.
pub(crate) const ARCHITECTURES: &str = "llama, qwen2, qwen3, phi3, gemma2, gemma3";

/// Typed metadata lookups with errors naming the file and key.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn bad(&self, message: String) -> EngineError {
        EngineError::BadModelFile {
            path: self.file.path().to_path_buf(),
            message,
        }
    }

    fn arch_key(&self, key: &str) -> String {
        format!("{}.{key}", self.arch)
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, EngineError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| self.bad(format!("{key} must be an unsigned integer, got {v:?}"))),
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize, EngineError> {
        match self.usize_opt(key)? {
            Some(n) if n > 0 => Ok(n),
            Some(_) => Err(self.bad(format!("{key} must be positive"))),
            None => Err(self.bad(format!("missing metadata key {key}"))),
        }
    }

    fn f32_opt(&self, key: &str) -> Result<Option<f32>, EngineError> {
        match self.file.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.bad(format!("{key} must be a number, got {v:?}"))),
        }
    }
}

/// The model configuration a GGUF file's metadata describes.
pub fn config(file: &GgufFile) -> Result<ModelConfig, EngineError> {
    let arch = file
        .get("general.architecture")
        .and_then(Value::as_str)
        .ok_or_else(|| EngineError::BadModelFile {
            path: file.path().to_path_buf(),
            message: "missing metadata key general.architecture".to_owned(),
        })?;
    let architecture = match arch {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "phi3" => Architecture::Phi3,
        "gemma2" => Architecture::Gemma2,
        "gemma3" => Architecture::Gemma3,
        other => {
            return Err(EngineError::UnsupportedArchitecture(format!(
                "{other} (GGUF)"
            )));
        }
    };
    let m = Meta { file, arch };
    let hidden_size = m.usize_req(&m.arch_key("embedding_length"))?;
    let num_attention_heads = m.usize_req(&m.arch_key("attention.head_count"))?;
    let num_key_value_heads = m
        .usize_opt(&m.arch_key("attention.head_count_kv"))?
        .unwrap_or(num_attention_heads);
    if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
        return Err(m.bad(format!(
            "{num_attention_heads} attention heads are not a multiple of {num_key_value_heads} kv heads"
        )));
    }
    let head_dim = match m.usize_opt(&m.arch_key("attention.key_length"))? {
        Some(d) => d,
        None => hidden_size / num_attention_heads,
    };
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(m.bad(format!(
            "head dim must be even and positive, got {head_dim}"
        )));
    }
    if let Some(rot) = m.usize_opt(&m.arch_key("rope.dimension_count"))?
        && rot != head_dim
    {
        return Err(m.bad(format!(
            "partial rotary embeddings ({rot} of {head_dim} dims) are not supported"
        )));
    }
    let vocab_size = match file.get("tokenizer.ggml.tokens").and_then(Value::as_array) {
        Some(tokens) => tokens.len(),
        None => m.usize_req(&m.arch_key("vocab_size"))?,
    };
    let max_position_embeddings = m.usize_opt(&m.arch_key("context_length"))?.unwrap_or(2048);
    let rope_theta = m
        .f32_opt(&m.arch_key("rope.freq_base"))?
        .unwrap_or(10_000.0);
    let rope_scaling = rope_scaling(&m)?;
    // Llama 3.x RoPE scaling: llama.cpp writes the per-frequency divisors.
    let rope_freq_factors = match file.tensor("rope_freqs.weight") {
        None => None,
        Some((info, bytes)) => {
            if info.elements() as usize != head_dim / 2 {
                return Err(m.bad(format!(
                    "rope_freqs.weight has {} values, the head dim {head_dim} needs {}",
                    info.elements(),
                    head_dim / 2
                )));
            }
            let factors = sluice_gguf::quant::dequantize_to_vec(info.ty, bytes, head_dim / 2);
            if factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
                return Err(m.bad("rope_freqs.weight holds a non-positive factor".to_owned()));
            }
            Some(factors)
        }
    };
    if file.tensor_info("rope_factors_long.weight").is_some() {
        return Err(m.bad(
            "LongRoPE (rope_factors_long/short, Phi-3's long-context variants) is not supported"
                .to_owned(),
        ));
    }
    let bos_token_id = file.token_id("tokenizer.ggml.bos_token_id")?;
    let eos_token_ids = file.eos_token_ids()?;
    let qkv = if architecture == Architecture::Phi3 {
        "attn_qkv"
    } else {
        "attn_q"
    };
    let has_bias = file.tensor_info(&format!("blk.0.{qkv}.bias")).is_some();
    let (qkv_bias, o_bias) = match architecture {
        Architecture::Qwen2 => (true, false),
        Architecture::Qwen3 => (has_bias, false),
        _ => (
            has_bias,
            file.tensor_info("blk.0.attn_output.bias").is_some(),
        ),
    };
    let num_hidden_layers = m.usize_req(&m.arch_key("block_count"))?;
    let (sliding_window, sliding_layers) = sliding(&m, architecture, num_hidden_layers)?;
    let gemma = if architecture.is_gemma() {
        Some(gemma(
            &m,
            architecture,
            hidden_size,
            num_attention_heads,
            head_dim,
            num_hidden_layers,
        )?)
    } else {
        None
    };
    Ok(ModelConfig {
        architecture,
        hidden_size,
        intermediate_size: m.usize_req(&m.arch_key("feed_forward_length"))?,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: m
            .f32_opt(&m.arch_key("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-6),
        rope_theta,
        rope_scaling,
        tie_word_embeddings: file.tensor_info("output.weight").is_none(),
        vocab_size,
        max_position_embeddings,
        qkv_bias,
        o_bias,
        mlp_bias: file.tensor_info("blk.0.ffn_up.bias").is_some(),
        bos_token_id,
        eos_token_ids,
        variant: Variant {
            qk_norm: matches!(architecture, Architecture::Qwen3 | Architecture::Gemma3),
            sliding_window,
            sliding_layers,
            fused_projections: architecture == Architecture::Phi3,
            gemma,
            rope_freq_factors,
        },
    })
}

/// The attention window and which layers slide, as llama.cpp reads them:
/// `attention.sliding_window` (Gemma 2: 4096 when absent) over the layers
/// `attention.sliding_window_pattern` picks (a per-layer list, or `n`: layer
/// `i` slides unless `i % n == n - 1`; Gemma 2's default 2, Gemma 3's 6).
/// Other families slide every layer when the file states a window: llama.cpp
/// ignores a window on them (Mistral's converter does not even write it,
/// Phi-3's is turned off), transformers does not, and the engine follows
/// the model.
fn sliding(
    m: &Meta<'_>,
    architecture: Architecture,
    layers: usize,
) -> Result<(Option<usize>, Vec<bool>), EngineError> {
    let window = match m.usize_opt(&m.arch_key("attention.sliding_window"))? {
        None if architecture == Architecture::Gemma2 => Some(4096),
        w => w.filter(|&w| w > 0),
    };
    let Some(window) = window else {
        return Ok((None, Vec::new()));
    };
    let default_pattern = match architecture {
        Architecture::Gemma2 => 2,
        Architecture::Gemma3 => 6,
        _ => return Ok((Some(window), Vec::new())),
    };
    let key = m.arch_key("attention.sliding_window_pattern");
    let layers: Vec<bool> = match m.file.get(&key) {
        Some(Value::Array(list)) => {
            if list.len() != layers {
                return Err(m.bad(format!(
                    "{key} has {} entries for {layers} layers",
                    list.len()
                )));
            }
            list.iter()
                .map(|v| {
                    v.as_bool()
                        .ok_or_else(|| m.bad(format!("{key} must hold booleans, got {v:?}")))
                })
                .collect::<Result<_, _>>()?
        }
        _ => {
            let n = m.usize_opt(&key)?.unwrap_or(default_pattern);
            (0..layers).map(|i| n == 0 || i % n < n - 1).collect()
        }
    };
    Ok((Some(window), layers))
}

/// Gemma's block constants as llama.cpp reads them: soft-caps from the file
/// (Gemma 2: 50 and 30 when absent; Gemma 3 caps no attention), the local
/// RoPE base `rope.freq_base_swa` (Gemma 3, 10000 when absent), and an
/// attention scale llama.cpp derives — `1/sqrt(head_dim)`, but
/// `1/sqrt(hidden / heads)` for the 27B models (46 and 62 layers) — unless
/// the file states `attention.scale`.
fn gemma(
    m: &Meta<'_>,
    architecture: Architecture,
    hidden_size: usize,
    heads: usize,
    head_dim: usize,
    layers: usize,
) -> Result<Gemma, EngineError> {
    let is_27b = matches!(
        (architecture, layers),
        (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62)
    );
    let derived = if is_27b {
        1.0 / ((hidden_size / heads) as f64).sqrt()
    } else {
        1.0 / (head_dim as f64).sqrt()
    };
    let attn_scale = match m.f32_opt(&m.arch_key("attention.scale"))? {
        Some(s) if s > 0.0 => s,
        Some(s) => return Err(m.bad(format!("attention.scale must be positive, got {s}"))),
        None => derived as f32,
    };
    let gemma2 = architecture == Architecture::Gemma2;
    let cap = |key: &str, default: f32| -> Result<Option<f32>, EngineError> {
        let c = m.f32_opt(&m.arch_key(key))?.unwrap_or(default);
        Ok((c > 0.0).then_some(c))
    };
    Ok(Gemma {
        embed_scale: (hidden_size as f64).sqrt() as f32,
        attn_scale,
        attn_softcap: if gemma2 {
            cap("attn_logit_softcapping", 50.0)?
        } else {
            None
        },
        final_softcap: cap("final_logit_softcapping", if gemma2 { 30.0 } else { 0.0 })?,
        local_rope: if gemma2 {
            None
        } else {
            let theta = m
                .f32_opt(&m.arch_key("rope.freq_base_swa"))?
                .unwrap_or(10_000.0);
            Some((theta, None))
        },
    })
}

fn rope_scaling(m: &Meta<'_>) -> Result<Option<RopeScaling>, EngineError> {
    let key = m.arch_key("rope.scaling.type");
    let Some(kind) = m.file.get(&key) else {
        return Ok(None);
    };
    let factor = m
        .f32_opt(&m.arch_key("rope.scaling.factor"))?
        .filter(|f| *f > 0.0);
    match (kind.as_str(), factor) {
        (Some("none"), _) => Ok(None),
        (Some("linear"), Some(factor)) if factor != 1.0 => Ok(Some(RopeScaling::Linear { factor })),
        (Some("linear"), _) => Ok(None),
        (other, _) => Err(m.bad(format!(
            "{key} {other:?} is not supported (supported: none, linear)"
        ))),
    }
}

/// The GGUF name of a tensor the builder asks for by Hugging Face name
/// (`gemma`: Gemma's four norms per layer).
fn gguf_name(hf: &str, gemma: bool) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_owned());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, kind) = rest.rsplit_once('.')?;
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        // Gemma's normalises the attention output; pre_feedforward_layernorm
        // is its MLP's input norm.
        "post_attention_layernorm" if gemma => "post_attention_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.qkv_proj" => "attn_qkv",
        "mlp.gate_up_proj" => "ffn_up",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{kind}"))
}

/// Serves tensors from the file under HF names.
struct GgufSource<'a> {
    file: &'a GgufFile,
    config: &'a ModelConfig,
}

impl GgufSource<'_> {
    /// The head count whose rows llama.cpp permuted in `hf`, if any.
    fn permuted_heads(&self, hf: &str) -> Option<usize> {
        if self.config.architecture != Architecture::Llama {
            return None;
        }
        if hf.ends_with("self_attn.q_proj.weight") || hf.ends_with("self_attn.q_proj.bias") {
            Some(self.config.num_attention_heads)
        } else if hf.ends_with("self_attn.k_proj.weight") || hf.ends_with("self_attn.k_proj.bias") {
            Some(self.config.num_key_value_heads)
        } else {
            None
        }
    }
}

/// Puts back the rows llama.cpp's converter permuted: within each head of
/// `head_dim` rows, its row `2i + j` is HF's row `j * head_dim / 2 + i`.
/// `row` is the bytes of one row.
fn unpermute_rows(bytes: &[u8], row: usize, heads: usize) -> Vec<u8> {
    let rows = bytes.len() / row;
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = h * head_dim + 2 * i + j;
                let to = h * head_dim + j * half + i;
                out[to * row..(to + 1) * row].copy_from_slice(&bytes[from * row..(from + 1) * row]);
            }
        }
    }
    out
}

impl WeightSource for GgufSource<'_> {
    /// llama.cpp's converter adds the 1 to Gemma's norms.
    fn gemma_norms_are_offsets(&self) -> bool {
        false
    }

    fn fetch(&mut self, hf: &str) -> Result<Option<Weight>, EngineError> {
        let gemma = self.config.architecture.is_gemma();
        let Some(name) = gguf_name(hf, gemma) else {
            return Ok(None);
        };
        let Some((info, bytes)) = self.file.tensor(&name) else {
            return Ok(None);
        };
        let shape = info.shape();
        let cols = shape.last().copied().unwrap_or(1);
        let rows = info.elements() as usize / cols;
        let row = info.ty.row_bytes(cols);
        let bytes = match self.permuted_heads(hf) {
            Some(heads) if rows.is_multiple_of(2 * heads) => unpermute_rows(bytes, row, heads),
            Some(heads) => {
                return Err(EngineError::BadModelFile {
                    path: self.file.path().to_path_buf(),
                    message: format!("{name}: {rows} rows do not split into {heads} heads"),
                });
            }
            None => bytes.to_vec(),
        };
        Ok(Some(if info.ty.is_quantized() && shape.len() == 2 {
            Weight::Quant(QuantTensor {
                ty: info.ty,
                rows,
                cols,
                bytes: Arc::from(bytes),
            })
        } else {
            let elements = info.elements() as usize;
            let mut data = vec![0.0; elements];
            sluice_gguf::quant::dequantize(info.ty, &bytes, &mut data);
            Weight::Dense(Tensor::new(shape, data))
        }))
    }
}

/// The weights of a GGUF file whose config is `config`.
pub fn weights(file: &GgufFile, config: &ModelConfig) -> Result<ModelWeights, EngineError> {
    ModelWeights::build(config, &mut GgufSource { file, config })
}

/// Opens a GGUF file (errors name the path).
pub fn open(path: &Path) -> Result<GgufFile, EngineError> {
    Ok(GgufFile::open(path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_names_map_to_llama_cpp_names() {
        assert_eq!(
            gguf_name("model.layers.12.self_attn.q_proj.weight", false).as_deref(),
            Some("blk.12.attn_q.weight")
        );
        assert_eq!(
            gguf_name("model.layers.0.self_attn.q_proj.bias", false).as_deref(),
            Some("blk.0.attn_q.bias")
        );
        assert_eq!(
            gguf_name("model.layers.3.post_attention_layernorm.weight", false).as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
        assert_eq!(
            gguf_name("lm_head.weight", false).as_deref(),
            Some("output.weight")
        );
        assert_eq!(gguf_name("model.layers.1.unknown.weight", false), None);
        assert_eq!(
            gguf_name("model.layers.3.post_attention_layernorm.weight", true).as_deref(),
            Some("blk.3.post_attention_norm.weight")
        );
        assert_eq!(
            gguf_name("model.layers.3.pre_feedforward_layernorm.weight", true).as_deref(),
            Some("blk.3.ffn_norm.weight")
        );
    }

    /// The f32 Llama fixture with its architecture renamed (same length).
    fn fixture_as(arch: &[u8; 5]) -> tempfile::NamedTempFile {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/gguf/llama_untied.gguf");
        let mut bytes = std::fs::read(path).expect("fixture");
        // The value of general.architecture: a string of length 5.
        let value = [&5u64.to_le_bytes()[..], b"llama"].concat();
        let at = bytes
            .windows(value.len())
            .position(|w| w == value.as_slice())
            .expect("the architecture value");
        bytes[at + 8..at + 13].copy_from_slice(arch);
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), bytes).expect("write");
        file
    }

    #[test]
    fn an_architecture_the_engine_does_not_compute_is_named_at_start_up() {
        let file = fixture_as(b"mamba");
        let err = ModelConfig::from_path(file.path()).expect_err("mamba is not served");
        assert!(
            matches!(&err, EngineError::UnsupportedArchitecture(a) if a.contains("mamba")),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("GGUF: llama, qwen2, qwen3, phi3, gemma2, gemma3"),
            "{err}"
        );
        // The unpatched file loads (the patch above is what fails it).
        let ok = fixture_as(b"llama");
        assert!(ModelConfig::from_path(ok.path()).is_ok());
    }

    /// A metadata value of a test file (the module's `Meta` reads them).
    #[derive(Clone, Copy)]
    enum Val {
        U32(u32),
        F32(f32),
        Str(&'static str),
    }

    /// A metadata-only GGUF v3 file (no tensors): what `config` reads.
    fn metadata_file(arch: &'static str, entries: &[(&str, Val)]) -> tempfile::NamedTempFile {
        let mut kv = vec![("general.architecture".to_owned(), Val::Str(arch))];
        kv.extend(entries.iter().map(|(k, v)| (format!("{arch}.{k}"), *v)));
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        b.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        for (key, value) in &kv {
            b.extend_from_slice(&(key.len() as u64).to_le_bytes());
            b.extend_from_slice(key.as_bytes());
            match value {
                Val::U32(n) => {
                    b.extend_from_slice(&4u32.to_le_bytes());
                    b.extend_from_slice(&n.to_le_bytes());
                }
                Val::F32(x) => {
                    b.extend_from_slice(&6u32.to_le_bytes());
                    b.extend_from_slice(&x.to_le_bytes());
                }
                Val::Str(s) => {
                    b.extend_from_slice(&8u32.to_le_bytes());
                    b.extend_from_slice(&(s.len() as u64).to_le_bytes());
                    b.extend_from_slice(s.as_bytes());
                }
            }
        }
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), b).expect("write");
        file
    }

    fn shape(layers: u32, hidden: u32, heads: u32, head_dim: u32) -> Vec<(&'static str, Val)> {
        vec![
            ("vocab_size", Val::U32(256)),
            ("embedding_length", Val::U32(hidden)),
            ("feed_forward_length", Val::U32(4 * hidden)),
            ("block_count", Val::U32(layers)),
            ("attention.head_count", Val::U32(heads)),
            ("attention.head_count_kv", Val::U32(heads / 2)),
            ("attention.key_length", Val::U32(head_dim)),
        ]
    }

    fn config_of(arch: &'static str, entries: &[(&str, Val)]) -> ModelConfig {
        let file = metadata_file(arch, entries);
        config(&GgufFile::open(file.path()).expect("opens")).expect("config")
    }

    #[test]
    fn gemma_follows_llama_cpp_where_the_file_is_silent() {
        // Gemma 2 9B's shape, with only what every file has.
        let c = config_of("gemma2", &shape(42, 3584, 16, 256));
        let g = c.variant.gemma.as_ref().expect("gemma block");
        assert_eq!(g.attn_scale, 1.0 / 16.0, "1/sqrt(head_dim)");
        assert_eq!((g.attn_softcap, g.final_softcap), (Some(50.0), Some(30.0)));
        assert_eq!(g.local_rope, None);
        assert_eq!(g.embed_scale, 3584f32.sqrt());
        let windows: Vec<_> = (0..4).map(|l| c.variant.window(l)).collect();
        assert_eq!(windows, [Some(4096), None, Some(4096), None]);
        // Gemma 2 27B: 1/sqrt(hidden / heads) = 1/sqrt(144).
        let c = config_of("gemma2", &shape(46, 4608, 32, 128));
        assert_eq!(c.variant.gemma.expect("gemma").attn_scale, 1.0 / 12.0);

        // Gemma 3: no window unless stated; then every sixth layer is global.
        let c = config_of("gemma3", &shape(26, 1152, 4, 256));
        assert_eq!(c.variant.sliding_window, None);
        let g = c.variant.gemma.as_ref().expect("gemma block");
        assert_eq!((g.attn_softcap, g.final_softcap), (None, None));
        assert_eq!(g.local_rope, Some((10_000.0, None)));
        assert!(c.variant.qk_norm);
        let mut entries = shape(26, 1152, 4, 256);
        entries.push(("attention.sliding_window", Val::U32(512)));
        entries.push(("rope.freq_base_swa", Val::F32(20_000.0)));
        let c = config_of("gemma3", &entries);
        let windows: Vec<_> = (0..12).map(|l| c.variant.window(l).is_none()).collect();
        let global: Vec<_> = (0..12).map(|l| l % 6 == 5).collect();
        assert_eq!(windows, global);
        assert_eq!(
            c.variant.gemma.expect("gemma").local_rope,
            Some((20_000.0, None))
        );
        // Gemma 3 27B.
        let c = config_of("gemma3", &shape(62, 5376, 32, 128));
        assert_eq!(
            c.variant.gemma.expect("gemma").attn_scale,
            (1.0 / 168f64.sqrt()) as f32
        );
    }

    #[test]
    fn a_stated_window_slides_every_layer_of_other_families() {
        let mut entries = shape(4, 64, 4, 16);
        entries.push(("attention.sliding_window", Val::U32(4096)));
        let c = config_of("llama", &entries);
        assert!((0..4).all(|l| c.variant.window(l) == Some(4096)));
        // Phi-3's converter writes 0 for none.
        let mut entries = shape(4, 64, 4, 16);
        entries.push(("attention.sliding_window", Val::U32(0)));
        let c = config_of("phi3", &entries);
        assert_eq!(c.variant.sliding_window, None);
        assert!(c.variant.fused_projections);
        assert!(
            config_of("llama", &shape(4, 64, 4, 16))
                .variant
                .sliding_window
                .is_none()
        );
    }

    #[test]
    fn unpermuting_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(heads, 2, hd/2, ...).swapaxes(1, 2).
        let (heads, head_dim, row) = (2, 8, 3);
        let hf: Vec<u8> = (0..(heads * head_dim * row) as u8).collect();
        let mut permuted = vec![0u8; hf.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..head_dim / 2 {
                    let from = h * head_dim + j * head_dim / 2 + i;
                    let to = h * head_dim + 2 * i + j;
                    permuted[to * row..(to + 1) * row]
                        .copy_from_slice(&hf[from * row..(from + 1) * row]);
                }
            }
        }
        assert_eq!(unpermute_rows(&permuted, row, heads), hf);
    }
}
