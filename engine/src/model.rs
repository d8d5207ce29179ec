//! A model: a Hugging Face directory (`config.json` and safetensors
//! weights) or one GGUF file.
//!
//! Owns parsing the config ([`ModelConfig`]), loading the weights
//! ([`ModelWeights`]: f32, or quantized blocks from a GGUF) and seeded
//! random initialisation ([`init`]) for tests, benchmarks and the built-in
//! model. Tokenizer and chat template live in `sluice-tokens`; compute
//! lives in `backend`.

pub mod config;
pub mod gguf;
pub mod init;
pub mod weights;

use std::path::Path;

pub use config::{Architecture, ModelConfig, RopeScaling, Variant};
pub use weights::{LayerWeights, Linear, ModelWeights, QuantTensor, Tensor, Weight};

use crate::error::EngineError;

/// A model's configuration and its weights.
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
}

impl Model {
    /// Loads a model directory (`config.json` and the safetensors weights
    /// beside it) or a GGUF file.
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        if sluice_gguf::GgufFile::is_gguf(path) {
            let file = gguf::open(path)?;
            let config = gguf::config(&file)?;
            let weights = gguf::weights(&file, &config)?;
            return Ok(Model { config, weights });
        }
        let config = ModelConfig::from_dir(path)?;
        let weights = ModelWeights::load(path, &config)?;
        Ok(Model { config, weights })
    }

    /// A model with seeded random weights (see [`init::random_tensors`]).
    pub fn random(config: ModelConfig, seed: u64) -> Result<Self, EngineError> {
        let weights = ModelWeights::from_tensors(&config, init::random_tensors(&config, seed))?;
        Ok(Model { config, weights })
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Small configs shared by the model and backend tests.

    pub(crate) use super::init::random_tensors;
    use super::{Architecture, ModelConfig};

    /// A 2-layer GQA Llama small enough for exhaustive checks.
    pub(crate) fn tiny_config(tied: bool) -> ModelConfig {
        ModelConfig {
            architecture: Architecture::Llama,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            tie_word_embeddings: tied,
            vocab_size: 40,
            max_position_embeddings: 256,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            variant: Default::default(),
        }
    }
}
