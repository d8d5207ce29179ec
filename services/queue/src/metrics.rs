//! The queue's Prometheus metrics, registered in a `Registry` value (never the
//! global one), so several services in one process keep separate registries.
//!
//! Priority labels are the priority itself for -99..=99; anything beyond
//! shares the label `<=-100` or `>=100`, so a client cannot create unbounded
//! label sets.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

/// Queue metrics; cheap to clone (handles to shared collectors).
#[derive(Debug, Clone)]
pub struct QueueMetrics {
    pending_requests: IntGaugeVec,
    pending_tokens: IntGaugeVec,
    wait_seconds: HistogramVec,
    grants: IntCounterVec,
    rejections: IntCounterVec,
    expiries: IntCounter,
    cancellations: IntCounter,
    active_leases: IntGauge,
}

/// Wait-time buckets in seconds: 1 ms to 2 min.
const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

impl QueueMetrics {
    /// Creates the collectors and registers them in `registry`.
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let pending_requests = IntGaugeVec::new(
            Opts::new(
                "sluice_queue_pending_requests",
                "Requests held or being placed, by priority.",
            ),
            &["priority"],
        )?;
        let pending_tokens = IntGaugeVec::new(
            Opts::new(
                "sluice_queue_pending_tokens",
                "Prompt tokens of pending requests, by priority.",
            ),
            &["priority"],
        )?;
        let wait_seconds = HistogramVec::new(
            HistogramOpts::new(
                "sluice_queue_wait_seconds",
                "Time from admission to grant, by priority.",
            )
            .buckets(WAIT_BUCKETS.to_vec()),
            &["priority"],
        )?;
        let grants = IntCounterVec::new(
            Opts::new(
                "sluice_queue_grants_total",
                "Requests granted, by priority.",
            ),
            &["priority"],
        )?;
        let rejections = IntCounterVec::new(
            Opts::new(
                "sluice_queue_rejections_total",
                "Requests refused or failed, by reason.",
            ),
            &["reason"],
        )?;
        let expiries = IntCounter::new(
            "sluice_queue_expiries_total",
            "Requests whose deadline passed while held.",
        )?;
        let cancellations = IntCounter::new(
            "sluice_queue_cancellations_total",
            "Requests whose client left before the grant.",
        )?;
        let active_leases = IntGauge::new(
            "sluice_queue_active_leases",
            "Granted leases not yet released.",
        )?;
        registry.register(Box::new(pending_requests.clone()))?;
        registry.register(Box::new(pending_tokens.clone()))?;
        registry.register(Box::new(wait_seconds.clone()))?;
        registry.register(Box::new(grants.clone()))?;
        registry.register(Box::new(rejections.clone()))?;
        registry.register(Box::new(expiries.clone()))?;
        registry.register(Box::new(cancellations.clone()))?;
        registry.register(Box::new(active_leases.clone()))?;
        Ok(Self {
            pending_requests,
            pending_tokens,
            wait_seconds,
            grants,
            rejections,
            expiries,
            cancellations,
            active_leases,
        })
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

    pub(crate) fn granted(&self, priority: i32, waited_secs: f64) {
        let label = priority_label(priority);
        self.grants.with_label_values(&[label.as_str()]).inc();
        self.wait_seconds
            .with_label_values(&[label.as_str()])
            .observe(waited_secs);
        self.active_leases.inc();
    }

    pub(crate) fn released(&self) {
        self.active_leases.dec();
    }

    pub(crate) fn rejected(&self, reason: &str) {
        self.rejections.with_label_values(&[reason]).inc();
    }

    pub(crate) fn cancelled(&self) {
        self.cancellations.inc();
    }

    pub(crate) fn expired(&self) {
        self.expiries.inc();
        self.rejected("deadline");
    }
}

fn priority_label(priority: i32) -> String {
    match priority {
        p if p <= -100 => "<=-100".to_owned(),
        p if p >= 100 => ">=100".to_owned(),
        p => p.to_string(),
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
        m.granted(0, 0.2);
        m.rejected("queue_full");
        m.expired();
        m.cancelled();
        m.released();
        let text = render(&registry);
        assert!(text.contains("sluice_queue_grants_total{priority=\"0\"} 1"));
        assert!(text.contains("sluice_queue_rejections_total{reason=\"queue_full\"} 1"));
        assert!(text.contains("sluice_queue_rejections_total{reason=\"deadline\"} 1"));
        assert!(text.contains("sluice_queue_expiries_total 1"));
        assert!(text.contains("sluice_queue_cancellations_total 1"));
        assert!(text.contains("sluice_queue_wait_seconds_count{priority=\"0\"} 1"));
        assert!(text.contains("sluice_queue_active_leases 0"));
    }
}
