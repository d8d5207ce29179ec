//! The listener edge every server shares: accept, TLS, HTTP/1.1 and HTTP/2
//! on one port, and bounded resources per connection.
//!
//! - At most `max_connections` connections at once; one more is closed as
//!   soon as it is accepted (it never waits in a queue holding a descriptor).
//! - A connection must finish its TLS handshake and send its first request's
//!   headers within `header_read_timeout`, or it is closed: a peer that
//!   connects and sends nothing holds nothing for long.
//! - A connection with no request in flight for `idle_timeout` (an idle
//!   HTTP/1.1 keep-alive or HTTP/2 connection) is shut down gracefully
//!   (HTTP/2 `GOAWAY`, so a client's racing request is not lost); HTTP/1.1
//!   request heads must also arrive within it.
//! - HTTP/2 keep-alive pings every 10 s end connections to dead peers.
//!
//! Every request gets a [`PeerInfo`] extension (the peer's address and
//! whether it presented a certificate the mesh CA signed) and the server
//! span of [`grpc_server_span`]. Shutdown stops accepting at once, lets
//! in-flight requests finish, and drops every connection if the serving
//! future itself is dropped (the drain deadline passed).
//!
//! Listeners that speak their own protocol on a raw socket (the KV plane's
//! `tcp` and `rdma` side channel) take their connections through the same
//! [`ConnectionGate`]: the same `max_connections`, the same first-frame and
//! idle deadlines, the same rate-limited refusal log.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, HttpBody};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;
use tracing::Instrument;

use crate::RuntimeError;
use crate::security::{ConnectionLimits, PeerInfo, Security};
use crate::telemetry::grpc_server_span;

/// HTTP/2 keep-alive ping interval and how long a ping may go unanswered.
const H2_PING_INTERVAL: Duration = Duration::from_secs(10);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// How long a connection shut down for idleness may take to close.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub(crate) async fn serve(
    listener: TcpListener,
    app: axum::Router,
    security: Arc<Security>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RuntimeError> {
    let limits = security.limits();
    let gate = ConnectionGate::new("http", limits);
    let tracker = TaskTracker::new();
    // Graceful: stop taking requests, finish those in flight.
    let drain = CancellationToken::new();
    // Hard: dropped with this future (the drain deadline passed).
    let hard = CancellationToken::new();
    let _hard_on_drop = hard.clone().drop_guard();
    {
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                accepted = gate.accept(&listener) => accepted,
            };
            let Some((tcp, peer, slot)) = accepted else {
                continue;
            };
            let conn = Connection {
                app: app.clone(),
                security: Arc::clone(&security),
                limits,
                peer,
                drain: drain.clone(),
                hard: hard.clone(),
            };
            tracker.spawn(async move {
                conn.run(tcp).await;
                drop(slot);
            });
        }
    }
    // Stop accepting before draining: new clients are refused, not hung.
    drop(listener);
    drain.cancel();
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Takes connections on a listener within the edge's limits: at most
/// `max_connections` held at once (one more is closed as soon as it is
/// accepted), refusals and accept errors logged at most once a second with
/// how many happened since.
pub struct ConnectionGate {
    listener: &'static str,
    limits: ConnectionLimits,
    slots: Arc<Semaphore>,
    refused: parking_lot::Mutex<RateLimitedLog>,
}

impl std::fmt::Debug for ConnectionGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionGate")
            .field("listener", &self.listener)
            .field("limits", &self.limits)
            .field("open", &self.open())
            .finish()
    }
}

/// A connection's place under [`ConnectionLimits::max_connections`]; it
/// frees when dropped.
pub type ConnectionSlot = tokio::sync::OwnedSemaphorePermit;

impl ConnectionGate {
    /// A gate for the listener named `listener` in its logs.
    pub fn new(listener: &'static str, limits: ConnectionLimits) -> Self {
        Self {
            listener,
            limits,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            refused: parking_lot::Mutex::default(),
        }
    }

    /// The limits it enforces (its connections apply the deadlines).
    pub fn limits(&self) -> ConnectionLimits {
        self.limits
    }

    /// Connections held now.
    pub fn open(&self) -> usize {
        self.limits.max_connections - self.slots.available_permits()
    }

    /// The next connection on `listener` with its slot, or `None` when the
    /// one accepted was closed at once (the limit is reached) or accepting
    /// failed (after a short back-off: out of descriptors never spins).
    pub async fn accept(
        &self,
        listener: &TcpListener,
    ) -> Option<(TcpStream, SocketAddr, ConnectionSlot)> {
        let (tcp, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                let listener = self.listener;
                self.refused
                    .lock()
                    .warn(|n| tracing::warn!(listener, error = %e, errors = n, "accept failed"));
                tokio::time::sleep(Duration::from_millis(50)).await;
                return None;
            }
        };
        self.slot(peer).map(|slot| (tcp, peer, slot))
    }

    /// A slot for a connection just accepted from `peer`, or `None` (close
    /// it): the limit is reached.
    pub fn slot(&self, peer: impl std::fmt::Display) -> Option<ConnectionSlot> {
        let slot = Arc::clone(&self.slots).try_acquire_owned().ok();
        if slot.is_none() {
            self.refuse(
                peer,
                "connection limit reached; closing new connections (--max-connections)",
            );
        }
        slot
    }

    /// Logs that a connection from `peer` was refused and why, at most once
    /// a second with the count since.
    pub fn refuse(&self, peer: impl std::fmt::Display, reason: &str) {
        let (listener, max_connections) = (self.listener, self.limits.max_connections);
        self.refused
            .lock()
            .warn(|n| tracing::warn!(listener, %peer, refused = n, max_connections, "{reason}"));
    }
}

