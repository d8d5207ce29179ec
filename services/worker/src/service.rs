//! The `Worker` gRPC service over one or more engine ranks: `Generate` and
//! its multiplexed `GenerateSession` ([`session`]; local prefill, or remote
//! through a [`RemotePrefill`]: `sluice-decode`'s disaggregation), the KV
//! event stream with replay and snapshot, and load reports. The prefill
//! worker plugs its `Prefill` handler in through [`PrefillHandler`].

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::Stream;
use sluice_engine::{EngineHandle, GenerateStream, KvEventRecord};
use sluice_proto::worker::v1 as pb;
use sluice_runtime::discovery::WorkerRole;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, Streaming};
use tracing::Instrument;

mod fetch;
mod session;

use crate::convert;
use crate::error::WorkerError;
use crate::metrics::WorkerMetrics;

/// State shared by every RPC of one worker.
#[derive(Debug)]
pub struct WorkerCore {
    pub id: String,
    pub model: String,
    pub role: WorkerRole,
    /// One engine per data-parallel rank.
    pub engines: Vec<EngineHandle>,
    pub metrics: WorkerMetrics,
    /// Remote prefills in flight from this (decode) worker.
    pub remote_prefills: AtomicU32,
    /// Requests that came without a router's placement.
    pub unplaced: Arc<UnplacedLoad>,
    /// Bytes per second prefixes fetched from peers arrive at, overall and
    /// by peer (what the load report says; 0: this worker does not fetch).
    pub fetch_rates: crate::FetchRates,
    /// Bytes per second a block restored from the second KV tier moves at
    /// (0: no second tier).
    pub tier_rate: u64,
    /// This host's memory copy bandwidth, measured once at start (0 on a
    /// timing backend, whose rates are modelled).
    pub host_copy_rate: u64,
    /// Tests only: see `WorkerArgs::reply_lag`.
    #[cfg(feature = "fault-injection")]
    pub reply_lag: Option<std::time::Duration>,
}

/// The requests a worker received without `placed`: no router counts them,
/// so its load reports add them, estimated as a router estimates its
/// placements (see `sluice-router`'s `load` module): the prompt tokens not
/// cached until the first token, the prompt blocks until the end.
#[derive(Debug, Default)]
pub struct UnplacedLoad {
    requests: AtomicU32,
    prefill_tokens: AtomicU64,
    blocks: AtomicU64,
}

impl UnplacedLoad {
    /// Counts one request until the guard drops.
    pub fn count(self: &Arc<Self>, prefill_tokens: u64, blocks: u64) -> UnplacedGuard {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        self.blocks.fetch_add(blocks, Ordering::Relaxed);
        UnplacedGuard {
            load: Arc::clone(self),
            prefill_tokens,
            blocks,
        }
    }

    /// (requests, prefill tokens, blocks) now.
    pub fn figures(&self) -> (u32, u64, u64) {
        (
            self.requests.load(Ordering::Relaxed),
            self.prefill_tokens.load(Ordering::Relaxed),
            self.blocks.load(Ordering::Relaxed),
        )
    }
}

/// One unplaced request's share of [`UnplacedLoad`].
#[derive(Debug)]
pub struct UnplacedGuard {
    load: Arc<UnplacedLoad>,
    prefill_tokens: u64,
    blocks: u64,
}

impl UnplacedGuard {
    /// The request produced its first token: its prefill is done.
    pub fn started(&mut self) {
        let t = std::mem::take(&mut self.prefill_tokens);
        self.load.prefill_tokens.fetch_sub(t, Ordering::Relaxed);
    }
}

