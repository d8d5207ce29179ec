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
//! from the router replaces those local additions. On a worker whose engine
//! schedules by priority (its load report says so), the prefill of this
//! queue's granted lower-priority requests still waiting for their first
//! token does not count against a higher-priority head: the engine runs the
//! head first (`LoadCheck::prefill_ahead`). Under `wfq`/`fair` one
//! exception: a class (tenant) with no released request waiting for its
//! first token may send its head past the threshold, one such request per
//! model at a time (`ModelQueue::express_head`), so a tenant coming back
//! from idle is in the engine's next step. `--max-active` (per
//! model) holds further requests while that many leases are granted or
//! being placed.
//!
//! **Default holding** (neither flag): a model's leases granted or being
//! placed are bounded by its engine slots, the `max_num_seqs` of its decode
//! and aggregated ranks less the requests on them no router placed, summed
//! and split evenly across queue replicas (rounded up); so requests wait
//! here, in policy order, not in an engine's waiting queue. When every such
//! rank schedules by priority (its load report says so), a request of
//! priority p counts only the leases of priority ≥ p: the engine preempts
//! the others for it (keeping their KV), so a request that outranks running
//! work is granted at once (`ModelQueue::busy_for`). A rank that reports no
//! `max_num_seqs` makes the model's capacity unknown: nothing is held.
//! Counting slots, not `active_prefill_tokens`, also avoids the threshold
//! rule's blind spot: the router counts a request waiting in an engine's
//! queue as prefill work not yet done, so a backlog inside the engines
//! looks like prefill load, and one without prefill tokens (fully cached)
//! looks like none.
//!
//! # Refusing
//!
//! Every request has a TTFT target: its own (`ttft_target_ms` in its
//! description), else `--ttft-targets`' for its priority, else
//! `--ttft-target-secs`. Under default holding the queue predicts a new
//! request's wait ([`State::predict_wait`]): the held requests released
//! before it beyond the slots free for it, each waiting for a lease to end,
//! at the mean lease of the grants that free a slot for it (before any lease
//! ended: the workers' reported step time times the request's expected
//! output; nothing known: no prediction, nothing refused). A request
//! predicted to miss its target, that wait plus its start
//! ([`hold::ModelQueue::admission_lead`]: the mean for one released at
//! once, the release lead for one held), is refused at once
//! (`TargetUnmeetable`); one still held when its target less the lead
//! passes leaves unplaced (`TargetMissed`),
//! so it is never served late. Past `--max-pending` a request is refused
//! (`QueueFull`), unless it
//! outranks a held request: then the held request of the lowest (strict
//! tier, priority), the newest of them, leaves with `Displaced` and the
//! newcomer takes its place, so a full queue sheds its lowest priorities
//! first. Every refusal for room or time (`QueueFull`, `TenantFull`,
//! `Shed`, `Displaced`, `TargetUnmeetable`, `TargetMissed`) carries a
//! retry-after, 1 to 60 s (for `TargetUnmeetable` the predicted wait past
//! the target; otherwise the time the backlog ahead takes to drain at the
//! rate grants were made over the last few seconds, a grant count decayed
//! with a 5 s time constant), as gRPC `retry-after` metadata, which the
//! frontend turns into a 429 with `Retry-After`.
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

use sluice_runtime::RequestDescription;

use crate::config::{Args, Policy, WfqClass, WfqCost};
use crate::error::QueueError;
use crate::metrics::QueueMetrics;
use crate::tenants::{Quotas, Replicas};

mod dispatch;
mod hold;
mod order;

use dispatch::{Outcome, PhaseCounts};
use hold::{DrainRate, LoadCheck, ModelQueue, hold_reason, retry_after_secs};
use order::{Order, Released, tokens_cost};

/// One request asking for admission.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// The request as the frontend described it (checked when the open
    /// arrived); its tenant is never "" (the default tenant has one name).
    /// Once admitted its TTFT target is the one it is held to (the
    /// default for its priority filled in). Handed to the router.
    pub desc: RequestDescription,
    /// Prompt tokens expected cached on the best worker (re-read after
    /// `--refresh-interval-ms` of holding).
    pub overlap_tokens: u32,
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
        self.desc.prompt_tokens.saturating_sub(self.overlap_tokens)
    }
}

