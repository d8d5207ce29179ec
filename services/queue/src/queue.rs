//! The admission queue: holds requests while every eligible worker is busy,
//! releases them in policy order, and counts granted leases until they end.
//!
//! No tonic types here. The service feeds it (`admit`, `update_load`) and
//! runs its dispatcher ([`Queue::run`]) with a [`Placer`] that asks the router
//! for a worker.
//!
//! # Model
//!
//! Every request is a [`Ticket`] with one slot in the queue. A slot is
//! *pending* while held, while its prefix overlap is re-read, and while it is
//! being placed; it is *active* from its grant until the ticket is dropped (the
//! lease ends). Each model has its own queue: its own release order, hold
//! decision and active count. Limits (`--max-pending`, per tenant, the
//! protected share) count pending slots across models.
//!
//! # Release order
//!
//! `(strict tier desc, policy key)`; see [`Policy`] for the keys. Under
//! `wfq` and `fair` held requests sit in *bands* released in strict order —
//! under `wfq` one band per strict tier, under `fair` one per (strict tier,
//! priority), highest first — and inside a band classes share by weight
//! through a virtual counter per class ([`fair`]: the class with the least
//! work served per weight goes next, FIFO within a class). `wfq`'s classes
//! are `--wfq-class` keys charged per request (`--wfq-cost requests`, the
//! default) or per token; `fair`'s are tenants charged per token. Tokens
//! are the prompt tokens not cached (charged at release as the whole
//! prompt, corrected when the placement reports the cached prefix) and the
//! output tokens, charged as the lease reports them ([`Ticket::progress`]).
//! **Bound** (unit cost): with `W` the weights of the backlogged classes of
//! the band summed, `n` their number, the `k`-th held request (0-based) of a
//! class of weight `w` is released within `k·W/w + n` releases of the band,
//! whatever the other classes' arrival rates. (Higher bands still go
//! first: the bound is within a band.)
//!
//! # Tenants
//!
//! A class's weight is `--wfq-weights`' for its key, else (for classes of
//! a tenant) the tenant's from `--tenant-limits`, else the one its
//! requests carry (the frontend's API key file), else
//! `--wfq-default-weight`. Tenants over a quota of `--tenant-limits` are
//! refused at admission ([`crate::tenants`]).
//!
//! # Holding
//!
//! With `--queue-threshold F`, a model's queue holds while every eligible
//! worker has `active_prefill_tokens > F × max_num_batched_tokens` (Dynamo's
//! rule). Eligible workers are the model's prefill workers when it has any
//! (they do the prefill work the threshold measures), otherwise its decode and
//! aggregated workers; a worker that reports `max_num_batched_tokens = 0`
//! counts as not busy, and a model with no known worker is not held (the
//! router then answers "no worker"). Releases under a threshold are serial
//! per model: the next request is released only after the previous placement
//! came back and its uncached prompt tokens were added to the chosen worker's
//! load, so one load snapshot cannot release a burst. The next `LoadView`
//! from the router replaces those local additions. Without a threshold
//! nothing is held and placements run concurrently. `--max-active` (per
//! model, 0 = none) holds further requests while that many leases are
//! granted or being placed.
//!
//! # Refusing
//!
//! Past `--max-pending` a request is refused (`QueueFull`), unless it
//! outranks a held request: then the held request of the lowest (strict
//! tier, priority), the newest of them, leaves with `Displaced` and the
//! newcomer takes its place, so a full queue sheds its lowest priorities
//! first. Every refusal for room (`QueueFull`, `TenantFull`, `Shed`,
//! `Displaced`) carries a retry-after: the time the backlog ahead takes to
//! drain at the rate grants were made over the last few seconds (a grant
//! count decayed with a 5 s time constant), 1 to 60 s, as gRPC
//! `retry-after` metadata, which the frontend turns into a 429 with
//! `Retry-After`.
//!
//! # Position updates
//!
//! A held request learns its 0-based position in its model's release order,
//! the number held and why. The head learns at once; the others are updated
//! in a full pass at most once per 100 ms per model (at once when the reason
//! changes), so a burst of releases costs each waiting client a few
//! messages, not one per release, and the dispatcher O(n) work per 100 ms
//! instead of per release. A newly held request's first update may lag by
//! up to that interval.
//!
//! # Prefix overlap
//!
//! Only `wspt` orders by the cached prefix (uncached prompt tokens), so only
//! `wspt` reads it: a newly held request gets a first estimate from the
//! placer (a dry-run route) without blocking releases, and a request at the
//! head whose estimate is older than `--refresh-interval-ms` is re-read (and
//! re-keyed) before it is released. Other policies leave the overlap to the
//! router, which computes it at placement anyway.
//!
//! # Invariants
//!
//! `pending` = slots held, refreshing or placing; `active` = slots granted
//! and not yet released; every slot is in exactly one phase; held and
//! refreshing slots are in their model's order, placing and active ones are
//! not; a slot whose ticket is dropped leaves at once and is never placed
//! afterwards.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt};
use parking_lot::Mutex;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::config::{Args, Policy, WfqClass, WfqCost};
use crate::error::QueueError;
use crate::metrics::QueueMetrics;
use crate::tenants::{Quotas, Replicas};

mod fair;

/// One request asking for admission.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The caller's request id (for logs and the router).
    pub request_id: String,
    /// The model; each model has its own queue. "" = any worker.
    pub model: String,
    /// Higher = more important; default 0.
    pub priority: i32,
    /// Strict tier; every request of a higher tier is released first.
    pub strict_tier: u32,
    /// Tenant for per-tenant limits, `wfq` classes and `fair` shares.
    pub tenant: String,
    /// The tenant's fair-share weight sent with the request (the API key
    /// file's); 0 = none.
    pub tenant_weight: u32,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens expected cached on the best worker (re-read after
    /// `--refresh-interval-ms` of holding).
    pub overlap_tokens: u32,
    /// Chained sequence block hashes of the prompt's full blocks.
    pub block_hashes: Arc<[u64]>,
    /// Block size the hashes were computed with.
    pub block_size: u32,
    /// Decode workers not to place on (a migrating request's failed ones).
    pub exclude_worker_ids: Arc<[String]>,
    /// When the queue received the request.
    pub arrival: Instant,
    /// Past this instant a held request fails with `DeadlineExceeded`.
    pub deadline: Option<Instant>,
    /// The request's span: placement and refresh calls to the router run
    /// inside it, so the router's spans join the request's trace.
    pub span: tracing::Span,
}

