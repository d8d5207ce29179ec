//! Keeps the pools in step with the workers out there.
//!
//! Watches discovery for the `decode` and `prefill` components. For each
//! instance it runs one task per data-parallel rank (its discovery entry's
//! `dp_size`, default 1) that takes a `KvSnapshot`, applies it, then follows
//! `SubscribeKvEvents` from the snapshot's sequence number, applying events
//! in order; a gap, a `snapshot_required` batch, or a broken stream sends it
//! back to the snapshot (a resync). One more task per instance follows its
//! `Load` stream. A worker joins its pool at its first snapshot; it leaves,
//! with all its blocks at once, when its discovery entry goes (lease expired
//! or deregistered) or after `--worker-max-failures` consecutive failed
//! snapshots (it rejoins when it answers again). A worker that does not
//! implement `KvSnapshot` — and every worker in `approx` mode — joins at
//! once and is placed on load alone (and the router's own predictions).
//!
//! [`SyncGate`] lets `serve` wait until every worker known at start has been
//! snapshotted (or given up on) before the router reports ready, and lets a
//! placement that finds no worker wait for one still joining.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use prometheus::IntGaugeVec;
use sluice_proto::worker::v1 as wpb;
use sluice_proto::worker::v1::worker_client::WorkerClient;
use sluice_runtime::discovery::Watch;
use sluice_runtime::grpc::TracedChannel;
use sluice_runtime::{Discovery, DiscoveryEvent, Followed, Instance, Security};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::convert;
use crate::error::RouterError;
use crate::indexer::{Applied, IndexError, TargetId};
use crate::metrics::RouterMetrics;
use crate::pool::{MemberInfo, PoolKind, Pools, WorkerPool};
use crate::selector::RouterMode;
use sluice_runtime::discovery::WorkerRank;

const BACKOFF_START: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Largest data-parallel size accepted from a discovery entry.
const MAX_DP_SIZE: u32 = 1024;

/// How the worker tasks behave.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkerSettings {
    pub(crate) mode: RouterMode,
    pub(crate) load_min_interval_ms: u32,
    pub(crate) load_max_interval_ms: u32,
    pub(crate) max_failures: u32,
}

/// Targets whose first snapshot is still outstanding, by pool.
#[derive(Debug)]
pub(crate) struct SyncGate {
    pending: Mutex<HashSet<(PoolKind, WorkerRank)>>,
    count: tokio::sync::watch::Sender<usize>,
    /// `sluice_router_workers_joining{pool}`, kept equal to `pending`.
    gauge: IntGaugeVec,
}

impl SyncGate {
    fn new(gauge: IntGaugeVec) -> Self {
        let gate = Self {
            pending: Mutex::new(HashSet::new()),
            count: tokio::sync::watch::Sender::new(0),
            gauge,
        };
        for kind in [PoolKind::Decode, PoolKind::Prefill] {
            gate.observe(kind, &gate.pending.lock());
        }
        gate
    }

    fn expect(&self, kind: PoolKind, t: WorkerRank) {
        let mut p = self.pending.lock();
        if p.insert((kind, t)) {
            self.count.send_replace(p.len());
            self.observe(kind, &p);
        }
    }

    fn done(&self, kind: PoolKind, t: &WorkerRank) {
        let mut p = self.pending.lock();
        if p.remove(&(kind, t.clone())) {
            self.count.send_replace(p.len());
            self.observe(kind, &p);
        }
    }

    /// Sets the pool's gauge from `pending` (called with its lock held).
    fn observe(&self, kind: PoolKind, pending: &HashSet<(PoolKind, WorkerRank)>) {
        let n = pending.iter().filter(|(k, _)| *k == kind).count();
        self.gauge
            .with_label_values(&[kind.component()])
            .set(n as i64);
    }

    /// Targets whose first snapshot is outstanding: workers joining.
    pub(crate) fn joining(&self) -> usize {
        *self.count.borrow()
    }

