//! KV transfer: moving a prompt's KV blocks from a prefill worker into the
//! blocks a decode worker reserved for them.
//!
//! The decode worker registers each expected transfer with the [`Receiver`]
//! (which slot, which block ids may be written). Every transport it runs
//! ([`Inbound`]) gives the transfer a region, and the descriptor lists those
//! regions in preference order (`shm` when the prefill worker is on this
//! host, then `rdma`, `tcp`, `grpc`). The prefill worker's [`Senders`] pick
//! the first region whose transport it supports and write every block there
//! ([`KvSender::write`]). Each block travels with an XXH3 checksum; a
//! checksum or layout mismatch, an unknown transfer or a block outside the
//! slot is refused, and the decode worker falls back to local prefill.
//!
//! Two delivery models: streamed transports (`tcp`, `grpc`) hand blocks to
//! [`Receiver::write`] as they arrive; one-sided transports (`shm`, `rdma`)
//! land bytes in memory the receiver registered, and the receiver collects
//! and verifies them when the prefill worker reports completion (the
//! `Prefill` response), in [`Expectation::finish`].

pub mod grpc;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
pub mod tcp;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;
use sluice_engine::EngineHandle;
use sluice_engine::backend::KvBlockLayout;
use sluice_proto::kv::v1 as pb;
use xxhash_rust::xxh3::xxh3_64;

use crate::error::WorkerError;

pub use grpc::{GrpcInbound, GrpcSender, KvTransferService, send_grpc};

/// Blocks written per engine round trip.
pub(crate) const WRITE_BATCH: usize = 16;

/// Copies of at least this many blocks run on the blocking pool.
pub(crate) const BLOCKING_COPY_BLOCKS: usize = 64;

/// A KV transport, as named on the command line, in discovery metadata and
/// in `PrefillResponse.transport`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum TransportKind {
    /// Shared memory on the same host: one-sided writes into a mapped file.
    Shm,
    /// One-sided RDMA WRITE into registered memory (cargo feature `rdma`).
    Rdma,
    /// Framed, checksummed blocks over a plain TCP connection.
    Tcp,
    /// The `KvTransfer.WriteBlocks` gRPC stream: the portable fallback.
    Grpc,
}

impl TransportKind {
    /// Every transport, in the receiver's preference order.
    pub const ALL: [TransportKind; 4] = [
        TransportKind::Shm,
        TransportKind::Rdma,
        TransportKind::Tcp,
        TransportKind::Grpc,
    ];

    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Shm => "shm",
            TransportKind::Rdma => "rdma",
            TransportKind::Tcp => "tcp",
            TransportKind::Grpc => "grpc",
        }
    }

    /// The wire enum.
    pub fn to_pb(self) -> pb::Transport {
        match self {
            TransportKind::Shm => pb::Transport::Shm,
            TransportKind::Rdma => pb::Transport::Rdma,
            TransportKind::Tcp => pb::Transport::Tcp,
            TransportKind::Grpc => pb::Transport::Grpc,
        }
    }

    /// From the wire enum's value; `None` for unspecified or unknown values.
    pub fn from_pb(value: i32) -> Option<Self> {
        match pb::Transport::try_from(value).ok()? {
            pb::Transport::Shm => Some(TransportKind::Shm),
            pb::Transport::Rdma => Some(TransportKind::Rdma),
            pb::Transport::Tcp => Some(TransportKind::Tcp),
            pb::Transport::Grpc => Some(TransportKind::Grpc),
            pb::Transport::Unspecified => None,
        }
    }

    /// Whether this build and machine can run the transport at all, and why not.
    pub fn availability(self) -> Result<(), String> {
        match self {
            TransportKind::Shm | TransportKind::Tcp | TransportKind::Grpc => Ok(()),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => rdma::probe().map_err(|e| e.to_string()),
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma => Err("built without the `rdma` feature".into()),
        }
    }
}

