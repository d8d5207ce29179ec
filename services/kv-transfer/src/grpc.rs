//! The portable fallback transport: the prefill worker streams blocks over
//! `KvTransfer.WriteBlocks` to the decode worker's gRPC endpoint. Works
//! wherever gRPC does; pays protobuf framing and HTTP/2 flow control.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_proto::kv::v1 as pb;
use sluice_runtime::Security;
use sluice_runtime::grpc::TracedChannel;
use tonic::{Request, Response, Status};

use crate::{Block, KvSender, KvTransferError, Receiver, TransportKind};

/// The `KvTransfer` service, served by decode workers.
#[derive(Debug, Clone)]
pub struct KvTransferService {
    pub receiver: Arc<Receiver>,
}

#[tonic::async_trait]
impl pb::kv_transfer_server::KvTransfer for KvTransferService {
    async fn write_blocks(
        &self,
        request: Request<tonic::Streaming<pb::BlockChunk>>,
    ) -> Result<Response<pb::WriteBlocksResponse>, Status> {
        let mut stream = request.into_inner();
        let mut written = 0u32;
        let mut target: Option<crate::Target> = None;
        let mut transfer = String::new();
        while let Some(chunk) = stream.message().await? {
            if target.is_none() {
                transfer = chunk.transfer_id.clone();
                target = Some(self.receiver.target(&transfer)?);
            } else if chunk.transfer_id != transfer {
                return Err(Status::invalid_argument(
                    "one WriteBlocks stream carries one transfer_id",
                ));
            }
            let block = Block {
                id: chunk.block_id,
                checksum: chunk.checksum,
                data: chunk.data,
            };
            if let Some(t) = &target {
                t.write_checked(&block).await?;
                written += 1;
            }
        }
        Ok(Response::new(pb::WriteBlocksResponse {
            blocks_written: written,
        }))
    }
}

/// Sends over `KvTransfer.WriteBlocks`, one kept channel per receiver
/// (HTTP/2 multiplexes concurrent transfers on it), with the worker's TLS
/// and mesh token (`KvTransfer` is an internal API).
#[derive(Debug, Default)]
pub struct GrpcSender {
    channels: Mutex<HashMap<String, TracedChannel>>,
    security: Arc<Security>,
}

/// Channels kept per sender.
const MAX_CHANNELS: usize = 64;

impl GrpcSender {
    /// A sender whose channels use `security`.
    pub fn new(security: Arc<Security>) -> Self {
        Self {
            channels: Mutex::default(),
            security,
        }
    }

    fn channel(&self, endpoint: &str) -> Result<TracedChannel, KvTransferError> {
        if let Some(c) = self.channels.lock().get(endpoint) {
            return Ok(c.clone());
        }
        let c = self
            .security
            .channel(endpoint)
            .map_err(KvTransferError::failed(
                TransportKind::Grpc,
                "opening a channel to the decode worker",
            ))?;
        let mut channels = self.channels.lock();
        if channels.len() >= MAX_CHANNELS {
            channels.clear();
        }
        channels.insert(endpoint.to_string(), c.clone());
        Ok(c)
    }
}

#[tonic::async_trait]
impl KvSender for GrpcSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Grpc
    }

    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, KvTransferError> {
        let channel = self.channel(&region.address)?;
        let r = send_on(channel, transfer_id, blocks).await;
        if r.is_err() {
            // A broken channel is not kept; the next transfer dials again.
            self.channels.lock().remove(&region.address);
        }
        r
    }
}

/// Streams `blocks` of `transfer_id` (checksums as given) to `endpoint` on a
/// new channel; returns blocks written.
pub async fn send_grpc(
    endpoint: &str,
    transfer_id: &str,
    blocks: Vec<Block>,
) -> Result<u32, KvTransferError> {
    let channel = sluice_runtime::grpc::channel(endpoint).map_err(KvTransferError::failed(
        TransportKind::Grpc,
        "opening a channel to the decode worker",
    ))?;
    send_on(channel, transfer_id, blocks).await
}

async fn send_on(
    channel: TracedChannel,
    transfer_id: &str,
    blocks: Vec<Block>,
) -> Result<u32, KvTransferError> {
    let mut client =
        pb::kv_transfer_client::KvTransferClient::new(channel).max_encoding_message_size(256 << 20);
    let id = transfer_id.to_string();
    let chunks = futures::stream::iter(blocks.into_iter().map(move |b| pb::BlockChunk {
        transfer_id: id.clone(),
        block_id: b.id,
        checksum: b.checksum,
        data: b.data,
    }));
    let resp = client
        .write_blocks(chunks)
        .await
        .map_err(|source| KvTransferError::Rpc {
            what: "write",
            source,
        })?;
    Ok(resp.into_inner().blocks_written)
}
