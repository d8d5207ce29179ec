//! One streamed request against an OpenAI-compatible server, timed.
//!
//! HTTP/1.1 through hyper-util's pooled client, `http://` or `https://`
//! (verified against `--ca`, see [`super::tls`]). The
//! body is `/v1/completions` with the prompt as token ids (or
//! `/v1/chat/completions` with a text prompt), `stream: true`,
//! `stream_options.include_usage`, `max_tokens` = `min_tokens` = the planned
//! output length with `ignore_eos`, and `nvext.agent_hints.priority` when the
//! priority is not 0.
//!
//! Timing: TTFT is from just before the request is written to the first SSE
//! chunk that carries non-empty content (`choices[0].text` or
//! `choices[0].delta.content`); end-to-end is to `[DONE]`. Token counts come
//! from the `usage` chunk, or the number of content chunks when a server sends
//! none. A non-200 answer, a stream that carries an error object or ends
//! without `[DONE]`, a connection failure and a timeout are failures, each
//! with a kind (`"429"`, `stream_error`, `incomplete`, `connect`, `timeout`).

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Serialize;
use serde_json::{Value, json};

use super::BenchError;
use super::workload::Planned;

/// Which API the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Endpoint {
    /// `/v1/completions`, prompt as token ids (exact lengths and prefixes).
    Completions,
    /// `/v1/chat/completions`, prompt as text of one word per planned token.
    Chat,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct RequestError {
    /// HTTP status (`"429"`), `stream_error`, `incomplete`, `connect`, `io`, `timeout`.
    pub kind: String,
    pub detail: String,
    /// The `Retry-After` header of a refusal, as sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<String>,
}

/// What one request measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct RequestRecord {
    pub index: usize,
    pub priority: i32,
    /// Planned send time, ms from the start.
    pub scheduled_ms: f64,
    /// Actual send time, ms from the start.
    pub sent_ms: f64,
    pub ttft_ms: Option<f64>,
    pub e2e_ms: f64,
    pub input_tokens: u32,
    pub output_tokens: u32,
    pub cached_tokens: Option<u64>,
    /// `nvext.queue_wait_ms` of the final chunk, if the server sends it.
    pub queue_wait_ms: Option<f64>,
    /// The request's TTFT target in ms: the server's `nvext.ttft_target_ms`
    /// where it reports one, else the one the bench sent (`--ttft-targets`).
    pub ttft_target_ms: Option<f64>,
    /// The request's TPOT target in ms, as the bench sent it
    /// (`--tpot-targets`).
    pub tpot_target_ms: Option<f64>,
    pub worker_id: Option<String>,
    /// `nvext.routed_overlap_tokens`: the prompt tokens the router expected
    /// cached on the worker it chose (beside `cached_tokens`, what was).
    pub routed_overlap_tokens: Option<u64>,
    /// `nvext.routed_ttft_ms`: the router's predicted time from placement
    /// to the first token (beside `ttft_ms` less `queue_wait_ms`, what it
    /// took).
    pub routed_ttft_ms: Option<f64>,
    pub error: Option<RequestError>,
}

impl RequestRecord {
    /// The record of `p`, sent at `sent`, before any answer.
    pub(crate) fn unanswered(p: &Planned, start: Instant, sent: Instant) -> Self {
        Self {
            index: p.index,
            priority: p.priority,
            scheduled_ms: p.at.as_secs_f64() * 1000.0,
            sent_ms: ms(sent - start),
            ttft_ms: None,
            e2e_ms: 0.0,
            input_tokens: p.prompt.len as u32,
            output_tokens: 0,
            cached_tokens: None,
            queue_wait_ms: None,
            ttft_target_ms: None,
            tpot_target_ms: None,
            worker_id: None,
            routed_overlap_tokens: None,
            routed_ttft_ms: None,
            error: None,
        }
    }

    /// Served, with its first token within its TTFT target (a request
    /// without a known target counts when served).
    pub(crate) fn within_target(&self) -> bool {
        self.error.is_none()
            && match (self.ttft_ms, self.ttft_target_ms) {
                (Some(ttft), Some(target)) => ttft <= target,
                (Some(_), None) => true,
                (None, _) => false,
            }
            && match (self.itl_ms(), self.tpot_target_ms) {
                (Some(tpot), Some(target)) => tpot <= target,
                // One token: no time per token to miss.
                _ => true,
            }
    }

