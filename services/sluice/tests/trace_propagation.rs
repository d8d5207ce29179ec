//! Trace context crosses a gRPC hop: an in-process OTLP/gRPC collector
//! receives the spans of a client → server call; they share one trace id
//! and the server span's parent is the client span. One OTLP test per test
//! binary: the subscriber is global.

use std::time::Duration;

use sluice_runtime::grpc::{GrpcServer, channel};
use sluice_tests::otlp::{hex, traced};
use tracing::Instrument;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_and_server_spans_share_one_trace() -> anyhow::Result<()> {
    let (collector, telemetry) = traced("trace-test").await?;

    // A real Sluice gRPC server (health service) and a traced client.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let shutdown = sluice_runtime::Shutdown::new();
    let server = GrpcServer::new()?;
    let s = shutdown.clone();
    let serving = tokio::spawn(async move { server.serve(listener, s).await });

    let mut client =
        tonic_health::pb::health_client::HealthClient::new(channel(&addr.to_string())?);
    let span = tracing::info_span!("client.call");
    let client_trace_id =
        sluice_runtime::telemetry::trace_id(&span).expect("client span has a trace id");
    async {
        client
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map(|_| ())
    }
    .instrument(span)
    .await?;

    shutdown.cancel();
    serving.await??;
    telemetry.flush().await;

    // Wait for both spans to arrive.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (client_span, server_span) = loop {
        {
            let spans = collector.spans().await;
            let client = spans.iter().find(|s| s.name == "client.call").cloned();
            let server = spans
                .iter()
                .find(|s| s.name.contains("grpc.health.v1.Health/Check"))
                .cloned();
            if let (Some(c), Some(s)) = (client, server) {
                break (c, s);
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "spans did not reach the collector"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        client_span.trace_id, server_span.trace_id,
        "one trace across the hop"
    );
    assert_eq!(hex(&client_span.trace_id), client_trace_id);
    assert_eq!(
        server_span.parent_span_id, client_span.span_id,
        "server span is the client span's child"
    );
    telemetry.shutdown().await;
    Ok(())
}
