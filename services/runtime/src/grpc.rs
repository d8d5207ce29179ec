//! gRPC plumbing: a server that every service gets health, reflection,
//! `/metrics`, `/live` and trace extraction from, and client channels that
//! inject trace context (and call a server of this process without a socket,
//! see [`crate::local`]).
//!
//! ```ignore
//! let server = GrpcServer::new()?
//!     .add_service(QueueServer::new(svc))
//!     .with_metrics(vec![registry]);
//! server.serve(listener, shutdown).await?;
//! ```

use std::convert::Infallible;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::interceptor::InterceptedService;
use tonic::service::{Routes, RoutesBuilder};
use tonic::transport::Endpoint;
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tower::Service;

use crate::local::MeshChannel;
use crate::telemetry::{TraceInjector, grpc_server_span};
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
    /// (what [`crate::local`] calls in-process).
    pub fn router(&self) -> axum::Router {
        let grpc: Routes = self.routes.clone().routes();
        grpc.into_axum_router().merge(self.http.clone())
    }

    /// Serves until `shutdown` is cancelled, then reports `NOT_SERVING` and
    /// drains in-flight calls.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: Shutdown,
    ) -> Result<(), RuntimeError> {
        let health = self.health.clone();
        for name in &self.names {
            health
                .set_service_status(*name, ServingStatus::Serving)
                .await;
        }
        health.set_service_status("", ServingStatus::Serving).await;
        let routes = Routes::from(self.router());
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
        // `tcp_nodelay` on the builder is ignored for a given listener: set it
        // on the incoming stream, or every small message (grants, tokens, SSE
        // chunks) waits ~40 ms for Nagle against the peer's delayed ACK.
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        tonic::transport::Server::builder()
            .accept_http1(true)
            .tcp_nodelay(true)
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .trace_fn(grpc_server_span)
            .add_routes(routes)
            .serve_with_incoming_shutdown(incoming, signal)
            .await?;
        Ok(())
    }
}

/// A channel to `endpoint` (`host:port` or a URL) that injects trace
/// context: straight into the server when one of this process registered
/// that endpoint, otherwise a lazily connecting gRPC channel (the first call
/// connects).
pub fn channel(endpoint: &str) -> Result<TracedChannel, RuntimeError> {
    let uri = if endpoint.contains("://") {
        endpoint.to_string()
    } else {
        format!("http://{endpoint}")
    };
    let ep = Endpoint::from_shared(uri)?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_while_idle(true);
    let host_port = endpoint.rsplit("://").next().unwrap_or(endpoint);
    let mesh = MeshChannel::new(host_port, || ep.connect_lazy());
    Ok(InterceptedService::new(mesh, TraceInjector))
}
