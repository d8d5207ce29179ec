//! `sluice up`: every service in one process, wired through in-process
//! discovery (or `--etcd`), serving the OpenAI API on `--http-port`. With no
//! `--model` it writes the built-in model into a cache directory once and
//! serves it as `sluice-tiny`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use sluice_runtime::discovery::{self, MemoryDiscovery};
use sluice_runtime::{CommonArgs, Discovery, ModelArgs, Security, ServiceContext, Shutdown};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

/// Flags of `sluice up`: its own, plus every flag of the roles it runs.
#[derive(Debug, clap::Args)]
pub(crate) struct UpArgs {
    /// Port of the OpenAI HTTP API (and the gRPC Inference API).
    #[arg(long, env = "SLUICE_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,

    /// Host the HTTP API binds to.
    #[arg(long, env = "SLUICE_HTTP_HOST", default_value = "127.0.0.1")]
    http_host: String,

    /// Decode (aggregated) workers to run.
    #[arg(long, env = "SLUICE_WORKERS", default_value_t = 1)]
    workers: usize,

    /// Also run prefill workers; decode workers prefill long uncached prompts remotely.
    #[arg(long, env = "SLUICE_DISAGG")]
    disagg: bool,

    /// Prefill workers to run with `--disagg`.
    #[arg(long, env = "SLUICE_PREFILL_WORKERS", default_value_t = 1)]
    prefill_workers: usize,

    /// Where the built-in model is written when `--model` is unset.
    #[arg(long, env = "SLUICE_MODEL_CACHE")]
    model_cache: Option<PathBuf>,

    #[command(flatten)]
    pub(crate) common: CommonArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    worker: sluice_worker::WorkerArgs,
    #[command(flatten)]
    frontend: sluice_frontend::Args,
    #[command(flatten)]
    queue: sluice_queue::Args,
    #[command(flatten)]
    router: sluice_router::Args,
}

