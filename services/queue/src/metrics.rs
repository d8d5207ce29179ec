//! The queue's Prometheus metrics, registered in a `Registry` value (never the
//! global one), so several services in one process keep separate registries.
//!
//! Priority labels are the priority itself for -99..=99; anything beyond
//! shares the label `<=-100` or `>=100`, so a client cannot create unbounded
//! label sets. Tenant labels are the [`TOP_TENANTS`] tenants with the most
//! served tokens, every other tenant counted as `other`
//! ([`sluice_runtime::tenant_labels`]).

use std::sync::Arc;

use prometheus::{HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Registry};
use sluice_runtime::metrics::{Registrar, priority_label};
use sluice_runtime::tenant_labels::TenantLabels;

/// Tenants with a label of their own in the per-tenant metrics.
pub(crate) const TOP_TENANTS: usize = 10;

/// Queue metrics; cheap to clone (handles to shared collectors).
#[derive(Debug, Clone)]
pub struct QueueMetrics {
    pending_requests: IntGaugeVec,
    pending_tokens: IntGaugeVec,
    wait_seconds: HistogramVec,
    grants: IntCounterVec,
    express: IntCounter,
    rejections: IntCounterVec,
    priority_rejections: IntCounterVec,
    predicted_wait: HistogramVec,
    expiries: IntCounter,
    cancellations: IntCounter,
    active_leases: IntGauge,
    lease_sessions: IntGauge,
    replicas: IntGauge,
    view_others_running: IntGauge,
    view_slots: IntGauge,
    view_held_elsewhere: IntGauge,
    view_workers: IntGaugeVec,
    tenant_tokens: IntCounterVec,
    tenant_wait: HistogramVec,
    tenant_rejections: IntCounterVec,
    tenants: Arc<TenantLabels>,
}

