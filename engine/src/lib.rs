//! `sluice-engine`: everything below the worker API — model loading, compute
//! backends (cpu, mocker, cuda), the paged KV cache with prefix caching and
//! its event stream, the continuous-batching scheduler, the sampler.
//!
//! No tonic, etcd or proto dependency: pure and deterministic, testable
//! without a network. Workers adapt it to gRPC.

pub mod backend;
pub mod builtin;
pub mod config;
pub mod engine;
pub mod error;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod scheduler;

pub use backend::cpu::CpuBackend;
pub use backend::mocker::{MockerBackend, MockerConfig};
pub use config::{BalanceGroup, EngineConfig, SchedulerConfig, SchedulingPolicy};
pub use engine::{EngineHandle, GenerateStream, HeldBlocks, Output, PrefillOutput, RemoteSlot};
pub use error::EngineError;
pub use kv::{KvEvent, KvEventRecord, KvSnapshot, KvSubscription, SnapshotRequired};
pub use model::{Model, ModelConfig};
pub use sampler::{PositionLogprobs, SamplingParams, TokenLogprob};
pub use scheduler::{FinishReason, Finished, LoadStats, Preemption, Request, Usage};
