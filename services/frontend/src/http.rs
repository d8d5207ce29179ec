//! The OpenAI-compatible HTTP surface: chat and text completions (SSE or
//! whole), models, health and readiness. Every handler ends in
//! [`Pipeline`]; errors render through [`FrontendError`].

use sluice_proto::common::v1::{FinishReason, Usage};
use sluice_tokens::tools::{ParsedCall, ToolFormat};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use futures::Stream;
use serde_json::{Value, json};
use tracing::Instrument;

use crate::auth::{Identity, TENANT_HEADER};
use crate::error::FrontendError;
use crate::metrics::RequestOutcome;
use crate::openai::{
    self, ChatRequest, CompletionRequest, GenerateParams, PRIORITY_PATH, StreamMode, ToolHold,
};
use crate::pipeline::{Event, Generation, Pipeline, Serving, TokenLogprob, assign_tenant};
use crate::responses::{Echo, ResponsesRequest, Shape};

/// Header that overrides the body's priority.
pub(crate) const PRIORITY_HEADER: &str = "x-sluice-priority";

/// The caller's key identity, set by [`authorize`] when the frontend has keys.
type Caller = Option<Extension<Identity>>;

/// The HTTP routes, with request ids, CORS, compression and the body limit
/// (`--max-body-bytes`, the one in force: a larger body is a 413 in the
/// OpenAI error shape).
pub(crate) fn router(pipeline: Arc<Pipeline>) -> Router {
    use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
    let x_request_id = http::HeaderName::from_static("x-request-id");
    let body_limit = pipeline.max_body_bytes;
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&pipeline),
            authorize,
        ));
    Router::new()
        .merge(api)
        .route("/health", get(health))
        .route("/ready", get(ready))
        .with_state(pipeline)
        .layer(tower_http::compression::CompressionLayer::new())
        .layer(tower_http::cors::CorsLayer::permissive())
        .layer(axum::extract::DefaultBodyLimit::max(body_limit))
        .layer(PropagateRequestIdLayer::new(x_request_id.clone()))
        .layer(SetRequestIdLayer::new(x_request_id, MakeRequestUuid))
}

/// Refuses an API request without a valid key (`--api-key-file`).
async fn authorize(
    State(p): State<Arc<Pipeline>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let value = request
        .headers()
        .get(http::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    match p.authorize(value) {
        Ok(identity) => {
            let mut request = request;
            if let Some(identity) = identity {
                request.extensions_mut().insert(identity);
            }
            next.run(request).await
        }
        Err(e) => {
            let endpoint = match request.uri().path() {
                "/v1/chat/completions" => Api::Chat.endpoint(),
                "/v1/completions" => Api::Completion.endpoint(),
                _ => "models",
            };
            p.metrics.outcome(endpoint).failed(&e);
            e.into_response()
        }
    }
}

/// The model is listed only once it is servable: a client that waits for it
/// here never gets a 503 for its first request.
async fn models(State(p): State<Arc<Pipeline>>) -> Json<Value> {
    let data = if p.ready() {
        json!([{ "id": p.model, "object": "model", "created": p.created, "owned_by": "sluice" }])
    } else {
        json!([])
    };
    Json(json!({ "object": "list", "data": data }))
}

async fn health(State(p): State<Arc<Pipeline>>) -> Json<Value> {
    Json(json!({ "status": "ok", "model": p.model, "workers": p.workers.count(&p.model) }))
}

async fn ready(State(p): State<Arc<Pipeline>>) -> Response {
    let workers = p.workers.count(&p.model);
    let queues = p.queues.count("");
    let routers = p.routers.count("");
    let ready = p.ready();
    let body =
        Json(json!({ "ready": ready, "workers": workers, "queues": queues, "routers": routers }));
    if ready {
        body.into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body).into_response()
    }
}