    /// Waits until fewer workers are joining than `than`, or `timeout`.
    pub(crate) async fn wait_fewer(&self, than: usize, timeout: Duration) {
        let mut rx = self.count.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|n| *n < than)).await;
    }

    /// Waits until no first snapshot is outstanding or `timeout` passes;
    /// returns the targets still outstanding.
    pub(crate) async fn wait(&self, timeout: Duration) -> Vec<WorkerRank> {
        let mut rx = self.count.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|n| *n == 0)).await;
        self.pending.lock().iter().map(|(_, t)| t.clone()).collect()
    }
}

/// Everything a worker task needs.
#[derive(Clone)]
struct Ctx {
    pools: Arc<Pools>,
    kind: PoolKind,
    settings: WorkerSettings,
    metrics: RouterMetrics,
    gate: Arc<SyncGate>,
    tracker: TaskTracker,
    /// TLS and mesh token for the worker channels.
    security: Arc<Security>,
}

impl Ctx {
    fn pool(&self) -> &WorkerPool {
        self.pools.get(self.kind)
    }
}

/// Starts watching both worker components. Targets of instances already
/// registered are put on the returned gate.
pub(crate) async fn start(
    discovery: &Arc<dyn Discovery>,
    pools: Arc<Pools>,
    settings: WorkerSettings,
    metrics: RouterMetrics,
    tracker: &TaskTracker,
    token: CancellationToken,
    security: Arc<Security>,
) -> Result<Arc<SyncGate>, RouterError> {
    let gate = Arc::new(SyncGate::new(metrics.workers_joining.clone()));
    for kind in [PoolKind::Decode, PoolKind::Prefill] {
        let initial = discovery
            .list(kind.component())
            .await
            .map_err(|e| RouterError::Runtime(Box::new(e)))?;
        for inst in &initial {
            for rank in 0..dp_size(inst) {
                gate.expect(kind, WorkerRank::new(inst.id.as_str(), rank));
            }
        }
        let watch = discovery
            .watch(kind.component())
            .await
            .map_err(|e| RouterError::Runtime(Box::new(e)))?;
        let ctx = Ctx {
            pools: Arc::clone(&pools),
            kind,
            settings,
            metrics: metrics.clone(),
            gate: Arc::clone(&gate),
            tracker: tracker.clone(),
            security: Arc::clone(&security),
        };
        tracker.spawn(watch_component(watch, ctx, token.clone()));
    }
    Ok(gate)
}

/// The data-parallel size an instance advertises (`dp_size`, default 1).
pub(crate) fn dp_size(inst: &Instance) -> u32 {
    inst.worker
        .as_ref()
        .map_or(1, |w| w.dp_size)
        .clamp(1, MAX_DP_SIZE)
}

fn member_info(inst: &Instance, kind: PoolKind, rank: u32) -> MemberInfo {
    MemberInfo {
        target: WorkerRank::new(inst.id.as_str(), rank),
        endpoint: inst.endpoint.clone(),
        model: inst.model.clone(),
        // An entry without worker facts has its pool's role.
        role: inst.worker.as_ref().map_or(kind.role(), |w| w.role),
        kv_block_bytes: inst
            .worker
            .as_ref()
            .and_then(|w| w.kv_block_bytes)
            .unwrap_or(0),
    }
}

async fn watch_component(watch: Watch, ctx: Ctx, token: CancellationToken) {
    let mut running: HashMap<String, (Instance, CancellationToken)> = HashMap::new();
    let followed = watch
        .follow(&token, |event| match event {
            DiscoveryEvent::Put(inst) => {
                if let Some((old, old_token)) = running.get(&inst.id) {
                    if *old == inst {
                        return;
                    }
                    old_token.cancel();
                    forget(&ctx, old, "changed");
                }
                let child = token.child_token();
                if let Err(e) = spawn_instance(&ctx, &inst, child.clone()) {
                    tracing::warn!(worker = %inst.id, endpoint = %inst.endpoint, error = %e, "cannot dial worker; ignoring it");
                    for rank in 0..dp_size(&inst) {
                        ctx.gate
                            .done(ctx.kind, &WorkerRank::new(inst.id.as_str(), rank));
                    }
                    return;
                }
                running.insert(inst.id.clone(), (inst, child));
            }
            DiscoveryEvent::Delete { id, .. } => {
                if let Some((old, old_token)) = running.remove(&id) {
                    old_token.cancel();
                    forget(&ctx, &old, "lease");
                }
            }
        })
        .await;
    if followed == Followed::WatchEnded {
        tracing::warn!(component = ctx.kind.component(), "discovery watch ended");
    }
    for (_, (_, t)) in running {
        t.cancel();
    }
}

