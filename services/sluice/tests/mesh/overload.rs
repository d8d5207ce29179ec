//! A full queue sheds by priority, end to end: a higher-priority request
//! displaces the newest lowest-priority held one, which gets a 429 with
//! `Retry-After`; a request that outranks nothing held gets one too.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_tests::http::{get, open};
use sluice_tests::mesh::{Mesh, MeshOptions};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::net::TcpStream;

fn completion(max_tokens: u32, priority: i32) -> Value {
    json!({"model": "sluice-tiny", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
           "min_tokens": max_tokens, "ignore_eos": true, "temperature": 0,
           "nvext": {"agent_hints": {"priority": priority}}})
}

/// Sends `body` to `/v1/completions` in a task: (status, head, body).
fn spawn_open(
    mesh: &Mesh,
    body: Value,
) -> tokio::task::JoinHandle<anyhow::Result<(u16, String, String)>> {
    let http = mesh.http.clone();
    tokio::spawn(async move {
        let (status, head, mut reader) = open(
            &http,
            "POST",
            "/v1/completions",
            Some(body.to_string()),
            &[],
        )
        .await?;
        let mut rest = String::new();
        reader.read_to_string(&mut rest).await?;
        Ok((status, head, rest))
    })
}

/// Opens a streaming completion of `max_tokens` at `priority` and reads
/// its first event (it runs); dropping the reader ends it.
async fn start_stream(
    mesh: &Mesh,
    max_tokens: u32,
    priority: i32,
) -> anyhow::Result<BufReader<TcpStream>> {
    let mut body = completion(max_tokens, priority);
    body["stream"] = json!(true);
    let (status, head, mut reader) = open(
        &mesh.http,
        "POST",
        "/v1/completions",
        Some(body.to_string()),
        &[],
    )
    .await?;
    anyhow::ensure!(status == 200, "{head}");
    let mut line = String::new();
    reader.read_line(&mut line).await?;
    Ok(reader)
}

/// Checks a refusal: 429 with a `Retry-After` of 1..=60 s; its error body.
fn refused((status, head, rest): (u16, String, String)) -> anyhow::Result<Value> {
    assert_eq!(status, 429, "{head}{rest}");
    assert!(
        retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
        "{head}"
    );
    Ok(serde_json::from_str(&rest)?)
}

fn retry_after(head: &str) -> Option<u64> {
    head.lines().find_map(|l| {
        l.to_ascii_lowercase()
            .strip_prefix("retry-after:")
            .and_then(|v| v.trim().parse().ok())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_sheds_its_lowest_priority_with_429_and_retry_after() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.queue.max_active = 1;
    opts.queue.max_pending = 1;
    // Timed: no CPU-engine mesh beside it (see `exclusive`).
    let _machine = sluice_tests::mesh::exclusive().await;
    let mesh = Mesh::start(opts).await?;

    // One request runs (the only active slot) and streams for a while.
    let running = start_stream(&mesh, 400, 0).await?;

    // A priority-0 request is held: the queue is now full.
    let low = spawn_open(&mesh, completion(2, 0));
    let queue = mesh.endpoints("queue").await?;
    let queue = queue
        .first()
        .map(|e| e.trim_start_matches("http://").to_owned())
        .unwrap_or_default();
    let mut full = false;
    for _ in 0..100 {
        let (_, metrics) = get(&queue, "/metrics").await?;
        if metrics.contains(r#"sluice_queue_pending_requests{priority="0"} 1"#) {
            full = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(full, "the second request is held");

    // Another priority-0 request outranks nothing held: 429, Retry-After.
    refused(
        tokio::time::timeout(Duration::from_secs(10), spawn_open(&mesh, completion(2, 0)))
            .await???,
    )?;

    // A priority-3 request displaces the held priority-0 one, which gets a
    // 429 with Retry-After naming why.
    let high = spawn_open(&mesh, completion(2, 3));
    let err = refused(tokio::time::timeout(Duration::from_secs(10), low).await???)?;
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("displaced")),
        "{err}"
    );

    // The running request ends; the priority-3 one is served.
    drop(running);
    let (status, head, text) = tokio::time::timeout(Duration::from_secs(20), high).await???;
    assert_eq!(status, 200, "{head}{text}");
    mesh.stop().await
}

/// Default flags (no `--queue-threshold`, `--max-active` or `--max-pending`
/// set): a burst far larger than the worker's `max_num_seqs` into a fresh
/// mesh is held and served, nothing refused (its predicted waits are well
/// within the default TTFT target), the higher priorities first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_flags_serve_a_burst_into_a_fresh_mesh_by_priority() -> anyhow::Result<()> {
    let means = burst_by_priority(1).await?;
    assert!(
        means[3] < means[0],
        "priority 3 ahead of priority 0: mean TTFT by priority {means:?}"
    );
    Ok(())
}

/// The same burst through two queue replicas (the frontend spreads requests
/// over them round robin, so one holds priorities 0 and 2 and the other 1
/// and 3): they share the worker's slots and release in one priority order,
/// so each priority is served before the next lower one, across replicas.
/// Each replica releasing its own requests in its own order on its own
/// share of the slots would serve 2 beside 3 and 0 beside 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_queue_replicas_serve_a_burst_in_one_priority_order() -> anyhow::Result<()> {
    let means = burst_by_priority(2).await?;
    eprintln!("mean TTFT by priority with two replicas: {means:?}");
    assert!(
        means[3] < means[2] && means[2] < means[1] && means[1] < means[0],
        "each priority ahead of the next lower one: mean TTFT by priority {means:?}"
    );
    Ok(())
}