/// A fresh id for a request. A client's `x-request-id` is never one: it is
/// echoed and kept on the request's span (`x_request_id`), but clients
/// reuse theirs across requests, and ids must not collide.
fn request_id(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

fn header_priority(headers: &HeaderMap) -> Result<Option<i32>, FrontendError> {
    match headers.get(PRIORITY_HEADER) {
        None => Ok(None),
        Some(v) => v.to_str().ok().and_then(|s| s.trim().parse::<i32>().ok()).map(Some).ok_or_else(|| {
            FrontendError::invalid(
                PRIORITY_HEADER,
                format!("header `{PRIORITY_HEADER}` must be an integer (higher = more important); in the body use `{PRIORITY_PATH}`"),
            )
        }),
    }
}

/// The header a gateway sets a request's TTFT target with, in
/// milliseconds (as `nvext.agent_hints.ttft_target_ms`, which it overrides).
pub(crate) const TTFT_TARGET_HEADER: &str = "x-sluice-ttft-target-ms";

/// The TPOT target header for gateways (the body's
/// `nvext.agent_hints.tpot_target_ms` otherwise).
pub(crate) const TPOT_TARGET_HEADER: &str = "x-sluice-tpot-target-ms";

/// A target header (`header`, in milliseconds > 0); `path` is its field in
/// the body, named in the error.
fn header_target(
    headers: &HeaderMap,
    header: &'static str,
    path: &str,
) -> Result<Option<u32>, FrontendError> {
    match headers.get(header) {
        None => Ok(None),
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .filter(|&ms| ms > 0)
            .map(Some)
            .ok_or_else(|| {
                FrontendError::invalid(
                    header,
                    format!("header `{header}` must be a whole number of milliseconds > 0; in the body use `{path}`"),
                )
            }),
    }
}

/// The body, or the error its reading ended in: over the limit is a 413.
fn body_bytes(
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
    limit: usize,
) -> Result<Bytes, FrontendError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            FrontendError::PayloadTooLarge { limit }
        } else {
            FrontendError::invalid("body", format!("cannot read the body: {rejection}"))
        }
    })
}

/// The request body as `T`. Every request type denies unknown fields, and a
/// priority in the wrong place is an unknown field or a wrong type, so a
/// body the typed parse accepts is one the checked path accepts too: only a
/// rejected body pays for the JSON tree that names its error precisely.
fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, FrontendError> {
    serde_json::from_slice(body).or_else(|_| parse_checked(body))
}

/// The body through a JSON tree: the priority's placement is checked first,
/// so its error names the right path instead of "unknown field".
fn parse_checked<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, FrontendError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| FrontendError::invalid("body", format!("the body is not valid JSON: {e}")))?;
    openai::check_priority_placement(&value)?;
    serde_json::from_value(value).map_err(openai::parse_error)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Completion,
    Responses,
}

impl Api {
    fn endpoint(self) -> &'static str {
        match self {
            Api::Chat => "chat_completions",
            Api::Completion => "completions",
            Api::Responses => "responses",
        }
    }
}

type Body = Result<Bytes, axum::extract::rejection::BytesRejection>;

async fn chat(
    State(p): State<Arc<Pipeline>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let received = Instant::now();
    let id = request_id("chatcmpl");
    let parsed = body_bytes(body, p.max_body_bytes)
        .and_then(|b| parse::<ChatRequest>(&b))
        .and_then(|r| r.into_params(id));
    answer(p, Api::Chat, caller, headers, parsed, received, None).await
}

async fn completions(
    State(p): State<Arc<Pipeline>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let received = Instant::now();
    let id = request_id("cmpl");
    let parsed = body_bytes(body, p.max_body_bytes)
        .and_then(|b| parse::<CompletionRequest>(&b))
        .and_then(|r| r.into_params(id));
    answer(p, Api::Completion, caller, headers, parsed, received, None).await
}

async fn responses(
    State(p): State<Arc<Pipeline>>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let received = Instant::now();
    // OpenAI's response ids are `resp_…` (item ids derive from it).
    let id = format!("resp_{}", uuid::Uuid::new_v4().simple());
    let parsed = body_bytes(body, p.max_body_bytes)
        .and_then(|b| parse::<ResponsesRequest>(&b))
        .and_then(|r| r.into_chat());
    let (parsed, echo) = match parsed {
        Ok((chat, echo)) => (chat.into_params(id), Some(echo)),
        Err(e) => (Err(e), None),
    };
    answer(p, Api::Responses, caller, headers, parsed, received, echo).await
}

