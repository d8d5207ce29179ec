//! Errors of the runtime plumbing.

/// What can fail in discovery, telemetry or server setup.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error("etcd at {endpoint}")]
    Etcd {
        endpoint: String,
        #[source]
        source: etcd_client::Error,
    },
    #[error("discovery entry {key} is malformed")]
    BadEntry {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("instance {id} of {component} is already registered")]
    AlreadyRegistered { component: String, id: String },
    #[error("invalid {flag}: {message}")]
    InvalidFlag { flag: &'static str, message: String },
    #[error("gRPC transport")]
    Transport(#[from] tonic::transport::Error),
    #[error("I/O")]
    Io(#[from] std::io::Error),
    #[error("telemetry setup: {what}")]
    Telemetry {
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("reflection setup")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("TLS")]
    Tls(#[from] crate::security::TlsError),
    #[error(
        "refusing to serve internal APIs ({services}) on {addr} without authentication: \
         set --tls-ca (mutual TLS) or --mesh-token-file, listen on a loopback address, \
         or pass --insecure on a network you trust"
    )]
    Exposed {
        addr: std::net::SocketAddr,
        services: String,
    },
}