impl Entry {
    /// Prompt tokens not expected in cache.
    pub fn uncached_tokens(&self) -> u32 {
        self.prompt_tokens.saturating_sub(self.overlap_tokens)
    }
}

/// A worker instance as the router names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// Worker instance id.
    pub worker_id: String,
    /// Address to call `Generate` (or the prefill RPC) on.
    pub endpoint: String,
    /// Data-parallel rank inside the worker.
    pub dp_rank: u32,
}

/// Where a request runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Decode (or aggregated) worker.
    pub worker: Target,
    /// Prefill worker, when the model has a prefill pool.
    pub prefill: Option<Target>,
    /// Prompt tokens the router expects cached on `worker`.
    pub overlap_tokens: u32,
}

/// A granted request: its placement and how long it waited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The router's placement.
    pub placement: Placement,
    /// Time from arrival to grant.
    pub waited: Duration,
}

/// Why a model's queue is holding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// Every eligible worker is above `--queue-threshold`.
    AboveThreshold,
    /// `--max-active` leases are granted or being placed.
    ActiveLimit,
    /// An earlier request's placement is in flight (threshold mode releases
    /// one at a time per model).
    PlacementInFlight,
    /// The next request's prefix overlap is being re-read (`wspt`).
    RefreshingOverlap,
}

impl HoldReason {
    /// A short phrase for logs, traces and `Held.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AboveThreshold => "all workers above threshold",
            Self::ActiveLimit => "active leases at limit",
            Self::PlacementInFlight => "waiting for an earlier placement",
            Self::RefreshingOverlap => "re-reading the prefix overlap",
        }
    }
}

/// A held request's place in its model's queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldStatus {
    /// 0-based position in release order.
    pub position: u32,
    /// Requests held in the same model's queue.
    pub pending: u32,
    /// Why the queue holds.
    pub reason: HoldReason,
}

/// What a ticket reports next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TicketEvent {
    /// Held, or the position changed.
    Held(HeldStatus),
    /// Granted; the lease now lasts until the ticket is dropped.
    Granted(Grant),
}

/// A worker's role as the router reports it (the one its discovery entry
/// publishes).
pub use sluice_runtime::discovery::WorkerRole;

/// One worker rank's load, from the router's `WatchLoad`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerLoad {
    /// The worker instance and rank.
    pub target: Target,
    /// The model it serves.
    pub model: String,
    /// Its role.
    pub role: WorkerRole,
    /// Prefill tokens admitted but not yet computed.
    pub active_prefill_tokens: u64,
    /// The engine's per-step token budget; 0 = unknown.
    pub max_num_batched_tokens: u32,
}

/// Every worker's load; each view replaces the previous one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadView {
    /// One entry per worker rank.
    pub workers: Vec<WorkerLoad>,
}

/// A placement's life at the router, held by the queue for as long as the
/// request's lease lasts: dropping it tells the router the request ended
/// (its load stops counting).
pub trait PlacementLease: Send + Sync + std::fmt::Debug {
    /// The request produced its first token: its prefill work is done.
    fn started(&self);
}

/// A placement and the lease that ends it.
#[derive(Debug)]
pub struct Placed {
    /// Where the request runs.
    pub placement: Placement,
    /// Dropped when the request's lease ends; `None`: nothing to release.
    pub lease: Option<Box<dyn PlacementLease>>,
}

impl From<Placement> for Placed {
    fn from(placement: Placement) -> Self {
        Self {
            placement,
            lease: None,
        }
    }
}

/// Chooses a worker for a released request (the service asks the router).
pub trait Placer: Send + Sync + 'static {
    /// Places the request; the placement counts as load from now on, until
    /// the returned lease drops.
    fn place(&self, entry: &Entry) -> impl Future<Output = Result<Placed, QueueError>> + Send;

    /// Re-reads the prompt tokens cached on the best worker, without placing.
    fn overlap(&self, entry: &Entry) -> impl Future<Output = Result<u32, QueueError>> + Send;
}

/// Pending and active counts with the held requests grouped by tier.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QueueStats {
    /// Requests held, refreshing or being placed.
    pub pending: usize,
    /// Granted leases not yet released.
    pub active: usize,
    /// Pending requests by (strict tier, priority), highest first.
    pub tiers: Vec<TierStats>,
}

/// Pending requests of one (strict tier, priority).
#[derive(Debug, Clone, PartialEq)]
pub struct TierStats {
    /// Strict tier.
    pub strict_tier: u32,
    /// Priority.
    pub priority: i32,
    /// Requests pending.
    pub pending: usize,
    /// Their prompt tokens.
    pub pending_tokens: u64,
    /// The longest wait among them.
    pub oldest_wait: Duration,
}

/// The admission queue; cheap to clone (one shared state).
#[derive(Debug, Clone)]
pub struct Queue {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    cfg: Args,
    metrics: QueueMetrics,
    epoch: Instant,
    state: Mutex<State>,
    wake: Notify,
}

impl Queue {
    /// A queue with `cfg`'s policy and limits; nothing is released until
    /// [`Queue::run`] is running.
    pub fn new(cfg: Args, metrics: QueueMetrics) -> Self {
        let quotas = Quotas::new(cfg.tenant_limits.clone().unwrap_or_default());
        Self {
            shared: Arc::new(Shared {
                cfg,
                metrics,
                epoch: Instant::now(),
                state: Mutex::new(State {
                    quotas,
                    ..State::default()
                }),
                wake: Notify::new(),
            }),
        }
    }

    /// The configuration the queue runs with.
    pub fn config(&self) -> &Args {
        &self.shared.cfg
    }

