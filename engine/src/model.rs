//! A Hugging Face model directory: `config.json` and safetensors weights.
//!
//! Owns parsing the config ([`ModelConfig`]), loading the weights into f32
//! ([`ModelWeights`]) and seeded random initialisation ([`init`]) for tests,
//! benchmarks and the built-in model. Tokenizer and chat template live in
//! `sluice-tokens`; compute lives in `backend`.

pub mod config;
pub mod init;
pub mod weights;

use std::path::Path;

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use weights::{LayerWeights, Linear, ModelWeights, Tensor};

use crate::error::EngineError;

/// A model's configuration and its weights.
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: ModelWeights,
}

impl Model {
    /// Loads `dir/config.json` and the safetensors weights beside it.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        let config = ModelConfig::from_dir(dir)?;
        let weights = ModelWeights::load(dir, &config)?;
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
        }
    }
}
