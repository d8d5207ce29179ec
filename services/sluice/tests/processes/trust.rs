//! Issue 16's faults against the mesh as separate `sluice` processes with a
//! real etcd-server on loopback, each service holding the mesh token
//! (`--mesh-token-file`), or mutual TLS from `sluice certs`:
//!
//! - internal RPCs (`Worker`, `Queue`, `Router`) without the token, or with
//!   a wrong one, are refused `UNAUTHENTICATED`; the mesh itself, calling
//!   with the token across processes, serves;
//! - poison `Worker.Generate` calls (a token id outside the vocabulary, a
//!   priority out of range) beside six running streams: refused at the
//!   boundary, and all six streams complete;
//! - a `Generate` naming a prefill endpoint discovery does not list never
//!   makes the worker dial it;
//! - connections that send nothing, and idle keep-alive ones, are closed;
//! - a 2 MB prompt is a 400 within a second while a small request is
//!   served; a body over `--max-body-bytes` is an OpenAI-shaped 413;
//! - with mutual TLS on every service, `sluice bench` over `https` with the
//!   CA is served end to end, and plain-text callers get nothing;
//! - with the mesh token, remote prefill over the raw `tcp` KV transport
//!   works between processes, and a stranger's connection to the decode
//!   worker's tcp KV port is refused and closed while transfers go on.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};
use sluice_proto::queue::v1 as qpb;
use sluice_proto::router::v1 as rpb;
use sluice_proto::worker::v1 as wpb;
use sluice_tests::etcd::EtcdServer;
use sluice_tests::http::{get, open, post_json};
use sluice_tests::process::{Proc, mesh_args, write_model};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tonic::Code;

const TOKEN: &str = "0123456789abcdef-trust-test-token";
const TOKEN_HEADER: &str = "x-sluice-mesh-token";

/// Starts `sluice ARGS` (listening on `127.0.0.1:0`) with `security`'s
/// flags; returns it with the address it reports.
async fn spawn(
    name: &'static str,
    args: &[&str],
    security: &[String],
    etcd: &str,
    log_dir: &std::path::Path,
) -> anyhow::Result<(Proc, String)> {
    let common = mesh_args(etcd, "trust-test", 2, None);
    Proc::spawn_listening(
        env!("CARGO_BIN_EXE_sluice"),
        args.iter()
            .copied()
            .chain(security.iter().map(String::as_str))
            .chain(common.iter().map(String::as_str)),
        &log_dir.join(format!("{name}.log")),
    )
    .await
}

/// etcd, the built-in model, a router, a queue, one decode worker (the
/// mocker, slowed so streams last) and a frontend, as separate processes on
/// known ports, each started with `security`'s flags.
struct Cluster {
    _etcd: EtcdServer,
    dir: tempfile::TempDir,
    http: String,
    queue: String,
    router: String,
    decode: String,
    _procs: Vec<Proc>,
}

