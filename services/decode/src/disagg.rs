//! Conditional disaggregation, decode side: prefill remotely only when it
//! pays (uncached prompt longer than `--max-local-prefill-length`, fewer than
//! `--max-prefill-queue-size` remote prefills in flight, a prefill worker
//! granted), and fall back to local prefill on any failure or timeout on that
//! path. The request always completes; the fallback is counted in
//! `sluice_worker_remote_prefill_total{outcome}` and logged.
//!
//! The worker dials only prefill workers discovery lists ([`Peers`]):
//! the request names one by id, and its endpoint comes from discovery, never
//! from the request, so a `Generate` cannot make this worker connect
//! anywhere else.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sluice_engine::GenerateStream;
use sluice_proto::kv::v1 as kvpb;
use sluice_proto::worker::v1 as pb;
use tracing::Instrument;

use sluice_runtime::Security;

use crate::peers::Peers;

use sluice_kv_transfer::{Receiver, TransportKind, layout_to_pb, same_host};
use sluice_worker::{InflightGuard, RemotePrefill, WorkerCore};

/// How long past the remote-prefill timeout the blocks of a failed transfer
/// that may have gone over `rdma` stay reserved: a posted RDMA write cannot
/// be revoked, and the prefill worker's sender may finish one (its own send
/// is bounded by the same timeout, its completion wait by 10 s).
pub(crate) const RDMA_QUARANTINE: Duration = Duration::from_secs(15);

/// A reserved slot that, dropped while `hold` is set, stays reserved that
/// long before its blocks are freed.
pub(crate) struct Quarantine {
    pub(crate) slot: Option<sluice_engine::RemoteSlot>,
    pub(crate) hold: Option<Duration>,
}

impl Drop for Quarantine {
    fn drop(&mut self) {
        if let (Some(slot), Some(hold)) = (self.slot.take(), self.hold)
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            rt.spawn(async move {
                tokio::time::sleep(hold).await;
                drop(slot);
            });
        }
    }
}

/// The decode worker's remote-prefill path.
#[derive(Debug)]
pub struct Disagg {
    pub max_local_prefill_length: usize,
    pub max_prefill_queue_size: usize,
    pub timeout: Duration,
    pub receiver: Arc<Receiver>,
    /// This worker's own address (decides whether a prefill worker is on
    /// this host, where `shm` applies).
    pub endpoint: String,
    /// The prefill workers it may dial.
    pub prefill_workers: Arc<Peers>,
    /// TLS and mesh token for the `Prefill` call.
    pub security: Arc<Security>,
    /// Fetching a cached prefix from a peer.
    pub fetcher: crate::fetch::Fetcher,
}

impl Disagg {
    fn fallback(
        &self,
        core: &WorkerCore,
        reason: &'static str,
        detail: &str,
    ) -> Option<(GenerateStream, String)> {
        core.metrics
            .remote_prefill
            .with_label_values(&[reason])
            .inc();
        if !detail.is_empty() {
            tracing::warn!(reason, detail, "remote prefill failed; prefilling locally");
        }
        None
    }
}

#[tonic::async_trait]
impl RemotePrefill for Disagg {
    async fn try_remote(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        engine_req: &sluice_engine::Request,
    ) -> Option<(GenerateStream, String)> {
        if req.prefill_worker_id.is_empty() && req.prefill_worker_endpoint.is_empty() {
            return None;
        }
        // Only a prefill worker discovery lists, at the endpoint discovery
        // gives: never an address the request names.
        let Some(prefill_endpoint) = self.prefill_workers.endpoint(&req.prefill_worker_id) else {
            return self.fallback(
                core,
                "unknown_prefill_worker",
                &format!(
                    "prefill worker {:?} is not in discovery; not dialling {:?}",
                    req.prefill_worker_id, req.prefill_worker_endpoint
                ),
            );
        };
        let engine = core.engine(req.dp_rank).ok()?;
        let uncached = engine_req
            .prompt
            .len()
            .saturating_sub(engine.cached_prefix_tokens(&engine_req.prompt));
        // A grammar's first token is sampled where the prompt is computed:
        // a constrained request keeps its prefill here.
        if engine_req.constraint.is_some() {
            core.metrics
                .remote_prefill
                .with_label_values(&["local_constrained"])
                .inc();
            return None;
        }
        if uncached <= self.max_local_prefill_length {
            core.metrics
                .remote_prefill
                .with_label_values(&["local_short"])
                .inc();
            return None;
        }
        if core.remote_prefills.load(Ordering::Relaxed) as usize >= self.max_prefill_queue_size {
            return self.fallback(core, "local_queue_full", "");
        }
        let _inflight = InflightGuard::new(&core.remote_prefills);
        let span = tracing::info_span!(
            "kv.remote_prefill",
            prefill_worker_id = %req.prefill_worker_id,
            uncached,
            transport = tracing::field::Empty,
        );
        self.remote(core, req, &prefill_endpoint, engine_req, engine, &span)
            .instrument(span.clone())
            .await
    }

