//! The tonic `Router` service: convert, ask the pool, record why, map errors.
//!
//! Every placement (`Route`, or a call on a `Place` session) records the
//! choice and every candidate's cost terms on its `route` span (fields
//! `worker_id`, `dp_rank`, `overlap_blocks`, `mode`, `candidates`), so a
//! trace shows why a worker was chosen. A `Place` session applies its
//! client's messages in order, so a release sent before a route is counted
//! before it. `WatchLoad` sends one view on subscribe and then at most one
//! per [`WATCH_MIN_INTERVAL`] while loads change (coalesced: a slow reader
//! gets the latest view, never a backlog).

use std::fmt::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use sluice_proto::router::v1 as pb;
use sluice_proto::router::v1::place_request::Msg as PlaceMsg;
use sluice_runtime::RequestDescription;
use sluice_runtime::metrics::Open;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::Span;

use crate::convert;
use crate::error::RouterError;
use crate::metrics::RouterMetrics;
use crate::pool::{Commit, Decision, PlacementKey, PlacementState, PoolKind, Pools, RouteInput};
use crate::workers::SyncGate;

/// Least time between two `WatchLoad` views to one subscriber.
pub const WATCH_MIN_INTERVAL: Duration = Duration::from_millis(5);

/// Answers a `Place` session may have waiting for its client to read.
const PLACE_BACKLOG: usize = 1024;

/// How long a placement that finds no worker waits for one still joining
/// (registered, its first snapshot in flight) before answering "no worker".
const JOIN_WAIT: Duration = Duration::from_secs(3);

/// The `Router` gRPC service.
#[derive(Debug, Clone)]
pub struct RouterService {
    pools: Arc<Pools>,
    metrics: RouterMetrics,
    shutdown: CancellationToken,
    /// Where each placement session runs (the service context's tasks).
    tasks: TaskTracker,
    sessions: Arc<AtomicU64>,
    joining: Option<Arc<SyncGate>>,
}

/// The `route` span of one placement, child of the caller's trace.
fn route_span(req: &pb::RouteRequest) -> Span {
    let d = req.description.as_ref();
    tracing::info_span!(
        "route",
        request_id = %d.map_or("", |d| d.request_id.as_str()),
        model = %d.map_or("", |d| d.model.as_str()),
        pool = tracing::field::Empty,
        priority = d.map_or(0, |d| d.priority),
        prompt_tokens = d.map_or(0, |d| d.prompt_tokens),
        prompt_blocks = d.map_or(0, |d| d.block_hashes.len()),
        commit = req.commit,
        worker_id = tracing::field::Empty,
        dp_rank = tracing::field::Empty,
        overlap_blocks = tracing::field::Empty,
        predicted_ttft_ms = tracing::field::Empty,
        ttft_target_ms = d.map_or(0, |d| d.ttft_target_ms),
        within_target = tracing::field::Empty,
        mode = tracing::field::Empty,
        tie_tolerance = tracing::field::Empty,
        candidates = tracing::field::Empty,
        fetch_blocks = tracing::field::Empty,
        fetch_ms = tracing::field::Empty,
        prefix_source = tracing::field::Empty,
    )
}

impl RouterService {
    /// A service over `pools`; `WatchLoad` streams and `Place` sessions end
    /// when `shutdown` fires.
    pub fn new(
        pools: Arc<Pools>,
        metrics: RouterMetrics,
        shutdown: CancellationToken,
        tasks: TaskTracker,
    ) -> Self {
        Self {
            pools,
            metrics,
            shutdown,
            tasks,
            sessions: Arc::new(AtomicU64::new(0)),
            joining: None,
        }
    }

    /// Placements that find no worker wait for one of `gate`'s joining ones.
    pub(crate) fn with_joining(mut self, gate: Arc<SyncGate>) -> Self {
        self.joining = Some(gate);
        self
    }

