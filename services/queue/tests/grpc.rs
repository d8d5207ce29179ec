//! The queue served for real on 127.0.0.1:0, found through in-process
//! discovery, placing with a tiny in-test Router server whose load view the
//! test controls.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use futures::{Stream, StreamExt};
use parking_lot::Mutex;
use sluice_proto::common::v1 as common;
use sluice_proto::queue::v1 as pb;
use sluice_proto::queue::v1::queue_client::QueueClient;
use sluice_proto::router::v1 as router_pb;
use sluice_proto::router::v1::router_server::{Router, RouterServer};
use sluice_proto::worker::v1::WorkerRole;
use sluice_runtime::discovery::MemoryDiscovery;
use sluice_runtime::{Discovery, Instance, Registration, ServiceContext, Shutdown};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, WatchStream};
use tonic::{Code, Request, Response, Status, Streaming};

/// Routes everything to `w0` (and `p0` in the prefill pool), recording
/// calls, and what its placement sessions tell it.
#[derive(Clone)]
struct TestRouter {
    routes: Arc<Mutex<Vec<(String, i32, bool)>>>,
    /// `hello:CLIENT`, `placed:ID`, `started:ID`, `released:ID`, in order.
    events: Arc<Mutex<Vec<String>>>,
    load: watch::Receiver<router_pb::LoadView>,
}

impl TestRouter {
    fn answer(&self, req: router_pb::RouteRequest) -> router_pb::RouteResponse {
        let desc = req.description.unwrap_or_default();
        self.routes
            .lock()
            .push((desc.request_id.clone(), req.pool, req.commit));
        let worker = if req.pool == router_pb::Pool::Prefill as i32 {
            "p0"
        } else {
            "w0"
        };
        let target = router_pb::Target {
            worker_id: worker.into(),
            dp_rank: 0,
            endpoint: format!("{worker}.local:1"),
        };
        router_pb::RouteResponse {
            target: Some(target.clone()),
            overlap_blocks: u32::try_from(desc.block_hashes.len()).unwrap_or(0),
            mode: router_pb::RouterMode::Kv as i32,
            candidates: Vec::new(),
            predicted_within_target: None,
            prefix_source: None,
            placement: req.commit.then(|| router_pb::Placement {
                placement_id: req.placement_id,
                pool: req.pool,
                target: Some(target),
                prefill_tokens: u64::from(desc.prompt_tokens),
                blocks: desc.prompt_tokens.div_ceil(desc.block_size.max(1)),
                block_hashes: desc.block_hashes.clone(),
                started: false,
                priority: desc.priority,
                tpot_target_ms: desc.tpot_target_ms,
            }),
        }
    }
}

#[tonic::async_trait]
impl Router for TestRouter {
    async fn route(
        &self,
        request: Request<router_pb::RouteRequest>,
    ) -> Result<Response<router_pb::RouteResponse>, Status> {
        Ok(Response::new(self.answer(request.into_inner())))
    }

    type PlaceStream =
        Pin<Box<dyn Stream<Item = Result<router_pb::PlaceResponse, Status>> + Send + 'static>>;

