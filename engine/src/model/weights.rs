//! A model's weights: dense f32, or quantized blocks kept as they are.
//!
//! Owns reading `model.safetensors` or the shards named by
//! `model.safetensors.index.json` (memory-mapped, f32/f16/bf16 converted to
//! f32 once at load), finding every tensor under its Hugging Face name and
//! checking its shape against the [`ModelConfig`]. A GGUF file
//! (`super::gguf`) feeds the same builder under the same names; its
//! quantized matrices stay quantized ([`QuantTensor`]). Tensors keep HF's
//! layout: a linear layer's weight is row-major `[out_features,
//! in_features]`. Backends rearrange them (fusing q/k/v, gate/up) as they
//! see fit.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use safetensors::{Dtype, SafeTensors};
use sluice_gguf::GgmlType;

use super::config::ModelConfig;
use crate::error::EngineError;

/// A dense row-major f32 tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    /// A tensor from its shape and `shape.iter().product()` values.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Tensor { shape, data }
    }
}

/// A matrix in one of ggml's block formats: `rows` rows of `cols` values,
/// each row whole blocks of `ty` (see `sluice_gguf::quant`). Cheap to clone
/// (tied embeddings share one copy with the lm_head).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantTensor {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub bytes: Arc<[u8]>,
}

impl QuantTensor {
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }

    /// The blocks of row `r`.
    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.bytes[r * n..(r + 1) * n]
    }

    /// Every value, de-quantized.
    pub fn dequantize(&self) -> Tensor {
        Tensor::new(
            vec![self.rows, self.cols],
            sluice_gguf::quant::dequantize_to_vec(self.ty, &self.bytes, self.rows * self.cols),
        )
    }
}

/// A weight matrix as the model file gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Weight {
    Dense(Tensor),
    Quant(QuantTensor),
}

impl Weight {
    /// Row-major shape (`[out, in]` for a linear layer).
    pub fn shape(&self) -> Cow<'_, [usize]> {
        match self {
            Weight::Dense(t) => Cow::Borrowed(&t.shape),
            Weight::Quant(q) => Cow::Owned(vec![q.rows, q.cols]),
        }
    }

    /// The values in f32 (de-quantized on the way for a quantized weight).
    pub fn dense(&self) -> Cow<'_, Tensor> {
        match self {
            Weight::Dense(t) => Cow::Borrowed(t),
            Weight::Quant(q) => Cow::Owned(q.dequantize()),
        }
    }

    /// Rows `range` of a 2-d weight.
    pub fn rows(&self, range: std::ops::Range<usize>) -> Weight {
        match self {
            Weight::Dense(t) => {
                let cols = t.shape[1];
                Weight::Dense(Tensor::new(
                    vec![range.len(), cols],
                    t.data[range.start * cols..range.end * cols].to_vec(),
                ))
            }
            Weight::Quant(q) => {
                let n = q.row_bytes();
                Weight::Quant(QuantTensor {
                    rows: range.len(),
                    bytes: Arc::from(&q.bytes[range.start * n..range.end * n]),
                    ..q.clone()
                })
            }
        }
    }

    /// [`Self::dense`], consuming the weight.
    pub fn into_dense(self) -> Tensor {
        match self {
            Weight::Dense(t) => t,
            Weight::Quant(q) => q.dequantize(),
        }
    }
}

impl From<Tensor> for Weight {
    fn from(t: Tensor) -> Self {
        Weight::Dense(t)
    }
}

/// `y = x · weightᵀ + bias`, with `weight` row-major `[out, in]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Vec<f32>>,
}

impl Linear {
    /// Output features (rows of the weight).
    pub fn out_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// The biases of `parts` stacked along the output (zeros for a part
    /// without one), or `None` when none has a bias: what a backend that
    /// fuses q/k/v or gate/up adds after the fused product.
    pub fn stacked_bias(parts: &[&Linear]) -> Option<Vec<f32>> {
        parts.iter().any(|l| l.bias.is_some()).then(|| {
            parts
                .iter()
                .flat_map(|l| match &l.bias {
                    Some(b) => b.clone(),
                    None => vec![0.0; l.out_features()],
                })
                .collect()
        })
    }
}

