//! The router's Prometheus metrics, in its own [`Registry`] (several
//! services in one process keep theirs apart).

use prometheus::{Histogram, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Registry};
use sluice_runtime::metrics::{Registrar, priority_label};

use crate::latency::TtftCheck;
use crate::pool::WorkerPool;

/// Every router metric.
#[derive(Debug, Clone)]
pub struct RouterMetrics {
    registry: Registry,
    /// Placements by pool, worker and mode.
    pub(crate) placements: IntCounterVec,
    /// Prompt blocks cached on the chosen worker, by pool.
    pub(crate) overlap_blocks: HistogramVec,
    /// Fraction of the prompt's blocks cached on the chosen worker, by pool.
    pub(crate) hit_rate: HistogramVec,
    /// Seconds per placement decision.
    pub(crate) decision_seconds: Histogram,
    /// Distinct blocks indexed, by pool.
    pub(crate) index_blocks: IntGaugeVec,
    /// (worker, block) pairs indexed, by pool.
    pub(crate) index_entries: IntGaugeVec,
    /// Estimated index heap bytes, by pool.
    pub(crate) index_bytes: IntGaugeVec,
    /// Members, by pool.
    pub(crate) workers: IntGaugeVec,
    /// Targets whose first snapshot is still outstanding, by pool.
    pub(crate) workers_joining: IntGaugeVec,
    /// KV events applied, by pool.
    pub(crate) events_applied: IntCounterVec,
    /// Seconds from receiving an event batch to having applied it.
    pub(crate) event_lag: Histogram,
    /// Snapshot resyncs, by pool and reason (`initial`, `gap`, `reconnect`,
    /// `snapshot_required`).
    pub(crate) resyncs: IntCounterVec,
    /// Workers forgotten, by pool and reason (`lease`, `unreachable`).
    pub(crate) departures: IntCounterVec,
    /// Placements that stopped counting, by reason (`released` by their
    /// client, `expired` orphans).
    pub(crate) placement_ends: IntCounterVec,
    /// Placements counted now (orphans included), by pool.
    pub(crate) live_placements: IntGaugeVec,
    /// `Place` sessions open now (one per queue replica, normally).
    pub(crate) place_sessions: IntGauge,
    /// Predicted and served seconds to the first token of the placements
    /// this router made, by pool.
    ttft_predicted: HistogramVec,
    ttft_served: HistogramVec,
    /// |predicted − served| / served, by pool, worker and priority.
    ttft_error: HistogramVec,
    /// Placements no candidate was predicted to serve within the request's
    /// TTFT target, by pool.
    pub(crate) beyond_target: IntCounterVec,
}

