//! No single point of failure, with separate `sluice` processes and a real
//! etcd-server on loopback: two routers, two queues, two decode workers
//! (the mocker engine) and a frontend. Under a steady load of concurrent
//! requests, each fault below must fail no request:
//!
//! - etcd stopped (SIGSTOP) for 10 s, long enough for every lease to
//!   expire, then continued: every member stays in every peer's view until
//!   it registers again, and the routers keep their workers' indexes;
//! - one of the two queues killed (SIGKILL): the frontend admits at the
//!   other one;
//! - one of the two routers killed (SIGKILL): the queues place with the
//!   other one;
//! - one of the two queues frozen (SIGSTOP), its connections still open:
//!   the frontend's admission there times out
//!   (`--queue-answer-timeout-ms`) and goes to the other queue, and no
//!   request hangs; continued (SIGCONT), it serves again;
//! - one of the two routers frozen: the queues' placement there times out
//!   and goes to the other router, which takes every placement after it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::etcd::EtcdServer;
use sluice_tests::http::{get, post_json};
use sluice_tests::process::{Proc, mesh_args, write_model};
use sluice_tests::wait::{self, sum};

const TTL_SECS: u64 = 2;
const GRACE_SECS: u64 = 5;
/// Concurrent clients, each sending one request after another.
const CLIENTS: usize = 6;

/// Starts `sluice ARGS` (which listen on `127.0.0.1:0`); returns it with
/// the address it reports.
async fn spawn(
    name: &str,
    args: &[&str],
    etcd: &str,
    log_dir: &std::path::Path,
) -> anyhow::Result<(String, Proc)> {
    let common = mesh_args(etcd, "failover-test", TTL_SECS, Some(GRACE_SECS));
    let (p, addr) = Proc::spawn_listening(
        env!("CARGO_BIN_EXE_sluice"),
        args.iter()
            .copied()
            .chain(common.iter().map(String::as_str)),
        &log_dir.join(format!("{name}.log")),
    )
    .await?;
    Ok((addr, p))
}

struct Cluster {
    etcd: EtcdServer,
    dir: tempfile::TempDir,
    http: String,
    /// `127.0.0.1:<port>` of each router and queue (gRPC and `/metrics`).
    routers: Vec<(String, Proc)>,
    queues: Vec<(String, Proc)>,
    _others: Vec<Proc>,
}

impl Cluster {
    async fn start() -> anyhow::Result<Self> {
        let etcd = EtcdServer::start().await?;
        let dir = tempfile::tempdir()?;
        let model = write_model(env!("CARGO_BIN_EXE_sluice"), dir.path())?;
        let url = etcd.url();
        let mut routers = Vec::new();
        let mut queues = Vec::new();
        for i in 0..2 {
            routers.push(
                spawn(
                    &format!("router-{i}"),
                    &["router", "--listen", "127.0.0.1:0"],
                    &url,
                    dir.path(),
                )
                .await?,
            );
        }
        for i in 0..2 {
            queues.push(
                spawn(
                    &format!("queue-{i}"),
                    &["queue", "--listen", "127.0.0.1:0"],
                    &url,
                    dir.path(),
                )
                .await?,
            );
        }
        let mut others = Vec::new();
        for i in 0..2 {
            let (_, p) = spawn(
                &format!("decode-{i}"),
                &[
                    "decode",
                    "--listen",
                    "127.0.0.1:0",
                    "--model",
                    &model,
                    "--engine",
                    "mocker",
                    "--num-gpu-blocks",
                    "512",
                ],
                &url,
                dir.path(),
            )
            .await?;
            others.push(p);
        }
        let (http, frontend) = spawn(
            "frontend",
            &["frontend", "--listen", "127.0.0.1:0", "--model", &model],
            &url,
            dir.path(),
        )
        .await?;
        others.push(frontend);
        let cluster = Self {
            etcd,
            dir,
            http,
            routers,
            queues,
            _others: others,
        };
        cluster
            .wait_members(2, 2, 2, Duration::from_secs(60))
            .await?;
        // Every queue has a placement session with every router.
        for _ in 0..8 {
            cluster.complete().await?;
        }
        Ok(cluster)
    }