/// 40 requests at once, priorities 0..3 interleaved, on a mocker worker of
/// two slots behind `queues` queue replicas, all with default flags: every
/// one is served within the default target. Returns the mean TTFT (ms) by
/// priority.
async fn burst_by_priority(queues: usize) -> anyhow::Result<Vec<f64>> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.max_num_seqs = 2;
    opts.queues = queues;
    assert_eq!(opts.queue.queue_threshold, None, "default flags");
    assert_eq!(opts.queue.max_active, 0, "default flags");
    // Timed: no CPU-engine mesh beside it (see `exclusive`).
    let _machine = sluice_tests::mesh::exclusive().await;
    let mesh = Mesh::start(opts).await?;
    queues_see_the_mesh(&mesh, queues).await?;

    // 20 rounds of the worker's two slots.
    let mut burst = Vec::new();
    for i in 0..40 {
        burst.push((i % 4, spawn_open(&mesh, completion(8, i % 4))));
        // One at a time into the frontend's round robin over the replicas.
        tokio::task::yield_now().await;
    }
    let mut ttft_ms = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
    for (priority, handle) in burst {
        let (status, head, rest) =
            tokio::time::timeout(Duration::from_secs(120), handle).await???;
        assert_eq!(
            status, 200,
            "priority {priority}: nothing refused: {head}{rest}"
        );
        let body: Value = serde_json::from_str(&rest)?;
        let nvext = &body["nvext"];
        assert_eq!(
            nvext["ttft_target_ms"], 60_000,
            "the default target: {nvext}"
        );
        assert_eq!(nvext["ttft_target_met"], true, "{nvext}");
        ttft_ms[priority as usize].push(nvext["ttft_ms"].as_f64().unwrap_or(f64::MAX));
    }
    mesh.stop().await?;
    let mean = |v: &Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;
    Ok(ttft_ms.iter().map(mean).collect())
}

/// Waits until every one of the `queues` queue replicas lists the worker in
/// its load view and knows how many replicas there are.
async fn queues_see_the_mesh(mesh: &Mesh, queues: usize) -> anyhow::Result<()> {
    sluice_tests::wait::until_true(
        "every queue replica to see the worker and the other replicas",
        Duration::from_secs(30),
        || async {
            let endpoints = mesh.endpoints("queue").await?;
            if endpoints.len() < queues {
                return Ok(false);
            }
            for queue in endpoints {
                let (_, metrics) = get(&queue, "/metrics").await?;
                let workers = sluice_tests::wait::sum(&metrics, "sluice_queue_load_view_slots");
                let replicas = sluice_tests::wait::sum(&metrics, "sluice_queue_replicas");
                if workers < 1.0 || replicas < queues as f64 {
                    return Ok(false);
                }
            }
            Ok(true)
        },
    )
    .await
}

/// Waits until the queue's load view from the router lists a worker (so
/// default holding knows its engine slots).
async fn queue_sees_a_worker(mesh: &Mesh) -> anyhow::Result<()> {
    let queue = mesh.endpoints("queue").await?.remove(0);
    sluice_tests::wait::until_true(
        "the queue's load view to list the worker's slots",
        Duration::from_secs(30),
        || async {
            let (_, metrics) = get(&queue, "/metrics").await?;
            Ok(sluice_tests::wait::sum(&metrics, "sluice_queue_load_view_slots") >= 1.0)
        },
    )
    .await
}

