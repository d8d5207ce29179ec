//! The whole mesh in one process, for end-to-end tests: decode (and prefill)
//! workers, router, queue and frontend on `127.0.0.1:0`, wired through
//! in-process discovery, serving the built-in model (written once per test
//! binary into a temp dir) or the mocker engine.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use sluice_runtime::discovery::MemoryDiscovery;
use sluice_runtime::{Discovery, ModelArgs, ServiceContext, Shutdown};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// The built-in tiny model, written once per process.
///
/// A `TempDir` in a static is never dropped, so each test binary used to
/// leave its 15 MB copy in the temp dir for good (hundreds of them on a
/// machine that runs the suite often). The copy now lives under
/// `$TMPDIR/sluice-test-models/<pid>`, and the first call in a process
/// removes the copies of processes that are gone.
pub fn builtin_model_dir() -> anyhow::Result<PathBuf> {
    static DIR: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let root = std::env::temp_dir().join("sluice-test-models");
        remove_copies_of_exited_processes(&root);
        let dir = root.join(std::process::id().to_string());
        let model = dir.join("sluice-tiny");
        sluice_engine::builtin::write_builtin_model(
            &model,
            sluice_engine::builtin::BuiltinSize::Tiny,
        )
        .map_err(|e| e.to_string())?;
        Ok(model)
    });
    match dir {
        Ok(d) => Ok(d.clone()),
        Err(e) => anyhow::bail!("writing the built-in model: {e}"),
    }
}