impl Cluster {
    async fn start(
        dir: tempfile::TempDir,
        security: &[String],
        frontend_flags: &[&str],
        ready: impl AsyncFn(&str) -> bool,
    ) -> anyhow::Result<Self> {
        let etcd = EtcdServer::start().await?;
        let model = write_model(env!("CARGO_BIN_EXE_sluice"), dir.path())?;
        let url = etcd.url();
        let d = dir.path();
        let any = "127.0.0.1:0";
        let (p_router, router) =
            spawn("router", &["router", "--listen", any], security, &url, d).await?;
        let (p_queue, queue) =
            spawn("queue", &["queue", "--listen", any], security, &url, d).await?;
        let (p_decode, decode) = spawn(
            "decode",
            &[
                "decode",
                "--listen",
                any,
                "--model",
                &model,
                "--engine",
                "mocker",
                "--speedup-ratio",
                "0.5",
            ],
            security,
            &url,
            d,
        )
        .await?;
        let mut procs = vec![p_router, p_queue, p_decode];
        let mut args = vec!["frontend", "--listen", any, "--model", &model];
        args.extend_from_slice(frontend_flags);
        let (p_frontend, http) = spawn("frontend", &args, security, &url, d).await?;
        procs.push(p_frontend);
        let deadline = Instant::now() + Duration::from_secs(90);
        while !ready(&http).await {
            anyhow::ensure!(
                Instant::now() < deadline,
                "mesh not ready in 90 s; logs in {}",
                dir.path().display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Self {
            _etcd: etcd,
            dir,
            http,
            queue,
            router,
            decode,
            _procs: procs,
        })
    }
}

async fn plain_ready(http: &str) -> bool {
    match get(http, "/ready").await {
        Ok((200, body)) => serde_json::from_str::<Value>(&body)
            .map(|v| v["workers"] == 1)
            .unwrap_or(false),
        _ => false,
    }
}

async fn grpc(addr: &str) -> anyhow::Result<tonic::transport::Channel> {
    Ok(
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .connect_timeout(Duration::from_secs(5))
            .connect()
            .await?,
    )
}

fn with_token<T>(msg: T, token: Option<&str>) -> anyhow::Result<tonic::Request<T>> {
    let mut req = tonic::Request::new(msg);
    if let Some(t) = token {
        req.metadata_mut().insert(TOKEN_HEADER, t.parse()?);
    }
    Ok(req)
}

fn generate(prompt: Vec<u32>, max_tokens: u32) -> wpb::GenerateRequest {
    wpb::GenerateRequest {
        request_id: format!("direct-{}", prompt.len()),
        model: "sluice-tiny".into(),
        prompt_token_ids: prompt,
        sampling: Some(sluice_proto::common::v1::SamplingParams {
            max_tokens,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Drains a worker stream; the tokens it produced.
async fn drain(mut s: tonic::Streaming<wpb::GenerateResponse>) -> Result<usize, tonic::Status> {
    let mut tokens = 0;
    while let Some(m) = s.message().await? {
        tokens += m.token_ids.len();
    }
    Ok(tokens)
}

/// Whether `conn` is closed by the peer within `within`.
async fn closed_within(conn: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 256];
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

/// Reads one SSE stream to its end: (content chunks, error chunks, `[DONE]` seen).
async fn read_sse(
    reader: &mut tokio::io::BufReader<TcpStream>,
) -> anyhow::Result<(usize, Vec<String>, bool)> {
    let (mut chunks, mut errors) = (0, Vec::new());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        anyhow::ensure!(Instant::now() < deadline, "stream did not end in 60 s");
        let mut line = String::new();
        if tokio::time::timeout(Duration::from_secs(30), reader.read_line(&mut line))
            .await
            .context("no SSE line in 30 s")??
            == 0
        {
            return Ok((chunks, errors, false));
        }
        let Some(data) = line.trim().strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return Ok((chunks, errors, true));
        }
        let v: Value = serde_json::from_str(data)?;
        if v.get("error").is_some() {
            errors.push(data.to_owned());
        } else if v["choices"][0]["text"]
            .as_str()
            .is_some_and(|t| !t.is_empty())
        {
            chunks += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_mesh_token_internal_apis_refuse_strangers_and_no_request_harms_another()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("mesh-token");
    std::fs::write(&token_file, format!("{TOKEN}\n"))?;
    let security = vec![
        "--mesh-token-file".to_owned(),
        token_file.to_string_lossy().into_owned(),
    ];
    let c = Cluster::start(
        dir,
        &security,
        &["--idle-timeout", "2", "--header-read-timeout", "1"],
        plain_ready,
    )
    .await?;
    let logs = c.dir.path().display().to_string();

    // The mesh serves: the frontend, queue, router and worker call each
    // other with the token.
    let body = json!({"model": "sluice-tiny", "prompt": "The river runs", "max_tokens": 4});
    let (status, resp) = post_json(&c.http, "/v1/completions", &body).await?;
    assert_eq!(status, 200, "{resp}; logs in {logs}");

    // 1. Internal RPCs without the token, or with a wrong one: refused.
    let mut worker = wpb::worker_client::WorkerClient::new(grpc(&c.decode).await?);
    let mut queue = qpb::queue_client::QueueClient::new(grpc(&c.queue).await?);
    let mut router = rpb::router_client::RouterClient::new(grpc(&c.router).await?);
    for token in [None, Some("0123456789abcdef-not-the-token")] {
        let err = worker
            .generate(with_token(generate(vec![5, 6, 7], 16), token)?)
            .await
            .expect_err("Worker.Generate without the token");
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let err = worker
            .kv_snapshot(with_token(wpb::KvSnapshotRequest::default(), token)?)
            .await
            .expect_err("Worker.KvSnapshot without the token");
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let open = qpb::AdmitRequest {
            msg: Some(qpb::admit_request::Msg::Open(qpb::AdmitOpen {
                description: Some(sluice_proto::common::v1::RequestDescription {
                    request_id: "stranger".into(),
                    model: "sluice-tiny".into(),
                    prompt_tokens: 3,
                    ..Default::default()
                }),
                ..Default::default()
            })),
        };
        let err = queue
            .admit(with_token(futures::stream::iter([open]), token)?)
            .await
            .expect_err("Queue.Admit without the token");
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
        let err = router
            .route(with_token(rpb::RouteRequest::default(), token)?)
            .await
            .expect_err("Router.Route without the token");
        assert_eq!(err.code(), Code::Unauthenticated, "{err:?}");
    }
    // Public surfaces stay open.
    assert_eq!(get(&c.decode, "/metrics").await?.0, 200);
    let mut health = tonic_health::pb::health_client::HealthClient::new(grpc(&c.decode).await?);
    health
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await?;

    // 2. Poison calls beside six running streams.
    let stream_body = json!({"model": "sluice-tiny", "prompt": "The river runs",
                             "max_tokens": 60, "stream": true});
    let mut streams = Vec::new();
    for _ in 0..6 {
        let (status, _, mut reader) = open(
            &c.http,
            "POST",
            "/v1/completions",
            Some(stream_body.to_string()),
            &[],
        )
        .await?;
        assert_eq!(status, 200);
        // Running: wait for its first content line.
        let mut line = String::new();
        while !line.contains("\"text\"") {
            line.clear();
            anyhow::ensure!(reader.read_line(&mut line).await? > 0, "stream ended early");
        }
        streams.push(reader);
    }
    let poisons = [
        generate(vec![5, u32::MAX], 16),
        wpb::GenerateRequest {
            priority: i32::MAX,
            ..generate(vec![5, 6], 16)
        },
        wpb::GenerateRequest {
            sampling: Some(sluice_proto::common::v1::SamplingParams {
                top_logprobs: u32::MAX,
                stop: vec![String::new()],
                ..Default::default()
            }),
            ..generate(vec![5, 6], 16)
        },
        generate(Vec::new(), 16),
    ];
    for poison in poisons {
        let err = match worker.generate(with_token(poison, Some(TOKEN))?).await {
            Err(e) => e,
            Ok(s) => drain(s.into_inner())
                .await
                .expect_err("a poison call must fail"),
        };
        assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    }
    for (i, mut reader) in streams.into_iter().enumerate() {
        let (chunks, errors, done) = read_sse(&mut reader).await?;
        assert!(
            errors.is_empty(),
            "stream {i} saw {errors:?}; logs in {logs}"
        );
        assert!(done, "stream {i} ended without [DONE]");
        assert!(chunks > 0, "stream {i} produced nothing");
    }

    // 3. SSRF: a prefill endpoint the request names is never dialled.
    let bait = TcpListener::bind("127.0.0.1:0").await?;
    let bait_addr = bait.local_addr()?.to_string();
    for id in ["", "p-evil"] {
        let req = wpb::GenerateRequest {
            prefill_worker_id: id.into(),
            prefill_worker_endpoint: bait_addr.clone(),
            ..generate((1..200).collect(), 4)
        };
        let stream = worker.generate(with_token(req, Some(TOKEN))?).await?;
        let tokens = drain(stream.into_inner()).await?;
        assert_eq!(tokens, 4, "served locally");
    }
    let dialled = tokio::time::timeout(Duration::from_millis(500), bait.accept()).await;
    assert!(dialled.is_err(), "the worker dialled {bait_addr}");

    // 4. Connections that send nothing are closed after the header-read
    // timeout (1 s); an idle keep-alive one after the idle timeout (2 s);
    // the server answers others meanwhile.
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(TcpStream::connect(&c.http).await?);
    }
    let mut keep_alive = TcpStream::connect(&c.http).await?;
    keep_alive
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await?;
    let mut head = [0u8; 12];
    keep_alive.read_exact(&mut head).await?;
    assert_eq!(&head[9..12], b"200");
    let started = Instant::now();
    assert_eq!(get(&c.http, "/health").await?.0, 200);
    for conn in &mut silent {
        assert!(
            closed_within(conn, Duration::from_secs(4)).await,
            "a silent connection is still open after {:?}",
            started.elapsed()
        );
    }
    assert!(
        closed_within(&mut keep_alive, Duration::from_secs(6)).await,
        "an idle keep-alive connection is still open after {:?}",
        started.elapsed()
    );

    // 5. A 2 MB prompt: a 400 within a second, while a small request is served.
    let big = json!({"model": "sluice-tiny", "prompt": "lorem ipsum ".repeat(2 * 1024 * 1024 / 12),
                     "max_tokens": 2});
    let small = json!({"model": "sluice-tiny", "prompt": "The river", "max_tokens": 2});
    let sent = Instant::now();
    let (big_res, small_res) = tokio::join!(
        async {
            let r = post_json(&c.http, "/v1/completions", &big).await;
            (r, sent.elapsed())
        },
        post_json(&c.http, "/v1/completions", &small)
    );
    let ((status, resp), took) = (big_res.0?, big_res.1);
    assert_eq!(status, 400, "{resp}");
    assert!(
        took < Duration::from_secs(1),
        "the 2 MB prompt took {took:?}"
    );
    let err: Value = serde_json::from_str(&resp)?;
    assert_eq!(err["error"]["code"], "context_length_exceeded", "{resp}");
    assert_eq!(small_res?.0, 200);

    // A body over --max-body-bytes (default 4 MiB): an OpenAI-shaped 413.
    let (status, resp) = oversized_post(&c.http, 5 * 1024 * 1024).await?;
    assert_eq!(status, 413, "{resp}");
    let err: Value = serde_json::from_str(&resp).with_context(|| resp.clone())?;
    assert_eq!(err["error"]["type"], "invalid_request_error", "{resp}");
    Ok(())
}

/// POSTs a body of `len` bytes without waiting to write it all (the server
/// may answer and close first): (status, body).
async fn oversized_post(http: &str, len: usize) -> anyhow::Result<(u16, String)> {
    let conn = TcpStream::connect(http).await?;
    let (mut rd, mut wr) = conn.into_split();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
    );
    wr.write_all(head.as_bytes()).await?;
    let writer = tokio::spawn(async move {
        let chunk = vec![b' '; 64 * 1024];
        let mut left = len;
        while left > 0 {
            let n = left.min(chunk.len());
            if wr.write_all(&chunk[..n]).await.is_err() {
                return;
            }
            left -= n;
        }
    });
    let mut resp = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), rd.read_to_end(&mut resp))
        .await
        .context("no answer to an oversized body in 10 s")??;
    writer.abort();
    let text = String::from_utf8_lossy(&resp).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("no status line in {text:?}"))?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body.lines()
            .filter(|l| l.starts_with('{'))
            .collect::<Vec<_>>()
            .join("")
    } else {
        body
    };
    Ok((status, body))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_mutual_tls_on_every_service_bench_over_https_is_served() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let certs = dir.path().join("certs");
    let status = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["certs", "--out"])
        .arg(&certs)
        .stdout(Stdio::null())
        .status()?;
    anyhow::ensure!(status.success(), "sluice certs failed");
    let path = |f: &str| certs.join(f).to_string_lossy().into_owned();
    let security = vec![
        "--tls-cert".to_owned(),
        path("mesh.pem"),
        "--tls-key".to_owned(),
        path("mesh-key.pem"),
        "--tls-ca".to_owned(),
        path("ca.pem"),
    ];
    // Ready once the frontend's (TLS) port accepts a handshake and knows
    // the worker: `sluice bench` itself is the probe of the data path.
    let c = Cluster::start(dir, &security, &[], async |http| {
        TcpStream::connect(http).await.is_ok()
    })
    .await?;
    let logs = c.dir.path().display().to_string();

    // Plain text to a TLS port gets no HTTP answer.
    let plain = tokio::time::timeout(Duration::from_secs(5), get(&c.http, "/health")).await;
    assert!(
        !matches!(plain, Ok(Ok((200, _)))),
        "a plain-text request was answered"
    );

    // Every hop (frontend → queue → router, router → worker, frontend →
    // worker) is mutual TLS; the client speaks https with the CA. Retried
    // until the mesh has found its members.
    let out = c.dir.path().join("bench");
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let status = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "bench",
                "--url",
                &format!("https://localhost:{}", port(&c.http)?),
            ])
            .args(["--ca", &path("ca.pem")])
            .args([
                "--model",
                "sluice-tiny",
                "--requests",
                "4",
                "--isl-mean",
                "16",
            ])
            .args([
                "--osl-mean",
                "4",
                "--timeout-secs",
                "60",
                "--no-progress",
                "--out",
            ])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()?;
        let records = std::fs::read_to_string(out.join("requests.jsonl")).unwrap_or_default();
        let ok = status.success()
            && records.lines().count() == 4
            && records
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .all(|r| r["error"].is_null() && r["output_tokens"] == 4);
        if ok {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "bench over https never succeeded: {records}; logs in {logs}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}

fn port(addr: &str) -> anyhow::Result<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .context("no port")
}

