//! `sluice-prefill`: the prefill worker (`sluice prefill`). It computes a
//! prompt on its own engine, then writes the prompt's KV blocks into the
//! blocks a decode worker reserved (the descriptor in `Prefill`), over the
//! first transport both sides offer, and returns the first token.
//!
//! It reuses the decode crate's worker core (engine flags, KV events, load,
//! registration) and owns only the `Prefill` RPC and the sending side.

use std::sync::Arc;

use sluice_decode::transfer::{check_layout, send_grpc};
use sluice_decode::{PrefillHandler, Role, WorkerArgs, WorkerCore, WorkerError, WorkerService};
use sluice_proto::kv::v1 as kvpb;
use sluice_proto::worker::v1 as pb;
use sluice_runtime::{ModelArgs, ServiceContext};
use tokio::net::TcpListener;

/// Faults a test can inject into the sending side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Flip a byte of every block after computing its checksum.
    CorruptBlocks,
    /// Send nothing and report success.
    DropBlocks,
}

/// The `Prefill` implementation.
#[derive(Debug, Default)]
pub struct Prefiller {
    /// Only tests set this.
    pub fault: Option<Fault>,
}

#[tonic::async_trait]
impl PrefillHandler for Prefiller {
    async fn prefill(
        &self,
        core: &Arc<WorkerCore>,
        req: pb::PrefillRequest,
    ) -> Result<pb::PrefillResponse, WorkerError> {
        let dest = req
            .destination
            .clone()
            .ok_or(WorkerError::InvalidArgument {
                field: "destination",
                message: "missing transfer descriptor".into(),
            })?;
        let engine = core.engine(0)?;
        check_layout(dest.layout.as_ref(), &engine.kv_layout())?;
        let bs = engine.kv_layout().block_size;
        let prompt_blocks = req.prompt_token_ids.len().div_ceil(bs);
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
        let span = tracing::info_span!("prefill.compute", request_id = %req.request_id, prompt_tokens = req.prompt_token_ids.len());
        let engine_req = sluice_engine::Request {
            request_id: req.request_id.clone(),
            prompt: req.prompt_token_ids.clone(),
            sampling: sluice_decode::wire_sampling(req.sampling.clone()),
            priority: req.priority,
        };
        let out = tracing::Instrument::instrument(engine.prefill(engine_req), span).await?;
        let skip = dest.skip_blocks as usize;
        let src: Vec<u32> = out.blocks.block_ids().iter().skip(skip).copied().collect();
        let dst: Vec<u32> = dest.block_ids.iter().skip(skip).copied().collect();
        let send_span = tracing::info_span!(
            "kv.transfer",
            transport = tracing::field::Empty,
            blocks = src.len(),
            bytes = tracing::field::Empty
        );
        let data = engine.read_blocks(src).await?;
        send_span.record("bytes", data.iter().map(Vec::len).sum::<usize>());
        let mut blocks: Vec<(u32, Vec<u8>)> = dst.into_iter().zip(data).collect();
        let region = dest
            .regions
            .iter()
            .find(|r| r.transport == kvpb::Transport::Grpc as i32)
            .ok_or_else(|| {
                WorkerError::Transfer("no transport in common (this worker offers grpc)".into())
            })?;
        send_span.record("transport", "grpc");
        let written = match self.fault {
            Some(Fault::DropBlocks) => 0,
            Some(Fault::CorruptBlocks) => {
                corrupt_after_checksum(&region.address, &dest.transfer_id, blocks).await?
            }
            None => {
                let n = blocks.len();
                let w = tracing::Instrument::instrument(
                    send_grpc(
                        &region.address,
                        &dest.transfer_id,
                        std::mem::take(&mut blocks),
                    ),
                    send_span,
                )
                .await?;
                debug_assert!(w as usize <= n);
                w
            }
        };
        drop(out.blocks);
        Ok(pb::PrefillResponse {
            first_token_id: out.first_token,
            first_logprobs: out
                .logprobs
                .map(|l| sluice_proto::common::v1::PositionLogprobs {
                    chosen: Some(sluice_proto::common::v1::TokenLogprob {
                        token_id: l.chosen.token_id,
                        logprob: l.chosen.logprob,
                    }),
                    top: l
                        .top
                        .iter()
                        .map(|t| sluice_proto::common::v1::TokenLogprob {
                            token_id: t.token_id,
                            logprob: t.logprob,
                        })
                        .collect(),
                }),
            cached_tokens: out.cached_tokens as u32,
            blocks_written: written,
            transport: "grpc".into(),
            worker_id: core.id.clone(),
        })
    }
}

/// Sends blocks whose bytes no longer match their checksums.
async fn corrupt_after_checksum(
    endpoint: &str,
    transfer_id: &str,
    blocks: Vec<(u32, Vec<u8>)>,
) -> Result<u32, WorkerError> {
    use sluice_proto::kv::v1::kv_transfer_client::KvTransferClient;
    let channel = sluice_runtime::grpc::channel(endpoint)
        .map_err(|e| WorkerError::Transfer(e.to_string()))?;
    let id = transfer_id.to_string();
    let chunks = blocks.into_iter().map(move |(block_id, mut data)| {
        let checksum = xxhash_rust::xxh3::xxh3_64(&data);
        if let Some(b) = data.first_mut() {
            *b ^= 0xff;
        }
        kvpb::BlockChunk {
            transfer_id: id.clone(),
            block_id,
            data,
            checksum,
        }
    });
    let r = KvTransferClient::new(channel)
        .write_blocks(futures::stream::iter(chunks))
        .await
        .map_err(|s| WorkerError::Transfer(s.to_string()))?;
    Ok(r.into_inner().blocks_written)
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
    let id = format!(
        "prefill-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    );
    let core = sluice_decode::build_core(&args, &model, Role::Prefill, id)?;
    let service = WorkerService {
        core,
        prefill: Some(Arc::new(prefiller)),
        remote: None,
    };
    sluice_decode::run_worker(listener, &args, service, None, ctx).await
}