impl fmt::Display for TransportKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The transports of `wanted` this build and machine can run, in `wanted`'s
/// order, duplicates removed; each one dropped is logged with the reason.
pub fn available(wanted: &[TransportKind]) -> Vec<TransportKind> {
    let mut out = Vec::new();
    for &kind in wanted {
        if out.contains(&kind) {
            continue;
        }
        match kind.availability() {
            Ok(()) => out.push(kind),
            Err(why) => {
                tracing::info!(transport = %kind, reason = %why, "KV transport not available")
            }
        }
    }
    out
}

/// `shm,tcp,grpc`: the discovery metadata value `kv_transports`.
pub fn join(kinds: &[TransportKind]) -> String {
    kinds
        .iter()
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(",")
}

/// The wire form of a block layout.
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

/// Whether two `host:port` endpoints (optionally with a scheme) name the same
/// host: equal hosts, or both loopback. Decides whether `shm` is offered.
pub fn same_host(a: &str, b: &str) -> bool {
    fn host(e: &str) -> &str {
        let e = e.split_once("://").map_or(e, |(_, rest)| rest);
        let e = e.split('/').next().unwrap_or(e);
        let h = match e.rsplit_once(':') {
            Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
            _ => e,
        };
        h.trim_start_matches('[').trim_end_matches(']')
    }
    fn loopback(h: &str) -> bool {
        h.eq_ignore_ascii_case("localhost")
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
    let (ha, hb) = (host(a), host(b));
    ha.eq_ignore_ascii_case(hb) || (loopback(ha) && loopback(hb))
}

/// One KV block on its way: destination block id, XXH3-64 of `data`, bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    pub id: u32,
    pub checksum: u64,
    pub data: Vec<u8>,
}

impl Block {
    /// A block with the checksum of `data`.
    pub fn new(id: u32, data: Vec<u8>) -> Self {
        Self {
            id,
            checksum: xxh3_64(&data),
            data,
        }
    }
}

/// The sending side of one transport.
#[tonic::async_trait]
pub trait KvSender: Send + Sync + fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// Whether this sender can write into `region` at all (cheap, writes
    /// nothing): e.g. `shm` only when the region's file is on this host.
    fn accepts(&self, _region: &pb::Region) -> bool {
        true
    }

    /// Writes `blocks` of `transfer_id` into `region`; returns the blocks the
    /// receiver took (streamed transports) or wrote (one-sided ones).
    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, WorkerError>;
}

/// A prefill worker's senders, one per transport it accepts.
#[derive(Debug, Clone, Default)]
pub struct Senders {
    senders: Vec<Arc<dyn KvSender>>,
}

impl Senders {
    /// Senders for the transports of `wanted` this build and machine can run.
    pub fn new(wanted: &[TransportKind]) -> Self {
        let mut senders: Vec<Arc<dyn KvSender>> = Vec::new();
        for kind in available(wanted) {
            match kind {
                TransportKind::Shm => senders.push(Arc::new(shm::ShmSender::default())),
                TransportKind::Tcp => senders.push(Arc::new(tcp::TcpSender::default())),
                TransportKind::Grpc => senders.push(Arc::new(GrpcSender::default())),
                // `available` yields rdma only once its data path exists
                // (see `rdma::probe`).
                TransportKind::Rdma => {}
            }
        }
        Self { senders }
    }

    /// Senders from explicit parts (tests, benches).
    pub fn from_senders(senders: Vec<Arc<dyn KvSender>>) -> Self {
        Self { senders }
    }

    /// The transports these senders speak.
    pub fn kinds(&self) -> Vec<TransportKind> {
        self.senders.iter().map(|s| s.kind()).collect()
    }

    /// Negotiation: the first region (receiver's preference order) whose
    /// transport one of these senders supports and accepts.
    pub fn choose<'a>(
        &self,
        regions: &'a [pb::Region],
    ) -> Option<(&Arc<dyn KvSender>, &'a pb::Region)> {
        regions.iter().find_map(|r| {
            let kind = TransportKind::from_pb(r.transport)?;
            self.senders
                .iter()
                .find(|s| s.kind() == kind && s.accepts(r))
                .map(|s| (s, r))
        })
    }
}