    /// Mean inter-token latency: (e2e − TTFT) / (output tokens − 1).
    pub(crate) fn itl_ms(&self) -> Option<f64> {
        let ttft = self.ttft_ms?;
        (self.output_tokens > 1).then(|| (self.e2e_ms - ttft) / f64::from(self.output_tokens - 1))
    }
}

/// The target: a pooled HTTP/1.1 client and the request URI.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    client: Client<super::tls::Connector, Full<Bytes>>,
    uri: http::Uri,
    model: String,
    endpoint: Endpoint,
    api_key: Option<String>,
    vocab: u32,
    /// `--ttft-targets`: ms by priority.
    ttft_targets: super::TargetsMs,
    /// `--tpot-targets`: ms by priority.
    tpot_targets: super::TargetsMs,
}

/// The request URI for `base` (`http(s)://host:port`, with or without `/v1`).
pub(crate) fn endpoint_uri(base: &str, endpoint: Endpoint) -> Result<http::Uri, BenchError> {
    let bad = |reason: String| BenchError::Flag {
        flag: "--url",
        reason,
    };
    let base = base.trim().trim_end_matches('/');
    if !(base.starts_with("http://") || base.starts_with("https://")) {
        return Err(bad(format!("{base:?}: use an http:// or https:// URL")));
    }
    let base = base.strip_suffix("/v1").unwrap_or(base);
    let path = match endpoint {
        Endpoint::Completions => "/v1/completions",
        Endpoint::Chat => "/v1/chat/completions",
    };
    format!("{base}{path}")
        .parse()
        .map_err(|e| bad(format!("{base:?}: {e}")))
}