    async fn fetch_prefix(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        engine_req: &sluice_engine::Request,
    ) -> usize {
        self.fetcher.fetch(core, req, engine_req).await
    }
}

impl Disagg {
    async fn remote(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        prefill_endpoint: &str,
        engine_req: &sluice_engine::Request,
        engine: &sluice_engine::EngineHandle,
        span: &tracing::Span,
    ) -> Option<(GenerateStream, String)> {
        let attempt = async {
            let mut inbound = self
                .reserve(req, prefill_endpoint, engine_req, engine)
                .await?;
            let resp = self
                .ask_prefill(core, req, prefill_endpoint, engine_req, &mut inbound)
                .await?;
            inbound.receive(&resp, span).await?;
            let mut quarantine = inbound.into_slot();
            let logprobs = resp
                .first_logprobs
                .as_ref()
                .and_then(sluice_worker::logprobs_from_wire);
            let slot = quarantine
                .slot
                .take()
                .ok_or_else(|| Fallback::new("commit_failed", "the reserved slot is gone"))?;
            engine
                .commit_remote(slot, resp.first_token_id, logprobs)
                .map(|stream| (stream, resp.worker_id))
                .map_err(|e| Fallback::new("commit_failed", e))
        };
        match attempt.await {
            Ok(done) => {
                core.metrics.remote_prefill.with_label_values(&["ok"]).inc();
                Some(done)
            }
            Err(f) => self.fallback(core, f.reason, &f.detail),
        }
    }

    /// Reserves the request's blocks in the engine and registers the
    /// transfer that will fill them with the receiver, for the transports
    /// this worker offers the prefill worker.
    async fn reserve(
        &self,
        req: &pb::GenerateRequest,
        prefill_endpoint: &str,
        engine_req: &sluice_engine::Request,
        engine: &sluice_engine::EngineHandle,
    ) -> Result<Inbound, Fallback> {
        let slot = engine
            .reserve_remote(engine_req.clone())
            .await
            .map_err(|e| Fallback::new("reserve_failed", e))?;
        Inbound::register(
            &self.receiver,
            engine,
            slot,
            format!("{}-{}", req.request_id, uuid::Uuid::new_v4().simple()),
            same_host(&self.endpoint, prefill_endpoint),
            self.timeout,
        )
    }

    /// Asks the prefill worker to compute the prompt into the registered
    /// blocks, within `--remote-prefill-timeout-ms`.
    async fn ask_prefill(
        &self,
        core: &WorkerCore,
        req: &pb::GenerateRequest,
        prefill_endpoint: &str,
        engine_req: &sluice_engine::Request,
        inbound: &mut Inbound,
    ) -> Result<pb::PrefillResponse, Fallback> {
        let channel = self
            .security
            .channel(prefill_endpoint)
            .map_err(|e| Fallback::new("bad_endpoint", e))?;
        let mut client = pb::worker_client::WorkerClient::new(channel);
        let call = client.prefill(pb::PrefillRequest {
            request_id: req.request_id.clone(),
            model: core.model.clone(),
            prompt_token_ids: engine_req.prompt.clone(),
            sampling: req.sampling.clone(),
            priority: req.priority,
            destination: inbound.descriptor.take(),
            // The prefill worker the grant named was placed with the request.
            placed: req.placed,
            // What is left of the TTFT target now: a prefill worker that
            // cannot start the prompt by then refuses it.
            ttft_budget_ms: sluice_worker::ttft_budget_ms(engine_req.first_token_by),
        });
        use sluice_proto::queue::v1::QueueReason;
        let missed = QueueReason::TtftTargetMissed;
        match tokio::time::timeout(self.timeout, call).await {
            Err(_) => Err(Fallback::new(
                "timeout",
                "no answer within --remote-prefill-timeout-ms",
            )),
            // Refused at the TTFT target: computed here it would be late
            // too, and this engine refuses it at its next step (the
            // request's deadline has passed), which the client gets as 429.
            Ok(Err(s)) if QueueReason::of_status(&s) == Some(missed) => {
                Err(Fallback::new(missed.label(), ""))
            }
            Ok(Err(s)) => Err(Fallback::new("prefill_error", s)),
            Ok(Ok(r)) => Ok(r.into_inner()),
        }
    }
}

/// A transfer's receiving side (a remote prefill's, a prefix fetch's): the
/// reserved slot (quarantined while an RDMA write may still land), the
/// registered transfer, and the descriptor to send the writer.
pub(crate) struct Inbound {
    pub(crate) slot: Quarantine,
    pub(crate) expectation: sluice_kv_transfer::Expectation,
    /// Blocks the writer must write (those past the slot's cached ones).
    pub(crate) writable: usize,
    pub(crate) descriptor: Option<kvpb::TransferDescriptor>,
}