/// The `x-sluice-tenant` header's value; a value that is not text is a 400.
fn header_tenant(headers: &HeaderMap) -> Result<Option<&str>, FrontendError> {
    headers
        .get(TENANT_HEADER)
        .map(|v| {
            v.to_str().map_err(|_| {
                FrontendError::invalid(TENANT_HEADER, "the tenant header must be visible ASCII")
            })
        })
        .transpose()
}

/// Answers one API request (chat, completion or responses) through the
/// pipeline, under its `http.request` span.
async fn answer(
    p: Arc<Pipeline>,
    api: Api,
    caller: Caller,
    headers: HeaderMap,
    parsed: Result<(GenerateParams, StreamMode), FrontendError>,
    received: Instant,
    echo: Option<Echo>,
) -> Response {
    let span = tracing::info_span!(
        "http.request",
        otel.name = api.endpoint(),
        otel.kind = "server",
        request_id = tracing::field::Empty,
        x_request_id = headers.get("x-request-id").and_then(|v| v.to_str().ok()),
        priority = tracing::field::Empty,
        strict_priority = tracing::field::Empty,
        tenant = tracing::field::Empty,
        prompt_tokens = tracing::field::Empty,
        worker_id = tracing::field::Empty,
    );
    sluice_runtime::telemetry::extract_http(&headers, &span);
    let mut outcome = p.metrics.outcome(api.endpoint());
    let result = async {
        let (mut params, mode) = parsed?;
        let priority_field = match header_priority(&headers)? {
            Some(prio) => {
                params.hints.priority = prio;
                PRIORITY_HEADER
            }
            None => PRIORITY_PATH,
        };
        if let Some(ms) = header_target(
            &headers,
            TTFT_TARGET_HEADER,
            crate::openai::TTFT_TARGET_PATH,
        )? {
            params.hints.ttft_target_ms = ms;
        }
        if let Some(ms) = header_target(
            &headers,
            TPOT_TARGET_HEADER,
            crate::openai::TPOT_TARGET_PATH,
        )? {
            params.hints.tpot_target_ms = ms;
        }
        sluice_runtime::limits::check_priority(
            priority_field,
            params.hints.priority,
            "nvext.agent_hints.strict_priority",
            params.hints.strict_priority,
        )
        .map_err(crate::openai::limit_error)?;
        let identity = caller.as_ref().map(|Extension(id)| id);
        assign_tenant(
            &mut params,
            identity,
            header_tenant(&headers)?,
            TENANT_HEADER,
        )?;
        let span = tracing::Span::current();
        span.record("request_id", params.request_id.as_str());
        span.record("priority", params.hints.priority);
        span.record("strict_priority", params.hints.strict_priority);
        span.record("tenant", params.tenant.as_str());
        let tools = params.tools.as_ref().map(|_| p.tool_format);
        let prepared = p.prepare(params, received).await?;
        span.record("prompt_tokens", prepared.prompt_ids.len());
        let id = prepared.desc.request_id.clone();
        let generations = p.start_choices(prepared).await?;
        Ok::<_, FrontendError>((id, mode, generations, tools))
    }
    .instrument(span.clone())
    .await;
    let (id, mode, generations, tools) = match result {
        Ok(r) => r,
        Err(e) => {
            outcome.failed(&e);
            return e.into_response();
        }
    };
    if let (Api::Responses, Some(echo)) = (api, echo) {
        let Some(generation) = generations.0.into_iter().next() else {
            let e = FrontendError::internal("no generation");
            outcome.failed(&e);
            return e.into_response();
        };
        let shape = Shape {
            id,
            model: p.model.clone(),
            created: unix_now(),
            tools,
            echo,
        };
        if mode.stream {
            outcome.ok();
            let mut resp = Sse::new(crate::responses::sse(shape, generation)).into_response();
            resp.headers_mut()
                .insert("x-accel-buffering", http::HeaderValue::from_static("no"));
            return resp;
        }
        let r = crate::responses::collect(shape, generation)
            .instrument(span)
            .await;
        return respond(r, outcome);
    }
    let out = Output {
        api,
        id,
        model: p.model.clone(),
        created: unix_now(),
        tools,
        index: 0,
    };
    if generations.0.len() > 1 {
        let (generations, first) = generations;
        if mode.stream {
            let mut resp =
                Sse::new(sse_multi(out, generations, first, mode, outcome)).into_response();
            resp.headers_mut()
                .insert("x-accel-buffering", http::HeaderValue::from_static("no"));
            return resp;
        }
        let r = collect(out, generations, first).instrument(span).await;
        return respond(r, outcome);
    }
    let (mut generations, first) = generations;
    let Some(generation) = generations.pop() else {
        let e = FrontendError::internal("no generation");
        outcome.failed(&e);
        return e.into_response();
    };
    if mode.stream {
        // Recorded when the stream ends, by how it ends.
        let stream = sse_stream(out, generation, mode, outcome);
        let mut resp = Sse::new(stream).into_response();
        resp.headers_mut()
            .insert("x-accel-buffering", http::HeaderValue::from_static("no"));
        resp
    } else {
        let r = collect(out, vec![generation], first).instrument(span).await;
        respond(r, outcome)
    }
}

