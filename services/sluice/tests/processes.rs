//! The mesh as separate `sluice` processes with a real etcd-server on
//! loopback: a request is served end to end, then a decode worker is killed
//! with SIGKILL and the router stops placing on it within the lease TTL.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sluice_tests::etcd::EtcdServer;
use sluice_tests::free_port;
use sluice_tests::http::{get, post_json};

const TTL_SECS: u64 = 2;

struct Proc {
    name: &'static str,
    child: Child,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(
    name: &'static str,
    args: &[&str],
    etcd: &str,
    log_dir: &std::path::Path,
) -> anyhow::Result<Proc> {
    let log = std::fs::File::create(log_dir.join(format!("{name}-{}.log", free_port()?)))?;
    let child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .args([
            "--etcd",
            etcd,
            "--namespace",
            "proc-test",
            "--lease-ttl",
            &TTL_SECS.to_string(),
            "--drain-timeout",
            "2",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()?;
    Ok(Proc { name, child })
}

async fn complete(http: &str) -> anyhow::Result<(u16, Value)> {
    let body = json!({"model": "sluice-tiny", "prompt": "The river runs", "max_tokens": 3, "temperature": 0});
    let (status, resp) = post_json(http, "/v1/completions", &body).await?;
    Ok((
        status,
        serde_json::from_str(&resp).unwrap_or(Value::String(resp)),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separate_processes_serve_and_a_killed_worker_stops_receiving_requests()
-> anyhow::Result<()> {
    let etcd = EtcdServer::start().await?;
    let dir = tempfile::tempdir()?;
    let model = dir.path().join("sluice-tiny");
    let status = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["model", "init", "--out"])
        .arg(&model)
        .status()?;
    assert!(status.success());
    let model = model.to_string_lossy().into_owned();
    let url = etcd.url();
    let http_port = free_port()?;
    let http = format!("127.0.0.1:{http_port}");
    let listen = "127.0.0.1:0";

    let _router = spawn("router", &["router", "--listen", listen], &url, dir.path())?;
    let _queue = spawn("queue", &["queue", "--listen", listen], &url, dir.path())?;
    let decode_args = [
        "decode",
        "--listen",
        listen,
        "--model",
        &model,
        "--num-gpu-blocks",
        "256",
    ];
    let mut decode_a = spawn("decode", &decode_args, &url, dir.path())?;
    let _decode_b = spawn("decode", &decode_args, &url, dir.path())?;
    let _frontend = spawn(
        "frontend",
        &["frontend", "--listen", &http, "--model", &model],
        &url,
        dir.path(),
    )?;

    // Ready: both workers known.
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

    // Served end to end, on both workers over a few requests (router spreads idle load).
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..6 {
        let (status, v) = complete(&http).await?;
        assert_eq!(status, 200, "{v}");
        seen.insert(
            v["nvext"]["worker_id"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
        );
    }
    assert!(!seen.is_empty());

    // Kill one worker: no deregistration, only its lease can remove it.
    decode_a.child.kill()?;
    let _ = decode_a.child.wait();
    let killed = Instant::now();
    tokio::time::sleep(Duration::from_secs(TTL_SECS) + Duration::from_millis(1500)).await;

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
    let _ = decode_a.name;
    Ok(())
}