/// Removes `root/<pid>` for every pid with no `/proc/<pid>`: copies left by
/// test processes that have exited. Best effort; a failure only leaves files.
fn remove_copies_of_exited_processes(root: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id()
            && !std::path::Path::new("/proc").join(pid.to_string()).exists()
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct MeshOptions {
    pub decode_workers: usize,
    /// Queue replicas (1 by default).
    pub queues: usize,
    /// Router replicas (1 by default).
    pub routers: usize,
    pub prefill_workers: usize,
    pub worker: sluice_worker::WorkerArgs,
    pub queue: sluice_queue::Args,
    pub router: sluice_router::Args,
    pub frontend: sluice_frontend::Args,
    /// Faults injected into every prefill worker.
    pub prefill_fault: Option<sluice_prefill::Fault>,
}

impl Default for MeshOptions {
    fn default() -> Self {
        use clap::Parser;
        #[derive(Parser)]
        struct Q {
            #[command(flatten)]
            q: sluice_queue::Args,
            #[command(flatten)]
            r: sluice_router::Args,
        }
        let defaults = Q::parse_from(["x"]);
        Self {
            decode_workers: 1,
            queues: 1,
            routers: 1,
            prefill_workers: 0,
            worker: sluice_worker::WorkerArgs {
                num_gpu_blocks: 512,
                ..Default::default()
            },
            queue: defaults.q,
            router: defaults.r,
            frontend: sluice_frontend::Args::default(),
            prefill_fault: None,
        }
    }
}

/// Meshes computing on the CPU engine share the machine; a test whose
/// promise is measured in wall-clock time takes it alone ([`exclusive`]):
/// on a 2-core host another test's engine threads would take the cores its
/// services need, and its latencies would measure that instead.
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held by a test that measures a promise in wall-clock time (TTFT
/// targets, priority ratios): no mesh computing on the CPU engine runs
/// beside it. Take it before [`Mesh::start`]. A test must not hold a
/// CPU-engine mesh while it starts another (none does: it would wait on
/// itself behind a waiting exclusive test).
pub async fn exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    MACHINE.write().await
}

/// A running mesh; dropping it shuts everything down.
#[derive(Debug)]
pub struct Mesh {
    pub http: String,
    pub discovery: Arc<dyn Discovery>,
    pub shutdown: Shutdown,
    pub model: String,
    tasks: Vec<JoinHandle<()>>,
    /// Ends the test process if this mesh is still up after [`MESH_LIMIT`].
    _watchdog: crate::watchdog::Watchdog,
    /// A CPU-engine mesh's share of the machine (see [`exclusive`]).
    _machine: Option<tokio::sync::RwLockReadGuard<'static, ()>>,
}

/// How long a test may keep one mesh: far past the longest test's own
/// bounds (the fuzz tests', about half an hour at worst).
const MESH_LIMIT: Duration = Duration::from_secs(45 * 60);

async fn listener() -> anyhow::Result<TcpListener> {
    Ok(TcpListener::bind("127.0.0.1:0").await?)
}

impl Mesh {
    /// Starts the mesh and waits until the frontend is ready.
    pub async fn start(opts: MeshOptions) -> anyhow::Result<Self> {
        let machine = match opts.worker.engine {
            sluice_worker::EngineKind::Mocker => None,
            _ if opts.decode_workers + opts.prefill_workers == 0 => None,
            _ => Some(MACHINE.read().await),
        };
        let model_dir = builtin_model_dir()?;
        let model = ModelArgs {
            model: Some(model_dir),
            served_model_name: None,
        };
        let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new("test"));
        let shutdown = Shutdown::new();
        let ctx = || ServiceContext::new(Arc::clone(&discovery), shutdown.child_token());
        let mut tasks = Vec::new();
        let report = |name: &'static str| {
            move |r: Result<(), String>| {
                if let Err(e) = r {
                    eprintln!("{name} stopped with an error: {e}");
                }
            }
        };
        for _ in 0..opts.decode_workers {
            let (l, a, m, c) = (listener().await?, opts.worker.clone(), model.clone(), ctx());
            let done = report("decode");
            tasks.push(tokio::spawn(async move {
                done(
                    sluice_decode::serve(l, a, m, c)
                        .await
                        .map_err(|e| format!("{e:?}")),
                )
            }));
        }
        for _ in 0..opts.prefill_workers {
            let (l, a, m, c) = (listener().await?, opts.worker.clone(), model.clone(), ctx());
            let prefiller = sluice_prefill::Prefiller {
                fault: opts.prefill_fault,
            };
            let done = report("prefill");
            tasks.push(tokio::spawn(async move {
                done(
                    sluice_prefill::serve_with(l, a, m, c, prefiller)
                        .await
                        .map_err(|e| format!("{e:?}")),
                )
            }));
        }
        for _ in 0..opts.routers.max(1) {
            let (l, a, c) = (listener().await?, opts.router.clone(), ctx());
            let done = report("router");
            tasks.push(tokio::spawn(async move {
                done(
                    sluice_router::serve(l, a, c)
                        .await
                        .map_err(|e| format!("{e:?}")),
                )
            }));
        }
        for _ in 0..opts.queues.max(1) {
            let (l, a, c) = (listener().await?, opts.queue.clone(), ctx());
            let done = report("queue");
            tasks.push(tokio::spawn(async move {
                done(
                    sluice_queue::serve(l, a, c)
                        .await
                        .map_err(|e| format!("{e:?}")),
                )
            }));
        }
        let l = listener().await?;
        let http = format!("127.0.0.1:{}", l.local_addr()?.port());
        let (a, m, c) = (opts.frontend.clone(), model.clone(), ctx());
        let done = report("frontend");
        tasks.push(tokio::spawn(async move {
            done(
                sluice_frontend::serve(l, a, m, c)
                    .await
                    .map_err(|e| format!("{e:?}")),
            )
        }));

        // libtest names each test's thread after the test.
        let test = std::thread::current().name().unwrap_or("a test").to_owned();
        let mesh = Self {
            http,
            discovery,
            shutdown,
            model: model.name(),
            tasks,
            _watchdog: crate::watchdog::watchdog(MESH_LIMIT, move || {
                format!("the mesh {test} started is still up")
            }),
            _machine: machine,
        };
        mesh.wait_ready(
            opts.decode_workers,
            opts.prefill_workers,
            opts.worker.data_parallel_size.max(1),
            opts.routers.max(1),
            opts.queues.max(1),
        )
        .await?;
        Ok(mesh)
    }

    /// Waits until the frontend is ready, every router and queue replica is
    /// registered, and every router has every worker in its pool with none
    /// still joining (first KV snapshot outstanding), read from the
    /// routers' `/metrics`.
    async fn wait_ready(
        &self,
        decode: usize,
        prefill: usize,
        dp: usize,
        router_count: usize,
        queue_count: usize,
    ) -> anyhow::Result<()> {
        let what = format!(
            "the mesh to be ready ({decode} decode, {prefill} prefill workers of {dp} ranks in the router's pools, none joining, every prefill worker known to every decode worker; every queue and router registered; frontend /ready)"
        );
        crate::wait::until_true(&what, Duration::from_secs(30), || async {
            let ready = decode == 0
                || crate::http::get(&self.http, "/ready")
                    .await
                    .map(|(s, _)| s == 200)
                    .unwrap_or(false);
            let routers = self.discovery.list("router").await?;
            anyhow::ensure!(ready, "frontend not ready");
            anyhow::ensure!(
                routers.len() == router_count,
                "{} of {router_count} routers registered",
                routers.len()
            );
            let queues = self.discovery.list("queue").await?.len();
            anyhow::ensure!(
                queues == queue_count,
                "{queues} of {queue_count} queues registered"
            );
            for router in &routers {
                let (_, metrics) = crate::http::get(&router.endpoint, "/metrics").await?;
                for (pool, workers) in [("decode", decode), ("prefill", prefill)] {
                    let series = |name: &str| {
                        crate::wait::sample(&metrics, &format!("{name}{{pool=\"{pool}\"}}"))
                            .unwrap_or(0.0) as usize
                    };
                    let (members, joining) = (
                        series("sluice_router_workers"),
                        series("sluice_router_workers_joining"),
                    );
                    anyhow::ensure!(
                        members >= workers * dp && joining == 0,
                        "router {} {pool} pool: {members}/{} targets, {joining} joining",
                        router.endpoint,
                        workers * dp
                    );
                }
            }
            if prefill > 0 {
                self.disaggregation_ready(prefill, dp).await?;
            }
            Ok(true)
        })
        .await?;
        Ok(())
    }

    /// Disaggregation needs the queue to see the prefill pool in its load
    /// view (it asks for a prefill placement only then) and each decode
    /// worker to know every prefill worker from discovery (it dials no
    /// other): until both, a request prefills locally.
    async fn disaggregation_ready(&self, prefill: usize, dp: usize) -> anyhow::Result<()> {
        for queue in self.endpoints("queue").await? {
            let (_, metrics) = crate::http::get(&queue, "/metrics").await?;
            let seen =
                crate::wait::sample(&metrics, "sluice_queue_load_view_workers{role=\"prefill\"}")
                    .unwrap_or(0.0) as usize;
            anyhow::ensure!(
                seen >= prefill * dp,
                "queue {queue} sees {seen}/{} prefill ranks",
                prefill * dp
            );
        }
        for decode in self.endpoints("decode").await? {
            let (_, metrics) = crate::http::get(&decode, "/metrics").await?;
            let known = crate::wait::sample(&metrics, "sluice_worker_prefill_peers").unwrap_or(0.0)
                as usize;
            anyhow::ensure!(
                known >= prefill,
                "decode {decode} knows {known}/{prefill} prefill workers"
            );
        }
        Ok(())
    }

    /// gRPC endpoints of the registered workers of `component`.
    pub async fn endpoints(&self, component: &str) -> anyhow::Result<Vec<String>> {
        Ok(self
            .discovery
            .list(component)
            .await?
            .into_iter()
            .map(|i| i.endpoint)
            .collect())
    }

    /// The `/metrics` page of the first registered instance of `component`
    /// (every service serves them on its gRPC port).
    pub async fn metrics(&self, component: &str) -> anyhow::Result<String> {
        let endpoints = self.endpoints(component).await?;
        let endpoint = endpoints
            .first()
            .with_context(|| format!("no {component} registered"))?;
        let endpoint = endpoint.trim_start_matches("http://");
        let (status, page) = crate::http::get(endpoint, "/metrics").await?;
        anyhow::ensure!(status == 200, "{component} /metrics: status {status}");
        Ok(page)
    }

    /// Stops every service and waits for them.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.shutdown.cancel();
        for t in self.tasks.drain(..) {
            tokio::time::timeout(Duration::from_secs(20), t)
                .await
                .context("service did not stop within 20 s")??;
        }
        Ok(())
    }
}

