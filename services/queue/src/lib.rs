//! The priority admission queue (`sluice queue`): each request holds a
//! lease, on its own `Admit` stream or on a frontend's `Leases` session.
//! The queue holds requests while every eligible worker is above the load
//! threshold, releases them in policy order (`fcfs`, `wspt`, `strict`,
//! `wfq`, `fair`, strict tiers first), asks the router for a placement,
//! and counts the lease until it ends. It refuses work it
//! cannot hold (`--max-pending`, per tenant, a share reserved for protected
//! priorities) and tenants over a quota (`--tenant-limits`, see `tenants.rs`)
//! with `RESOURCE_EXHAUSTED` (quotas with a `retry-after`).
//!
//! Under `fair` (and `wfq`) held requests are released by strict priority
//! and, inside a priority, by weighted fair share of tokens between tenants
//! (a virtual token counter per tenant: `queue/order/fair.rs`); the frontend
//! reports each lease's output tokens (`AdmitProgress`, `AdmitDone`) so they
//! are charged as they are produced.
//!
//! It does not proxy tokens, score workers (the router does) or schedule
//! inside an engine.

#![forbid(unsafe_code)]

mod config;
mod convert;
mod error;
mod metrics;
mod placement;
mod queue;
mod service;
mod tenants;

use std::sync::Arc;

use prometheus::Registry;
use sluice_proto::queue::v1::queue_server::QueueServer;
use sluice_runtime::ServiceContext;
use sluice_runtime::grpc::GrpcServer;
use tokio::net::TcpListener;

pub use config::{Args, Policy, TargetsByPriority, WfqClass, WfqCost, WfqWeights};
pub use error::{QueueError, Quota};
pub use metrics::QueueMetrics;
pub use queue::{
    Entry, Grant, HeldByModel, HeldStatus, HoldReason, LoadView, Placed, Placement, PlacementLease,
    Placer, Queue, QueueStats, Target, Ticket, TicketEvent, TierStats, WorkerLoad, WorkerRole,
};
pub use tenants::{DEFAULT_TENANT, Limits, Replicas, TenantLimits};

/// Discovery component name the queue registers under.
pub const COMPONENT: &str = "queue";

/// Serves the queue on `listener` until `ctx.shutdown` is cancelled: registers
/// as `queue` in discovery, places through `--router-endpoint` or the
/// `router` instances in discovery, follows their load, and on shutdown
/// deregisters, drains lease streams under `--drain-timeout`, then stops the
/// dispatcher (requests still held fail with `UNAVAILABLE`).
pub async fn serve(
    listener: TcpListener,
    args: Args,
    ctx: ServiceContext,
) -> Result<(), QueueError> {
    args.validate()?;
    let registry = Registry::new();
    let metrics = QueueMetrics::new(&registry)?;
    let queue = Queue::new(args.clone(), metrics);
    tracing::info!("queue: {}", args.summary());

    let tracker = ctx.tasks();
    let background = ctx.background();
    let instance = ctx.instance(COMPONENT, &listener)?;
    // The queue names itself to the routers by its instance id.
    let routers = match &args.router_endpoint {
        Some(endpoint) => placement::Routers::fixed(
            endpoint,
            &instance.id,
            tracker,
            background.clone(),
            Arc::clone(&ctx.security),
        )?,
        None => {
            placement::Routers::discovered(
                &ctx.discovery,
                &instance.id,
                tracker,
                background.clone(),
                Arc::clone(&ctx.security),
            )
            .await?
        }
    };
    let placer = placement::RouterPlacer::new(routers.clone(), &registry)?;
    tracker.spawn(placement::watch_load(
        queue.clone(),
        routers,
        placer.clone(),
        background.clone(),
    ));
    tracker.spawn({
        let queue = queue.clone();
        let token = background.clone();
        async move { queue.run(placer, token).await }
    });
    // The replicas split tenants' quotas and share the workers' slots.
    tracker.spawn(tenants::follow_replicas(
        queue.clone(),
        std::sync::Arc::clone(&ctx.discovery),
        instance.id.clone(),
        background.clone(),
    ));

    let server = GrpcServer::new()?
        .add_service(QueueServer::new(service::QueueService::new(
            queue,
            background.clone(),
            tracker.clone(),
        )))
        .with_metrics(vec![registry]);
    let served = ctx.run(server, listener, instance).await;
    served.map_err(QueueError::from)
}