/// A whole (not streamed) answer, its outcome recorded.
fn respond(r: Result<Value, FrontendError>, mut outcome: RequestOutcome) -> Response {
    match r {
        Ok(v) => {
            outcome.ok();
            Json(v).into_response()
        }
        Err(e) => {
            outcome.failed(&e);
            e.into_response()
        }
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

#[derive(Clone)]
struct Output {
    api: Api,
    id: String,
    model: String,
    created: i64,
    /// Parse the output for tool calls in this family's format.
    tools: Option<ToolFormat>,
    /// The choice this output is (`n` > 1: 0..n).
    index: u32,
}

/// Parsed calls as OpenAI's `tool_calls` (with `index` when streamed).
fn tool_calls_json(calls: &[ParsedCall], streamed: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": openai::call_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if streamed && let Some(o) = v.as_object_mut() {
                    o.insert("index".into(), json!(i));
                }
                v
            })
            .collect(),
    )
}

/// The finish reason OpenAI gives a turn: `tool_calls` when it made some.
fn finish_name(reason: FinishReason, called: bool) -> Option<&'static str> {
    if called && reason == FinishReason::Stop {
        Some("tool_calls")
    } else {
        reason.openai_name()
    }
}

fn usage_json(u: &sluice_proto::common::v1::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

pub(crate) fn nvext_json(s: &Serving) -> Value {
    serde_json::to_value(s).unwrap_or(Value::Null)
}

fn chat_logprobs(lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|lp| {
            json!({
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": lp.token.as_bytes(),
                "top_logprobs": lp.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

fn completion_logprobs(lps: &[TokenLogprob], offset: usize) -> Value {
    let mut text_offset = Vec::with_capacity(lps.len());
    let mut at = offset;
    for lp in lps {
        text_offset.push(at);
        at += lp.token.len();
    }
    json!({
        "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": text_offset,
    })
}

impl Output {
    fn chunk(&self, choice: Value, extra: Option<(&str, Value)>) -> Value {
        let object = match self.api {
            Api::Chat | Api::Responses => "chat.completion.chunk",
            Api::Completion => "text_completion",
        };
        let mut v = json!({ "id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice] });
        if let Some((k, x)) = extra
            && let Some(o) = v.as_object_mut()
        {
            o.insert(k.into(), x);
        }
        v
    }

    /// One streamed delta as its JSON text, serialized straight from
    /// borrowed fields: a chunk per token is the stream's hot path, and
    /// building it as a `serde_json::Value` tree cost some twenty
    /// allocations each. Same bytes as [`Output::chunk`] would give.
    fn delta_chunk(
        &self,
        text: &str,
        lps: &[TokenLogprob],
        first: bool,
        want_lp: bool,
        offset: usize,
    ) -> String {
        #[derive(serde::Serialize)]
        struct Chunk<'a, C> {
            id: &'a str,
            object: &'static str,
            created: i64,
            model: &'a str,
            choices: [C; 1],
        }
        #[derive(serde::Serialize)]
        struct ChatDelta<'a> {
            content: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            role: Option<&'static str>,
        }
        #[derive(serde::Serialize)]
        struct ChatChoice<'a> {
            index: u32,
            delta: ChatDelta<'a>,
            logprobs: Option<Value>,
            finish_reason: Option<&'static str>,
        }
        #[derive(serde::Serialize)]
        struct CompletionChoice<'a> {
            index: u32,
            text: &'a str,
            logprobs: Option<Value>,
            finish_reason: Option<&'static str>,
        }
        let (id, created, model) = (self.id.as_str(), self.created, self.model.as_str());
        let written = match self.api {
            Api::Chat | Api::Responses => serde_json::to_string(&Chunk {
                id,
                object: "chat.completion.chunk",
                created,
                model,
                choices: [ChatChoice {
                    index: self.index,
                    delta: ChatDelta {
                        content: text,
                        role: first.then_some("assistant"),
                    },
                    logprobs: want_lp.then(|| chat_logprobs(lps)),
                    finish_reason: None,
                }],
            }),
            Api::Completion => serde_json::to_string(&Chunk {
                id,
                object: "text_completion",
                created,
                model,
                choices: [CompletionChoice {
                    index: self.index,
                    text,
                    logprobs: want_lp.then(|| completion_logprobs(lps, offset)),
                    finish_reason: None,
                }],
            }),
        };
        // Borrowed strings, integers and a `Value` cannot fail to serialize.
        written.unwrap_or_default()
    }

    fn final_choice(&self, reason: FinishReason) -> Value {
        let reason = reason.openai_name();
        match self.api {
            Api::Chat | Api::Responses => {
                json!({ "index": self.index, "delta": {}, "logprobs": null, "finish_reason": reason })
            }
            Api::Completion => {
                json!({ "index": self.index, "text": "", "logprobs": null, "finish_reason": reason })
            }
        }
    }
}

fn sse_stream(
    out: Output,
    generation: Generation,
    mode: StreamMode,
    outcome: RequestOutcome,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct St {
        out: Output,
        generation: Generation,
        mode: StreamMode,
        first: bool,
        offset: usize,
        done: bool,
        queued: Vec<SseEvent>,
        outcome: RequestOutcome,
        /// With tools: text that may be (part of) a call, held until the
        /// output ends and it is parsed.
        hold: Option<ToolHold>,
    }
    let hold = out.tools.map(ToolHold::new);
    let st = St {
        out,
        generation,
        mode,
        first: true,
        offset: 0,
        done: false,
        queued: Vec::new(),
        hold,
        outcome,
    };
    futures::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(ev) = st.queued.pop() {
                return Some((Ok(ev), st));
            }
            if st.done {
                return None;
            }
            let event = st.generation.next().await;
            let want_lp =
                !matches!(&event, Some(Ok(Event::Delta { logprobs, .. })) if logprobs.is_empty());
            match event {
                Some(Ok(Event::Delta { text, logprobs, .. })) => {
                    let text = match &mut st.hold {
                        Some(hold) => hold.push(&text),
                        None => text,
                    };
                    if text.is_empty() && logprobs.is_empty() && !st.first {
                        continue;
                    }
                    let data = st
                        .out
                        .delta_chunk(&text, &logprobs, st.first, want_lp, st.offset);
                    st.offset += text.len();
                    st.first = false;
                    return Some((Ok(SseEvent::default().data(data)), st));
                }
                Some(Ok(Event::Done {
                    finish_reason,
                    usage,
                    serving,
                })) => {
                    st.done = true;
                    st.outcome.ok();
                    // Sent in reverse (popped from the end): final chunk, usage chunk, [DONE].
                    st.queued.push(SseEvent::default().data("[DONE]"));
                    if st.mode.include_usage {
                        let mut v = st
                            .out
                            .chunk(Value::Null, Some(("usage", usage_json(&usage))));
                        if let Some(o) = v.as_object_mut() {
                            o.insert("choices".into(), json!([]));
                        }
                        st.queued.push(SseEvent::default().data(v.to_string()));
                    }
                    let parsed = st.hold.as_mut().map(ToolHold::finish);
                    let called = parsed.as_ref().is_some_and(|p| !p.calls.is_empty());
                    let mut v = st.out.chunk(
                        st.out.final_choice(finish_reason),
                        Some(("nvext", nvext_json(&serving))),
                    );
                    if let Some(c) = v.pointer_mut("/choices/0/finish_reason") {
                        *c = json!(finish_name(finish_reason, called));
                    }
                    st.queued.push(SseEvent::default().data(v.to_string()));
                    // The held text, parsed: its calls, after any text of it.
                    if let Some(p) = parsed {
                        let mut delta = serde_json::Map::new();
                        if st.first {
                            delta.insert("role".into(), json!("assistant"));
                        }
                        if called {
                            delta.insert("tool_calls".into(), tool_calls_json(&p.calls, true));
                            let choice = json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null});
                            st.queued.push(
                                SseEvent::default().data(st.out.chunk(choice, None).to_string()),
                            );
                        }
                        if !p.content.is_empty() {
                            let choice = json!({"index": 0, "delta": {"content": p.content}, "logprobs": null, "finish_reason": null});
                            st.queued.push(
                                SseEvent::default().data(st.out.chunk(choice, None).to_string()),
                            );
                        }
                    }
                }
                Some(Err(e)) => {
                    st.done = true;
                    st.outcome.failed(&e);
                    st.queued.push(SseEvent::default().data("[DONE]"));
                    st.queued
                        .push(SseEvent::default().data(e.body().to_string()));
                }
                None => return None,
            }
        }
    })
}

