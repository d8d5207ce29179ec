//! An in-process OTLP/gRPC trace collector: tests point the exporter at it
//! and read back every span it received.

use std::net::SocketAddr;
use std::sync::Arc;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
pub use opentelemetry_proto::tonic::trace::v1::Span;
use sluice_runtime::telemetry::{LogFormat, Telemetry, TelemetryConfig, init};
use tokio::sync::Mutex;

/// Spans received so far.
#[derive(Debug, Default, Clone)]
pub struct Collector {
    spans: Arc<Mutex<Vec<Span>>>,
}

impl Collector {
    /// Starts a collector on a free loopback port; returns it and its address.
    pub async fn start() -> anyhow::Result<(Self, SocketAddr)> {
        let collector = Self::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let c = collector.clone();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(TraceServiceServer::new(c))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                .await
        });
        Ok((collector, addr))
    }

    /// A copy of every span received.
    pub async fn spans(&self) -> Vec<Span> {
        self.spans.lock().await.clone()
    }

    /// The workers' `worker.generate` spans (not the frontend's hop of the
    /// same name), each once (a batch exported twice counts once), waiting
    /// up to 10 s for at least `n` of them.
    pub async fn worker_generate_spans(&self, n: usize) -> anyhow::Result<Vec<Span>> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let mut spans: Vec<_> = self
                .spans()
                .await
                .into_iter()
                .filter(|s| {
                    s.name == "worker.generate"
                        && attr(s, "target").as_deref() == Some("sluice_worker::service")
                })
                .collect();
            spans.sort_by(|a, b| a.span_id.cmp(&b.span_id));
            spans.dedup_by(|a, b| a.span_id == b.span_id);
            if spans.len() >= n {
                return Ok(spans);
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "{} of {n} worker.generate spans arrived",
                spans.len()
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// Starts a collector and points this process's traces at it, as
/// `service_name` (one per test binary: the subscriber is global). Flush
/// the returned telemetry before reading the spans.
pub async fn traced(service_name: &str) -> anyhow::Result<(Collector, Telemetry)> {
    let (collector, addr) = Collector::start().await?;
    let telemetry = init(&TelemetryConfig {
        service_name: service_name.into(),
        otlp_endpoint: Some(format!("http://{addr}")),
        log_format: LogFormat::Text,
        ansi: false,
    })?;
    Ok((collector, telemetry))
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().await;
        for rs in req.into_inner().resource_spans {
            for ss in rs.scope_spans {
                spans.extend(ss.spans);
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// A span attribute rendered as a string.
pub fn attr(span: &Span, key: &str) -> Option<String> {
    let v = span
        .attributes
        .iter()
        .find(|a| a.key == key)?
        .value
        .as_ref()?
        .value
        .as_ref()?;
    Some(match v {
        AnyValue::StringValue(s) => s.clone(),
        AnyValue::IntValue(i) => i.to_string(),
        AnyValue::DoubleValue(d) => d.to_string(),
        AnyValue::BoolValue(b) => b.to_string(),
        other => format!("{other:?}"),
    })
}

/// Lower-case hex of an id.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