/// Removes every rank of an instance from its pool at once.
fn forget(ctx: &Ctx, inst: &Instance, reason: &str) {
    let mut blocks = 0;
    for rank in 0..dp_size(inst) {
        let target = WorkerRank::new(inst.id.as_str(), rank);
        ctx.gate.done(ctx.kind, &target);
        if let Some(n) = ctx.pool().remove_member(&target) {
            blocks += n;
        }
    }
    ctx.metrics
        .departures
        .with_label_values(&[ctx.kind.component(), reason])
        .inc();
    ctx.metrics.observe_pool(ctx.pool());
    ctx.pools.load_changed();
    tracing::info!(worker = %inst.id, reason, blocks, pool = %ctx.kind, "worker left the pool");
}

fn spawn_instance(ctx: &Ctx, inst: &Instance, token: CancellationToken) -> Result<(), RouterError> {
    let channel = ctx
        .security
        .channel(&inst.endpoint)
        .map_err(|e| RouterError::Runtime(Box::new(e)))?;
    let client = WorkerClient::new(channel);
    tracing::info!(worker = %inst.id, endpoint = %inst.endpoint, pool = %ctx.kind, ranks = dp_size(inst), "worker joined");
    for rank in 0..dp_size(inst) {
        // Joining until its first snapshot: placement waits for it.
        ctx.gate
            .expect(ctx.kind, WorkerRank::new(inst.id.as_str(), rank));
        ctx.tracker.spawn(rank_task(
            ctx.clone(),
            member_info(inst, ctx.kind, rank),
            client.clone(),
            token.clone(),
        ));
    }
    ctx.tracker
        .spawn(load_task(ctx.clone(), inst.id.clone(), client, token));
    Ok(())
}

type Client = WorkerClient<TracedChannel>;

/// Why an event stream stopped.
enum StreamEnd {
    Cancelled,
    Gap,
    SnapshotRequired,
    Ended,
    /// The worker does not implement `SubscribeKvEvents`.
    Unsupported,
}