/// A worker instance as the router names it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Target {
    /// The worker and rank.
    pub rank: WorkerRank,
    /// Address to call `Generate` (or the prefill RPC) on.
    pub endpoint: String,
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
    /// The router's predicted time from placement to the first token on
    /// `worker` (`None`: no prediction).
    pub routed_ttft: Option<Duration>,
    /// Whether the router predicted it within what was left of the
    /// request's TTFT target (`None`: no prediction).
    pub routed_within_target: Option<bool>,
    /// The peer `worker` fetches the prompt's cached prefix from, and the
    /// blocks it holds (`None`: no fetch).
    pub prefix_source: Option<(WorkerRank, u32)>,
}

/// A granted request: its placement and how long it waited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The router's placement.
    pub placement: Placement,
    /// Time from arrival to grant.
    pub waited: Duration,
    /// The request's TTFT target (its own, or the default for its
    /// priority).
    pub ttft_target: Duration,
    /// The request's TPOT target in ms (its own, or its priority's
    /// default; 0 = none).
    pub tpot_target_ms: u32,
    /// The wait the queue predicted at admission; `None` when it could not
    /// (the workers' capacity or speed not known yet).
    pub predicted_wait: Option<Duration>,
    /// Released past a busy threshold because its tenant had nothing
    /// starting (`ModelQueue::express_head`).
    pub express: bool,
}

/// Why a model's queue is holding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldReason {
    /// Every eligible worker is above `--queue-threshold`.
    AboveThreshold,
    /// Default holding: the model's workers run as many requests as their
    /// `max_num_seqs` allow.
    AtCapacity,
    /// `--max-active` leases are granted or being placed.
    ActiveLimit,
    /// An earlier request's placement is in flight (threshold mode releases
    /// one at a time per model).
    PlacementInFlight,
    /// The next request's prefix overlap is being re-read (`wspt`).
    RefreshingOverlap,
    /// Default holding with several queue replicas: the free slots go to
    /// higher-priority requests another replica holds.
    HigherElsewhere,
}

impl HoldReason {
    /// A short phrase for logs, traces and `Held.reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::AboveThreshold => "all workers above threshold",
            Self::ActiveLimit => "active leases at limit",
            Self::AtCapacity => "every worker at max_num_seqs",
            Self::PlacementInFlight => "waiting for an earlier placement",
            Self::RefreshingOverlap => "re-reading the prefix overlap",
            Self::HigherElsewhere => "higher priorities wait at another queue replica",
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

use sluice_runtime::discovery::WorkerRank;
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
    /// Sequences the engine runs at once; 0 = unknown.
    pub max_num_seqs: u32,
    /// Requests running on the worker that no router placed (they take
    /// engine slots the queue did not grant).
    pub unplaced_requests: u32,
    /// Its engine orders waiting requests by priority: prefill of lower
    /// priority queued there does not delay a higher-priority request.
    pub priority_scheduling: bool,
    /// Its engine's recent mean step time in microseconds; 0 = not
    /// measured yet.
    pub step_time_us: u32,
    /// Live placements on it made for other queue replicas, by priority.
    pub others_by_priority: BTreeMap<i32, u32>,
}

/// Requests held unplaced, by model and priority.
pub type HeldByModel = HashMap<String, BTreeMap<i32, u32>>;

/// Every worker's load; each view replaces the previous one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadView {
    /// One entry per worker rank.
    pub workers: Vec<WorkerLoad>,
    /// What the other queue replicas hold unplaced.
    pub held_elsewhere: HeldByModel,
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

    /// What this queue holds unplaced now, for the other queue replicas
    /// (sent when it changes, at most every [`HELD_REPORT_INTERVAL`]).
    fn report_held(&self, _held: HeldByModel) {}
}

