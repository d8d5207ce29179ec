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
        span.record("candidates", candidates_field(d).as_str());
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