/// What a transport is asked to register for one transfer.
#[derive(Debug, Clone, Copy)]
pub struct TransferSpec<'a> {
    pub id: &'a str,
    /// Blocks the sender will write.
    pub blocks: usize,
    pub block_bytes: usize,
    /// Whether the sender runs on this host (`shm` is offered only then).
    pub same_host: bool,
}

/// A region registered for one transfer. What it holds (shared-memory slots,
/// a registered memory region) is released when it drops.
#[derive(Debug)]
pub struct Registration {
    pub region: pb::Region,
    /// One-sided transports: where the written blocks wait for collection.
    pub staged: Option<Arc<dyn Staged>>,
}

impl Registration {
    /// A stream transport's region: just where to connect.
    pub fn address(kind: TransportKind, address: &str) -> Self {
        Self {
            region: pb::Region {
                transport: kind.to_pb() as i32,
                address: address.to_string(),
                ..Default::default()
            },
            staged: None,
        }
    }
}

/// Blocks a sender wrote one-sidedly into receiver memory.
pub trait Staged: Send + Sync + fmt::Debug {
    /// Copies out and returns the written blocks (destination ids `ids`, in
    /// order), each checked against the checksum the sender recorded right
    /// after its copy (while it is in cache); refuses a block that was not
    /// written by this transfer or does not match.
    ///
    /// `first` is the position of `ids[0]` in the transfer, so a transfer
    /// can be collected batch by batch.
    fn collect(&self, first: usize, ids: &[u32]) -> Result<Vec<Block>, WorkerError>;
}

/// The receiving side of one transport.
pub trait Inbound: Send + Sync + fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// A region for `spec`, or `None` when this transport does not apply to
    /// it (e.g. `shm` for a sender on another host, or a full pool).
    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, WorkerError>;
}

/// One transfer a decode worker is waiting for.
#[derive(Debug)]
struct Expected {
    engine: EngineHandle,
    slot: u64,
    block_bytes: usize,
    /// Block ids the sender may write (the slot's blocks past the skipped prefix).
    writable: Arc<[u32]>,
    written: usize,
}

/// The decode side's registry of expected transfers, and the transports
/// that write into them.
#[derive(Debug, Default)]
pub struct Receiver {
    expected: Mutex<HashMap<String, Expected>>,
    inbound: Vec<Arc<dyn Inbound>>,
}

/// A registered transfer: its regions, and the guard that forgets it (and
/// releases every region) when dropped.
#[derive(Debug)]
pub struct Expectation {
    receiver: Arc<Receiver>,
    id: String,
    writable: Arc<[u32]>,
    staged: Vec<(TransportKind, Arc<dyn Staged>)>,
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

    /// Completes the transfer once the sender reports it done over
    /// `transport`: one-sided transports are collected, verified and written
    /// into the engine now. Returns the blocks written in all.
    pub async fn finish(&self, transport: &str) -> Result<usize, WorkerError> {
        if let Some((_, staged)) = self.staged.iter().find(|(k, _)| k.as_str() == transport) {
            // Batch by batch, collecting the next while the engine writes
            // the previous one.
            let mut inflight: Option<tokio::task::JoinHandle<Result<usize, WorkerError>>> = None;
            for (k, ids) in self.writable.chunks(WRITE_BATCH).enumerate() {
                let blocks = staged.collect(k * WRITE_BATCH, ids)?;
                if let Some(prev) = inflight.take() {
                    join_write(prev).await?;
                }
                let (receiver, id) = (Arc::clone(&self.receiver), self.id.clone());
                inflight = Some(tokio::spawn(async move {
                    receiver.write_verified(&id, blocks).await
                }));
            }
            if let Some(prev) = inflight.take() {
                join_write(prev).await?;
            }
        }
        Ok(self.written())
    }
}

/// Waits for a spawned engine write.
pub(crate) async fn join_write(
    h: tokio::task::JoinHandle<Result<usize, WorkerError>>,
) -> Result<usize, WorkerError> {
    h.await
        .map_err(|e| WorkerError::Transfer(format!("engine write task: {e}")))?
}