impl Drop for UnplacedGuard {
    fn drop(&mut self) {
        self.started();
        self.load.requests.fetch_sub(1, Ordering::Relaxed);
        self.load.blocks.fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

impl WorkerCore {
    /// A request its engine did not start by its TTFT target, refused as
    /// the queue refuses one it still holds (`budget_ms` what it had left
    /// when sent), and counted in `sluice_worker_requests_total`.
    pub fn refuse_late(&self, budget_ms: u32) -> WorkerError {
        let reason = finish_label(sluice_engine::FinishReason::TtftTargetMissed);
        self.metrics.requests.with_label_values(&[reason]).inc();
        WorkerError::TtftTargetMissed { budget_ms }
    }

    /// The engine of `rank`.
    pub fn engine(&self, rank: u32) -> Result<&EngineHandle, WorkerError> {
        self.engines
            .get(rank as usize)
            .ok_or(WorkerError::NoSuchRank {
                rank,
                size: self.engines.len(),
            })
    }

    /// Rejects a request for another model.
    pub fn check_model(&self, model: &str) -> Result<(), WorkerError> {
        if !model.is_empty() && model != self.model {
            return Err(WorkerError::WrongModel {
                requested: model.into(),
                served: self.model.clone(),
            });
        }
        Ok(())
    }
}

/// The prefill worker's `Prefill` implementation, plugged into the service.
#[tonic::async_trait]
pub trait PrefillHandler: Send + Sync + std::fmt::Debug {
    async fn prefill(
        &self,
        core: &Arc<WorkerCore>,
        req: pb::PrefillRequest,
    ) -> Result<pb::PrefillResponse, WorkerError>;
}

/// Starts a generation whose prompt is computed by a remote prefill worker;
/// plugged in by the decode role (`sluice-decode`'s `disagg`). `Ok(None)` means
/// "prefill locally".
#[tonic::async_trait]
pub trait RemotePrefill: Send + Sync + std::fmt::Debug {
    async fn try_remote(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        engine_req: &sluice_engine::Request,
    ) -> Option<(GenerateStream, String)>;

    /// Fetches the prompt's cached prefix from the peer the request names
    /// (`prefix_source`) into the engine's prefix cache before the prompt
    /// is admitted; the prompt tokens fetched (0 on any failure: the
    /// prompt is computed as if nothing was asked).
    async fn fetch_prefix(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        engine_req: &sluice_engine::Request,
    ) -> usize {
        let _ = (core, req, engine_req);
        0
    }
}

/// The tonic `Worker` service.
#[derive(Debug, Clone)]
pub struct WorkerService {
    pub core: Arc<WorkerCore>,
    pub prefill: Option<Arc<dyn PrefillHandler>>,
    pub remote: Option<Arc<dyn RemotePrefill>>,
    /// How this worker sends KV blocks to a peer that fetches a prefix it
    /// holds (`FetchPrefix`); `None`: it serves no fetches.
    pub senders: Option<Arc<sluice_kv_transfer::Senders>>,
    /// Cancelled when the worker starts to drain: sessions then take no new
    /// generations.
    pub draining: sluice_runtime::Shutdown,
    /// Where the tasks behind its streams run (the service context's).
    pub tasks: TaskTracker,
}

pub(crate) type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Messages a `GenerateSession` may have waiting to be written. When the
/// caller reads slower than the engine produces, the generations wait for
/// room, and each one's outputs meanwhile merge into its next message (see
/// `response_stream`), as on a `Generate` stream under HTTP/2 flow control.
const SESSION_OUTBOUND: usize = 64;

/// What a generation's wire stream reports besides the engine's tokens.
struct Admitted {
    prompt_tokens: usize,
    /// Prompt tokens found cached at admission.
    cached_tokens: usize,
    /// The prefill worker, when prefill ran remotely.
    prefill_worker_id: String,
    /// Prompt tokens fetched from a peer before admission.
    fetched_tokens: usize,
    /// The request's share of the worker's unplaced load, if no router placed it.
    unplaced: Option<UnplacedGuard>,
    priority: i32,
    /// What was left of its TTFT target when it was sent (0 = none).
    ttft_budget_ms: u32,
}

/// Adapts an engine stream to the wire: the first message carries the usage
/// known at admission (cached prompt tokens), the last the final usage.
fn response_stream(
    core: Arc<WorkerCore>,
    stream: GenerateStream,
    admitted: Admitted,
    span: tracing::Span,
) -> BoxStream<pb::GenerateResponse> {
    let reply = Reply {
        core,
        stream,
        first: true,
        done: false,
        started: Instant::now(),
        priority: admitted.priority.to_string(),
        admitted,
        preemption: Default::default(),
        span,
    };
    Box::pin(futures::stream::unfold(reply, |mut reply| async move {
        if reply.done {
            return None;
        }
        #[cfg(feature = "fault-injection")]
        if let Some(lag) = reply.core.reply_lag {
            tokio::time::sleep(lag).await;
        }
        // What the engine produced while this stream was not polled goes
        // out as one message: one frame and one wake-up for the reader.
        let out = loop {
            let out = reply.stream.recv_ready().await?;
            // Before the first token an output without one only reports a
            // preemption: counted, not sent, so the first message is the
            // first token, the end, or the refusal (the frontend answers
            // the client's status on it).
            if reply.first && out.token_ids.is_empty() && out.finished.is_none() {
                reply.note_preemption(out.preemption);
                continue;
            }
            break out;
        };
        let msg = reply.message(out);
        Some((msg, reply))
    }))
}

/// One request's stream of replies, as it is written.
struct Reply {
    core: Arc<WorkerCore>,
    stream: GenerateStream,
    first: bool,
    done: bool,
    /// What admission learned; its `unplaced` guard is dropped with the
    /// stream: the request's end.
    admitted: Admitted,
    started: Instant,
    /// The request's priority, as the preemption counter's label.
    priority: String,
    /// Preemption cost already counted.
    preemption: sluice_engine::Preemption,
    span: tracing::Span,
}

impl Reply {
    /// The wire message for one engine output, counting what it reports;
    /// the engine's refusal of a request it did not start by its TTFT
    /// target is the stream's error status instead.
    fn message(&mut self, out: sluice_engine::Output) -> Result<pb::GenerateResponse, Status> {
        self.note_preemption(out.preemption);
        if let Some(f) = out.finished
            && f.reason == sluice_engine::FinishReason::TtftTargetMissed
        {
            self.done = true;
            self.span.record("refused", finish_label(f.reason));
            return Err(self.core.refuse_late(self.admitted.ttft_budget_ms).into());
        }
        let mut msg = pb::GenerateResponse {
            token_ids: out.token_ids,
            logprobs: out.logprobs.iter().map(convert::logprobs_to_wire).collect(),
            ..Default::default()
        };
        let first = self.first;
        if first {
            self.first = false;
            self.first_token(&mut msg);
        }
        let last = out.finished.is_some();
        if let Some(f) = out.finished {
            self.done = true;
            self.finished(&mut msg, f);
        }
        // Who served it, on the first and the last message, not on every
        // token in between.
        if first || last {
            msg.worker_id = self.core.id.clone();
            msg.fetched_tokens = self.admitted.fetched_tokens as u32;
        }
        Ok(msg)
    }

    /// Counts preemptions and recomputed tokens as they grow.
    fn note_preemption(&mut self, p: sluice_engine::Preemption) {
        let seen = self.preemption;
        if p.count > seen.count || p.recomputed_tokens > seen.recomputed_tokens {
            self.core.metrics.record_preemption(&self.priority, seen, p);
            self.preemption = p;
            record_preemption(&self.span, p);
        }
    }

    /// The first message: TTFT observed, the usage known at admission.
    fn first_token(&mut self, msg: &mut pb::GenerateResponse) {
        let a = &mut self.admitted;
        if let Some(u) = a.unplaced.as_mut() {
            u.started();
        }
        self.core
            .metrics
            .ttft
            .observe(self.started.elapsed().as_secs_f64());
        msg.usage = Some(sluice_proto::common::v1::Usage {
            prompt_tokens: a.prompt_tokens as u32,
            completion_tokens: 0,
            cached_tokens: a.cached_tokens as u32,
        });
        msg.prefill_worker_id = a.prefill_worker_id.clone();
    }

    /// The last message: final usage and finish reason, counted.
    fn finished(&mut self, msg: &mut pb::GenerateResponse, f: sluice_engine::Finished) {
        let a = &self.admitted;
        msg.finish_reason = convert::finish_reason(f.reason) as i32;
        let mut usage = convert::usage(f.usage);
        if !a.prefill_worker_id.is_empty() {
            usage.cached_tokens = usage.cached_tokens.max(a.cached_tokens as u32);
        }
        msg.usage = Some(usage);
        msg.prefill_worker_id = a.prefill_worker_id.clone();
        let m = &self.core.metrics;
        m.requests
            .with_label_values(&[finish_label(f.reason)])
            .inc();
        m.generated_tokens.inc_by(f.usage.completion_tokens as u64);
        self.span
            .record("completion_tokens", f.usage.completion_tokens);
        if f.usage.admission_held_steps > 0 {
            self.span
                .record("admission_held_steps", f.usage.admission_held_steps);
        }
        record_preemption(&self.span, self.preemption);
    }
}

/// Puts a request's preemption cost on its `worker.generate` span.
fn record_preemption(span: &tracing::Span, p: sluice_engine::Preemption) {
    span.record("preemptions", p.count);
    span.record("recomputed_tokens", p.recomputed_tokens);
}

fn finish_label(r: sluice_engine::FinishReason) -> &'static str {
    match r {
        sluice_engine::FinishReason::Stop => "stop",
        sluice_engine::FinishReason::Length => "length",
        sluice_engine::FinishReason::Abort => "abort",
        sluice_engine::FinishReason::Error => "error",
        sluice_engine::FinishReason::TtftTargetMissed => "ttft_target_missed",
    }
}

/// Sends KV events after `from_seq` of `engine`, or `snapshot_required`.
fn kv_event_stream(
    tasks: &TaskTracker,
    engine: &EngineHandle,
    rank: u32,
    from_seq: u64,
) -> BoxStream<pb::KvEventBatch> {
    let (tx, rx) = mpsc::channel::<Result<pb::KvEventBatch, Status>>(64);
    let resync = pb::KvEventBatch {
        events: Vec::new(),
        snapshot_required: true,
        dp_rank: rank,
    };
    match engine.subscribe_kv_events(from_seq) {
        Err(e) => {
            tracing::debug!(error = %e, "subscriber must resync from a snapshot");
            let _ = tx.try_send(Ok(resync));
        }
        Ok(sub) => {
            tasks.spawn(async move {
                let batch = |events: &[KvEventRecord]| pb::KvEventBatch {
                    events: events.iter().map(convert::kv_event).collect(),
                    snapshot_required: false,
                    dp_rank: rank,
                };
                for chunk in sub.backlog.chunks(512) {
                    if tx.send(Ok(batch(chunk))).await.is_err() {
                        return;
                    }
                }
                let mut live = sub.live;
                loop {
                    let first = tokio::select! {
                        _ = tx.closed() => return,
                        r = live.recv() => r,
                    };
                    let mut events = match first {
                        Ok(r) => vec![r],
                        Err(RecvError::Lagged(_)) => {
                            let _ = tx.send(Ok(resync)).await;
                            return;
                        }
                        Err(RecvError::Closed) => return,
                    };
                    // Batch whatever else is already there.
                    while events.len() < 512 {
                        match live.try_recv() {
                            Ok(r) => events.push(r),
                            Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_)) => {
                                let _ = tx.send(Ok(batch(&events))).await;
                                let _ = tx.send(Ok(resync)).await;
                                return;
                            }
                            Err(_) => break,
                        }
                    }
                    if tx.send(Ok(batch(&events))).await.is_err() {
                        return;
                    }
                }
            });
        }
    }
    Box::pin(ReceiverStream::new(rx))
}

