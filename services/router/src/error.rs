//! `RouterError` and its one mapping to `tonic::Status`.

use crate::pool::PoolKind;

/// Everything the router can fail with.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// No worker of the pool serves the model.
    #[error("no {pool} worker available for model {model:?}")]
    NoWorkers {
        /// The pool asked.
        pool: PoolKind,
        /// The model asked ("" = any).
        model: String,
    },
    /// The request is malformed.
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// Configuration rejected at start.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// Metrics registration failed.
    #[error("metrics registration")]
    Metrics(#[source] prometheus::Error),
    /// Shared plumbing failed (discovery, server setup).
    #[error("runtime failure")]
    Runtime(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl From<RouterError> for tonic::Status {
    fn from(e: RouterError) -> Self {
        match &e {
            RouterError::NoWorkers { .. } => tonic::Status::unavailable(e.to_string()),
            RouterError::InvalidArgument(_) => tonic::Status::invalid_argument(e.to_string()),
            RouterError::Config(_) | RouterError::Metrics(_) | RouterError::Runtime(_) => {
                tracing::error!(error = ?e, "router internal error");
                tonic::Status::internal("router internal error")
            }
        }
    }
}

impl From<sluice_runtime::RuntimeError> for RouterError {
    fn from(e: sluice_runtime::RuntimeError) -> Self {
        RouterError::Runtime(Box::new(e))
    }
}