impl Drop for Expectation {
    fn drop(&mut self) {
        self.receiver.expected.lock().remove(&self.id);
    }
}

impl Receiver {
    /// A receiver over `inbound`, in preference order.
    pub fn new(inbound: Vec<Arc<dyn Inbound>>) -> Self {
        Self {
            expected: Mutex::default(),
            inbound,
        }
    }

    /// The transports this receiver offers, in preference order.
    pub fn kinds(&self) -> Vec<TransportKind> {
        self.inbound.iter().map(|i| i.kind()).collect()
    }

    /// Registers transfer `id` into `slot` of `engine` and returns its
    /// regions, preferred first. Dropping the guard forgets the transfer
    /// (late writes are then refused) and releases the regions.
    pub fn expect(
        self: &Arc<Self>,
        id: &str,
        engine: EngineHandle,
        slot: u64,
        writable: Vec<u32>,
        same_host: bool,
    ) -> Result<(Expectation, Vec<pb::Region>), WorkerError> {
        let block_bytes = engine.kv_layout().block_bytes();
        let writable: Arc<[u32]> = writable.into();
        self.expected.lock().insert(
            id.to_string(),
            Expected {
                engine,
                slot,
                block_bytes,
                writable: Arc::clone(&writable),
                written: 0,
            },
        );
        let mut expectation = Expectation {
            receiver: Arc::clone(self),
            id: id.to_string(),
            writable: Arc::clone(&writable),
            staged: Vec::new(),
        };
        let spec = TransferSpec {
            id,
            blocks: writable.len(),
            block_bytes,
            same_host,
        };
        let mut regions = Vec::with_capacity(self.inbound.len());
        for inbound in &self.inbound {
            match inbound.register(&spec) {
                Ok(Some(reg)) => {
                    regions.push(reg.region);
                    if let Some(staged) = reg.staged {
                        expectation.staged.push((inbound.kind(), staged));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(transport = %inbound.kind(), error = %e, "cannot register a KV region; not offering it");
                }
            }
        }
        Ok((expectation, regions))
    }

    /// The block size and writable blocks of transfer `id` (streamed
    /// transports check incoming frames against them before reading).
    pub(crate) fn lookup(&self, id: &str) -> Result<(usize, Arc<[u32]>), WorkerError> {
        let guard = self.expected.lock();
        let e = guard
            .get(id)
            .ok_or_else(|| WorkerError::Transfer(format!("unknown or cancelled transfer {id}")))?;
        Ok((e.block_bytes, Arc::clone(&e.writable)))
    }

    /// Verifies and writes blocks of transfer `id`; returns how many.
    pub async fn write(&self, id: &str, blocks: Vec<Block>) -> Result<usize, WorkerError> {
        verify(id, &blocks)?;
        self.write_verified(id, blocks).await
    }

    /// [`Receiver::write`] for blocks whose checksums the transport already
    /// verified (right after reading each, while it was in cache).
    pub(crate) async fn write_verified(
        &self,
        id: &str,
        blocks: Vec<Block>,
    ) -> Result<usize, WorkerError> {
        let (engine, slot, block_bytes, writable) = {
            let guard = self.expected.lock();
            let e = guard.get(id).ok_or_else(|| {
                WorkerError::Transfer(format!("unknown or cancelled transfer {id}"))
            })?;
            (
                e.engine.clone(),
                e.slot,
                e.block_bytes,
                Arc::clone(&e.writable),
            )
        };
        for b in &blocks {
            if !writable.contains(&b.id) {
                return Err(WorkerError::Transfer(format!(
                    "block {} is not part of transfer {id}",
                    b.id
                )));
            }
            if b.data.len() != block_bytes {
                return Err(WorkerError::Transfer(format!(
                    "block {} of transfer {id} has {} bytes, the layout says {block_bytes}",
                    b.id,
                    b.data.len()
                )));
            }
        }
        let n = blocks.len();
        engine
            .write_blocks(slot, blocks.into_iter().map(|b| (b.id, b.data)).collect())
            .await?;
        if let Some(e) = self.expected.lock().get_mut(id) {
            e.written += n;
        }
        Ok(n)
    }
}

/// Refuses the first block whose bytes do not match its checksum.
pub(crate) fn verify(id: &str, blocks: &[Block]) -> Result<(), WorkerError> {
    match blocks.iter().find(|b| xxh3_64(&b.data) != b.checksum) {
        Some(b) => Err(WorkerError::Transfer(format!(
            "checksum mismatch on block {} of transfer {id}",
            b.id
        ))),
        None => Ok(()),
    }
}

/// Where a decode worker's transports listen and how big they are.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Transports to offer, preferred first (unavailable ones are skipped).
    pub transports: Vec<TransportKind>,
    /// This worker's gRPC endpoint (the `grpc` region; its host is advertised
    /// for `tcp`).
    pub endpoint: String,
    /// Where the `tcp` listener binds; `None`: the gRPC host, port 0.
    pub tcp_listen: Option<std::net::SocketAddr>,
    /// Bytes of the shared-memory pool (capped at the engine's KV size).
    pub shm_pool_bytes: u64,
    pub block_bytes: usize,
    pub num_blocks: usize,
}

