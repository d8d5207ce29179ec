//! The router side of the queue: one `Place` session to every router
//! replica ([`Routers`]: a fixed `--router-endpoint`, or every `router`
//! instance in discovery), the [`Placer`] that places a released request on
//! one of them, the leases that end its placement, and the task that feeds
//! a router's `WatchLoad` figures into the queue.
//!
//! # Every router hears every placement
//!
//! A committed route is answered by one router and then sent, as `placed`,
//! to every other; a lease's start and its end (the request's first token,
//! its lease dropping) go to all. So replicas count the same load and a
//! burst spread by one is seen by all. A (re)connected session first sends
//! every placement this queue still holds, so a restarted router counts
//! them again; a session that ends leaves its placements to age out at the
//! router. A session's messages are applied in order: the release of a
//! request that just ended reaches a router before the placement of the
//! request that follows it.
//!
//! The router never sees held requests: it is called once per release (and,
//! under `wspt`, for dry-run overlap reads).
//!
//! # A router that fails is replaced
//!
//! A placement goes to one ready session, round robin. When that router's
//! session breaks before it answers (the router died or restarted) or it
//! gives no answer within [`ROUTE_TIMEOUT`] (hung, paused), the placement is
//! asked of another router under the same placement id — what the first
//! may have committed is released by its session's end or by the
//! placement's release, which every router hears — until every ready
//! router was tried (`sluice_queue_failovers_total{service="router"}`
//! counts each move). A dead router's session stays down, and is skipped,
//! until it answers again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures::FutureExt;
use parking_lot::Mutex;
use prometheus::{IntCounterVec, Registry};
use sluice_proto::router::v1 as router_pb;
use sluice_proto::router::v1::place_request::Msg as PlaceMsg;
use sluice_proto::router::v1::router_client::RouterClient;
use sluice_runtime::grpc::TracedChannel;
use sluice_runtime::metrics::Registrar;
use sluice_runtime::session::{Protocol, Session};
use sluice_runtime::{Discovery, DiscoveryEvent, Followed, Security};
use tokio::sync::Notify;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::QueueError;
use crate::queue::{
    Entry, HeldByModel, LoadView, Placed, Placement, PlacementLease, Placer, Queue, Target,
    WorkerRole,
};

/// Discovery component name routers register under.
pub(crate) const ROUTER_COMPONENT: &str = "router";

/// Pause before re-subscribing to a router's load, or reconnecting a
/// session, after a failure (doubling up to [`RETRY_MAX`]).
const RETRY: Duration = Duration::from_millis(500);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Longest wait for one route answer before another router is asked. Under
/// a threshold a model's releases wait for the previous placement, so a
/// hung router must not stall them. Longer than the router's own wait for
/// a joining worker.
const ROUTE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long placement waits for a router to appear before failing with
/// `no_router` (start-up order, router restarts).
const ROUTER_WAIT: Duration = Duration::from_secs(3);
type Answer = Result<router_pb::RouteResponse, tonic::Status>;

/// `Router.Place`, on the mesh's session client: each route is a member
/// whose one event is its answer. A router that falls the session's backlog
/// behind has its session ended, and the next is sent every held placement
/// again.
#[derive(Debug)]
struct Place;

/// What a route call hears.
enum PlaceEvent {
    /// The router's answer (boxed: a route answer is large beside `Broke`).
    Answer(Box<Answer>),
    /// The session ended first.
    Broke,
}

impl Protocol for Place {
    type Out = router_pb::PlaceRequest;
    type In = router_pb::PlaceResponse;
    type Event = PlaceEvent;
    const PEER: &'static str = "router";
    const METHOD: &'static str = "Router.Place";
    const MEMBER: &'static str = "placement";

    fn call(
        channel: TracedChannel,
        outbound: ReceiverStream<router_pb::PlaceRequest>,
    ) -> futures::future::BoxFuture<
        'static,
        Result<tonic::Streaming<router_pb::PlaceResponse>, tonic::Status>,
    > {
        async move {
            let mut client = RouterClient::new(channel);
            Ok(client.place(outbound).await?.into_inner())
        }
        .boxed()
    }

