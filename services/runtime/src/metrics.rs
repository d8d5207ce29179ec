//! Prometheus exposition. Each service owns a [`prometheus::Registry`] value
//! (several services in one process keep separate registries) and serves it
//! at `/metrics` through [`router`].

use axum::{Router, extract::State, http::header, response::IntoResponse, routing::get};
use prometheus::{Encoder, Registry, TextEncoder};

/// Text exposition of every metric in `registries`.
pub fn render(registries: &[Registry]) -> String {
    let encoder = TextEncoder::new();
    let mut families = Vec::new();
    for r in registries {
        families.extend(r.gather());
    }
    let mut out = Vec::new();
    if let Err(e) = encoder.encode(&families, &mut out) {
        tracing::warn!(error = %e, "encoding metrics");
    }
    String::from_utf8(out).unwrap_or_default()
}

/// An axum router with `GET /metrics` for `registries` and `GET /live`.
pub fn router(registries: Vec<Registry>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/live", get(|| async { "ok" }))
        .with_state(registries)
}

async fn metrics_handler(State(registries): State<Vec<Registry>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        render(&registries),
    )
}