    /// Waits until the frontend lists this many of each member.
    async fn wait_members(
        &self,
        workers: u64,
        queues: u64,
        routers: u64,
        within: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + within;
        let mut last = String::new();
        loop {
            // A start-up answer that is not the frontend's JSON (seen once:
            // a 200 with an empty body) is one more poll, not a failure.
            if let Ok((200, body)) = get(&self.http, "/ready").await {
                if let Ok(v) = serde_json::from_str::<Value>(&body)
                    && v["workers"] == workers
                    && v["queues"] == queues
                    && v["routers"] == routers
                {
                    return Ok(());
                }
                last = body;
            }
            assert!(
                Instant::now() < deadline,
                "the frontend did not list {workers} workers, {queues} queues and {routers} routers within {within:?}; last /ready: {last:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn complete(&self) -> anyhow::Result<()> {
        let (status, body) = complete(&self.http).await?;
        assert_eq!(status, 200, "{body}");
        Ok(())
    }

    async fn metrics(addr: &str) -> anyhow::Result<String> {
        let (status, page) = get(addr, "/metrics").await?;
        anyhow::ensure!(status == 200, "GET {addr}/metrics: {status}");
        Ok(page)
    }
}

impl Drop for Cluster {
    /// A failed test shows the end of every service's log (the directory
    /// goes with the test).
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let Ok(entries) = std::fs::read_dir(self.dir.path()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log")
                && let Ok(log) = std::fs::read_to_string(&path)
            {
                let lines: Vec<&str> = log.lines().collect();
                let tail = &lines[lines.len().saturating_sub(15)..];
                eprintln!("--- {} ---\n{}", path.display(), tail.join("\n"));
            }
        }
    }
}

async fn complete(http: &str) -> anyhow::Result<(u16, String)> {
    let body = json!({"model": "sluice-tiny", "prompt": "The river runs to the sea",
                      "max_tokens": 12, "temperature": 0});
    post_json(http, "/v1/completions", &body).await
}

/// One answer: status, body, how long it took.
type Answer = (u16, String, Duration);

/// Requests sent by [`CLIENTS`] clients until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    /// Requests answered so far, whatever the answer.
    answered: Arc<AtomicUsize>,
    clients: Vec<tokio::task::JoinHandle<Vec<Answer>>>,
}

/// What a [`Load`] saw.
struct Seen {
    total: usize,
    /// The answers that were not 200.
    failed: Vec<Answer>,
    /// The longest any request took.
    slowest: Duration,
    /// Requests that took longer than [`SLOW`].
    slow: usize,
}

/// Far longer than an unbroken request (milliseconds), shorter than a
/// request that waited out the frozen replica's keepalive or route timeout
/// twice.
const SLOW: Duration = Duration::from_secs(4);