/// The token's proof on the raw `tcp` KV transport, between real processes:
/// the prefill worker writes the prompt's KV blocks into the decode worker
/// over `tcp` (opening its connections with the token), and a raw
/// connection that does not open with the token is answered with the
/// reason and closed; remote prefills before and after it succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_mesh_token_the_tcp_kv_port_takes_only_members() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let token_file = dir.path().join("mesh-token");
    std::fs::write(&token_file, format!("{TOKEN}\n"))?;
    let security = vec![
        "--mesh-token-file".to_owned(),
        token_file.to_string_lossy().into_owned(),
    ];
    let etcd = EtcdServer::start().await?;
    let model = write_model(env!("CARGO_BIN_EXE_sluice"), dir.path())?;
    let url = etcd.url();
    let d = dir.path();
    let worker = async |role: &'static str, extra: &[&str]| {
        let mut args = vec![
            role,
            "--model",
            &model,
            "--engine",
            "mocker",
            "--kv-transports",
            "tcp",
            "--listen",
            "127.0.0.1:0",
        ];
        args.extend_from_slice(extra);
        spawn(role, &args, &security, &url, d).await
    };
    let any = "127.0.0.1:0";
    let (p_decode, decode) = worker(
        "decode",
        &[
            "--kv-tcp-listen",
            "127.0.0.1:0",
            "--max-local-prefill-length",
            "8",
        ],
    )
    .await?;
    // The KV listener's port 0, as the worker logs it bound.
    let kv_tcp = Proc::logged(&d.join("decode.log"), "KV tcp listener bound", "address").await?;
    let _procs = [
        spawn("router", &["router", "--listen", any], &security, &url, d)
            .await?
            .0,
        spawn("queue", &["queue", "--listen", any], &security, &url, d)
            .await?
            .0,
        p_decode,
        worker("prefill", &[]).await?.0,
    ];
    let (_frontend, http) = spawn(
        "frontend",
        &["frontend", "--listen", any, "--model", &model],
        &security,
        &url,
        d,
    )
    .await?;
    let logs = d.display().to_string();
    let remote_ok = || async {
        let (_, page) = get(&decode, "/metrics").await?;
        anyhow::Ok(sluice_tests::wait::sum(
            &page,
            "sluice_worker_remote_prefill_total{outcome=\"ok\"}",
        ))
    };
    // Long, distinct prompts (nothing cached) go to the prefill worker once
    // the decode worker has found it in discovery.
    let mut n = 0;
    let mut complete = async || -> anyhow::Result<()> {
        n += 1;
        let prompt = format!("request {n}: {}", "the river runs to the sea ".repeat(8));
        let body = json!({"model": "sluice-tiny", "prompt": prompt, "max_tokens": 4});
        let (status, resp) = post_json(&http, "/v1/completions", &body).await?;
        anyhow::ensure!(status == 200, "{status} {resp}");
        Ok(())
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let served = complete().await;
        if served.is_ok() && remote_ok().await? > 0.0 {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "no remote prefill over tcp within 90 s (last: {served:?}); logs in {logs}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A stranger: a BEGIN frame for some transfer, without the hello.
    let mut stranger = TcpStream::connect(&kv_tcp).await?;
    let mut frame = Vec::new();
    frame.extend(b"SLKV");
    frame.extend(1u32.to_le_bytes()); // BEGIN
    frame.extend(1u32.to_le_bytes()); // one block
    frame.extend(4u32.to_le_bytes()); // id length
    frame.extend(0u64.to_le_bytes());
    frame.extend(b"t-id");
    stranger.write_all(&frame).await?;
    stranger.shutdown().await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), stranger.read_to_end(&mut answer))
        .await
        .context("the stranger's connection was neither answered nor closed in 10 s")??;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("SLKV") && answer.contains("mesh members only"),
        "{answer:?}"
    );

    // Members go on.
    let before = remote_ok().await?;
    complete().await?;
    assert!(
        remote_ok().await? > before,
        "the next remote prefill over tcp failed; logs in {logs}"
    );
    Ok(())
}