    /// Admits `entry` or refuses it at once (`QueueFull`, `TenantFull`,
    /// `Shed`, `DeadlineExceeded`, `Draining`). Dropping the ticket cancels
    /// a held request or, once granted, releases its lease.
    pub fn admit(&self, mut entry: Entry) -> Result<Ticket, QueueError> {
        let shared = &self.shared;
        let cfg = &shared.cfg;
        entry.overlap_tokens = entry.overlap_tokens.min(entry.prompt_tokens);
        let now = Instant::now();
        let mut st = shared.state.lock();
        let mut checked = st.check_admission(cfg, &entry, now);
        if matches!(checked, Err(QueueError::QueueFull { .. }))
            && st.displace(cfg, shared.epoch, &entry, &shared.metrics, now)
        {
            checked = st.check_admission(cfg, &entry, now);
        }
        let refused =
            checked.and_then(|()| st.quotas.admit(&entry.tenant, entry.prompt_tokens, now));
        if let Err(err) = refused {
            drop(st);
            shared.metrics.rejected(&entry.tenant, err.reason());
            return Err(err);
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let (tx, rx) = watch::channel(TicketState::Waiting);
        let weight = st
            .quotas
            .weight(&entry.tenant)
            .unwrap_or(entry.tenant_weight);
        let model = st
            .models
            .entry(entry.model.clone())
            .or_insert_with(|| ModelQueue::new(cfg.queue_policy));
        model.order.insert(cfg, shared.epoch, seq, &entry, weight);
        if let Some(deadline) = entry.deadline {
            st.deadlines.insert((deadline, seq));
        }
        *st.tenants.entry(entry.tenant.clone()).or_default() += 1;
        st.pending += 1;
        shared
            .metrics
            .pending(entry.priority, entry.prompt_tokens, 1);
        st.slots.insert(
            seq,
            Slot {
                entry,
                phase: Phase::Held,
                tx,
                last_refresh: None,
                sent: None,
                lease: None,
                fair: None,
                weight,
                output: 0,
            },
        );
        st.unread.push(seq);
        drop(st);
        shared.wake.notify_one();
        Ok(Ticket {
            seq,
            rx,
            shared: Arc::clone(shared),
            last_held: None,
        })
    }

    /// Replaces the load view (the router's latest `LoadView`) and
    /// re-evaluates every model's hold decision.
    pub fn update_load(&self, view: LoadView) {
        let mut st = self.shared.state.lock();
        st.load = view
            .workers
            .into_iter()
            .map(|w| ((w.target.worker_id.clone(), w.target.dp_rank), w))
            .collect();
        drop(st);
        self.shared.wake.notify_one();
    }

    /// The number of queue replicas and this one's rank changed: every
    /// tenant's quota share is rescaled.
    pub fn set_replicas(&self, replicas: Replicas) {
        self.shared.state.lock().quotas.set_replicas(replicas);
    }

    /// Current pending and active counts and the pending requests by tier.
    pub fn stats(&self) -> QueueStats {
        let now = Instant::now();
        let st = self.shared.state.lock();
        let mut tiers: BTreeMap<(Reverse<u32>, Reverse<i32>), TierStats> = BTreeMap::new();
        for slot in st.slots.values().filter(|s| s.phase != Phase::Active) {
            let e = &slot.entry;
            let tier = tiers
                .entry((Reverse(e.strict_tier), Reverse(e.priority)))
                .or_insert_with(|| TierStats {
                    strict_tier: e.strict_tier,
                    priority: e.priority,
                    pending: 0,
                    pending_tokens: 0,
                    oldest_wait: Duration::ZERO,
                });
            tier.pending += 1;
            tier.pending_tokens += u64::from(e.prompt_tokens);
            tier.oldest_wait = tier
                .oldest_wait
                .max(now.saturating_duration_since(e.arrival));
        }
        QueueStats {
            pending: st.pending,
            active: st.active,
            tiers: tiers.into_values().collect(),
        }
    }

    /// The dispatcher: releases held requests in order while capacity allows,
    /// places them with `placer`, expires deadlines and publishes positions.
    /// Returns once `shutdown` is cancelled, after failing every request not
    /// yet granted with `Draining`; granted leases stay valid.
    pub async fn run<P: Placer>(&self, placer: P, shutdown: CancellationToken) {
        let shared = &self.shared;
        let placer = Arc::new(placer);
        let mut ops: FuturesUnordered<BoxFuture<'static, Outcome>> = FuturesUnordered::new();
        loop {
            let (started, next_deadline) = {
                let now = Instant::now();
                let mut st = shared.state.lock();
                st.expire(&shared.cfg, shared.epoch, now, &shared.metrics);
                let started = st.release(&shared.cfg, now);
                let next_publish = st.publish_positions(now);
                st.models.retain(|_, m| !m.is_idle());
                let next_deadline = st.deadlines.first().map(|&(d, _)| d);
                // Wake for whichever comes first: a deadline or a held-back update.
                let wake_at = match (next_deadline, next_publish) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                (started, wake_at)
            };
            for op in started {
                ops.push(op.start(Arc::clone(&placer)));
            }
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                Some(outcome) = ops.next(), if !ops.is_empty() => {
                    let now = Instant::now();
                    let mut st = shared.state.lock();
                    st.complete(outcome, &shared.cfg, shared.epoch, &shared.metrics, now);
                }
                () = shared.wake.notified() => {}
                () = tokio::time::sleep_until(next_deadline.unwrap_or_else(Instant::now)),
                    if next_deadline.is_some() => {}
            }
        }
        let mut st = shared.state.lock();
        st.drain(&shared.metrics);
    }
}

/// Least time between two position updates to one held request (the first,
/// a changed reason and reaching the head are sent at once).
pub(crate) const POSITION_INTERVAL: Duration = Duration::from_millis(100);

/// A request's place in the queue and, once granted, its lease.
///
/// Dropping it cancels a request not yet granted (it leaves the queue at
/// once and is never placed) or releases a granted lease's slot.
#[derive(Debug)]
pub struct Ticket {
    seq: u64,
    rx: watch::Receiver<TicketState>,
    shared: Arc<Shared>,
    last_held: Option<HeldStatus>,
}

impl Ticket {
    /// Waits for the next event: a new held status, or the grant. After the
    /// grant or an error it returns the same outcome again.
    pub async fn next(&mut self) -> Result<TicketEvent, QueueError> {
        loop {
            let state = self.rx.borrow_and_update().clone();
            match state {
                TicketState::Granted(grant) => return Ok(TicketEvent::Granted(grant)),
                TicketState::Failed(err) => return Err(err),
                TicketState::Held(status) if self.last_held.as_ref() != Some(&status) => {
                    self.last_held = Some(status.clone());
                    return Ok(TicketEvent::Held(status));
                }
                TicketState::Held(_) | TicketState::Waiting => {}
            }
            if self.rx.changed().await.is_err() {
                // The queue dropped the slot without a verdict: it is gone.
                return Err(QueueError::Draining);
            }
        }
    }