/// Least time between two reports of what the queue holds.
pub(crate) const HELD_REPORT_INTERVAL: Duration = Duration::from_millis(5);

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

    /// The queue's metrics (its sessions count themselves there).
    pub(crate) fn metrics(&self) -> &QueueMetrics {
        &self.shared.metrics
    }

    /// Admits `entry` or refuses it at once (`QueueFull`, `TenantFull`,
    /// `Shed`, `DeadlineExceeded`, `Draining`). Dropping the ticket cancels
    /// a held request or, once granted, releases its lease.
    pub fn admit(&self, mut entry: Entry) -> Result<Ticket, QueueError> {
        let shared = &self.shared;
        let cfg = &shared.cfg;
        entry.overlap_tokens = entry.overlap_tokens.min(entry.desc.prompt_tokens);
        let now = Instant::now();
        let mut st = shared.state.lock();
        let target = cfg.ttft_target(entry.desc.priority, entry.desc.ttft_target_ms);
        // The router is told the target the request is held to (what is
        // left of it when it is placed: see the placer).
        entry.desc.ttft_target_ms = u32::try_from(target.as_millis()).unwrap_or(u32::MAX);
        entry.desc.tpot_target_ms =
            cfg.tpot_target_ms(entry.desc.priority, entry.desc.tpot_target_ms);
        let mut checked = st.check_admission(cfg, &entry, now);
        if matches!(checked, Err(QueueError::QueueFull { .. }))
            && st.displace(cfg, shared.epoch, &entry, &shared.metrics, now)
        {
            checked = st.check_admission(cfg, &entry, now);
        }
        let predicted = st.predict_wait(cfg, shared.epoch, &entry);
        // A released request takes this long to its first token: it must
        // leave the queue that much before its target.
        let (lead, trial) = st
            .models
            .get(&entry.desc.model)
            .map_or((Duration::ZERO, false), |m| {
                let held = predicted.is_some_and(|w| !w.is_zero());
                m.admission_lead(entry.desc.priority, held, now)
            });
        if checked.is_ok()
            && let Some(predicted) = predicted
            && predicted + lead > target
        {
            checked = Err(QueueError::TargetUnmeetable {
                predicted,
                target,
                retry_after: retry_after_secs(predicted.saturating_sub(target)),
            });
        }
        entry
            .span
            .record("ttft_target_ms", target.as_millis() as u64);
        if let Some(predicted) = predicted {
            entry
                .span
                .record("predicted_wait_ms", predicted.as_millis() as u64);
            if checked.is_ok() {
                shared
                    .metrics
                    .predicted(entry.desc.priority, predicted.as_secs_f64());
            }
        }
        let refused = checked.and_then(|()| {
            st.quotas
                .admit(&entry.desc.tenant, entry.desc.prompt_tokens, now)
        });
        if let Err(err) = refused {
            drop(st);
            entry.span.record("outcome", err.reason().label());
            shared.metrics.rejected(
                entry.desc.priority,
                &entry.desc.tenant,
                err.reason().label(),
            );
            return Err(err);
        }
        if trial && let Some(model) = st.models.get_mut(&entry.desc.model) {
            model.tried(entry.desc.priority, now);
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let (tx, rx) = watch::channel(TicketState::Waiting);
        let weight = st
            .quotas
            .weight(&entry.desc.tenant)
            .unwrap_or(entry.desc.tenant_weight);
        let model = st
            .models
            .entry(entry.desc.model.clone())
            .or_insert_with(|| ModelQueue::new(cfg.queue_policy));
        model.order.insert(cfg, shared.epoch, seq, &entry, weight);
        model.count_held(entry.desc.priority, 1);
        {
            let state = &mut *st;
            let model = state.models.get_mut(&entry.desc.model);
            (state.counts).moved(model, &entry, None, Some(Phase::Held), &shared.metrics);
        }
        st.held_changed = true;
        // A target beyond any clock (a huge `--ttft-target-secs`) never
        // expires the request.
        let target_at = entry
            .arrival
            .checked_add(target.saturating_sub(lead))
            .unwrap_or(entry.arrival + Duration::from_secs(100 * 365 * 86_400));
        let expiry = entry.deadline.map_or(target_at, |d| d.min(target_at));
        st.deadlines.insert((expiry, seq));
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
                prefill: None,
                express: false,
                expiry,
                predicted,
                target,
                released_at: None,
                granted_at: None,
            },
        );
        st.unread.push(seq);
        st.check();
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
        self.shared.metrics.load_view(&view);
        let mut st = self.shared.state.lock();
        st.load = view
            .workers
            .into_iter()
            .map(|w| (w.target.rank.clone(), w))
            .collect();
        st.held_elsewhere = view.held_elsewhere;
        drop(st);
        self.shared.wake.notify_one();
    }

    /// The number of queue replicas and this one's rank changed: every
    /// tenant's quota share is rescaled.
    pub fn set_replicas(&self, replicas: Replicas) {
        self.shared.metrics.replicas(replicas.count.max(1));
        let mut st = self.shared.state.lock();
        st.replicas = replicas.count.max(1);
        st.quotas.set_replicas(replicas);
    }

    /// Current pending and active counts and the pending requests by tier.
    pub fn stats(&self) -> QueueStats {
        let now = Instant::now();
        let st = self.shared.state.lock();
        let mut tiers: BTreeMap<(Reverse<u32>, Reverse<i32>), TierStats> = BTreeMap::new();
        for slot in st.slots.values().filter(|s| s.phase != Phase::Active) {
            let e = &slot.entry;
            let tier = tiers
                .entry((Reverse(e.desc.strict_priority), Reverse(e.desc.priority)))
                .or_insert_with(|| TierStats {
                    strict_tier: e.desc.strict_priority,
                    priority: e.desc.priority,
                    pending: 0,
                    pending_tokens: 0,
                    oldest_wait: Duration::ZERO,
                });
            tier.pending += 1;
            tier.pending_tokens += u64::from(e.desc.prompt_tokens);
            tier.oldest_wait = tier
                .oldest_wait
                .max(now.saturating_duration_since(e.arrival));
        }
        QueueStats {
            pending: st.counts.pending(),
            active: st.counts.active(),
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
            let (started, next_deadline, held) = {
                let now = Instant::now();
                let mut st = shared.state.lock();
                st.expire(&shared.cfg, shared.epoch, now, &shared.metrics);
                let started = st.release(&shared.cfg, now, &shared.metrics);
                let next_publish = st.publish_positions(now);
                let (held, next_report) = st.held_report(now);
                // An idle model goes, unless it served something: what it
                // learned of the workers' speed stays for its next request.
                st.models
                    .retain(|_, m| !m.is_idle() || m.lease_secs.is_known());
                st.check();
                let next_deadline = st.deadlines.first().map(|&(d, _)| d);
                // Wake for whichever comes first: a deadline, a held-back
                // update or a held-back report.
                let wake_at = [next_deadline, next_publish, next_report]
                    .into_iter()
                    .flatten()
                    .min();
                (started, wake_at, held)
            };
            if let Some(held) = held {
                placer.report_held(held);
            }
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
                    st.check();
                }
                () = shared.wake.notified() => {}
                () = tokio::time::sleep_until(next_deadline.unwrap_or_else(Instant::now)),
                    if next_deadline.is_some() => {}
            }
        }
        let mut st = shared.state.lock();
        st.drain(&shared.metrics);
        st.check();
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
    ///
    /// The prompt's prefill also leaves this queue's own view of that
    /// worker's load at once, and held requests are looked at again: the
    /// next release waits for no load report (which the router sends at
    /// most every `--load-min-interval-ms`) to learn the worker is free.
    pub fn started(&self) {
        let mut st = self.shared.state.lock();
        if st.started(self.seq) {
            drop(st);
            self.shared.wake.notify_one();
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
        st.check();
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
    /// Once granted and until its first token: the worker rank whose local
    /// load figure carries this request's uncached prompt, and how many
    /// tokens (taken off again when the request starts).
    prefill: Option<(WorkerRank, u64)>,
    /// Released past a busy threshold (`ModelQueue::express_head`).
    express: bool,
    /// When it leaves unplaced if still held: its TTFT target or its
    /// deadline, whichever comes first (its key in `State::deadlines`).
    expiry: Instant,
    /// The wait predicted at admission (`None`: no prediction).
    predicted: Option<Duration>,
    /// Its TTFT target (its own, or the default for its priority).
    target: Duration,
    /// When it was released for placement.
    released_at: Option<Instant>,
    /// When it was granted.
    granted_at: Option<Instant>,
}

impl Slot {
    /// Released and no first token yet: being placed, or granted with its
    /// prefill still to come.
    fn starting(&self) -> bool {
        self.phase == Phase::Placing || self.prefill.is_some()
    }
}

#[derive(Debug, Default)]
struct State {
    next_seq: u64,
    slots: HashMap<u64, Slot>,
    models: HashMap<String, ModelQueue>,
    /// Pending and active requests, in all and per tenant: written only by
    /// the phase transitions (`dispatch.rs`).
    counts: PhaseCounts,
    deadlines: BTreeSet<(Instant, u64)>,
    /// Admitted since the last pass; `wspt` reads their overlap if held.
    unread: Vec<u64>,
    load: HashMap<WorkerRank, WorkerLoad>,
    /// This queue's granted requests still waiting for their first token:
    /// uncached prompt tokens by worker rank and priority (also counted in
    /// `load`), so a higher-priority request need not wait behind them on a
    /// worker whose engine schedules by priority.
    starting_prefill: HashMap<WorkerRank, BTreeMap<i32, u64>>,
    draining: bool,
    /// Tenants' quotas and what they used.
    quotas: Quotas,
    /// How fast grants drain the backlog.
    drained: DrainRate,
    /// Queue replicas in discovery (0 until told: counts as 1). With one,
    /// default holding counts its own grants against the workers' slots;
    /// with several, the others' placements (from the router's view) too,
    /// and what they hold unplaced.
    replicas: u32,
    /// What the other queue replicas hold unplaced (the router's view).
    held_elsewhere: HeldByModel,
    /// What this queue holds changed since it last reported it.
    held_changed: bool,
    /// When it last reported what it holds.
    held_reported: Option<Instant>,
}

impl State {
    /// Debug builds: every count that follows requests' phases agrees with
    /// a recount from the slots (the transitions in `dispatch.rs` are the
    /// only writers). Release builds: nothing.
    fn check(&self) {
        #[cfg(debug_assertions)]
        self.recount();
    }

    #[cfg(debug_assertions)]
    fn recount(&self) {
        let mut pending = 0;
        let mut tenants: HashMap<&str, usize> = HashMap::new();
        let mut by_model: HashMap<&str, [usize; 4]> = HashMap::new();
        let mut starting: HashMap<WorkerRank, BTreeMap<i32, u64>> = HashMap::new();
        for slot in self.slots.values() {
            let desc = &slot.entry.desc;
            let phase = match slot.phase {
                Phase::Held => 0,
                Phase::Refreshing => 1,
                Phase::Placing => 2,
                Phase::Active => 3,
            };
            by_model.entry(&desc.model).or_default()[phase] += 1;
            if slot.phase != Phase::Active {
                pending += 1;
                *tenants.entry(&desc.tenant).or_default() += 1;
            }
            if let Some((rank, tokens)) = &slot.prefill
                && *tokens > 0
            {
                *starting
                    .entry(rank.clone())
                    .or_default()
                    .entry(desc.priority)
                    .or_default() += tokens;
            }
        }
        let active = self.slots.len() - pending;
        assert_eq!(self.counts.pending(), pending, "pending requests");
        assert_eq!(self.counts.active(), active, "active leases");
        let counted: HashMap<&str, usize> = self
            .counts
            .tenants()
            .map(|(t, &n)| (t.as_str(), n))
            .collect();
        assert_eq!(counted, tenants, "pending requests by tenant");
        for (name, model) in &self.models {
            let [held, refreshing, placing, active] =
                by_model.get(name.as_str()).copied().unwrap_or_default();
            assert_eq!(model.active, active, "active leases of {name}");
            // Placements and refreshes still in flight for requests that
            // left count until their answers come back.
            assert!(model.placing >= placing, "placements of {name}");
            assert!(model.refreshing >= refreshing, "refreshes of {name}");
            if !self.draining {
                assert_eq!(
                    model.order.len(),
                    held + refreshing,
                    "held requests of {name}"
                );
            }
        }
        let in_order: usize = by_model.values().map(|[h, r, _, _]| h + r).sum();
        assert_eq!(self.deadlines.len(), in_order, "deadlines of held requests");
        assert_eq!(
            self.starting_prefill, starting,
            "prefill of granted requests"
        );
    }
}

#[cfg(test)]
mod tests;