/// One decoder layer's weights.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights {
    pub input_layernorm: Vec<f32>,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    /// Per-head RMSNorm weights of queries and keys (`[head_dim]`, Qwen3).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub o_proj: Linear,
    /// Norm of the attention output before the residual add (Gemma).
    pub attn_out_norm: Option<Vec<f32>>,
    /// The MLP's input norm (Gemma's `pre_feedforward_layernorm`).
    pub post_attention_layernorm: Vec<f32>,
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
    /// Norm of the MLP output before the residual add (Gemma).
    pub mlp_out_norm: Option<Vec<f32>>,
}

/// Every weight of a model, in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelWeights {
    /// `[vocab_size, hidden_size]`.
    pub embed_tokens: Weight,
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm, `[hidden_size]`.
    pub norm: Vec<f32>,
    /// `[vocab_size, hidden_size]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Weight>,
}

impl ModelWeights {
    /// Loads `dir/model.safetensors`, or the shards listed in
    /// `dir/model.safetensors.index.json`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Self, EngineError> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        let (files, weight_map) = if single.is_file() {
            (vec![single], None)
        } else if index.is_file() {
            let (files, map) = read_index(dir, &index)?;
            (files, Some(map))
        } else {
            return Err(EngineError::MissingFile { path: single });
        };
        let maps = files
            .iter()
            .map(|path| map_file(path))
            .collect::<Result<Vec<_>, _>>()?;
        let parsed = files
            .iter()
            .zip(&maps)
            .map(|(path, map)| {
                SafeTensors::deserialize(map).map_err(|e| EngineError::BadModelFile {
                    path: path.clone(),
                    message: format!("invalid safetensors file: {e}"),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut source = FileSource {
            files: &files,
            parsed: &parsed,
            weight_map: weight_map.as_ref(),
        };
        Self::build(config, &mut source)
    }

    /// Builds weights from tensors already in memory, keyed by HF name
    /// (tests and the built-in model writer use this).
    pub fn from_tensors(
        config: &ModelConfig,
        mut tensors: HashMap<String, Tensor>,
    ) -> Result<Self, EngineError> {
        let mut source = |name: &str| -> Result<Option<Weight>, EngineError> {
            Ok(tensors.remove(name).map(Weight::Dense))
        };
        Self::build(config, &mut source)
    }

    pub(crate) fn build(
        config: &ModelConfig,
        source: &mut dyn WeightSource,
    ) -> Result<Self, EngineError> {
        let h = config.hidden_size;
        let q = config.num_attention_heads * config.head_dim;
        let kv = config.num_key_value_heads * config.head_dim;
        let inter = config.intermediate_size;
        // Gemma stores norm weights as offsets from 1 (in HF's layout).
        let norm_offsets = config.architecture.is_gemma() && source.gemma_norms_are_offsets();
        let mut fetch = |name: &str, shape: &[usize]| -> Result<Weight, EngineError> {
            let weight = source
                .fetch(name)?
                .ok_or_else(|| EngineError::MissingWeight {
                    name: name.to_owned(),
                })?;
            if *weight.shape() != *shape {
                return Err(EngineError::WeightShape {
                    name: name.to_owned(),
                    expected: shape.to_vec(),
                    actual: weight.shape().into_owned(),
                });
            }
            if let Weight::Dense(t) = &weight
                && t.data.len() != shape.iter().product::<usize>()
            {
                // An in-memory tensor whose data disagrees with its shape.
                return Err(EngineError::WeightShape {
                    name: name.to_owned(),
                    expected: shape.to_vec(),
                    actual: vec![t.data.len()],
                });
            }
            Ok(weight)
        };
        let embed_tokens = fetch("model.embed_tokens.weight", &[config.vocab_size, h])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let mut linear =
                |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear, EngineError> {
                    let weight = fetch(&format!("{p}.{name}.weight"), &[out, inp])?;
                    let bias = if bias {
                        Some(
                            fetch(&format!("{p}.{name}.bias"), &[out])?
                                .into_dense()
                                .data,
                        )
                    } else {
                        None
                    };
                    Ok(Linear { weight, bias })
                };
            let fused = config.variant.fused_projections;
            let [q_proj, k_proj, v_proj] = if fused {
                // Phi-3: one [q + 2 kv, hidden] matrix, rows q, then k, then v.
                split(
                    linear("self_attn.qkv_proj", q + 2 * kv, h, config.qkv_bias)?,
                    [q, kv, kv],
                )
            } else {
                [
                    linear("self_attn.q_proj", q, h, config.qkv_bias)?,
                    linear("self_attn.k_proj", kv, h, config.qkv_bias)?,
                    linear("self_attn.v_proj", kv, h, config.qkv_bias)?,
                ]
            };
            let o_proj = linear("self_attn.o_proj", h, q, config.o_bias)?;
            let [gate_proj, up_proj] = if fused {
                split(
                    linear("mlp.gate_up_proj", 2 * inter, h, config.mlp_bias)?,
                    [inter, inter],
                )
            } else {
                [
                    linear("mlp.gate_proj", inter, h, config.mlp_bias)?,
                    linear("mlp.up_proj", inter, h, config.mlp_bias)?,
                ]
            };
            let down_proj = linear("mlp.down_proj", h, inter, config.mlp_bias)?;
            let offset = if norm_offsets { 1.0 } else { 0.0 };
            let mut norm = |name: &str, len: usize| -> Result<Vec<f32>, EngineError> {
                let mut w = fetch(&format!("{p}.{name}.weight"), &[len])?
                    .into_dense()
                    .data;
                w.iter_mut().for_each(|v| *v += offset);
                Ok(w)
            };
            let (q_norm, k_norm) = if config.variant.qk_norm {
                let d = config.head_dim;
                (
                    Some(norm("self_attn.q_norm", d)?),
                    Some(norm("self_attn.k_norm", d)?),
                )
            } else {
                (None, None)
            };
            // Gemma: HF's post_attention_layernorm normalises the attention
            // output; pre_feedforward_layernorm is the MLP's input norm.
            let (mlp_norm, attn_out_norm, mlp_out_norm) = if config.variant.gemma.is_some() {
                (
                    norm("pre_feedforward_layernorm", h)?,
                    Some(norm("post_attention_layernorm", h)?),
                    Some(norm("post_feedforward_layernorm", h)?),
                )
            } else {
                (norm("post_attention_layernorm", h)?, None, None)
            };
            layers.push(LayerWeights {
                input_layernorm: norm("input_layernorm", h)?,
                q_proj,
                k_proj,
                v_proj,
                q_norm,
                k_norm,
                o_proj,
                attn_out_norm,
                post_attention_layernorm: mlp_norm,
                gate_proj,
                up_proj,
                down_proj,
                mlp_out_norm,
            });
        }
        let mut norm = fetch("model.norm.weight", &[h])?.into_dense().data;
        if norm_offsets {
            norm.iter_mut().for_each(|v| *v += 1.0);
        }
        let lm_head = if config.tie_word_embeddings {
            None
        } else {
            Some(fetch("lm_head.weight", &[config.vocab_size, h])?)
        };
        Ok(ModelWeights {
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }
}

impl LayerWeights {
    /// The layer's seven projections.
    pub fn linears_mut(&mut self) -> [&mut Linear; 7] {
        [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
            &mut self.gate_proj,
            &mut self.up_proj,
            &mut self.down_proj,
        ]
    }
}

/// A fused linear split along its output rows into `N` parts of `rows`.
fn split<const N: usize>(fused: Linear, rows: [usize; N]) -> [Linear; N] {
    let mut start = 0;
    rows.map(|n| {
        let range = start..start + n;
        start += n;
        Linear {
            weight: fused.weight.rows(range.clone()),
            bias: fused.bias.as_ref().map(|b| b[range].to_vec()),
        }
    })
}

/// Where [`ModelWeights::build`] finds tensors by Hugging Face name.
pub(crate) trait WeightSource {
    fn fetch(&mut self, name: &str) -> Result<Option<Weight>, EngineError>;

    /// Whether a Gemma model's norm weights come as HF stores them,
    /// offsets from 1 the builder adds 1 to (llama.cpp's converter stores
    /// the weights themselves).
    fn gemma_norms_are_offsets(&self) -> bool {
        true
    }
}

impl<F: FnMut(&str) -> Result<Option<Weight>, EngineError>> WeightSource for F {
    fn fetch(&mut self, name: &str) -> Result<Option<Weight>, EngineError> {
        self(name)
    }
}

struct FileSource<'a, 'data> {
    files: &'a [PathBuf],
    parsed: &'a [SafeTensors<'data>],
    /// Tensor name → index into `files`; `None` for a single file.
    weight_map: Option<&'a HashMap<String, usize>>,
}

impl WeightSource for FileSource<'_, '_> {
    fn fetch(&mut self, name: &str) -> Result<Option<Weight>, EngineError> {
        let index = match self.weight_map {
            None => 0,
            Some(map) => match map.get(name) {
                Some(&i) => i,
                None => return Ok(None),
            },
        };
        let Ok(view) = self.parsed[index].tensor(name) else {
            return Ok(None);
        };
        let data = to_f32(view.dtype(), view.data()).ok_or_else(|| EngineError::BadModelFile {
            path: self.files[index].clone(),
            message: format!(
                "tensor {name} has dtype {:?}; supported: F32, F16, BF16",
                view.dtype()
            ),
        })?;
        Ok(Some(Weight::Dense(Tensor {
            shape: view.shape().to_vec(),
            data,
        })))
    }
}

/// Little-endian f32/f16/bf16 bytes to f32; `None` for other dtypes.
fn to_f32(dtype: Dtype, bytes: &[u8]) -> Option<Vec<f32>> {
    let out = match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32())
            .collect(),
        _ => return None,
    };
    Some(out)
}

