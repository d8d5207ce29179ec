//! `config.json` of a Hugging Face model directory, for the Llama, Qwen2,
//! Qwen3, Mistral and Phi-3 families.
//!
//! Owns the translation from HF's loosely typed JSON (optional keys with
//! family-specific defaults, `eos_token_id` as an int or a list, RoPE settings
//! either as `rope_theta` + `rope_scaling` or as transformers 5's
//! `rope_parameters`) into one validated [`ModelConfig`]. It does not read
//! weights: the mocker backend needs only this file.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::EngineError;

/// The model families the engine can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` (also Llama 2/3, TinyLlama, SmolLM, …).
    Llama,
    /// `Qwen2ForCausalLM`: Llama with biases on the q/k/v projections.
    Qwen2,
    /// `Qwen3ForCausalLM`: Llama with per-head q/k RMSNorm.
    Qwen3,
    /// `MistralForCausalLM`: Llama with a sliding attention window.
    Mistral,
    /// `Phi3ForCausalLM`: Llama with fused q/k/v and gate/up tensors.
    Phi3,
    /// `Gemma2ForCausalLM`: see [`Gemma`].
    Gemma2,
    /// `Gemma3ForCausalLM` (text): Gemma 2's block with q/k norms and a
    /// local RoPE for sliding layers.
    Gemma3,
}

impl Architecture {
    /// The name `config.json` uses in `architectures`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// Whether the family is Gemma's (see [`Gemma`]).
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }

    /// Every architecture, for error messages.
    pub const ALL: [Architecture; 7] = [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Mistral,
        Architecture::Phi3,
        Architecture::Gemma2,
        Architecture::Gemma3,
    ];

    /// The Hugging Face names of [`Architecture::ALL`], for error messages.
    pub fn supported() -> String {
        Self::ALL.map(Self::hf_name).join(", ")
    }

    fn from_hf_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.hf_name() == name)
    }

    fn from_model_type(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Architecture::Llama,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            "mistral" => Architecture::Mistral,
            "phi3" => Architecture::Phi3,
            "gemma2" => Architecture::Gemma2,
            "gemma3_text" => Architecture::Gemma3,
            _ => return None,
        })
    }
}

/// What a family changes in the Llama block; all off for Llama and Qwen2.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Variant {
    /// RMSNorm of each query and key head (weights `[head_dim]`, the
    /// model's eps) before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Attention window: a token at position `i` sees keys `j` with
    /// `i - window < j <= i` (its own included) on the layers that slide.
    pub sliding_window: Option<usize>,
    /// Per layer, whether it slides; empty means every layer does (when
    /// `sliding_window` is set).
    pub sliding_layers: Vec<bool>,
    /// q/k/v and gate/up stored fused (`qkv_proj`, `gate_up_proj`; Phi-3).
    pub fused_projections: bool,
    /// Gemma's block, when the family is Gemma's.
    pub gemma: Option<Gemma>,
    /// Per-frequency RoPE divisors (`head_dim / 2`): llama.cpp's
    /// `rope_freqs` tensor, how a GGUF states Llama 3.x RoPE scaling.
    pub rope_freq_factors: Option<Vec<f32>>,
}

/// Gemma 2/3's departures (transformers' `modeling_gemma2/3.py`): norm
/// weights stored as offsets from 1 (the loader adds the 1), a norm on the
/// attention and on the MLP output before each residual add, GELU-tanh in
/// the gated MLP, embeddings scaled, attention scaled by
/// `query_pre_attn_scalar^-1/2` and optionally soft-capped, logits
/// optionally soft-capped.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma {
    /// `sqrt(hidden_size)` as f32.
    pub embed_scale: f32,
    /// `query_pre_attn_scalar^-1/2`.
    pub attn_scale: f32,
    /// `tanh(s / c) · c` on attention scores (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// `tanh(l / c) · c` on logits.
    pub final_softcap: Option<f32>,
    /// RoPE `(theta, scaling)` of the sliding layers when it differs from
    /// the model's (Gemma 3's local RoPE).
    pub local_rope: Option<(f32, Option<RopeScaling>)>,
}

impl Variant {
    /// The window layer `layer` attends through, if it slides.
    pub fn window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match self.sliding_layers.get(layer) {
            Some(false) => None,
            _ => Some(w),
        }
    }
}

/// How rotary position embeddings stretch beyond the trained context.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (HF `"linear"`).
    Linear { factor: f32 },
    /// Llama 3.x frequency-dependent scaling (HF `"llama3"`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: usize,
    },
    /// Dynamic NTK: the base grows once a sequence passes
    /// `max_position_embeddings` (HF `"dynamic"`).
    Dynamic { factor: f32 },
}

