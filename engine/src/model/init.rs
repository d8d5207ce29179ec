//! Seeded random weights under their Hugging Face names.
//!
//! Owns one initialisation scheme, deterministic for a given seed: linear
//! weights uniform with standard deviation `1/sqrt(in_features)` (activations
//! stay O(1) through the layers, so logits are informative), embeddings with
//! standard deviation 1, biases small, norm weights near 1. Used by tests,
//! benchmarks and the built-in model writer; never by a real checkpoint.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::config::ModelConfig;
use super::weights::Tensor;

/// Every tensor `config` needs, under its HF name, from `seed`.
pub fn random_tensors(config: &ModelConfig, seed: u64) -> HashMap<String, Tensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = HashMap::new();
    let h = config.hidden_size;
    let q = config.num_attention_heads * config.head_dim;
    let kv = config.num_key_value_heads * config.head_dim;
    let inter = config.intermediate_size;
    let mut put = |rng: &mut StdRng, name: String, shape: Vec<usize>, center: f32, std: f32| {
        // Uniform on [c - a, c + a] has standard deviation a / sqrt(3).
        let a = std * 3f32.sqrt();
        let n = shape.iter().product();
        let data = (0..n).map(|_| center + rng.random_range(-a..a)).collect();
        out.insert(name, Tensor::new(shape, data));
    };
    put(
        &mut rng,
        "model.embed_tokens.weight".to_owned(),
        vec![config.vocab_size, h],
        0.0,
        1.0,
    );
    for i in 0..config.num_hidden_layers {
        let p = format!("model.layers.{i}");
        let linears = [
            ("self_attn.q_proj", q, h, config.qkv_bias),
            ("self_attn.k_proj", kv, h, config.qkv_bias),
            ("self_attn.v_proj", kv, h, config.qkv_bias),
            ("self_attn.o_proj", h, q, config.o_bias),
            ("mlp.gate_proj", inter, h, config.mlp_bias),
            ("mlp.up_proj", inter, h, config.mlp_bias),
            ("mlp.down_proj", h, inter, config.mlp_bias),
        ];
        for (name, rows, cols, bias) in linears {
            put(
                &mut rng,
                format!("{p}.{name}.weight"),
                vec![rows, cols],
                0.0,
                1.0 / (cols as f32).sqrt(),
            );
            if bias {
                put(&mut rng, format!("{p}.{name}.bias"), vec![rows], 0.0, 0.1);
            }
        }
        put(
            &mut rng,
            format!("{p}.input_layernorm.weight"),
            vec![h],
            1.0,
            0.1,
        );
        put(
            &mut rng,
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            1.0,
            0.1,
        );
    }
    put(&mut rng, "model.norm.weight".to_owned(), vec![h], 1.0, 0.1);
    if !config.tie_word_embeddings {
        put(
            &mut rng,
            "lm_head.weight".to_owned(),
            vec![config.vocab_size, h],
            0.0,
            1.0 / (h as f32).sqrt(),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::tiny_config;

    #[test]
    fn same_seed_gives_same_weights_and_different_seed_differs() {
        let config = tiny_config(false);
        assert_eq!(random_tensors(&config, 7), random_tensors(&config, 7));
        assert_ne!(random_tensors(&config, 7), random_tensors(&config, 8));
    }

    #[test]
    fn tied_config_has_no_lm_head() {
        assert!(!random_tensors(&tiny_config(true), 1).contains_key("lm_head.weight"));
        assert!(random_tensors(&tiny_config(false), 1).contains_key("lm_head.weight"));
    }
}
