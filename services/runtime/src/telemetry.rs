//! Telemetry: structured logs, OpenTelemetry spans exported over OTLP/gRPC
//! when an endpoint is configured, and W3C `traceparent` propagation.
//!
//! Propagation lives here and nowhere else: [`inject_http`] / [`extract_http`]
//! for HTTP headers, [`TraceInjector`] for gRPC clients and [`grpc_server_span`]
//! for gRPC servers. Spans get real trace ids even without an exporter, so a
//! trace that enters through one service continues through every other.

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::RuntimeError;

/// Filter for the OpenTelemetry layer: without it every RPC exports a
/// hundred-odd internal spans, the exporter's own traffic included.
const OTEL_FILTER: &str = "info,h2=off,hyper=off,hyper_util=off,tonic=off,tower=off,opentelemetry=off,opentelemetry_sdk=off";

/// How log lines are written (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines; coloured only when standard output is a terminal.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// How to set up telemetry for one process.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` of exported spans.
    pub service_name: String,
    /// OTLP/gRPC endpoint (e.g. `http://127.0.0.1:4317`); `None` = no export.
    pub otlp_endpoint: Option<String>,
    /// Text or JSON lines.
    pub log_format: LogFormat,
    /// ANSI colours in text logs: only for a terminal, and never with
    /// `NO_COLOR` set, so a log written to a file or a pipe stays plain.
    pub ansi: bool,
}

impl TelemetryConfig {
    /// Reads `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME` and
    /// `NO_COLOR`; colours only when standard output is a terminal.
    pub fn from_env(default_service_name: &str, log_format: LogFormat) -> Self {
        use std::io::IsTerminal;
        let non_empty = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            service_name: non_empty("OTEL_SERVICE_NAME")
                .unwrap_or_else(|| default_service_name.to_string()),
            otlp_endpoint: non_empty("OTEL_EXPORTER_OTLP_ENDPOINT"),
            log_format,
            ansi: std::io::stdout().is_terminal() && non_empty("NO_COLOR").is_none(),
        }
    }
}

/// Keeps the tracer provider alive; [`Telemetry::shutdown`] flushes it.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkTracerProvider,
}

impl Telemetry {
    /// Flushes pending spans and stops the exporter. Runs on a blocking
    /// thread: flushing blocks, and on a current-thread runtime it would
    /// starve the export it waits for.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(e) = provider.force_flush() {
                tracing::debug!(error = %e, "flushing spans");
            }
            let _ = provider.shutdown_with_timeout(Duration::from_secs(5));
        })
        .await;
    }

    /// Flushes pending spans without stopping the exporter.
    pub async fn flush(&self) {
        let provider = self.provider.clone();
        let _ = tokio::task::spawn_blocking(move || provider.force_flush()).await;
    }
}

/// Installs the global subscriber (logs filtered by `RUST_LOG`, default
/// `info`) and tracer provider, and the W3C propagator. Call once per process.
pub fn init(cfg: &TelemetryConfig) -> Result<Telemetry, RuntimeError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(cfg.service_name.clone())
        .build();
    let mut builder = SdkTracerProvider::builder().with_resource(resource);
    if let Some(endpoint) = &cfg.otlp_endpoint {
        use opentelemetry_otlp::WithExportConfig;
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint.clone())
            .build()
            .map_err(|e| RuntimeError::Telemetry {
                what: "building the OTLP exporter",
                source: e.into(),
            })?;
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    let tracer = provider.tracer("sluice");
    opentelemetry::global::set_tracer_provider(provider.clone());

    let log_filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = match cfg.log_format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_ansi(false)
            .with_filter(log_filter)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_target(true)
            .with_ansi(cfg.ansi)
            .with_filter(log_filter)
            .boxed(),
    };
    // Spans become OpenTelemetry spans only when they go somewhere: without
    // an endpoint the layer would cost ~5% of the CPU per request for
    // nothing. Trace context then propagates only between services that
    // export, so set the endpoint on every service whose spans you want.
    let otel = cfg.otlp_endpoint.is_some().then(|| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(EnvFilter::new(OTEL_FILTER))
    });
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()
        .map_err(|e| RuntimeError::Telemetry {
            what: "installing the tracing subscriber",
            source: e.into(),
        })?;
    if let Some(endpoint) = &cfg.otlp_endpoint {
        tracing::info!(%endpoint, service = %cfg.service_name, "exporting traces over OTLP");
    }
    Ok(Telemetry { provider })
}

