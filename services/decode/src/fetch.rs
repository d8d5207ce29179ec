//! Prefix fetch, receiving side: a request placed here whose prompt a peer
//! holds more of in its prefix cache (the router names it: the request's
//! `prefix_source`) has the missing blocks written here by that peer
//! instead of computed. The worker reserves blocks for them (after the ones
//! it holds itself), registers the transfer with its KV receiver, asks the
//! peer (`FetchPrefix`), checks that what the peer says it wrote landed,
//! and makes those blocks its own cached prefix (and KV events); the
//! prompt is then admitted as usual and prefills only the rest. Any
//! failure on the way costs a recompute, never a wrong block: the reserved
//! blocks are freed uncached (held past the timeout where an RDMA write
//! might still land, as for a remote prefill).
//!
//! The worker dials only decode workers discovery lists ([`Peers`]), at
//! the endpoint discovery gives. On a timing backend (the mocker) a fetch
//! lasts as long as the modelled transfer. Each fetch's rate updates what
//! the worker's load reports say its fetches arrive at
//! (`kv_fetch_bytes_per_sec`), which the router prices fetches by.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_kv_transfer::{Receiver, TransportKind, same_host};
use sluice_proto::common::v1::PrefixSource;
use sluice_proto::worker::v1 as pb;
use sluice_runtime::Security;
use sluice_worker::WorkerCore;
use tracing::Instrument;

use crate::disagg::{Fallback, Inbound};
use crate::peers::Peers;

/// A fetch may take this many times what the reported rate predicts ...
const TIMEOUT_FACTOR: u32 = 4;
/// ... and at least this long (a fetch waits for a step of the holder's
/// engine and two of this one's, between which each takes commands).
const MIN_TIMEOUT: Duration = Duration::from_secs(2);

/// The decode worker's prefix-fetch path.
#[derive(Debug)]
pub struct Fetcher {
    pub receiver: Arc<Receiver>,
    /// This worker's own address (whether a peer is on this host).
    pub endpoint: String,
    /// The decode workers it may fetch from.
    pub peers: Arc<Peers>,
    /// TLS and mesh token for the `FetchPrefix` call.
    pub security: Arc<Security>,
    /// The longest a fetch may take (`--remote-prefill-timeout-ms`).
    pub max_timeout: Duration,
}

/// What a fetch brought: blocks asked of the holder and written by it, and
/// the prompt tokens they hold.
struct Fetched {
    asked: usize,
    written: usize,
    tokens: usize,
}

impl Fetcher {
    /// Fetches what the request's `prefix_source` holds beyond this
    /// worker's own cached prefix; the prompt tokens fetched (0 on any
    /// failure, counted and logged).
    pub async fn fetch(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        engine_req: &sluice_engine::Request,
    ) -> usize {
        let Some(source) = &req.prefix_source else {
            return 0;
        };
        let span = tracing::info_span!(
            "kv.fetch_prefix",
            peer = %source.worker_id,
            blocks = tracing::field::Empty,
            transport = tracing::field::Empty,
        );
        let outcome = self
            .attempt(core, req, source, engine_req, &span)
            .instrument(span.clone())
            .await;
        let m = &core.metrics;
        match outcome {
            Ok(Fetched { asked: 0, .. }) => {
                m.prefix_fetch.with_label_values(&["cached"]).inc();
                0
            }
            Ok(Fetched {
                asked,
                written,
                tokens,
            }) => {
                // A holder that evicted part of the prefix since the router
                // looked sends what it still has; the rest is computed.
                let outcome = if written < asked { "partial" } else { "ok" };
                m.prefix_fetch.with_label_values(&[outcome]).inc();
                m.prefix_fetched_tokens.inc_by(tokens as u64);
                tokens
            }
            Err(r) => {
                m.prefix_fetch.with_label_values(&[r.reason]).inc();
                tracing::warn!(outcome = r.reason, detail = %r.detail, peer = %source.worker_id, "prefix fetch failed; computing the prefix");
                0
            }
        }
    }