    /// Waits for the grant, skipping held updates.
    pub async fn granted(&mut self) -> Result<Grant, QueueError> {
        loop {
            if let TicketEvent::Granted(grant) = self.next().await? {
                return Ok(grant);
            }
        }
    }

    /// Tells the router, through the placement's lease, that the granted
    /// request produced its first token. No-op before the grant.
    pub fn started(&self) {
        let st = self.shared.state.lock();
        if let Some(lease) = st.slots.get(&self.seq).and_then(|s| s.lease.as_ref()) {
            lease.started();
        }
    }

    /// The granted request has produced `completion_tokens` output tokens
    /// in all (a running total): the new ones are charged to its tenant's
    /// fair-share counter and token quota. No-op before the grant.
    pub fn progress(&self, completion_tokens: u32) {
        let shared = &self.shared;
        let mut st = shared.state.lock();
        st.progress(
            self.seq,
            completion_tokens,
            &shared.cfg,
            &shared.metrics,
            Instant::now(),
        );
    }

    /// The latest held status, if the request has been held.
    pub fn held(&self) -> Option<HeldStatus> {
        match &*self.rx.borrow() {
            TicketState::Held(status) => Some(status.clone()),
            _ => None,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let shared = &self.shared;
        let mut st = shared.state.lock();
        st.leave(self.seq, &shared.cfg, shared.epoch, &shared.metrics);
        drop(st);
        shared.wake.notify_one();
    }
}

#[derive(Debug, Clone)]
enum TicketState {
    Waiting,
    Held(HeldStatus),
    Granted(Grant),
    Failed(QueueError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Held,
    Refreshing,
    Placing,
    Active,
}

#[derive(Debug)]
struct Slot {
    entry: Entry,
    phase: Phase,
    tx: watch::Sender<TicketState>,
    /// When the overlap was last read (None: never; `wspt` only).
    last_refresh: Option<Instant>,
    sent: Option<HeldStatus>,
    /// The granted placement's lease: the slot's removal (the lease ended)
    /// drops it, which tells the router.
    lease: Option<Box<dyn PlacementLease>>,
    /// Under `wfq`/`fair`, once released: its band, class and the cost
    /// charged at release.
    fair: Option<Released>,
    /// The weight of its tenant from `--tenant-limits` or the request.
    weight: u32,
    /// Output tokens charged so far.
    output: u32,
}

/// Where a released request's work is charged under `wfq`/`fair`.
#[derive(Debug, Clone)]
struct Released {
    band: BandKey,
    class: Arc<str>,
    /// The cost charged at release (refunded if it never runs).
    charged: f64,
}

#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    slots: HashMap<u64, Slot>,
    models: HashMap<String, ModelQueue>,
    tenants: HashMap<String, usize>,
    pending: usize,
    active: usize,
    deadlines: BTreeSet<(Instant, u64)>,
    /// Admitted since the last pass; `wspt` reads their overlap if held.
    unread: Vec<u64>,
    load: HashMap<(String, u32), WorkerLoad>,
    draining: bool,
    /// Tenants' quotas and what they used.
    quotas: Quotas,
    /// How fast grants drain the backlog.
    drained: DrainRate,
}

/// Time constant of [`DrainRate`], in seconds.
const DRAIN_TAU: f64 = 5.0;

/// Grants per second over the last few seconds: a count of grants decayed
/// with time constant [`DRAIN_TAU`], divided by it.
#[derive(Debug, Default)]
struct DrainRate {
    count: f64,
    at: Option<Instant>,
}

impl DrainRate {
    fn decayed(&self, now: Instant) -> f64 {
        self.at.map_or(0.0, |at| {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            self.count * (-dt / DRAIN_TAU).exp()
        })
    }

    fn grant(&mut self, now: Instant) {
        self.count = self.decayed(now) + 1.0;
        self.at = Some(now);
    }

    /// Whole seconds until `ahead` requests and this one drain at the
    /// current rate: 1 to 60, 1 when nothing was granted yet.
    fn retry_after(&self, ahead: usize, now: Instant) -> Duration {
        let rate = self.decayed(now) / DRAIN_TAU;
        let secs = if rate > 0.0 {
            ((ahead as f64 + 1.0) / rate).ceil()
        } else {
            1.0
        };
        Duration::from_secs(secs.clamp(1.0, 60.0) as u64)
    }
}

/// Work the dispatcher starts outside the lock.
enum Op {
    Place(u64, Entry),
    Refresh(u64, Entry),
}

enum Outcome {
    Placed {
        seq: u64,
        model: String,
        result: Result<Placed, QueueError>,
    },
    Refreshed {
        seq: u64,
        model: String,
        result: Result<u32, QueueError>,
    },
}

impl Op {
    fn start<P: Placer>(self, placer: Arc<P>) -> BoxFuture<'static, Outcome> {
        match self {
            Op::Place(seq, entry) => Box::pin(async move {
                let span = entry.span.clone();
                let result = tracing::Instrument::instrument(placer.place(&entry), span).await;
                Outcome::Placed {
                    seq,
                    model: entry.model,
                    result,
                }
            }),
            Op::Refresh(seq, entry) => Box::pin(async move {
                let span = entry.span.clone();
                let result = tracing::Instrument::instrument(placer.overlap(&entry), span).await;
                Outcome::Refreshed {
                    seq,
                    model: entry.model,
                    result,
                }
            }),
        }
    }
}