impl Target {
    pub(crate) fn new(
        url: &str,
        model: String,
        endpoint: Endpoint,
        api_key: Option<String>,
        vocab: u32,
        ca: Option<&std::path::Path>,
    ) -> Result<Self, BenchError> {
        let uri = endpoint_uri(url, endpoint)?;
        let tls = match ca {
            Some(path) => Some(
                sluice_runtime::security::client_config_trusting(path).map_err(|e| {
                    BenchError::Flag {
                        flag: "--ca",
                        reason: format!(
                            "{e}: {}",
                            std::error::Error::source(&e)
                                .map(ToString::to_string)
                                .unwrap_or_default()
                        ),
                    }
                })?,
            ),
            None if uri.scheme_str() == Some("https") => {
                return Err(BenchError::Flag {
                    flag: "--ca",
                    reason: "an https:// URL needs --ca FILE: the CA certificate that signed the server's".into(),
                });
            }
            None => None,
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(10)));
        // Idle keep-alive connections are dropped well before a server's
        // usual 30 s idle/header timeout, so a reused one is never half-closed.
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(10))
            .build(super::tls::Connector::new(connector, tls));
        Ok(Self {
            client,
            uri,
            model,
            endpoint,
            api_key,
            vocab,
            ttft_targets: super::TargetsMs::new(),
            tpot_targets: super::TargetsMs::new(),
        })
    }

    /// Requests of the listed priorities carry these TTFT targets (ms).
    /// Sends `targets` (ms by priority) as each request's TPOT target.
    pub(crate) fn with_tpot_targets(mut self, targets: super::TargetsMs) -> Self {
        self.tpot_targets = targets;
        self
    }

    pub(crate) fn with_ttft_targets(mut self, targets: super::TargetsMs) -> Self {
        self.ttft_targets = targets;
        self
    }

    /// The JSON body for `p`.
    pub(crate) fn body(&self, p: &Planned) -> Value {
        let tokens = p.prompt.tokens(self.vocab);
        let mut body = match self.endpoint {
            Endpoint::Completions => json!({ "model": self.model, "prompt": tokens }),
            Endpoint::Chat => {
                let text = tokens
                    .iter()
                    .map(|t| WORDS[*t as usize % WORDS.len()])
                    .collect::<Vec<_>>()
                    .join(" ");
                json!({ "model": self.model, "messages": [{ "role": "user", "content": text }] })
            }
        };
        if let Some(o) = body.as_object_mut() {
            o.insert("max_tokens".into(), json!(p.output_tokens));
            o.insert("min_tokens".into(), json!(p.output_tokens));
            o.insert("ignore_eos".into(), json!(true));
            o.insert("stream".into(), json!(true));
            o.insert("stream_options".into(), json!({ "include_usage": true }));
            let target = self.ttft_targets.get(&p.priority);
            let tpot = self.tpot_targets.get(&p.priority);
            if p.priority != 0 || target.is_some() || tpot.is_some() {
                let mut hints = json!({ "priority": p.priority });
                if let Some(ms) = target {
                    hints["ttft_target_ms"] = json!(ms);
                }
                if let Some(ms) = tpot {
                    hints["tpot_target_ms"] = json!(ms);
                }
                o.insert("nvext".into(), json!({ "agent_hints": hints }));
            }
        }
        body
    }

    /// Sends `p` now and measures it; `start` is the run's time origin.
    pub(crate) async fn send(
        &self,
        p: &Planned,
        start: Instant,
        timeout: Duration,
    ) -> RequestRecord {
        let body = self.body(p);
        let sent = Instant::now();
        let mut rec = RequestRecord::unanswered(p, start, sent);
        rec.ttft_target_ms = self.ttft_targets.get(&p.priority).map(|&ms| f64::from(ms));
        rec.tpot_target_ms = self.tpot_targets.get(&p.priority).map(|&ms| f64::from(ms));
        let outcome = tokio::time::timeout(timeout, self.stream(body, sent, &mut rec)).await;
        rec.e2e_ms = ms(sent.elapsed());
        let err = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(RequestError {
                kind: "timeout".into(),
                detail: format!("no answer within {} s", timeout.as_secs_f64()),
                retry_after: None,
            }),
        };
        rec.error = err;
        rec
    }

    async fn stream(
        &self,
        body: Value,
        sent: Instant,
        rec: &mut RequestRecord,
    ) -> Result<(), RequestError> {
        let mut req = http::Request::post(self.uri.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::ACCEPT, "text/event-stream");
        if let Some(key) = &self.api_key {
            req = req.header(http::header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| fail("io", e.to_string()))?;
        let resp = self.client.request(req).await.map_err(|e| {
            let kind = if e.is_connect() { "connect" } else { "io" };
            fail(kind, format!("{e:?}"))
        })?;
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut body = resp.into_body();
        if status != http::StatusCode::OK {
            let mut text = Vec::new();
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame.map_err(|e| fail("io", e.to_string()))?.into_data()
                    && text.len() < 4096
                {
                    text.extend_from_slice(&data);
                }
            }
            return Err(RequestError {
                retry_after,
                ..fail(status.as_str(), String::from_utf8_lossy(&text).into_owned())
            });
        }
        let mut parser = SseParser::default();
        let mut content_chunks = 0u32;
        let mut usage_tokens = None;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| fail("io", e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            let now = Instant::now();
            for event in parser.push(&data) {
                if event == "[DONE]" {
                    rec.output_tokens = usage_tokens.unwrap_or(content_chunks);
                    return Ok(());
                }
                let v: Value = serde_json::from_str(&event)
                    .map_err(|e| fail("stream_error", format!("bad SSE JSON: {e}")))?;
                if v.get("error").is_some() {
                    return Err(fail("stream_error", v.to_string()));
                }
                if has_content(&v) {
                    content_chunks += 1;
                    if rec.ttft_ms.is_none() {
                        rec.ttft_ms = Some(ms(now - sent));
                    }
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    usage_tokens = u
                        .get("completion_tokens")
                        .and_then(Value::as_u64)
                        .map(|n| n as u32);
                    if let Some(n) = u.get("prompt_tokens").and_then(Value::as_u64) {
                        rec.input_tokens = n as u32;
                    }
                    rec.cached_tokens = u
                        .pointer("/prompt_tokens_details/cached_tokens")
                        .and_then(Value::as_u64);
                }
                if let Some(nv) = v.get("nvext") {
                    rec.queue_wait_ms = nv.get("queue_wait_ms").and_then(Value::as_f64);
                    if let Some(target) = nv
                        .get("ttft_target_ms")
                        .and_then(Value::as_f64)
                        .filter(|&ms| ms > 0.0)
                    {
                        rec.ttft_target_ms = Some(target);
                    }
                    rec.worker_id = nv
                        .get("worker_id")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    rec.routed_overlap_tokens =
                        nv.get("routed_overlap_tokens").and_then(Value::as_u64);
                    rec.routed_ttft_ms = nv.get("routed_ttft_ms").and_then(Value::as_f64);
                }
            }
        }
        rec.output_tokens = usage_tokens.unwrap_or(content_chunks);
        Err(fail("incomplete", "the stream ended without [DONE]".into()))
    }
}