/// Logs a repeated condition at most once a second, with how many times it
/// happened since.
#[derive(Default)]
struct RateLimitedLog {
    last: Option<Instant>,
    count: u64,
}

impl RateLimitedLog {
    fn warn(&mut self, log: impl FnOnce(u64)) {
        self.count += 1;
        if self
            .last
            .is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            log(self.count);
            self.last = Some(Instant::now());
            self.count = 0;
        }
    }
}

/// One accepted connection.
struct Connection {
    app: axum::Router,
    security: Arc<Security>,
    limits: ConnectionLimits,
    peer: SocketAddr,
    drain: CancellationToken,
    hard: CancellationToken,
}

impl Connection {
    async fn run(self, tcp: TcpStream) {
        let _ = tcp.set_nodelay(true);
        let started = tokio::time::Instant::now();
        let first_deadline = started + self.limits.header_read_timeout;
        match self.security.server_tls() {
            None => {
                let info = PeerInfo {
                    addr: self.peer,
                    verified_client_cert: false,
                };
                self.serve(tcp, info, first_deadline).await;
            }
            Some(config) => {
                let acceptor = tokio_rustls::TlsAcceptor::from(config);
                let handshake = tokio::select! {
                    () = self.hard.cancelled() => return,
                    r = tokio::time::timeout_at(first_deadline, acceptor.accept(tcp)) => r,
                };
                let tls = match handshake {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        tracing::debug!(peer = %self.peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(peer = %self.peer, "TLS handshake not done within --header-read-timeout");
                        return;
                    }
                };
                // The verifier refused any certificate the CA did not sign,
                // so a certificate here is a verified one.
                let info = PeerInfo {
                    addr: self.peer,
                    verified_client_cert: self.security.dials_tls()
                        && tls.get_ref().1.peer_certificates().is_some(),
                };
                self.serve(tls, info, first_deadline).await;
            }
        }
    }

    async fn serve<I>(self, io: I, info: PeerInfo, first_deadline: tokio::time::Instant)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let activity = Arc::new(Activity::default());
        let app = self.app.clone();
        let counted = Arc::clone(&activity);
        let svc = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(info);
            let guard = counted.begin();
            let span = grpc_server_span(&req);
            let call = app.clone().oneshot(req.map(Body::new));
            async move {
                let resp = call.await?;
                Ok::<_, Infallible>(resp.map(|body| {
                    Body::new(Counted {
                        inner: body,
                        _guard: guard,
                    })
                }))
            }
            .instrument(span)
        });
        let mut builder = auto::Builder::new(TokioExecutor::new());
        builder
            .http1()
            .timer(TokioTimer::new())
            .header_read_timeout(self.limits.idle_timeout)
            .keep_alive(true);
        builder
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(H2_PING_INTERVAL))
            .keep_alive_timeout(H2_PING_TIMEOUT);
        let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(svc));
        let mut conn = std::pin::pin!(conn);
        let idle = activity.idle(first_deadline, self.limits.idle_timeout);
        let mut idle = std::pin::pin!(idle);
        // Set once an idle connection was asked to close: it gets a grace
        // period, then is dropped.
        let mut closing: Option<tokio::time::Instant> = None;
        let mut draining = false;
        loop {
            let grace = async {
                match closing {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(peer = %self.peer, error = %e, "connection ended with an error");
                    }
                    return;
                }
                () = self.hard.cancelled() => return,
                // Draining waits for the requests in flight; the caller's
                // drain deadline bounds it (then `hard`).
                () = self.drain.cancelled(), if !draining && closing.is_none() => {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
                () = &mut idle, if !draining && closing.is_none() => {
                    tracing::debug!(peer = %self.peer, served = activity.served(), "closing an idle connection");
                    conn.as_mut().graceful_shutdown();
                    closing = Some(tokio::time::Instant::now() + IDLE_CLOSE_GRACE);
                }
                () = grace => return,
            }
        }
    }
}

/// Requests in flight on one connection, and whether one has started yet.
#[derive(Default)]
struct Activity {
    active: AtomicUsize,
    started_any: AtomicBool,
    changed: Notify,
}

impl Activity {
    fn begin(self: &Arc<Self>) -> ActiveGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.started_any.store(true, Ordering::Release);
        self.changed.notify_waiters();
        ActiveGuard(Arc::clone(self))
    }

    fn served(&self) -> bool {
        self.started_any.load(Ordering::Acquire)
    }

    /// Resolves once the connection has had no request in flight for
    /// `idle` (or, before its first request, at `first_deadline`).
    async fn idle(&self, first_deadline: tokio::time::Instant, idle: Duration) {
        loop {
            let changed = self.changed.notified();
            if self.active.load(Ordering::Acquire) > 0 {
                changed.await;
                continue;
            }
            let until = if self.served() {
                tokio::time::Instant::now() + idle
            } else {
                first_deadline
            };
            tokio::select! {
                () = tokio::time::sleep_until(until) => {
                    if self.active.load(Ordering::Acquire) == 0 {
                        return;
                    }
                }
                () = changed => {}
            }
        }
    }
}

/// One request in flight; it ends when its response body is done or dropped.
struct ActiveGuard(Arc<Activity>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }
}

/// A response body that keeps its request counted as in flight.
struct Counted {
    inner: Body,
    _guard: ActiveGuard,
}

impl HttpBody for Counted {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}
