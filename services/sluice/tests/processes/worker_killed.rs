//! The mesh as separate `sluice` processes with a real etcd-server on
//! loopback: a request is served end to end, then a decode worker is killed
//! with SIGKILL: requests placed on it before its lease expires are placed
//! again, and the router stops placing on it within the lease TTL and the
//! discovery grace period; and a
//! stream whose worker is killed mid-generation goes on on the other one.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::etcd::EtcdServer;
use sluice_tests::http::{get, post_json};
use sluice_tests::process::{Proc, mesh_args, write_model};

const TTL_SECS: u64 = 2;
/// How long a member whose lease expired stays listed (`--discovery-grace`).
const GRACE_SECS: u64 = 1;

/// Starts `sluice ARGS` (listening on `127.0.0.1:0`) logging to
/// `log_dir/NAME.log`; returns it with the address it reports.
async fn spawn(
    name: &str,
    args: &[&str],
    etcd: &str,
    log_dir: &std::path::Path,
) -> anyhow::Result<(Proc, String)> {
    let common = mesh_args(etcd, "proc-test", TTL_SECS, Some(GRACE_SECS));
    Proc::spawn_listening(
        env!("CARGO_BIN_EXE_sluice"),
        args.iter()
            .copied()
            .chain(common.iter().map(String::as_str)),
        &log_dir.join(format!("{name}.log")),
    )
    .await
}

async fn complete(http: &str) -> anyhow::Result<(u16, Value)> {
    let body = json!({"model": "sluice-tiny", "prompt": "The river runs", "max_tokens": 3, "temperature": 0});
    let (status, resp) = post_json(http, "/v1/completions", &body).await?;
    Ok((
        status,
        serde_json::from_str(&resp).unwrap_or(Value::String(resp)),
    ))
}

/// etcd, the built-in model, a router, a queue, two decode workers on
/// known ports and a frontend, as separate processes; ready when the
/// frontend knows both workers.
struct Cluster {
    _etcd: EtcdServer,
    dir: tempfile::TempDir,
    http: String,
    /// The decode workers' addresses.
    decode_addrs: Vec<String>,
    decode: Vec<Proc>,
    _others: Vec<Proc>,
}