    async fn place(
        &self,
        request: Request<Streaming<router_pb::PlaceRequest>>,
    ) -> Result<Response<Self::PlaceStream>, Status> {
        use router_pb::place_request::Msg;
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(64);
        let router = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                match m.msg {
                    Some(Msg::Hello(h)) => {
                        router.events.lock().push(format!("hello:{}", h.client_id))
                    }
                    Some(Msg::Route(call)) => {
                        let answer = router.answer(call.request.unwrap_or_default());
                        let reply = router_pb::PlaceResponse {
                            call_id: call.call_id,
                            result: Some(router_pb::place_response::Result::Routed(answer)),
                        };
                        if tx.send(Ok(reply)).await.is_err() {
                            return;
                        }
                    }
                    Some(Msg::Placed(p)) => router
                        .events
                        .lock()
                        .push(format!("placed:{}", p.placement_id)),
                    Some(Msg::Held(h)) => router.events.lock().push(format!(
                        "held:{}",
                        h.models.iter().map(|m| m.by_priority.len()).sum::<usize>()
                    )),
                    Some(Msg::Update(u)) => {
                        let what = if u.state == router_pb::PlacementState::Started as i32 {
                            "started"
                        } else {
                            "released"
                        };
                        router
                            .events
                            .lock()
                            .push(format!("{what}:{}", u.placement_id));
                    }
                    None => {}
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    type WatchLoadStream =
        Pin<Box<dyn Stream<Item = Result<router_pb::LoadView, Status>> + Send + 'static>>;

    async fn watch_load(
        &self,
        _request: Request<router_pb::WatchLoadRequest>,
    ) -> Result<Response<Self::WatchLoadStream>, Status> {
        let stream = WatchStream::new(self.load.clone()).map(Ok);
        Ok(Response::new(Box::pin(stream)))
    }
}

fn worker(id: &str, role: WorkerRole, active: u64) -> router_pb::WorkerLoad {
    router_pb::WorkerLoad {
        target: Some(router_pb::Target {
            worker_id: id.into(),
            dp_rank: 0,
            endpoint: format!("{id}.local:1"),
        }),
        model: "m".into(),
        role: role as i32,
        active_prefill_tokens: active,
        max_num_batched_tokens: 100,
        ..Default::default()
    }
}

fn view(workers: Vec<router_pb::WorkerLoad>) -> router_pb::LoadView {
    router_pb::LoadView {
        workers,
        held: Vec::new(),
    }
}

struct Mesh {
    queue: QueueClient<tonic::transport::Channel>,
    addr: SocketAddr,
    routes: Arc<Mutex<Vec<(String, i32, bool)>>>,
    events: Events,
    load: watch::Sender<router_pb::LoadView>,
    shutdown: Shutdown,
    served: tokio::task::JoinHandle<Result<(), sluice_queue::QueueError>>,
    _router: Option<Registration>,
}

type Routes = Arc<Mutex<Vec<(String, i32, bool)>>>;
type Events = Arc<Mutex<Vec<String>>>;

/// A test router holding `initial` load, served and registered in `discovery`.
async fn start_router(
    discovery: &Arc<dyn Discovery>,
    initial: router_pb::LoadView,
) -> anyhow::Result<(
    watch::Sender<router_pb::LoadView>,
    Routes,
    Events,
    Option<Registration>,
)> {
    let (load, load_rx) = watch::channel(initial);
    let routes = Arc::new(Mutex::new(Vec::new()));
    let events = Arc::new(Mutex::new(Vec::new()));
    let router = TestRouter {
        routes: Arc::clone(&routes),
        events: Arc::clone(&events),
        load: load_rx,
    };
    let router_listener = TcpListener::bind("127.0.0.1:0").await?;
    let router_addr = router_listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RouterServer::new(router))
            .serve_with_incoming(TcpListenerStream::new(router_listener)),
    );
    let registration = discovery
        .register(Instance::new("router", router_addr.to_string()), 5)
        .await?;
    Ok((load, routes, events, Some(registration)))
}

