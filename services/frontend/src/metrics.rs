//! The frontend's Prometheus metrics: latency histograms by priority (and
//! TTFT by tenant: the [`TOP_TENANTS`] tenants with the most tokens, every
//! other tenant as `other`) and requests by endpoint and status code, each
//! recorded once through a [`RequestOutcome`].

use std::sync::Arc;

use prometheus::core::Collector;
use prometheus::{HistogramVec, IntCounterVec, IntGauge, Registry};
use sluice_runtime::metrics::Registrar;
use sluice_runtime::tenant_labels::TenantLabels;

/// Tenants with a label of their own in the per-tenant metrics.
pub(crate) const TOP_TENANTS: usize = 10;
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
    tenant_ttft: HistogramVec,
    slo: IntCounterVec,
    refusals: IntCounterVec,
    tenants: Arc<TenantLabels>,
}

const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// One request's line in `sluice_frontend_requests_total`, for the HTTP and
/// the gRPC API alike, written once: by [`RequestOutcome::ok`] or
/// [`RequestOutcome::failed`] (the error's HTTP status, which a gRPC
/// request's error maps to as well), or `499` when it is dropped unwritten
/// (the client left first).
#[derive(Debug)]
pub(crate) struct RequestOutcome {
    requests: IntCounterVec,
    endpoint: &'static str,
    recorded: bool,
}

impl RequestOutcome {
    /// Served: `200`.
    pub(crate) fn ok(&mut self) {
        self.record("200");
    }

    /// Failed with `e`.
    pub(crate) fn failed(&mut self, e: &crate::error::FrontendError) {
        self.record(e.status().as_str());
    }

    fn record(&mut self, code: &str) {
        if !self.recorded {
            self.recorded = true;
            self.requests
                .with_label_values(&[self.endpoint, code])
                .inc();
        }
    }
}

impl Drop for RequestOutcome {
    fn drop(&mut self) {
        self.record("499");
    }
}

impl Metrics {
    /// The outcome of one request to `endpoint`, to be recorded once.
    pub(crate) fn outcome(&self, endpoint: &'static str) -> RequestOutcome {
        RequestOutcome {
            requests: self.requests.clone(),
            endpoint,
            recorded: false,
        }
    }

    pub(crate) fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let r = Registrar(&registry);
        let latency =
            |name: &str, help: &str| r.histogram_vec(name, help, LATENCY_BUCKETS, &["priority"]);
        Ok(Self {
            tenant_ttft: r.histogram_vec(
                "sluice_frontend_tenant_ttft_seconds",
                "Time to first token, by tenant (the top tenants by tokens, the rest as `other`)",
                LATENCY_BUCKETS,
                &["tenant"],
            )?,
            ttft: latency(
                "sluice_frontend_ttft_seconds",
                "Time to first token, by request priority",
            )?,
            itl: latency(
                "sluice_frontend_itl_seconds",
                "Inter-token latency, by request priority",
            )?,
            e2e: latency(
                "sluice_frontend_e2e_seconds",
                "End-to-end request latency, by request priority",
            )?,
            queue_wait: latency(
                "sluice_frontend_queue_wait_seconds",
                "Time held by the admission queue, by priority",
            )?,
            requests: r.counter_vec(
                "sluice_frontend_requests_total",
                "Requests by endpoint and status code",
                &["endpoint", "code"],
            )?,
            inflight: r.gauge("sluice_frontend_inflight_requests", "Requests being served")?,
            migrations: r.counter_vec(
                "sluice_frontend_migrations_total",
                "Requests moved to another decode worker after theirs failed mid-stream, by outcome",
                &["outcome"],
            )?,
            failovers: r.counter_vec(
                "sluice_frontend_failovers_total",
                "Calls that failed at one replica of a service and were tried at another, by service",
                &["service"],
            )?,
            slo: r.counter_vec(
                "sluice_frontend_ttft_slo_requests_total",
                "Requests by priority, tenant (top tenants, the rest as `other`) and outcome against their TTFT target: met, missed (first token after the target) or refused (a 429 before any token, sluice_frontend_refusals_total says why). The rate of `met` is the goodput.",
                &["priority", "tenant", "outcome"],
            )?,
            refusals: r.counter_vec(
                "sluice_frontend_refusals_total",
                "Requests refused before any token (429), by priority, tenant and the queue's reason (ttft_target_unmeetable, ttft_target_missed, queue_full, displaced, shed, tenant_full, tokens, requests)",
                &["priority", "tenant", "reason"],
            )?,
            registry,
            tenants: Arc::new(TenantLabels::new(TOP_TENANTS)),
        })
    }

    /// `tokens` more for `tenant` (its volume ranks it for a label).
    pub(crate) fn tenant_tokens(&self, tenant: &str, tokens: u32) {
        if let Some(evicted) = self.tenants.record(tenant, f64::from(tokens)) {
            let _ = self.tenant_ttft.remove_label_values(&[&evicted]);
            let gone = |m: &IntCounterVec| {
                for series in m.collect().iter().flat_map(|f| f.get_metric()) {
                    let labels: Vec<&str> = series.get_label().iter().map(|l| l.value()).collect();
                    if labels.get(1) == Some(&evicted.as_str()) {
                        let _ = m.remove_label_values(&labels);
                    }
                }
            };
            gone(&self.slo);
            gone(&self.refusals);
        }
    }

    /// A request of `priority` and `tenant` got its first token within its
    /// TTFT target (`met`) or after it (`missed`).
    pub(crate) fn slo(&self, priority: i32, tenant: &str, outcome: &str) {
        let label = self.tenants.label(tenant);
        self.slo
            .with_label_values(&[&priority.to_string(), label.as_str(), outcome])
            .inc();
    }

    /// A request was refused before any token for `reason`.
    pub(crate) fn refused(&self, priority: i32, tenant: &str, reason: &str) {
        let label = self.tenants.label(tenant);
        let priority = priority.to_string();
        self.slo
            .with_label_values(&[&priority, label.as_str(), "refused"])
            .inc();
        self.refusals
            .with_label_values(&[&priority, label.as_str(), reason])
            .inc();
    }

    /// A request of `tenant` with `prompt_tokens` got its first token.
    pub(crate) fn tenant_ttft(&self, tenant: &str, prompt_tokens: u32, seconds: f64) {
        self.tenant_tokens(tenant, prompt_tokens);
        self.tenant_ttft
            .with_label_values(&[self.tenants.label(tenant).as_str()])
            .observe(seconds);
    }
}