    async fn attempt(
        &self,
        core: &Arc<WorkerCore>,
        req: &pb::GenerateRequest,
        source: &PrefixSource,
        engine_req: &sluice_engine::Request,
        span: &tracing::Span,
    ) -> Result<Fetched, Fallback> {
        let nothing = Fetched {
            asked: 0,
            written: 0,
            tokens: 0,
        };
        if source.worker_id == core.id {
            return Ok(nothing);
        }
        let peer = self.peers.endpoint(&source.worker_id).ok_or_else(|| {
            Fallback::new(
                "unknown_peer",
                format!("{:?} is not in discovery", source.worker_id),
            )
        })?;
        let engine = core
            .engine(req.dp_rank)
            .map_err(|e| Fallback::new("bad_rank", e))?;
        let layout = engine.kv_layout();
        let bs = layout.block_size;
        let prompt = &engine_req.prompt;
        let local = engine.cached_prefix_tokens(prompt) / bs;
        let want = (source.blocks as usize).min(prompt.len().saturating_sub(1) / bs);
        if want <= local {
            return Ok(nothing);
        }
        let block_bytes = engine
            .kv_transfer_model()
            .map_or(layout.block_bytes() as u64, |m| m.block_bytes);
        let timeout = self.timeout(core, &source.worker_id, (want - local) as u64 * block_bytes);
        let slot = engine
            .reserve_import(engine_req.clone(), want)
            .await
            .map_err(|e| Fallback::new("reserve_failed", e))?;
        let mut inbound = Inbound::register(
            &self.receiver,
            engine,
            slot,
            format!("{}-fetch-{}", req.request_id, uuid::Uuid::new_v4().simple()),
            same_host(&self.endpoint, &peer),
            timeout,
        )?;
        span.record("blocks", inbound.writable);
        let channel = self
            .security
            .channel(&peer)
            .map_err(|e| Fallback::new("bad_endpoint", e))?;
        let mut client = pb::worker_client::WorkerClient::new(channel);
        // The transfer's time (what the reported rate measures; the router
        // adds the engines' waits for the reservation and the import).
        let started = Instant::now();
        let call = client.fetch_prefix(pb::FetchPrefixRequest {
            request_id: req.request_id.clone(),
            model: core.model.clone(),
            prompt_token_ids: prompt[..want * bs].to_vec(),
            dp_rank: source.dp_rank,
            destination: inbound.descriptor.take(),
        });
        let resp = match tokio::time::timeout(timeout, call).await {
            Err(_) => {
                return Err(Fallback::new(
                    "timeout",
                    format!("no answer within {timeout:?}"),
                ));
            }
            Ok(Err(s)) => return Err(Fallback::new("fetch_error", s)),
            Ok(Ok(r)) => r.into_inner(),
        };
        let transport = TransportKind::from_pb(resp.transport).ok_or_else(|| {
            Fallback::new(
                "refused_transfer",
                format!("the peer names no transport ({})", resp.transport),
            )
        })?;
        span.record("transport", transport.as_str());
        if transport != TransportKind::Rdma {
            inbound.slot.hold = None;
        }
        let (written, asked) = (resp.blocks_written as usize, inbound.writable);
        if written > asked {
            return Err(Fallback::new(
                "refused_transfer",
                format!("the peer says it wrote {written} of {asked} blocks"),
            ));
        }
        inbound
            .expectation
            .finish_first(transport, written)
            .await
            .map_err(|e| Fallback::new("refused_transfer", e))?;
        let mut slot = inbound.into_slot();
        // A timing backend's fetch lasts what its model says.
        if let Some(model) = engine.kv_transfer_model() {
            tokio::time::sleep(model.duration(written).saturating_sub(started.elapsed())).await;
        }
        let took = started.elapsed();
        let Some(reserved) = slot.slot.take() else {
            return Err(Fallback::new("commit_failed", "the reserved slot is gone"));
        };
        engine
            .commit_import(reserved, written)
            .await
            .map_err(|e| Fallback::new("commit_failed", e))?;
        if written > 0 {
            core.fetch_rates
                .measured(&source.worker_id, written as u64 * block_bytes, took);
        }
        Ok(Fetched {
            asked,
            written,
            tokens: written * bs,
        })
    }

    /// How long fetching `bytes` from `peer` may take: a few times what the
    /// pair's rate predicts, at least [`MIN_TIMEOUT`], at most the
    /// configured one.
    fn timeout(&self, core: &WorkerCore, peer: &str, bytes: u64) -> Duration {
        let rate = core.fetch_rates.from_peer(peer).max(1);
        let expected = Duration::from_secs_f64(bytes as f64 / rate as f64);
        (expected * TIMEOUT_FACTOR)
            .max(MIN_TIMEOUT)
            .min(self.max_timeout)
    }
}

/// The rate a worker expects of its fetches before it measured one: the
/// modelled link on a timing backend, else this host's memory copy
/// bandwidth (what `shm`, the transport between same-host workers, moves
/// at; the first fetches correct it for the transport really used).
pub fn initial_fetch_rate(core: &WorkerCore) -> u64 {
    core.engines
        .first()
        .and_then(|e| e.kv_transfer_model())
        .map_or(core.host_copy_rate, |m| m.bytes_per_sec as u64)
}