    fn event(reply: router_pb::PlaceResponse) -> Option<(u64, PlaceEvent, bool)> {
        let answer = match reply.result {
            Some(router_pb::place_response::Result::Routed(r)) => Ok(r),
            Some(router_pb::place_response::Result::Error(e)) => {
                Err(tonic::Status::new(e.code.into(), e.message))
            }
            None => Err(tonic::Status::internal("empty answer")),
        };
        Some((reply.call_id, PlaceEvent::Answer(Box::new(answer)), true))
    }

    fn failure(_: tonic::Status) -> PlaceEvent {
        PlaceEvent::Broke
    }

    fn ends(_: &PlaceEvent) -> bool {
        true
    }

    /// A route's answer is not withdrawn: its placement is released instead.
    fn cancel(_: u64) -> Option<router_pb::PlaceRequest> {
        None
    }
}

/// The router replicas, one `Place` session each.
#[derive(Debug, Clone)]
pub(crate) struct Routers {
    inner: Arc<RoutersInner>,
}

#[derive(Debug)]
struct RoutersInner {
    /// This queue's identity on its sessions.
    client_id: String,
    /// Router id → its link (a fixed endpoint is keyed by itself).
    links: Mutex<BTreeMap<String, Arc<RouterLink>>>,
    next: AtomicUsize,
    changed: Notify,
    /// The placements of live leases, by placement id (a request's decode
    /// and prefill placements share it): what a new session is sent first.
    held: Mutex<HashMap<u64, Vec<router_pb::Placement>>>,
    /// The latest report of what this queue holds unplaced: sent to every
    /// session as it changes, and to a new one after its placements.
    unplaced: Mutex<router_pb::HeldReport>,
    /// Placement and call ids.
    next_id: AtomicU64,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// TLS and mesh token for the router channels.
    security: Arc<Security>,
}

/// One router: its channel and its current session, reopened while it
/// lasts.
#[derive(Debug)]
struct RouterLink {
    router_id: String,
    channel: TracedChannel,
    /// The session now; `None` between sessions.
    current: Mutex<Option<Arc<Session<Place>>>>,
    stop: CancellationToken,
}

/// Why a call on a session got no answer.
enum CallError {
    /// The session is down or broke before answering: another router may.
    Unavailable,
    /// The router answered with an error.
    Status(tonic::Status),
    /// No answer within [`ROUTE_TIMEOUT`].
    Timeout,
}

const TIMED_OUT: &str = "it gave no answer in time";

/// The router took longer than [`ROUTE_TIMEOUT`] to answer.
#[derive(Debug, thiserror::Error)]
#[error("the router gave no answer within {0:?}")]
struct RouteTimeout(Duration);

impl RouterLink {
    fn current(&self) -> Option<Arc<Session<Place>>> {
        self.current.lock().clone()
    }

    /// The router answered the current session's opening: routes may go here.
    fn ready(&self) -> bool {
        self.current()
            .is_some_and(|s| s.phase() == sluice_runtime::session::Phase::Open)
    }

    /// Sends `msg` on the current session; between sessions nothing is
    /// sent (the next is sent what is held).
    fn send(&self, msg: router_pb::PlaceRequest) {
        if let Some(session) = self.current() {
            session.send(msg);
        }
    }

    /// The router gave no answer in time (hung or frozen, its connection
    /// still open): end the session and skip it until a new session opens,
    /// which a router that is still hung never answers. Every placement
    /// after this one goes straight to the other routers instead of waiting
    /// out [`ROUTE_TIMEOUT`] again.
    fn reset(&self) {
        if let Some(session) = self.current() {
            session.close(&tonic::Status::unavailable(TIMED_OUT));
        }
    }

    fn client(&self) -> RouterClient<TracedChannel> {
        RouterClient::new(self.channel.clone())
    }

    async fn call(
        &self,
        request: router_pb::RouteRequest,
    ) -> Result<router_pb::RouteResponse, CallError> {
        let Some(session) = self.current() else {
            return Err(CallError::Unavailable);
        };
        let mut member = session.join(|call_id| router_pb::PlaceRequest {
            msg: Some(PlaceMsg::Route(router_pb::PlaceCall {
                call_id,
                request: Some(request),
                traceparent: sluice_runtime::telemetry::traceparent(),
            })),
        });
        match tokio::time::timeout(ROUTE_TIMEOUT, member.next()).await {
            Err(_) => Err(CallError::Timeout),
            Ok(None | Some(PlaceEvent::Broke)) => Err(CallError::Unavailable),
            Ok(Some(PlaceEvent::Answer(answer))) => match *answer {
                Ok(r) => Ok(r),
                Err(status) => Err(CallError::Status(status)),
            },
        }
    }
}