impl WorkerService {
    /// Admits one generation and returns its wire stream: the body of
    /// `Generate`, and of each generation on a `GenerateSession`. Its
    /// `worker.generate` span is a child of the current span (a `Generate`
    /// call's), or of `traceparent` on a session.
    pub(crate) async fn start(
        &self,
        req: pb::GenerateRequest,
        traceparent: Option<&str>,
    ) -> Result<BoxStream<pb::GenerateResponse>, Status> {
        let core = &self.core;
        if core.role == WorkerRole::Prefill {
            return Err(WorkerError::WrongRole {
                role: WorkerRole::Prefill,
                rpc: "Generate",
            }
            .into());
        }
        core.check_model(&req.model)?;
        let engine = core.engine(req.dp_rank)?;
        let engine_req = convert::request(&req, engine)?;
        let parent = match traceparent {
            Some(_) => None,
            None => tracing::Span::current().id(),
        };
        let span = tracing::info_span!(
            parent: parent,
            "worker.generate",
            worker_id = %core.id,
            request_id = %req.request_id,
            priority = req.priority,
            dp_rank = req.dp_rank,
            prompt_tokens = engine_req.prompt.len(),
            cached_tokens = tracing::field::Empty,
            fetched_tokens = tracing::field::Empty,
            prefill = tracing::field::Empty,
            completion_tokens = tracing::field::Empty,
            preemptions = tracing::field::Empty,
            recomputed_tokens = tracing::field::Empty,
            admission_held_steps = tracing::field::Empty,
            ttft_budget_ms = req.ttft_budget_ms,
            tpot_target_ms = req.tpot_target_ms,
            refused = tracing::field::Empty,
        );
        if let Some(tp) = traceparent {
            sluice_runtime::telemetry::set_parent_from_traceparent(tp, &span);
        }
        let fetched = match &self.remote {
            Some(r) if req.prefix_source.is_some() => {
                r.fetch_prefix(core, &req, &engine_req)
                    .instrument(span.clone())
                    .await
            }
            _ => 0,
        };
        let cached = engine.cached_prefix_tokens(&engine_req.prompt);
        span.record("cached_tokens", cached);
        span.record("fetched_tokens", fetched);
        let prompt_tokens = engine_req.prompt.len();
        let unplaced = (!req.placed).then(|| {
            let bs = engine.kv_layout().block_size.max(1);
            core.unplaced.count(
                prompt_tokens.saturating_sub(cached) as u64,
                prompt_tokens.div_ceil(bs) as u64,
            )
        });
        let remote = match &self.remote {
            Some(r) => {
                r.try_remote(core, &req, &engine_req)
                    .instrument(span.clone())
                    .await
            }
            None => None,
        };
        let (stream, prefill_worker, cached) = match remote {
            Some((stream, prefill_worker)) => {
                span.record("prefill", "remote");
                (stream, prefill_worker, cached)
            }
            None => {
                span.record("prefill", "local");
                (
                    engine.generate(engine_req).map_err(WorkerError::from)?,
                    String::new(),
                    cached,
                )
            }
        };
        Ok(response_stream(
            Arc::clone(core),
            stream,
            Admitted {
                prompt_tokens,
                cached_tokens: cached,
                fetched_tokens: fetched,
                prefill_worker_id: prefill_worker,
                unplaced,
                priority: req.priority,
                ttft_budget_ms: req.ttft_budget_ms,
            },
            span,
        ))
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = BoxStream<pb::GenerateResponse>;
    type GenerateSessionStream = BoxStream<pb::GenerateSessionResponse>;
    type SubscribeKvEventsStream = BoxStream<pb::KvEventBatch>;
    type LoadStream = BoxStream<pb::LoadReport>;

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Ok(Response::new(self.start(request.into_inner(), None).await?))
    }