impl Mesh {
    /// A router holding `initial` load, registered in discovery, and the
    /// queue started with `flags`.
    async fn start(flags: &[&str], initial: router_pb::LoadView) -> anyhow::Result<Self> {
        let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("default"));
        let (load, routes, events, registration) = start_router(&discovery, initial).await?;
        Self::start_queue(discovery, flags, load, routes, events, registration).await
    }

    /// The queue started with `flags` over `discovery`.
    async fn start_queue(
        discovery: Arc<dyn Discovery>,
        flags: &[&str],
        load: watch::Sender<router_pb::LoadView>,
        routes: Routes,
        events: Events,
        registration: Option<Registration>,
    ) -> anyhow::Result<Self> {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: sluice_queue::Args,
        }
        let mut argv = vec!["queue"];
        argv.extend_from_slice(flags);
        let args = Cli::try_parse_from(argv)?.args;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        let shutdown = Shutdown::new();
        let ctx = ServiceContext::new(Arc::clone(&discovery), shutdown.clone());
        let served = tokio::spawn(sluice_queue::serve(listener, args, ctx));
        let queue = QueueClient::connect(format!("http://{addr}")).await?;
        Ok(Self {
            queue,
            addr,
            routes,
            events,
            load,
            shutdown,
            served,
            _router: registration,
        })
    }

    /// Opens a lease; returns the sender (drop it or send `done` to
    /// release) and the response stream.
    async fn admit(
        &self,
        open: pb::AdmitOpen,
    ) -> Result<(mpsc::Sender<pb::AdmitRequest>, Streaming<pb::AdmitResponse>), Status> {
        let (tx, rx) = mpsc::channel(4);
        tx.send(pb::AdmitRequest {
            msg: Some(pb::admit_request::Msg::Open(open)),
        })
        .await
        .map_err(|_| Status::internal("send"))?;
        let responses = self
            .queue
            .clone()
            .admit(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok((tx, responses))
    }

    /// Admits `id-0`, `id-1`, … until one is held, which shows the router's
    /// load view has reached the queue; earlier probes are granted and
    /// released. Returns the held one's id, sender, stream and status.
    async fn admit_held(&self, id: &str, priority: i32) -> anyhow::Result<HeldLease> {
        for i in 0..200 {
            let probe = format!("{id}-{i}");
            let (tx, mut stream) = self.admit(open(&probe, priority)).await?;
            match next_msg(&mut stream).await? {
                pb::admit_response::Msg::Held(status) => {
                    return Ok(HeldLease {
                        id: probe,
                        tx,
                        stream,
                        status,
                    });
                }
                pb::admit_response::Msg::Grant(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
        anyhow::bail!("never held")
    }

    async fn stats(&self) -> anyhow::Result<pb::StatsResponse> {
        Ok(self
            .queue
            .clone()
            .stats(pb::StatsRequest {})
            .await?
            .into_inner())
    }

    /// Waits until the queue's stats satisfy `done` (the queue follows
    /// stream ends and load views asynchronously).
    async fn eventually(&self, done: impl Fn(&pb::StatsResponse) -> bool) -> anyhow::Result<()> {
        for _ in 0..200 {
            if done(&self.stats().await?) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        anyhow::bail!("condition not reached: {:?}", self.stats().await?)
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        self.served.await?.context("serve")?;
        Ok(())
    }
}

struct HeldLease {
    id: String,
    tx: mpsc::Sender<pb::AdmitRequest>,
    stream: Streaming<pb::AdmitResponse>,
    status: pb::Held,
}

fn description(id: &str, priority: i32) -> common::RequestDescription {
    common::RequestDescription {
        request_id: id.into(),
        model: "m".into(),
        priority,
        strict_priority: 0,
        tenant: String::new(),
        prompt_tokens: 64,
        block_hashes: vec![11, 22],
        block_size: 16,
        expected_output_tokens: 0,
        ttft_target_ms: 0,
        tpot_target_ms: 0,
        exclude_worker_ids: Vec::new(),
        tenant_weight: 0,
    }
}

fn open_with(description: common::RequestDescription) -> pb::AdmitOpen {
    pb::AdmitOpen {
        description: Some(description),
        deadline_ms: 0,
    }
}

fn open(id: &str, priority: i32) -> pb::AdmitOpen {
    open_with(description(id, priority))
}

async fn next_msg(
    stream: &mut Streaming<pb::AdmitResponse>,
) -> anyhow::Result<pb::admit_response::Msg> {
    let response = tokio::time::timeout(Duration::from_secs(5), stream.message())
        .await
        .context("timed out")??
        .context("stream ended")?;
    response.msg.context("empty response")
}

fn done() -> pb::AdmitRequest {
    pb::AdmitRequest {
        msg: Some(pb::admit_request::Msg::Done(pb::AdmitDone::default())),
    }
}

#[tokio::test]
async fn grant_then_done_releases_the_slot_for_the_held_request() -> anyhow::Result<()> {
    let mesh = Mesh::start(
        &["--max-active", "1"],
        view(vec![worker("w0", WorkerRole::Aggregated, 0)]),
    )
    .await?;
    let (a_tx, mut a) = mesh.admit(open("a", 0)).await?;
    let pb::admit_response::Msg::Grant(grant) = next_msg(&mut a).await? else {
        anyhow::bail!("a not granted at once");
    };
    assert_eq!(grant.worker_id, "w0");
    assert_eq!(grant.worker_endpoint, "w0.local:1");
    assert_eq!(grant.overlap_tokens, 32, "2 blocks of 16 cached");
    assert!(grant.prefill_worker_id.is_empty());

    let (b_tx, mut b) = mesh.admit(open("b", 0)).await?;
    let pb::admit_response::Msg::Held(held) = next_msg(&mut b).await? else {
        anyhow::bail!("b not held");
    };
    assert_eq!((held.position, held.pending), (0, 1));
    assert_eq!(held.reason, "active leases at limit");

    a_tx.send(done()).await?;
    let pb::admit_response::Msg::Grant(grant) = next_msg(&mut b).await? else {
        anyhow::bail!("b not granted after a's lease ended");
    };
    assert!(grant.queue_wait_ms > 0.0);
    assert!(
        a.message().await?.is_none(),
        "a's stream ends with its lease"
    );

    drop(b_tx); // closing the client side releases too
    mesh.eventually(|s| s.active == 0 && s.pending == 0).await?;
    // Each lease's end reached the router as the release of its placement.
    for _ in 0..300 {
        if mesh
            .events
            .lock()
            .iter()
            .filter(|e| e.starts_with("released:"))
            .count()
            == 2
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let released = mesh
        .events
        .lock()
        .iter()
        .filter(|e| e.starts_with("released:"))
        .count();
    assert_eq!(released, 2, "{:?}", mesh.events.lock());
    let routes = mesh.routes.lock().clone();
    assert_eq!(
        routes,
        [
            ("a".to_owned(), router_pb::Pool::Decode as i32, true),
            ("b".to_owned(), router_pb::Pool::Decode as i32, true),
        ]
    );
    mesh.stop().await
}

#[tokio::test]
async fn threshold_holds_on_the_routers_load_and_releases_when_it_drops() -> anyhow::Result<()> {
    let mesh = Mesh::start(
        &["--queue-threshold", "0.5"],
        view(vec![worker("w0", WorkerRole::Aggregated, 1000)]),
    )
    .await?;
    let mut held = mesh.admit_held("held", 3).await?;
    assert_eq!(held.status.reason, "all workers above threshold");
    assert_eq!((held.status.position, held.status.pending), (0, 1));
    let stats = mesh.stats().await?;
    assert_eq!(
        stats.policy(),
        pb::QueuePolicy::Strict,
        "the default policy"
    );
    assert_eq!(stats.threshold, 0.5);
    assert_eq!(stats.pending, 1);
    assert_eq!(stats.tiers.len(), 1);
    assert_eq!(stats.tiers[0].priority, 3);
    assert_eq!(stats.tiers[0].pending_tokens, 64);
    assert!(
        !mesh.routes.lock().iter().any(|r| r.0 == held.id),
        "nothing placed while held"
    );

    mesh.load
        .send(view(vec![worker("w0", WorkerRole::Aggregated, 0)]))?;
    let pb::admit_response::Msg::Grant(grant) = next_msg(&mut held.stream).await? else {
        anyhow::bail!("not granted after load dropped");
    };
    assert_eq!(grant.worker_id, "w0");
    held.tx.send(done()).await?;
    mesh.eventually(|s| s.active == 0).await?;
    mesh.stop().await
}

#[tokio::test]
async fn prefill_pool_adds_a_prefill_placement() -> anyhow::Result<()> {
    let mesh = Mesh::start(
        &[],
        view(vec![
            worker("w0", WorkerRole::Decode, 0),
            worker("p0", WorkerRole::Prefill, 0),
        ]),
    )
    .await?;
    // The placer learns the prefill pool from the load view; poll until it has.
    for _ in 0..200 {
        let (_tx, mut stream) = mesh.admit(open("probe", 0)).await?;
        let pb::admit_response::Msg::Grant(grant) = next_msg(&mut stream).await? else {
            anyhow::bail!("not granted");
        };
        if !grant.prefill_worker_id.is_empty() {
            assert_eq!(grant.prefill_worker_id, "p0");
            assert_eq!(grant.prefill_worker_endpoint, "p0.local:1");
            assert_eq!(grant.worker_id, "w0");
            drop((_tx, stream)); // end the lease so shutdown need not drain it
            return mesh.stop().await;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("prefill pool never used")
}

#[tokio::test]
async fn overload_yields_resource_exhausted() -> anyhow::Result<()> {
    let mesh = Mesh::start(
        &[
            "--queue-threshold",
            "0",
            "--max-pending",
            "1",
            "--shed-protect-fraction",
            "0",
        ],
        view(vec![worker("w0", WorkerRole::Aggregated, 1000)]),
    )
    .await?;
    let _first = mesh.admit_held("first", 0).await?;
    let err = mesh.admit(open("second", 0)).await.expect_err("full");
    assert_eq!(err.code(), Code::ResourceExhausted);
    assert!(err.message().contains("--max-pending"), "{}", err.message());
    mesh.stop().await
}

#[tokio::test]
async fn a_tenant_over_its_token_quota_is_refused_with_retry_after_metadata() -> anyhow::Result<()>
{
    let file = std::env::temp_dir().join(format!("sluice-quota-{}", std::process::id()));
    std::fs::write(&file, "acme tpm=120 # 2 tokens a second\n")?;
    let path = file.to_str().context("utf-8 path")?;
    let mesh = Mesh::start(
        &["--tenant-limits", path],
        view(vec![worker("w0", WorkerRole::Aggregated, 0)]),
    )
    .await?;
    let acme = |id: &str| {
        open_with(common::RequestDescription {
            tenant: "acme".into(),
            ..description(id, 0)
        })
    };
    // 64 prompt tokens, 32 of them cached (the router's overlap): 32 charged.
    let (tx, mut first) = mesh.admit(acme("first")).await?;
    let pb::admit_response::Msg::Grant(_) = next_msg(&mut first).await? else {
        anyhow::bail!("first not granted");
    };
    // 100 output tokens over the lease: 120 - 32 - 100 = -12 tokens left.
    tx.send(pb::AdmitRequest {
        msg: Some(pb::admit_request::Msg::Progress(pb::AdmitProgress {
            completion_tokens: 60,
        })),
    })
    .await?;
    tx.send(pb::AdmitRequest {
        msg: Some(pb::admit_request::Msg::Done(pb::AdmitDone {
            completion_tokens: 100,
        })),
    })
    .await?;
    assert!(first.message().await?.is_none(), "the lease ended");
    mesh.eventually(|s| s.active == 0).await?;

    let err = mesh.admit(acme("second")).await.expect_err("over quota");
    assert_eq!(err.code(), Code::ResourceExhausted);
    let meta = |k: &str| err.metadata().get(k).and_then(|v| v.to_str().ok());
    assert_eq!(meta("sluice-quota"), Some("tokens"));
    // 13 tokens at 2 a second: 7 s (less whatever refilled meanwhile).
    let retry: u64 = meta("retry-after").context("retry-after")?.parse()?;
    assert!((6..=7).contains(&retry), "retry-after {retry}");
    assert!(
        err.message()
            .contains("tenant \"acme\" is over its limit of 120 tokens per minute"),
        "{}",
        err.message()
    );
    let (_other, mut other) = mesh.admit(open("other-tenant", 0)).await?;
    assert!(matches!(
        next_msg(&mut other).await?,
        pb::admit_response::Msg::Grant(_)
    ));
    let _ = std::fs::remove_file(&file);
    mesh.stop().await
}

#[tokio::test]
async fn malformed_open_is_invalid_argument_naming_the_field() -> anyhow::Result<()> {
    let mesh = Mesh::start(&[], view(Vec::new())).await?;
    let bad = open_with(common::RequestDescription {
        block_size: 0,
        ..description("bad", 0)
    });
    let err = mesh.admit(bad).await.expect_err("invalid");
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("open.description.block_size"),
        "{}",
        err.message()
    );

    let (tx, rx) = mpsc::channel(1);
    tx.send(done()).await?;
    let err = mesh
        .queue
        .clone()
        .admit(ReceiverStream::new(rx))
        .await
        .expect_err("done first");
    assert_eq!(err.code(), Code::InvalidArgument);
    mesh.stop().await
}

#[tokio::test]
async fn held_request_whose_client_disconnects_never_reaches_the_router() -> anyhow::Result<()> {
    let mesh = Mesh::start(
        &["--queue-threshold", "0.5"],
        view(vec![worker("w0", WorkerRole::Aggregated, 1000)]),
    )
    .await?;
    let gone = mesh.admit_held("gone", 0).await?;
    let gone_id = gone.id.clone();
    drop(gone);
    mesh.eventually(|s| s.pending == 0).await?;
    mesh.load
        .send(view(vec![worker("w0", WorkerRole::Aggregated, 0)]))?;
    let (_tx, mut next) = mesh.admit(open("next", 0)).await?;
    // The new load view may reach the queue after this request: it can be
    // held for a moment first, then granted.
    loop {
        match next_msg(&mut next).await? {
            pb::admit_response::Msg::Grant(_) => break,
            pb::admit_response::Msg::Held(_) => continue,
        }
    }
    let ids: Vec<String> = mesh.routes.lock().iter().map(|r| r.0.clone()).collect();
    assert!(!ids.contains(&gone_id), "{ids:?}");
    assert_eq!(ids.last().map(String::as_str), Some("next"));
    drop((_tx, next));
    mesh.stop().await
}

/// The queue's `/metrics` page (HTTP/1.1 on its gRPC port), status line
/// and headers included.
async fn scrape(addr: std::net::SocketAddr) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"GET /metrics HTTP/1.1\r\nHost: queue\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = String::new();
    conn.read_to_string(&mut body).await?;
    Ok(body)
}

#[tokio::test]
async fn metrics_are_served_on_the_grpc_port() -> anyhow::Result<()> {
    let mesh = Mesh::start(&[], view(vec![worker("w0", WorkerRole::Aggregated, 0)])).await?;
    let (tx, mut stream) = mesh.admit(open("counted", 2)).await?;
    let pb::admit_response::Msg::Grant(_) = next_msg(&mut stream).await? else {
        anyhow::bail!("not granted");
    };
    let body = scrape(mesh.addr).await?;
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.contains("sluice_queue_grants_total{priority=\"2\"} 1"),
        "{body}"
    );
    assert!(body.contains("sluice_queue_active_leases 1"), "{body}");
    drop((tx, stream));
    mesh.stop().await
}

#[tokio::test]
async fn a_request_placed_before_any_router_is_known_waits_for_one() -> anyhow::Result<()> {
    // The queue starts first (as in any start-up order); the router comes later.
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("default"));
    let (load, _) = watch::channel(router_pb::LoadView::default());
    let mesh = Mesh::start_queue(
        Arc::clone(&discovery),
        &[],
        load,
        Routes::default(),
        Events::default(),
        None,
    )
    .await?;
    let (_tx, mut stream) = mesh.admit(open("early", 0)).await?;
    // Admitted, and waiting for a router, before any router exists.
    mesh.eventually(|s| s.pending == 1).await?;
    let (_load, routes, _events, _registration) = start_router(
        &discovery,
        view(vec![worker("w0", WorkerRole::Aggregated, 0)]),
    )
    .await?;
    let pb::admit_response::Msg::Grant(grant) = next_msg(&mut stream).await? else {
        anyhow::bail!("not granted once a router appeared");
    };
    assert_eq!(grant.worker_id, "w0");
    assert_eq!(
        routes.lock().len(),
        1,
        "placed by the router that came later"
    );
    mesh.stop().await
}

fn started() -> pb::AdmitRequest {
    pb::AdmitRequest {
        msg: Some(pb::admit_request::Msg::Started(pb::AdmitStarted {})),
    }
}

/// Waits until `events` holds `want` (the sessions run asynchronously).
async fn wait_events(events: &Events, want: &[&str]) -> anyhow::Result<()> {
    for _ in 0..300 {
        let got = events.lock().clone();
        if want.iter().all(|w| got.iter().any(|g| g == w)) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::bail!("wanted {want:?}, router heard {:?}", events.lock())
}

#[tokio::test]
async fn every_router_hears_each_placement_its_start_and_its_end() -> anyhow::Result<()> {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("default"));
    let idle = view(vec![worker("w0", WorkerRole::Aggregated, 0)]);
    let (load, routes_a, events_a, reg_a) = start_router(&discovery, idle.clone()).await?;
    let (_load_b, routes_b, events_b, _reg_b) = start_router(&discovery, idle).await?;
    let mesh = Mesh::start_queue(
        Arc::clone(&discovery),
        &[],
        load,
        Arc::clone(&routes_a),
        Arc::clone(&events_a),
        reg_a,
    )
    .await?;
    // Both sessions open (hello) before anything is placed.
    let queue_id = discovery.list("queue").await?.first().map(|i| i.id.clone());
    let hello = format!("hello:{}", queue_id.context("queue registered")?);
    wait_events(&events_a, &[&hello]).await?;
    wait_events(&events_b, &[&hello]).await?;

    let (tx, mut stream) = mesh.admit(open("r", 0)).await?;
    let pb::admit_response::Msg::Grant(_) = next_msg(&mut stream).await? else {
        anyhow::bail!("not granted");
    };
    // One router placed it; the other heard it as `placed`, same id.
    let (placer, other) = if routes_a.lock().is_empty() {
        (&events_b, &events_a)
    } else {
        (&events_a, &events_b)
    };
    assert_eq!(routes_a.lock().len() + routes_b.lock().len(), 1);
    let mut id = None;
    for _ in 0..300 {
        id = other
            .lock()
            .iter()
            .find_map(|e| e.strip_prefix("placed:").map(str::to_owned));
        if id.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let id = id.context("the other router never heard the placement")?;
    assert!(
        !placer.lock().iter().any(|e| e.starts_with("placed:")),
        "the placing router counts its own answer"
    );

    tx.send(started()).await?;
    let started_ev = format!("started:{id}");
    wait_events(&events_a, &[&started_ev]).await?;
    wait_events(&events_b, &[&started_ev]).await?;
    tx.send(done()).await?;
    let released = format!("released:{id}");
    wait_events(&events_a, &[&released]).await?;
    wait_events(&events_b, &[&released]).await?;
    mesh.stop().await
}

/// One message on a `Leases` session.
fn lease_msg(id: u64, msg: Option<pb::admit_request::Msg>) -> pb::LeaseRequest {
    pb::LeaseRequest {
        lease_id: id,
        request: msg.map(|m| pb::AdmitRequest { msg: Some(m) }),
        traceparent: String::new(),
    }
}

/// The next answer on a session other than `opened`: (lease id, answer).
async fn next_answer(
    answers: &mut Streaming<pb::LeaseResponse>,
) -> anyhow::Result<(u64, pb::lease_response::Msg)> {
    loop {
        let answer = tokio::time::timeout(Duration::from_secs(5), answers.message())
            .await
            .context("timed out")??
            .context("session ended")?;
        match answer.msg.context("empty answer")? {
            pb::lease_response::Msg::Opened(_) => continue,
            m => return Ok((answer.lease_id, m)),
        }
    }
}

#[tokio::test]
async fn a_session_whose_caller_stops_reading_drops_its_leases() -> anyhow::Result<()> {
    use pb::admit_request::Msg as In;
    use pb::lease_response::Msg as Out;
    let mesh = Mesh::start(&[], view(vec![worker("w0", WorkerRole::Aggregated, 0)])).await?;
    // A caller in this process: no socket, so no reset tells the queue that
    // the caller left.
    let endpoint = mesh.addr.to_string();
    for _ in 0..500 {
        if sluice_runtime::local::is_local(&endpoint) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::ensure!(
        sluice_runtime::local::is_local(&endpoint),
        "the queue never became callable in this process"
    );
    let mut queue = QueueClient::new(sluice_runtime::grpc::channel(&endpoint)?);
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(lease_msg(1, Some(In::Open(open("a", 0)))))?;
    let mut answers = queue
        .leases(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let (1, Out::Grant(_)) = next_answer(&mut answers).await? else {
        anyhow::bail!("a not granted at once");
    };
    mesh.eventually(|s| s.active == 1).await?;
    anyhow::ensure!(
        scrape(mesh.addr)
            .await?
            .contains("\nsluice_queue_lease_sessions 1\n")
    );
    // The answers go unread while the requests stay open (`tx` lives).
    drop(answers);
    mesh.eventually(|s| s.active == 0 && s.pending == 0).await?;
    let mut page = String::new();
    for _ in 0..200 {
        page = scrape(mesh.addr).await?;
        if page.contains("\nsluice_queue_lease_sessions 0\n") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    anyhow::ensure!(
        page.contains("\nsluice_queue_lease_sessions 0\n"),
        "the session outlived its reader: {page}"
    );
    drop(tx);
    mesh.stop().await
}

#[tokio::test]
async fn leases_share_one_session_and_each_ends_on_its_own() -> anyhow::Result<()> {
    use pb::admit_request::Msg as In;
    use pb::lease_response::Msg as Out;
    let mesh = Mesh::start(
        &[
            "--max-active",
            "1",
            "--max-pending",
            "1",
            "--shed-protect-fraction",
            "0",
        ],
        view(vec![worker("w0", WorkerRole::Aggregated, 0)]),
    )
    .await?;
    let (tx, rx) = mpsc::unbounded_channel();
    tx.send(lease_msg(1, Some(In::Open(open("a", 0)))))?;
    let mut answers = mesh
        .queue
        .clone()
        .leases(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await?
        .into_inner();
    let (id, Out::Grant(grant)) = next_answer(&mut answers).await? else {
        anyhow::bail!("a not granted at once");
    };
    assert_eq!((id, grant.worker_id.as_str()), (1, "w0"));

    // A second lease on the same session waits for the first's slot.
    tx.send(lease_msg(2, Some(In::Open(open("b", 0)))))?;
    let (id, Out::Held(held)) = next_answer(&mut answers).await? else {
        anyhow::bail!("b not held");
    };
    assert_eq!((id, held.reason.as_str()), (2, "active leases at limit"));

    // A third finds the queue full: its error names the reason and the
    // retry, as `Admit`'s status would, and ends that lease only.
    tx.send(lease_msg(3, Some(In::Open(open("c", 0)))))?;
    let (id, Out::Error(err)) = next_answer(&mut answers).await? else {
        anyhow::bail!("c not refused");
    };
    assert_eq!(id, 3);
    assert_eq!(err.code, Code::ResourceExhausted as i32);
    assert!(err.message.contains("--max-pending"), "{}", err.message);
    assert_eq!(
        err.metadata
            .get(sluice_proto::REASON_HEADER)
            .map(String::as_str),
        Some("queue_full")
    );
    assert!(err.metadata.contains_key("retry-after"), "{err:?}");

    // Opening a live lease's id again is refused for that message alone.
    tx.send(lease_msg(1, Some(In::Open(open("a-again", 0)))))?;
    let (id, Out::Error(err)) = next_answer(&mut answers).await? else {
        anyhow::bail!("a reused id was accepted");
    };
    assert_eq!((id, err.code), (1, Code::InvalidArgument as i32));

    // `done` on the first releases its slot to the second.
    tx.send(lease_msg(1, Some(In::Done(pb::AdmitDone::default()))))?;
    let (id, Out::Grant(_)) = next_answer(&mut answers).await? else {
        anyhow::bail!("b not granted after a's done");
    };
    assert_eq!(id, 2);

    // A message without a request drops the lease, as closing `Admit` does.
    tx.send(lease_msg(2, None))?;
    mesh.eventually(|s| s.active == 0 && s.pending == 0).await?;

    // Ending the session drops every lease still on it.
    tx.send(lease_msg(4, Some(In::Open(open("d", 0)))))?;
    let (4, Out::Grant(_)) = next_answer(&mut answers).await? else {
        anyhow::bail!("d not granted");
    };
    mesh.eventually(|s| s.active == 1).await?;
    drop((tx, answers));
    mesh.eventually(|s| s.active == 0 && s.pending == 0).await?;
    let released = |mesh: &Mesh| {
        mesh.events
            .lock()
            .iter()
            .filter(|e| e.starts_with("released:"))
            .count()
    };
    for _ in 0..300 {
        if released(&mesh) == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(released(&mesh), 3, "{:?}", mesh.events.lock());

    // An idle session does not hold up shutdown: the queue ends it.
    let (idle_tx, idle_rx) = mpsc::unbounded_channel::<pb::LeaseRequest>();
    let mut idle = mesh
        .queue
        .clone()
        .leases(tokio_stream::wrappers::UnboundedReceiverStream::new(
            idle_rx,
        ))
        .await?
        .into_inner();
    tokio::time::timeout(Duration::from_secs(10), mesh.stop())
        .await
        .context("shutdown waited on an idle session")??;
    assert!(matches!(idle.message().await, Ok(None) | Err(_)));
    drop(idle_tx);
    Ok(())
}
