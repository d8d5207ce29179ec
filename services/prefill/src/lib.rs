//! `sluice-prefill`: the prefill worker (`sluice prefill`). It computes a
//! prompt on its own engine, then writes the prompt's KV blocks into the
//! blocks a decode worker reserved (the descriptor in `Prefill`), over the
//! first transport both sides offer, and returns the first token.
//!
//! It builds on the worker core (`sluice-worker`: engine flags, KV events,
//! load, registration, input checks) and owns only the `Prefill` RPC. The sending
//! side is `sluice-kv-transfer`'s: negotiation ([`Senders::negotiate`])
//! picks the first region of the descriptor (the decode worker's preference
//! order) whose transport this worker accepts (`--kv-transports`), before
//! any compute, so a worker with nothing in common refuses at once.

#![forbid(unsafe_code)]

use std::sync::Arc;
#[cfg(feature = "fault-injection")]
use std::time::Duration;

#[cfg(feature = "fault-injection")]
use sluice_kv_transfer::{Block, KvTransferError};
use sluice_kv_transfer::{Senders, check_layout, send_blocks};
use sluice_proto::kv::v1 as kvpb;
use sluice_proto::worker::v1 as pb;
use sluice_runtime::discovery::WorkerRole;
use sluice_runtime::{ModelArgs, ServiceContext};
use sluice_worker::{PrefillHandler, WorkerArgs, WorkerCore, WorkerError, WorkerService};
use tokio::net::TcpListener;
use tracing::Instrument;

/// Faults a test can inject into the sending side (any transport). Only
/// with the `fault-injection` feature, which only the test crates enable.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Flip a byte of every block after computing its checksum (on `shm`,
    /// only a receiver with `--kv-shm-checksums` can tell).
    CorruptBlocks,
    /// Send nothing and report success.
    DropBlocks,
    /// Write the first half of the blocks, then wait out the descriptor's
    /// timeout before writing the rest (a transfer to cancel midway).
    StallMidTransfer,
}

/// How a prefill worker behaves; the default is the real one.
#[derive(Debug, Default)]
pub struct Prefiller {
    /// Only tests set this.
    #[cfg(feature = "fault-injection")]
    pub fault: Option<Fault>,
}

/// The `Prefill` implementation: a [`Prefiller`] and the transports this
/// worker accepts.
#[derive(Debug)]
struct Handler {
    #[cfg(feature = "fault-injection")]
    fault: Option<Fault>,
    senders: Senders,
}

#[tonic::async_trait]
impl PrefillHandler for Handler {
    async fn prefill(
        &self,
        core: &Arc<WorkerCore>,
        req: pb::PrefillRequest,
    ) -> Result<pb::PrefillResponse, WorkerError> {
        let engine = core.engine(0)?;
        let dest = checked_destination(engine, &req)?;
        // Negotiate before computing: no transport in common is refused at once.
        let (sender, region) = self.senders.negotiate(&dest.regions)?;
        let transport = sender.kind();
        let out = compute(core, engine, &req).await?;
        let written = self
            .send(
                engine,
                sender.as_ref(),
                region,
                &dest,
                out.blocks.block_ids(),
            )
            .await?;
        drop(out.blocks);
        Ok(pb::PrefillResponse {
            first_token_id: out.first_token,
            first_logprobs: out.logprobs.as_ref().map(sluice_worker::logprobs_to_wire),
            cached_tokens: out.cached_tokens as u32,
            blocks_written: written,
            transport: transport.to_pb() as i32,
            worker_id: core.id.clone(),
        })
    }
}

/// The request's transfer descriptor, once the request passes the same
/// input checks as `Generate` and the destination matches this engine's
/// block layout and the prompt's block count.
fn checked_destination(
    engine: &sluice_engine::EngineHandle,
    req: &pb::PrefillRequest,
) -> Result<kvpb::TransferDescriptor, WorkerError> {
    let dest = req
        .destination
        .clone()
        .ok_or(WorkerError::InvalidArgument {
            field: "destination",
            message: "missing transfer descriptor".into(),
        })?;
    sluice_worker::check_input(
        engine,
        &req.request_id,
        &req.prompt_token_ids,
        req.sampling.as_ref(),
    )?;
    check_layout(dest.layout.as_ref(), &engine.kv_layout())?;
    let prompt_blocks = req
        .prompt_token_ids
        .len()
        .div_ceil(engine.kv_layout().block_size);
    if dest.block_ids.len() != prompt_blocks {
        return Err(WorkerError::InvalidArgument {
            field: "destination.block_ids",
            message: format!(
                "{} destination blocks for a {}-block prompt",
                dest.block_ids.len(),
                prompt_blocks
            ),
        });
    }
    Ok(dest)
}

