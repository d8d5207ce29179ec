//! `sluice-worker`: the worker core both worker roles build on — the
//! engine on the mesh.
//!
//! Owns: building engine ranks from the worker flags ([`WorkerArgs`]), the
//! `Worker` gRPC service (`Generate`, KV events with replay and snapshot,
//! load reports) and its multiplexed sessions, registration with role,
//! model, block size and KV capabilities, and the one mapping of worker
//! errors to gRPC statuses. The roles plug in through two hooks:
//! [`RemotePrefill`] (the decode worker's disaggregation, `sluice-decode`)
//! and [`PrefillHandler`] (the `Prefill` RPC, `sluice-prefill`). Does not
//! own placement (router), admission (queue), the model maths (engine) or
//! moving KV blocks (`sluice-kv-transfer`).

#![forbid(unsafe_code)]

mod args;
mod convert;
mod error;
#[cfg(feature = "fault-injection")]
pub mod fault;
mod fetch_rates;
mod metrics;
mod service;

use std::sync::Arc;
use std::sync::atomic::AtomicU32;

use sluice_kv_transfer as transfer;
use sluice_runtime::discovery::{WorkerInfo, WorkerRole};
use sluice_runtime::grpc::GrpcServer;
use sluice_runtime::{ModelArgs, ServiceContext};
use tokio::net::TcpListener;

pub use args::{EngineKind, WorkerArgs};
pub use convert::{
    check_input, first_token_by, logprobs_from_wire, logprobs_to_wire, sampling as wire_sampling,
    ttft_budget_ms,
};
pub use error::WorkerError;
pub use fetch_rates::FetchRates;
pub use metrics::WorkerMetrics;
pub use service::{
    InflightGuard, PrefillHandler, RemotePrefill, UnplacedGuard, UnplacedLoad, WorkerCore,
    WorkerService,
};
use sluice_engine::backend::KvBacking;

/// Builds a worker's core: its engine rank(s), metrics and identity.
pub fn build_core(
    args: &WorkerArgs,
    model: &ModelArgs,
    role: WorkerRole,
    id: String,
) -> Result<Arc<WorkerCore>, WorkerError> {
    let dir = model.dir().map_err(|e| WorkerError::InvalidArgument {
        field: "--model",
        message: e.to_string(),
    })?;
    // A decode worker that offers `shm` keeps its KV in a shared file for
    // same-host prefill workers to write into.
    let backing = if role == WorkerRole::Decode
        && transfer::available(&args.kv_transports).contains(&transfer::TransportKind::Shm)
    {
        KvBacking::Shared
    } else {
        KvBacking::Private
    };
    let engines = args.start_engines(dir, &backing)?;
    let metrics =
        WorkerMetrics::new(&id).map_err(WorkerError::startup("registering the worker metrics"))?;
    // Measured once: what a second-tier restore moves at here, and what a
    // prefix fetch is expected to before one was measured.
    let modelled = engines.first().and_then(|e| e.kv_transfer_model());
    let host_copy_rate = if modelled.is_none() {
        copy_bandwidth()
    } else {
        0
    };
    let tier_rate = match modelled {
        _ if args.kv_tier_bytes == Some(0) => 0,
        Some(m) => m.tier_bytes_per_sec as u64,
        None => host_copy_rate,
    };
    Ok(Arc::new(WorkerCore {
        id,
        model: model.name(),
        role,
        engines,
        metrics,
        remote_prefills: AtomicU32::new(0),
        unplaced: Arc::default(),
        fetch_rates: FetchRates::default(),
        tier_rate,
        host_copy_rate,
        #[cfg(feature = "fault-injection")]
        reply_lag: args.reply_lag,
    }))
}

/// Registers and serves a worker built around `service` until shutdown, then
/// stops its engines.
pub async fn run_worker(
    listener: TcpListener,
    args: &WorkerArgs,
    service: WorkerService,
    kv_receiver: Option<Arc<transfer::Receiver>>,
    ctx: ServiceContext,
) -> Result<(), WorkerError> {
    let core = Arc::clone(&service.core);
    let engine = core
        .engines
        .first()
        .ok_or(WorkerError::Startup("no engine rank"))?;
    let layout = engine.kv_layout();
    let mut instance =
        ctx.instance(core.role.as_str(), &listener)
            .map_err(WorkerError::startup(
                "describing this instance for discovery",
            ))?;
    instance.id = core.id.clone();
    let kv_transports = match &kv_receiver {
        Some(r) => r.kinds(),
        None => transfer::available(&args.kv_transports),
    };
    let instance = instance
        .with_model(core.model.clone())
        .with_worker(WorkerInfo {
            role: core.role,
            block_size: saturating_u32(layout.block_size),
            dp_size: saturating_u32(core.engines.len()),
            engine: Some(args.engine.backend()),
            total_blocks: engine.num_blocks() as u64,
            max_num_seqs: saturating_u32(args.max_num_seqs),
            max_num_batched_tokens: saturating_u32(args.max_num_batched_tokens),
            // The longest request (prompt and output) it holds: the frontend
            // refuses longer prompts before they travel.
            max_model_len: Some(saturating_u32(engine.max_len())),
            kv_transports: kv_transports.iter().map(|k| k.to_pb()).collect(),
            // What a fetch of one block moves (the modelled model's, on a
            // timing backend): the router prices fetches by it.
            kv_block_bytes: Some(
                engine
                    .kv_transfer_model()
                    .map_or(layout.block_bytes() as u64, |m| m.block_bytes),
            ),
        });
    let mut server = GrpcServer::new()
        .map_err(WorkerError::startup("building the gRPC server"))?
        .add_service(
            sluice_proto::worker::v1::worker_server::WorkerServer::new(service)
                .max_decoding_message_size(256 << 20),
        )
        .with_metrics(vec![core.metrics.registry.clone()]);
    if let Some(receiver) = kv_receiver {
        server = server.add_service(
            sluice_proto::kv::v1::kv_transfer_server::KvTransferServer::new(
                transfer::KvTransferService { receiver },
            )
            .max_decoding_message_size(256 << 20),
        );
    }
    tracing::info!(id = %core.id, role = core.role.as_str(), model = %core.model, engine = engine.backend_name(), "worker starting");
    // Keep the per-rank gauges current until the worker has drained.
    for (rank, engine) in core.engines.iter().enumerate() {
        let (mut load, core, stop) = (engine.load(), Arc::clone(&core), ctx.background().clone());
        ctx.spawn(async move {
            loop {
                core.metrics.record_load(rank, &load.borrow_and_update());
                tokio::select! {
                    _ = stop.cancelled() => return,
                    changed = load.changed() => if changed.is_err() { return },
                }
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
        });
    }
    let res = ctx
        .run(server, listener, instance)
        .await
        .map_err(WorkerError::startup("serving"));
    let engines = core.engines.clone();
    let _ = tokio::task::spawn_blocking(move || engines.iter().for_each(|e| e.shutdown())).await;
    res
}

fn saturating_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// This host's memory copy bandwidth in bytes per second (the best of a few
/// 16 MiB copies): what a second-tier restore and a same-host (`shm`)
/// transfer move at, before either was measured.
fn copy_bandwidth() -> u64 {
    sluice_engine::backend::copy_bandwidth(16 << 20, 3) as u64
}