impl Cluster {
    async fn start(decode_flags: &[&str]) -> anyhow::Result<Self> {
        let etcd = EtcdServer::start().await?;
        let dir = tempfile::tempdir()?;
        let model = write_model(env!("CARGO_BIN_EXE_sluice"), dir.path())?;
        let url = etcd.url();
        let listen = "127.0.0.1:0";
        let mut others = vec![
            spawn("router", &["router", "--listen", listen], &url, dir.path())
                .await?
                .0,
            spawn("queue", &["queue", "--listen", listen], &url, dir.path())
                .await?
                .0,
        ];
        let mut decode = Vec::new();
        let mut decode_addrs = Vec::new();
        for i in 0..2 {
            let mut args = vec!["decode", "--listen", listen, "--model", &model];
            args.extend_from_slice(decode_flags);
            let (p, addr) = spawn(&format!("decode-{i}"), &args, &url, dir.path()).await?;
            decode.push(p);
            decode_addrs.push(addr);
        }
        let (frontend, http) = spawn(
            "frontend",
            &["frontend", "--listen", listen, "--model", &model],
            &url,
            dir.path(),
        )
        .await?;
        others.push(frontend);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok((200, body)) = get(&http, "/ready").await
                && serde_json::from_str::<Value>(&body)?["workers"] == 2
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "mesh not ready in 60 s; logs in {}",
                dir.path().display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Self {
            _etcd: etcd,
            dir,
            http,
            decode_addrs,
            decode,
            _others: others,
        })
    }

    /// SIGKILL decode worker `i`: no deregistration, no drain.
    fn kill_decode(&mut self, i: usize) -> anyhow::Result<()> {
        self.decode[i].kill()?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_serve_and_a_killed_worker_stops_receiving_requests()
-> anyhow::Result<()> {
    let mut cluster = Cluster::start(&["--num-gpu-blocks", "256"]).await?;
    let http = cluster.http.clone();

    // Served end to end, on both workers: ties between idle workers go at
    // random, so keep asking until each has served one (30 requests all on
    // one worker by chance: 2^-29).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..30 {
        let (status, v) = complete(&http).await?;
        assert_eq!(status, 200, "{v}");
        seen.insert(
            v["nvext"]["worker_id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
        if seen.len() == 2 {
            break;
        }
    }
    assert_eq!(
        seen.len(),
        2,
        "30 requests were served by only these workers: {seen:?}"
    );

    // Kill one worker: no deregistration, only its lease can remove it.
    cluster.kill_decode(0)?;
    let killed = Instant::now();
    // While discovery still lists it, requests placed on it are placed
    // again on the survivor: none fails.
    let mut moved = 0;
    for _ in 0..6 {
        let (status, v) = complete(&http).await?;
        assert_eq!(status, 200, "request failed right after the kill: {v}");
        moved += v["nvext"]["migrations"].as_u64().unwrap_or(0);
    }
    eprintln!(
        "{moved} of 6 requests were placed on the dead worker first ({:?} after the kill)",
        killed.elapsed()
    );
    // Wait until the dead worker's lease (TTL, then the grace) has expired
    // and the frontend no longer counts it.
    let limit = Duration::from_secs(TTL_SECS + GRACE_SECS + 10);
    loop {
        let (_, ready) = get(&http, "/ready").await?;
        let workers = serde_json::from_str::<Value>(&ready)
            .map(|v| v["workers"].clone())
            .unwrap_or(Value::Null);
        if workers == 1 {
            break;
        }
        assert!(
            killed.elapsed() < limit,
            "the killed worker still counted {:?} after the kill (TTL {TTL_SECS} s, grace {GRACE_SECS} s): {ready}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // From now on every request is served, and by the survivor.
    let mut survivors = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let (status, v) = complete(&http).await?;
        assert_eq!(
            status,
            200,
            "request failed {:?} after the kill: {v}",
            killed.elapsed()
        );
        survivors.insert(
            v["nvext"]["worker_id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert_eq!(
        survivors.len(),
        1,
        "placements after the lease expired: {survivors:?}"
    );
    let (_, ready) = get(&http, "/ready").await?;
    assert_eq!(
        serde_json::from_str::<Value>(&ready)?["workers"],
        1,
        "{ready}"
    );
    Ok(())
}

/// Which decode worker runs a sequence now (from its `/metrics`).
async fn busy_worker(cluster: &Cluster) -> anyhow::Result<Option<usize>> {
    for (i, addr) in cluster.decode_addrs.iter().enumerate() {
        let Ok((200, metrics)) = get(addr, "/metrics").await else {
            continue;
        };
        let running = metrics
            .lines()
            .filter(|l| l.starts_with("sluice_worker_running_sequences{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        if running > 0.0 {
            return Ok(Some(i));
        }
    }
    Ok(None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_goes_on_when_its_worker_is_killed_mid_generation() -> anyhow::Result<()> {
    // The mocker: its tokens depend only on the previous token and the
    // position, so a continuation on another worker must give exactly the
    // tokens an unbroken run gives; slowed down so the kill lands mid-stream.
    let mut cluster = Cluster::start(&["--engine", "mocker", "--speedup-ratio", "0.5"]).await?;
    let http = cluster.http.clone();
    let body = |stream: bool| {
        json!({"model": "sluice-tiny", "prompt": "The river runs", "max_tokens": 200,
               "temperature": 0, "stream": stream})
    };
    let (status, reference) = post_json(&http, "/v1/completions", &body(false)).await?;
    assert_eq!(status, 200, "{reference}");
    let reference: Value = serde_json::from_str(&reference)?;
    let expected = reference["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert_eq!(reference["usage"]["completion_tokens"], 200, "{reference}");
    // The workers' gauges lag by up to 100 ms: wait until none still shows
    // the reference request, so the busy worker found below is the stream's.
    let idle_by = Instant::now() + Duration::from_secs(10);
    while busy_worker(&cluster).await?.is_some() {
        assert!(
            Instant::now() < idle_by,
            "a worker still shows a running sequence 10 s after the reference ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let (status, _, mut reader) = sluice_tests::http::open(
        &http,
        "POST",
        "/v1/completions",
        Some(body(true).to_string()),
        &[],
    )
    .await?;
    assert_eq!(status, 200);
    let mut text = String::new();
    let mut last: Option<Value> = None;
    let mut killed: Option<usize> = None;
    let mut deltas = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        assert!(
            Instant::now() < deadline,
            "stream did not end; logs in {}",
            cluster.dir.path().display()
        );
        let mut line = String::new();
        if tokio::io::AsyncBufReadExt::read_line(&mut reader, &mut line).await? == 0 {
            break;
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            break;
        }
        let chunk: Value = serde_json::from_str(data)?;
        assert!(
            chunk.get("error").is_none(),
            "the client saw an error: {chunk}"
        );
        if let Some(t) = chunk["choices"][0]["text"].as_str() {
            text.push_str(t);
            deltas += 1;
        }
        if killed.is_none() && deltas >= 3 {
            // Kill whichever worker runs the stream (its gauge updates every 100 ms).
            for _ in 0..50 {
                if let Some(i) = busy_worker(&cluster).await? {
                    cluster.kill_decode(i)?;
                    killed = Some(i);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(killed.is_some(), "no worker ran the stream");
        }
        last = Some(chunk);
    }
    let last = last.expect("chunks");
    assert_eq!(
        text, expected,
        "the continuation gives the unbroken run's tokens"
    );
    assert_eq!(last["choices"][0]["finish_reason"], "length", "{last}");
    assert_eq!(last["nvext"]["migrations"], 1, "{last}");
    let (_, metrics) = get(&http, "/metrics").await?;
    assert!(
        metrics.contains("sluice_frontend_migrations_total{outcome=\"ok\"} 1"),
        "{metrics}"
    );

    // With every worker dead (both still listed until their leases expire)
    // a request fails quickly with a clear status; it does not hang.
    let survivor = 1 - killed.expect("killed one");
    cluster.kill_decode(survivor)?;
    let asked = Instant::now();
    let (status, body) = post_json(&http, "/v1/completions", &body(false)).await?;
    assert_eq!(status, 503, "{body}");
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "{:?}",
        asked.elapsed()
    );
    Ok(())
}
