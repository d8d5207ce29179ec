//! The tonic `Router` service: convert, ask the pool, record why, map errors.
//!
//! `Route` records the choice and every candidate's cost terms on its span
//! (fields `worker_id`, `dp_rank`, `overlap_blocks`, `mode`, `candidates`),
//! so a trace shows why a worker was chosen. `WatchLoad` sends one view on
//! subscribe and one whenever a worker reports or membership changes
//! (coalesced: a slow reader gets the latest view, never a backlog).

use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use futures::Stream;
use sluice_proto::router::v1 as pb;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::metrics::RouterMetrics;
use crate::pool::{Decision, Pools};

/// The `Router` gRPC service.
#[derive(Debug, Clone)]
pub struct RouterService {
    pools: Arc<Pools>,
    metrics: RouterMetrics,
    shutdown: CancellationToken,
}

impl RouterService {
    /// A service over `pools`; `WatchLoad` streams end when `shutdown` fires.
    pub fn new(pools: Arc<Pools>, metrics: RouterMetrics, shutdown: CancellationToken) -> Self {
        Self {
            pools,
            metrics,
            shutdown,
        }
    }

    fn record(&self, pool: &str, req: &pb::RouteRequest, d: &Decision) {
        let chosen = d.target();
        let mode = d.mode.as_str();
        let worker = chosen.target.worker_id.as_ref();
        if req.commit {
            self.metrics
                .placements
                .with_label_values(&[pool, worker, mode])
                .inc();
        }
        let overlap = chosen.terms.overlap_blocks;
        self.metrics
            .overlap_blocks
            .with_label_values(&[pool])
            .observe(f64::from(overlap));
        if !req.block_hashes.is_empty() {
            self.metrics
                .hit_rate
                .with_label_values(&[pool])
                .observe(f64::from(overlap) / req.block_hashes.len() as f64);
        }
        let span = tracing::Span::current();
        span.record("worker_id", worker);
        span.record("dp_rank", chosen.target.dp_rank);
        span.record("overlap_blocks", overlap);
        span.record("mode", mode);
        let candidates = candidates_field(d);
        span.record("candidates", candidates.as_str());
        tracing::debug!(
            request_id = %req.request_id,
            worker_id = worker,
            overlap_blocks = overlap,
            mode,
            candidates = %candidates,
            "placed"
        );
    }
}

/// `worker/rank overlap=… prefill=… decode=… total=… active=…; …`
fn candidates_field(d: &Decision) -> String {
    let mut s = String::new();
    for (i, c) in d.candidates.iter().enumerate() {
        if i > 0 {
            s.push_str("; ");
        }
        let _ = write!(
            s,
            "{}{} overlap={} prefill={:.2} decode={:.2} total={:.2} active={}",
            c.target,
            if i == d.chosen { "*" } else { "" },
            c.terms.overlap_blocks,
            c.terms.prefill_cost,
            c.terms.decode_cost,
            c.terms.total_cost,
            c.terms.active_requests
        );
    }
    s
}

