//! The cuda backend's kernel sources and how they are compiled: one NVRTC
//! program (`kernels.cu`), specialised per model by two defines (head
//! dimension and query heads per kv head, which size the attention
//! kernel's tiles and accumulators).
//!
//! Pure host code: which kernels exist, which options compile them for a
//! model and a GPU architecture. The NVRTC call itself is in
//! [`super::nvrtc`] (feature `cuda`); CI compiles [`SOURCE`] with the real
//! NVRTC and assembles it with `ptxas` (`engine/tests/cuda_kernels.rs`).

use crate::error::EngineError;
use crate::model::ModelConfig;

use super::plan::attention_unsupported;

/// Every kernel, as one CUDA C++ translation unit.
pub const SOURCE: &str = include_str!("kernels.cu");

/// The name NVRTC gives the program (in logs).
pub const PROGRAM_NAME: &str = "sluice_kernels.cu";

/// The entry points of [`SOURCE`], each `extern "C"`.
pub const KERNELS: [&str; 9] = [
    "embed_gather",
    "rms_norm",
    "qkv_rope_store",
    "paged_attention",
    "attention_combine",
    "swiglu",
    "add_bias",
    "kv_pack",
    "kv_unpack",
];

/// The model geometry the kernels are specialised for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelConfig {
    pub head_dim: usize,
    /// Query heads per kv head.
    pub group: usize,
}

impl KernelConfig {
    /// The specialisation for `config`, or why the kernels cannot run it.
    pub fn for_model(config: &ModelConfig) -> Result<Self, EngineError> {
        let group = config.num_attention_heads / config.num_key_value_heads;
        Self::new(config.head_dim, group)
    }

    /// A specialisation for heads of `head_dim` in groups of `group`.
    pub fn new(head_dim: usize, group: usize) -> Result<Self, EngineError> {
        match attention_unsupported(head_dim, group) {
            Some(why) => Err(EngineError::InvalidConfig(format!(
                "the cuda backend cannot run this model: {why}"
            ))),
            None => Ok(Self { head_dim, group }),
        }
    }

    /// NVRTC options for `arch` (`compute_90` for PTX, `sm_90` for a cubin).
    pub fn nvrtc_options(&self, arch: &str) -> Vec<String> {
        vec![
            format!("--gpu-architecture={arch}"),
            "--fmad=true".to_owned(),
            format!("-DSLUICE_HEAD_DIM={}", self.head_dim),
            format!("-DSLUICE_GROUP={}", self.group),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::tiny_config;

    #[test]
    fn every_kernel_is_an_extern_c_entry_point_of_the_source() {
        for k in KERNELS {
            let decl = format!("void {k}(");
            let at = SOURCE
                .find(&decl)
                .or_else(|| SOURCE.find(&format!("{k}(")))
                .unwrap_or_else(|| panic!("{k} is not in kernels.cu"));
            let line_start = SOURCE[..at].rfind("extern \"C\"").expect("extern C");
            assert!(
                SOURCE[line_start..at].contains("__global__"),
                "{k} must be an extern \"C\" __global__ function"
            );
        }
        assert_eq!(
            SOURCE.matches("extern \"C\" __global__").count(),
            KERNELS.len()
        );
    }

    #[test]
    fn the_model_picks_the_specialisation() {
        let c = tiny_config(true);
        let k = KernelConfig::for_model(&c).expect("supported");
        assert_eq!((k.head_dim, k.group), (8, 2));
        let opts = k.nvrtc_options("sm_90");
        assert!(opts.contains(&"--gpu-architecture=sm_90".to_owned()));
        assert!(opts.contains(&"-DSLUICE_HEAD_DIM=8".to_owned()));
        assert!(opts.contains(&"-DSLUICE_GROUP=2".to_owned()));
        let err = KernelConfig::new(60, 1).expect_err("60 is not a multiple of 8");
        assert!(err.to_string().contains("head_dim 60"), "{err}");
    }
}
