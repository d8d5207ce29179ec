//! Waiting on conditions instead of clocks: [`until`] polls a check until it
//! holds or a deadline passes, and [`sample`] reads one Prometheus series so
//! a check can look at a service's `/metrics`.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`until`] polls.
const POLL: Duration = Duration::from_millis(20);

/// Polls `check` every 20 ms until it returns `Ok(Some(v))`, then returns
/// `v`. Fails with `what` and the last state seen (`Ok(None)` or the last
/// error) once `timeout` has passed.
pub async fn until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => "condition false".to_string(),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() >= deadline {
            anyhow::bail!("timed out after {timeout:?} waiting for {what} (last: {last})");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Like [`until`] for a check that is a plain condition.
pub async fn until_true<F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    until(what, timeout, || {
        let f = check();
        async move { Ok(f.await?.then_some(())) }
    })
    .await
}

/// Whether the Prometheus text line `line` is a sample of `series`
/// (`name{label="v",…}`: that metric, with every label given); its value.
fn matching(line: &str, series: &str) -> Option<f64> {
    let (want_name, want_labels) = match series.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (series, ""),
    };
    let (key, value) = line.rsplit_once(' ')?;
    let (name, labels) = match key.split_once('{') {
        Some((n, l)) => (n, l.trim_end_matches('}')),
        None => (key, ""),
    };
    let has = |pair: &str| pair.is_empty() || labels.split(',').any(|p| p == pair);
    (name == want_name && want_labels.split(',').all(has)).then(|| value.parse().ok())?
}

/// The value of `series` (`name{label="v",…}`) in a Prometheus text page:
/// the first line of that metric whose labels include every one given (a
/// worker's series also carry its `worker_id`).
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| matching(l, series))
}

/// The sum of every line of `series` (as in [`sample`]) in a Prometheus
/// text page (0 when there is none).
pub fn sum(metrics: &str, series: &str) -> f64 {
    metrics.lines().filter_map(|l| matching(l, series)).sum()
}

/// The sum of every series of metric `name` in a Prometheus text page (0
/// when there is none).
pub fn total(metrics: &str, name: &str) -> f64 {
    sum(metrics, name)
}