impl Drop for Mesh {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Mesh {
    /// A greedy `/v1/completions` of token ids; panics unless it is a 200.
    pub async fn complete_tokens(
        &self,
        prompt: &[u32],
        max_tokens: u32,
    ) -> anyhow::Result<serde_json::Value> {
        let body = serde_json::json!({"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
        let (status, resp) = crate::http::post_json(&self.http, "/v1/completions", &body).await?;
        anyhow::ensure!(status == 200, "status {status}: {resp}");
        Ok(serde_json::from_str(&resp)?)
    }
}

/// The first report of a worker's `Load` stream (its first rank's).
pub async fn load_report(
    endpoint: &str,
) -> anyhow::Result<Option<sluice_proto::worker::v1::LoadReport>> {
    use sluice_proto::worker::v1 as wpb;
    let mut client =
        wpb::worker_client::WorkerClient::connect(format!("http://{endpoint}")).await?;
    let mut s = client
        .load(wpb::LoadRequest {
            min_interval_ms: 1,
            max_interval_ms: 50,
        })
        .await?
        .into_inner();
    Ok(s.message().await?)
}

/// KV blocks a worker's first rank holds right now (from its `Load` stream).
pub async fn active_blocks(endpoint: &str) -> anyhow::Result<u64> {
    Ok(load_report(endpoint)
        .await?
        .map(|r| r.active_blocks)
        .unwrap_or(u64::MAX))
}

/// One generation run straight on a worker (its `Generate`, no queue or
/// router): what came back and when.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerRun {
    /// From the call to the first token.
    pub ttft: Duration,
    pub tokens: Vec<u32>,
    /// Prompt tokens the worker fetched from a peer.
    pub fetched_tokens: u32,
    /// Prompt tokens served from its cache (fetched ones included).
    pub cached_tokens: u32,
    /// The worker that served it.
    pub worker_id: String,
}

/// A greedy generation of `max_tokens` for `prompt` on the worker at
/// `endpoint`, fetching the prefix from `source` when one is named.
pub async fn worker_generate(
    endpoint: &str,
    prompt: &[u32],
    max_tokens: u32,
    source: Option<sluice_proto::common::v1::PrefixSource>,
) -> anyhow::Result<WorkerRun> {
    use sluice_proto::worker::v1 as wpb;
    let mut client =
        wpb::worker_client::WorkerClient::connect(format!("http://{endpoint}")).await?;
    let started = std::time::Instant::now();
    let mut stream = client
        .generate(wpb::GenerateRequest {
            request_id: "worker-run".into(),
            model: "sluice-tiny".into(),
            prompt_token_ids: prompt.to_vec(),
            sampling: Some(sluice_proto::common::v1::SamplingParams {
                max_tokens,
                ignore_eos: true,
                temperature: Some(0.0),
                ..Default::default()
            }),
            prefix_source: source,
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut run = WorkerRun {
        ttft: Duration::ZERO,
        tokens: Vec::new(),
        fetched_tokens: 0,
        cached_tokens: 0,
        worker_id: String::new(),
    };
    while let Some(m) = stream.message().await? {
        if run.worker_id.is_empty() {
            run.worker_id = m.worker_id.clone();
        }
        if run.tokens.is_empty() && !m.token_ids.is_empty() {
            run.ttft = started.elapsed();
        }
        run.tokens.extend(&m.token_ids);
        run.fetched_tokens = run.fetched_tokens.max(m.fetched_tokens);
        if let Some(u) = m.usage {
            run.cached_tokens = run.cached_tokens.max(u.cached_tokens);
        }
    }
    Ok(run)
}