/// Under standing overload (arrivals several times what the worker serves)
/// with a 1 s TTFT target on every request, the queue refuses what cannot
/// start in time, at admission or when the target passes while held, each
/// with a 429, `Retry-After` and the reason, lowest priority first; what it
/// serves starts within the target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_overload_refuses_by_ttft_target_lowest_priority_first() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.max_num_seqs = 2;
    // Timed: no CPU-engine mesh beside it (see `exclusive`).
    let _machine = sluice_tests::mesh::exclusive().await;
    let mesh = Mesh::start(opts).await?;
    queue_sees_a_worker(&mesh).await?;

    // Priorities 3 and 0 alternating, every 10 ms for 3 s: each request
    // takes the worker ~0.3 s, so two slots serve ~7 of the 100 per s.
    let start = tokio::time::Instant::now();
    let mut sent = Vec::new();
    for i in 0..300u32 {
        let priority = if i % 2 == 0 { 3 } else { 0 };
        let mut body = completion(48, priority);
        body["nvext"]["agent_hints"]["ttft_target_ms"] = json!(1000);
        sent.push((priority, spawn_open(&mesh, body)));
        tokio::time::sleep_until(start + Duration::from_millis(10 * u64::from(i + 1))).await;
    }
    let (mut served, mut refused, mut met) = ([0usize; 4], [0usize; 4], 0);
    for (priority, handle) in sent {
        let (status, head, rest) =
            tokio::time::timeout(Duration::from_secs(60), handle).await???;
        let body: Value = serde_json::from_str(&rest)?;
        match status {
            200 => {
                served[priority as usize] += 1;
                // Released before its target (a placement in flight at the
                // target may land a little after it).
                let wait = body["nvext"]["queue_wait_ms"].as_f64().unwrap_or(f64::MAX);
                assert!(wait < 1500.0, "granted at its target at the latest: {body}");
                if body["nvext"]["ttft_target_met"] == true {
                    met += 1;
                }
            }
            429 => {
                refused[priority as usize] += 1;
                assert!(
                    retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
                    "{head}"
                );
                let code = body["error"]["code"].as_str().unwrap_or_default();
                assert!(
                    code == "ttft_target_unmeetable" || code == "ttft_target_missed",
                    "refused for the target: {body}"
                );
            }
            other => panic!("priority {priority}: {other} {head}{rest}"),
        }
    }
    eprintln!("served {served:?}, refused {refused:?}, {met} within the target");
    let served_all: usize = served.iter().sum();
    assert!(
        met * 10 >= served_all * 9,
        "served within the target: {met} of {served_all}"
    );
    assert!(refused[0] > 0, "overload refuses: {refused:?}");
    assert!(
        refused[0] > refused[3] && served[3] > served[0],
        "priority 0 refused first: served {served:?}, refused {refused:?}"
    );
    let queue = mesh.endpoints("queue").await?.remove(0);
    let (_, metrics) = get(&queue, "/metrics").await?;
    let unmeetable = sluice_tests::wait::sample(
        &metrics,
        "sluice_queue_rejections_total{reason=\"ttft_target_unmeetable\"}",
    );
    assert!(unmeetable.is_some_and(|n| n > 0.0), "{metrics}");
    let (_, frontend) = get(&mesh.http, "/metrics").await?;
    assert!(
        frontend.lines().any(
            |l| l.starts_with("sluice_frontend_ttft_slo_requests_total{")
                && l.contains("outcome=\"met\"")
                && l.contains("priority=\"3\"")
        ),
        "{frontend}"
    );
    mesh.stop().await
}

