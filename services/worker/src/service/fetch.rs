//! `FetchPrefix`, the holder's side of a prefix fetch: a peer that was
//! placed a request whose prompt this worker holds more of in its prefix
//! cache asks for those blocks instead of recomputing them. The holder
//! takes references on what it still holds (so nothing is evicted while it
//! is read), writes the blocks the peer lacks into the peer's reserved
//! blocks over the first transport both offer, and says how many it wrote:
//! a prefix evicted since the router looked is a shorter (or no) fetch,
//! never a wrong block.

use sluice_kv_transfer::{check_layout, send_blocks, transfer_timeout};
use sluice_proto::worker::v1 as pb;

use super::WorkerService;
use crate::{WorkerError, convert};

impl WorkerService {
    /// Serves one `FetchPrefix`.
    pub(crate) async fn serve_fetch(
        &self,
        req: pb::FetchPrefixRequest,
    ) -> Result<pb::FetchPrefixResponse, WorkerError> {
        let core = &self.core;
        core.check_model(&req.model)?;
        let Some(senders) = &self.senders else {
            return Err(WorkerError::WrongRole {
                role: core.role,
                rpc: "FetchPrefix",
            });
        };
        let engine = core.engine(req.dp_rank)?;
        convert::check_input(engine, &req.request_id, &req.prompt_token_ids, None)?;
        let dest = req.destination.ok_or(WorkerError::InvalidArgument {
            field: "destination",
            message: "missing transfer descriptor".into(),
        })?;
        check_layout(dest.layout.as_ref(), &engine.kv_layout())?;
        let full_blocks = req.prompt_token_ids.len() / engine.kv_layout().block_size;
        if dest.block_ids.len() > full_blocks {
            return Err(WorkerError::InvalidArgument {
                field: "destination.block_ids",
                message: format!(
                    "{} blocks asked of a prompt with {full_blocks} full blocks",
                    dest.block_ids.len()
                ),
            });
        }
        let skip = dest.skip_blocks as usize;
        if skip > dest.block_ids.len() {
            return Err(WorkerError::InvalidArgument {
                field: "destination.skip_blocks",
                message: format!("{skip} skipped of {} blocks asked", dest.block_ids.len()),
            });
        }
        let (sender, region) = senders.negotiate(&dest.regions)?;
        let transport = sender.kind();
        let held = engine
            .hold_prefix(req.prompt_token_ids, dest.block_ids.len())
            .await?;
        let pairs: Vec<(u32, u32)> = held
            .block_ids()
            .iter()
            .zip(&dest.block_ids)
            .skip(skip)
            .map(|(&s, &d)| (s, d))
            .collect();
        let timeout = transfer_timeout(&dest);
        let written = if pairs.is_empty() {
            0
        } else {
            send_blocks(
                engine,
                sender.as_ref(),
                region,
                &dest.transfer_id,
                &pairs,
                timeout,
            )
            .await?
        };
        drop(held);
        core.metrics.prefix_served_blocks.inc_by(u64::from(written));
        Ok(pb::FetchPrefixResponse {
            blocks_written: written,
            transport: transport.to_pb() as i32,
            worker_id: core.id.clone(),
        })
    }
}
