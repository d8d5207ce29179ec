//! `sluice-router` (`sluice router`): KV-aware placement from streamed block
//! events. The router never proxies tokens.
//!
//! - [`indexer`]: the concurrent block index fed by workers' KV events.
//! - [`selector`]: the placement cost (Dynamo's form) and the choice.
//! - [`pool`]: one pool of workers (decode or prefill): members, loads,
//!   index, and the placement decision.
//! - `workers`: follows discovery, each worker's KV events (snapshot,
//!   events in sequence, resync on a gap) and its load reports.
//! - [`service`]: the tonic `Router` (`Route`, `WatchLoad`).
//! - [`config`], [`metrics`], [`error`]; `load` (reported load plus the
//!   router's uncovered placements), `approx` (TTL cache prediction),
//!   `convert` (wire ⇄ domain).

#![forbid(unsafe_code)]

mod approx;
pub mod config;
mod convert;
pub mod error;
pub mod indexer;
pub mod latency;
mod load;
pub mod metrics;
pub mod pool;
pub mod selector;
pub mod service;
mod workers;

use std::sync::Arc;
use std::time::Duration;

use sluice_proto::router::v1::router_server::RouterServer;
use sluice_runtime::ServiceContext;
use sluice_runtime::grpc::GrpcServer;
use tokio::net::TcpListener;

pub use config::Args;
pub use error::RouterError;
pub use indexer::{
    Applied, IndexError, IndexStats, KvEvent, KvEventKind, KvIndexer, OverlapScores, TargetHandle,
    TargetId,
};
pub use load::{EffectiveLoad, LoadReport};
pub use metrics::RouterMetrics;
pub use pool::{
    Candidate, Commit, Decision, MemberInfo, MemberLoad, PlacementKey, PlacementRecord,
    PlacementState, PoolConfig, PoolKind, Pools, RouteInput, WorkerPool,
};
pub use selector::{CostInput, CostParams, CostTerms, RouterMode};
pub use service::RouterService;

/// Discovery component name the router registers under.
pub const COMPONENT: &str = "router";

/// How often the index memory gauge is refreshed.
const MEMORY_GAUGE_PERIOD: Duration = Duration::from_secs(10);
/// How often orphaned placements are aged out (and the pool gauges refreshed).
const EXPIRY_PERIOD: Duration = Duration::from_secs(1);

/// Serves the router on `listener` until `ctx.shutdown` is cancelled.
///
/// Before it registers and reports ready it waits (up to
/// `--router-sync-timeout-secs`) for a snapshot of every worker already in
/// discovery, so a restarted router routes as before from its first request.
pub async fn serve(
    listener: TcpListener,
    args: Args,
    ctx: ServiceContext,
) -> Result<(), RouterError> {
    args.validate()?;
    let metrics = RouterMetrics::new().map_err(RouterError::Metrics)?;
    let pools = Arc::new(Pools::new(args.pool_config()));
    let tracker = ctx.tasks();
    let background = ctx.background();

    let settings = workers::WorkerSettings {
        mode: args.router_mode,
        load_min_interval_ms: args.load_min_interval_ms,
        load_max_interval_ms: args.load_max_interval_ms,
        max_failures: args.worker_max_failures,
    };
    let gate = workers::start(
        &ctx.discovery,
        Arc::clone(&pools),
        settings,
        metrics.clone(),
        tracker,
        background.clone(),
        Arc::clone(&ctx.security),
    )
    .await?;
    let outstanding = gate.wait(Duration::from_secs(args.sync_timeout_secs)).await;
    if outstanding.is_empty() {
        tracing::info!("block index synchronised with every known worker");
    } else {
        let names: Vec<String> = outstanding.iter().map(ToString::to_string).collect();
        tracing::warn!(outstanding = ?names, "starting before every known worker was snapshotted");
    }

    {
        let pools = Arc::clone(&pools);
        let metrics = metrics.clone();
        let token = background.clone();
        tracker.spawn(async move {
            let mut memory = tokio::time::interval(MEMORY_GAUGE_PERIOD);
            let mut expiry = tokio::time::interval(EXPIRY_PERIOD);
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = memory.tick() => {
                        for p in pools.all() {
                            metrics.observe_memory(p);
                        }
                    }
                    _ = expiry.tick() => {
                        let now = std::time::Instant::now();
                        for p in pools.all() {
                            let expired = p.expire(now);
                            if expired > 0 {
                                metrics
                                    .placement_ends
                                    .with_label_values(&["expired"])
                                    .inc_by(expired as u64);
                                pools.load_changed();
                            }
                            metrics.observe_pool(p);
                        }
                    }
                }
            }
        });
    }

    let svc = RouterService::new(
        Arc::clone(&pools),
        metrics.clone(),
        background.clone(),
        tracker.clone(),
    )
    .with_joining(gate);
    let server = GrpcServer::new()?
        .add_service(RouterServer::new(svc))
        .with_metrics(vec![metrics.registry().clone()]);
    let instance = ctx.instance(COMPONENT, &listener)?;
    let result = ctx.run(server, listener, instance).await;
    result.map_err(RouterError::from)
}
