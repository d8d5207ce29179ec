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
    opts.worker.engine = sluice_decode::EngineKind::Mocker;
    opts.queue.max_active = 1;
    opts.queue.max_pending = 1;
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
    let (status, head, rest) =
        tokio::time::timeout(Duration::from_secs(10), spawn_open(&mesh, completion(2, 0)))
            .await???;
    assert_eq!(status, 429, "{head}{rest}");
    assert!(
        retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
        "{head}"
    );

    // A priority-3 request displaces the held priority-0 one, which gets a
    // 429 with Retry-After naming why.
    let high = spawn_open(&mesh, completion(2, 3));
    let (status, head, rest) = tokio::time::timeout(Duration::from_secs(10), low).await???;
    assert_eq!(status, 429, "{head}{rest}");
    assert!(
        retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
        "{head}"
    );
    let err: Value = serde_json::from_str(&rest)?;
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
/// set): the queue fills the worker's `max_num_seqs` slots, holds a small
/// backlog and refuses the rest with 429 + `Retry-After`, lowest priority
/// first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_flags_shed_a_sustained_burst_by_priority() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_decode::EngineKind::Mocker;
    opts.worker.max_num_seqs = 2;
    assert_eq!(opts.queue.queue_threshold, None, "default flags");
    assert_eq!(opts.queue.max_active, 0, "default flags");
    let mesh = Mesh::start(opts).await?;

    // Two long priority-3 requests (about 10 s each) take both engine slots.
    let mut fillers = Vec::new();
    for _ in 0..2 {
        fillers.push(start_stream(&mesh, 1500, 3).await?);
    }
    // The queue learns the worker's max_num_seqs from the router's load view.
    queue_sees_a_worker(&mesh).await?;

    // 40 requests at once, priorities 0..3 interleaved.
    let burst: Vec<_> = (0..40)
        .map(|i| (i % 4, spawn_open(&mesh, completion(4, i % 4))))
        .collect();
    let mut served = [0usize; 4];
    let mut refused = 0;
    let mut pending = Vec::new();
    for (priority, handle) in burst {
        pending.push((priority, handle));
    }
    // Let the refusals come back, then free the slots for the held ones.
    sluice_tests::wait::until_true("20 refusals back", Duration::from_secs(30), || {
        let done = pending.iter().filter(|(_, h)| h.is_finished()).count();
        async move { Ok(done >= 20) }
    })
    .await?;
    drop(fillers);
    for (priority, handle) in pending {
        let (status, head, rest) =
            tokio::time::timeout(Duration::from_secs(60), handle).await???;
        match status {
            200 => served[priority as usize] += 1,
            429 => {
                refused += 1;
                assert!(
                    retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
                    "{head}"
                );
            }
            other => panic!("priority {priority}: {other} {head}{rest}"),
        }
    }
    assert!(refused >= 20, "most of the burst is refused: {served:?}");
    assert!(
        served[3] >= served[2] && served[2] >= served[1] && served[1] >= served[0],
        "served by priority: {served:?}"
    );
    assert!(served[3] > served[0], "served by priority: {served:?}");
    mesh.stop().await
}

/// Waits until the queue's load view from the router lists a worker (so
/// default holding knows its engine slots).
async fn queue_sees_a_worker(mesh: &Mesh) -> anyhow::Result<()> {
    let queue = mesh.endpoints("queue").await?.remove(0);
    sluice_tests::wait::until_true(
        "the queue's load view to list the worker",
        Duration::from_secs(30),
        || async {
            let (_, metrics) = get(&queue, "/metrics").await?;
            Ok(sluice_tests::wait::sum(&metrics, "sluice_queue_load_view_workers") >= 1.0)
        },
    )
    .await
}

/// Under standing overload (arrivals several times what the worker serves,
/// for longer than `--backlog-secs`) the queue keeps only a short backlog
/// and refuses at once the priority the higher one crowds out: late in the
/// run, priority 0 gets 429s naming the overload while priority 3 is
/// served, and what is served starts soon.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standing_overload_refuses_the_crowded_out_priority_at_once() -> anyhow::Result<()> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_decode::EngineKind::Mocker;
    opts.worker.max_num_seqs = 2;
    opts.queue.backlog_secs = 0.3;
    let mesh = Mesh::start(opts).await?;
    queue_sees_a_worker(&mesh).await?;

    // Priorities 3 and 0 alternating, every 10 ms for 3 s: each request
    // takes the worker ~60 ms, so two slots serve ~30 of the 200 per s.
    let start = tokio::time::Instant::now();
    let mut sent = Vec::new();
    for i in 0..300u32 {
        let priority = if i % 2 == 0 { 3 } else { 0 };
        sent.push((
            priority,
            start.elapsed(),
            spawn_open(&mesh, completion(48, priority)),
        ));
        tokio::time::sleep_until(start + Duration::from_millis(10 * u64::from(i + 1))).await;
    }
    let (mut late_served, mut late_overload) = ([0usize; 4], [0usize; 4]);
    for (priority, at, handle) in sent {
        let (status, head, rest) =
            tokio::time::timeout(Duration::from_secs(60), handle).await???;
        let late = at >= Duration::from_millis(1500);
        match status {
            200 if late => late_served[priority as usize] += 1,
            200 => {}
            429 => {
                assert!(
                    retry_after(&head).is_some_and(|s| (1..=60).contains(&s)),
                    "{head}"
                );
                if late && rest.contains("overloaded") {
                    late_overload[priority as usize] += 1;
                }
            }
            other => panic!("priority {priority}: {other} {head}{rest}"),
        }
    }
    assert!(
        late_overload[0] > 0,
        "priority 0 refused for the overload: {late_overload:?}"
    );
    assert_eq!(late_overload[3], 0, "{late_overload:?}");
    assert!(
        late_served[3] > late_served[0],
        "served late: {late_served:?}, refused for the overload: {late_overload:?}"
    );
    let queue = mesh.endpoints("queue").await?.remove(0);
    let (_, metrics) = get(&queue, "/metrics").await?;
    assert!(
        sluice_tests::wait::sample(
            &metrics,
            "sluice_queue_rejections_total{reason=\"overload\"}"
        )
        .is_some_and(|n| n > 0.0),
        "{metrics}"
    );
    mesh.stop().await
}