/// Snapshot, follow events, resync; until cancelled.
async fn rank_task(ctx: Ctx, info: MemberInfo, mut client: Client, token: CancellationToken) {
    let target = info.target.clone();
    let pool_name = ctx.kind.component();
    if ctx.settings.mode == RouterMode::Approx {
        ctx.pool().add_member(info);
        after_membership_change(&ctx);
        ctx.gate.done(ctx.kind, &target);
        return;
    }
    let mut failures = 0u32;
    let mut backoff = BACKOFF_START;
    let mut reason = "initial";
    loop {
        let req = wpb::KvSnapshotRequest {
            dp_rank: target.dp_rank,
        };
        let snap = tokio::select! {
            _ = token.cancelled() => return,
            r = client.kv_snapshot(req) => r,
        };
        match snap {
            Ok(resp) => {
                let resp = resp.into_inner();
                let id = ctx.pool().add_member(info.clone());
                if token.is_cancelled() {
                    // The worker left while the snapshot was in flight.
                    ctx.pool().remove_member(&target);
                    return;
                }
                if let Err(e) = ctx.pool().indexer().apply_snapshot(
                    id,
                    resp.seq,
                    &resp.block_hashes,
                    &resp.tier2_block_hashes,
                ) {
                    // Removed meanwhile (departure): the next loop re-adds it.
                    tracing::debug!(%target, error = %e, "snapshot raced a removal");
                    continue;
                }
                ctx.metrics
                    .resyncs
                    .with_label_values(&[pool_name, reason])
                    .inc();
                after_membership_change(&ctx);
                ctx.gate.done(ctx.kind, &target);
                tracing::debug!(%target, seq = resp.seq, blocks = resp.block_hashes.len(), reason, "snapshot applied");
                failures = 0;
                backoff = BACKOFF_START;
                match follow_events(&ctx, &mut client, id, &target, resp.seq, &token).await {
                    StreamEnd::Cancelled => return,
                    StreamEnd::Gap => reason = "gap",
                    StreamEnd::SnapshotRequired => reason = "snapshot_required",
                    StreamEnd::Unsupported => {
                        tracing::warn!(%target, "worker publishes no KV events; keeping its snapshot only");
                        return;
                    }
                    StreamEnd::Ended => {
                        reason = "reconnect";
                        if !sleep_or_cancel(BACKOFF_START, &token).await {
                            return;
                        }
                    }
                }
            }
            Err(status) if status.code() == tonic::Code::Unimplemented => {
                tracing::warn!(%target, "worker publishes no KV snapshot; placing it on load alone");
                ctx.pool().add_member(info);
                after_membership_change(&ctx);
                ctx.gate.done(ctx.kind, &target);
                return;
            }
            Err(status) => {
                failures += 1;
                tracing::debug!(%target, code = ?status.code(), message = status.message(), failures, "snapshot failed");
                if failures == ctx.settings.max_failures {
                    if ctx.pool().remove_member(&target).is_some() {
                        ctx.metrics
                            .departures
                            .with_label_values(&[pool_name, "unreachable"])
                            .inc();
                        after_membership_change(&ctx);
                        tracing::warn!(%target, failures, "worker unreachable; forgot its blocks");
                    }
                    ctx.gate.done(ctx.kind, &target);
                }
                if !sleep_or_cancel(backoff, &token).await {
                    return;
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
}

fn after_membership_change(ctx: &Ctx) {
    ctx.metrics.observe_pool(ctx.pool());
    ctx.pools.load_changed();
}

async fn follow_events(
    ctx: &Ctx,
    client: &mut Client,
    id: TargetId,
    target: &WorkerRank,
    from_seq: u64,
    token: &CancellationToken,
) -> StreamEnd {
    let pool_name = ctx.kind.component();
    let req = wpb::SubscribeKvEventsRequest {
        from_seq,
        dp_rank: target.dp_rank,
    };
    let mut stream = tokio::select! {
        _ = token.cancelled() => return StreamEnd::Cancelled,
        r = client.subscribe_kv_events(req) => match r {
            Ok(s) => s.into_inner(),
            Err(status) if status.code() == tonic::Code::Unimplemented => return StreamEnd::Unsupported,
            Err(status) => {
                tracing::debug!(%target, code = ?status.code(), "subscribe failed");
                return StreamEnd::Ended;
            }
        },
    };
    loop {
        let msg = tokio::select! {
            _ = token.cancelled() => return StreamEnd::Cancelled,
            m = stream.message() => m,
        };
        let batch = match msg {
            Ok(Some(b)) => b,
            Ok(None) => return StreamEnd::Ended,
            Err(status) => {
                tracing::debug!(%target, code = ?status.code(), "event stream broke");
                return StreamEnd::Ended;
            }
        };
        if batch.snapshot_required {
            return StreamEnd::SnapshotRequired;
        }
        let received = Instant::now();
        let mut applied = 0u64;
        for ev in batch.events {
            let Some(ev) = convert::kv_event(ev) else {
                tracing::warn!(%target, "KV event of an unknown kind; resyncing");
                return StreamEnd::Gap;
            };
            match ctx.pool().indexer().apply(id, &ev) {
                Ok(Applied::Applied) => applied += 1,
                Ok(Applied::Stale) => {}
                Err(IndexError::Gap { expected, got, .. }) => {
                    tracing::info!(%target, expected, got, "KV event gap; resyncing");
                    return StreamEnd::Gap;
                }
                Err(IndexError::UnknownTarget(_)) => return StreamEnd::Ended,
            }
        }
        ctx.metrics
            .events_applied
            .with_label_values(&[pool_name])
            .inc_by(applied);
        ctx.metrics
            .event_lag
            .observe(received.elapsed().as_secs_f64());
        ctx.metrics.observe_pool(ctx.pool());
    }
}

/// Follows one instance's `Load` stream (all ranks) until cancelled.
async fn load_task(ctx: Ctx, worker_id: String, mut client: Client, token: CancellationToken) {
    let mut backoff = BACKOFF_START;
    loop {
        let req = wpb::LoadRequest {
            min_interval_ms: ctx.settings.load_min_interval_ms,
            max_interval_ms: ctx.settings.load_max_interval_ms,
        };
        let stream = tokio::select! {
            _ = token.cancelled() => return,
            r = client.load(req) => r,
        };
        if let Ok(stream) = stream {
            let mut stream = stream.into_inner();
            loop {
                let msg = tokio::select! {
                    _ = token.cancelled() => return,
                    m = stream.message() => m,
                };
                let Ok(Some(report)) = msg else { break };
                backoff = BACKOFF_START;
                let target = WorkerRank::new(worker_id.as_str(), report.dp_rank);
                let pool = ctx.pool();
                let joined =
                    pool.record_load(&target, convert::load_report(&report), Instant::now());
                // Kept with the report for the join when it came early.
                pool.record_fetch_rates(&target, report.kv_fetch_bytes_per_sec_by_peer);
                if joined {
                    ctx.pools.load_changed();
                }
            }
        }
        if !sleep_or_cancel(backoff, &token).await {
            return;
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// Sleeps; false if cancelled first.
async fn sleep_or_cancel(d: Duration, token: &CancellationToken) -> bool {
    tokio::select! {
        _ = token.cancelled() => false,
        _ = tokio::time::sleep(d) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_runtime::discovery::{WorkerInfo, WorkerRole};

    #[test]
    fn dp_size_and_role_come_from_the_worker_info_with_defaults() {
        let i = Instance::new("decode", "127.0.0.1:1");
        assert_eq!(dp_size(&i), 1);
        assert_eq!(
            member_info(&i, PoolKind::Prefill, 0).role,
            WorkerRole::Prefill
        );
        let with = |dp_size| {
            i.clone().with_worker(WorkerInfo {
                dp_size,
                ..WorkerInfo::new(WorkerRole::Aggregated, 16)
            })
        };
        assert_eq!(dp_size(&with(4)), 4);
        assert_eq!(dp_size(&with(0)), 1);
        assert_eq!(dp_size(&with(u32::MAX)), MAX_DP_SIZE);
        assert_eq!(
            member_info(&with(2), PoolKind::Decode, 1).role,
            WorkerRole::Aggregated
        );
    }

    #[tokio::test]
    async fn the_gate_opens_when_every_expected_target_is_done() {
        let gauge =
            IntGaugeVec::new(prometheus::Opts::new("joining", "test"), &["pool"]).expect("gauge");
        let g = SyncGate::new(gauge.clone());
        let joining = |pool: PoolKind| gauge.with_label_values(&[pool.component()]).get();
        assert_eq!(
            (joining(PoolKind::Decode), joining(PoolKind::Prefill)),
            (0, 0)
        );
        let a = WorkerRank::new("a", 0);
        g.expect(PoolKind::Decode, a.clone());
        assert_eq!(
            (joining(PoolKind::Decode), joining(PoolKind::Prefill)),
            (1, 0)
        );
        assert_eq!(g.wait(Duration::from_millis(10)).await, vec![a.clone()]);
        g.done(PoolKind::Prefill, &a);
        assert_eq!(g.joining(), 1, "done in another pool leaves it joining");
        g.done(PoolKind::Decode, &a);
        assert_eq!(joining(PoolKind::Decode), 0);
        assert!(g.wait(Duration::from_secs(5)).await.is_empty());
    }
}