/// One choice, whole: its JSON, usage and where it ran. `first` is an
/// event already read from it.
async fn collect_choice(
    out: &Output,
    mut generation: Generation,
    mut first: Option<Event>,
) -> Result<(Value, Usage, Serving), FrontendError> {
    let mut text = String::new();
    let mut lps = Vec::new();
    let mut want_lp = false;
    loop {
        let ev = match first.take() {
            Some(ev) => ev,
            None => match generation.next().await {
                Some(ev) => ev?,
                None => break,
            },
        };
        match ev {
            Event::Delta {
                text: t, logprobs, ..
            } => {
                text.push_str(&t);
                want_lp |= !logprobs.is_empty();
                lps.extend(logprobs);
            }
            Event::Done {
                finish_reason,
                usage,
                serving,
            } => {
                let choice = match out.api {
                    Api::Chat | Api::Responses => {
                        let parsed = out
                            .tools
                            .map(|f| f.parse(&text))
                            .filter(|p| !p.calls.is_empty());
                        let message = match &parsed {
                            Some(p) => json!({
                                "role": "assistant",
                                "content": if p.content.is_empty() { Value::Null } else { json!(p.content) },
                                "tool_calls": tool_calls_json(&p.calls, false),
                            }),
                            None => json!({ "role": "assistant", "content": text }),
                        };
                        json!({
                            "index": out.index,
                            "message": message,
                            "logprobs": if want_lp { chat_logprobs(&lps) } else { Value::Null },
                            "finish_reason": finish_name(finish_reason, parsed.is_some()),
                        })
                    }
                    Api::Completion => json!({
                        "index": out.index, "text": text,
                        "logprobs": if want_lp { completion_logprobs(&lps, 0) } else { Value::Null },
                        "finish_reason": finish_reason.openai_name(),
                    }),
                };
                return Ok((choice, usage, serving));
            }
        }
    }
    Err(FrontendError::internal(
        "generation ended without a final event",
    ))
}

