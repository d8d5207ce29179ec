//! The router's own service test: the real `serve()` on 127.0.0.1:0, in-process
//! discovery, and scripted fake workers (real tonic servers implementing
//! `Worker`: a KV event ring, snapshots and load reports driven by the test).

use std::collections::BTreeSet;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use futures::Stream;
use parking_lot::Mutex;
use sluice_proto::common::v1 as common;
use sluice_proto::router::v1 as pb;
use sluice_proto::router::v1::router_client::RouterClient;
use sluice_proto::worker::v1 as wpb;
use sluice_proto::worker::v1::worker_server::{Worker, WorkerServer};
use sluice_router::{Args, RouterMode};
use sluice_runtime::discovery::{MemoryDiscovery, WorkerInfo, WorkerRole};
use sluice_runtime::{Discovery, Instance, Registration, ServiceContext, Shutdown};
use sluice_tokens::sequence_block_hashes;
use tokio::net::TcpListener;
use tokio::sync::broadcast;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

const BS: u32 = 16;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// A worker whose KV cache and load the test scripts.
#[derive(Clone)]
struct FakeWorker {
    state: Arc<Mutex<KvState>>,
    events: broadcast::Sender<wpb::KvEvent>,
    loads: broadcast::Sender<wpb::LoadReport>,
    /// Cancelled = the worker is gone: streams end, every call fails.
    dead: Shutdown,
}

#[derive(Default)]
struct KvState {
    seq: u64,
    blocks: BTreeSet<u64>,
    /// Every event, for replay (the ring never drops here).
    log: Vec<wpb::KvEvent>,
    snapshots: u32,
}

impl FakeWorker {
    fn new() -> Self {
        Self {
            state: Arc::default(),
            events: broadcast::channel(1024).0,
            loads: broadcast::channel(1024).0,
            dead: Shutdown::new(),
        }
    }

    fn check_alive(&self) -> Result<(), Status> {
        if self.dead.is_cancelled() {
            Err(Status::unavailable("worker is gone"))
        } else {
            Ok(())
        }
    }

    fn push(&self, kind: wpb::kv_event::Kind, broadcast: bool) {
        let ev = {
            let mut s = self.state.lock();
            s.seq += 1;
            match &kind {
                wpb::kv_event::Kind::Stored(st) => s.blocks.extend(st.block_hashes.iter().copied()),
                wpb::kv_event::Kind::Removed(r) => {
                    for h in &r.block_hashes {
                        s.blocks.remove(h);
                    }
                }
                wpb::kv_event::Kind::Cleared(_) => s.blocks.clear(),
                wpb::kv_event::Kind::Moved(_) => {}
            }
            let ev = wpb::KvEvent {
                seq: s.seq,
                kind: Some(kind),
            };
            s.log.push(ev.clone());
            ev
        };
        if broadcast {
            let _ = self.events.send(ev);
        }
    }

    fn store(&self, hashes: &[u64]) {
        self.store_with(hashes, true);
    }

    /// Stores blocks but loses the event on the live stream (a gap).
    fn store_lost(&self, hashes: &[u64]) {
        self.store_with(hashes, false);
    }

    fn store_with(&self, hashes: &[u64], broadcast: bool) {
        self.push(
            wpb::kv_event::Kind::Stored(wpb::BlocksStored {
                parent_hash: None,
                block_hashes: hashes.to_vec(),
            }),
            broadcast,
        );
    }

    fn report(&self, r: wpb::LoadReport) {
        let _ = self.loads.send(r);
    }

    fn snapshots(&self) -> u32 {
        self.state.lock().snapshots
    }
}