impl Routers {
    fn empty(
        client_id: &str,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        security: Arc<Security>,
    ) -> Self {
        Self {
            inner: Arc::new(RoutersInner {
                client_id: client_id.to_owned(),
                links: Mutex::new(BTreeMap::new()),
                next: AtomicUsize::new(0),
                changed: Notify::new(),
                held: Mutex::new(HashMap::new()),
                unplaced: Mutex::new(router_pb::HeldReport::default()),
                next_id: AtomicU64::new(1),
                tracker: tracker.clone(),
                shutdown,
                security,
            }),
        }
    }

    /// Always `endpoint`; this queue is `client_id` on its session.
    pub(crate) fn fixed(
        endpoint: &str,
        client_id: &str,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        security: Arc<Security>,
    ) -> Result<Self, QueueError> {
        let routers = Self::empty(client_id, tracker, shutdown, security);
        let channel = routers.inner.security.channel(endpoint)?;
        RoutersInner::open(&routers.inner, endpoint.to_owned(), channel);
        Ok(routers)
    }

    /// Every `router` instance in discovery, kept current by a task on
    /// `tracker` until `shutdown`; this queue is `client_id` on their
    /// sessions.
    pub(crate) async fn discovered(
        discovery: &Arc<dyn Discovery>,
        client_id: &str,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
        security: Arc<Security>,
    ) -> Result<Self, QueueError> {
        let routers = Self::empty(client_id, tracker, shutdown.clone(), security);
        let watch = discovery.watch(ROUTER_COMPONENT).await?;
        let inner = Arc::clone(&routers.inner);
        tracker.spawn(async move {
            let followed = watch
                .follow(&shutdown, |event| {
                    match event {
                        DiscoveryEvent::Put(instance) => match inner.security.channel(&instance.endpoint) {
                            Ok(ch) => {
                                tracing::info!(id = %instance.id, endpoint = %instance.endpoint, "router found");
                                RoutersInner::open(&inner, instance.id, ch);
                            }
                            Err(err) => {
                                tracing::warn!(id = %instance.id, endpoint = %instance.endpoint, error = %err, "unusable router endpoint");
                            }
                        },
                        DiscoveryEvent::Delete { id, .. } => {
                            tracing::info!(%id, "router left");
                            if let Some(link) = inner.links.lock().remove(&id) {
                                link.stop.cancel();
                            }
                        }
                    }
                    inner.changed.notify_waiters();
                })
                .await;
            if followed == Followed::WatchEnded {
                tracing::warn!("discovery watch of routers ended");
            }
        });
        Ok(routers)
    }

    /// A ready session, round robin, skipping `tried`; waits until
    /// `deadline` for one to appear (a queue that starts before the router,
    /// or between router restarts, holds a request briefly instead of
    /// failing it).
    async fn pick_within(
        &self,
        deadline: tokio::time::Instant,
        tried: &HashSet<String>,
    ) -> Option<Arc<RouterLink>> {
        loop {
            // Registered before the check: a router found in between still wakes us.
            let changed = self.inner.changed.notified();
            if let Some(s) = self.pick(tried) {
                return Some(s);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.pick(tried);
            }
        }
    }

    /// A ready session, round robin, skipping `tried`.
    fn pick(&self, tried: &HashSet<String>) -> Option<Arc<RouterLink>> {
        let links = self.inner.links.lock();
        let ready: Vec<&Arc<RouterLink>> = links
            .values()
            .filter(|l| !tried.contains(&l.router_id) && l.ready())
            .collect();
        if ready.is_empty() {
            return None;
        }
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % ready.len();
        Some(Arc::clone(ready[i]))
    }

    fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }
}

impl RoutersInner {
    /// Opens (or keeps) the link to router `id`.
    fn open(inner: &Arc<Self>, id: String, channel: TracedChannel) {
        let link = {
            let mut links = inner.links.lock();
            if links.contains_key(&id) {
                return;
            }
            let link = Arc::new(RouterLink {
                router_id: id.clone(),
                channel,
                current: Mutex::new(None),
                stop: inner.shutdown.child_token(),
            });
            links.insert(id, Arc::clone(&link));
            link
        };
        inner.tracker.spawn(run_link(Arc::clone(inner), link));
    }