/// A validated model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Equal to `num_attention_heads` without GQA.
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` unless the config says otherwise.
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub tie_word_embeddings: bool,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// Biases on the q, k and v projections (always for Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias`).
    pub o_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    pub bos_token_id: Option<u32>,
    /// Every end-of-sequence id, in config order (HF allows an int or a list).
    pub eos_token_ids: Vec<u32>,
    /// The family's departures from the Llama block.
    pub variant: Variant,
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, EngineError> {
        Self::from_file(&dir.join("config.json"))
    }

    /// The config of a model directory or of a GGUF file's metadata.
    pub fn from_path(path: &Path) -> Result<Self, EngineError> {
        if sluice_gguf::GgufFile::is_gguf(path) {
            return super::gguf::config(&super::gguf::open(path)?);
        }
        Self::from_dir(path)
    }

    /// Reads a `config.json` file.
    pub fn from_file(path: &Path) -> Result<Self, EngineError> {
        if !path.is_file() {
            return Err(EngineError::MissingFile {
                path: path.to_path_buf(),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| EngineError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Parses the text of a `config.json`; `path` only names it in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self, EngineError> {
        let value: Value = serde_json::from_str(text).map_err(|e| EngineError::BadModelFile {
            path: path.to_path_buf(),
            message: format!("invalid JSON: {e}"),
        })?;
        let obj = value.as_object().ok_or_else(|| EngineError::BadModelFile {
            path: path.to_path_buf(),
            message: "expected a JSON object".to_owned(),
        })?;
        Parser { obj, path }.parse()
    }

    /// Rows of the fused q/k/v projection: `(heads + 2 * kv_heads) * head_dim`.
    pub fn qkv_dim(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
    }

    /// Parameters in the weights (embeddings counted once when tied).
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let attn = h * (q + 2 * kv) + q * h;
        let mlp = 3 * h * self.intermediate_size;
        let per_layer = attn + mlp + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + h + self.num_hidden_layers * per_layer
    }
}

struct Parser<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl Parser<'_> {
    fn bad(&self, message: String) -> EngineError {
        EngineError::BadModelFile {
            path: self.path.to_path_buf(),
            message,
        }
    }

    /// A present, non-null key.
    fn get(&self, key: &str) -> Option<&Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| {
                    self.bad(format!(
                        "key {key:?} must be a non-negative integer, got {v}"
                    ))
                }),
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize, EngineError> {
        let n = self
            .usize_opt(key)?
            .ok_or_else(|| self.bad(format!("missing key {key:?}")))?;
        if n == 0 {
            return Err(self.bad(format!("key {key:?} must be positive")));
        }
        Ok(n)
    }

    fn f32_opt(&self, key: &str) -> Result<Option<f32>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| self.bad(format!("key {key:?} must be a number, got {v}"))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, EngineError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.bad(format!("key {key:?} must be a boolean, got {v}"))),
        }
    }

    /// An int, a list of ints, or absent.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>, EngineError> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| self.bad(format!("key {key:?} must hold token ids, got {v}")))
        };
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => Ok(vec![one(v)?]),
        }
    }

    fn architecture(&self) -> Result<Architecture, EngineError> {
        let names: Vec<&str> = match self.get("architectures") {
            Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
            Some(other) => {
                return Err(self.bad(format!("key \"architectures\" must be a list, got {other}")));
            }
            None => Vec::new(),
        };
        let first = match names.first() {
            Some(name) => *name,
            // Configs without `architectures` still name their family.
            None => match self.get("model_type").and_then(Value::as_str) {
                Some(t) => {
                    return Architecture::from_model_type(t)
                        .ok_or_else(|| EngineError::UnsupportedArchitecture(t.to_owned()));
                }
                None => return Err(self.bad("missing key \"architectures\"".to_owned())),
            },
        };
        Architecture::from_hf_name(first)
            .ok_or_else(|| EngineError::UnsupportedArchitecture(first.to_owned()))
    }

    /// `(rope_theta, scaling)` from `rope_theta` + `rope_scaling`, or from
    /// transformers 5's `rope_parameters`, which carries both.
    fn rope(&self, max_pos: usize) -> Result<(f32, Option<RopeScaling>), EngineError> {
        let params_key = if self.get("rope_parameters").is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let params = match self.get(params_key) {
            None => None,
            Some(Value::Object(map)) => Some(map),
            Some(other) => {
                return Err(self.bad(format!("key {params_key:?} must be an object, got {other}")));
            }
        };
        let mut theta = self.f32_opt("rope_theta")?;
        if let Some(t) = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
        {
            theta = Some(t as f32);
        }
        let theta = theta.unwrap_or(10_000.0);
        if theta.is_nan() || theta <= 0.0 {
            return Err(self.bad(format!("rope_theta must be positive, got {theta}")));
        }
        let Some(params) = params else {
            return Ok((theta, None));
        };
        Ok((theta, self.rope_scaling(params, params_key, max_pos)?))
    }

    /// Gemma 3's two RoPEs: `(global theta, global scaling, local)` from
    /// `rope_parameters.{full_attention, sliding_attention}`, or from
    /// `rope_theta` + `rope_scaling` (global) and `rope_local_base_freq`.
    #[allow(clippy::type_complexity)]
    fn gemma3_rope(
        &self,
        max_pos: usize,
    ) -> Result<(f32, Option<RopeScaling>, Option<(f32, Option<RopeScaling>)>), EngineError> {
        let nested = self
            .get("rope_parameters")
            .and_then(Value::as_object)
            .filter(|p| p.contains_key("full_attention"));
        let Some(nested) = nested else {
            let (theta, scaling) = self.rope(max_pos)?;
            let local = self.f32_opt("rope_local_base_freq")?.unwrap_or(10_000.0);
            return Ok((theta, scaling, Some((local, None))));
        };
        let one = |kind: &str| -> Result<(f32, Option<RopeScaling>), EngineError> {
            let key = format!("rope_parameters.{kind}");
            let params = nested
                .get(kind)
                .and_then(Value::as_object)
                .ok_or_else(|| self.bad(format!("{key} is missing or not an object")))?;
            let theta = params
                .get("rope_theta")
                .and_then(Value::as_f64)
                .map_or(10_000.0, |t| t as f32);
            Ok((theta, self.rope_scaling(params, &key, max_pos)?))
        };
        let (theta, scaling) = one("full_attention")?;
        Ok((theta, scaling, Some(one("sliding_attention")?)))
    }

    /// The scaling a RoPE parameter object (`rope_type`/`type`, `factor`,
    /// …) describes; `params_key` names it in errors.
    fn rope_scaling(
        &self,
        params: &Map<String, Value>,
        params_key: &str,
        max_pos: usize,
    ) -> Result<Option<RopeScaling>, EngineError> {
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let num = |name: &str| -> Result<f32, EngineError> {
            params
                .get(name)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
                .ok_or_else(|| self.bad(format!("{params_key}.{name} is missing or not a number")))
        };
        let factor = || -> Result<f32, EngineError> {
            let f = num("factor")?;
            if f > 0.0 {
                Ok(f)
            } else {
                Err(self.bad(format!("{params_key}.factor must be positive, got {f}")))
            }
        };
        let scaling = match kind {
            "default" => None,
            "linear" => Some(RopeScaling::Linear { factor: factor()? }),
            "dynamic" => Some(RopeScaling::Dynamic { factor: factor()? }),
            "llama3" => {
                let original = params
                    .get("original_max_position_embeddings")
                    .and_then(Value::as_u64)
                    .and_then(|n| usize::try_from(n).ok())
                    .unwrap_or(max_pos);
                Some(RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: num("low_freq_factor")?,
                    high_freq_factor: num("high_freq_factor")?,
                    original_max_position_embeddings: original,
                })
            }
            other => {
                return Err(self.bad(format!(
                    "{params_key} type {other:?} is not supported (supported: linear, llama3, dynamic)"
                )));
            }
        };
        Ok(scaling)
    }

    fn parse(&self) -> Result<ModelConfig, EngineError> {
        let architecture = self.architecture()?;
        let hidden_size = self.usize_req("hidden_size")?;
        let intermediate_size = self.usize_req("intermediate_size")?;
        let num_hidden_layers = self.usize_req("num_hidden_layers")?;
        let num_attention_heads = self.usize_req("num_attention_heads")?;
        let vocab_size = self.usize_req("vocab_size")?;
        let num_key_value_heads = self
            .usize_opt("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(self.bad(format!(
                "num_attention_heads ({num_attention_heads}) must be a multiple of num_key_value_heads ({num_key_value_heads})"
            )));
        }
        let head_dim = match self.usize_opt("head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(self.bad(format!(
                        "hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_attention_heads}) and head_dim is absent"
                    )));
                }
                hidden_size / num_attention_heads
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(self.bad(format!(
                "head_dim must be even and positive, got {head_dim}"
            )));
        }
        let want_act = if architecture.is_gemma() {
            "gelu_pytorch_tanh"
        } else {
            "silu"
        };
        if let Some(act) = self
            .get("hidden_activation")
            .or_else(|| self.get("hidden_act"))
            && act.as_str() != Some(want_act)
        {
            return Err(self.bad(format!(
                "hidden activation {act} is not supported for {} (supported: {want_act:?})",
                architecture.hf_name()
            )));
        }
        if let Some(f) = self
            .get("rope_parameters")
            .and_then(|p| p.get("partial_rotary_factor"))
            .or_else(|| self.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            && f != 1.0
        {
            return Err(self.bad(format!(
                "partial_rotary_factor {f} is not supported (RoPE over the whole head only)"
            )));
        }
        let default_max_pos = match architecture {
            Architecture::Llama | Architecture::Phi3 => 2048,
            Architecture::Gemma2 | Architecture::Gemma3 => 8192,
            Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Mistral => 32_768,
        };
        let max_position_embeddings = self
            .usize_opt("max_position_embeddings")?
            .unwrap_or(default_max_pos);
        let (rope_theta, rope_scaling, local_rope) = if architecture == Architecture::Gemma3 {
            self.gemma3_rope(max_position_embeddings)?
        } else {
            let (theta, scaling) = self.rope(max_position_embeddings)?;
            (theta, scaling, None)
        };
        let attention_bias = self.bool_opt("attention_bias")?.unwrap_or(false);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Llama => (attention_bias, attention_bias),
            Architecture::Qwen2 => (true, false),
            Architecture::Qwen3 => (attention_bias, attention_bias),
            Architecture::Mistral | Architecture::Phi3 => (false, false),
            Architecture::Gemma2 | Architecture::Gemma3 => (attention_bias, attention_bias),
        };
        let mut variant = self.variant(architecture, num_hidden_layers)?;
        if architecture.is_gemma() {
            let scalar = self
                .f32_opt("query_pre_attn_scalar")?
                .unwrap_or(head_dim as f32);
            let cap = |key: &str| -> Result<Option<f32>, EngineError> {
                Ok(self.f32_opt(key)?.filter(|c| *c > 0.0))
            };
            variant.gemma = Some(Gemma {
                embed_scale: (hidden_size as f64).sqrt() as f32,
                attn_scale: 1.0 / scalar.sqrt(),
                // transformers' Gemma 3 never applies it, even when set.
                attn_softcap: if architecture == Architecture::Gemma2 {
                    cap("attn_logit_softcapping")?
                } else {
                    None
                },
                final_softcap: cap("final_logit_softcapping")?,
                local_rope,
            });
        }
        let bos = self.token_ids("bos_token_id")?;
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: self.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            tie_word_embeddings: self
                .bool_opt("tie_word_embeddings")?
                .unwrap_or(architecture.is_gemma()),
            vocab_size,
            max_position_embeddings,
            qkv_bias,
            o_bias,
            mlp_bias: self.bool_opt("mlp_bias")?.unwrap_or(false),
            bos_token_id: bos.first().copied(),
            eos_token_ids: self.token_ids("eos_token_id")?,
            variant,
        })
    }

    /// The family's departures from Llama: q/k norms, fused tensors and
    /// which layers attend through a sliding window (`layer_types` when
    /// given; Mistral and Phi-3 slide every layer when `sliding_window` is
    /// set; Qwen's `use_sliding_window` slides layers from
    /// `max_window_layers` on).
    fn variant(&self, arch: Architecture, layers: usize) -> Result<Variant, EngineError> {
        let window = self.usize_opt("sliding_window")?.filter(|&w| w > 0);
        let sliding_layers: Vec<bool> = match self.get("layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != layers {
                    return Err(self.bad(format!(
                        "layer_types has {} entries for {layers} layers",
                        types.len()
                    )));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("full_attention") => Ok(false),
                        Some("sliding_attention") => Ok(true),
                        _ => Err(self.bad(format!(
                            "layer_types entry {t} is not supported (full_attention, sliding_attention)"
                        ))),
                    })
                    .collect::<Result<_, _>>()?
            }
            Some(other) => {
                return Err(self.bad(format!("key \"layer_types\" must be a list, got {other}")));
            }
            None => match arch {
                Architecture::Qwen2 | Architecture::Qwen3 => {
                    let on = self.bool_opt("use_sliding_window")?.unwrap_or(false);
                    let from = self.usize_opt("max_window_layers")?.unwrap_or(layers);
                    (0..layers).map(|l| on && l >= from).collect()
                }
                // Gemma 2: every other layer, from the first.
                Architecture::Gemma2 => (0..layers).map(|l| l % 2 == 0).collect(),
                // Gemma 3: layer i is global iff (i + 1) % pattern == 0.
                Architecture::Gemma3 => {
                    let pattern = self
                        .usize_opt("sliding_window_pattern")?
                        .unwrap_or(6)
                        .max(1);
                    (0..layers).map(|l| (l + 1) % pattern != 0).collect()
                }
                _ => Vec::new(),
            },
        };
        let slides = match arch {
            Architecture::Mistral | Architecture::Phi3 => window.is_some(),
            _ => sliding_layers.iter().any(|&s| s),
        };
        if slides && window.is_none() {
            return Err(self
                .bad("layer_types names sliding layers but sliding_window is not set".to_owned()));
        }
        Ok(Variant {
            qk_norm: matches!(arch, Architecture::Qwen3 | Architecture::Gemma3),
            sliding_window: if slides { window } else { None },
            sliding_layers,
            fused_projections: arch == Architecture::Phi3,
            gemma: None,
            rope_freq_factors: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<ModelConfig, EngineError> {
        ModelConfig::from_json_str(json, Path::new("config.json"))
    }

    const LLAMA: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": 256,
        "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": [2, 7],
        "hidden_act": "silu", "tie_word_embeddings": true
    }"#;

    #[test]
    fn llama_config_parses_gqa_and_eos_list() {
        let c = parse(LLAMA).expect("valid config");
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.num_key_value_heads, 2);
        assert_eq!(c.eos_token_ids, vec![2, 7]);
        assert_eq!(c.bos_token_id, Some(1));
        assert!(c.tie_word_embeddings);
        assert!(!c.qkv_bias);
        assert_eq!(c.rope_theta, 500_000.0);
        assert_eq!(c.rope_scaling, None);
        assert_eq!(c.qkv_dim(), (4 + 4) * 16);
    }

    #[test]
    fn qwen2_has_qkv_bias_and_scalar_eos() {
        let c = parse(
            r#"{"architectures": ["Qwen2ForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10, "eos_token_id": 3,
            "head_dim": 16}"#,
        )
        .expect("valid config");
        assert_eq!(c.architecture, Architecture::Qwen2);
        assert!(c.qkv_bias && !c.o_bias);
        assert_eq!(c.num_key_value_heads, 4);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.eos_token_ids, vec![3]);
        assert_eq!(c.max_position_embeddings, 32_768);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let err = parse(
            r#"{"architectures": ["GPT2LMHeadModel"], "hidden_size": 8, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 4}"#,
        )
        .expect_err("gpt2 is unsupported");
        assert!(
            matches!(err, EngineError::UnsupportedArchitecture(ref a) if a == "GPT2LMHeadModel")
        );
    }

    #[test]
    fn missing_key_is_named() {
        let err = parse(r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 8}"#)
            .expect_err("incomplete config");
        assert!(err.to_string().contains("intermediate_size"), "{err}");
    }

    #[test]
    fn missing_file_is_named() {
        let err = ModelConfig::from_dir(Path::new("/nonexistent/model")).expect_err("no such dir");
        assert!(
            matches!(err, EngineError::MissingFile { ref path } if path.ends_with("config.json"))
        );
    }

    #[test]
    fn rope_scaling_variants_parse() {
        let with = |scaling: &str| {
            parse(&LLAMA.replace("\"hidden_act\"", &format!("{scaling}, \"hidden_act\"")))
        };
        let linear = with(r#""rope_scaling": {"type": "linear", "factor": 2.0}"#).expect("linear");
        assert_eq!(
            linear.rope_scaling,
            Some(RopeScaling::Linear { factor: 2.0 })
        );
        let llama3 = with(
            r#""rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
        )
        .expect("llama3");
        assert_eq!(
            llama3.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192
            })
        );
        let dynamic =
            with(r#""rope_scaling": {"type": "dynamic", "factor": 4.0}"#).expect("dynamic");
        assert_eq!(
            dynamic.rope_scaling,
            Some(RopeScaling::Dynamic { factor: 4.0 })
        );
        let yarn = with(r#""rope_scaling": {"type": "yarn", "factor": 4.0}"#).expect_err("yarn");
        assert!(yarn.to_string().contains("yarn"), "{yarn}");
    }

    #[test]
    fn transformers5_rope_parameters_parse() {
        let c = parse(&LLAMA.replace(
            "\"rope_theta\": 500000.0",
            r#""rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}"#,
        ))
        .expect("valid config");
        assert_eq!(c.rope_theta, 1000.0);
        assert_eq!(c.rope_scaling, None);
    }

    #[test]
    fn gqa_heads_must_divide() {
        let err = parse(&LLAMA.replace("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3"))
            .expect_err("4 heads over 3 kv heads");
        assert!(err.to_string().contains("num_key_value_heads"), "{err}");
    }
}