impl RouterMetrics {
    /// Creates and registers every metric in a fresh registry.
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let pool = &["pool"];
        let block_buckets = [
            0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ];
        let ttft_buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
        let fractions = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
        let decision_buckets = [
            1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 1e-2,
        ];
        Ok(Self {
            placement_ends: r.counter_vec(
                "sluice_router_placement_ends_total",
                "Placements that stopped counting as load, by reason (released by their client, expired orphans).",
                &["reason"],
            )?,
            live_placements: r.gauge_vec(
                "sluice_router_live_placements",
                "Placements counted as load now (orphans included).",
                pool,
            )?,
            place_sessions: r.gauge(
                "sluice_router_place_sessions",
                "Place sessions open now (normally one per queue replica).",
            )?,
            placements: r.counter_vec(
                "sluice_router_placements_total",
                "Placements by pool, worker and mode.",
                &["pool", "worker", "mode"],
            )?,
            overlap_blocks: r.histogram_vec(
                "sluice_router_overlap_blocks",
                "Prompt blocks cached on the chosen worker.",
                &block_buckets,
                pool,
            )?,
            hit_rate: r.histogram_vec(
                "sluice_router_hit_rate",
                "Fraction of prompt blocks cached on the chosen worker.",
                &fractions,
                pool,
            )?,
            decision_seconds: r.histogram(
                "sluice_router_decision_seconds",
                "Seconds per placement decision.",
                &decision_buckets,
            )?,
            index_blocks: r.gauge_vec("sluice_router_index_blocks", "Distinct blocks indexed.", pool)?,
            index_entries: r.gauge_vec(
                "sluice_router_index_entries",
                "(worker, block) pairs indexed.",
                pool,
            )?,
            index_bytes: r.gauge_vec(
                "sluice_router_index_bytes",
                "Estimated heap bytes of the block index.",
                pool,
            )?,
            workers: r.gauge_vec("sluice_router_workers", "Targets in the pool.", pool)?,
            workers_joining: r.gauge_vec(
                "sluice_router_workers_joining",
                "Targets whose first KV snapshot is still outstanding (not yet placeable on cache).",
                pool,
            )?,
            events_applied: r.counter_vec("sluice_router_kv_events_total", "KV events applied.", pool)?,
            event_lag: r.histogram(
                "sluice_router_event_lag_seconds",
                "Seconds from receiving a KV event batch to having applied it.",
                &[1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0],
            )?,
            resyncs: r.counter_vec(
                "sluice_router_resyncs_total",
                "Snapshot resyncs by reason.",
                &["pool", "reason"],
            )?,
            departures: r.counter_vec(
                "sluice_router_departures_total",
                "Workers forgotten by reason.",
                &["pool", "reason"],
            )?,
            ttft_predicted: r.histogram_vec(
                "sluice_router_ttft_predicted_seconds",
                "Time to first token predicted at placement (placements whose worker had measured a step).",
                &ttft_buckets,
                pool,
            )?,
            ttft_served: r.histogram_vec(
                "sluice_router_ttft_served_seconds",
                "Time from placement to first token of the same placements.",
                &ttft_buckets,
                pool,
            )?,
            ttft_error: r.histogram_vec(
                "sluice_router_ttft_prediction_error_ratio",
                "|predicted - served| / served time to first token, by worker and priority.",
                &[
                    0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0,
                ],
                &["pool", "worker", "priority"],
            )?,
            beyond_target: r.counter_vec(
                "sluice_router_beyond_ttft_target_total",
                "Placements whose chosen worker was predicted to miss the request's TTFT target (in latency mode: no candidate was predicted to meet it).",
                pool,
            )?,
            registry,
        })
    }

    /// Records a placement's predicted time to first token beside the one
    /// it got.
    pub(crate) fn ttft_checked(&self, pool: &str, check: &TtftCheck) {
        self.ttft_predicted
            .with_label_values(&[pool])
            .observe(check.predicted);
        self.ttft_served
            .with_label_values(&[pool])
            .observe(check.served);
        self.ttft_error
            .with_label_values(&[
                pool,
                &check.target.worker_id,
                &priority_label(check.priority),
            ])
            .observe(check.relative_error());
    }

    /// The registry to serve at `/metrics`.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Refreshes the cheap size gauges of a pool.
    pub(crate) fn observe_pool(&self, pool: &WorkerPool) {
        let name = pool.kind().component();
        let idx = pool.indexer();
        self.index_blocks
            .with_label_values(&[name])
            .set(idx.block_count() as i64);
        self.index_entries
            .with_label_values(&[name])
            .set(idx.entry_count() as i64);
        self.workers
            .with_label_values(&[name])
            .set(pool.members().len() as i64);
        self.live_placements
            .with_label_values(&[name])
            .set(pool.placement_count() as i64);
    }

    /// Refreshes the memory estimate of a pool's index (walks the index).
    pub(crate) fn observe_memory(&self, pool: &WorkerPool) {
        let stats = pool.indexer().stats();
        self.index_bytes
            .with_label_values(&[pool.kind().component()])
            .set(stats.memory_bytes as i64);
    }
}
