//! One disaggregated request yields one trace whose spans cover frontend →
//! queue → router → decode worker → prefill worker → KV transfer, with the
//! attributes that say why it waited and where it ran. An in-process
//! OTLP/gRPC collector receives the spans; one OTLP test per binary (the
//! subscriber is global).

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;
use sluice_tests::http::post_json;
use sluice_tests::mesh::{Mesh, MeshOptions};
use sluice_tests::otlp::{Span, attr, hex, traced};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_request_is_one_trace_across_every_hop() -> anyhow::Result<()> {
    let (collector, telemetry) = traced("sluice-test").await?;

    let mut opts = MeshOptions {
        prefill_workers: 1,
        ..Default::default()
    };
    opts.worker.max_local_prefill_length = 16;
    let mesh = Mesh::start(opts).await?;
    let prompt: Vec<u32> = (0..120u32).map(|i| (i * 13 + 7) % 800 + 3).collect();
    let body = json!({"model": "sluice-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                      "user": "tracer",
                      "nvext": {"agent_hints": {"priority": 2, "tpot_target_ms": 5000}}});
    let (status, resp) = post_json(&mesh.http, "/v1/completions", &body).await?;
    assert_eq!(status, 200, "{resp}");
    assert!(
        resp.contains("prefill_worker_id"),
        "the request must be disaggregated: {resp}"
    );
    mesh.stop().await?;
    telemetry.flush().await;

    let wanted = [
        "completions",                     // frontend root (http.request)
        "queue.admit",                     // frontend → queue
        "queue.lease",                     // the queue's lease (on the frontend's session)
        "route",                           // router's placement (on the queue's session)
        "worker.generate",                 // frontend's call and the decode worker's generation
        "kv.remote_prefill",               // decode worker's remote prefill
        "sluice.worker.v1.Worker/Prefill", // prefill worker server
        "kv.transfer",                     // KV blocks sent
    ];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (spans, trace_id) = loop {
        let spans = collector.spans().await;
        let root = spans.iter().find(|s| s.name == "completions");
        if let Some(root) = root {
            let trace: Vec<Span> = spans
                .iter()
                .filter(|s| s.trace_id == root.trace_id)
                .cloned()
                .collect();
            if wanted.iter().all(|w| trace.iter().any(|s| s.name == *w)) {
                break (trace, root.trace_id.clone());
            }
        }
        if tokio::time::Instant::now() > deadline {
            let names: Vec<(String, String)> = spans
                .iter()
                .map(|s| (s.name.clone(), hex(&s.trace_id)))
                .collect();
            panic!("missing spans; got {names:#?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!trace_id.is_empty());
    let by_name: HashMap<&str, &Span> = spans.iter().map(|s| (s.name.as_str(), s)).collect();
    // Why did it wait, where did it run.
    let root = by_name["completions"];
    assert_eq!(attr(root, "priority").as_deref(), Some("2"));
    // Whose request: the tenant, on the frontend's root and the queue's lease.
    assert_eq!(attr(root, "tenant").as_deref(), Some("tracer"));
    assert_eq!(
        attr(by_name["queue.lease"], "tenant").as_deref(),
        Some("tracer")
    );
    // The lease rides the frontend's session to the queue, yet its span is
    // the frontend's admission's child, not the session's.
    assert_eq!(
        by_name["queue.lease"].parent_span_id, by_name["queue.admit"].span_id,
        "queue.lease is a child of queue.admit"
    );
    assert!(attr(root, "worker_id").is_some_and(|w| w.starts_with("decode-")));
    // The generation rides the frontend's session to the worker, yet the
    // worker's span is the child of the frontend's span for this request.
    let generate: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "worker.generate")
        .collect();
    let served = generate
        .iter()
        .find(|s| attr(s, "prefill").as_deref() == Some("remote"))
        .expect("the decode worker's generation span");
    let called = generate
        .iter()
        .find(|s| attr(s, "prefill").is_none())
        .expect("the frontend's generation span");
    assert_eq!(
        served.parent_span_id, called.span_id,
        "the worker's generation is a child of the frontend's"
    );
    // The TPOT target the queue granted reaches the worker's engine with
    // the request (what prefill first reads to keep its rows decoding).
    assert_eq!(attr(called, "tpot_target_ms").as_deref(), Some("5000"));
    assert_eq!(
        attr(served, "tpot_target_ms").as_deref(),
        Some("5000"),
        "the worker's request carries the TPOT target: {served:?}"
    );
    // One `route` span per pool; the decode one chose the serving worker.
    let route = spans
        .iter()
        .find(|s| s.name == "route" && attr(s, "pool").as_deref() == Some("decode"))
        .expect("a decode placement span");
    assert!(
        spans
            .iter()
            .any(|s| s.name == "route" && attr(s, "pool").as_deref() == Some("prefill")),
        "a prefill placement span"
    );
    assert_eq!(
        attr(route, "worker_id"),
        attr(root, "worker_id"),
        "the router's span names the worker it chose: {route:?}"
    );
    assert!(
        attr(route, "candidates").is_some_and(|c| c.contains("prefill=")),
        "{route:?}"
    );
    assert!(attr(by_name["kv.transfer"], "transport").is_some());
    telemetry.shutdown().await;
    Ok(())
}