impl State {
    fn check_admission(&self, cfg: &Args, entry: &Entry, now: Instant) -> Result<(), QueueError> {
        if self.draining {
            return Err(QueueError::Draining);
        }
        let retry_after = self.drained.retry_after(self.pending, now);
        if self.pending >= cfg.max_pending {
            return Err(QueueError::QueueFull {
                pending: self.pending,
                limit: cfg.max_pending,
                retry_after,
            });
        }
        let reserved = cfg.reserved_slots();
        if entry.priority <= cfg.shed_protect_priority
            && reserved > 0
            && self.pending >= cfg.max_pending - reserved
        {
            return Err(QueueError::Shed {
                retry_after,
                priority: entry.priority,
                pending: self.pending,
                reserved,
                limit: cfg.max_pending,
                protect: cfg.shed_protect_priority,
            });
        }
        let tenant_pending = self.tenants.get(&entry.tenant).copied().unwrap_or(0);
        if tenant_pending >= cfg.max_pending_per_tenant {
            return Err(QueueError::TenantFull {
                tenant: entry.tenant.clone(),
                pending: tenant_pending,
                limit: cfg.max_pending_per_tenant,
                retry_after: self.drained.retry_after(tenant_pending, now),
            });
        }
        if let Some(deadline) = entry.deadline
            && deadline <= now
        {
            return Err(QueueError::DeadlineExceeded {
                waited: now.saturating_duration_since(entry.arrival),
            });
        }
        Ok(())
    }

    /// Releases, per model, as many held requests as the hold rule allows.
    fn release(&mut self, cfg: &Args, now: Instant) -> Vec<Op> {
        let mut ops = Vec::new();
        if self.draining {
            return ops;
        }
        let refresh_after = cfg.refresh_interval();
        for (model_name, model) in &mut self.models {
            model.hold = None;
            while let Some(seq) = model.order.head() {
                if let Some(reason) = hold_reason(cfg, model, model_name, &self.load) {
                    model.hold = Some(reason);
                    break;
                }
                let Some(slot) = self.slots.get_mut(&seq) else {
                    // Unreachable by the invariants; drop the stray id.
                    tracing::error!(seq, "held id without a slot");
                    if let Some((_, Some(released))) = model.order.pop_head() {
                        model.order.finish(&released);
                    }
                    continue;
                };
                if slot.phase == Phase::Refreshing {
                    model.hold = Some(HoldReason::RefreshingOverlap);
                    break;
                }
                let stale = slot
                    .last_refresh
                    .is_some_and(|at| now.saturating_duration_since(at) >= refresh_after);
                if cfg.queue_policy == Policy::Wspt && stale {
                    // Stays in the order (and blocks this model's releases)
                    // until the fresh overlap is back.
                    slot.phase = Phase::Refreshing;
                    model.refreshing += 1;
                    ops.push(Op::Refresh(seq, slot.entry.clone()));
                    continue;
                }
                if let Some((_, released)) = model.order.pop_head() {
                    slot.fair = released;
                }
                if let Some(deadline) = slot.entry.deadline {
                    self.deadlines.remove(&(deadline, seq));
                }
                slot.phase = Phase::Placing;
                model.placing += 1;
                ops.push(Op::Place(seq, slot.entry.clone()));
            }
        }
        // Under wspt the overlap orders held requests: read a first estimate
        // for each newly held one, without blocking releases.
        for seq in std::mem::take(&mut self.unread) {
            if cfg.queue_policy != Policy::Wspt {
                break;
            }
            let Some(slot) = self.slots.get_mut(&seq) else {
                continue;
            };
            if slot.phase != Phase::Held || slot.last_refresh.is_some() {
                continue;
            }
            if let Some(model) = self.models.get_mut(&slot.entry.model) {
                slot.phase = Phase::Refreshing;
                model.refreshing += 1;
                ops.push(Op::Refresh(seq, slot.entry.clone()));
            }
        }
        ops
    }

    /// Sends held requests their status when it changed: the head at once,
    /// everyone else in a full pass at most once per [`POSITION_INTERVAL`]
    /// per model (at once when the reason changed). Returns when a
    /// held-back pass falls due.
    fn publish_positions(&mut self, now: Instant) -> Option<Instant> {
        let mut due_next: Option<Instant> = None;
        for model in self.models.values_mut() {
            let Some(reason) = model.hold else {
                model.published = None;
                continue;
            };
            let pending = u32::try_from(model.order.len()).unwrap_or(u32::MAX);
            let full_due = match model.published {
                Some((at, published)) if published == reason && now < at + POSITION_INTERVAL => {
                    let due = at + POSITION_INTERVAL;
                    due_next = Some(due_next.map_or(due, |d| d.min(due)));
                    false
                }
                _ => true,
            };
            let order = if full_due {
                model.published = Some((now, reason));
                model.order.sequence()
            } else {
                model.order.head().into_iter().collect()
            };
            for (position, seq) in order.into_iter().enumerate() {
                let Some(slot) = self.slots.get_mut(&seq) else {
                    continue;
                };
                let status = HeldStatus {
                    position: u32::try_from(position).unwrap_or(u32::MAX),
                    pending,
                    reason,
                };
                if slot.sent.as_ref() != Some(&status) {
                    slot.tx.send_replace(TicketState::Held(status.clone()));
                    slot.sent = Some(status);
                }
            }
        }
        due_next
    }

    /// Fails held requests whose deadline passed.
    fn expire(&mut self, cfg: &Args, epoch: Instant, now: Instant, metrics: &QueueMetrics) {
        while let Some(&(deadline, seq)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(slot) = self.slots.remove(&seq) else {
                continue;
            };
            if let Some(model) = self.models.get_mut(&slot.entry.model) {
                model.order.remove(cfg, epoch, seq, &slot.entry);
            }
            self.forget_pending(&slot.entry, metrics);
            self.retire(&slot, false, now);
            metrics.expired(&slot.entry.tenant);
            slot.tx
                .send_replace(TicketState::Failed(QueueError::DeadlineExceeded {
                    waited: now.saturating_duration_since(slot.entry.arrival),
                }));
        }
    }