    /// Checks `req` once, then [`RouterService::route_in`], waiting up to
    /// [`JOIN_WAIT`] while it finds no worker and some are still joining
    /// (start-up: a client that sees a worker registered must not get "no
    /// worker").
    async fn route_joined(
        &self,
        req: pb::RouteRequest,
        commit: Commit,
        span: &Span,
    ) -> Result<pb::RouteResponse, RouterError> {
        let (kind, input) = {
            let _entered = span.enter();
            let kind = convert::pool_kind(req.pool)?;
            span.record("pool", kind.component());
            (kind, convert::route_input(req, commit)?)
        };
        let deadline = tokio::time::Instant::now() + JOIN_WAIT;
        loop {
            let result = self.route_in(kind, &input, span);
            let joining = self.joining.as_ref().map_or(0, |g| g.joining());
            match result {
                Err(RouterError::NoWorkers { .. })
                    if joining > 0 && tokio::time::Instant::now() < deadline =>
                {
                    if let Some(g) = &self.joining {
                        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                        g.wait_fewer(joining, left).await;
                    }
                }
                r => return r,
            }
        }
    }

    /// Places one checked request in `kind`'s pool, inside `span`.
    fn route_in(
        &self,
        kind: PoolKind,
        input: &RouteInput,
        span: &Span,
    ) -> Result<pb::RouteResponse, RouterError> {
        let _entered = span.enter();
        let started = Instant::now();
        let decision = self.pools.get(kind).route(input, started)?;
        self.metrics
            .decision_seconds
            .observe(started.elapsed().as_secs_f64());
        self.record(kind.component(), &input.desc, &decision, span);
        if decision.placement.is_some() {
            self.pools.load_changed();
        }
        Ok(convert::route_response(kind, &decision))
    }

    /// Applies one message of `client`'s session `session`; a call's answer
    /// goes to `out`.
    async fn session_message(
        &self,
        client: &Arc<str>,
        session: u64,
        msg: PlaceMsg,
        out: &mpsc::Sender<Result<pb::PlaceResponse, Status>>,
    ) -> Result<(), RouterError> {
        let key = |id| PlacementKey {
            client: Arc::clone(client),
            id,
        };
        match msg {
            PlaceMsg::Hello(_) => Err(RouterError::InvalidArgument(
                "hello: sent twice on one session".into(),
            )),
            PlaceMsg::Route(call) => {
                let Some(req) = call.request else {
                    return Err(RouterError::InvalidArgument(
                        "route: request is required".into(),
                    ));
                };
                let commit = if req.commit {
                    Commit::Held {
                        key: key(req.placement_id),
                        session,
                    }
                } else {
                    Commit::DryRun
                };
                let span = route_span(&req);
                sluice_runtime::telemetry::set_parent_from_traceparent(&call.traceparent, &span);
                let result = match self.route_joined(req, commit, &span).await {
                    Ok(routed) => pb::place_response::Result::Routed(routed),
                    Err(e) => {
                        let status = Status::from(e);
                        pb::place_response::Result::Error(pb::PlaceError {
                            code: status.code() as i32,
                            message: status.message().to_owned(),
                        })
                    }
                };
                let reply = pb::PlaceResponse {
                    call_id: call.call_id,
                    result: Some(result),
                };
                // The client stopped reading: the session is over anyway.
                let _ = out.send(Ok(reply)).await;
                Ok(())
            }
            PlaceMsg::Placed(p) => {
                let (kind, record) = convert::placement_record(&p)?;
                if self.pools.get(kind).record_placement(
                    key(record.id),
                    session,
                    &record,
                    Instant::now(),
                ) {
                    self.pools.load_changed();
                }
                Ok(())
            }
            PlaceMsg::Held(report) => {
                self.pools
                    .report_held(client, convert::held_report(&report)?);
                Ok(())
            }
            PlaceMsg::Update(u) => {
                let state = convert::placement_state(u.state)?;
                let updated = self.pools.update(&key(u.placement_id), state);
                for (kind, u) in [PoolKind::Decode, PoolKind::Prefill].iter().zip(&updated) {
                    if let Some(check) = &u.checked {
                        self.metrics.ttft_checked(kind.component(), check);
                        tracing::debug!(
                            pool = kind.component(),
                            worker_id = %check.target.worker_id,
                            predicted_ms = check.predicted * 1e3,
                            served_ms = check.served * 1e3,
                            "first token checked against its prediction"
                        );
                    }
                }
                if updated.iter().any(|u| u.counted) {
                    if state == PlacementState::Released {
                        self.metrics
                            .placement_ends
                            .with_label_values(&["released"])
                            .inc();
                    }
                    self.pools.load_changed();
                }
                Ok(())
            }
        }
    }

