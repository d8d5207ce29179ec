//! Prometheus exposition. Each service owns a [`prometheus::Registry`] value
//! (several services in one process keep separate registries) and serves it
//! at `/metrics` through [`router`].
//!
//! One process, one `/metrics`: after [`serve_whole_process`] (what
//! `sluice up` calls), every `/metrics` of the process renders every
//! registry of every service the process runs ([`ServiceContext::run`]
//! records them), so a user of `sluice up` finds the frontend's, queue's,
//! router's and each worker's series on the one port they know. Families of
//! the same name from several registries (two workers' counters) are merged
//! into one; registries tell their series apart by constant labels (a
//! worker's `worker_id`).
//!
//! [`ServiceContext::run`]: crate::ServiceContext::run

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};
use parking_lot::Mutex;
use prometheus::core::Collector;
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every registry of the services this process runs, by registration id.
static PROCESS: LazyLock<Mutex<BTreeMap<u64, Vec<Registry>>>> = LazyLock::new(Default::default);
static NEXT: AtomicU64 = AtomicU64::new(0);
static WHOLE_PROCESS: AtomicBool = AtomicBool::new(false);

/// From now on every `/metrics` of this process renders every service's
/// registries, not only its own.
pub fn serve_whole_process() {
    WHOLE_PROCESS.store(true, Ordering::Release);
}

/// Keeps a service's registries in the process-wide set until dropped.
#[derive(Debug)]
pub struct ProcessRegistration(u64);

impl Drop for ProcessRegistration {
    fn drop(&mut self) {
        PROCESS.lock().remove(&self.0);
    }
}

/// Adds a running service's registries to the process-wide set.
pub fn register_process(registries: &[Registry]) -> ProcessRegistration {
    let id = NEXT.fetch_add(1, Ordering::Relaxed);
    PROCESS.lock().insert(id, registries.to_vec());
    ProcessRegistration(id)
}

/// Families of every registry, same-named families merged into one.
fn gather(registries: &[Registry]) -> Vec<MetricFamily> {
    let mut by_name: BTreeMap<String, MetricFamily> = BTreeMap::new();
    for r in registries {
        for mut family in r.gather() {
            match by_name.get_mut(family.name()) {
                Some(merged) => merged.mut_metric().extend(family.take_metric()),
                None => {
                    by_name.insert(family.name().to_owned(), family);
                }
            }
        }
    }
    by_name.into_values().collect()
}

/// Text exposition of every metric in `registries`.
pub fn render(registries: &[Registry]) -> String {
    let encoder = TextEncoder::new();
    let mut out = Vec::new();
    if let Err(e) = encoder.encode(&gather(registries), &mut out) {
        tracing::warn!(error = %e, "encoding metrics");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// An axum router with `GET /metrics` for `registries` (or, after
/// [`serve_whole_process`], for the whole process) and `GET /live`.
pub fn router(registries: Vec<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/live", get(|| async { "ok" }))
        .with_state(registries)
}

async fn metrics_handler(State(registries): State<Vec<Registry>>) -> impl IntoResponse {
    let body = if WHOLE_PROCESS.load(Ordering::Acquire) {
        let all: Vec<Registry> = PROCESS.lock().values().flatten().cloned().collect();
        render(&all)
    } else {
        render(&registries)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}

/// Counts one thing open in a gauge while alive: incremented when made,
/// decremented when dropped, however its holder ends (a session's task
/// that returns, breaks or unwinds).
#[derive(Debug)]
pub struct Open(IntGauge);

impl Open {
    pub fn new(gauge: &IntGauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A request priority as a metric label: the value itself from -99 to 99,
/// beyond that `<=-100` or `>=100`, so a client's priorities cannot grow a
/// series without bound.
pub fn priority_label(priority: i32) -> String {
    match priority {
        p if p <= -100 => "<=-100".to_owned(),
        p if p >= 100 => ">=100".to_owned(),
        p => p.to_string(),
    }
}

/// Creates metrics registered in one registry, one call a metric, so a
/// service's metrics constructor reads as the list of its series: name,
/// help, labels (and buckets).
#[derive(Debug, Clone, Copy)]
pub struct Registrar<'a>(pub &'a Registry);

impl Registrar<'_> {
    fn add<M: Collector + Clone + 'static>(&self, metric: M) -> Result<M, prometheus::Error> {
        self.0.register(Box::new(metric.clone()))?;
        Ok(metric)
    }

    pub fn counter(&self, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
        self.add(IntCounter::new(name, help)?)
    }

    pub fn counter_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntCounterVec, prometheus::Error> {
        self.add(IntCounterVec::new(Opts::new(name, help), labels)?)
    }

    pub fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
        self.add(IntGauge::new(name, help)?)
    }

    pub fn gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<IntGaugeVec, prometheus::Error> {
        self.add(IntGaugeVec::new(Opts::new(name, help), labels)?)
    }

    /// A gauge vector of fractional values.
    pub fn float_gauge_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
    ) -> Result<GaugeVec, prometheus::Error> {
        self.add(GaugeVec::new(Opts::new(name, help), labels)?)
    }

    pub fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> Result<Histogram, prometheus::Error> {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(Histogram::with_opts(opts)?)
    }

    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
        labels: &[&str],
    ) -> Result<HistogramVec, prometheus::Error> {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(HistogramVec::new(opts, labels)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker_registry(id: &str, count: u64) -> Registry {
        let labels = [("worker_id".to_owned(), id.to_owned())].into();
        let r = Registry::new_custom(None, Some(labels)).expect("registry");
        let c = IntCounter::with_opts(Opts::new("sluice_test_requests_total", "Requests."))
            .expect("counter");
        c.inc_by(count);
        r.register(Box::new(c)).expect("register");
        r
    }

    #[test]
    fn same_named_families_of_two_registries_render_as_one() {
        let text = render(&[worker_registry("w0", 3), worker_registry("w1", 5)]);
        assert_eq!(
            text.matches("# TYPE sluice_test_requests_total").count(),
            1,
            "{text}"
        );
        assert!(
            text.contains("sluice_test_requests_total{worker_id=\"w0\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("sluice_test_requests_total{worker_id=\"w1\"} 5"),
            "{text}"
        );
    }

    #[test]
    fn a_registrar_registers_what_it_creates_and_refuses_a_second_of_a_name() {
        let r = Registry::new();
        let reg = Registrar(&r);
        let c = reg
            .counter_vec("sluice_test_x_total", "X.", &["kind"])
            .expect("counter");
        c.with_label_values(&["a"]).inc();
        assert!(render(std::slice::from_ref(&r)).contains("sluice_test_x_total{kind=\"a\"} 1"));
        assert!(reg.counter("sluice_test_x_total", "Again.").is_err());
    }

    #[test]
    fn a_registration_is_in_the_process_set_until_dropped() {
        let r = worker_registry("w9", 1);
        let reg = register_process(std::slice::from_ref(&r));
        let count = || {
            PROCESS
                .lock()
                .values()
                .flatten()
                .filter(|x| render(std::slice::from_ref(x)).contains("w9"))
                .count()
        };
        assert_eq!(count(), 1);
        drop(reg);
        assert_eq!(count(), 0);
    }
}