    /// Applies a placement's or refresh's result.
    fn complete(
        &mut self,
        outcome: Outcome,
        cfg: &Args,
        epoch: Instant,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        match outcome {
            Outcome::Refreshed { seq, model, result } => {
                let Some(queue) = self.models.get_mut(&model) else {
                    return;
                };
                queue.refreshing -= 1;
                let Some(slot) = self.slots.get_mut(&seq) else {
                    return; // cancelled while refreshing
                };
                if slot.phase != Phase::Refreshing {
                    return;
                }
                match result {
                    Ok(overlap) => {
                        // Re-key: under wspt the overlap moves the request.
                        queue.order.remove(cfg, epoch, seq, &slot.entry);
                        slot.entry.overlap_tokens = overlap.min(slot.entry.prompt_tokens);
                        queue
                            .order
                            .insert(cfg, epoch, seq, &slot.entry, slot.weight);
                    }
                    Err(err) => {
                        tracing::debug!(request_id = %slot.entry.request_id, error = %err, "overlap refresh failed; keeping the old estimate");
                    }
                }
                slot.last_refresh = Some(now);
                slot.phase = Phase::Held;
            }
            Outcome::Placed { seq, model, result } => {
                let Some(queue) = self.models.get_mut(&model) else {
                    return;
                };
                queue.placing -= 1;
                let Some(slot) = self.slots.get(&seq) else {
                    tracing::debug!(seq, "request cancelled during placement");
                    return;
                };
                match result {
                    Ok(Placed { placement, lease }) => {
                        queue.active += 1;
                        self.active += 1;
                        let entry = slot.entry.clone();
                        let released = slot.fair.clone();
                        self.forget_pending(&entry, metrics);
                        let uncached = entry.prompt_tokens.saturating_sub(placement.overlap_tokens);
                        // The prompt was charged as uncached (less any
                        // overlap read before release); the placement
                        // knows the cached prefix now.
                        let cached = f64::from(placement.overlap_tokens.min(entry.prompt_tokens))
                            - f64::from(entry.overlap_tokens);
                        if let Some(released) = &released
                            && tokens_cost(cfg)
                            && let Some(queue) = self.models.get_mut(&model)
                        {
                            queue.order.charge(released, -cached);
                        }
                        self.quotas.charge(
                            &entry.tenant,
                            -f64::from(placement.overlap_tokens.min(entry.prompt_tokens)),
                            now,
                        );
                        let busy = placement.prefill.as_ref().unwrap_or(&placement.worker);
                        if let Some(load) =
                            self.load.get_mut(&(busy.worker_id.clone(), busy.dp_rank))
                        {
                            load.active_prefill_tokens += u64::from(uncached);
                        }
                        let waited = now.saturating_duration_since(entry.arrival);
                        self.drained.grant(now);
                        metrics.served(&entry.tenant, "prompt", u64::from(uncached));
                        metrics.granted(entry.priority, &entry.tenant, waited.as_secs_f64());
                        tracing::debug!(
                            request_id = %entry.request_id,
                            priority = entry.priority,
                            worker_id = %placement.worker.worker_id,
                            waited_ms = waited.as_secs_f64() * 1000.0,
                            "granted"
                        );
                        if let Some(slot) = self.slots.get_mut(&seq) {
                            slot.phase = Phase::Active;
                            slot.lease = lease;
                            slot.tx
                                .send_replace(TicketState::Granted(Grant { placement, waited }));
                        }
                    }
                    Err(err) => {
                        if let Some(slot) = self.slots.remove(&seq) {
                            tracing::debug!(request_id = %slot.entry.request_id, error = %err, "placement failed");
                            self.forget_pending(&slot.entry, metrics);
                            self.retire(&slot, false, now);
                            metrics.rejected(&slot.entry.tenant, err.reason());
                            slot.tx.send_replace(TicketState::Failed(err));
                        }
                    }
                }
            }
        }
    }

    /// The ticket was dropped: leave at once, or end the lease.
    fn leave(&mut self, seq: u64, cfg: &Args, epoch: Instant, metrics: &QueueMetrics) {
        let Some(slot) = self.slots.remove(&seq) else {
            return;
        };
        self.retire(&slot, slot.phase == Phase::Active, Instant::now());
        match slot.phase {
            Phase::Held | Phase::Refreshing => {
                if let Some(model) = self.models.get_mut(&slot.entry.model) {
                    model.order.remove(cfg, epoch, seq, &slot.entry);
                }
                if let Some(deadline) = slot.entry.deadline {
                    self.deadlines.remove(&(deadline, seq));
                }
                self.forget_pending(&slot.entry, metrics);
                metrics.cancelled();
            }
            Phase::Placing => {
                self.forget_pending(&slot.entry, metrics);
                metrics.cancelled();
            }
            Phase::Active => {
                self.active -= 1;
                if let Some(model) = self.models.get_mut(&slot.entry.model) {
                    model.active -= 1;
                }
                metrics.released();
            }
        }
    }

    /// Fails every request not yet granted; admits nothing more.
    fn drain(&mut self, metrics: &QueueMetrics) {
        self.draining = true;
        let waiting: Vec<u64> = self
            .slots
            .iter()
            .filter(|(_, s)| s.phase != Phase::Active)
            .map(|(&seq, _)| seq)
            .collect();
        for model in self.models.values_mut() {
            model.order.clear();
        }
        for seq in waiting {
            if let Some(slot) = self.slots.remove(&seq) {
                self.forget_pending(&slot.entry, metrics);
                self.retire(&slot, false, Instant::now());
                metrics.rejected(&slot.entry.tenant, QueueError::Draining.reason());
                slot.tx
                    .send_replace(TicketState::Failed(QueueError::Draining));
            }
        }
        self.deadlines.clear();
    }

    /// The queue is full and `entry` outranks a held request: the held
    /// request of the lowest (strict tier, priority), the newest of them,
    /// leaves with [`QueueError::Displaced`] and a retry-after from the
    /// drain rate, making room. Whether one left.
    fn displace(
        &mut self,
        cfg: &Args,
        epoch: Instant,
        entry: &Entry,
        metrics: &QueueMetrics,
        now: Instant,
    ) -> bool {
        let rank = |e: &Entry| (e.strict_tier, e.priority);
        let victim = self
            .slots
            .iter()
            .filter(|(_, s)| s.phase == Phase::Held && rank(&s.entry) < rank(entry))
            .min_by_key(|&(&seq, s)| (rank(&s.entry), Reverse(seq)))
            .map(|(&seq, _)| seq);
        let Some(slot) = victim.and_then(|seq| self.slots.remove(&seq).map(|s| (seq, s))) else {
            return false;
        };
        let (seq, slot) = slot;
        self.retire(&slot, false, now);
        if let Some(model) = self.models.get_mut(&slot.entry.model) {
            model.order.remove(cfg, epoch, seq, &slot.entry);
        }
        if let Some(deadline) = slot.entry.deadline {
            self.deadlines.remove(&(deadline, seq));
        }
        self.forget_pending(&slot.entry, metrics);
        let err = QueueError::Displaced {
            priority: slot.entry.priority,
            by: entry.priority,
            retry_after: self.drained.retry_after(self.pending, now),
        };
        tracing::debug!(request_id = %slot.entry.request_id, by = %entry.request_id, "displaced from the full queue");
        metrics.rejected(&slot.entry.tenant, err.reason());
        slot.tx.send_replace(TicketState::Failed(err));
        true
    }