impl Load {
    fn start(http: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let clients = (0..CLIENTS)
            .map(|_| {
                let (http, stop) = (http.to_string(), Arc::clone(&stop));
                let answered = Arc::clone(&answered);
                tokio::spawn(async move {
                    let mut out = Vec::new();
                    // Bounded: a stop that never comes ends the loop too.
                    for _ in 0..5_000 {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let sent = Instant::now();
                        let (status, body) = match complete(&http).await {
                            Ok(r) => r,
                            Err(e) => (0, format!("client error: {e}")),
                        };
                        out.push((status, body, sent.elapsed()));
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    out
                })
            })
            .collect();
        Self {
            stop,
            answered,
            clients,
        }
    }

    /// Waits until `n` more requests have been answered (how they were
    /// answered counts in [`Self::finish`]): the load runs through the
    /// mesh as it is now, instead of for a fixed time.
    async fn answers(&self, n: usize) -> anyhow::Result<()> {
        let target = self.answered.load(Ordering::Relaxed) + n;
        wait::until_true(
            &format!("{n} more answers to the load"),
            Duration::from_secs(30),
            || async { Ok(self.answered.load(Ordering::Relaxed) >= target) },
        )
        .await
    }

    /// Stops the clients; what they saw.
    async fn finish(self) -> anyhow::Result<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        let mut seen = Seen {
            total: 0,
            failed: Vec::new(),
            slowest: Duration::ZERO,
            slow: 0,
        };
        for c in self.clients {
            let answers = tokio::time::timeout(Duration::from_secs(60), c).await??;
            seen.total += answers.len();
            for a in answers {
                seen.slowest = seen.slowest.max(a.2);
                seen.slow += usize::from(a.2 > SLOW);
                if a.0 != 200 {
                    seen.failed.push(a);
                }
            }
        }
        Ok(seen)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_paused_for_10_s_under_load_fails_no_request() -> anyhow::Result<()> {
    let cluster = Cluster::start().await?;
    let load = Load::start(&cluster.http);
    load.answers(20).await?;

    // Far longer than every lease: all of them expire when etcd goes on.
    cluster.etcd.pause()?;
    let paused = Instant::now();
    let mut lowest = (u64::MAX, u64::MAX, u64::MAX);
    while paused.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    cluster.etcd.resume()?;
    // Through the expiry of every lease and the re-registrations that
    // follow, the frontend lists every member.
    let resumed = Instant::now();
    while resumed.elapsed() < Duration::from_secs(GRACE_SECS + 2) {
        if let Ok((200, body)) = get(&cluster.http, "/ready").await {
            let v: Value = serde_json::from_str(&body)?;
            let n = |k: &str| v[k].as_u64().unwrap_or(0);
            lowest = (
                lowest.0.min(n("workers")),
                lowest.1.min(n("queues")),
                lowest.2.min(n("routers")),
            );
        } else {
            lowest = (0, 0, 0);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let Seen { total, failed, .. } = load.finish().await?;
    eprintln!("{total} requests across the pause; members listed at least {lowest:?}");
    assert!(
        failed.is_empty(),
        "{} of {total} requests failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)],
    );
    assert!(total >= 50, "too little load to tell: {total} requests");
    assert_eq!(lowest, (2, 2, 2), "a member left the frontend's view");

    // The leases really were lost (each service registered again), and no
    // router dropped a worker (and its index) for it.
    for (i, (addr, _)) in cluster.routers.iter().enumerate() {
        let page = Cluster::metrics(addr).await?;
        assert_eq!(
            sum(&page, "sluice_router_departures_total"),
            0.0,
            "router {i} dropped a worker"
        );
        assert_eq!(
            sum(&page, "sluice_router_resyncs_total{reason=\"initial\"}"),
            2.0,
            "router {i} rebuilt a worker's index"
        );
    }
    let log = std::fs::read_to_string(cluster.dir.path().join("decode-0.log"))?;
    assert!(
        log.contains("re-registered in etcd"),
        "the pause did not expire decode-0's lease: {}",
        log.lines()
            .filter(|l| l.contains("etcd"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    Ok(())
}

/// Kills the first of the two replicas of `service` (`queue` or `router`)
/// under load: no request may fail. Returns the survivor's metrics.
async fn kill_one_under_load(cluster: &mut Cluster, service: &str) -> anyhow::Result<String> {
    // Both replicas take part before the kill.
    let (name, replicas) = match service {
        "queue" => ("sluice_queue_grants_total", &cluster.queues),
        _ => ("sluice_router_placements_total", &cluster.routers),
    };
    for (addr, _) in replicas {
        let page = Cluster::metrics(addr).await?;
        assert!(
            sum(&page, name) > 0.0,
            "{service} at {addr} took no part before the kill"
        );
    }
    let load = Load::start(&cluster.http);
    load.answers(20).await?;
    match service {
        "queue" => cluster.queues[0].1.kill()?,
        _ => cluster.routers[0].1.kill()?,
    }
    let killed = Instant::now();
    // Through the dead replica's listing (its lease, then the grace
    // period) and after it is gone.
    let (queues, routers) = if service == "queue" { (1, 2) } else { (2, 1) };
    cluster
        .wait_members(
            2,
            queues,
            routers,
            Duration::from_secs(TTL_SECS + GRACE_SECS + 10),
        )
        .await?;
    let gone = killed.elapsed();
    // Served without it.
    load.answers(20).await?;
    let Seen { total, failed, .. } = load.finish().await?;
    eprintln!("{total} requests; the killed {service} left the view after {gone:?}");
    assert!(
        failed.is_empty(),
        "{} of {total} requests failed after killing a {service}: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)],
    );
    assert!(total >= 50, "too little load to tell: {total} requests");
    // The survivor serves on its own.
    for _ in 0..4 {
        cluster.complete().await?;
    }
    let survivor = match service {
        "queue" => &cluster.queues[1].0,
        _ => &cluster.routers[1].0,
    };
    Cluster::metrics(survivor).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_queues_killed_under_load_fails_no_request() -> anyhow::Result<()> {
    let mut cluster = Cluster::start().await?;
    kill_one_under_load(&mut cluster, "queue").await?;
    let (_, page) = get(&cluster.http, "/metrics").await?;
    assert!(
        sum(&page, "sluice_frontend_failovers_total{service=\"queue\"}") > 0.0,
        "no admission moved to the surviving queue: {page}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_routers_killed_under_load_fails_no_request() -> anyhow::Result<()> {
    let mut cluster = Cluster::start().await?;
    let before = sum(
        &Cluster::metrics(&cluster.routers[1].0).await?,
        "sluice_router_placements_total",
    );
    let page = kill_one_under_load(&mut cluster, "router").await?;
    assert!(
        sum(&page, "sluice_router_placements_total") > before,
        "the surviving router placed nothing"
    );

    // With no router at all, a request fails for that reason, not for
    // want of workers.
    cluster.routers[1].1.kill()?;
    let (status, body) = complete(&cluster.http).await?;
    assert_eq!(status, 503, "{body}");
    let error: Value = serde_json::from_str(&body)?;
    assert_eq!(error["error"]["code"], "unavailable", "{body}");
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("router is unavailable")),
        "{body}"
    );
    Ok(())
}

/// The longest a request may take while a replica is frozen: a frozen
/// queue costs an admission `--queue-answer-timeout-ms` (2 s), or the
/// channel keepalive for a lease it already opened; a frozen router costs a
/// placement the queue's 5 s route timeout. Unbroken, a request takes
/// milliseconds.
const FROZEN_SLOWEST: Duration = Duration::from_secs(12);

/// Freezes (SIGSTOP) the first of the two replicas of `service` (`queue`
/// or `router`) under load: it keeps its connections open and answers
/// nothing, the way a hung process does. No request may fail or take
/// longer than [`FROZEN_SLOWEST`], and at most `max_slow` longer than
/// [`SLOW`], through its listing and after it leaves the view; continued
/// (SIGCONT), it registers again and serves again.
async fn freeze_one_under_load(
    cluster: &Cluster,
    service: &str,
    max_slow: usize,
) -> anyhow::Result<()> {
    let (name, replicas) = match service {
        "queue" => ("sluice_queue_grants_total", &cluster.queues),
        _ => ("sluice_router_placements_total", &cluster.routers),
    };
    let mut before = Vec::new();
    for (addr, _) in replicas {
        let n = sum(&Cluster::metrics(addr).await?, name);
        assert!(
            n > 0.0,
            "{service} at {addr} took no part before the freeze"
        );
        before.push(n);
    }
    let load = Load::start(&cluster.http);
    load.answers(20).await?;
    let (frozen_addr, frozen) = &replicas[0];
    frozen.pause()?;
    let paused = Instant::now();
    // Its lease expires (it sends no keepalive) and the grace passes: it
    // leaves the view. Until then it is listed, and tried.
    let (queues, routers) = if service == "queue" { (1, 2) } else { (2, 1) };
    let waited = cluster
        .wait_members(
            2,
            queues,
            routers,
            Duration::from_secs(TTL_SECS + GRACE_SECS + 10),
        )
        .await;
    // Served without it; continued whatever happened, so a failure leaves
    // no stopped process.
    let served = match &waited {
        Ok(_) => load.answers(20).await,
        Err(_) => Ok(()),
    };
    frozen.resume()?;
    waited?;
    served?;
    let gone = paused.elapsed();
    cluster
        .wait_members(2, 2, 2, Duration::from_secs(TTL_SECS + GRACE_SECS + 10))
        .await?;
    // Served with it back.
    load.answers(20).await?;
    let Seen {
        total,
        failed,
        slowest,
        slow,
    } = load.finish().await?;
    eprintln!(
        "{total} requests; the frozen {service} left the view after {gone:?}; slowest request {slowest:?}, {slow} slower than {SLOW:?}"
    );
    assert!(
        failed.is_empty(),
        "{} of {total} requests failed with a {service} frozen: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)],
    );
    assert!(total >= 50, "too little load to tell: {total} requests");
    assert!(
        slowest < FROZEN_SLOWEST,
        "a request took {slowest:?} with a {service} frozen"
    );
    assert!(
        slow <= max_slow,
        "{slow} requests took longer than {SLOW:?} with a {service} frozen (at most {max_slow} may)"
    );
    // The continued replica serves again.
    sluice_tests::wait::until_true(
        &format!("the continued {service} at {frozen_addr} to serve again"),
        Duration::from_secs(30),
        || async {
            cluster.complete().await?;
            Ok(sum(&Cluster::metrics(frozen_addr).await?, name) > before[0])
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_queues_frozen_under_load_fails_no_request() -> anyhow::Result<()> {
    let cluster = Cluster::start().await?;
    // Only a lease the queue opened just before it froze waits for the
    // channel's keepalive (8 s); every admission after the freeze costs at
    // most the 2 s answer timeout (without it, one in every client would
    // wait 8 s).
    freeze_one_under_load(&cluster, "queue", 2).await?;
    let (_, page) = get(&cluster.http, "/metrics").await?;
    assert!(
        sum(&page, "sluice_frontend_failovers_total{service=\"queue\"}") > 0.0,
        "no admission moved from the frozen queue: {page}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_routers_frozen_under_load_fails_no_request() -> anyhow::Result<()> {
    let cluster = Cluster::start().await?;
    // The placements sent to the frozen router wait out the 5 s route
    // timeout (and requests placed after them, on the same queue, with
    // them): every client once (6 in every run so far); then the router is
    // skipped. Twice that leaves room without letting every placement wait.
    freeze_one_under_load(&cluster, "router", 2 * CLIENTS).await?;
    let mut moved = 0.0;
    for (addr, _) in &cluster.queues {
        moved += sum(
            &Cluster::metrics(addr).await?,
            "sluice_queue_failovers_total{service=\"router\"}",
        );
    }
    assert!(moved > 0.0, "no placement moved from the frozen router");
    Ok(())
}