/// The usage of `n` choices of one prompt: the prompt counted once.
fn combined_usage(usages: impl IntoIterator<Item = Usage>) -> Usage {
    let mut total: Option<Usage> = None;
    for u in usages {
        match &mut total {
            None => total = Some(u),
            Some(t) => t.completion_tokens += u.completion_tokens,
        }
    }
    total.unwrap_or_default()
}

/// The whole response: every choice (read concurrently), the prompt's
/// usage once, where the first choice ran.
async fn collect(
    out: Output,
    generations: Vec<Generation>,
    mut first: Option<Event>,
) -> Result<Value, FrontendError> {
    let object = match out.api {
        Api::Completion => "text_completion",
        Api::Chat | Api::Responses => "chat.completion",
    };
    let choices = generations.into_iter().enumerate().map(|(i, g)| {
        let out = Output {
            index: i as u32,
            ..out.clone()
        };
        let f = if i == 0 { first.take() } else { None };
        async move { collect_choice(&out, g, f).await }
    });
    let results = futures::future::try_join_all(choices).await?;
    let serving = results.first().map(|r| r.2.clone()).unwrap_or_default();
    let usage = combined_usage(results.iter().map(|r| r.1));
    Ok(json!({
        "id": out.id, "object": object, "created": out.created, "model": out.model,
        "choices": results.into_iter().map(|r| r.0).collect::<Vec<_>>(),
        "usage": usage_json(&usage),
        "nvext": nvext_json(&serving),
    }))
}