    fn record(&self, pool: &str, req: &RequestDescription, d: &Decision, span: &Span) {
        let chosen = d.target();
        let mode = d.mode.as_str();
        let worker = chosen.target.worker_id.as_ref();
        if d.placement.is_some() {
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
        span.record("worker_id", worker);
        span.record("dp_rank", chosen.target.dp_rank);
        span.record("overlap_blocks", overlap);
        if let Some(ttft) = chosen.terms.predicted_ttft {
            span.record("predicted_ttft_ms", ttft * 1e3);
        }
        if let Some(within) = d.within_target {
            span.record("within_target", within);
            if !within {
                self.metrics.beyond_target.with_label_values(&[pool]).inc();
            }
        }
        span.record("mode", mode);
        // Candidates whose totals lay within this of the cheapest counted
        // as equal (the choice's tolerance, in the totals' units).
        span.record("tie_tolerance", d.tolerance);
        if let Some((holder, _)) = &d.prefix_source {
            span.record("prefix_source", holder.worker_id.as_ref());
            span.record("fetch_blocks", chosen.terms.fetch_blocks);
            if let Some(s) = chosen.terms.fetch_seconds {
                span.record("fetch_ms", s * 1e3);
            }
        }
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

/// `worker/rank overlap=… prefill=… decode=… ttft_ms=… total=… active=…; …`
fn candidates_field(d: &Decision) -> String {
    let mut s = String::new();
    for (i, c) in d.candidates.iter().enumerate() {
        if i > 0 {
            s.push_str("; ");
        }
        let _ = write!(
            s,
            "{}{} overlap={} fetch={} restore_ms={:.1} queued={} prefill={:.2} decode={:.2} ttft_ms={} total={:.4} active={}{}",
            c.target,
            if i == d.chosen { "*" } else { "" },
            c.terms.overlap_blocks,
            c.terms.fetch_blocks,
            c.terms.restore_seconds * 1e3,
            c.terms.queued_prefill_tokens,
            c.terms.prefill_cost,
            c.terms.decode_cost,
            c.terms
                .predicted_ttft
                .map_or_else(|| "-".to_owned(), |t| format!("{:.1}", t * 1e3)),
            c.terms.total_cost,
            c.terms.active_requests,
            if c.terms.over_bound {
                " over-bound"
            } else {
                ""
            }
        );
    }
    s
}

type LoadStream = Pin<Box<dyn Stream<Item = Result<pb::LoadView, Status>> + Send>>;
type PlaceStream = Pin<Box<dyn Stream<Item = Result<pb::PlaceResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::router_server::Router for RouterService {
    async fn route(
        &self,
        request: Request<pb::RouteRequest>,
    ) -> Result<Response<pb::RouteResponse>, Status> {
        let req = request.into_inner();
        let commit = if req.commit {
            Commit::Unreleasable
        } else {
            Commit::DryRun
        };
        let span = route_span(&req);
        Ok(Response::new(self.route_joined(req, commit, &span).await?))
    }

    type PlaceStream = PlaceStream;

    async fn place(
        &self,
        request: Request<Streaming<pb::PlaceRequest>>,
    ) -> Result<Response<Self::PlaceStream>, Status> {
        let mut inbound = request.into_inner();
        let client: Arc<str> = match inbound.message().await? {
            Some(pb::PlaceRequest {
                msg: Some(PlaceMsg::Hello(h)),
            }) if !h.client_id.is_empty() => h.client_id.into(),
            _ => {
                return Err(RouterError::InvalidArgument(
                    "the first message of a Place session must be `hello` with a client_id".into(),
                )
                .into());
            }
        };
        let session = self.sessions.fetch_add(1, Ordering::Relaxed) + 1;
        // What the client still holds follows; nothing of it is counted twice.
        self.pools.forget_client(&client);
        tracing::info!(%client, session, "placement session opened");
        let (tx, rx) = mpsc::channel(PLACE_BACKLOG);
        let svc = self.clone();
        self.tasks.spawn(async move {
            let _open = Open::new(&svc.metrics.place_sessions);
            loop {
                let msg = tokio::select! {
                    () = svc.shutdown.cancelled() => break,
                    // Nobody reads the answers any more (a client in this
                    // process dropped them without ending its requests).
                    () = tx.closed() => break,
                    m = inbound.message() => m,
                };
                match msg {
                    Ok(Some(pb::PlaceRequest { msg: Some(m) })) => {
                        if let Err(e) = svc.session_message(&client, session, m, &tx).await {
                            tracing::warn!(%client, error = %e, "bad message on a placement session; closing it");
                            let _ = tx.send(Err(e.into())).await;
                            break;
                        }
                    }
                    Ok(Some(pb::PlaceRequest { msg: None })) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            svc.pools.orphan_session(&client, session, Instant::now());
            // What it held goes with it (a reconnecting client reports again).
            svc.pools.report_held(&client, Default::default());
            svc.pools.load_changed();
            tracing::info!(%client, session, "placement session closed; its placements age out");
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type WatchLoadStream = LoadStream;

    async fn watch_load(
        &self,
        request: Request<pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let pb::WatchLoadRequest { model, client_id } = request.into_inner();
        let pools = Arc::clone(&self.pools);
        let rx = pools.watch_loads();
        let shutdown = self.shutdown.clone();
        let state = (rx, true, pools, (model, client_id), shutdown);
        let stream = futures::stream::unfold(
            state,
            |(mut rx, first, pools, watcher, shutdown)| async move {
                if !first {
                    tokio::select! {
                        _ = shutdown.cancelled() => return None,
                        changed = rx.changed() => changed.ok()?,
                    }
                    // Coalesce a burst of changes into one view.
                    tokio::time::sleep(WATCH_MIN_INTERVAL).await;
                    rx.mark_unchanged();
                } else {
                    rx.mark_unchanged();
                }
                let view = load_view(&pools, &watcher.0, &watcher.1);
                Some((Ok(view), (rx, false, pools, watcher, shutdown)))
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The view for a watcher of `model` ("" = every model) whose own
/// placements and held report (client `client`, "" = none) are left out of
/// the others' counts.
fn load_view(pools: &Pools, model: &str, client: &str) -> pb::LoadView {
    let now = Instant::now();
    let mut workers = Vec::new();
    for pool in pools.all() {
        let others = pool.placements_by_priority(client);
        workers.extend(
            pool.load_view(now)
                .iter()
                .filter(|m| model.is_empty() || m.info.model.is_empty() || m.info.model == model)
                .map(|m| convert::worker_load(m, others.get(&m.info.target))),
        );
    }
    let held = convert::held_models(&pools.held_by_others(client, model));
    pb::LoadView { workers, held }
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
    use crate::indexer::{KvEvent, KvEventKind};
    use crate::pool::{MemberInfo, PoolConfig, PoolKind};
    use sluice_runtime::discovery::WorkerRank;

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
                target: WorkerRank::new(format!("w{i}"), 0),
                endpoint: format!("127.0.0.1:{i}"),
                model: "m".into(),
                role: sluice_runtime::discovery::WorkerRole::Decode,
                kv_block_bytes: 0,
            });
        }
        let hashes = vec![11u64, 12, 13];
        let id = pool.kv_id(&WorkerRank::new("w1", 0)).expect("member");
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
        let svc = RouterService::new(
            pools,
            metrics.clone(),
            CancellationToken::new(),
            TaskTracker::new(),
        );
        let reply = svc
            .route(Request::new(pb::RouteRequest {
                description: Some(sluice_proto::common::v1::RequestDescription {
                    request_id: "req-1".into(),
                    model: "m".into(),
                    prompt_tokens: 48,
                    block_hashes: hashes,
                    block_size: 16,
                    priority: 3,
                    ..Default::default()
                }),
                pool: pb::Pool::Decode as i32,
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
        // w1 holds more of the prompt: no tolerance (ties only when equal).
        assert_eq!(
            f.get("tie_tolerance").and_then(|t| t.parse::<f64>().ok()),
            Some(0.0),
            "{f:?}"
        );
        let candidates = f.get("candidates").expect("candidates recorded");
        assert!(
            candidates.contains("w0/0 overlap=0 fetch=0 restore_ms=0.0 queued=0 prefill=3.00"),
            "{candidates}"
        );
        assert!(
            candidates.contains("w1/0* overlap=3 fetch=0 restore_ms=0.0 queued=0 prefill=0.00"),
            "{candidates}"
        );
        let placed = metrics
            .placements
            .with_label_values(&["decode", "w1", "kv"])
            .get();
        assert_eq!(placed, 1);
    }
}
