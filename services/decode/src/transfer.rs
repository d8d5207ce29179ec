//! KV transfer: moving a prompt's KV blocks from a prefill worker into the
//! blocks a decode worker reserved for them.
//!
//! The decode worker registers each expected transfer with the
//! [`Receiver`] (which slot, which block ids may be written) and describes
//! it in a `TransferDescriptor`; the prefill worker writes every block over
//! the first transport both sides support. Each block travels with an XXH3
//! checksum; a checksum or layout mismatch, an unknown transfer or a block
//! outside the slot is refused, and the decode worker falls back to local
//! prefill. Transports: the gRPC stream (`grpc`, portable).

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_engine::EngineHandle;
use sluice_engine::backend::KvBlockLayout;
use sluice_proto::kv::v1 as pb;
use tonic::{Request, Response, Status};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::WorkerError;

/// Blocks written per engine round trip.
const WRITE_BATCH: usize = 16;

/// The wire form of a block layout (f32 only today).
pub fn layout_to_pb(l: &KvBlockLayout) -> pb::KvLayout {
    pb::KvLayout {
        num_layers: l.num_layers as u32,
        num_kv_heads: l.num_kv_heads as u32,
        head_dim: l.head_dim as u32,
        block_size: l.block_size as u32,
        dtype: match l.elem_bytes {
            2 => pb::Dtype::F16,
            _ => pb::Dtype::F32,
        } as i32,
        block_bytes: l.block_bytes() as u64,
    }
}

/// Refuses a descriptor whose layout differs from `ours`, saying how.
pub fn check_layout(
    theirs: Option<&pb::KvLayout>,
    ours: &KvBlockLayout,
) -> Result<(), WorkerError> {
    let ours_pb = layout_to_pb(ours);
    match theirs {
        Some(t) if *t == ours_pb => Ok(()),
        Some(t) => Err(WorkerError::InvalidArgument {
            field: "destination.layout",
            message: format!("KV layout mismatch: receiver has {t:?}, this worker has {ours_pb:?}"),
        }),
        None => Err(WorkerError::InvalidArgument {
            field: "destination.layout",
            message: "missing".into(),
        }),
    }
}

/// One transfer a decode worker is waiting for.
#[derive(Debug)]
struct Expected {
    engine: EngineHandle,
    slot: u64,
    /// Block ids the sender may write (the slot's blocks past the skipped prefix).
    writable: Vec<u32>,
    written: usize,
}

/// The decode side's registry of expected transfers.
#[derive(Debug, Default)]
pub struct Receiver {
    expected: Mutex<HashMap<String, Expected>>,
}

/// Removes its transfer from the registry when dropped.
#[derive(Debug)]
pub struct Expectation {
    receiver: Arc<Receiver>,
    id: String,
}

impl Expectation {
    /// Blocks written so far.
    pub fn written(&self) -> usize {
        self.receiver
            .expected
            .lock()
            .get(&self.id)
            .map(|e| e.written)
            .unwrap_or(0)
    }
}

impl Drop for Expectation {
    fn drop(&mut self) {
        self.receiver.expected.lock().remove(&self.id);
    }
}

impl Receiver {
    /// Registers transfer `id` into `slot` of `engine`; dropping the
    /// returned guard forgets it (late writes are then refused).
    pub fn expect(
        self: &Arc<Self>,
        id: &str,
        engine: EngineHandle,
        slot: u64,
        writable: Vec<u32>,
    ) -> Expectation {
        self.expected.lock().insert(
            id.to_string(),
            Expected {
                engine,
                slot,
                writable,
                written: 0,
            },
        );
        Expectation {
            receiver: Arc::clone(self),
            id: id.to_string(),
        }
    }

    /// Verifies and writes blocks of transfer `id`.
    pub async fn write(
        &self,
        id: &str,
        blocks: Vec<(u32, Vec<u8>, u64)>,
    ) -> Result<usize, WorkerError> {
        let (engine, slot) = {
            let guard = self.expected.lock();
            let e = guard.get(id).ok_or_else(|| {
                WorkerError::Transfer(format!("unknown or cancelled transfer {id}"))
            })?;
            for (block, data, checksum) in &blocks {
                if !e.writable.contains(block) {
                    return Err(WorkerError::Transfer(format!(
                        "block {block} is not part of transfer {id}"
                    )));
                }
                if xxh3_64(data) != *checksum {
                    return Err(WorkerError::Transfer(format!(
                        "checksum mismatch on block {block} of transfer {id}"
                    )));
                }
            }
            (e.engine.clone(), e.slot)
        };
        let n = blocks.len();
        engine
            .write_blocks(slot, blocks.into_iter().map(|(b, d, _)| (b, d)).collect())
            .await?;
        if let Some(e) = self.expected.lock().get_mut(id) {
            e.written += n;
        }
        Ok(n)
    }
}

/// The gRPC fallback transport, served by decode workers.
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
        let mut batch: Vec<(u32, Vec<u8>, u64)> = Vec::with_capacity(WRITE_BATCH);
        let mut transfer = String::new();
        while let Some(chunk) = stream.message().await? {
            if transfer.is_empty() {
                transfer = chunk.transfer_id.clone();
            } else if chunk.transfer_id != transfer {
                return Err(Status::invalid_argument(
                    "one WriteBlocks stream carries one transfer_id",
                ));
            }
            batch.push((chunk.block_id, chunk.data, chunk.checksum));
            if batch.len() == WRITE_BATCH {
                written += self
                    .receiver
                    .write(&transfer, std::mem::take(&mut batch))
                    .await? as u32;
            }
        }
        if !batch.is_empty() {
            written += self.receiver.write(&transfer, batch).await? as u32;
        }
        Ok(Response::new(pb::WriteBlocksResponse {
            blocks_written: written,
        }))
    }
}

/// Sends `blocks` (destination id, bytes) of `transfer_id` over the gRPC
/// stream to `endpoint`; returns blocks written.
pub async fn send_grpc(
    endpoint: &str,
    transfer_id: &str,
    blocks: Vec<(u32, Vec<u8>)>,
) -> Result<u32, WorkerError> {
    let channel = sluice_runtime::grpc::channel(endpoint)
        .map_err(|e| WorkerError::Transfer(e.to_string()))?;
    let mut client =
        pb::kv_transfer_client::KvTransferClient::new(channel).max_encoding_message_size(256 << 20);
    let id = transfer_id.to_string();
    let chunks =
        futures::stream::iter(
            blocks
                .into_iter()
                .map(move |(block_id, data)| pb::BlockChunk {
                    transfer_id: id.clone(),
                    block_id,
                    checksum: xxh3_64(&data),
                    data,
                }),
        );
    let resp = client
        .write_blocks(chunks)
        .await
        .map_err(|s| WorkerError::Transfer(format!("gRPC write: {s}")))?;
    Ok(resp.into_inner().blocks_written)
}