    async fn generate_session(
        &self,
        request: Request<Streaming<pb::GenerateSessionRequest>>,
    ) -> Result<Response<Self::GenerateSessionStream>, Status> {
        let (tx, rx) = mpsc::channel(SESSION_OUTBOUND);
        self.tasks
            .spawn(session::run(self.clone(), request.into_inner(), tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<pb::PrefillResponse>, Status> {
        let Some(handler) = &self.prefill else {
            return Err(WorkerError::WrongRole {
                role: self.core.role,
                rpc: "Prefill",
            }
            .into());
        };
        let req = request.into_inner();
        self.core.check_model(&req.model)?;
        Ok(Response::new(handler.prefill(&self.core, req).await?))
    }

    async fn fetch_prefix(
        &self,
        request: Request<pb::FetchPrefixRequest>,
    ) -> Result<Response<pb::FetchPrefixResponse>, Status> {
        Ok(Response::new(self.serve_fetch(request.into_inner()).await?))
    }

    async fn subscribe_kv_events(
        &self,
        request: Request<pb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        let req = request.into_inner();
        let engine = self.core.engine(req.dp_rank)?;
        Ok(Response::new(kv_event_stream(
            &self.tasks,
            engine,
            req.dp_rank,
            req.from_seq,
        )))
    }

    async fn kv_snapshot(
        &self,
        request: Request<pb::KvSnapshotRequest>,
    ) -> Result<Response<pb::KvSnapshotResponse>, Status> {
        let rank = request.into_inner().dp_rank;
        let engine = self.core.engine(rank)?;
        let snap = engine.kv_snapshot();
        Ok(Response::new(pb::KvSnapshotResponse {
            seq: snap.seq,
            block_hashes: snap.block_hashes,
            block_size: engine.kv_layout().block_size as u32,
            dp_rank: rank,
            tier2_block_hashes: snap.tier2_hashes,
        }))
    }

    async fn load(
        &self,
        request: Request<pb::LoadRequest>,
    ) -> Result<Response<Self::LoadStream>, Status> {
        let req = request.into_inner();
        let min = Duration::from_millis(u64::from(req.min_interval_ms.max(1)));
        let max = Duration::from_millis(u64::from(if req.max_interval_ms == 0 {
            1000
        } else {
            req.max_interval_ms
        }));
        let (tx, rx) = mpsc::channel(16);
        for (rank, engine) in self.core.engines.iter().enumerate() {
            let mut watch = engine.load();
            let tx = tx.clone();
            let core = Arc::clone(&self.core);
            self.tasks.spawn(async move {
                loop {
                    let report = {
                        let l = watch.borrow_and_update();
                        let mut report = convert::load(
                            rank as u32,
                            &l,
                            core.remote_prefills.load(Ordering::Relaxed),
                        );
                        report.kv_fetch_bytes_per_sec = core.fetch_rates.overall();
                        report.kv_fetch_bytes_per_sec_by_peer = core.fetch_rates.by_peer();
                        report.kv_tier_bytes_per_sec = core.tier_rate;
                        // Unplaced requests are counted per worker, on rank 0.
                        if rank == 0 {
                            let (n, prefill, blocks) = core.unplaced.figures();
                            report.unplaced_requests = n;
                            report.unplaced_prefill_tokens = prefill;
                            report.unplaced_blocks = blocks;
                        }
                        report
                    };
                    if tx.send(Ok(report)).await.is_err() {
                        return;
                    }
                    // A caller that left while this waits (the interval is
                    // the caller's, up to days) ends it now, not after.
                    tokio::select! {
                        _ = tx.closed() => return,
                        () = tokio::time::sleep(min) => {}
                    }
                    tokio::select! {
                        _ = tx.closed() => return,
                        changed = watch.changed() => if changed.is_err() { return },
                        _ = tokio::time::sleep(max.saturating_sub(min)) => {}
                    }
                }
            });
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Counts a remote prefill in flight while alive.
#[derive(Debug)]
pub struct InflightGuard<'a>(&'a AtomicU32);

impl<'a> InflightGuard<'a> {
    pub fn new(c: &'a AtomicU32) -> Self {
        c.fetch_add(1, Ordering::Relaxed);
        Self(c)
    }
}

impl Drop for InflightGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}
