//! gRPC plumbing: a server that every service gets health, reflection,
//! `/metrics`, `/live`, trace extraction, the mesh's membership check on
//! internal APIs and the listener edge (TLS, connection limits, timeouts:
//! [`crate::edge`]) from, and client channels that inject trace context
//! (and call a server of this process without a socket, see
//! [`crate::local`]; secured ones come from [`Security::channel`]).
//!
//! ```ignore
//! let server = GrpcServer::new()?
//!     .add_service(QueueServer::new(svc))
//!     .with_metrics(vec![registry]);
//! server.serve(listener, shutdown).await?;
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tower::Service;

use crate::local::MeshChannel;
use crate::security::{MESH_TOKEN_HEADER, Security, is_internal_path};
use crate::telemetry::TraceInjector;
use crate::{RuntimeError, Shutdown};

/// A client channel whose requests carry the caller's trace context.
pub type TracedChannel = InterceptedService<MeshChannel, TraceInjector>;

/// A gRPC server with the standard extras.
pub struct GrpcServer {
    routes: RoutesBuilder,
    health: HealthReporter,
    names: Vec<&'static str>,
    http: axum::Router,
    registries: Vec<prometheus::Registry>,
    security: Arc<Security>,
}

impl GrpcServer {
    /// A server with the health service and reflection (v1 and v1alpha)
    /// over every Sluice package.
    pub fn new() -> Result<Self, RuntimeError> {
        let (health, health_svc) = tonic_health::server::health_reporter();
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()?;
        let reflection_alpha = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        let mut routes = RoutesBuilder::default();
        routes
            .add_service(health_svc)
            .add_service(reflection)
            .add_service(reflection_alpha);
        Ok(Self {
            routes,
            health,
            names: Vec::new(),
            http: axum::Router::new(),
            registries: Vec::new(),
            security: Arc::new(Security::open()),
        })
    }

    /// Serves with `security`: TLS, the membership check on internal APIs
    /// and the connection limits ([`crate::ServiceContext::run`] sets the
    /// process's own; the default is [`Security::open`]).
    pub fn with_security(mut self, security: Arc<Security>) -> Self {
        self.security = security;
        self
    }

    /// Refuses to expose internal APIs on `addr` when nothing can tell a
    /// mesh member from a stranger (no `--tls-ca`, no `--mesh-token-file`)
    /// and `addr` is not loopback, unless `--insecure` says so.
    pub fn check_exposure(&self, addr: SocketAddr) -> Result<(), RuntimeError> {
        let internal: Vec<&str> = self
            .names
            .iter()
            .copied()
            .filter(|n| is_internal_path(&format!("/{n}/")))
            .collect();
        if internal.is_empty() || self.security.authenticates_members() || addr.ip().is_loopback() {
            return Ok(());
        }
        if self.security.insecure() {
            tracing::error!(
                %addr,
                services = ?internal,
                "--insecure: serving internal APIs on a non-loopback address WITHOUT authentication; \
                 anyone who can reach this port can generate, admit and route. Use --tls-ca or --mesh-token-file."
            );
            return Ok(());
        }
        Err(RuntimeError::Exposed {
            addr,
            services: internal.join(", "),
        })
    }

    /// Adds a service; it reports `SERVING` once the server accepts.
    pub fn add_service<S>(mut self, svc: S) -> Self
    where
        S: Service<http::Request<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Response: axum::response::IntoResponse,
        S::Future: Send + 'static,
    {
        self.routes.add_service(svc);
        self.names.push(S::NAME);
        self
    }

    /// Serves `/metrics` for `registries` and `/live` on the same port (HTTP/1.1).
    pub fn with_metrics(mut self, registries: Vec<prometheus::Registry>) -> Self {
        self.registries.extend(registries.iter().cloned());
        self.http = self.http.merge(crate::metrics::router(registries));
        self
    }

    /// The registries `/metrics` serves (see [`crate::metrics`]).
    pub fn registries(&self) -> &[prometheus::Registry] {
        &self.registries
    }

    /// Serves `router`'s HTTP routes on the same port (HTTP/1.1 and h2c).
    pub fn with_http(mut self, router: axum::Router) -> Self {
        self.http = self.http.merge(router);
        self
    }

    /// The health reporter, to flip services to `NOT_SERVING` early.
    pub fn health(&self) -> HealthReporter {
        self.health.clone()
    }

    /// Every route the server answers: the gRPC services and the HTTP routes
    /// (what [`crate::local`] calls in-process), behind the membership check
    /// on internal APIs when members can be authenticated.
    pub fn router(&self) -> axum::Router {
        let grpc: Routes = self.routes.clone().routes();
        let router = grpc.into_axum_router().merge(self.http.clone());
        if self.security.authenticates_members() {
            router.layer(axum::middleware::from_fn_with_state(
                Arc::clone(&self.security),
                require_member,
            ))
        } else {
            router
        }
    }

    /// Serves until `shutdown` is cancelled, then reports `NOT_SERVING` and
    /// drains in-flight calls.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: Shutdown,
    ) -> Result<(), RuntimeError> {
        self.check_exposure(listener.local_addr()?)?;
        let health = self.health.clone();
        for name in &self.names {
            health
                .set_service_status(*name, ServingStatus::Serving)
                .await;
        }
        health.set_service_status("", ServingStatus::Serving).await;
        let app = self.router();
        let names = self.names.clone();
        let signal = async move {
            shutdown.cancelled().await;
            for name in names {
                health
                    .set_service_status(name, ServingStatus::NotServing)
                    .await;
            }
            health
                .set_service_status("", ServingStatus::NotServing)
                .await;
        };
        crate::edge::serve(listener, app, self.security, signal).await
    }
}

/// Answers `UNAUTHENTICATED` to a caller of an internal API that is not a
/// mesh member (see [`crate::security`]); everything else passes.
async fn require_member(
    State(security): State<Arc<Security>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let path = request.uri().path();
    if is_internal_path(path) && !security.is_member(&request) {
        tracing::warn!(
            path,
            peer = ?request.extensions().get::<crate::security::PeerInfo>().map(|p| p.addr),
            "refused an internal call from outside the mesh"
        );
        let status = tonic::Status::unauthenticated(format!(
            "{path} is an internal API of the Sluice mesh: callers must present a client \
             certificate signed by the mesh CA or send the mesh token in `{MESH_TOKEN_HEADER}`"
        ));
        return status.into_http::<axum::body::Body>().into_response();
    }
    next.run(request).await
}

/// A channel to `endpoint` (`host:port` or a URL) that injects trace
/// context, without TLS or mesh token: straight into the server when one of
/// this process registered that endpoint, otherwise a lazily connecting
/// gRPC channel (the first call connects). Services call the mesh through
/// [`Security::channel`] instead.
pub fn channel(endpoint: &str) -> Result<TracedChannel, RuntimeError> {
    Security::open().channel(endpoint)
}