type LoadStream = Pin<Box<dyn Stream<Item = Result<pb::LoadView, Status>> + Send>>;

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    #[tracing::instrument(
        name = "route",
        skip_all,
        fields(
            request_id = %request.get_ref().request_id,
            model = %request.get_ref().model,
            pool = tracing::field::Empty,
            priority = request.get_ref().priority,
            prompt_tokens = request.get_ref().prompt_tokens,
            prompt_blocks = request.get_ref().block_hashes.len(),
            commit = request.get_ref().commit,
            worker_id = tracing::field::Empty,
            dp_rank = tracing::field::Empty,
            overlap_blocks = tracing::field::Empty,
            mode = tracing::field::Empty,
            candidates = tracing::field::Empty,
        )
    )]
    async fn route(
        &self,
        request: Request<pb::RouteRequest>,
    ) -> Result<Response<pb::RouteResponse>, Status> {
        let req = request.into_inner();
        let kind = convert::pool_kind(req.pool)?;
        tracing::Span::current().record("pool", kind.component());
        let input = convert::route_input(&req)?;
        let started = Instant::now();
        let decision = self.pools.get(kind).route(&input, started)?;
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        self.record(kind.component(), &req, &decision);
        Ok(Response::new(convert::route_response(&decision)))
    }

    type WatchLoadStream = LoadStream;

    async fn watch_load(
        &self,
        request: Request<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let model = request.into_inner().model;
        let pools = Arc::clone(&self.pools);
        let rx = pools.watch_loads();
        let shutdown = self.shutdown.clone();
        let state = (rx, true, pools, model, shutdown);
        let stream = futures::stream::unfold(
            state,
            |(mut rx, first, pools, model, shutdown)| async move {
                if !first {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        changed = rx.changed() => changed.ok()?,
                    }
                } else {
                    rx.mark_unchanged();
                }
                let view = load_view(&pools, &model);
                Some((Ok(view), (rx, false, pools, model, shutdown)))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

fn load_view(pools: &Pools, model: &str) -> pb::LoadView {
    let now = Instant::now();
    let workers = pools
        .all()
        .iter()
        .flat_map(|p| p.load_view(now))
        .filter(|m| model.is_empty() || m.info.model.is_empty() || m.info.model == model)
        .map(|m| convert::worker_load(&m))
        .collect();
    pb::LoadView { workers }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::Mutex;

    use sluice_proto::router::v1::router_server::Router as _;
    use tracing::field::{Field, Visit};
    use tracing::span::{Attributes, Id, Record};
    use tracing_subscriber::layer::{Context, Layer};
    use tracing_subscriber::prelude::*;

    use super::*;
    use crate::indexer::{KvEvent, KvEventKind, Target};
    use crate::pool::{MemberInfo, PoolConfig, PoolKind};

    /// Collects every field recorded on spans named `route`.
    #[derive(Clone, Default)]
    struct Fields(Arc<Mutex<HashMap<String, String>>>);

    struct Collect<'a>(&'a Mutex<HashMap<String, String>>);

    impl Visit for Collect<'_> {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            if let Ok(mut m) = self.0.lock() {
                m.insert(field.name().to_owned(), format!("{value:?}"));
            }
        }
        fn record_str(&mut self, field: &Field, value: &str) {
            if let Ok(mut m) = self.0.lock() {
                m.insert(field.name().to_owned(), value.to_owned());
            }
        }
    }

    impl<S: tracing::Subscriber> Layer<S> for Fields {
        fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, _: Context<'_, S>) {
            if attrs.metadata().name() == "route" {
                attrs.record(&mut Collect(&self.0));
            }
        }
        fn on_record(&self, _: &Id, values: &Record<'_>, _: Context<'_, S>) {
            values.record(&mut Collect(&self.0));
        }
    }

    #[tokio::test]
    async fn route_records_the_choice_and_every_candidates_cost_terms_on_its_span() {
        let fields = Fields::default();
        let subscriber = tracing_subscriber::registry().with(fields.clone());
        let _guard = tracing::subscriber::set_default(subscriber);

        let pools = Arc::new(Pools::new(PoolConfig::default()));
        let pool = pools.get(PoolKind::Decode);
        for i in 0..2 {
            pool.add_member(MemberInfo {
                target: Target::new(format!("w{i}"), 0),
                endpoint: format!("127.0.0.1:{i}"),
                model: "m".into(),
                role: "decode".into(),
            });
        }
        let hashes = vec![11u64, 12, 13];
        let id = pool.kv_id(&Target::new("w1", 0)).expect("member");
        pool.indexer()
            .apply(
                id,
                &KvEvent {
                    seq: 1,
                    kind: KvEventKind::Stored {
                        parent: None,
                        hashes: hashes.clone(),
                    },
                },
            )
            .expect("apply");
        let metrics = RouterMetrics::new().expect("metrics");
        let svc = RouterService::new(pools, metrics.clone(), CancellationToken::new());
        let reply = svc
            .route(Request::new(pb::RouteRequest {
                request_id: "req-1".into(),
                model: "m".into(),
                pool: pb::Pool::Decode as i32,
                prompt_tokens: 48,
                block_hashes: hashes,
                block_size: 16,
                priority: 3,
                commit: true,
                ..Default::default()
            }))
            .await
            .expect("route")
            .into_inner();
        assert_eq!(
            reply.target.as_ref().map(|t| t.worker_id.as_str()),
            Some("w1")
        );
        assert_eq!(reply.overlap_blocks, 3);
        assert_eq!(reply.candidates.len(), 2);

        let f = fields.0.lock().expect("fields").clone();
        assert_eq!(f.get("worker_id").map(String::as_str), Some("w1"));
        assert_eq!(f.get("overlap_blocks").map(String::as_str), Some("3"));
        assert_eq!(f.get("mode").map(String::as_str), Some("kv"));
        assert_eq!(f.get("request_id").map(String::as_str), Some("req-1"));
        let candidates = f.get("candidates").expect("candidates recorded");
        assert!(
            candidates.contains("w0/0 overlap=0 prefill=3.00"),
            "{candidates}"
        );
        assert!(
            candidates.contains("w1/0* overlap=3 prefill=0.00"),
            "{candidates}"
        );
        let placed = metrics
            .placements
            .with_label_values(&["decode", "w1", "kv"])
            .get();
        assert_eq!(placed, 1);
    }
}