    /// Sends `msg` to every router but `except`.
    fn broadcast(&self, msg: &router_pb::PlaceRequest, except: Option<&str>) {
        let links: Vec<Arc<RouterLink>> = self.links.lock().values().cloned().collect();
        for link in links {
            if except != Some(link.router_id.as_str()) {
                link.send(msg.clone());
            }
        }
    }

    /// Tells every router what this queue now holds unplaced (and keeps it
    /// for sessions that open later).
    fn report_unplaced(&self, report: router_pb::HeldReport) {
        let mut unplaced = self.unplaced.lock();
        let msg = router_pb::PlaceRequest {
            msg: Some(PlaceMsg::Held(report.clone())),
        };
        self.broadcast(&msg, None);
        *unplaced = report;
    }

    /// Records a granted request's placements and tells every router but
    /// `origin` (which made them) about them.
    fn hold(&self, id: u64, placements: Vec<router_pb::Placement>, origin: &str) {
        let mut held = self.held.lock();
        for p in &placements {
            let msg = router_pb::PlaceRequest {
                msg: Some(PlaceMsg::Placed(p.clone())),
            };
            self.broadcast(&msg, Some(origin));
        }
        held.insert(id, placements);
    }

    /// Tells every router that placement `id`, never held (its request
    /// failed while being placed), ends: whatever was committed is released.
    fn abandon(&self, id: u64) {
        let msg = router_pb::PlaceRequest {
            msg: Some(PlaceMsg::Update(router_pb::PlacementUpdate {
                placement_id: id,
                state: router_pb::PlacementState::Released as i32,
            })),
        };
        self.broadcast(&msg, None);
    }

    /// Applies a change to a held placement and tells every router.
    fn update(&self, id: u64, state: router_pb::PlacementState) {
        let mut held = self.held.lock();
        match state {
            router_pb::PlacementState::Released => {
                if held.remove(&id).is_none() {
                    return;
                }
            }
            _ => match held.get_mut(&id) {
                Some(ps) if ps.iter().any(|p| !p.started) => {
                    for p in ps {
                        p.started = true;
                    }
                }
                _ => return,
            },
        }
        let msg = router_pb::PlaceRequest {
            msg: Some(PlaceMsg::Update(router_pb::PlacementUpdate {
                placement_id: id,
                state: state as i32,
            })),
        };
        self.broadcast(&msg, None);
    }
}