/// Wait-time buckets in seconds: 1 ms to 2 min.
const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl QueueMetrics {
    /// Creates the collectors and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let r = Registrar(registry);
        let priority = &["priority"];
        Ok(Self {
            tenant_tokens: r.counter_vec(
                "sluice_queue_tenant_served_tokens_total",
                "Tokens charged to a tenant: prompt tokens not cached (kind=prompt) and output tokens (kind=output); top tenants by volume, the rest as `other`.",
                &["tenant", "kind"],
            )?,
            tenant_wait: r.histogram_vec(
                "sluice_queue_tenant_wait_seconds",
                "Time from admission to grant, by tenant (top tenants, the rest as `other`).",
                WAIT_BUCKETS,
                &["tenant"],
            )?,
            tenant_rejections: r.counter_vec(
                "sluice_queue_tenant_rejections_total",
                "Requests refused or failed, by tenant (top tenants, the rest as `other`) and reason.",
                &["tenant", "reason"],
            )?,
            pending_requests: r.gauge_vec(
                "sluice_queue_pending_requests",
                "Requests held or being placed, by priority.",
                priority,
            )?,
            pending_tokens: r.gauge_vec(
                "sluice_queue_pending_tokens",
                "Prompt tokens of pending requests, by priority.",
                priority,
            )?,
            wait_seconds: r.histogram_vec(
                "sluice_queue_wait_seconds",
                "Time from admission to grant, by priority.",
                WAIT_BUCKETS,
                priority,
            )?,
            grants: r.counter_vec(
                "sluice_queue_grants_total",
                "Requests granted, by priority.",
                priority,
            )?,
            express: r.counter(
                "sluice_queue_express_grants_total",
                "Requests granted past a busy threshold because their tenant had nothing starting (fair/wfq with --queue-threshold; at most one per model at a time).",
            )?,
            rejections: r.counter_vec(
                "sluice_queue_rejections_total",
                "Requests refused or failed, by reason.",
                &["reason"],
            )?,
            priority_rejections: r.counter_vec(
                "sluice_queue_priority_rejections_total",
                "Requests refused or failed, by priority and reason (ttft_target_unmeetable: the predicted wait exceeded the TTFT target at admission; ttft_target_missed: still held when the target passed).",
                &["priority", "reason"],
            )?,
            predicted_wait: r.histogram_vec(
                "sluice_queue_predicted_wait_seconds",
                "The wait predicted at admission for requests admitted with a prediction, by priority (compare with sluice_queue_wait_seconds).",
                WAIT_BUCKETS,
                priority,
            )?,
            expiries: r.counter(
                "sluice_queue_expiries_total",
                "Requests whose deadline passed while held.",
            )?,
            cancellations: r.counter(
                "sluice_queue_cancellations_total",
                "Requests whose client left before the grant.",
            )?,
            active_leases: r.gauge(
                "sluice_queue_active_leases",
                "Granted leases not yet released.",
            )?,
            lease_sessions: r.gauge(
                "sluice_queue_lease_sessions",
                "Leases sessions open now (normally one per frontend).",
            )?,
            replicas: r.gauge(
                "sluice_queue_replicas",
                "Queue replicas in discovery, this one included (they share the workers' slots and release in one priority order)",
            )?,
            view_others_running: r.gauge(
                "sluice_queue_load_view_other_placements",
                "Live placements the other queue replicas made, in the latest load view (they take the workers' slots too)",
            )?,
            view_slots: r.gauge(
                "sluice_queue_load_view_slots",
                "Engine slots (max_num_seqs) of the decode and aggregated ranks in the latest load view",
            )?,
            view_held_elsewhere: r.gauge(
                "sluice_queue_load_view_held_elsewhere",
                "Requests the other queue replicas hold unplaced, in the latest load view (a higher priority among them goes first)",
            )?,
            view_workers: r.gauge_vec(
                "sluice_queue_load_view_workers",
                "Worker ranks in the latest load view from the router, by role",
                &["role"],
            )?,
            tenants: Arc::new(TenantLabels::new(TOP_TENANTS)),
        })
    }

    /// The queue replicas in discovery.
    pub(crate) fn replicas(&self, count: u32) {
        self.replicas.set(i64::from(count));
    }

    /// Counts a `Leases` session as open while the guard lives.
    pub(crate) fn lease_session(&self) -> sluice_runtime::metrics::Open {
        sluice_runtime::metrics::Open::new(&self.lease_sessions)
    }

    /// A new load view: its worker ranks by role, the other replicas'
    /// placements and held requests.
    pub(crate) fn load_view(&self, view: &crate::queue::LoadView) {
        let workers = &view.workers;
        let count = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
        let others: u64 = workers
            .iter()
            .flat_map(|w| w.others_by_priority.values())
            .map(|&n| u64::from(n))
            .sum();
        self.view_others_running.set(count(others));
        let slots: u64 = workers
            .iter()
            .filter(|w| w.role != crate::queue::WorkerRole::Prefill)
            .map(|w| u64::from(w.max_num_seqs))
            .sum();
        self.view_slots.set(count(slots));
        let held: u64 = view
            .held_elsewhere
            .values()
            .flat_map(|m| m.values())
            .map(|&n| u64::from(n))
            .sum();
        self.view_held_elsewhere.set(count(held));
        use crate::queue::WorkerRole;
        for role in [
            WorkerRole::Decode,
            WorkerRole::Prefill,
            WorkerRole::Aggregated,
        ] {
            let n = workers.iter().filter(|w| w.role == role).count();
            self.view_workers
                .with_label_values(&[role.as_str()])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
    }

    /// `tokens` of `kind` (`prompt` or `output`) were charged to `tenant`.
    pub(crate) fn served(&self, tenant: &str, kind: &str, tokens: u64) {
        if tokens == 0 {
            return;
        }
        if let Some(evicted) = self.tenants.record(tenant, tokens as f64) {
            self.forget_tenant(&evicted);
        }
        let label = self.tenants.label(tenant);
        self.tenant_tokens
            .with_label_values(&[label.as_str(), kind])
            .inc_by(tokens);
    }

    /// A tenant lost its label: its series go (it counts as `other` now).
    fn forget_tenant(&self, tenant: &str) {
        for kind in ["prompt", "output"] {
            let _ = self.tenant_tokens.remove_label_values(&[tenant, kind]);
        }
        let _ = self.tenant_wait.remove_label_values(&[tenant]);
        for reason in sluice_proto::queue::v1::QueueReason::ALL {
            let _ = self
                .tenant_rejections
                .remove_label_values(&[tenant, reason.label()]);
        }
    }

    /// A request entered (`delta` = 1) or left (`delta` = -1) the pending set.
    pub(crate) fn pending(&self, priority: i32, prompt_tokens: u32, delta: i64) {
        let label = priority_label(priority);
        self.pending_requests
            .with_label_values(&[label.as_str()])
            .add(delta);
        self.pending_tokens
            .with_label_values(&[label.as_str()])
            .add(delta * i64::from(prompt_tokens));
    }

    pub(crate) fn granted(&self, priority: i32, tenant: &str, waited_secs: f64, express: bool) {
        let label = priority_label(priority);
        self.grants.with_label_values(&[label.as_str()]).inc();
        if express {
            self.express.inc();
        }
        self.wait_seconds
            .with_label_values(&[label.as_str()])
            .observe(waited_secs);
        self.tenant_wait
            .with_label_values(&[self.tenants.label(tenant).as_str()])
            .observe(waited_secs);
    }

    /// Granted leases not yet ended changed by `delta` (the queue's phase
    /// transitions call this, nothing else).
    pub(crate) fn active(&self, delta: i64) {
        self.active_leases.add(delta);
    }

    pub(crate) fn rejected(&self, priority: i32, tenant: &str, reason: &str) {
        self.rejections.with_label_values(&[reason]).inc();
        self.priority_rejections
            .with_label_values(&[priority_label(priority).as_str(), reason])
            .inc();
        self.tenant_rejections
            .with_label_values(&[self.tenants.label(tenant).as_str(), reason])
            .inc();
    }

    pub(crate) fn cancelled(&self) {
        self.cancellations.inc();
    }

    pub(crate) fn expired(&self, priority: i32, tenant: &str) {
        self.expiries.inc();
        self.rejected(priority, tenant, "deadline");
    }

    /// A request admitted with a predicted wait.
    pub(crate) fn predicted(&self, priority: i32, wait_secs: f64) {
        self.predicted_wait
            .with_label_values(&[priority_label(priority).as_str()])
            .observe(wait_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Encoder;

    fn render(registry: &Registry) -> String {
        let mut buf = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&registry.gather(), &mut buf)
            .expect("encode");
        String::from_utf8(buf).expect("utf8")
    }

    #[test]
    fn pending_gauges_follow_entries_by_priority() {
        let registry = Registry::new();
        let m = QueueMetrics::new(&registry).expect("register");
        m.pending(3, 512, 1);
        m.pending(3, 100, 1);
        m.pending(3, 100, -1);
        m.pending(1000, 7, 1);
        let text = render(&registry);
        assert!(text.contains("sluice_queue_pending_requests{priority=\"3\"} 1"));
        assert!(text.contains("sluice_queue_pending_tokens{priority=\"3\"} 512"));
        assert!(text.contains("sluice_queue_pending_requests{priority=\">=100\"} 1"));
    }

    #[test]
    fn separate_registries_do_not_collide() {
        let a = Registry::new();
        let b = Registry::new();
        QueueMetrics::new(&a).expect("first");
        QueueMetrics::new(&b).expect("second");
        assert!(QueueMetrics::new(&a).is_err(), "same registry twice");
    }

    #[test]
    fn grants_rejections_and_expiries_count() {
        let registry = Registry::new();
        let m = QueueMetrics::new(&registry).expect("register");
        m.granted(0, "t", 0.2, false);
        m.rejected(0, "t", "queue_full");
        m.expired(0, "t");
        m.cancelled();
        m.active(1);
        m.active(-1);
        let text = render(&registry);
        assert!(text.contains("sluice_queue_grants_total{priority=\"0\"} 1"));
        assert!(text.contains("sluice_queue_rejections_total{reason=\"queue_full\"} 1"));
        assert!(text.contains("sluice_queue_rejections_total{reason=\"deadline\"} 1"));
        assert!(text.contains("sluice_queue_expiries_total 1"));
        assert!(text.contains("sluice_queue_cancellations_total 1"));
        assert!(text.contains("sluice_queue_wait_seconds_count{priority=\"0\"} 1"));
        assert!(text.contains("sluice_queue_active_leases 0"));
    }

    #[test]
    fn tenant_series_are_the_top_tenants_and_other() {
        let registry = Registry::new();
        let m = QueueMetrics::new(&registry).expect("register");
        for i in 0..TOP_TENANTS {
            m.served(&format!("t{i}"), "prompt", 100);
        }
        m.served("small", "output", 5);
        m.rejected(0, "small", "quota_tokens");
        m.granted(0, "t0", 0.1, false);
        let text = render(&registry);
        assert!(
            text.contains(
                r#"sluice_queue_tenant_served_tokens_total{kind="prompt",tenant="t3"} 100"#
            )
        );
        assert!(text.contains(
            r#"sluice_queue_tenant_served_tokens_total{kind="output",tenant="other"} 5"#
        ));
        assert!(text.contains(
            r#"sluice_queue_tenant_rejections_total{reason="quota_tokens",tenant="other"} 1"#
        ));
        assert!(text.contains(r#"sluice_queue_tenant_wait_seconds_count{tenant="t0"} 1"#));
        // A heavy newcomer takes the smallest label; that tenant's series go.
        m.served("heavy", "prompt", 1000);
        let text = render(&registry);
        assert!(text.contains(r#"tenant="heavy""#), "{text}");
        let tenants = text
            .lines()
            .filter(|l| l.starts_with("sluice_queue_tenant_served_tokens_total{"))
            .count();
        assert_eq!(tenants, TOP_TENANTS + 1, "{text}");
    }
}