    /// A slot left the queue: its tenant's quota gets its in-flight count
    /// back, and, when it never ran (`granted` false), the prompt it was
    /// charged; a released request stops counting as running in its band
    /// (refunding its release cost when it never ran).
    fn retire(&mut self, slot: &Slot, granted: bool, now: Instant) {
        let entry = &slot.entry;
        if !granted {
            // Admission charged the whole prompt.
            self.quotas
                .charge(&entry.tenant, -f64::from(entry.prompt_tokens), now);
        }
        self.quotas.release(&entry.tenant, now);
        if let Some(released) = &slot.fair
            && let Some(model) = self.models.get_mut(&entry.model)
        {
            if !granted {
                model.order.charge(released, -released.charged);
            }
            model.order.finish(released);
        }
    }

    /// Charges the output tokens a granted request produced since the last
    /// report.
    fn progress(
        &mut self,
        seq: u64,
        completion_tokens: u32,
        cfg: &Args,
        metrics: &QueueMetrics,
        now: Instant,
    ) {
        let Some(slot) = self.slots.get_mut(&seq) else {
            return;
        };
        if slot.phase != Phase::Active || completion_tokens <= slot.output {
            return;
        }
        let new = f64::from(completion_tokens - slot.output);
        slot.output = completion_tokens;
        let tenant = slot.entry.tenant.clone();
        if let Some(released) = slot.fair.clone()
            && tokens_cost(cfg)
            && let Some(model) = self.models.get_mut(&slot.entry.model)
        {
            model.order.charge(&released, new);
        }
        self.quotas.charge(&tenant, new, now);
        metrics.served(&tenant, "output", new as u64);
    }

    fn forget_pending(&mut self, entry: &Entry, metrics: &QueueMetrics) {
        self.pending -= 1;
        if let Some(count) = self.tenants.get_mut(&entry.tenant) {
            *count -= 1;
            if *count == 0 {
                self.tenants.remove(&entry.tenant);
            }
        }
        metrics.pending(entry.priority, entry.prompt_tokens, -1);
    }
}

fn hold_reason(
    cfg: &Args,
    model: &ModelQueue,
    model_name: &str,
    load: &HashMap<(String, u32), WorkerLoad>,
) -> Option<HoldReason> {
    if cfg.max_active > 0 && model.active + model.placing >= cfg.max_active {
        return Some(HoldReason::ActiveLimit);
    }
    let threshold = cfg.queue_threshold?;
    if all_busy(model_name, load, threshold) {
        return Some(HoldReason::AboveThreshold);
    }
    // Serial under a threshold: the next release waits for this one's load.
    (model.placing > 0).then_some(HoldReason::PlacementInFlight)
}

/// Dynamo's rule: busy when every eligible worker is above the threshold.
fn all_busy(model: &str, load: &HashMap<(String, u32), WorkerLoad>, threshold: f64) -> bool {
    let serves = |w: &&WorkerLoad| model.is_empty() || w.model.is_empty() || w.model == model;
    let has_prefill = load
        .values()
        .filter(serves)
        .any(|w| w.role == WorkerRole::Prefill);
    let mut eligible = load
        .values()
        .filter(serves)
        .filter(|w| (w.role == WorkerRole::Prefill) == has_prefill)
        .peekable();
    if eligible.peek().is_none() {
        return false;
    }
    eligible.all(|w| {
        w.max_num_batched_tokens > 0
            && w.active_prefill_tokens as f64 > threshold * f64::from(w.max_num_batched_tokens)
    })
}

#[derive(Debug)]
struct ModelQueue {
    order: Order,
    placing: usize,
    refreshing: usize,
    active: usize,
    hold: Option<HoldReason>,
    /// When positions were last sent in full, and with which reason.
    published: Option<(Instant, HoldReason)>,
}

impl ModelQueue {
    fn new(policy: Policy) -> Self {
        Self {
            order: match policy {
                Policy::Wfq | Policy::Fair => Order::Fair(BTreeMap::new()),
                Policy::Fcfs | Policy::Wspt | Policy::Strict => Order::Keyed(BTreeMap::new()),
            },
            placing: 0,
            refreshing: 0,
            active: 0,
            hold: None,
            published: None,
        }
    }

    fn is_idle(&self) -> bool {
        self.order.is_empty() && self.placing == 0 && self.refreshing == 0 && self.active == 0
    }
}

/// Held requests of one model in release order.
#[derive(Debug)]
enum Order {
    /// `fcfs`, `wspt`, `strict`: a static key per request.
    Keyed(BTreeMap<OrderKey, u64>),
    /// `wfq`, `fair`: bands in strict order, classes sharing by weight
    /// inside each.
    Fair(BTreeMap<BandKey, fair::Band>),
}

