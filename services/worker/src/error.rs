//! The worker's errors and their one mapping to `tonic::Status`.

use sluice_engine::EngineError;
use sluice_kv_transfer::KvTransferError;

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
    /// Sending or receiving KV blocks failed (the transfer crate's error).
    #[error("KV transfer: {0}")]
    Transfer(#[from] KvTransferError),
    #[error("this worker is a {role} worker and does not serve {rpc}")]
    WrongRole {
        role: sluice_runtime::discovery::WorkerRole,
        rpc: &'static str,
    },
    /// The engine had not started the request when its TTFT target passed
    /// (`GenerateRequest.ttft_budget_ms`): refused before any token.
    #[error(
        "the request was not started within what was left of its TTFT target ({budget_ms} ms) on this worker; retry after 1 s"
    )]
    TtftTargetMissed { budget_ms: u32 },
    /// Start-up found something missing (no underlying error).
    #[error("start-up: {0}")]
    Startup(&'static str),
    /// Start-up failed on an underlying error, kept as the source.
    #[error("start-up: {what}")]
    StartupFailed {
        what: &'static str,
        #[source]
        source: BoxError,
    },
}

/// Any underlying error a [`WorkerError`] wraps.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

impl WorkerError {
    /// Start-up failed while doing `what` (for `map_err`).
    pub fn startup<E: Into<BoxError>>(what: &'static str) -> impl FnOnce(E) -> Self {
        move |e| Self::StartupFailed {
            what,
            source: e.into(),
        }
    }
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
            // The transfer crate's mapping; its internal errors are hidden below.
            WorkerError::Transfer(inner) if inner.code() != Code::Internal => inner.code(),
            // The queue's refusal, in the queue's words: the frontend
            // answers it as for a request the queue held past its target.
            WorkerError::TtftTargetMissed { .. } => {
                return sluice_proto::queue::v1::QueueReason::TtftTargetMissed
                    .refusal(e.to_string(), 1);
            }
            WorkerError::Engine(_)
            | WorkerError::Transfer(_)
            | WorkerError::Startup(_)
            | WorkerError::StartupFailed { .. } => {
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
