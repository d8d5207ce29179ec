//! Property tests of the boundaries (issue 16): generated inputs, valid,
//! nearly valid and hostile, driven through the whole mesh in one process
//! (the mocker engine, sped up).
//!
//! - ≥ 10⁵ HTTP bodies through the frontend's in-process router (no socket:
//!   `sluice_runtime::local`), streamed answers read to the end: no panic,
//!   no 5xx, no error chunk of a server error, no hang.
//! - ≥ 10⁴ generated messages through each gRPC service's handlers
//!   (`Inference`, `Worker`, `Queue`, `Router`, `KvTransfer`): no panic,
//!   no `INTERNAL` / `UNKNOWN` / `DATA_LOSS`, no hang.
//!
//! Generation is seeded (`SLUICE_FUZZ_SEED`, default fixed) so a failure
//! reproduces; the failing input is printed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use sluice_proto::common::v1 as common;
use sluice_proto::inference::v1 as ipb;
use sluice_proto::kv::v1 as kpb;
use sluice_proto::queue::v1 as qpb;
use sluice_proto::router::v1 as rpb;
use sluice_proto::worker::v1 as wpb;
use sluice_tests::mesh::{Mesh, MeshOptions};
use tonic::Code;
use tower::ServiceExt;

const HTTP_BODIES: usize = 100_000;
const GRPC_MESSAGES: usize = 10_000;
const IN_FLIGHT: usize = 16;
/// One input's time limit: generated requests ask for few tokens.
const EACH: Duration = Duration::from_secs(30);
/// One loop's time limit, with room for a slow machine: here each loop
/// takes well under a minute. Past it no new input starts, and the test
/// fails saying how far it got (a mesh that slowed to a crawl is a finding,
/// and a CI run that never ends says nothing).
const LOOP_LIMIT: Duration = Duration::from_secs(300);
/// An input slower than this is counted (and the slowest named) in a loop's
/// summary.
const SLOW: Duration = Duration::from_secs(2);
/// An input slower than this fails the loop.
const TOO_SLOW: Duration = Duration::from_secs(10);
/// A whole test's time limit, past every bound above: a test still running
/// then is stuck where no timer fires (a blocked runtime), and the process
/// ends saying where.
const WATCHDOG: Duration = Duration::from_secs(40 * 60);

/// Where each test is, for the watchdog.
static PHASES: std::sync::Mutex<Vec<(&str, String)>> = std::sync::Mutex::new(Vec::new());

fn phase(test: &'static str, what: impl Into<String>) {
    let what = what.into();
    let mut phases = PHASES.lock().unwrap_or_else(|e| e.into_inner());
    match phases.iter_mut().find(|(t, _)| *t == test) {
        Some(p) => p.1 = what,
        None => phases.push((test, what)),
    }
}

/// Ends the process if `test` is still running after [`WATCHDOG`], saying
/// where every test is.
fn watchdog(test: &'static str) -> sluice_tests::watchdog::Watchdog {
    sluice_tests::watchdog::watchdog(WATCHDOG, move || {
        let phases = PHASES.lock().unwrap_or_else(|e| e.into_inner()).clone();
        format!("fuzz test {test}; where each test is: {phases:?}")
    })
}

fn seed() -> u64 {
    std::env::var("SLUICE_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0016)
}

async fn mesh() -> anyhow::Result<Mesh> {
    let mut opts = MeshOptions::default();
    opts.worker.engine = sluice_worker::EngineKind::Mocker;
    opts.worker.speedup_ratio = 1000.0;
    opts.frontend.default_max_tokens = 4;
    Mesh::start(opts).await
}

// ---------------------------------------------------------------- values

fn pick<'a, T>(rng: &mut StdRng, xs: &'a [T]) -> &'a T {
    &xs[rng.random_range(0..xs.len())]
}

/// A string: short words, unicode, control characters, long runs.
fn string(rng: &mut StdRng) -> String {
    match rng.random_range(0..8) {
        0 => String::new(),
        1 => "x".repeat(rng.random_range(1..5000)),
        2 => (0..rng.random_range(1..20))
            .map(|_| char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('\u{fffd}'))
            .collect(),
        3 => "\u{0}\n\r\t\"\\".into(),
        4 => pick(rng, &["system", "user", "assistant", "tool", "wizard", ""]).to_string(),
        _ => pick(
            rng,
            &[
                "The river runs",
                "hello",
                "a b c",
                "<|im_start|>",
                "STOP",
                "🦀",
            ],
        )
        .to_string(),
    }
}

/// A number: small, boundary, huge, negative, fractional, non-integer.
fn number(rng: &mut StdRng) -> Value {
    match rng.random_range(0..10) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(u32::MAX),
        3 => json!(u64::MAX),
        4 => json!(i64::MIN),
        5 => json!(rng.random::<f64>() * 4.0 - 1.0),
        6 => json!(1e300),
        7 => json!(i32::MAX),
        _ => json!(rng.random_range(1..8)),
    }
}

/// Any JSON value, nested up to `depth`.
fn any(rng: &mut StdRng, depth: u32) -> Value {
    match rng.random_range(0..if depth == 0 { 5 } else { 7 }) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => number(rng),
        3 | 4 => json!(string(rng)),
        5 => Value::Array(
            (0..rng.random_range(0..6))
                .map(|_| any(rng, depth - 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.random_range(0..5))
                .map(|_| (string(rng), any(rng, depth - 1)))
                .collect(),
        ),
    }
}