#[tonic::async_trait]
impl Worker for FakeWorker {
    type GenerateStream = BoxStream<wpb::GenerateResponse>;
    async fn generate(
        &self,
        _: Request<wpb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented("fake worker"))
    }

    type GenerateSessionStream = BoxStream<wpb::GenerateSessionResponse>;
    async fn generate_session(
        &self,
        _: Request<tonic::Streaming<wpb::GenerateSessionRequest>>,
    ) -> Result<Response<Self::GenerateSessionStream>, Status> {
        Err(Status::unimplemented("fake worker"))
    }

    async fn prefill(
        &self,
        _: Request<wpb::PrefillRequest>,
    ) -> Result<Response<wpb::PrefillResponse>, Status> {
        Err(Status::unimplemented("fake worker"))
    }

    async fn fetch_prefix(
        &self,
        _: Request<wpb::FetchPrefixRequest>,
    ) -> Result<Response<wpb::FetchPrefixResponse>, Status> {
        Err(Status::unimplemented("fake worker"))
    }

    type SubscribeKvEventsStream = BoxStream<wpb::KvEventBatch>;
    async fn subscribe_kv_events(
        &self,
        request: Request<wpb::SubscribeKvEventsRequest>,
    ) -> Result<Response<Self::SubscribeKvEventsStream>, Status> {
        self.check_alive()?;
        let from = request.into_inner().from_seq;
        let live = self.events.subscribe();
        let replay: Vec<wpb::KvEvent> = self
            .state
            .lock()
            .log
            .iter()
            .filter(|e| e.seq > from)
            .cloned()
            .collect();
        let last = replay.last().map_or(from, |e| e.seq);
        let stream = replay_then_live(replay, live, last, self.dead.clone());
        Ok(Response::new(stream))
    }

    async fn kv_snapshot(
        &self,
        _: Request<wpb::KvSnapshotRequest>,
    ) -> Result<Response<wpb::KvSnapshotResponse>, Status> {
        self.check_alive()?;
        let mut s = self.state.lock();
        s.snapshots += 1;
        Ok(Response::new(wpb::KvSnapshotResponse {
            seq: s.seq,
            block_hashes: s.blocks.iter().copied().collect(),
            block_size: BS,
            dp_rank: 0,
            tier2_block_hashes: Vec::new(),
        }))
    }

    type LoadStream = BoxStream<wpb::LoadReport>;
    async fn load(
        &self,
        _: Request<wpb::LoadRequest>,
    ) -> Result<Response<Self::LoadStream>, Status> {
        self.check_alive()?;
        let rx = self.loads.subscribe();
        let dead = self.dead.clone();
        let stream = futures::stream::unfold((rx, dead), |(mut rx, dead)| async move {
            loop {
                let r = tokio::select! {
                    _ = dead.cancelled() => return None,
                    r = rx.recv() => r,
                };
                match r {
                    Ok(r) => return Some((Ok(r), (rx, dead))),
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(_) => return None,
                }
            }
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

/// The replayed events as one batch, then one batch per live event.
fn replay_then_live(
    replay: Vec<wpb::KvEvent>,
    mut live: broadcast::Receiver<wpb::KvEvent>,
    mut last: u64,
    dead: Shutdown,
) -> BoxStream<wpb::KvEventBatch> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(async move {
        let first = wpb::KvEventBatch {
            events: replay,
            snapshot_required: false,
            dp_rank: 0,
        };
        if tx.send(Ok(first)).await.is_err() {
            return;
        }
        loop {
            let next = tokio::select! {
                _ = dead.cancelled() => return,
                r = live.recv() => r,
            };
            let ev = match next {
                Ok(ev) if ev.seq > last => ev,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => continue,
                Err(broadcast::error::RecvError::Closed) => return,
            };
            last = ev.seq;
            let batch = wpb::KvEventBatch {
                events: vec![ev],
                snapshot_required: false,
                dp_rank: 0,
            };
            if tx.send(Ok(batch)).await.is_err() {
                return;
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

struct RunningWorker {
    fake: FakeWorker,
    registration: Option<Registration>,
    id: String,
    stop: Shutdown,
}

async fn start_worker(discovery: &Arc<dyn Discovery>) -> Result<RunningWorker> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let fake = FakeWorker::new();
    let stop = Shutdown::new();
    let server = tonic::transport::Server::builder()
        .add_service(WorkerServer::new(fake.clone()))
        .serve_with_incoming_shutdown(
            TcpListenerStream::new(listener),
            stop.clone().cancelled_owned(),
        );
    tokio::spawn(server);
    let instance = Instance::new("decode", addr.to_string())
        .with_model("m")
        .with_worker(WorkerInfo::new(WorkerRole::Decode, BS));
    let id = instance.id.clone();
    let registration = discovery.register(instance, 5).await?;
    Ok(RunningWorker {
        fake,
        registration: Some(registration),
        id,
        stop,
    })
}

struct RunningRouter {
    client: RouterClient<tonic::transport::Channel>,
    addr: std::net::SocketAddr,
    stop: Shutdown,
    task: tokio::task::JoinHandle<Result<(), sluice_router::RouterError>>,
}

async fn start_router(discovery: &Arc<dyn Discovery>, mode: RouterMode) -> Result<RunningRouter> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let stop = Shutdown::new();
    let args = Args {
        router_mode: mode,
        ..Args::default()
    };
    let ctx = ServiceContext::new(Arc::clone(discovery), stop.clone());
    let task = tokio::spawn(sluice_router::serve(listener, args, ctx));
    // Ready = registered: serve registers only after the initial snapshots.
    wait_for(Duration::from_secs(10), || async {
        Ok(discovery
            .list("router")
            .await?
            .iter()
            .any(|i| i.endpoint == addr.to_string()))
    })
    .await
    .context("router never registered")?;
    let client = RouterClient::connect(format!("http://{addr}")).await?;
    Ok(RunningRouter {
        client,
        addr,
        stop,
        task,
    })
}

impl RunningRouter {
    /// A gauge or counter of the router's `/metrics` (HTTP/1.1 on its port).
    async fn metric(&self, name: &str) -> Result<Option<f64>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(self.addr).await?;
        conn.write_all(
            format!(
                "GET /metrics HTTP/1.1\r\nHost: {}\r\nConnection: close\r\n\r\n",
                self.addr
            )
            .as_bytes(),
        )
        .await?;
        let mut page = String::new();
        conn.read_to_string(&mut page).await?;
        Ok(page.lines().find_map(|l| {
            l.strip_prefix(name)
                .filter(|rest| rest.starts_with(' '))
                .and_then(|v| v.trim().parse().ok())
        }))
    }

    async fn stop(self) -> Result<()> {
        self.stop.cancel();
        self.task.await??;
        Ok(())
    }
}

async fn wait_for<F, Fut>(timeout: Duration, mut f: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<bool>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if f().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("condition not met within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn prompt(seed: u32, blocks: u32) -> (Vec<u64>, u32) {
    let tokens: Vec<u32> = (0..blocks * BS).map(|i| seed * 1_000_003 + i).collect();
    (sequence_block_hashes(&tokens, BS as usize), blocks * BS)
}

fn route_req(hashes: &[u64], prompt_tokens: u32, commit: bool) -> pb::RouteRequest {
    pb::RouteRequest {
        description: Some(common::RequestDescription {
            request_id: "req".into(),
            model: "m".into(),
            prompt_tokens,
            block_hashes: hashes.to_vec(),
            block_size: BS,
            priority: 0,
            ..Default::default()
        }),
        pool: pb::Pool::Decode as i32,
        commit,
        ..Default::default()
    }
}

async fn route(
    client: &mut RouterClient<tonic::transport::Channel>,
    hashes: &[u64],
    tokens: u32,
) -> Result<pb::RouteResponse> {
    Ok(client
        .route(route_req(hashes, tokens, false))
        .await?
        .into_inner())
}

fn chosen(r: &pb::RouteResponse) -> &str {
    r.target.as_ref().map_or("", |t| t.worker_id.as_str())
}

/// Routes (dry run) until the reply shows `overlap` blocks on `worker`.
async fn wait_overlap(
    client: &mut RouterClient<tonic::transport::Channel>,
    hashes: &[u64],
    tokens: u32,
    worker: &str,
    overlap: u32,
) -> Result<pb::RouteResponse> {
    let mut last = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while tokio::time::Instant::now() < deadline {
        let r = route(client, hashes, tokens).await?;
        if chosen(&r) == worker && r.overlap_blocks == overlap {
            return Ok(r);
        }
        last = Some(r);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("never saw {overlap} blocks on {worker}; last reply {last:?}")
}

/// Routes until `worker` is the only candidate left, which then holds none
/// of the prompt.
async fn wait_sole_candidate(
    client: &mut RouterClient<tonic::transport::Channel>,
    hashes: &[u64],
    tokens: u32,
    worker: &str,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let r = route(client, hashes, tokens).await?;
        if r.candidates.len() == 1 {
            assert_eq!(chosen(&r), worker);
            assert_eq!(r.overlap_blocks, 0);
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the other worker was never forgotten: {r:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_to_the_prefix_holder_resyncs_on_gaps_and_forgets_departed_workers() -> Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let mut a = start_worker(&discovery).await?;
    let b = start_worker(&discovery).await?;
    let router = start_router(&discovery, RouterMode::Kv).await?;
    let mut client = router.client.clone();

    // A request whose prefix one worker holds goes there.
    let (h, tokens) = prompt(1, 8);
    a.fake.store(&h[..6]);
    let r = wait_overlap(&mut client, &h, tokens, &a.id, 6).await?;
    assert_eq!(r.mode(), pb::RouterMode::Kv);
    assert_eq!(r.candidates.len(), 2);
    let other = r
        .candidates
        .iter()
        .find(|c| c.target.as_ref().is_some_and(|t| t.worker_id == b.id))
        .context("b is a candidate")?;
    assert_eq!(other.overlap_blocks, 0);
    assert!(
        other.prefill_cost
            > r.candidates
                .iter()
                .map(|c| c.prefill_cost)
                .fold(f64::INFINITY, f64::min)
    );

    // A gap (an event lost on the live stream) triggers a snapshot resync
    // that restores the same index: the lost blocks become visible.
    let (h2, tokens2) = prompt(2, 4);
    let snapshots_before = b.fake.snapshots();
    b.fake.store_lost(&h2[..2]);
    b.fake.store(&h2[2..]);
    wait_overlap(&mut client, &h2, tokens2, &b.id, 4).await?;
    assert!(
        b.fake.snapshots() > snapshots_before,
        "resync took a snapshot"
    );

    // Equal overlap spreads by load: both hold h3, b reports heavy load
    // from requests no router placed.
    let (h3, tokens3) = prompt(3, 4);
    a.fake.store(&h3);
    b.fake.store(&h3);
    wait_for(Duration::from_secs(10), || {
        let mut client = client.clone();
        let h3 = h3.clone();
        async move {
            let r = route(&mut client, &h3, tokens3).await?;
            Ok(r.candidates.iter().all(|c| c.overlap_blocks == 4))
        }
    })
    .await?;
    b.fake.report(wpb::LoadReport {
        active_blocks: 500,
        running: 8,
        unplaced_requests: 8,
        unplaced_blocks: 500,
        ..Default::default()
    });
    a.fake.report(wpb::LoadReport::default());
    wait_overlap(&mut client, &h3, tokens3, &a.id, 4).await?;

    // A departed worker's blocks vanish.
    if let Some(reg) = a.registration.take() {
        reg.deregister().await;
    }
    wait_sole_candidate(&mut client, &h, tokens, &b.id).await?;
    a.stop.cancel();
    router.stop().await?;
    b.stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_router_routes_as_before_from_its_first_request() -> Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let workers = [
        start_worker(&discovery).await?,
        start_worker(&discovery).await?,
        start_worker(&discovery).await?,
    ];
    let prompts: Vec<(Vec<u64>, u32)> = (0..3).map(|i| prompt(10 + i, 6)).collect();
    for (w, (h, _)) in workers.iter().zip(&prompts) {
        w.fake.store(h);
    }
    let router = start_router(&discovery, RouterMode::Kv).await?;
    let mut client = router.client.clone();
    for (w, (h, t)) in workers.iter().zip(&prompts) {
        wait_overlap(&mut client, h, *t, &w.id, 6).await?;
    }
    router.stop().await?;

    // The new router rebuilt its index from snapshots before it reported
    // ready: its very first answers are the same, no waiting.
    let router = start_router(&discovery, RouterMode::Kv).await?;
    let mut client = router.client.clone();
    for (w, (h, t)) in workers.iter().zip(&prompts) {
        let r = route(&mut client, h, *t).await?;
        assert_eq!(chosen(&r), w.id);
        assert_eq!(r.overlap_blocks, 6);
    }
    router.stop().await?;
    for w in &workers {
        w.stop.cancel();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_session_whose_caller_stops_reading_ends() -> Result<()> {
    use sluice_proto::router::v1::place_request::Msg as PlaceMsg;
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let router = start_router(&discovery, RouterMode::RoundRobin).await?;
    // A caller in this process: no socket, so no reset tells the router
    // that the caller left.
    let endpoint = router.addr.to_string();
    wait_for(Duration::from_secs(5), || async {
        Ok(sluice_runtime::local::is_local(&endpoint))
    })
    .await
    .context("the router never became callable in this process")?;
    let mut client = RouterClient::new(sluice_runtime::grpc::channel(&endpoint)?);
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(pb::PlaceRequest {
        msg: Some(PlaceMsg::Hello(pb::PlaceHello {
            client_id: "queue-a".into(),
        })),
    })?;
    let answers = client
        .place(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let sessions = "sluice_router_place_sessions";
    wait_for(Duration::from_secs(5), || async {
        Ok(router.metric(sessions).await? == Some(1.0))
    })
    .await
    .context("the session never counted as open")?;
    // The answers go unread while the requests stay open (`tx` lives).
    drop(answers);
    wait_for(Duration::from_secs(10), || async {
        Ok(router.metric(sessions).await? == Some(0.0))
    })
    .await
    .context("the session outlived its reader")?;
    drop(tx);
    router.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_load_sends_a_view_then_one_per_report_and_bad_requests_are_invalid() -> Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let w = start_worker(&discovery).await?;
    let router = start_router(&discovery, RouterMode::RoundRobin).await?;
    let mut client = router.client.clone();

    let mut stream = client
        .watch_load(pb::WatchLoadRequest {
            model: "m".into(),
            client_id: String::new(),
        })
        .await?
        .into_inner();
    let first = stream.message().await?.context("first view")?;
    assert_eq!(first.workers.len(), 1);
    w.fake.report(wpb::LoadReport {
        running: 3,
        active_blocks: 42,
        pending_prefill_tokens: 7,
        unplaced_requests: 3,
        unplaced_blocks: 42,
        unplaced_prefill_tokens: 7,
        priority_scheduling: true,
        ..Default::default()
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = tokio::time::timeout_at(deadline, stream.message())
            .await
            .context("no view with the report")??
            .context("stream ended")?;
        if v.workers.first().is_some_and(|l| l.running == 3) {
            assert_eq!(v.workers[0].active_decode_blocks, 42);
            assert_eq!(v.workers[0].active_prefill_tokens, 7);
            assert_eq!(v.workers[0].unplaced_requests, 3);
            assert_eq!(v.workers[0].role(), wpb::WorkerRole::Decode);
            assert!(
                v.workers[0].priority_scheduling,
                "the queue hears how the engine schedules"
            );
            break;
        }
    }

    let bad = route_req(&[1, 2, 3], 16, false);
    let err = client.route(bad).await.expect_err("too many hashes");
    assert_eq!(err.code(), tonic::Code::InvalidArgument);

    let mut none = route_req(&[], 16, false);
    if let Some(d) = none.description.as_mut() {
        d.model = "unknown".into();
    }
    let err = client.route(none).await.expect_err("no such model");
    assert_eq!(err.code(), tonic::Code::Unavailable);

    let mut prefill = route_req(&[], 16, false);
    prefill.pool = pb::Pool::Prefill as i32;
    let err = client.route(prefill).await.expect_err("no prefill workers");
    assert_eq!(err.code(), tonic::Code::Unavailable);

    router.stop().await?;
    w.stop.cancel();
    Ok(())
}

/// Two queue replicas on Place sessions: each one's `WatchLoad` view counts
/// the other's placements by priority and what the other holds, never its
/// own; a replica's held report goes when its session ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_sees_the_other_replicas_placements_and_held_requests_not_its_own() -> Result<()>
{
    use sluice_proto::router::v1::place_request::Msg as PlaceMsg;
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let w = start_worker(&discovery).await?;
    let router = start_router(&discovery, RouterMode::RoundRobin).await?;
    let mut client = router.client.clone();
    // Queue "a" places a priority-3 request and holds two of priority 1.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(pb::PlaceRequest {
        msg: Some(PlaceMsg::Hello(pb::PlaceHello {
            client_id: "queue-a".into(),
        })),
    })?;
    let mut answers = client
        .place(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut req = route_req(&[], 16, true);
    req.placement_id = 7;
    if let Some(d) = req.description.as_mut() {
        d.priority = 3;
    }
    tx.send(pb::PlaceRequest {
        msg: Some(PlaceMsg::Route(pb::PlaceCall {
            call_id: 1,
            request: Some(req),
            traceparent: String::new(),
        })),
    })?;
    let answer = answers.message().await?.context("an answer")?;
    assert!(matches!(
        answer.result,
        Some(pb::place_response::Result::Routed(_))
    ));
    tx.send(pb::PlaceRequest {
        msg: Some(PlaceMsg::Held(pb::HeldReport {
            models: vec![pb::HeldModel {
                model: "m".into(),
                by_priority: vec![pb::PriorityCount {
                    priority: 1,
                    count: 2,
                }],
            }],
        })),
    })?;
    let view_of = |client_id: &str| pb::WatchLoadRequest {
        model: "m".into(),
        client_id: client_id.into(),
    };
    let others = |v: &pb::LoadView| -> Vec<(i32, u32)> {
        v.workers
            .iter()
            .flat_map(|w| w.others_by_priority.iter().map(|c| (c.priority, c.count)))
            .collect()
    };
    let held = |v: &pb::LoadView| -> Vec<(String, i32, u32)> {
        v.held
            .iter()
            .flat_map(|m| {
                m.by_priority
                    .iter()
                    .map(|c| (m.model.clone(), c.priority, c.count))
            })
            .collect()
    };
    let mut b = client.watch_load(view_of("queue-b")).await?.into_inner();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = tokio::time::timeout_at(deadline, b.message())
            .await
            .context("no view with queue-a's placement and held requests")??
            .context("stream ended")?;
        if others(&v) == [(3, 1)] && held(&v) == [("m".to_owned(), 1, 2)] {
            break;
        }
    }
    let mut a = client.watch_load(view_of("queue-a")).await?.into_inner();
    let own = a.message().await?.context("a view")?;
    assert!(others(&own).is_empty(), "its own placements are left out");
    assert!(held(&own).is_empty(), "its own held requests are left out");
    // Queue "a" goes: what it held goes with it.
    drop((tx, answers));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let v = tokio::time::timeout_at(deadline, b.message())
            .await
            .context("queue-a's held requests outlived its session")??
            .context("stream ended")?;
        if held(&v).is_empty() {
            break;
        }
    }
    router.stop().await?;
    w.stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_streams_end_for_good_is_forgotten_while_still_registered() -> Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let a = start_worker(&discovery).await?;
    let b = start_worker(&discovery).await?;
    let router = start_router(&discovery, RouterMode::Kv).await?;
    let mut client = router.client.clone();
    let (h, tokens) = prompt(30, 4);
    a.fake.store(&h);
    wait_overlap(&mut client, &h, tokens, &a.id, 4).await?;

    // a's process dies but its lease has not expired yet.
    a.fake.dead.cancel();
    wait_sole_candidate(&mut client, &h, tokens, &b.id).await?;
    assert!(a.registration.is_some(), "still registered");
    router.stop().await?;
    a.stop.cancel();
    b.stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approx_mode_routes_repeats_of_a_prompt_to_the_same_worker() -> Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
    let workers = [
        start_worker(&discovery).await?,
        start_worker(&discovery).await?,
        start_worker(&discovery).await?,
    ];
    let router = start_router(&discovery, RouterMode::Approx).await?;
    let mut client = router.client.clone();
    wait_for(Duration::from_secs(10), || {
        let mut client = client.clone();
        async move { Ok(route(&mut client, &[], 16).await?.candidates.len() == 3) }
    })
    .await?;
    let prompts: Vec<(Vec<u64>, u32)> = (0..3).map(|i| prompt(40 + i, 8)).collect();
    let mut first = Vec::new();
    for (h, t) in &prompts {
        let r = client.route(route_req(h, *t, true)).await?.into_inner();
        assert_eq!(r.mode(), pb::RouterMode::Approx);
        first.push(chosen(&r).to_owned());
    }
    for round in 0..3 {
        // Earlier placements still count (a unary commit ages out), but a
        // repeat shares all of its blocks with them, so they cost it nothing.
        for (i, (h, t)) in prompts.iter().enumerate() {
            let r = client.route(route_req(h, *t, true)).await?.into_inner();
            assert_eq!(chosen(&r), first[i], "round {round}, prompt {i}");
            assert_eq!(r.overlap_blocks, 8);
        }
    }
    router.stop().await?;
    for w in &workers {
        w.stop.cancel();
    }
    Ok(())
}
