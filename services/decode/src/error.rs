//! The worker's errors and their one mapping to `tonic::Status`.

use sluice_engine::EngineError;

/// What a worker request or start-up can fail with.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    #[error("this worker serves `{served}`, not `{requested}`")]
    WrongModel { requested: String, served: String },
    #[error("data-parallel rank {rank} does not exist (this worker has {size})")]
    NoSuchRank { rank: u32, size: usize },
    #[error("engine")]
    Engine(#[from] EngineError),
    #[error("KV transfer: {0}")]
    Transfer(String),
    #[error("this worker is a {role} worker and does not serve {rpc}")]
    WrongRole {
        role: &'static str,
        rpc: &'static str,
    },
    #[error("start-up: {0}")]
    Startup(String),
}

impl From<sluice_runtime::limits::Invalid> for WorkerError {
    fn from(e: sluice_runtime::limits::Invalid) -> Self {
        WorkerError::InvalidArgument {
            field: e.field,
            message: e.message,
        }
    }
}

impl From<WorkerError> for tonic::Status {
    fn from(e: WorkerError) -> Self {
        use tonic::Code;
        let code = match &e {
            WorkerError::InvalidArgument { .. } | WorkerError::NoSuchRank { .. } => {
                Code::InvalidArgument
            }
            WorkerError::WrongModel { .. } => Code::NotFound,
            WorkerError::WrongRole { .. } => Code::Unimplemented,
            WorkerError::Engine(EngineError::InvalidRequest(_)) => Code::InvalidArgument,
            WorkerError::Engine(EngineError::OutOfBlocks { .. }) => Code::ResourceExhausted,
            WorkerError::Engine(EngineError::Shutdown) => Code::Unavailable,
            WorkerError::Engine(EngineError::BlockSize { .. }) => Code::InvalidArgument,
            WorkerError::Transfer(_) => Code::Unavailable,
            WorkerError::Engine(_) | WorkerError::Startup(_) => {
                tracing::error!(error = %e, source = ?std::error::Error::source(&e), "worker internal error");
                return tonic::Status::internal("internal worker error; see the worker's log");
            }
        };
        let msg = match &e {
            WorkerError::Engine(inner) => inner.to_string(),
            other => other.to_string(),
        };
        tonic::Status::new(code, msg)
    }
}