/// `n` > 1 choices streamed: each choice's deltas as they come, with its
/// index; its final chunk when it ends; usage (the prompt once) and
/// `[DONE]` when the last one ends.
fn sse_multi(
    out: Output,
    generations: Vec<Generation>,
    first: Option<Event>,
    mode: StreamMode,
    outcome: RequestOutcome,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    use futures::StreamExt;
    let n = generations.len();
    let mut first = first;
    let streams = generations.into_iter().enumerate().map(|(i, g)| {
        let head = futures::stream::iter(if i == 0 { first.take().map(Ok) } else { None });
        let rest =
            futures::stream::unfold(g, |mut g| async move { g.next().await.map(|e| (e, g)) });
        head.chain(rest).map(move |e| (i, e)).boxed()
    });
    struct St {
        merged: futures::stream::SelectAll<
            futures::stream::BoxStream<'static, (usize, Result<Event, FrontendError>)>,
        >,
        outs: Vec<Output>,
        first: Vec<bool>,
        offset: Vec<usize>,
        usages: Vec<Usage>,
        remaining: usize,
        queued: std::collections::VecDeque<SseEvent>,
        done: bool,
        mode: StreamMode,
        outcome: RequestOutcome,
    }
    let st = St {
        merged: futures::stream::select_all(streams),
        outs: (0..n)
            .map(|i| Output {
                index: i as u32,
                ..out.clone()
            })
            .collect(),
        first: vec![true; n],
        offset: vec![0; n],
        usages: Vec::new(),
        remaining: n,
        queued: std::collections::VecDeque::new(),
        done: false,
        mode,
        outcome,
    };
    futures::stream::unfold(st, |mut st| async move {
        use futures::StreamExt;
        loop {
            if let Some(ev) = st.queued.pop_front() {
                return Some((Ok(ev), st));
            }
            if st.done {
                return None;
            }
            match st.merged.next().await {
                Some((i, Ok(Event::Delta { text, logprobs, .. }))) => {
                    if text.is_empty() && logprobs.is_empty() && !st.first[i] {
                        continue;
                    }
                    let want_lp = !logprobs.is_empty();
                    let data = st.outs[i].delta_chunk(
                        &text,
                        &logprobs,
                        st.first[i],
                        want_lp,
                        st.offset[i],
                    );
                    st.offset[i] += text.len();
                    st.first[i] = false;
                    return Some((Ok(SseEvent::default().data(data)), st));
                }
                Some((
                    i,
                    Ok(Event::Done {
                        finish_reason,
                        usage,
                        serving,
                    }),
                )) => {
                    let v = st.outs[i].chunk(
                        st.outs[i].final_choice(finish_reason),
                        Some(("nvext", nvext_json(&serving))),
                    );
                    st.queued.push_back(SseEvent::default().data(v.to_string()));
                    st.usages.push(usage);
                    st.remaining -= 1;
                    if st.remaining == 0 {
                        st.done = true;
                        st.outcome.ok();
                        if st.mode.include_usage {
                            let usage = combined_usage(std::mem::take(&mut st.usages));
                            let mut v =
                                st.outs[0].chunk(Value::Null, Some(("usage", usage_json(&usage))));
                            if let Some(o) = v.as_object_mut() {
                                o.insert("choices".into(), json!([]));
                            }
                            st.queued.push_back(SseEvent::default().data(v.to_string()));
                        }
                        st.queued.push_back(SseEvent::default().data("[DONE]"));
                    }
                }
                Some((_, Err(e))) => {
                    st.done = true;
                    st.outcome.failed(&e);
                    st.queued
                        .push_back(SseEvent::default().data(e.body().to_string()));
                    st.queued.push_back(SseEvent::default().data("[DONE]"));
                }
                None => return None,
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_target_headers_are_milliseconds_above_zero() {
        for (header, path) in [
            (TTFT_TARGET_HEADER, crate::openai::TTFT_TARGET_PATH),
            (TPOT_TARGET_HEADER, crate::openai::TPOT_TARGET_PATH),
        ] {
            let with = |v: &str| {
                let mut h = HeaderMap::new();
                h.insert(header, v.parse().expect("a header value"));
                header_target(&h, header, path)
            };
            assert_eq!(
                header_target(&HeaderMap::new(), header, path).ok(),
                Some(None)
            );
            assert_eq!(with(" 1500 ").ok(), Some(Some(1500)));
            for bad in ["0", "-5", "1.5", "soon"] {
                let err = with(bad).expect_err(bad);
                assert_eq!(err.status(), StatusCode::BAD_REQUEST, "{bad}");
                assert!(err.to_string().contains(header), "{err}");
                assert!(err.to_string().contains(path), "{err}");
            }
        }
    }

    /// The chunk as it was built before `delta_chunk`: a `Value` tree.
    fn delta_as_tree(
        out: &Output,
        text: &str,
        lps: &[TokenLogprob],
        first: bool,
        want_lp: bool,
        offset: usize,
    ) -> String {
        let choice = match out.api {
            Api::Chat | Api::Responses => {
                let mut delta = json!({ "content": text });
                if first && let Some(o) = delta.as_object_mut() {
                    o.insert("role".into(), json!("assistant"));
                }
                json!({ "index": 0, "delta": delta, "logprobs": if want_lp { chat_logprobs(lps) } else { Value::Null }, "finish_reason": null })
            }
            Api::Completion => json!({
                "index": 0, "text": text,
                "logprobs": if want_lp { completion_logprobs(lps, offset) } else { Value::Null },
                "finish_reason": null,
            }),
        };
        out.chunk(choice, None).to_string()
    }

    #[test]
    fn a_streamed_delta_is_the_same_json_as_the_value_tree_gave() {
        let lps = [TokenLogprob {
            wire: Default::default(),
            token: " river\"\n".into(),
            logprob: -0.25,
            top: vec![(" river\"\n".into(), -0.25), (" sea".into(), -1.5)],
        }];
        for api in [Api::Chat, Api::Completion] {
            let out = Output {
                api,
                id: "chatcmpl-1\u{e9}".into(),
                model: "sluice-tiny".into(),
                created: 1_790_000_000,
                tools: None,
                index: 0,
            };
            for (text, first, want_lp, offset) in [
                ("The", true, false, 0),
                (" river\"\n", false, false, 3),
                (" river\"\n", false, true, 3),
                ("", true, true, 0),
            ] {
                let lps = if want_lp { &lps[..] } else { &[] };
                assert_eq!(
                    out.delta_chunk(text, lps, first, want_lp, offset),
                    delta_as_tree(&out, text, lps, first, want_lp, offset),
                    "{:?} {text:?} first={first} logprobs={want_lp}",
                    api.endpoint()
                );
            }
        }
    }

    #[test]
    fn the_typed_parse_accepts_and_rejects_what_the_checked_parse_does() {
        let bodies = [
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            r#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":-3,"osl":8}}}"#,
            r#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":null}}}"#,
            r#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":"high"}}}"#,
            r#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":1.5}}}"#,
            r#"{"model":"m","messages":[],"nvext":{"agent_hints":{"priority":4294967296}}}"#,
            r#"{"model":"m","messages":[],"nvext":{"priority":5}}"#,
            r#"{"model":"m","messages":[],"priority":5}"#,
            r#"{"model":"m","messages":[],"extra":{"nvext":{"agent_hints":{"priority":5}}}}"#,
            r#"{"model":"m","messages":[],"extra_body":{"priority":5}}"#,
            r#"{"model":"m","messages":[],"temprature":0.5}"#,
            r#"{"model":"m","model":"n","messages":[]}"#,
            r#"{"messages":[]}"#,
            r#"[1, 2]"#,
            r#"{"model":"m","messages":[]"#,
        ];
        for body in bodies {
            let bytes = Bytes::from_static(body.as_bytes());
            let fast = parse::<crate::openai::ChatRequest>(&bytes).map(|r| format!("{r:?}"));
            let checked =
                parse_checked::<crate::openai::ChatRequest>(&bytes).map(|r| format!("{r:?}"));
            assert_eq!(
                fast.map_err(|e| format!("{e:?}")),
                checked.map_err(|e| format!("{e:?}")),
                "{body}"
            );
        }
    }
}