struct HeaderInjector<'a>(&'a mut http::HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(val)) = (
            http::header::HeaderName::from_bytes(key.as_bytes()),
            http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, val);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// Writes the current span's context into `headers` as `traceparent`.
pub fn inject_http(headers: &mut http::HeaderMap) {
    let cx = Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&cx, &mut HeaderInjector(headers))
    });
}

/// Makes `span` a child of the context carried in `headers`, if any.
pub fn extract_http(headers: &http::HeaderMap, span: &Span) {
    let cx =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    if opentelemetry::trace::TraceContextExt::has_active_span(&cx) {
        let _ = span.set_parent(cx);
    }
}

/// The current span's context as a W3C `traceparent` value ("" when there
/// is none), for messages on a long-lived stream, which carry no headers
/// of their own.
pub fn traceparent() -> String {
    let mut headers = http::HeaderMap::new();
    inject_http(&mut headers);
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// Makes `span` a child of a `traceparent` value from [`traceparent`]; an
/// empty or malformed value leaves it a root.
pub fn set_parent_from_traceparent(traceparent: &str, span: &Span) {
    if traceparent.is_empty() {
        return;
    }
    let mut headers = http::HeaderMap::new();
    if let Ok(v) = http::HeaderValue::from_str(traceparent) {
        headers.insert("traceparent", v);
        extract_http(&headers, span);
    }
}

/// The trace id of `span` as 32 hex digits, or `None` when it has none.
pub fn trace_id(span: &Span) -> Option<String> {
    use opentelemetry::trace::TraceContextExt;
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| sc.trace_id().to_string())
}

/// A tonic client interceptor that injects the current span's context into
/// the request metadata.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceInjector;

impl tonic::service::Interceptor for TraceInjector {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let mut headers = http::HeaderMap::new();
        inject_http(&mut headers);
        for (k, v) in headers.iter() {
            if let (Ok(key), Ok(val)) = (
                tonic::metadata::MetadataKey::from_bytes(k.as_str().as_bytes()),
                tonic::metadata::MetadataValue::try_from(v.as_bytes()),
            ) {
                req.metadata_mut().insert(key, val);
            }
        }
        Ok(req)
    }
}

/// Paths polled by probes, scrapers and the mesh's own long-lived control
/// streams: when the caller sends no trace context, their spans stay at
/// debug level so that exported traces show requests, not polling.
const QUIET_PATHS: &[&str] = &[
    "/live",
    "/ready",
    "/health",
    "/metrics",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/sluice.worker.v1.Worker/Load",
    "/sluice.worker.v1.Worker/KvSnapshot",
    "/sluice.worker.v1.Worker/SubscribeKvEvents",
    "/sluice.router.v1.Router/WatchLoad",
    "/sluice.router.v1.Router/Place",
    "/sluice.queue.v1.Queue/Leases",
    "/sluice.worker.v1.Worker/GenerateSession",
];

/// The server span for one request (gRPC or HTTP on a gRPC port), child of
/// the caller's span when the request carries `traceparent`. Used as tonic's
/// `trace_fn`.
pub fn grpc_server_span<B>(req: &http::Request<B>) -> Span {
    let path = req.uri().path();
    let span = if QUIET_PATHS.contains(&path) && !req.headers().contains_key("traceparent") {
        tracing::debug_span!("grpc.server", otel.name = %path.trim_start_matches('/'), rpc.method = %path)
    } else {
        tracing::info_span!(
            "grpc.server",
            otel.name = %path.trim_start_matches('/'),
            otel.kind = "server",
            rpc.system = "grpc",
            rpc.method = %path,
        )
    };
    extract_http(req.headers(), &span);
    span
}