/// A field's value: usually plausible, sometimes anything.
fn field(rng: &mut StdRng, plausible: impl FnOnce(&mut StdRng) -> Value) -> Value {
    if rng.random_bool(0.8) {
        plausible(rng)
    } else {
        any(rng, 2)
    }
}

fn token_ids(rng: &mut StdRng) -> Vec<u32> {
    let n = pick(rng, &[0usize, 1, 3, 8, 40, 300, 3000]);
    (0..*n)
        .map(|_| {
            if rng.random_bool(0.02) {
                pick(rng, &[u32::MAX, 1 << 20, 70_000]).to_owned()
            } else {
                rng.random_range(1..500)
            }
        })
        .collect()
}

// ---------------------------------------------------------------- HTTP

/// A request body for `chat` or `completions`: a valid request with some
/// fields changed, left out or added.
fn body(rng: &mut StdRng, chat: bool) -> Vec<u8> {
    match rng.random_range(0..20) {
        0 => {
            return (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect();
        }
        1 => return any(rng, 4).to_string().into_bytes(),
        2 => return b"{\"model\": \"sluice-tiny\", \"messages\": [".to_vec(),
        _ => {}
    }
    let mut o = serde_json::Map::new();
    let mut maybe = |rng: &mut StdRng, key: &str, p: f64, v: &dyn Fn(&mut StdRng) -> Value| {
        if rng.random_bool(p) {
            let value = field(rng, v);
            o.insert(key.to_owned(), value);
        }
    };
    maybe(rng, "model", 0.97, &|r| {
        json!(if r.random_bool(0.9) {
            "sluice-tiny".to_owned()
        } else {
            string(r)
        })
    });
    if chat {
        maybe(rng, "messages", 0.97, &|r| {
            Value::Array(
                (0..r.random_range(0..4))
                    .map(|_| {
                        let role = if r.random_bool(0.9) {
                            pick(r, &["user", "system", "assistant"]).to_string()
                        } else {
                            string(r)
                        };
                        let content = if r.random_bool(0.85) {
                            json!(string(r))
                        } else {
                            json!([{"type": pick(r, &["text", "image_url"]), "text": string(r)}])
                        };
                        json!({"role": role, "content": content})
                    })
                    .collect(),
            )
        });
    } else {
        maybe(rng, "prompt", 0.97, &|r| {
            if r.random_bool(0.5) {
                json!(string(r))
            } else {
                json!(token_ids(r))
            }
        });
    }
    maybe(rng, "max_tokens", 0.6, &|r| {
        if r.random_bool(0.85) {
            json!(r.random_range(1..5))
        } else {
            number(r)
        }
    });
    maybe(rng, "min_tokens", 0.1, &number);
    maybe(rng, "temperature", 0.3, &number);
    maybe(rng, "top_p", 0.2, &number);
    maybe(rng, "top_k", 0.1, &number);
    maybe(rng, "seed", 0.1, &number);
    maybe(rng, "n", 0.05, &number);
    maybe(rng, "repetition_penalty", 0.05, &number);
    maybe(rng, "frequency_penalty", 0.05, &number);
    maybe(rng, "presence_penalty", 0.05, &number);
    maybe(rng, "ignore_eos", 0.1, &|r| json!(r.random_bool(0.5)));
    maybe(rng, "stream", 0.4, &|r| json!(r.random_bool(0.7)));
    maybe(
        rng,
        "stream_options",
        0.2,
        &|r| json!({"include_usage": r.random_bool(0.5)}),
    );
    maybe(rng, "stop", 0.2, &|r| {
        if r.random_bool(0.5) {
            json!(string(r))
        } else {
            json!(
                (0..r.random_range(0..20))
                    .map(|_| string(r))
                    .collect::<Vec<_>>()
            )
        }
    });
    maybe(rng, "stop_token_ids", 0.05, &|r| json!(token_ids(r)));
    maybe(rng, "logprobs", 0.15, &|r| {
        if chat {
            json!(r.random_bool(0.5))
        } else {
            number(r)
        }
    });
    maybe(rng, "top_logprobs", 0.1, &number);
    maybe(rng, "user", 0.1, &|r| json!(string(r)));
    maybe(
        rng,
        "nvext",
        0.2,
        &|r| json!({"agent_hints": {"priority": number(r), "strict_priority": number(r), "osl": number(r)}}),
    );
    maybe(rng, "priority", 0.02, &number);
    maybe(rng, &string(&mut StdRng::seed_from_u64(0)), 0.02, &|r| {
        any(r, 1)
    });
    Value::Object(o).to_string().into_bytes()
}

/// A whole request: mostly the two generation routes, sometimes others.
fn http_request(rng: &mut StdRng) -> (http::Method, &'static str, Vec<(String, String)>, Vec<u8>) {
    let route = rng.random_range(0..100);
    let (method, path) = match route {
        0..=47 => (http::Method::POST, "/v1/chat/completions"),
        48..=95 => (http::Method::POST, "/v1/completions"),
        96 => (http::Method::GET, "/v1/models"),
        97 => (http::Method::GET, "/health"),
        98 => (http::Method::GET, "/v1/chat/completions"),
        _ => (http::Method::POST, "/v1/nope"),
    };
    let body = body(rng, path.contains("chat"));
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    if rng.random_bool(0.05) {
        headers.push((
            "x-sluice-priority".to_owned(),
            pick(rng, &["1", "-5", "99999999999", "high", "2147483647"]).to_string(),
        ));
    }
    if rng.random_bool(0.02) {
        headers.push((
            "x-request-id".to_owned(),
            "r".repeat(rng.random_range(1..600)),
        ));
    }
    if rng.random_bool(0.03) {
        headers[0].1 =
            pick(rng, &["text/plain", "", "application/json; charset=latin1"]).to_string();
    }
    (method, path, headers, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_http_bodies_never_panic_or_get_a_5xx() -> anyhow::Result<()> {
    const TEST: &str = "http";
    let _watchdog = watchdog(TEST);
    phase(TEST, "starting the mesh");
    let mesh = mesh().await?;
    phase(TEST, "generated bodies");
    let channel = sluice_runtime::grpc::channel(&mesh.http)?;
    let seed = seed();
    let started = std::time::Instant::now();
    let ok = Arc::new(AtomicUsize::new(0));
    let failures = bounded(TEST, HTTP_BODIES, |i| {
        let channel = channel.clone();
        let ok = Arc::clone(&ok);
        async move {
            let mut rng = StdRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
            let (method, path, headers, body) = http_request(&mut rng);
            let shown = String::from_utf8_lossy(&body[..body.len().min(600)]).into_owned();
            let mut req = http::Request::builder().method(method).uri(path);
            for (k, v) in &headers {
                if let Ok(v) = http::HeaderValue::from_str(v) {
                    req = req.header(k.as_str(), v);
                }
            }
            let req = match req.body(tonic::body::Body::new(Full::new(Bytes::from(body)))) {
                Ok(r) => r,
                Err(e) => return Some(format!("#{i}: building the request: {e}")),
            };
            let answer = tokio::time::timeout(EACH, async {
                let resp = channel.oneshot(req).await.map_err(|e| e.to_string())?;
                let status = resp.status();
                let body = resp
                    .into_body()
                    .collect()
                    .await
                    .map_err(|e| format!("reading the body: {e}"))?
                    .to_bytes();
                Ok::<_, String>((status, body))
            })
            .await;
            let (status, body) = match answer {
                Err(_) => return Some(format!("#{i} {path}: no answer in {EACH:?}: {shown}")),
                Ok(Err(e)) => return Some(format!("#{i} {path}: {e}: {shown}")),
                Ok(Ok(a)) => a,
            };
            let text = String::from_utf8_lossy(&body);
            if status.is_server_error() || text.contains("\"server_error\"") {
                return Some(format!(
                    "#{i} {path}: {status} {text}\n  for {headers:?} {shown}"
                ));
            }
            if status.is_success() {
                ok.fetch_add(1, Ordering::Relaxed);
            }
            None
        }
    })
    .await;
    assert!(failures.is_empty(), "seed {seed}:\n{}", failures.join("\n"));
    let ok = ok.load(Ordering::Relaxed);
    eprintln!(
        "{ok} of {HTTP_BODIES} generated requests were served (2xx), in {:.1?}",
        started.elapsed()
    );
    assert!(
        ok > HTTP_BODIES / 100,
        "the generator hardly reaches generation: {ok} served"
    );
    // Still serving.
    phase(TEST, "checking the mesh still serves");
    still_serves(&mesh).await?;
    phase(TEST, "stopping the mesh");
    mesh.stop().await
}

/// After the generated inputs, nothing they did is still held (a lease
/// left open, a sequence never freed) and an ordinary request is served.
/// Each wait is bounded; a failure shows the services' gauges.
async fn still_serves(mesh: &Mesh) -> anyhow::Result<()> {
    const LIMIT: Duration = Duration::from_secs(60);
    let held = [
        ("queue", "sluice_queue_active_leases"),
        ("queue", "sluice_queue_pending_requests"),
        ("decode", "sluice_worker_running_sequences"),
        ("decode", "sluice_worker_waiting_sequences"),
    ];
    let drained =
        sluice_tests::wait::until("the generated inputs to hold nothing", LIMIT, || async {
            let mut still = Vec::new();
            for (component, gauge) in held {
                let value = sluice_tests::wait::sum(&metrics(mesh, component).await, gauge);
                if value != 0.0 {
                    still.push(format!("{gauge} {value}"));
                }
            }
            anyhow::ensure!(still.is_empty(), "they still hold {}", still.join(", "));
            Ok(Some(()))
        })
        .await;
    if let Err(e) = drained {
        anyhow::bail!("{e:#}; the services' gauges:\n{}", gauges(mesh).await);
    }
    match tokio::time::timeout(LIMIT, mesh.complete_tokens(&[5, 6, 7], 2)).await {
        Ok(r) => r.map(drop),
        Err(_) => anyhow::bail!(
            "after the generated inputs, an ordinary completion got no answer in {LIMIT:?}; the services' gauges:\n{}",
            gauges(mesh).await
        ),
    }
}

/// A service's `/metrics` page, or why there is none (bounded).
async fn metrics(mesh: &Mesh, component: &str) -> String {
    tokio::time::timeout(Duration::from_secs(10), mesh.metrics(component))
        .await
        .map_err(anyhow::Error::from)
        .and_then(|r| r)
        .unwrap_or_else(|e| format!("(no metrics: {e})"))
}

/// Every series of the queue, router and first worker but histograms.
async fn gauges(mesh: &Mesh) -> String {
    let mut out = String::new();
    for component in ["queue", "router", "decode"] {
        let page = metrics(mesh, component).await;
        for line in page
            .lines()
            .filter(|l| !l.starts_with('#') && !l.contains("_bucket"))
        {
            out.push_str(&format!("  {component}: {line}\n"));
        }
    }
    out
}

// ---------------------------------------------------------------- gRPC

fn sampling(rng: &mut StdRng) -> Option<common::SamplingParams> {
    rng.random_bool(0.9).then(|| common::SamplingParams {
        max_tokens: *pick(rng, &[0, 1, 2, 4, 4, 4, u32::MAX]),
        min_tokens: *pick(rng, &[0, 0, 0, 1, 5, u32::MAX]),
        temperature: rng
            .random_bool(0.3)
            .then(|| *pick(rng, &[0.0, 0.7, 2.0, 3.0, -1.0, f32::NAN, f32::INFINITY])),
        top_p: rng
            .random_bool(0.2)
            .then(|| *pick(rng, &[0.0, 0.5, 1.0, 1.5, f32::NAN])),
        top_k: *pick(rng, &[0, 0, 0, 1, 50, u32::MAX]),
        seed: rng.random_bool(0.2).then(|| rng.random()),
        stop: (0..*pick(rng, &[0, 0, 1, 3, 20, 10_000]))
            .map(|_| string(rng))
            .collect(),
        stop_token_ids: token_ids(rng)
            .into_iter()
            .take(*pick(rng, &[0, 2, 100]))
            .collect(),
        ignore_eos: rng.random_bool(0.3),
        repetition_penalty: rng
            .random_bool(0.1)
            .then(|| *pick(rng, &[0.0, 1.1, 11.0, f32::NAN])),
        top_logprobs: *pick(rng, &[0, 0, 1, 5, 20, 21, u32::MAX]),
        logprobs: rng.random_bool(0.2),
        structured_output: rng.random_bool(0.1).then(|| structured_output(rng)),
    })
}

/// A grammar, well-formed or not: a bad one must be an `InvalidArgument`.
fn structured_output(rng: &mut StdRng) -> common::StructuredOutput {
    use common::structured_output::Kind;
    let kind = match rng.random_range(0..6) {
        0 => Kind::JsonObject(rng.random_bool(0.5)),
        1 => Kind::JsonSchema(r#"{"type":"integer","minimum":0,"maximum":9}"#.into()),
        2 => Kind::JsonSchema(string(rng)),
        3 => Kind::Regex(pick(rng, &["[a-z]{1,4}", "(", ""]).to_string()),
        4 => Kind::Lark(string(rng)),
        _ => Kind::JsonSchema(r#"{"type":"no-such-type"}"#.into()),
    };
    common::StructuredOutput { kind: Some(kind) }
}

fn hints(rng: &mut StdRng) -> Option<common::PriorityHints> {
    rng.random_bool(0.5).then(|| common::PriorityHints {
        priority: *pick(rng, &[0, 1, 3, -3, 1000, 1001, i32::MAX, i32::MIN]),
        strict_priority: *pick(rng, &[0, 1, 1000, u32::MAX]),
        osl: rng.random(),
        ttft_target_ms: *pick(rng, &[0, 1, 500, u32::MAX]),
        tpot_target_ms: *pick(rng, &[0, 1, 50, u32::MAX]),
    })
}

fn model(rng: &mut StdRng) -> String {
    if rng.random_bool(0.9) {
        "sluice-tiny".into()
    } else {
        string(rng)
    }
}

/// A request description as the queue and the router receive it: mostly
/// plausible, with the edges of every field.
fn description(rng: &mut StdRng) -> common::RequestDescription {
    common::RequestDescription {
        request_id: if rng.random_bool(0.9) {
            format!("q{}", rng.random::<u32>())
        } else {
            string(rng)
        },
        model: model(rng),
        priority: *pick(rng, &[0, 3, -3, i32::MAX, i32::MIN]),
        strict_priority: *pick(rng, &[0, 1, u32::MAX]),
        tenant: if rng.random_bool(0.8) {
            String::new()
        } else {
            string(rng)
        },
        tenant_weight: *pick(rng, &[0, 1, 3, u32::MAX]),
        prompt_tokens: *pick(rng, &[0, 5, 64, u32::MAX]),
        expected_output_tokens: rng.random(),
        ttft_target_ms: *pick(rng, &[0, 1, 1000, u32::MAX]),
        tpot_target_ms: *pick(rng, &[0, 1, 40, u32::MAX]),
        block_hashes: (0..*pick(rng, &[0usize, 1, 4, 5000]))
            .map(|_| rng.random())
            .collect(),
        block_size: *pick(rng, &[0, 16, 16, u32::MAX]),
        exclude_worker_ids: (0..*pick(rng, &[0usize, 1, 100]))
            .map(|_| string(rng))
            .collect(),
    }
}

fn worker_generate(rng: &mut StdRng, endpoint: &str) -> wpb::GenerateRequest {
    wpb::GenerateRequest {
        request_id: if rng.random_bool(0.95) {
            format!("f{}", rng.random::<u32>())
        } else {
            string(rng)
        },
        model: model(rng),
        prompt_token_ids: token_ids(rng),
        sampling: sampling(rng),
        priority: *pick(rng, &[0, 2, -7, i32::MAX]),
        dp_rank: *pick(rng, &[0, 0, 0, 1, u32::MAX]),
        prefill_worker_id: if rng.random_bool(0.1) {
            string(rng)
        } else {
            String::new()
        },
        prefill_worker_endpoint: if rng.random_bool(0.1) {
            pick(
                rng,
                &[endpoint, "127.0.0.1:1", "not an endpoint", "http://[::1"],
            )
            .to_string()
        } else {
            String::new()
        },
        placed: rng.random_bool(0.5),
        // A TTFT budget of any size: a refusal when it passes unstarted,
        // never a failure.
        ttft_budget_ms: *pick(rng, &[0, 0, 1, 5_000, u32::MAX]),
        // A TPOT target of any size: the engine only keeps its decode row
        // in every step.
        tpot_target_ms: *pick(rng, &[0, 0, 1, 50, u32::MAX]),
        // A peer to fetch the prefix from: unknown ones, absurd block
        // counts and ranks are a recompute, never a failure.
        prefix_source: rng
            .random_bool(0.1)
            .then(|| sluice_proto::common::v1::PrefixSource {
                worker_id: string(rng),
                dp_rank: *pick(rng, &[0, 1, u32::MAX]),
                blocks: *pick(rng, &[0, 1, 3, u32::MAX]),
            }),
    }
}

/// A bad status: the server failed rather than refusing the input.
fn bad(s: &tonic::Status) -> bool {
    matches!(s.code(), Code::Internal | Code::Unknown | Code::DataLoss)
}

/// Reads a server stream for a while (long-lived ones are dropped).
async fn sample_stream<T>(
    s: Result<tonic::Response<tonic::Streaming<T>>, tonic::Status>,
    until_end: bool,
) -> Result<(), tonic::Status> {
    let mut s = s?.into_inner();
    let read = async {
        while s.message().await?.is_some() {
            if !until_end {
                break;
            }
        }
        Ok::<_, tonic::Status>(())
    };
    match tokio::time::timeout(
        Duration::from_millis(if until_end { 25_000 } else { 200 }),
        read,
    )
    .await
    {
        Ok(r) => r,
        Err(_) if !until_end => Ok(()),
        Err(_) => Err(tonic::Status::deadline_exceeded("the stream did not end")),
    }
}

/// Sends `msgs` on a `GenerateSession` that stays open, and reads its
/// answers for a while: each generation's error is checked like a call's
/// status.
async fn session_answers(
    c: &mut wpb::worker_client::WorkerClient<sluice_runtime::grpc::TracedChannel>,
    msgs: Vec<wpb::GenerateSessionRequest>,
) -> Result<(), tonic::Status> {
    use wpb::generate_session_response::Msg;
    let outbound = futures::stream::iter(msgs).chain(futures::stream::pending());
    let mut answers = c.generate_session(outbound).await?.into_inner();
    let read = async {
        while let Some(answer) = answers.message().await? {
            if let Some(Msg::Error(e)) = answer.msg {
                let status = e.into_status();
                if bad(&status) {
                    return Err(status);
                }
            }
        }
        Ok(())
    };
    tokio::time::timeout(Duration::from_millis(500), read)
        .await
        .unwrap_or(Ok(()))
}

const GRPC: &str = "grpc";

/// Runs `input(i)` for `i` in `0..count`, `IN_FLIGHT` at a time, each as
/// a task of its own, starting none after `LOOP_LIMIT`; returns the first
/// five failures (an input's `Some`), and one more if the limit cut the
/// loop short or an input outlived it.
///
/// A task per input, not one task polling them all: the mesh's servers
/// answer in-process calls inside the caller's future, so here each input
/// runs on the runtime's workers as a request of `sluice up` does, keeps its
/// own timers, and a slow input cannot hold up the others' polling.
async fn bounded<F, Fut>(what: &str, count: usize, input: F) -> Vec<String>
where
    F: Fn(usize) -> Fut,
    Fut: Future<Output = Option<String>> + Send + 'static,
{
    let deadline = tokio::time::Instant::now() + LOOP_LIMIT;
    let mut running = tokio::task::JoinSet::new();
    let mut failures = Vec::new();
    let mut started = 0;
    while failures.len() < 5 {
        while started < count && running.len() < IN_FLIGHT && tokio::time::Instant::now() < deadline
        {
            running.spawn(input(started));
            started += 1;
        }
        // Every input ends within its own limit (`EACH`): one still running
        // well past the loop's is stuck where its timers do not fire.
        match tokio::time::timeout_at(deadline + 2 * EACH, running.join_next()).await {
            Ok(None) => break,
            Ok(Some(Ok(Some(failure)))) => failures.push(failure),
            Ok(Some(Ok(None))) => {}
            Ok(Some(Err(e))) => failures.push(format!("{what}: an input's task failed: {e}")),
            Err(_) => {
                failures.push(format!(
                    "{what}: {} inputs still running {:?} after the loop's limit",
                    running.len(),
                    2 * EACH
                ));
                break;
            }
        }
    }
    running.abort_all();
    if started < count && failures.len() < 5 {
        failures.push(format!(
            "{what}: only {started} of {count} generated inputs started in {LOOP_LIMIT:?}"
        ));
    }
    failures
}

/// Sends `count` generated messages through `call`; the first failures,
/// and one more if none was served at all (the generator must reach the
/// handlers, not only the checks in front of them).
async fn drive<F, Fut>(name: &'static str, count: usize, call: F) -> Vec<String>
where
    F: Fn(StdRng) -> Fut,
    Fut: Future<Output = Result<(), (tonic::Status, String)>> + Send + 'static,
{
    let seed = seed();
    phase(GRPC, format!("{name} messages"));
    let started = std::time::Instant::now();
    let served = Arc::new(AtomicUsize::new(0));
    // Inputs that took over SLOW, and the slowest: a loop that crawls
    // (every input waiting out some timeout before a refusal) shows here.
    let slow = Arc::new(std::sync::Mutex::new((
        0usize,
        Duration::ZERO,
        String::new(),
    )));
    let mut failures = bounded(name, count, |i| {
        let rng = StdRng::seed_from_u64(seed ^ (i as u64 + 1).wrapping_mul(0x2545_f491));
        let fut = call(rng);
        let (served, slow) = (Arc::clone(&served), Arc::clone(&slow));
        async move {
            let t0 = std::time::Instant::now();
            let answer = tokio::time::timeout(EACH, fut).await;
            let took = t0.elapsed();
            if took > SLOW {
                let mut s = slow.lock().unwrap_or_else(|e| e.into_inner());
                s.0 += 1;
                if took > s.1 {
                    let code = match &answer {
                        Ok(Err((status, _))) => format!("{:?}", status.code()),
                        Ok(Ok(())) => "served".into(),
                        Err(_) => "no answer".into(),
                    };
                    *s = (s.0, took, format!("#{i} ({code})"));
                }
            }
            match answer {
                Err(_) => Some(format!("{name} #{i}: no answer in {EACH:?}")),
                // Here the slowest input takes well under SLOW: one that
                // waits this long for whatever answer is a finding.
                Ok(r) if took > TOO_SLOW => Some(format!(
                    "{name} #{i}: an answer took {took:.1?} ({})",
                    match r {
                        Ok(()) => "served".to_string(),
                        Err((status, input)) => format!("{status:?}\n  for {input}"),
                    }
                )),
                Ok(Err((status, input))) if bad(&status) || hung(&status) => {
                    Some(format!("{name} #{i}: {status:?}\n  for {input}"))
                }
                Ok(Ok(())) => {
                    served.fetch_add(1, Ordering::Relaxed);
                    None
                }
                Ok(_) => None,
            }
        }
    })
    .await;
    let served = served.load(Ordering::Relaxed);
    let took = started.elapsed();
    let (slow_inputs, slowest, which) = slow.lock().unwrap_or_else(|e| e.into_inner()).clone();
    eprintln!(
        "{name}: {served} of {count} generated inputs served, in {took:.1?}; \
         {slow_inputs} took over {SLOW:?}, the slowest {slowest:.1?} {which}"
    );
    if served == 0 {
        failures.push(format!(
            "{name}: none of {count} generated inputs was served"
        ));
    }
    failures
}

/// A deadline status that is not a service's own answer: the queue refuses
/// a request whose generated deadline (1 ms) passed while it was held,
/// and says so (`sluice-reason: deadline`); any other is a hang.
fn hung(status: &tonic::Status) -> bool {
    status.code() == Code::DeadlineExceeded
        && status
            .metadata()
            .get(sluice_proto::REASON_HEADER)
            .is_none_or(|r| r != "deadline")
}

fn shown<T: std::fmt::Debug>(m: &T) -> String {
    let s = format!("{m:?}");
    s.chars().take(800).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_grpc_messages_never_panic_or_get_internal() -> anyhow::Result<()> {
    let _watchdog = watchdog(GRPC);
    phase(GRPC, "starting the mesh");
    let mesh = mesh().await?;
    let ch = sluice_runtime::grpc::channel;
    let decode = mesh.endpoints("decode").await?.remove(0);
    let queue = mesh.endpoints("queue").await?.remove(0);
    let router = mesh.endpoints("router").await?.remove(0);
    let mut failures = Vec::new();

    let inference = ipb::inference_client::InferenceClient::new(ch(&mesh.http)?);
    failures.extend(
        drive("Inference.Generate", GRPC_MESSAGES, |mut rng| {
            let mut c = inference.clone();
            async move {
                let input = match rng.random_range(0..5) {
                    0 => None,
                    1 => Some(ipb::generate_request::Input::Text(string(&mut rng))),
                    2 => Some(ipb::generate_request::Input::Tokens(ipb::TokenIds {
                        ids: token_ids(&mut rng),
                    })),
                    _ => Some(ipb::generate_request::Input::Chat(ipb::ChatMessages {
                        messages: (0..rng.random_range(0..4))
                            .map(|_| ipb::ChatMessage {
                                role: if rng.random_bool(0.8) {
                                    "user".into()
                                } else {
                                    string(&mut rng)
                                },
                                content: string(&mut rng),
                                tool_calls: (0..*pick(&mut rng, &[0, 0, 0, 1, 2]))
                                    .map(|_| ipb::ToolCall {
                                        id: string(&mut rng),
                                        name: string(&mut rng),
                                        arguments_json: if rng.random_bool(0.5) {
                                            any(&mut rng, 2).to_string()
                                        } else {
                                            string(&mut rng)
                                        },
                                    })
                                    .collect(),
                                tool_call_id: if rng.random_bool(0.8) {
                                    String::new()
                                } else {
                                    string(&mut rng)
                                },
                            })
                            .collect(),
                    })),
                };
                let req = ipb::GenerateRequest {
                    request_id: if rng.random_bool(0.9) {
                        String::new()
                    } else {
                        string(&mut rng)
                    },
                    model: model(&mut rng),
                    input,
                    sampling: sampling(&mut rng),
                    hints: hints(&mut rng),
                    tenant: if rng.random_bool(0.9) {
                        String::new()
                    } else {
                        string(&mut rng)
                    },
                    tools: (0..*pick(&mut rng, &[0, 0, 0, 1, 3]))
                        .map(|_| ipb::Tool {
                            name: if rng.random_bool(0.7) {
                                "f".into()
                            } else {
                                string(&mut rng)
                            },
                            description: string(&mut rng),
                            parameters_json: match rng.random_range(0..4) {
                                0 => String::new(),
                                1 => r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#
                                    .into(),
                                2 => any(&mut rng, 2).to_string(),
                                _ => string(&mut rng),
                            },
                        })
                        .collect(),
                    tool_choice: rng.random_bool(0.3).then(|| ipb::ToolChoice {
                        choice: Some(if rng.random_bool(0.5) {
                            ipb::tool_choice::Choice::Mode(rng.random_range(-1..5))
                        } else {
                            ipb::tool_choice::Choice::Function(if rng.random_bool(0.5) {
                                "f".into()
                            } else {
                                string(&mut rng)
                            })
                        }),
                    }),
                    parallel_tool_calls: rng.random_bool(0.3).then(|| rng.random()),
                    n: *pick(&mut rng, &[0, 0, 1, 2, 17, u32::MAX]),
                    ..Default::default()
                };
                let input = shown(&req);
                sample_stream(c.generate(req).await, true)
                    .await
                    .map_err(|s| (s, input))
            }
        })
        .await,
    );

    let worker = wpb::worker_client::WorkerClient::new(ch(&decode)?);
    failures.extend(
        drive("Worker", GRPC_MESSAGES, |mut rng| {
            let mut c = worker.clone();
            let decode = decode.clone();
            async move {
                match rng.random_range(0..11) {
                    0..=4 => {
                        let req = worker_generate(&mut rng, &decode);
                        let input = shown(&req);
                        sample_stream(c.generate(req).await, true)
                            .await
                            .map_err(|s| (s, input))
                    }
                    5 => {
                        // Many generations on one session: ids collide,
                        // aborts come before, after or instead of a request.
                        let msgs: Vec<wpb::GenerateSessionRequest> = (0..rng.random_range(0..6))
                            .map(|_| wpb::GenerateSessionRequest {
                                id: *pick(&mut rng, &[0, 1, 2, u64::MAX]),
                                request: rng
                                    .random_bool(0.8)
                                    .then(|| worker_generate(&mut rng, &decode)),
                                traceparent: string(&mut rng),
                            })
                            .collect();
                        let input = shown(&msgs);
                        session_answers(&mut c, msgs).await.map_err(|s| (s, input))
                    }
                    6 => {
                        let req = wpb::PrefillRequest {
                            request_id: string(&mut rng),
                            model: model(&mut rng),
                            prompt_token_ids: token_ids(&mut rng),
                            sampling: sampling(&mut rng),
                            priority: rng.random(),
                            destination: rng.random_bool(0.5).then(|| kpb::TransferDescriptor {
                                transfer_id: string(&mut rng),
                                block_ids: token_ids(&mut rng),
                                ..Default::default()
                            }),
                            placed: rng.random(),
                            ttft_budget_ms: rng.random(),
                        };
                        let input = shown(&req);
                        c.prefill(req).await.map(drop).map_err(|s| (s, input))
                    }
                    7 => {
                        let req = wpb::KvSnapshotRequest {
                            dp_rank: *pick(&mut rng, &[0, 1, u32::MAX]),
                        };
                        let input = shown(&req);
                        c.kv_snapshot(req).await.map(drop).map_err(|s| (s, input))
                    }
                    8 => {
                        let req = wpb::SubscribeKvEventsRequest {
                            from_seq: *pick(&mut rng, &[0, 1, u64::MAX, 1 << 40]),
                            dp_rank: *pick(&mut rng, &[0, 1, u32::MAX]),
                        };
                        let input = shown(&req);
                        sample_stream(c.subscribe_kv_events(req).await, false)
                            .await
                            .map_err(|s| (s, input))
                    }
                    9 => {
                        // A peer asking for a prefix: any descriptor, any
                        // region (a refusal, never a failure or a dial
                        // that hangs the call).
                        let req = wpb::FetchPrefixRequest {
                            request_id: string(&mut rng),
                            model: model(&mut rng),
                            prompt_token_ids: token_ids(&mut rng),
                            dp_rank: *pick(&mut rng, &[0, 1, u32::MAX]),
                            destination: rng.random_bool(0.7).then(|| kpb::TransferDescriptor {
                                transfer_id: string(&mut rng),
                                block_ids: token_ids(&mut rng),
                                skip_blocks: *pick(&mut rng, &[0, 1, 3, u32::MAX]),
                                timeout_ms: *pick(&mut rng, &[0, 1, 100]),
                                regions: (0..rng.random_range(0..3))
                                    .map(|_| kpb::Region {
                                        transport: rng.random_range(0..6),
                                        address: pick(
                                            &mut rng,
                                            &[
                                                "127.0.0.1:1",
                                                "@sluice-kv-1-x/1",
                                                "not an address",
                                                "",
                                            ],
                                        )
                                        .to_string(),
                                        ..Default::default()
                                    })
                                    .collect(),
                                ..Default::default()
                            }),
                        };
                        let input = shown(&req);
                        c.fetch_prefix(req).await.map(drop).map_err(|s| (s, input))
                    }
                    _ => {
                        let req = wpb::LoadRequest {
                            min_interval_ms: *pick(&mut rng, &[0, 1, 100, u32::MAX]),
                            max_interval_ms: *pick(&mut rng, &[0, 1, 100, u32::MAX]),
                        };
                        let input = shown(&req);
                        sample_stream(c.load(req).await, false)
                            .await
                            .map_err(|s| (s, input))
                    }
                }
            }
        })
        .await,
    );

    let kv = kpb::kv_transfer_client::KvTransferClient::new(ch(&decode)?);
    failures.extend(
        drive("KvTransfer.WriteBlocks", GRPC_MESSAGES, |mut rng| {
            let mut c = kv.clone();
            async move {
                let chunks: Vec<kpb::BlockChunk> = (0..rng.random_range(0..4))
                    .map(|_| kpb::BlockChunk {
                        transfer_id: string(&mut rng),
                        block_id: *pick(&mut rng, &[0, 1, u32::MAX]),
                        data: (0..*pick(&mut rng, &[0usize, 16, 4096]))
                            .map(|_| rng.random())
                            .collect(),
                        checksum: rng.random(),
                    })
                    .collect();
                let input = shown(&chunks);
                match c.write_blocks(futures::stream::iter(chunks)).await {
                    Err(s) if s.code() == Code::Unimplemented => Ok(()),
                    r => r.map(drop).map_err(|s| (s, input)),
                }
            }
        })
        .await,
    );

    let queue_c = qpb::queue_client::QueueClient::new(ch(&queue)?);
    failures.extend(
        drive("Queue", GRPC_MESSAGES, |mut rng| {
            let mut c = queue_c.clone();
            async move {
                if rng.random_bool(0.1) {
                    return c
                        .stats(qpb::StatsRequest {})
                        .await
                        .map(drop)
                        .map_err(|s| (s, "Stats".into()));
                }
                let admit = |rng: &mut StdRng| {
                    let msg = match rng.random_range(0..6) {
                        0 => None,
                        1 => Some(qpb::admit_request::Msg::Done(qpb::AdmitDone {
                            completion_tokens: *pick(rng, &[0, 8, u32::MAX]),
                        })),
                        2 => Some(qpb::admit_request::Msg::Started(qpb::AdmitStarted {})),
                        _ => Some(qpb::admit_request::Msg::Open(qpb::AdmitOpen {
                            description: rng.random_bool(0.95).then(|| description(rng)),
                            deadline_ms: *pick(rng, &[0, 1, 50, u32::MAX]),
                        })),
                    };
                    qpb::AdmitRequest { msg }
                };
                if rng.random_bool(0.3) {
                    // Many leases on one session: ids collide, messages
                    // come before `open` or after `done`.
                    let msgs: Vec<qpb::LeaseRequest> = (0..rng.random_range(0..6))
                        .map(|_| qpb::LeaseRequest {
                            lease_id: *pick(&mut rng, &[0, 1, 2, u64::MAX]),
                            request: rng.random_bool(0.9).then(|| admit(&mut rng)),
                            traceparent: string(&mut rng),
                        })
                        .collect();
                    let input = shown(&msgs);
                    return sample_stream(c.leases(futures::stream::iter(msgs)).await, false)
                        .await
                        .map_err(|s| (s, input));
                }
                let msgs: Vec<qpb::AdmitRequest> = (0..rng.random_range(0..4))
                    .map(|_| admit(&mut rng))
                    .collect();
                let input = shown(&msgs);
                sample_stream(c.admit(futures::stream::iter(msgs)).await, false)
                    .await
                    .map_err(|s| (s, input))
            }
        })
        .await,
    );

    let router_c = rpb::router_client::RouterClient::new(ch(&router)?);
    let route = |rng: &mut StdRng| rpb::RouteRequest {
        description: rng.random_bool(0.95).then(|| description(rng)),
        pool: rng.random_range(-1..4),
        commit: rng.random_bool(0.3),
        placement_id: rng.random(),
    };
    failures.extend(
        drive("Router", GRPC_MESSAGES, |mut rng| {
            let mut c = router_c.clone();
            async move {
                match rng.random_range(0..10) {
                    0..=4 => {
                        let req = route(&mut rng);
                        let input = shown(&req);
                        c.route(req).await.map(drop).map_err(|s| (s, input))
                    }
                    5 => {
                        let req = rpb::WatchLoadRequest {
                            model: model(&mut rng),
                            client_id: string(&mut rng),
                        };
                        let input = shown(&req);
                        sample_stream(c.watch_load(req).await, false)
                            .await
                            .map_err(|s| (s, input))
                    }
                    _ => {
                        let msgs: Vec<rpb::PlaceRequest> = (0..rng.random_range(0..5))
                            .map(|_| {
                                let msg = match rng.random_range(0..5) {
                                    0 => None,
                                    1 => Some(rpb::place_request::Msg::Hello(rpb::PlaceHello {
                                        client_id: string(&mut rng),
                                    })),
                                    2 => Some(rpb::place_request::Msg::Update(
                                        rpb::PlacementUpdate {
                                            placement_id: rng.random(),
                                            state: rng.random_range(-1..4),
                                        },
                                    )),
                                    3 => Some(rpb::place_request::Msg::Placed(rpb::Placement {
                                        placement_id: rng.random(),
                                        ..Default::default()
                                    })),
                                    _ => Some(rpb::place_request::Msg::Route(rpb::PlaceCall {
                                        call_id: rng.random(),
                                        request: rng.random_bool(0.9).then(|| route(&mut rng)),
                                        traceparent: string(&mut rng),
                                    })),
                                };
                                rpb::PlaceRequest { msg }
                            })
                            .collect();
                        let input = shown(&msgs);
                        sample_stream(c.place(futures::stream::iter(msgs)).await, false)
                            .await
                            .map_err(|s| (s, input))
                    }
                }
            }
        })
        .await,
    );

    assert!(
        failures.is_empty(),
        "seed {}:\n{}",
        seed(),
        failures.join("\n")
    );
    phase(GRPC, "checking the mesh still serves");
    still_serves(&mesh).await?;
    phase(GRPC, "stopping the mesh");
    mesh.stop().await
}
