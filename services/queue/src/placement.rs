//! The router side of the queue: which router to call ([`Routers`]: a fixed
//! `--router-endpoint` or every `router` instance in discovery, in turn), the
//! [`Placer`] that asks it for a placement, and the task that feeds the
//! router's `WatchLoad` figures into the queue.
//!
//! The router never sees held requests: it is called once per release (and,
//! under `wspt`, for dry-run overlap reads).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use sluice_proto::router::v1 as router_pb;
use sluice_proto::router::v1::router_client::RouterClient;
use sluice_runtime::grpc::{TracedChannel, channel};
use sluice_runtime::{Discovery, DiscoveryEvent};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::QueueError;
use crate::queue::{Entry, LoadView, Placement, Placer, Queue, Target, WorkerRole};

/// Discovery component name routers register under.
pub(crate) const ROUTER_COMPONENT: &str = "router";

/// Pause before re-subscribing to a router's load after a failure.
const RETRY: Duration = Duration::from_millis(500);

/// Longest wait for one `Route` answer. Under a threshold a model's releases
/// wait for the previous placement, so a hung router must not stall them.
const ROUTE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long placement waits for a router to appear before failing with
/// `no_router` (start-up order, router restarts).
const ROUTER_WAIT: Duration = Duration::from_secs(3);

type Client = RouterClient<TracedChannel>;

/// The routers to call, round robin.
#[derive(Debug, Clone)]
pub(crate) struct Routers {
    inner: Arc<RoutersInner>,
}

#[derive(Debug)]
struct RoutersInner {
    /// Instance id → client (a fixed endpoint is keyed by itself).
    clients: Mutex<BTreeMap<String, Client>>,
    next: AtomicUsize,
    changed: Notify,
}

impl Routers {
    fn empty() -> Self {
        Self {
            inner: Arc::new(RoutersInner {
                clients: Mutex::new(BTreeMap::new()),
                next: AtomicUsize::new(0),
                changed: Notify::new(),
            }),
        }
    }

    /// Always `endpoint`.
    pub(crate) fn fixed(endpoint: &str) -> Result<Self, QueueError> {
        let routers = Self::empty();
        let client = RouterClient::new(channel(endpoint)?);
        routers
            .inner
            .clients
            .lock()
            .insert(endpoint.to_owned(), client);
        Ok(routers)
    }

    /// Every `router` instance in discovery, kept current by a task on
    /// `tracker` until `shutdown`.
    pub(crate) async fn discovered(
        discovery: &Arc<dyn Discovery>,
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> Result<Self, QueueError> {
        let routers = Self::empty();
        let mut watch = discovery.watch(ROUTER_COMPONENT).await?;
        let inner = Arc::clone(&routers.inner);
        tracker.spawn(async move {
            loop {
                let event = tokio::select! {
                    () = shutdown.cancelled() => return,
                    event = watch.next() => event,
                };
                match event {
                    Some(DiscoveryEvent::Put(instance)) => match channel(&instance.endpoint) {
                        Ok(ch) => {
                            tracing::info!(id = %instance.id, endpoint = %instance.endpoint, "router found");
                            inner.clients.lock().insert(instance.id, RouterClient::new(ch));
                        }
                        Err(err) => {
                            tracing::warn!(id = %instance.id, endpoint = %instance.endpoint, error = %err, "unusable router endpoint");
                        }
                    },
                    Some(DiscoveryEvent::Delete { id, .. }) => {
                        tracing::info!(%id, "router left");
                        inner.clients.lock().remove(&id);
                    }
                    None => {
                        tracing::warn!("discovery watch of routers ended");
                        return;
                    }
                }
                inner.changed.notify_waiters();
            }
        });
        Ok(routers)
    }

    /// The next router, waiting up to `wait` for one to appear (a queue
    /// that starts before the router, or between router restarts, holds a
    /// request briefly instead of failing it).
    async fn pick_within(&self, wait: Duration) -> Option<Client> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the check: a router found in between still wakes us.
            let changed = self.inner.changed.notified();
            if let Some(c) = self.pick() {
                return Some(c);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.pick();
            }
        }
    }

    /// The next router, round robin; None when none is known.
    fn pick(&self) -> Option<Client> {
        let clients = self.inner.clients.lock();
        if clients.is_empty() {
            return None;
        }
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % clients.len();
        clients.values().nth(i).cloned()
    }
}

/// Places released requests with the router: a decode (or aggregated) worker,
/// then a prefill worker when the model has a prefill pool.
#[derive(Debug, Clone)]
pub(crate) struct RouterPlacer {
    routers: Routers,
    /// Models with prefill workers, from the latest load view ("" = any).
    prefill_models: Arc<Mutex<HashSet<String>>>,
}

impl RouterPlacer {
    pub(crate) fn new(routers: Routers) -> Self {
        Self {
            routers,
            prefill_models: Arc::default(),
        }
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

    async fn route(
        &self,
        entry: &Entry,
        pool: router_pb::Pool,
        commit: bool,
    ) -> Result<router_pb::RouteResponse, QueueError> {
        let mut client = self
            .routers
            .pick_within(ROUTER_WAIT)
            .await
            .ok_or(QueueError::NoRouter)?;
        let request = router_pb::RouteRequest {
            request_id: entry.request_id.clone(),
            model: entry.model.clone(),
            pool: pool as i32,
            prompt_tokens: entry.prompt_tokens,
            block_hashes: entry.block_hashes.to_vec(),
            block_size: entry.block_size,
            priority: entry.priority,
            commit,
            // Exclusions name decode workers (the ones that failed this request).
            exclude_worker_ids: if pool == router_pb::Pool::Decode {
                entry.exclude_worker_ids.to_vec()
            } else {
                Vec::new()
            },
        };
        let answer = tokio::time::timeout(ROUTE_TIMEOUT, client.route(request))
            .await
            .map_err(QueueError::placement)?;
        match answer {
            Ok(response) => Ok(response.into_inner()),
            Err(status) => Err(match status.code() {
                tonic::Code::Unavailable
                | tonic::Code::NotFound
                | tonic::Code::FailedPrecondition => {
                    tracing::debug!(model = %entry.model, ?pool, message = status.message(), "router has no worker");
                    QueueError::NoWorkers {
                        model: entry.model.clone(),
                    }
                }
                _ => QueueError::placement(status),
            }),
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

fn overlap_tokens(entry: &Entry, response: &router_pb::RouteResponse) -> u32 {
    response
        .overlap_blocks
        .saturating_mul(entry.block_size)
        .min(entry.prompt_tokens)
}

impl Placer for RouterPlacer {
    async fn place(&self, entry: &Entry) -> Result<Placement, QueueError> {
        let decode = self.route(entry, router_pb::Pool::Decode, true).await?;
        let prefill = if self.has_prefill_pool(&entry.model) {
            let response = self.route(entry, router_pb::Pool::Prefill, true).await?;
            Some(target_of(&response)?)
        } else {
            None
        };
        Ok(Placement {
            worker: target_of(&decode)?,
            prefill,
            overlap_tokens: overlap_tokens(entry, &decode),
        })
    }

    async fn overlap(&self, entry: &Entry) -> Result<u32, QueueError> {
        let response = self.route(entry, router_pb::Pool::Decode, false).await?;
        Ok(overlap_tokens(entry, &response))
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
        if let Some(mut client) = routers.pick() {
            let request = router_pb::WatchLoadRequest {
                model: String::new(),
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
