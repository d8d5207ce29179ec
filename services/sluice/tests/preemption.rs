//! A preempted request through the whole mesh: a priority-5 request takes
//! the only slot of a mocker worker from a running priority-0 one. The
//! worker's `/metrics` counts the preemption under the victim's priority and
//! the tokens it computed again (none: the victim parks its blocks), and the
//! victim's `worker.generate` span says the same. One OTLP test per binary
//! (the subscriber is global).

use std::time::Duration;

use serde_json::{Value, json};
use sluice_tests::http::{get, post_json};
use sluice_tests::mesh::{Mesh, MeshOptions};
use sluice_tests::otlp::{attr, traced};
use sluice_tests::wait::sample;

fn completion(prompt: &str, max_tokens: u32, priority: i32) -> Value {
    json!({"model": "sluice-tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
           "nvext": {"agent_hints": {"priority": priority}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preempted_request_shows_in_worker_metrics_and_its_span() -> anyhow::Result<()> {
    let (collector, telemetry) = traced("sluice-test").await?;

    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.speedup_ratio = 5.0;
    opts.worker.max_num_seqs = 1;
    opts.worker.scheduling_policy = "priority".into();
    // The engine must see both requests: default holding would keep the
    // interactive one in the queue until the batch one's slot frees.
    opts.queue.no_default_holding = true;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?[0].clone();

    // About 300 decode steps of ~1.2 ms: long enough to be running when
    // the priority-5 request arrives.
    let http = mesh.http.clone();
    let low = tokio::spawn(async move {
        post_json(&http, "/v1/completions", &completion("batch work ", 300, 0)).await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, m) = get(&worker, "/metrics").await?;
        if sample(&m, "sluice_worker_running_sequences{rank=\"0\"}") == Some(1.0) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the batch request never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = post_json(
        &mesh.http,
        "/v1/completions",
        &completion("interactive ", 4, 5),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) = low.await??;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body)?;
    assert_eq!(v["usage"]["completion_tokens"], 300, "{v}");

    let (_, m) = get(&worker, "/metrics").await?;
    assert_eq!(
        sample(&m, "sluice_worker_preemptions_total{priority=\"0\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        sample(&m, "sluice_worker_preemptions_total{priority=\"5\"}"),
        None
    );
    assert_eq!(
        sample(&m, "sluice_worker_recomputed_tokens_total"),
        Some(0.0),
        "{m}"
    );
    mesh.stop().await?;
    telemetry.flush().await;

    let spans = collector.worker_generate_spans(2).await?;
    let by_priority = |p: &str| {
        spans
            .iter()
            .find(|s| attr(s, "priority").as_deref() == Some(p))
            .unwrap_or_else(|| panic!("no worker.generate span of priority {p}"))
    };
    let victim = by_priority("0");
    assert_eq!(attr(victim, "preemptions").as_deref(), Some("1"));
    assert_eq!(attr(victim, "recomputed_tokens").as_deref(), Some("0"));
    assert_eq!(attr(victim, "completion_tokens").as_deref(), Some("300"));
    let winner = by_priority("5");
    assert_eq!(attr(winner, "preemptions").as_deref(), Some("0"));
    Ok(())
}