/// A band: (strict tier, priority) under `fair`, (strict tier, 0) under
/// `wfq`; highest first.
type BandKey = (Reverse<u32>, Reverse<i32>);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct OrderKey {
    tier: Reverse<u32>,
    key: PolicyKey,
    seq: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum PolicyKey {
    /// Effective arrival in ns since the queue's epoch; earliest first.
    EffectiveArrival(i128),
    /// Highest priority first.
    Priority(Reverse<i32>),
    /// Largest WSPT score first.
    Score(Reverse<TotalF64>),
}

/// `f64` ordered by `total_cmp`.
#[derive(Debug, Clone, Copy)]
struct TotalF64(f64);

impl PartialEq for TotalF64 {
    fn eq(&self, other: &Self) -> bool {
        self.0.total_cmp(&other.0).is_eq()
    }
}
impl Eq for TotalF64 {}
impl PartialOrd for TotalF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TotalF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

fn order_key(cfg: &Args, epoch: Instant, seq: u64, entry: &Entry) -> OrderKey {
    let bump = i128::from(entry.priority.max(0));
    let key = match cfg.queue_policy {
        Policy::Fcfs | Policy::Wfq | Policy::Fair => {
            let arrival = if entry.arrival >= epoch {
                entry.arrival.duration_since(epoch).as_nanos() as i128
            } else {
                -(epoch.duration_since(entry.arrival).as_nanos() as i128)
            };
            PolicyKey::EffectiveArrival(arrival - bump * 1_000_000_000)
        }
        Policy::Strict => PolicyKey::Priority(Reverse(entry.priority)),
        Policy::Wspt => {
            let score = (1 + bump) as f64 / f64::from(entry.uncached_tokens().max(1));
            PolicyKey::Score(Reverse(TotalF64(score)))
        }
    };
    OrderKey {
        tier: Reverse(entry.strict_tier),
        key,
        seq,
    }
}

fn wfq_class(cfg: &Args, entry: &Entry) -> String {
    let tenant = if entry.tenant.is_empty() {
        crate::tenants::DEFAULT_TENANT
    } else {
        entry.tenant.as_str()
    };
    match cfg.wfq_class {
        WfqClass::Tenant => tenant.to_owned(),
        WfqClass::Priority => entry.priority.to_string(),
        WfqClass::TenantPriority => format!("{tenant}/{}", entry.priority),
    }
}

/// Whether releases cost tokens (`fair`, `wfq --wfq-cost tokens`) rather
/// than one per request.
fn tokens_cost(cfg: &Args) -> bool {
    cfg.queue_policy == Policy::Fair || cfg.wfq_cost == WfqCost::Tokens
}

/// `entry`'s band and class under `wfq`/`fair`.
fn band_and_class(cfg: &Args, entry: &Entry) -> (BandKey, String) {
    match cfg.queue_policy {
        Policy::Fair => {
            let band = (Reverse(entry.strict_tier), Reverse(entry.priority));
            let tenant = if entry.tenant.is_empty() {
                crate::tenants::DEFAULT_TENANT
            } else {
                entry.tenant.as_str()
            };
            (band, tenant.to_owned())
        }
        _ => (
            (Reverse(entry.strict_tier), Reverse(0)),
            wfq_class(cfg, entry),
        ),
    }
}

/// A class's weight: `--wfq-weights`' for its key, else the tenant's
/// (`tenant_weight`, for classes of a tenant), else the default.
fn class_weight(cfg: &Args, class: &str, tenant_weight: u32) -> u32 {
    let of_tenant = cfg.queue_policy == Policy::Fair
        || matches!(cfg.wfq_class, WfqClass::Tenant | WfqClass::TenantPriority);
    cfg.wfq_weights
        .0
        .get(class)
        .copied()
        .or_else(|| (of_tenant && tenant_weight > 0).then_some(tenant_weight))
        .unwrap_or(cfg.wfq_default_weight)
        .max(1)
}

impl Order {
    /// Holds `seq`; `tenant_weight` is its tenant's weight (0 = none).
    fn insert(&mut self, cfg: &Args, epoch: Instant, seq: u64, entry: &Entry, tenant_weight: u32) {
        match self {
            Order::Keyed(map) => {
                map.insert(order_key(cfg, epoch, seq, entry), seq);
            }
            Order::Fair(bands) => {
                let (band, class) = band_and_class(cfg, entry);
                let weight = class_weight(cfg, &class, tenant_weight);
                let cost = if tokens_cost(cfg) {
                    f64::from(entry.uncached_tokens().max(1))
                } else {
                    1.0
                };
                bands
                    .entry(band)
                    .or_default()
                    .push(Arc::from(class), weight, seq, cost);
            }
        }
    }

    /// Removes `seq` (cancelled, expired or re-keyed); `entry` is its
    /// current entry. Not a release: nothing is charged.
    fn remove(&mut self, cfg: &Args, epoch: Instant, seq: u64, entry: &Entry) {
        match self {
            Order::Keyed(map) => {
                map.remove(&order_key(cfg, epoch, seq, entry));
            }
            Order::Fair(bands) => {
                let (key, class) = band_and_class(cfg, entry);
                if let Some(band) = bands.get_mut(&key) {
                    band.remove(&class, seq);
                    if band.is_idle() {
                        bands.remove(&key);
                    }
                }
            }
        }
    }

    /// Charges `work` (tokens, or requests under unit cost; negative: a
    /// refund) to a released request's class.
    fn charge(&mut self, released: &Released, work: f64) {
        if let Order::Fair(bands) = self
            && let Some(band) = bands.get_mut(&released.band)
        {
            band.charge(&released.class, work);
        }
    }

    /// A released request ended or was never granted.
    fn finish(&mut self, released: &Released) {
        if let Order::Fair(bands) = self
            && let Some(band) = bands.get_mut(&released.band)
        {
            band.finish(&released.class);
            if band.is_idle() {
                bands.remove(&released.band);
            }
        }
    }

    /// Forgets every held request.
    fn clear(&mut self) {
        match self {
            Order::Keyed(map) => map.clear(),
            Order::Fair(bands) => bands.clear(),
        }
    }

    /// Takes the next request out for release; under `wfq`/`fair` also
    /// where its work is charged.
    fn pop_head(&mut self) -> Option<(u64, Option<Released>)> {
        match self {
            Order::Keyed(map) => map.pop_first().map(|(_, seq)| (seq, None)),
            Order::Fair(bands) => bands.iter_mut().find_map(|(key, band)| {
                band.pop().map(|(seq, class, charged)| {
                    let released = Released {
                        band: *key,
                        class,
                        charged,
                    };
                    (seq, Some(released))
                })
            }),
        }
    }

    /// The next request to release.
    fn head(&self) -> Option<u64> {
        match self {
            Order::Keyed(map) => map.values().next().copied(),
            Order::Fair(bands) => bands.values().find_map(fair::Band::head),
        }
    }

    /// Every held request in release order.
    fn sequence(&self) -> Vec<u64> {
        match self {
            Order::Keyed(map) => map.values().copied().collect(),
            Order::Fair(bands) => bands.values().flat_map(fair::Band::sequence).collect(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Order::Keyed(map) => map.len(),
            Order::Fair(bands) => bands.values().map(|band| band.len).sum(),
        }
    }

    fn is_empty(&self) -> bool {
        match self {
            Order::Keyed(map) => map.is_empty(),
            Order::Fair(bands) => bands.values().all(|band| band.len == 0),
        }
    }
}

#[cfg(test)]
mod tests;