fn cache_dir(explicit: Option<PathBuf>) -> PathBuf {
    if let Some(p) = explicit {
        return p;
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("sluice").join("models")
}

/// The built-in model's directory, written on first use.
fn builtin_model(cache: PathBuf) -> anyhow::Result<PathBuf> {
    let size = sluice_engine::builtin::BuiltinSize::Tiny;
    let dir = cache.join(size.model_name());
    if dir.join("config.json").exists() && dir.join("model.safetensors").exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(&cache).with_context(|| format!("creating {}", cache.display()))?;
    let tmp = cache.join(format!(".{}-{}", size.model_name(), std::process::id()));
    sluice_engine::builtin::write_builtin_model(&tmp, size)
        .context("writing the built-in model")?;
    if let Err(e) = std::fs::rename(&tmp, &dir) {
        // Another process won the race; use its copy.
        let _ = std::fs::remove_dir_all(&tmp);
        if !dir.join("config.json").exists() {
            return Err(e)
                .with_context(|| format!("moving the built-in model to {}", dir.display()));
        }
    }
    tracing::info!(dir = %dir.display(), "wrote the built-in model");
    Ok(dir)
}

async fn local() -> anyhow::Result<TcpListener> {
    Ok(TcpListener::bind("127.0.0.1:0").await?)
}

pub(crate) async fn run(mut args: UpArgs, shutdown: Shutdown) -> anyhow::Result<()> {
    settle_args(&mut args)?;
    // One process, one /metrics: the HTTP port shows every service's series.
    sluice_runtime::metrics::serve_whole_process();
    let discovery: Arc<dyn Discovery> = discovery::from_args(
        &args.common,
        Some(Arc::new(MemoryDiscovery::new(&args.common.namespace))),
    )
    .await?;
    let security = Arc::new(Security::from_args(&args.common.security)?);
    let ctx = |s: &Shutdown| {
        ServiceContext::with_common(
            args.common.clone(),
            Arc::clone(&discovery),
            s.child_token(),
            Arc::clone(&security),
        )
    };

    let http = TcpListener::bind((args.http_host.as_str(), args.http_port))
        .await
        .with_context(|| {
            format!(
                "binding the HTTP API to {}:{} (try --http-port)",
                args.http_host, args.http_port
            )
        })?;
    let http_addr = http.local_addr()?;

    let tasks = spawn_services(&args, http, ctx, &shutdown).await?;
    // What `--http-port 0` got, in the form every service prints.
    println!("listening on {http_addr}");
    print_banner(&args, http_addr, &security);
    wait_for_services(tasks, &shutdown).await
}

/// Validates the flags and fills in what `up` decides itself: the built-in
/// model when none is given, no shm transport where no prefill worker can
/// join.
fn settle_args(args: &mut UpArgs) -> anyhow::Result<()> {
    args.common.validate()?;
    if args.model.model.is_none() {
        args.model.model = Some(builtin_model(cache_dir(args.model_cache.clone()))?);
    }
    args.worker.validate()?;
    if !args.disagg && args.common.etcd.is_none() {
        // No prefill worker can ever join this mesh: shared KV memory
        // (committed up front) would buy nothing.
        args.worker
            .kv_transports
            .retain(|t| *t != sluice_kv_transfer::TransportKind::Shm);
    }
    if args.workers == 0 {
        anyhow::bail!("--workers must be at least 1");
    }
    Ok(())
}

/// The services `up` runs, each a task that reports its name and result.
type Services = JoinSet<(&'static str, anyhow::Result<()>)>;

/// Starts every service of the mesh on its own loopback listener (the
/// frontend on `http`), each with a context from `ctx`.
async fn spawn_services(
    args: &UpArgs,
    http: TcpListener,
    ctx: impl Fn(&Shutdown) -> ServiceContext,
    shutdown: &Shutdown,
) -> anyhow::Result<Services> {
    let mut tasks = Services::new();
    for _ in 0..args.workers {
        let (l, a, m, c) = (
            local().await?,
            args.worker.clone(),
            args.model.clone(),
            ctx(shutdown),
        );
        tasks.spawn(async move {
            (
                "decode",
                sluice_decode::serve(l, a, m, c).await.map_err(Into::into),
            )
        });
    }
    if args.disagg {
        for _ in 0..args.prefill_workers {
            let (l, a, m, c) = (
                local().await?,
                args.worker.clone(),
                args.model.clone(),
                ctx(shutdown),
            );
            tasks.spawn(async move {
                (
                    "prefill",
                    sluice_prefill::serve(l, a, m, c).await.map_err(Into::into),
                )
            });
        }
    }
    let (l, a, c) = (local().await?, args.router.clone(), ctx(shutdown));
    tasks.spawn(async move {
        (
            "router",
            sluice_router::serve(l, a, c).await.map_err(Into::into),
        )
    });
    let (l, a, c) = (local().await?, args.queue.clone(), ctx(shutdown));
    tasks.spawn(async move {
        (
            "queue",
            sluice_queue::serve(l, a, c).await.map_err(Into::into),
        )
    });
    let (a, m, c) = (args.frontend.clone(), args.model.clone(), ctx(shutdown));
    tasks.spawn(async move {
        (
            "frontend",
            sluice_frontend::serve(http, a, m, c)
                .await
                .map_err(Into::into),
        )
    });

    Ok(tasks)
}

/// Tells the user where the mesh answers.
fn print_banner(args: &UpArgs, http_addr: std::net::SocketAddr, security: &Security) {
    let model = args.model.name();
    println!(
        "Sluice is up: model `{model}`, {} worker(s){}",
        args.workers,
        if args.disagg {
            format!(" + {} prefill", args.prefill_workers)
        } else {
            String::new()
        }
    );
    let (scheme, curl) = match &args.common.security.tls_ca {
        _ if !security.serves_tls() => ("http", String::new()),
        Some(ca) => ("https", format!("--cacert {} ", ca.display())),
        None => ("https", "--cacert <your CA> ".to_owned()),
    };
    println!(
        "  OpenAI API   {scheme}://{http_addr}/v1   (try: curl {curl}{scheme}://{http_addr}/v1/models)"
    );
    println!(
        "  gRPC         {http_addr}  (sluice.inference.v1.Inference, reflection on{})",
        if security.serves_tls() { ", TLS" } else { "" }
    );
    println!(
        "  metrics      {scheme}://{http_addr}/metrics (every service)    ready: {scheme}://{http_addr}/ready"
    );
    println!("  Ctrl-C to stop");
}

/// Waits for the services; the first to end (or fail) stops them all, and
/// the first failure is the result.
async fn wait_for_services(mut tasks: Services, shutdown: &Shutdown) -> anyhow::Result<()> {
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (name, res) =
            joined.unwrap_or(("task", Err(anyhow::anyhow!("a service task panicked"))));
        if let Err(e) = res {
            tracing::error!(
                service = name,
                error = format!("{e:#}"),
                "service failed; stopping everything"
            );
            first_error.get_or_insert(e.context(format!("{name} failed")));
        }
        // Any service ending ends the whole mesh.
        shutdown.cancel();
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
