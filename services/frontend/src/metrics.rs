//! The frontend's Prometheus metrics: latency histograms by priority and
//! requests by status code.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};

/// Every metric the frontend exports, in its own registry.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    pub registry: Registry,
    pub ttft: HistogramVec,
    pub itl: HistogramVec,
    pub e2e: HistogramVec,
    pub queue_wait: HistogramVec,
    pub requests: IntCounterVec,
    pub inflight: IntGauge,
    pub migrations: IntCounterVec,
    pub failovers: IntCounterVec,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl Metrics {
    pub(crate) fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let h = |name: &str, help: &str| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
                &["priority"],
            )
        };
        let ttft = h(
            "sluice_frontend_ttft_seconds",
            "Time to first token, by request priority",
        )?;
        let itl = h(
            "sluice_frontend_itl_seconds",
            "Inter-token latency, by request priority",
        )?;
        let e2e = h(
            "sluice_frontend_e2e_seconds",
            "End-to-end request latency, by request priority",
        )?;
        let queue_wait = h(
            "sluice_frontend_queue_wait_seconds",
            "Time held by the admission queue, by priority",
        )?;
        let requests = IntCounterVec::new(
            Opts::new(
                "sluice_frontend_requests_total",
                "Requests by endpoint and status code",
            ),
            &["endpoint", "code"],
        )?;
        let inflight = IntGauge::new("sluice_frontend_inflight_requests", "Requests being served")?;
        let migrations = IntCounterVec::new(
            Opts::new(
                "sluice_frontend_migrations_total",
                "Requests moved to another decode worker after theirs failed mid-stream, by outcome",
            ),
            &["outcome"],
        )?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(itl.clone()))?;
        registry.register(Box::new(e2e.clone()))?;
        registry.register(Box::new(queue_wait.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(inflight.clone()))?;
        let failovers = IntCounterVec::new(
            Opts::new(
                "sluice_frontend_failovers_total",
                "Calls that failed at one replica of a service and were tried at another, by service",
            ),
            &["service"],
        )?;
        registry.register(Box::new(migrations.clone()))?;
        registry.register(Box::new(failovers.clone()))?;
        Ok(Self {
            registry,
            ttft,
            itl,
            e2e,
            queue_wait,
            requests,
            inflight,
            migrations,
            failovers,
        })
    }
}