fn map_file(path: &Path) -> Result<memmap2::Mmap, EngineError> {
    let file = File::open(path).map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    // SAFETY: the map is read-only and lives only while the weights are
    // converted to owned f32; model files are not modified while loading.
    unsafe { memmap2::Mmap::map(&file) }.map_err(|source| EngineError::Io {
        path: path.to_path_buf(),
        source,
    })
}

/// Parses `model.safetensors.index.json`: the shard files, and each tensor's shard.
fn read_index(
    dir: &Path,
    index: &Path,
) -> Result<(Vec<PathBuf>, HashMap<String, usize>), EngineError> {
    let bad = |message: String| EngineError::BadModelFile {
        path: index.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(index).map_err(|source| EngineError::Io {
        path: index.to_path_buf(),
        source,
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| bad("missing key \"weight_map\"".to_owned()))?;
    let mut files: Vec<PathBuf> = Vec::new();
    let mut by_name = HashMap::with_capacity(map.len());
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| bad(format!("weight_map.{name} must be a file name")))?;
        let path = dir.join(file);
        let i = match files.iter().position(|p| *p == path) {
            Some(i) => i,
            None => {
                if !path.is_file() {
                    return Err(EngineError::MissingFile { path });
                }
                files.push(path);
                files.len() - 1
            }
        };
        by_name.insert(name.clone(), i);
    }
    if files.is_empty() {
        return Err(bad("weight_map is empty".to_owned()));
    }
    Ok((files, by_name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::{random_tensors, tiny_config};
    use safetensors::tensor::TensorView;

    fn write_safetensors(path: &Path, tensors: &HashMap<String, Tensor>, dtype: Dtype) {
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(name, t)| {
                let raw: Vec<u8> = match dtype {
                    Dtype::F32 => t.data.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    Dtype::F16 => t
                        .data
                        .iter()
                        .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
                        .collect(),
                    Dtype::BF16 => t
                        .data
                        .iter()
                        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
                        .collect(),
                    other => panic!("test writes no {other:?}"),
                };
                (name.clone(), raw, t.shape.clone())
            })
            .collect();
        let views: Vec<(String, TensorView<'_>)> = bytes
            .iter()
            .map(|(name, raw, shape)| {
                (
                    name.clone(),
                    TensorView::new(dtype, shape.clone(), raw).expect("valid view"),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).expect("write safetensors");
    }

    #[test]
    fn single_file_f32_round_trips() {
        let config = tiny_config(false);
        let tensors = random_tensors(&config, 1);
        let dir = tempfile::tempdir().expect("tempdir");
        write_safetensors(&dir.path().join("model.safetensors"), &tensors, Dtype::F32);
        let loaded = ModelWeights::load(dir.path(), &config).expect("load");
        let expected = ModelWeights::from_tensors(&config, tensors).expect("in memory");
        assert_eq!(loaded, expected);
        assert!(loaded.lm_head.is_some());
    }

    #[test]
    fn bf16_and_f16_convert_to_f32() {
        let config = tiny_config(true);
        let tensors = random_tensors(&config, 2);
        for dtype in [Dtype::BF16, Dtype::F16] {
            let dir = tempfile::tempdir().expect("tempdir");
            write_safetensors(&dir.path().join("model.safetensors"), &tensors, dtype);
            let loaded = ModelWeights::load(dir.path(), &config).expect("load");
            let want = &tensors["model.embed_tokens.weight"].data;
            let got = &loaded.embed_tokens.dense().data;
            let tol = if dtype == Dtype::BF16 { 1e-2 } else { 1e-3 };
            for (a, b) in got.iter().zip(want) {
                assert!(
                    (a - b).abs() <= tol * b.abs().max(1e-2),
                    "{dtype:?}: {a} vs {b}"
                );
            }
            assert!(loaded.lm_head.is_none());
        }
    }

    #[test]
    fn sharded_index_loads_from_every_shard() {
        let config = tiny_config(false);
        let tensors = random_tensors(&config, 3);
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b): (HashMap<_, _>, HashMap<_, _>) = tensors
            .clone()
            .into_iter()
            .partition(|(name, _)| name.contains("layers.0") || name.contains("embed"));
        write_safetensors(
            &dir.path().join("model-00001-of-00002.safetensors"),
            &a,
            Dtype::F32,
        );
        write_safetensors(
            &dir.path().join("model-00002-of-00002.safetensors"),
            &b,
            Dtype::F32,
        );
        let map: serde_json::Map<String, serde_json::Value> = a
            .keys()
            .map(|k| (k.clone(), "model-00001-of-00002.safetensors".into()))
            .chain(
                b.keys()
                    .map(|k| (k.clone(), "model-00002-of-00002.safetensors".into())),
            )
            .collect();
        let index = serde_json::json!({"metadata": {}, "weight_map": map});
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            index.to_string(),
        )
        .expect("write index");
        let loaded = ModelWeights::load(dir.path(), &config).expect("load");
        assert_eq!(
            loaded,
            ModelWeights::from_tensors(&config, tensors).expect("in memory")
        );
    }

    #[test]
    fn missing_weights_file_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let err = ModelWeights::load(dir.path(), &tiny_config(false)).expect_err("no weights");
        assert!(
            matches!(err, EngineError::MissingFile { ref path } if path.ends_with("model.safetensors"))
        );
    }

    #[test]
    fn missing_tensor_is_named() {
        let config = tiny_config(false);
        let mut tensors = random_tensors(&config, 4);
        tensors.remove("model.layers.1.mlp.up_proj.weight");
        let err = ModelWeights::from_tensors(&config, tensors).expect_err("missing up_proj");
        assert!(
            matches!(err, EngineError::MissingWeight { ref name } if name == "model.layers.1.mlp.up_proj.weight")
        );
    }

    #[test]
    fn wrong_shape_is_reported() {
        let config = tiny_config(false);
        let mut tensors = random_tensors(&config, 5);
        tensors.insert(
            "model.norm.weight".to_owned(),
            Tensor::new(vec![3], vec![1.0; 3]),
        );
        let err = ModelWeights::from_tensors(&config, tensors).expect_err("bad norm shape");
        assert!(
            matches!(err, EngineError::WeightShape { ref name, ref actual, .. } if name == "model.norm.weight" && actual == &[3])
        );
    }

    #[test]
    fn unsupported_dtype_is_named() {
        let dir = tempfile::tempdir().expect("tempdir");
        let raw = vec![0u8; 4];
        let views = vec![(
            "model.embed_tokens.weight".to_owned(),
            TensorView::new(Dtype::I32, vec![1], &raw).expect("view"),
        )];
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors"))
            .expect("write");
        let err = ModelWeights::load(dir.path(), &tiny_config(true)).expect_err("i32 weight");
        assert!(err.to_string().contains("I32"), "{err}");
    }
}
