//! `sluice-runtime`: the plumbing every Sluice service shares, and nothing else.
//!
//! - [`config`]: flags common to every service (`--etcd`, `--namespace`,
//!   `--listen`, `--advertise`), each also read from a `SLUICE_*` variable.
//! - [`telemetry`]: logs, OTLP export when `OTEL_EXPORTER_OTLP_ENDPOINT` is
//!   set, and W3C trace-context propagation over HTTP headers and gRPC metadata.
//! - [`discovery`]: the [`Discovery`] trait and its `etcd` and `memory` backends.
//! - [`grpc`]: a gRPC server with health, reflection, `/metrics`, trace
//!   extraction and the membership check on internal APIs, and client
//!   channels that inject trace context.
//! - [`security`]: TLS and mutual TLS from files, the mesh token, who is a
//!   mesh member, connection limits; `edge` (private) is the listener that
//!   enforces them.
//! - [`limits`]: the input rules every boundary applies to shared messages.
//! - [`request`]: one request's description through admission and placement
//!   (`common.v1.RequestDescription`), checked once where it is received.
//! - [`local`]: the servers of this process, called without a socket.
//! - [`shutdown`]: the cancellation token every `serve` takes, and signal handling.
//! - [`tenant_labels`]: per-tenant metric labels of bounded cardinality (top N + `other`).
//! - [`service`]: the shape of a service crate (`Args`, `serve(listener, args, ctx)`)
//!   and [`ServiceContext::run`], the one lifecycle: register, serve, deregister, drain.
//!
//! Business logic stays in its service.

#![forbid(unsafe_code)]

pub mod config;
pub mod discovery;
pub mod edge;
pub mod error;
pub mod grpc;
pub mod limits;
pub mod local;
pub mod metrics;
pub mod request;
pub mod security;
pub mod service;
pub mod session;
pub mod shutdown;
pub mod telemetry;
pub mod tenant_labels;

pub use config::{CommonArgs, ModelArgs};
pub use discovery::{Discovery, DiscoveryEvent, Followed, Instance, Registration};
pub use error::RuntimeError;
pub use request::RequestDescription;
pub use security::{Security, SecurityArgs};
pub use service::ServiceContext;
pub use shutdown::Shutdown;
