//! Services of this process, and the channel that calls them without a socket.
//!
//! When several services share a process (`sluice up`, the test mesh), a
//! call from one to another needs no TCP connection, no HTTP/2 framing and
//! no syscalls: [`ServiceContext::run`](crate::ServiceContext::run) records
//! every server it starts here under the endpoint it registers in discovery,
//! and [`crate::grpc::channel`] hands out a [`MeshChannel`] that calls that
//! server's routes directly whenever the endpoint it is asked for belongs to
//! this process. The request still goes through the same tonic service, the
//! same protobuf encoding and the same trace context as over the network, so
//! a service cannot tell a local caller from a remote one. Everything else
//! (other processes, other hosts) is dialled over gRPC as before: one code
//! path decides, from the endpoint discovery gave.
//!
//! A server that stops is removed at once; a channel already holding it
//! answers `UNAVAILABLE` from then on, as a closed connection would.
//!
//! Authentication: an in-process call passes the same membership check as a
//! networked one (the server's routes include it), and is a mesh member by
//! construction — the channel marks it, and nothing outside this process
//! can reach this path. It carries the mesh token too, when there is one.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use parking_lot::RwLock;
use tonic::body::Body;
use tonic::transport::Channel;
use tower::{Service, ServiceExt};
use tracing::Instrument;

use crate::telemetry::grpc_server_span;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One server of this process.
#[derive(Clone)]
struct LocalServer {
    router: axum::Router,
    stopped: Arc<AtomicBool>,
}

static SERVERS: LazyLock<RwLock<HashMap<String, LocalServer>>> = LazyLock::new(Default::default);

/// Keeps a server callable in-process; dropping it (the server stopped)
/// removes it and fails every channel still holding it.
#[derive(Debug)]
pub struct LocalRegistration {
    endpoint: String,
    stopped: Arc<AtomicBool>,
}

impl Drop for LocalRegistration {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Release);
        let mut servers = SERVERS.write();
        if servers
            .get(&self.endpoint)
            .is_some_and(|s| Arc::ptr_eq(&s.stopped, &self.stopped))
        {
            servers.remove(&self.endpoint);
        }
    }
}

/// Makes `router` (a server's gRPC and HTTP routes) callable in-process at
/// `endpoint` until the returned registration drops.
pub fn register(endpoint: &str, router: axum::Router) -> LocalRegistration {
    let stopped = Arc::new(AtomicBool::new(false));
    SERVERS.write().insert(
        endpoint.to_owned(),
        LocalServer {
            router,
            stopped: Arc::clone(&stopped),
        },
    );
    LocalRegistration {
        endpoint: endpoint.to_owned(),
        stopped,
    }
}

/// Whether a server of this process is registered at `endpoint`.
pub fn is_local(endpoint: &str) -> bool {
    SERVERS.read().contains_key(endpoint)
}

fn lookup(endpoint: &str) -> Option<LocalServer> {
    SERVERS.read().get(endpoint).cloned()
}

/// A client channel: straight into a server of this process, or over gRPC.
#[derive(Clone)]
pub struct MeshChannel {
    inner: Inner,
    /// The mesh token, sent on every call.
    token: Option<http::HeaderValue>,
}

#[derive(Clone)]
enum Inner {
    Remote(Channel),
    Local(LocalServer),
}

impl std::fmt::Debug for MeshChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Remote(c) => f.debug_tuple("MeshChannel::Remote").field(c).finish(),
            Inner::Local(_) => f.write_str("MeshChannel::Local"),
        }
    }
}

impl MeshChannel {
    /// The in-process server at `endpoint` if there is one, else `remote`
    /// (called only then: a local call dials nothing).
    pub(crate) fn new(endpoint: &str, remote: impl FnOnce() -> Channel) -> Self {
        let inner = match lookup(endpoint) {
            Some(server) => Inner::Local(server),
            None => Inner::Remote(remote()),
        };
        Self { inner, token: None }
    }

    /// Sends `token` as the mesh token on every call.
    pub(crate) fn with_token(mut self, token: Option<http::HeaderValue>) -> Self {
        self.token = token;
        self
    }

    /// Whether calls stay in this process.
    pub fn is_local(&self) -> bool {
        matches!(self.inner, Inner::Local(_))
    }
}

impl Service<http::Request<Body>> for MeshChannel {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match &mut self.inner {
            Inner::Remote(c) => c.poll_ready(cx).map_err(Into::into),
            Inner::Local(_) => Poll::Ready(Ok(())),
        }
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        if let Some(token) = &self.token {
            req.headers_mut()
                .insert(crate::security::MESH_TOKEN_HEADER, token.clone());
        }
        match &mut self.inner {
            Inner::Remote(c) => {
                let fut = c.call(req);
                Box::pin(async move { fut.await.map_err(Into::into) })
            }
            Inner::Local(server) => {
                if server.stopped.load(Ordering::Acquire) {
                    let status = tonic::Status::unavailable("the service has stopped");
                    return Box::pin(async move { Err(Box::new(status) as BoxError) });
                }
                // A member by construction (see the module docs).
                req.extensions_mut().insert(crate::security::LocalCall);
                // The span the listener gives a networked call.
                let span = grpc_server_span(&req);
                let router = server.router.clone();
                Box::pin(
                    async move {
                        let resp: Result<_, Infallible> = router.oneshot(req).await;
                        match resp {
                            Ok(resp) => Ok(resp.map(Body::new)),
                            Err(never) => match never {},
                        }
                    }
                    .instrument(span),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;

    use super::*;
    use crate::grpc::{GrpcServer, channel};

    #[tokio::test]
    async fn a_registered_server_answers_without_a_socket_and_refuses_once_stopped() {
        // Nothing listens on port 1: only the in-process path can answer.
        let endpoint = "127.0.0.1:1";
        let server = GrpcServer::new().expect("server");
        let registration = register(endpoint, server.router());
        let ch = channel(endpoint).expect("channel");
        assert!(is_local(endpoint));
        let mut client = HealthClient::new(ch);
        let reply = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        // The health service answers (NOT_FOUND/SERVING alike prove it ran);
        // a socket call would have failed to connect.
        match reply {
            Ok(_) => {}
            Err(status) => assert_ne!(status.code(), tonic::Code::Unavailable, "{status}"),
        }
        drop(registration);
        assert!(!is_local(endpoint));
        let err = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect_err("stopped");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    }

    #[tokio::test]
    async fn an_endpoint_of_no_server_here_is_dialled() {
        let mut client = HealthClient::new(channel("127.0.0.1:2").expect("channel"));
        let err = client
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .expect_err("nothing listens there");
        assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    }
}