fn fail(kind: &str, detail: String) -> RequestError {
    RequestError {
        kind: kind.into(),
        detail,
        retry_after: None,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Whether a chunk carries generated text.
fn has_content(v: &Value) -> bool {
    let Some(c) = v.pointer("/choices/0") else {
        return false;
    };
    let text = c
        .get("text")
        .or_else(|| c.pointer("/delta/content"))
        .and_then(Value::as_str);
    text.is_some_and(|t| !t.is_empty())
}

/// Words for chat prompts (one per planned token).
const WORDS: [&str; 16] = [
    "river", "stone", "light", "cloud", "field", "north", "quiet", "amber", "table", "green",
    "ocean", "paper", "glass", "tower", "maple", "ember",
];

/// Incremental Server-Sent Events parser: feed bytes, get each event's data
/// (its `data:` lines joined by `\n`). Comments and other fields are ignored.
#[derive(Debug, Default)]
pub(crate) struct SseParser {
    buf: BytesMut,
}

impl SseParser {
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut events = Vec::new();
        while let Some((end, sep)) = find_boundary(&self.buf) {
            let block = self.buf.split_to(end + sep);
            let text = String::from_utf8_lossy(&block[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                events.push(data.join("\n"));
            }
        }
        events
    }
}

/// The first blank line: (end of the event, length of the separator).
fn find_boundary(buf: &[u8]) -> Option<(usize, usize)> {
    (0..buf.len()).find_map(|i| {
        if buf[i..].starts_with(b"\n\n") {
            Some((i, 2))
        } else if buf[i..].starts_with(b"\r\n\r\n") {
            Some((i, 4))
        } else {
            None
        }
    })
}

#[cfg(test)]
mod tests {
    use super::super::trace::PromptSpec;
    use super::*;

    #[test]
    fn sse_parser_splits_events_across_chunks() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(
            p.push(b"1}\n\n: keep-alive\n\ndata:[DONE]\r\n\r\n"),
            vec!["{\"a\":1}".to_string(), "[DONE]".to_string()]
        );
        assert_eq!(p.push(b"event: x\ndata: a\ndata: b\n\n"), vec!["a\nb"]);
    }

    #[test]
    fn content_is_text_or_delta_content_and_not_empty() {
        assert!(has_content(&json!({"choices": [{"text": "hi"}]})));
        assert!(has_content(
            &json!({"choices": [{"delta": {"content": "x"}}]})
        ));
        assert!(!has_content(
            &json!({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
        ));
        assert!(!has_content(&json!({"choices": [], "usage": {}})));
    }

    #[test]
    fn endpoint_uri_accepts_base_with_or_without_v1() {
        let a = endpoint_uri("http://127.0.0.1:8000", Endpoint::Completions).expect("uri");
        let b = endpoint_uri("http://127.0.0.1:8000/v1/", Endpoint::Completions).expect("uri");
        assert_eq!(a, b);
        assert_eq!(a.path(), "/v1/completions");
        let c = endpoint_uri("http://h:1/v1", Endpoint::Chat).expect("uri");
        assert_eq!(c.path(), "/v1/chat/completions");
        assert_eq!(
            endpoint_uri("https://h:8443", Endpoint::Chat)
                .expect("uri")
                .scheme_str(),
            Some("https")
        );
        assert!(endpoint_uri("ftp://h", Endpoint::Chat).is_err());
        // https without a CA to verify the server with is refused up front.
        let err = Target::new("https://h:1", "m".into(), Endpoint::Chat, None, 100, None)
            .expect_err("https needs --ca");
        assert!(err.to_string().contains("--ca"), "{err}");
    }

    #[test]
    fn body_asks_for_exact_output_and_carries_priority() {
        let t = Target::new(
            "http://127.0.0.1:1",
            "m".into(),
            Endpoint::Completions,
            None,
            100,
            None,
        )
        .expect("target");
        let p = Planned {
            index: 0,
            at: Duration::ZERO,
            prompt: PromptSpec {
                len: 5,
                hash_ids: vec![],
                block_tokens: 1,
                tail_seed: 1,
            },
            output_tokens: 7,
            priority: 2,
        };
        let b = t.body(&p);
        assert_eq!(b["prompt"].as_array().map(Vec::len), Some(5));
        assert_eq!(b["max_tokens"], 7);
        assert_eq!(b["min_tokens"], 7);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["nvext"]["agent_hints"]["priority"], 2);
        let b0 = t.body(&Planned { priority: 0, ..p });
        assert!(b0.get("nvext").is_none());
    }
}
