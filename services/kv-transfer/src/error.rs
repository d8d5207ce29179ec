//! What a KV transfer can fail with, and its one mapping to `tonic::Status`.
//!
//! Underlying errors (I/O, the engine, gRPC, mapping a file, verbs return
//! codes) are kept as sources, never flattened into strings. A transfer's
//! errors cross process boundaries as text (the `KvTransfer` status, the
//! `tcp` ack, the `Prefill` status the decode worker logs when it falls
//! back), so a wrapping variant's message also names its immediate source,
//! as the worker's errors do.

use std::net::SocketAddr;
use std::time::Duration;

use sluice_engine::EngineError;
use sluice_proto::kv::v1 as pb;

use crate::TransportKind;

/// Any underlying error a [`KvTransferError`] wraps.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What a KV transfer (either side, any transport) can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KvTransferError {
    /// A descriptor field is wrong (missing, or not what this side has).
    #[error("invalid {field}: {message}")]
    InvalidArgument {
        field: &'static str,
        message: String,
    },
    /// The sender's block layout is not the receiver's.
    #[error(
        "invalid destination.layout: KV layout mismatch: receiver has {theirs:?}, this worker has {ours:?}"
    )]
    LayoutMismatch {
        theirs: Box<pb::KvLayout>,
        ours: Box<pb::KvLayout>,
    },
    /// The receiver has no such transfer registered (never, or forgotten).
    #[error("unknown or cancelled transfer {transfer}")]
    UnknownTransfer { transfer: String },
    /// A block outside the transfer's writable blocks.
    #[error("block {block} is not part of transfer {transfer}")]
    NotWritable { transfer: String, block: u32 },
    /// A block whose size is not the layout's.
    #[error("block {block} of transfer {transfer} has {len} bytes, the layout says {expected}")]
    BlockSize {
        transfer: String,
        block: u32,
        len: usize,
        expected: usize,
    },
    /// A block whose bytes do not match the checksum it came with.
    #[error("checksum mismatch on block {block} of transfer {transfer}")]
    Checksum { transfer: String, block: u32 },
    /// Negotiation found no region whose transport the sender accepts.
    #[error(
        "no KV transport in common: the decode worker offers [{offered}], this worker accepts [{accepted}]"
    )]
    NoCommonTransport { offered: String, accepted: String },
    /// The transfer did not finish within the descriptor's timeout.
    #[error("{transport} transfer not done within {} ms", after.as_millis())]
    Timeout {
        transport: TransportKind,
        after: Duration,
    },
    /// The receiving side refused the transfer and said why.
    #[error("{transport} refused: {reason}")]
    Refused {
        transport: TransportKind,
        reason: String,
    },
    /// A transport's own check failed (a malformed frame or file, a state
    /// it cannot write in); there is no underlying error.
    #[error("{transport}: {message}")]
    Transport {
        transport: TransportKind,
        message: String,
    },
    /// A transport failed while doing `what` on an underlying error, kept as
    /// the source.
    #[error("{transport}: {what}: {source}")]
    Failed {
        transport: TransportKind,
        what: String,
        #[source]
        source: BoxError,
    },
    /// A gRPC call of the `grpc` transport failed.
    #[error("gRPC {what}: {}", .source.message())]
    Rpc {
        what: &'static str,
        #[source]
        source: tonic::Status,
    },
    /// A transport's listener could not start.
    #[error("KV {transport} listener on {bind}: {source}")]
    Listen {
        transport: TransportKind,
        bind: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// The destination engine refused a block write.
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
}

impl KvTransferError {
    /// `transport` failed while doing `what` (for `map_err`).
    pub fn failed<E: Into<BoxError>>(
        transport: TransportKind,
        what: impl Into<String>,
    ) -> impl FnOnce(E) -> Self {
        move |e| Self::Failed {
            transport,
            what: what.into(),
            source: e.into(),
        }
    }

    /// A check of `transport` failed (no underlying error).
    pub fn transport(transport: TransportKind, message: impl Into<String>) -> Self {
        Self::Transport {
            transport,
            message: message.into(),
        }
    }

    /// The status code a caller gets for this error.
    pub fn code(&self) -> tonic::Code {
        use tonic::Code;
        match self {
            Self::InvalidArgument { .. } | Self::LayoutMismatch { .. } => Code::InvalidArgument,
            Self::Engine(EngineError::InvalidRequest(_) | EngineError::BlockSize { .. }) => {
                Code::InvalidArgument
            }
            Self::Engine(EngineError::OutOfBlocks { .. }) => Code::ResourceExhausted,
            Self::Engine(EngineError::Shutdown) => Code::Unavailable,
            Self::Engine(_) => Code::Internal,
            _ => Code::Unavailable,
        }
    }
}

impl From<KvTransferError> for tonic::Status {
    fn from(e: KvTransferError) -> Self {
        match e.code() {
            tonic::Code::Internal => {
                tracing::error!(error = %e, source = ?std::error::Error::source(&e), "KV transfer internal error");
                tonic::Status::internal("internal worker error; see the worker's log")
            }
            code => tonic::Status::new(code, e.to_string()),
        }
    }
}
