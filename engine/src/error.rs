//! The engine's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the engine, classified by cause.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model file {path} is missing")]
    MissingFile { path: PathBuf },
    #[error("reading {path}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    BadModelFile { path: PathBuf, message: String },
    #[error(transparent)]
    Gguf(#[from] sluice_gguf::GgufError),
    #[error(
        "unsupported architecture {0:?} (supported: {hf}; GGUF: {gguf})",
        hf = crate::model::Architecture::supported(),
        gguf = crate::model::gguf::ARCHITECTURES
    )]
    UnsupportedArchitecture(String),
    #[error("weight {name} is missing from the safetensors files")]
    MissingWeight { name: String },
    #[error("weight {name} has shape {actual:?}, expected {expected:?}")]
    WeightShape {
        name: String,
        expected: Vec<usize>,
        actual: Vec<usize>,
    },
    #[error("out of KV blocks: needed {needed}, free {free}")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("KV block {id} is out of range (pool has {num_blocks})")]
    BlockOutOfRange { id: u32, num_blocks: usize },
    #[error("KV block data is {actual} bytes, layout needs {expected}")]
    BlockSize { expected: usize, actual: usize },
    #[error("the engine has shut down")]
    Shutdown,
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    #[error("backend returned {actual} output rows, the step needs {expected}")]
    BackendRows { expected: usize, actual: usize },
    #[error("no such sequence {0} in the engine (finished, aborted or never added)")]
    UnknownSequence(u64),
    #[error("KV block {id} does not belong to reserved slot {seq}")]
    BlockNotReserved { seq: u64, id: u32 },
    #[error("the backend failed this request's step: {0}")]
    StepFailed(String),
    #[error("not started by its first-token deadline (`Request::first_token_by`)")]
    FirstTokenLate,
    #[error("the cuda engine needs {library}, which could not be loaded: {hint}")]
    CudaLibraryMissing {
        library: &'static str,
        hint: &'static str,
    },
    #[error("the cuda engine found no CUDA device (CUDA_VISIBLE_DEVICES={visible})")]
    NoCudaDevice { visible: String },
    #[cfg(feature = "cuda")]
    #[error("CUDA driver: {what}")]
    CudaDriver {
        what: String,
        #[source]
        source: cudarc::driver::DriverError,
    },
    #[cfg(feature = "cuda")]
    #[error("cuBLAS: {what}")]
    Cublas {
        what: String,
        #[source]
        source: cudarc::cublas::result::CublasError,
    },
    #[cfg(feature = "cuda")]
    #[error("NVRTC could not compile the cuda kernels ({options}):\n{log}")]
    KernelCompile {
        options: String,
        log: String,
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
    },
}