/// Computes the prompt; a prefill no router placed is counted in this
/// worker's load reports until its first token.
async fn compute(
    core: &WorkerCore,
    engine: &sluice_engine::EngineHandle,
    req: &pb::PrefillRequest,
) -> Result<sluice_engine::PrefillOutput, WorkerError> {
    let span = tracing::info_span!("prefill.compute", request_id = %req.request_id, prompt_tokens = req.prompt_token_ids.len());
    let engine_req = sluice_engine::Request {
        request_id: req.request_id.clone(),
        prompt: req.prompt_token_ids.clone(),
        sampling: sluice_worker::wire_sampling(req.sampling.clone()),
        priority: req.priority,
        constraint: None,
        first_token_by: sluice_worker::first_token_by(req.ttft_budget_ms),
        tpot_target: None,
    };
    let bs = engine.kv_layout().block_size;
    let mut unplaced = (!req.placed).then(|| {
        let prompt = req.prompt_token_ids.len();
        let cached = engine.cached_prefix_tokens(&req.prompt_token_ids);
        core.unplaced.count(
            prompt.saturating_sub(cached) as u64,
            prompt.div_ceil(bs.max(1)) as u64,
        )
    });
    // Not started by the request's TTFT target: the queue's refusal, as a
    // decode worker's engine gives it (the decode worker passes it on).
    let out = engine
        .prefill(engine_req)
        .instrument(span)
        .await
        .map_err(|e| match e {
            sluice_engine::EngineError::FirstTokenLate => core.refuse_late(req.ttft_budget_ms),
            e => e.into(),
        })?;
    if let Some(u) = unplaced.as_mut() {
        u.started();
    }
    Ok(out)
}

impl Handler {
    /// Writes the computed blocks (past the destination's cached ones) into
    /// the destination over `sender`, within the descriptor's timeout
    /// ([`send_blocks`]; a test's fault reads them out and breaks them).
    async fn send(
        &self,
        engine: &sluice_engine::EngineHandle,
        sender: &dyn sluice_kv_transfer::KvSender,
        region: &kvpb::Region,
        dest: &kvpb::TransferDescriptor,
        computed: &[u32],
    ) -> Result<u32, WorkerError> {
        let skip = dest.skip_blocks as usize;
        let pairs: Vec<(u32, u32)> = computed
            .iter()
            .zip(&dest.block_ids)
            .skip(skip)
            .map(|(&s, &d)| (s, d))
            .collect();
        let timeout = sluice_kv_transfer::transfer_timeout(dest);
        #[cfg(feature = "fault-injection")]
        if let Some(fault) = self.fault {
            return faulty_send(fault, engine, sender, region, dest, &pairs, timeout).await;
        }
        Ok(send_blocks(engine, sender, region, &dest.transfer_id, &pairs, timeout).await?)
    }
}

/// Sends `pairs` as a test's `fault` asks.
#[cfg(feature = "fault-injection")]
async fn faulty_send(
    fault: Fault,
    engine: &sluice_engine::EngineHandle,
    sender: &dyn sluice_kv_transfer::KvSender,
    region: &kvpb::Region,
    dest: &kvpb::TransferDescriptor,
    pairs: &[(u32, u32)],
    timeout: Duration,
) -> Result<u32, WorkerError> {
    let transport = sender.kind();
    let send = async {
        let data = engine
            .read_blocks(pairs.iter().map(|&(s, _)| s).collect())
            .await?;
        let checked = sender.needs_checksums(region);
        let mut blocks: Vec<Block> = pairs
            .iter()
            .zip(data)
            .map(|(&(_, id), d)| Block::for_region(id, d, checked))
            .collect();
        match fault {
            Fault::DropBlocks => return Ok(0),
            Fault::CorruptBlocks => {
                for b in &mut blocks {
                    if let Some(x) = b.data.first_mut() {
                        *x ^= 0xff;
                    }
                }
            }
            Fault::StallMidTransfer => {
                let rest = blocks.split_off(blocks.len() / 2);
                let first = sender.write(region, &dest.transfer_id, blocks).await?;
                tokio::time::sleep(timeout).await;
                return Ok(first + sender.write(region, &dest.transfer_id, rest).await?);
            }
        }
        Ok(sender.write(region, &dest.transfer_id, blocks).await?)
    };
    tokio::time::timeout(timeout, send)
        .await
        .map_err(|_| KvTransferError::Timeout {
            transport,
            after: timeout,
        })
        .map_err(WorkerError::from)?
}

/// Serves a prefill worker on `listener` until `ctx.shutdown`.
pub async fn serve(
    listener: TcpListener,
    args: WorkerArgs,
    model: ModelArgs,
    ctx: ServiceContext,
) -> Result<(), WorkerError> {
    serve_with(listener, args, model, ctx, Prefiller::default()).await
}

/// [`serve`] with a given [`Prefiller`] (tests inject faults through it).
pub async fn serve_with(
    listener: TcpListener,
    args: WorkerArgs,
    model: ModelArgs,
    ctx: ServiceContext,
    prefiller: Prefiller,
) -> Result<(), WorkerError> {
    let id = sluice_runtime::discovery::instance_id(WorkerRole::Prefill.as_str());
    let core = sluice_worker::build_core(&args, &model, WorkerRole::Prefill, id)?;
    #[cfg(not(feature = "fault-injection"))]
    let Prefiller {} = prefiller;
    let handler = Handler {
        #[cfg(feature = "fault-injection")]
        fault: prefiller.fault,
        senders: Senders::new(&args.kv_transports, &ctx.security),
    };
    let service = WorkerService {
        core,
        prefill: Some(Arc::new(handler)),
        remote: None,
        senders: Some(Arc::new(Senders::new(&args.kv_transports, &ctx.security))),
        draining: ctx.shutdown.clone(),
        tasks: ctx.tasks().clone(),
    };
    sluice_worker::run_worker(listener, &args, service, None, ctx).await
}