/// Keeps one router's session open until the link is stopped: hello,
/// every held placement, then whatever the queue sends; answers go to their
/// calls. A session that ends is opened again after a pause.
async fn run_link(inner: Arc<RoutersInner>, link: Arc<RouterLink>) {
    let mut backoff = RETRY;
    while !link.stop.is_cancelled() {
        let session = {
            // Under `held`: a placement is either in this snapshot or sent
            // on the new session after it, never both, never neither.
            let held = inner.held.lock();
            // Under `unplaced` too: the report is in the snapshot or sent
            // after it.
            let unplaced = inner.unplaced.lock();
            let mut opening = vec![router_pb::PlaceRequest {
                msg: Some(PlaceMsg::Hello(router_pb::PlaceHello {
                    client_id: inner.client_id.clone(),
                })),
            }];
            opening.extend(held.values().flatten().map(|p| router_pb::PlaceRequest {
                msg: Some(PlaceMsg::Placed(p.clone())),
            }));
            if !unplaced.models.is_empty() {
                opening.push(router_pb::PlaceRequest {
                    msg: Some(PlaceMsg::Held(unplaced.clone())),
                });
            }
            match Session::open(
                link.channel.clone(),
                opening,
                &inner.tracker,
                link.stop.clone(),
            ) {
                Ok(session) => {
                    *link.current.lock() = Some(Arc::clone(&session));
                    Some(session)
                }
                Err(e) => {
                    tracing::warn!(router = %link.router_id, error = %e, "too many held placements for one session");
                    None
                }
            }
        };
        if let Some(session) = session {
            let opened = tokio::select! {
                () = link.stop.cancelled() => break,
                opened = session.opened() => opened,
            };
            if opened {
                inner.changed.notify_waiters();
                tracing::info!(router = %link.router_id, "placement session open");
                backoff = RETRY;
                tokio::select! {
                    () = link.stop.cancelled() => break,
                    () = session.closed() => {}
                }
            } else {
                tracing::debug!(router = %link.router_id, "cannot open a placement session");
            }
            link.current.lock().take();
        }
        inner.changed.notify_waiters();
        tokio::select! {
            () = link.stop.cancelled() => break,
            () = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(RETRY_MAX);
    }
    if let Some(session) = link.current.lock().take() {
        session.close(&tonic::Status::unavailable("the router left"));
    }
    inner.changed.notify_waiters();
}

/// Ends a request's placements at every router when dropped.
#[derive(Debug)]
struct RouterLease {
    inner: Arc<RoutersInner>,
    id: u64,
}

impl PlacementLease for RouterLease {
    fn started(&self) {
        self.inner
            .update(self.id, router_pb::PlacementState::Started);
    }
}

impl Drop for RouterLease {
    fn drop(&mut self) {
        self.inner
            .update(self.id, router_pb::PlacementState::Released);
    }
}

/// Places released requests with the router: a decode (or aggregated) worker,
/// and a prefill worker when the model has a prefill pool.
#[derive(Debug, Clone)]
pub(crate) struct RouterPlacer {
    routers: Routers,
    /// Models with prefill workers, from the latest load view ("" = any).
    prefill_models: Arc<Mutex<HashSet<String>>>,
    /// Placements asked again of another router, by failed service.
    failovers: IntCounterVec,
}

impl RouterPlacer {
    /// Places on `routers`; its failover counter goes into `registry`.
    pub(crate) fn new(routers: Routers, registry: &Registry) -> Result<Self, QueueError> {
        let failovers = Registrar(registry).counter_vec(
            "sluice_queue_failovers_total",
            "Placements a router failed (broke, no answer in time) that were asked of another router, by service",
            &["service"],
        )?;
        Ok(Self {
            routers,
            prefill_models: Arc::default(),
            failovers,
        })
    }

    fn has_prefill_pool(&self, model: &str) -> bool {
        let models = self.prefill_models.lock();
        if model.is_empty() {
            !models.is_empty()
        } else {
            models.contains(model) || models.contains("")
        }
    }

    fn note_load(&self, view: &LoadView) {
        let models = view
            .workers
            .iter()
            .filter(|w| w.role == WorkerRole::Prefill)
            .map(|w| w.model.clone())
            .collect();
        *self.prefill_models.lock() = models;
    }

    fn request(
        entry: &Entry,
        pool: router_pb::Pool,
        placement_id: Option<u64>,
    ) -> router_pb::RouteRequest {
        let mut description = entry.desc.to_wire();
        // Exclusions name decode workers (the ones that failed this request).
        if pool != router_pb::Pool::Decode {
            description.exclude_worker_ids.clear();
        }
        // What is left of the TTFT target after the wait so far (at least
        // 1 ms: 0 would mean no target).
        if description.ttft_target_ms > 0 {
            let waited = entry.arrival.elapsed().as_millis();
            description.ttft_target_ms =
                u32::try_from(u128::from(description.ttft_target_ms).saturating_sub(waited))
                    .unwrap_or(u32::MAX)
                    .max(1);
        }
        router_pb::RouteRequest {
            description: Some(description),
            pool: pool as i32,
            commit: placement_id.is_some(),
            placement_id: placement_id.unwrap_or(0),
        }
    }

    /// Asks one router for every pool in `pools` (pipelined on its session);
    /// a router whose session breaks before answering, or that does not
    /// answer in time, is replaced by another, each tried once. Returns the
    /// router that answered and its answers.
    async fn route(
        &self,
        entry: &Entry,
        pools: &[router_pb::Pool],
        placement_id: Option<u64>,
    ) -> Result<(String, Vec<router_pb::RouteResponse>), QueueError> {
        let deadline = tokio::time::Instant::now() + ROUTER_WAIT;
        let mut tried = HashSet::new();
        loop {
            let session = self
                .routers
                .pick_within(deadline, &tried)
                .await
                .ok_or(QueueError::NoRouter)?;
            let calls = pools
                .iter()
                .map(|&pool| session.call(Self::request(entry, pool, placement_id)));
            let answers = futures::future::join_all(calls).await;
            let mut out = Vec::with_capacity(answers.len());
            let mut retry = None;
            for (pool, answer) in pools.iter().zip(answers) {
                match answer {
                    Ok(r) => out.push(r),
                    Err(CallError::Unavailable) => {
                        retry.get_or_insert("its session broke before answering");
                    }
                    Err(CallError::Timeout) => retry = Some(TIMED_OUT),
                    Err(CallError::Status(status)) => {
                        return Err(match status.code() {
                            tonic::Code::Unavailable
                            | tonic::Code::NotFound
                            | tonic::Code::FailedPrecondition => {
                                tracing::debug!(model = %entry.desc.model, ?pool, message = status.message(), "router has no worker");
                                QueueError::NoWorkers {
                                    model: entry.desc.model.clone(),
                                }
                            }
                            _ => QueueError::placement(status),
                        });
                    }
                }
            }
            let Some(why) = retry else {
                return Ok((session.router_id.clone(), out));
            };
            if why == TIMED_OUT {
                tracing::warn!(router = %session.router_id, "router gave no answer in time; skipping it until it opens a session again");
                session.reset();
            }
            tried.insert(session.router_id.clone());
            if self.routers.pick(&tried).is_some() {
                self.failovers.with_label_values(&["router"]).inc();
                tracing::warn!(router = %session.router_id, request_id = %entry.desc.request_id, reason = why, "router failed a placement; asking another");
            } else if why == TIMED_OUT {
                return Err(QueueError::placement(RouteTimeout(ROUTE_TIMEOUT)));
            } else {
                // Another router may appear before the deadline.
                tracing::debug!(router = %session.router_id, reason = why, "router failed a placement; waiting for another");
            }
        }
    }
}

fn target_of(response: &router_pb::RouteResponse) -> Result<Target, QueueError> {
    response
        .target
        .clone()
        .map(Target::from)
        .ok_or_else(|| QueueError::placement(MissingTarget))
}

/// The router answered `Route` without a target.
#[derive(Debug, thiserror::Error)]
#[error("router response has no target")]
struct MissingTarget;

/// The router's predicted time to first token on the worker it chose.
fn routed_ttft(response: &router_pb::RouteResponse) -> Option<Duration> {
    let chosen = response.target.as_ref()?;
    let ms = response
        .candidates
        .iter()
        .find(|c| {
            c.target
                .as_ref()
                .is_some_and(|t| t.worker_id == chosen.worker_id && t.dp_rank == chosen.dp_rank)
        })?
        .predicted_ttft_ms?;
    Duration::try_from_secs_f64(ms / 1e3).ok()
}

fn overlap_tokens(entry: &Entry, response: &router_pb::RouteResponse) -> u32 {
    response
        .overlap_blocks
        .saturating_mul(entry.desc.block_size)
        .min(entry.desc.prompt_tokens)
}

impl Placer for RouterPlacer {
    async fn place(&self, entry: &Entry) -> Result<Placed, QueueError> {
        let mut pools = vec![router_pb::Pool::Decode];
        if self.has_prefill_pool(&entry.desc.model) {
            pools.push(router_pb::Pool::Prefill);
        }
        let id = self.routers.next_id();
        let (origin, answers) = match self.route(entry, &pools, Some(id)).await {
            Ok(r) => r,
            Err(e) => {
                // One pool may have been placed before another failed.
                self.routers.inner.abandon(id);
                return Err(e);
            }
        };
        let placements: Vec<router_pb::Placement> =
            answers.iter().filter_map(|a| a.placement.clone()).collect();
        // Counted at `origin` from its answer: held from now on, so the
        // lease (or a failure below) releases it everywhere.
        self.routers.inner.hold(id, placements, &origin);
        let lease = RouterLease {
            inner: Arc::clone(&self.routers.inner),
            id,
        };
        let decode = answers
            .first()
            .ok_or_else(|| QueueError::placement(MissingTarget))?;
        let prefill = match answers.get(1) {
            Some(a) => Some(target_of(a)?),
            None => None,
        };
        Ok(Placed {
            placement: Placement {
                worker: target_of(decode)?,
                prefill,
                overlap_tokens: overlap_tokens(entry, decode),
                routed_ttft: routed_ttft(decode),
                routed_within_target: decode.predicted_within_target,
                prefix_source: decode.prefix_source.as_ref().map(|s| {
                    (
                        sluice_runtime::discovery::WorkerRank::new(s.worker_id.clone(), s.dp_rank),
                        s.blocks,
                    )
                }),
            },
            lease: Some(Box::new(lease)),
        })
    }

    async fn overlap(&self, entry: &Entry) -> Result<u32, QueueError> {
        let (_, answers) = self.route(entry, &[router_pb::Pool::Decode], None).await?;
        let answer = answers
            .first()
            .ok_or_else(|| QueueError::placement(MissingTarget))?;
        Ok(overlap_tokens(entry, answer))
    }

    fn report_held(&self, held: HeldByModel) {
        self.routers
            .inner
            .report_unplaced(crate::convert::held_report(&held));
    }
}

/// Feeds the router's load views into `queue` (and the placer's prefill
/// pools) until `shutdown`, re-subscribing after failures. While no router
/// answers, the queue gets an empty view: nothing is held on stale figures.
pub(crate) async fn watch_load(
    queue: Queue,
    routers: Routers,
    placer: RouterPlacer,
    shutdown: CancellationToken,
) {
    let mut warned = false;
    while !shutdown.is_cancelled() {
        if let Some(session) = routers.pick(&HashSet::new()) {
            let mut client = session.client();
            let request = router_pb::WatchLoadRequest {
                model: String::new(),
                client_id: routers.inner.client_id.clone(),
            };
            match client.watch_load(request).await {
                Ok(response) => {
                    warned = false;
                    let mut stream = response.into_inner();
                    loop {
                        let message = tokio::select! {
                            () = shutdown.cancelled() => return,
                            message = stream.message() => message,
                        };
                        match message {
                            Ok(Some(view)) => {
                                let view = LoadView::from(view);
                                placer.note_load(&view);
                                queue.update_load(view);
                            }
                            Ok(None) => break,
                            Err(status) => {
                                tracing::warn!(code = ?status.code(), message = status.message(), "router load stream failed");
                                break;
                            }
                        }
                    }
                }
                Err(status) if !warned => {
                    warned = true;
                    tracing::warn!(code = ?status.code(), message = status.message(), "cannot watch router load; retrying");
                }
                Err(_) => {}
            }
            queue.update_load(LoadView::default());
        }
        let changed = routers.inner.changed.notified();
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(RETRY) => {}
            () = changed => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn candidate(worker: &str, predicted_ttft_ms: Option<f64>) -> router_pb::Candidate {
        router_pb::Candidate {
            target: Some(router_pb::Target {
                worker_id: worker.into(),
                ..Default::default()
            }),
            predicted_ttft_ms,
            ..Default::default()
        }
    }

    #[test]
    fn the_router_is_told_what_is_left_of_the_ttft_target() {
        let entry = |target_ms| Entry {
            desc: sluice_runtime::RequestDescription {
                ttft_target_ms: target_ms,
                ..Default::default()
            },
            overlap_tokens: 0,
            arrival: tokio::time::Instant::now() - Duration::from_millis(300),
            deadline: None,
            span: tracing::Span::none(),
        };
        let left = |target_ms| {
            RouterPlacer::request(&entry(target_ms), router_pb::Pool::Decode, None)
                .description
                .map(|d| d.ttft_target_ms)
        };
        let ms = left(1_000).expect("a description");
        assert!((600..=700).contains(&ms), "{ms}");
        assert_eq!(left(100), Some(1), "past its target: 1 ms, still a target");
        assert_eq!(left(0), Some(0), "no target stays none");
    }

    #[test]
    fn the_routed_ttft_is_the_chosen_candidates_prediction() {
        let mut response = router_pb::RouteResponse {
            target: Some(router_pb::Target {
                worker_id: "w1".into(),
                ..Default::default()
            }),
            candidates: vec![candidate("w0", Some(900.0)), candidate("w1", Some(250.0))],
            ..Default::default()
        };
        assert_eq!(routed_ttft(&response), Some(Duration::from_millis(250)));
        // A worker that had measured nothing: no prediction to pass on.
        response.candidates[1].predicted_ttft_ms = None;
        assert_eq!(routed_ttft(&response), None);
    }
}
