//! `sluice up` as a user runs it: one process, one port.
//!
//! The model is listed by `/v1/models` only once a request for it can be
//! served (the first one, sent the moment it is listed, succeeds), and the
//! HTTP port's `/metrics` shows every service the process runs: frontend,
//! queue, router and each worker, told apart by `worker_id`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::http::{get, post_json};
use sluice_tests::process::Proc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_port_serves_a_listed_model_at_once_and_every_services_metrics() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let cache = dir.path().to_string_lossy().into_owned();
    let (_up, http) = Proc::spawn_listening(
        env!("CARGO_BIN_EXE_sluice"),
        [
            "up",
            "--engine",
            "mocker",
            "--workers",
            "2",
            "--http-port",
            "0",
            "--model-cache",
            &cache,
        ],
        &dir.path().join("up.log"),
    )
    .await?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((200, body)) = get(&http, "/v1/models").await
            && body.contains("sluice-tiny")
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "never listed; log in {}",
            dir.path().display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Listed: servable now, not after some settling.
    let body = json!({"model": "sluice-tiny", "prompt": "The river", "max_tokens": 4});
    let (status, resp) = post_json(&http, "/v1/completions", &body).await?;
    assert_eq!(status, 200, "{resp}");

    let (status, metrics) = get(&http, "/metrics").await?;
    assert_eq!(status, 200);
    for series in [
        "sluice_frontend_requests_total",
        "sluice_queue_grants_total",
        "sluice_router_placements_total",
        "sluice_worker_requests_total",
    ] {
        assert!(metrics.contains(series), "{series} missing:\n{metrics}");
    }
    assert_eq!(
        metrics
            .matches("# TYPE sluice_worker_requests_total")
            .count(),
        1,
        "one family for both workers"
    );
    // The model is listed once one worker can serve it; the second may
    // still be starting. Both report into the same page once they run.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (status, metrics) = get(&http, "/metrics").await?;
        assert_eq!(status, 200);
        let workers = worker_ids(&metrics);
        if workers.len() == 2 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "both workers' series never shown, only {workers:?}; log in {}",
            dir.path().display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The `worker_id`s the page's worker KV gauges name.
fn worker_ids(metrics: &str) -> BTreeSet<&str> {
    metrics
        .lines()
        .filter(|l| l.starts_with("sluice_worker_kv_usage"))
        .filter_map(|l| l.split("worker_id=\"").nth(1)?.split('"').next())
        .collect()
}
