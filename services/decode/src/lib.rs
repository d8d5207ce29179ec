//! `sluice-decode`: the decode worker (`sluice decode`) — the worker core
//! (`sluice-worker`) with conditional disaggregation: long uncached prompts
//! go to a prefill worker, whose KV blocks this worker receives.
//!
//! Owns: following the prefill workers and choosing one ([`disagg`]),
//! starting the KV receiver and serving its `KvTransfer` service. Does not
//! own the `Worker` service or the engine ranks (`sluice-worker`), nor
//! moving KV blocks (`sluice-kv-transfer`).

#![forbid(unsafe_code)]

pub mod disagg;
pub mod fetch;
pub mod peers;

use std::sync::Arc;

use sluice_kv_transfer as transfer;
use sluice_runtime::discovery::WorkerRole;
use sluice_runtime::{ModelArgs, ServiceContext};
use sluice_worker::{WorkerArgs, WorkerError, WorkerService, build_core, run_worker};
use tokio::net::TcpListener;

/// Where a decode worker's KV transports listen, from its flags.
fn receiver_config(
    args: &WorkerArgs,
    endpoint: String,
    security: Arc<sluice_runtime::Security>,
) -> transfer::ReceiverConfig {
    transfer::ReceiverConfig {
        transports: args.kv_transports.clone(),
        endpoint,
        tcp_listen: args.kv_tcp_listen,
        shm_checksums: args.kv_shm_checksums,
        security,
    }
}

/// Serves a decode worker on `listener` until `ctx.shutdown`.
pub async fn serve(
    listener: TcpListener,
    args: WorkerArgs,
    model: ModelArgs,
    ctx: ServiceContext,
) -> Result<(), WorkerError> {
    let id = sluice_runtime::discovery::instance_id(WorkerRole::Decode.as_str());
    let core = build_core(&args, &model, WorkerRole::Decode, id)?;
    let bound = listener
        .local_addr()
        .map_err(WorkerError::startup("reading the listener's address"))?;
    let endpoint = ctx.common.advertise_addr(bound);
    let receiver = transfer::start_receiver(
        &receiver_config(&args, endpoint.clone(), Arc::clone(&ctx.security)),
        bound,
        ctx.background().clone(),
        ctx.tasks(),
    )
    .await?;
    let prefill_workers = peers::Peers::follow(
        &ctx,
        WorkerRole::Prefill,
        core.metrics.prefill_peers.clone(),
    )
    .await?;
    let decode_workers =
        peers::Peers::follow(&ctx, WorkerRole::Decode, core.metrics.prefix_peers.clone()).await?;
    core.fetch_rates.expect(fetch::initial_fetch_rate(&core));
    let timeout = std::time::Duration::from_millis(args.remote_prefill_timeout_ms);
    let fetcher = fetch::Fetcher {
        receiver: Arc::clone(&receiver),
        endpoint: endpoint.clone(),
        peers: decode_workers,
        security: Arc::clone(&ctx.security),
        max_timeout: timeout,
    };
    let remote = disagg::Disagg {
        max_local_prefill_length: args.max_local_prefill_length,
        max_prefill_queue_size: args.max_prefill_queue_size,
        timeout,
        receiver: Arc::clone(&receiver),
        endpoint,
        prefill_workers,
        security: Arc::clone(&ctx.security),
        fetcher,
    };
    let service = WorkerService {
        core,
        prefill: None,
        remote: Some(Arc::new(remote)),
        senders: Some(Arc::new(transfer::Senders::new(
            &args.kv_transports,
            &ctx.security,
        ))),
        draining: ctx.shutdown.clone(),
        tasks: ctx.tasks().clone(),
    };
    run_worker(listener, &args, service, Some(receiver), ctx).await
}