/// A request the engine has not started when its TTFT target passes is
/// refused there, before any token, as the queue refuses one it still
/// holds: a 429 with `Retry-After` and the reason, counted by the worker
/// and the frontend. The request that kept it waiting goes on, and one with
/// the default target is served after it. (Default holding keeps a lower
/// priority in the queue while the only slot runs a higher one; without it
/// the request waits in the engine, as one granted in a race with a
/// higher priority's arrival does on defaults.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_engine_does_not_start_by_its_ttft_target_gets_a_429() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.speedup_ratio = 5.0;
    opts.worker.max_num_seqs = 1;
    opts.worker.scheduling_policy = "priority".into();
    opts.queue.no_default_holding = true;
    let _machine = sluice_tests::mesh::exclusive().await;
    let mesh = Mesh::start(opts).await?;
    let worker = mesh.endpoints("decode").await?.remove(0);

    // ~1,500 decode steps of ~1.2 ms: it runs for seconds, at priority 5.
    let mut hog = start_stream(&mesh, 1500, 5).await?;
    let mut late = completion(4, 0);
    late["nvext"]["agent_hints"]["ttft_target_ms"] = json!(300);
    let err =
        refused(tokio::time::timeout(Duration::from_secs(20), spawn_open(&mesh, late)).await???)?;
    assert_eq!(err["error"]["code"], "ttft_target_missed", "{err}");
    let (_, m) = get(&worker, "/metrics").await?;
    assert_eq!(
        sluice_tests::wait::sample(
            &m,
            "sluice_worker_requests_total{reason=\"ttft_target_missed\"}"
        ),
        Some(1.0),
        "the engine refused it, not the queue: {m}"
    );

    // The default target (60 s) is far: this one waits for the slot.
    let patient = spawn_open(&mesh, completion(4, 0));
    let mut rest = String::new();
    tokio::time::timeout(Duration::from_secs(60), hog.read_to_string(&mut rest)).await??;
    assert!(
        rest.contains("\"finish_reason\":\"length\"") && rest.contains("[DONE]"),
        "the priority-5 request goes on to its end: {}",
        rest.get(rest.len().saturating_sub(2000)..).unwrap_or(&rest)
    );
    let (status, head, rest) = tokio::time::timeout(Duration::from_secs(20), patient).await???;
    assert_eq!(status, 200, "{head}{rest}");

    let (_, frontend) = get(&mesh.http, "/metrics").await?;
    assert!(
        frontend
            .lines()
            .any(|l| l.starts_with("sluice_frontend_refusals_total{")
                && l.contains("reason=\"ttft_target_missed\"")
                && l.ends_with(" 1")),
        "{frontend}"
    );
    mesh.stop().await
}

/// Disaggregated: the prefill worker holds the TTFT target too. A long
/// priority-5 prompt keeps the prefill worker's steps busy for seconds; a
/// priority-0 request with a 300 ms target waits there, is refused when the
/// target passes, and the decode worker passes the refusal on (computed
/// locally it would be late too) as the client's 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_prefill_not_started_by_its_ttft_target_gets_a_429() -> anyhow::Result<()> {
    let mut opts = MeshOptions {
        prefill_workers: 1,
        ..MeshOptions::default()
    };
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    // 512-token steps of ~1.2 s: the long prompt takes three.
    opts.worker.speedup_ratio = 0.02;
    opts.worker.max_num_batched_tokens = 512;
    opts.worker.max_local_prefill_length = 32;
    let _machine = sluice_tests::mesh::exclusive().await;
    let mesh = Mesh::start(opts).await?;
    let decode = mesh.endpoints("decode").await?.remove(0);
    let prefill = mesh.endpoints("prefill").await?.remove(0);

    let long: Vec<u32> = (0..1500u32).map(|i| (i * 37 + 11) % 900 + 5).collect();
    let hog = spawn_open(
        &mesh,
        json!({"model": "sluice-tiny", "prompt": long, "max_tokens": 1, "temperature": 0,
               "nvext": {"agent_hints": {"priority": 5}}}),
    );
    // The long prompt's prefill is running on the prefill worker.
    sluice_tests::wait::until_true(
        "the long prompt running on the prefill worker",
        Duration::from_secs(20),
        || async {
            let (_, m) = get(&prefill, "/metrics").await?;
            Ok(
                sluice_tests::wait::sample(&m, "sluice_worker_running_sequences").unwrap_or(0.0)
                    >= 1.0,
            )
        },
    )
    .await?;
    let short: Vec<u32> = (0..64u32).map(|i| (i * 53 + 7) % 900 + 5).collect();
    let late = json!({"model": "sluice-tiny", "prompt": short, "max_tokens": 1,
                      "temperature": 0,
                      "nvext": {"agent_hints": {"priority": 0, "ttft_target_ms": 300}}});
    let err =
        refused(tokio::time::timeout(Duration::from_secs(20), spawn_open(&mesh, late)).await???)?;
    assert_eq!(err["error"]["code"], "ttft_target_missed", "{err}");
    let (_, m) = get(&decode, "/metrics").await?;
    assert_eq!(
        sluice_tests::wait::sample(
            &m,
            "sluice_worker_remote_prefill_total{outcome=\"ttft_target_missed\"}"
        ),
        Some(1.0),
        "the prefill worker refused it: {m}"
    );
    let (_, m) = get(&prefill, "/metrics").await?;
    assert_eq!(
        sluice_tests::wait::sample(
            &m,
            "sluice_worker_requests_total{reason=\"ttft_target_missed\"}"
        ),
        Some(1.0),
        "counted where it was refused: {m}"
    );
    let (status, head, rest) = tokio::time::timeout(Duration::from_secs(60), hog).await???;
    assert_eq!(status, 200, "the long prompt is served: {head}{rest}");
    mesh.stop().await
}