impl ReceiverConfig {
    /// From the worker's flags and its first engine rank's KV geometry.
    pub fn new(
        args: &crate::WorkerArgs,
        core: &crate::WorkerCore,
        endpoint: String,
    ) -> Result<Self, WorkerError> {
        let engine = core.engine(0)?;
        Ok(Self {
            transports: args.kv_transports.clone(),
            endpoint,
            tcp_listen: args.kv_tcp_listen,
            shm_pool_bytes: args.kv_shm_pool_mb.saturating_mul(1 << 20),
            block_bytes: engine.kv_layout().block_bytes(),
            num_blocks: engine.num_blocks(),
        })
    }
}

/// Starts every transport of `cfg` this machine can run and returns the
/// receiver; listeners stop when `shutdown` is cancelled.
pub async fn start_receiver(
    cfg: &ReceiverConfig,
    grpc_bind: std::net::SocketAddr,
    shutdown: sluice_runtime::Shutdown,
) -> Result<Arc<Receiver>, WorkerError> {
    // The listeners need the receiver and the receiver needs the listeners'
    // regions: start listeners on a shared slot filled once built.
    let slot: Arc<std::sync::OnceLock<std::sync::Weak<Receiver>>> = Arc::default();
    let mut inbound: Vec<Arc<dyn Inbound>> = Vec::new();
    for kind in available(&cfg.transports) {
        let built: Result<Arc<dyn Inbound>, WorkerError> = match kind {
            TransportKind::Grpc => Ok(Arc::new(GrpcInbound {
                endpoint: cfg.endpoint.clone(),
            })),
            TransportKind::Tcp => {
                let bind = cfg
                    .tcp_listen
                    .unwrap_or_else(|| std::net::SocketAddr::new(grpc_bind.ip(), 0));
                tcp::TcpInbound::start(
                    bind,
                    &cfg.endpoint,
                    Arc::clone(&slot),
                    shutdown.child_token(),
                )
                .await
                .map(|t| Arc::new(t) as Arc<dyn Inbound>)
            }
            TransportKind::Shm => {
                shm::ShmInbound::lazy(cfg.shm_pool_bytes, cfg.block_bytes, cfg.num_blocks)
                    .map(|s| Arc::new(s) as Arc<dyn Inbound>)
            }
            // Never yielded by `available` yet (see `rdma::probe`).
            TransportKind::Rdma => continue,
        };
        match built {
            Ok(i) => inbound.push(i),
            Err(e) => {
                tracing::warn!(transport = %kind, error = %e, "KV transport failed to start; not offering it")
            }
        }
    }
    let receiver = Arc::new(Receiver::new(inbound));
    let _ = slot.set(Arc::downgrade(&receiver));
    tracing::info!(transports = %join(&receiver.kinds()), "KV receiver ready");
    Ok(receiver)
}

#[cfg(test)]
mod tests;
