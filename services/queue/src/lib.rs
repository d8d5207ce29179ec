//! The priority admission queue (`sluice queue`): each request's `Admit`
//! stream is its lease. The queue holds requests while every eligible worker
//! is above the load threshold, releases them in policy order (`fcfs`, `wspt`,
//! `strict`, `wfq`, strict tiers first), asks the router for a placement,
//! and counts the lease until the stream ends. It refuses work it cannot hold
//! (`--max-pending`, per tenant, a share reserved for protected priorities)
//! with `RESOURCE_EXHAUSTED`.
//!
//! It does not proxy tokens, score workers (the router does) or schedule
//! inside an engine.

mod config;
mod error;
mod metrics;
mod queue;

pub use config::{ConfigError, Policy, QueueConfig, WfqClass, WfqWeights};
pub use error::QueueError;
pub use metrics::QueueMetrics;
pub use queue::{
    Entry, Grant, HeldStatus, HoldReason, LoadView, Placement, Placer, Queue, QueueStats, Target,
    Ticket, TicketEvent, TierStats, WorkerLoad, WorkerRole,
};