impl Inbound {
    /// Registers `slot`'s blocks past its cached ones with `receiver` as
    /// transfer `transfer_id`, for the transports this worker offers a
    /// writer (`same_host`: on this host) within `timeout`.
    pub(crate) fn register(
        receiver: &Arc<Receiver>,
        engine: &sluice_engine::EngineHandle,
        slot: sluice_engine::RemoteSlot,
        transfer_id: String,
        same_host: bool,
        timeout: Duration,
    ) -> Result<Self, Fallback> {
        let (slot_id, block_ids, skip) = (slot.id(), slot.block_ids().to_vec(), slot.skip_blocks());
        let mut slot = Quarantine {
            slot: Some(slot),
            hold: None,
        };
        let writable: Vec<u32> = block_ids[skip..].to_vec();
        let (expectation, regions) = receiver
            .expect(
                &transfer_id,
                engine.clone(),
                slot_id,
                writable.clone(),
                same_host,
            )
            .map_err(|e| Fallback::new("register_failed", e))?;
        if regions.is_empty() {
            return Err(Fallback::new(
                "no_transport",
                "this worker offers no KV transport",
            ));
        }
        if regions
            .iter()
            .any(|r| r.transport == kvpb::Transport::Rdma as i32)
        {
            // Until the writer says it used another transport, an RDMA
            // write may still land after a failure here.
            slot.hold = Some(timeout + RDMA_QUARANTINE);
        }
        Ok(Inbound {
            slot,
            expectation,
            writable: writable.len(),
            descriptor: Some(kvpb::TransferDescriptor {
                transfer_id,
                layout: Some(layout_to_pb(&engine.kv_layout())),
                block_ids,
                regions,
                skip_blocks: skip as u32,
                timeout_ms: timeout.as_millis().min(u128::from(u32::MAX)) as u32,
            }),
        })
    }

    /// The transfer is over: its registration goes, the slot stays.
    pub(crate) fn into_slot(self) -> Quarantine {
        drop(self.expectation);
        self.slot
    }

    /// Waits until every block the prefill worker says it wrote, over the
    /// transport it names, has landed.
    async fn receive(
        &mut self,
        resp: &pb::PrefillResponse,
        span: &tracing::Span,
    ) -> Result<(), Fallback> {
        let Some(transport) = TransportKind::from_pb(resp.transport) else {
            return Err(Fallback::new(
                "refused_transfer",
                format!(
                    "the prefill worker names no transport it wrote over ({})",
                    resp.transport
                ),
            ));
        };
        span.record("transport", transport.as_str());
        if transport != TransportKind::Rdma {
            self.slot.hold = None;
        }
        let written = self
            .expectation
            .finish(transport)
            .await
            .map_err(|e| Fallback::new("refused_transfer", e))?;
        if written != self.writable {
            return Err(Fallback::new(
                "incomplete_transfer",
                format!(
                    "{written} of {} blocks arrived over {transport}",
                    self.writable
                ),
            ));
        }
        Ok(())
    }
}

/// Why a remote prefill (or a prefix fetch) gave way to local compute: the
/// metric's reason and the detail for the log.
pub(crate) struct Fallback {
    pub(crate) reason: &'static str,
    pub(crate) detail: String,
}

impl Fallback {
    pub(crate) fn new(reason: &'static str, detail: impl ToString) -> Self {
        Self {
            reason,
            detail: detail.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_engine::{
        EngineConfig, EngineHandle, MockerBackend, MockerConfig, Request, SamplingParams,
    };

    fn engine() -> EngineHandle {
        let backend = MockerBackend::new(MockerConfig {
            num_blocks: 64,
            ..MockerConfig::default()
        })
        .expect("mocker config");
        EngineHandle::spawn(
            Box::new(backend),
            EngineConfig {
                num_blocks: Some(64),
                ..EngineConfig::default()
            },
        )
        .expect("engine")
    }

    async fn reserve(e: &EngineHandle) -> sluice_engine::RemoteSlot {
        let req = Request {
            request_id: "q".into(),
            prompt: (1..=64).collect(),
            sampling: SamplingParams::greedy(),
            priority: 0,
            constraint: None,
            first_token_by: None,
            tpot_target: None,
        };
        e.reserve_remote(req).await.expect("slot")
    }

    async fn active_blocks_within(e: &EngineHandle, d: Duration) -> u64 {
        let mut load = e.load();
        let _ = tokio::time::timeout(d, load.wait_for(|l| l.active_blocks == 0)).await;
        load.borrow().active_blocks as u64
    }

    #[tokio::test]
    async fn a_slot_rdma_may_still_write_stays_reserved_for_its_hold() {
        let e = engine();
        let held = Quarantine {
            slot: Some(reserve(&e).await),
            hold: Some(Duration::from_millis(400)),
        };
        drop(held);
        assert!(
            active_blocks_within(&e, Duration::from_millis(150)).await > 0,
            "still reserved inside the hold"
        );
        assert_eq!(
            active_blocks_within(&e, Duration::from_secs(5)).await,
            0,
            "freed after it"
        );

        let plain = Quarantine {
            slot: Some(reserve(&e).await),
            hold: None,
        };
        drop(plain);
        assert_eq!(
            active_blocks_within(&e, Duration::from_millis(500)).await,
            0,
            "no hold: freed at once"
        );
    }
}
