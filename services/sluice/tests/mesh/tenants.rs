//! Tenants end to end: API keys name the tenant (the `user` field and the
//! tenant header cannot change it), the tenant reaches the queue and comes
//! back in `nvext`, quotas refuse with 429 and `Retry-After`, and per-tenant
//! metrics count what the queue charged.

use std::time::Duration;

use serde_json::{Value, json};
use sluice_proto::inference::v1 as ipb;
use sluice_tests::http::{get, open, request};
use sluice_tests::mesh::{Mesh, MeshOptions};
use tokio::io::{AsyncBufReadExt, AsyncReadExt};

fn completion(max_tokens: u32) -> Value {
    json!({"model": "sluice-tiny", "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
           "min_tokens": max_tokens, "ignore_eos": true, "temperature": 0})
}

fn parse(body: &str) -> Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

async fn post(mesh: &Mesh, body: &Value, headers: &[(&str, &str)]) -> anyhow::Result<(u16, Value)> {
    let (status, text) = request(
        &mesh.http,
        "POST",
        "/v1/completions",
        Some(body.to_string()),
        headers,
    )
    .await?;
    Ok((status, parse(&text)))
}

/// The queue's `/metrics` (its gRPC port serves them).
async fn queue_metrics(mesh: &Mesh) -> anyhow::Result<String> {
    let queue = mesh.endpoints("queue").await?;
    let endpoint = queue.first().map(String::as_str).unwrap_or_default();
    let addr = endpoint.trim_start_matches("http://");
    Ok(get(addr, "/metrics").await?.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_name_the_tenant_and_user_or_the_header_cannot_change_it() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "# key tenant weight\nsk-acme acme 2\nsk-solo\n")?;
    let mut opts = MeshOptions::default();
    opts.frontend.api_key_file = Some(keys);
    opts.queue.queue_policy = sluice_queue::Policy::Fair;
    let mesh = Mesh::start(opts).await?;

    // The scheme in capitals works; `user` names someone else: ignored.
    let mut body = completion(3);
    body["user"] = json!("globex");
    let (status, resp) = post(&mesh, &body, &[("Authorization", "BEARER sk-acme")]).await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["nvext"]["tenant"], "acme", "{resp}");

    // Claiming another tenant through the header is refused.
    let (status, resp) = post(
        &mesh,
        &completion(3),
        &[
            ("Authorization", "Bearer sk-acme"),
            ("x-sluice-tenant", "globex"),
        ],
    )
    .await?;
    assert_eq!(status, 403, "{resp}");
    assert_eq!(resp["error"]["code"], "tenant_mismatch");
    assert_eq!(resp["error"]["type"], "permission_error");
    // Naming one's own tenant is fine.
    let (status, _) = post(
        &mesh,
        &completion(3),
        &[
            ("Authorization", "bearer sk-acme"),
            ("x-sluice-tenant", "acme"),
        ],
    )
    .await?;
    assert_eq!(status, 200);

    // A bare key is a tenant of its own, named without the key.
    let (status, resp) = post(
        &mesh,
        &completion(3),
        &[("Authorization", "Bearer sk-solo")],
    )
    .await?;
    assert_eq!(status, 200, "{resp}");
    let solo = resp["nvext"]["tenant"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(
        solo.starts_with("key-") && !solo.contains("sk-solo"),
        "{solo}"
    );

    // gRPC: the `tenant` field may not name another tenant either.
    let mut client =
        ipb::inference_client::InferenceClient::connect(format!("http://{}", mesh.http)).await?;
    let generate = |tenant: &str| {
        let mut req = tonic::Request::new(ipb::GenerateRequest {
            model: "sluice-tiny".into(),
            input: Some(ipb::generate_request::Input::Tokens(ipb::TokenIds {
                ids: vec![5, 6, 7],
            })),
            sampling: Some(sluice_proto::common::v1::SamplingParams {
                max_tokens: 2,
                ..Default::default()
            }),
            tenant: tenant.into(),
            ..Default::default()
        });
        if let Ok(v) = "Bearer sk-acme".parse() {
            req.metadata_mut().insert("authorization", v);
        }
        req
    };
    let err = client
        .generate(generate("globex"))
        .await
        .expect_err("impersonation");
    assert_eq!(err.code(), tonic::Code::PermissionDenied);
    let mut stream = client.generate(generate("")).await?.into_inner();
    let mut serving = None;
    while let Some(msg) = stream.message().await? {
        serving = msg.serving.or(serving);
    }
    assert_eq!(serving.map(|s| s.tenant).as_deref(), Some("acme"));

    // Per-tenant metrics: TTFT at the frontend, tokens at the queue (the
    // output tokens reached it over the lease).
    let (_, metrics) = get(&mesh.http, "/metrics").await?;
    assert!(
        metrics.contains(r#"sluice_frontend_tenant_ttft_seconds_count{tenant="acme"} 3"#),
        "{metrics}"
    );
    let queue = queue_metrics(&mesh).await?;
    let output = queue
        .lines()
        .find(|l| {
            l.starts_with(r#"sluice_queue_tenant_served_tokens_total{kind="output",tenant="acme"}"#)
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(output, Some(3.0 + 3.0 + 2.0), "{queue}");
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_keys_the_header_or_user_names_the_tenant() -> anyhow::Result<()> {
    let mesh = Mesh::start(MeshOptions::default()).await?;
    let mut body = completion(2);
    body["user"] = json!("alice");
    let (status, resp) = post(&mesh, &body, &[]).await?;
    assert_eq!(status, 200, "{resp}");
    assert_eq!(resp["nvext"]["tenant"], "alice");
    let (_, resp) = post(&mesh, &body, &[("x-sluice-tenant", "bob")]).await?;
    assert_eq!(resp["nvext"]["tenant"], "bob", "the header wins");
    let (_, resp) = post(&mesh, &completion(2), &[]).await?;
    assert_eq!(resp["nvext"]["tenant"], "default");
    mesh.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_refuse_with_429_retry_after_and_an_error_naming_the_limit() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "sk-acme acme\nsk-solo solo\n")?;
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.frontend.api_key_file = Some(keys);
    opts.queue.tenant_limits = Some(
        "acme tpm=100\nsolo concurrency=1\n"
            .parse()
            .map_err(anyhow::Error::msg)?,
    );
    let mesh = Mesh::start(opts).await?;
    let acme = [("Authorization", "Bearer sk-acme")];

    // 4 prompt tokens and 120 output tokens: 24 more than the minute's 100.
    let (status, resp) = post(&mesh, &completion(120), &acme).await?;
    assert_eq!(status, 200, "{resp}");
    let (status, head, mut reader) = open(
        &mesh.http,
        "POST",
        "/v1/completions",
        Some(completion(1).to_string()),
        &acme,
    )
    .await?;
    let mut rest = String::new();
    reader.read_to_string(&mut rest).await?;
    assert_eq!(status, 429, "{head}{rest}");
    let retry_after: u64 = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("retry-after:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // 25 tokens at 100 a minute: 15 s, less whatever refilled meanwhile.
    assert!((10..=15).contains(&retry_after), "{head}");
    let err = parse(&rest);
    assert_eq!(err["error"]["type"], "tokens", "{err}");
    assert_eq!(err["error"]["code"], "rate_limit_exceeded");
    assert!(
        err["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("100 tokens per minute")),
        "{err}"
    );

    // `solo` may have one request at a time: a second one, while the first
    // streams, is refused.
    let solo = [("Authorization", "Bearer sk-solo")];
    let mut long = completion(1500);
    long["stream"] = json!(true);
    let (status, head, mut first) = open(
        &mesh.http,
        "POST",
        "/v1/completions",
        Some(long.to_string()),
        &solo,
    )
    .await?;
    assert_eq!(status, 200, "{head}");
    let mut line = String::new();
    first.read_line(&mut line).await?;
    let (status, resp) = post(&mesh, &completion(1), &solo).await?;
    assert_eq!(status, 429, "{resp}");
    assert_eq!(resp["error"]["type"], "requests", "{resp}");
    assert!(
        resp["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("1 concurrent requests")),
        "{resp}"
    );
    drop(first);
    // The dropped stream's lease ends; the next request is admitted.
    let mut admitted = false;
    for _ in 0..50 {
        let (status, _) = post(&mesh, &completion(1), &solo).await?;
        if status == 200 {
            admitted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(admitted, "the slot came back");
    let queue = queue_metrics(&mesh).await?;
    assert!(
        queue.contains(
            r#"sluice_queue_tenant_rejections_total{reason="quota_tokens",tenant="acme"} 1"#
        ),
        "{queue}"
    );
    mesh.stop().await
}
