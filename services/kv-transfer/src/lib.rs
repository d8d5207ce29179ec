//! `sluice-kv-transfer`: moving a prompt's KV blocks from a prefill worker
//! into the blocks a decode worker reserved for them.
//!
//! Owns the transports (`shm`, `tcp`, `grpc`, and `rdma` behind the `rdma`
//! feature), their negotiation and the ownership rules on KV memory below.
//! Depends on the engine (its [`EngineHandle`] and [`KvArena`]), the
//! protocol and the runtime (security, gRPC channels, shutdown), never on a
//! worker service: the decode worker receives with it, the prefill worker
//! sends with it. Its failures are [`KvTransferError`].
//!
//! The decode worker registers each expected transfer with the [`Receiver`]
//! (which slot, which block ids may be written). Every transport it runs
//! ([`Inbound`]) gives the transfer a region, and the descriptor lists those
//! regions in preference order (`shm` when the prefill worker is on this
//! host, then `rdma`, `tcp`, `grpc`). The prefill worker's [`Senders`] pick
//! the first region whose transport it supports and write every block there
//! ([`KvSender::write`]). Blocks on streamed transports travel with an
//! XXH3 checksum of their bytes (one-sided ones only with
//! `--kv-shm-checksums`: memory-to-memory copies are as safe as the memory,
//! and a verifying pass costs more than the copy); a checksum or layout
//! mismatch, an unknown transfer, a block not written or outside the slot
//! is refused, and the decode worker falls back to local prefill.
//!
//! Blocks land in the engine's KV memory itself (the [`KvArena`], when the
//! backend has one), never in a staging buffer: streamed transports (`tcp`,
//! `grpc`) copy each received, verified block into its destination block
//! ([`Target::write`]); one-sided ones (`shm`, `rdma`) write the destination
//! blocks from the prefill worker's side, and the receiver checks what they
//! wrote when the prefill worker reports completion (the `Prefill`
//! response), in [`Expectation::finish`]. Nothing is written into a block
//! once its transfer is forgotten (cancelled, timed out, fallen back): the
//! [`Expectation`]'s drop closes the gate streamed writes pass and revokes
//! one-sided writers before the slot's blocks can be reused.

mod error;
pub mod grpc;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod shm;
pub mod tcp;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};
use sluice_engine::EngineHandle;
use sluice_engine::backend::{KvArena, KvBlockLayout};
use sluice_proto::kv::v1 as pb;
use xxhash_rust::xxh3::xxh3_64;

pub use error::{BoxError, KvTransferError};

pub use grpc::{GrpcSender, KvTransferService, send_grpc};

/// Copies of at least this many blocks run on the blocking pool.
pub(crate) const BLOCKING_COPY_BLOCKS: usize = 64;

/// A KV transport, as named on the command line; on the wire (discovery,
/// transfer regions, `PrefillResponse.transport`) it is `kv.v1.Transport`.
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
    pub fn availability(self) -> Result<(), KvTransferError> {
        match self {
            TransportKind::Shm | TransportKind::Tcp | TransportKind::Grpc => Ok(()),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => rdma::probe(),
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma => Err(KvTransferError::transport(
                TransportKind::Rdma,
                "built without the `rdma` feature",
            )),
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

/// `shm,tcp,grpc`, for logs and messages.
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
) -> Result<(), KvTransferError> {
    let ours_pb = layout_to_pb(ours);
    match theirs {
        Some(t) if *t == ours_pb => Ok(()),
        Some(t) => Err(KvTransferError::LayoutMismatch {
            theirs: Box::new(*t),
            ours: Box::new(ours_pb),
        }),
        None => Err(KvTransferError::InvalidArgument {
            field: "destination.layout",
            message: "missing".into(),
        }),
    }
}

/// The host of an endpoint (`[scheme://]host[:port][/path]`), IPv6
/// brackets kept (so `host:port` can be rebuilt from it).
pub(crate) fn endpoint_host(e: &str) -> &str {
    let e = e.split_once("://").map_or(e, |(_, rest)| rest);
    let e = e.split('/').next().unwrap_or(e);
    match e.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => e,
    }
}

/// Whether two `host:port` endpoints (optionally with a scheme) name the same
/// host: equal hosts, or both loopback. Decides whether `shm` is offered.
pub fn same_host(a: &str, b: &str) -> bool {
    fn host(e: &str) -> &str {
        endpoint_host(e)
            .trim_start_matches('[')
            .trim_end_matches(']')
    }
    fn loopback(h: &str) -> bool {
        h.eq_ignore_ascii_case("localhost")
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
    let (ha, hb) = (host(a), host(b));
    ha.eq_ignore_ascii_case(hb) || (loopback(ha) && loopback(hb))
}

/// How long a writer may take to send a descriptor's blocks: its
/// `timeout_ms`, or 10 s when it names none.
pub fn transfer_timeout(d: &pb::TransferDescriptor) -> std::time::Duration {
    match d.timeout_ms {
        0 => std::time::Duration::from_secs(10),
        ms => std::time::Duration::from_millis(u64::from(ms)),
    }
}

/// Sends blocks of `engine`'s KV memory to a receiver's region over
/// `sender`, each `(source, destination)` pair one block, within `timeout`:
/// straight from the engine's KV memory where the transport can (`shm`),
/// else read out of the engine and sent. Returns the blocks the receiver
/// took. The sending half of a remote prefill and of a prefix fetch.
pub async fn send_blocks(
    engine: &EngineHandle,
    sender: &dyn KvSender,
    region: &pb::Region,
    transfer_id: &str,
    pairs: &[(u32, u32)],
    timeout: std::time::Duration,
) -> Result<u32, KvTransferError> {
    use tracing::Instrument;
    let transport = sender.kind();
    let span = tracing::info_span!(
        "kv.transfer",
        transport = transport.as_str(),
        blocks = pairs.len(),
        bytes = pairs.len() * engine.kv_layout().block_bytes()
    );
    let send = async {
        if let Some(arena) = engine.kv_arena()
            && let Some(r) = sender.write_from(region, transfer_id, arena, pairs).await
        {
            return r;
        }
        let src: Vec<u32> = pairs.iter().map(|&(s, _)| s).collect();
        let data = engine
            .read_blocks(src)
            .await
            .map_err(KvTransferError::failed(
                transport,
                "reading the source blocks",
            ))?;
        let checked = sender.needs_checksums(region);
        let blocks: Vec<Block> = pairs
            .iter()
            .zip(data)
            .map(|(&(_, d), data)| Block::for_region(d, data, checked))
            .collect();
        sender.write(region, transfer_id, blocks).await
    };
    tokio::time::timeout(timeout, send.instrument(span))
        .await
        .map_err(|_| KvTransferError::Timeout {
            transport,
            after: timeout,
        })?
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

    /// A block without a checksum (0), for a region that does not verify
    /// them ([`KvSender::needs_checksums`]).
    pub fn unchecked(id: u32, data: Vec<u8>) -> Self {
        Self {
            id,
            checksum: 0,
            data,
        }
    }

    /// [`Block::new`] when `checked`, else [`Block::unchecked`].
    pub fn for_region(id: u32, data: Vec<u8>, checked: bool) -> Self {
        if checked {
            Self::new(id, data)
        } else {
            Self::unchecked(id, data)
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

    /// Whether blocks written to `region` must carry their checksum
    /// ([`Block::new`]); else [`Block::unchecked`] saves a pass over them.
    fn needs_checksums(&self, _region: &pb::Region) -> bool {
        true
    }

    /// Writes blocks straight from the sender engine's KV memory `src`:
    /// `pairs` of (source block, destination block). `None`: this transport
    /// cannot; the caller reads the blocks out and calls [`KvSender::write`].
    async fn write_from(
        &self,
        _region: &pb::Region,
        _transfer_id: &str,
        _src: &Arc<KvArena>,
        _pairs: &[(u32, u32)],
    ) -> Option<Result<u32, KvTransferError>> {
        None
    }

    /// Writes `blocks` of `transfer_id` into `region`; returns the blocks the
    /// receiver took (streamed transports) or wrote (one-sided ones).
    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, KvTransferError>;
}

/// A prefill worker's senders, one per transport it accepts.
#[derive(Debug, Clone, Default)]
pub struct Senders {
    senders: Vec<Arc<dyn KvSender>>,
}

impl Senders {
    /// Senders for the transports of `wanted` this build and machine can
    /// run; gRPC ones call with `security`.
    pub fn new(wanted: &[TransportKind], security: &Arc<sluice_runtime::Security>) -> Self {
        let mut senders: Vec<Arc<dyn KvSender>> = Vec::new();
        for kind in available(wanted) {
            match kind {
                TransportKind::Shm => senders.push(Arc::new(shm::ShmSender::default())),
                TransportKind::Tcp => match tcp_refused(security, None) {
                    Some(why) => {
                        tracing::warn!(reason = why, "not sending KV blocks over tcp");
                    }
                    None => {
                        senders.push(Arc::new(tcp::TcpSender::with_token(security.mesh_token())))
                    }
                },
                TransportKind::Grpc => {
                    senders.push(Arc::new(GrpcSender::new(Arc::clone(security))))
                }
                #[cfg(feature = "rdma")]
                TransportKind::Rdma => match rdma::RdmaSender::new() {
                    Ok(r) => senders.push(Arc::new(r)),
                    Err(e) => tracing::warn!(error = %e, "rdma sender unavailable"),
                },
                #[cfg(not(feature = "rdma"))]
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

    /// [`Senders::choose`], refusing with both sides' transports named when
    /// there is nothing in common (before any compute is spent).
    pub fn negotiate<'a>(
        &self,
        regions: &'a [pb::Region],
    ) -> Result<(&Arc<dyn KvSender>, &'a pb::Region), KvTransferError> {
        self.choose(regions).ok_or_else(|| {
            let offered: Vec<TransportKind> = regions
                .iter()
                .filter_map(|r| TransportKind::from_pb(r.transport))
                .collect();
            KvTransferError::NoCommonTransport {
                offered: join(&offered),
                accepted: join(&self.kinds()),
            }
        })
    }
}

/// What a transport is asked to register for one transfer.
#[derive(Debug, Clone, Copy)]
pub struct TransferSpec<'a> {
    pub id: &'a str,
    /// The destination blocks the sender will write, in order.
    pub writable: &'a [u32],
    /// The destination engine's KV memory, when transports may write it.
    pub arena: Option<&'a Arc<KvArena>>,
    /// Whether the sender runs on this host (`shm` is offered only then).
    pub same_host: bool,
}

/// A region registered for one transfer. What it holds (armed blocks, a
/// registered memory region) is released when it drops.
#[derive(Debug)]
pub struct Registration {
    pub region: pb::Region,
    /// One-sided transports: how to check what the sender wrote.
    pub one_sided: Option<Arc<dyn OneSided>>,
}

/// A streamed transport's receiving side (`tcp`, `grpc`): every transfer
/// gets the same region, the address senders connect to.
#[derive(Debug, Clone)]
pub struct AddressInbound {
    pub kind: TransportKind,
    pub address: String,
}

impl Inbound for AddressInbound {
    fn kind(&self) -> TransportKind {
        self.kind
    }

    fn register(&self, _spec: &TransferSpec<'_>) -> Result<Option<Registration>, KvTransferError> {
        Ok(Some(Registration {
            region: pb::Region {
                transport: self.kind.to_pb() as i32,
                address: self.address.clone(),
                ..Default::default()
            },
            one_sided: None,
        }))
    }
}

/// Blocks a sender writes one-sidedly into the engine's KV memory.
/// Dropping it revokes the sender's right to write: once the drop returns,
/// no write of this transfer lands any more.
pub trait OneSided: Send + Sync + fmt::Debug {
    /// Checks that every block of `ids` was written by this transfer and
    /// matches the checksum its sender recorded; refuses otherwise.
    fn complete(&self, ids: &[u32]) -> Result<(), KvTransferError>;
}

/// The receiving side of one transport.
pub trait Inbound: Send + Sync + fmt::Debug {
    /// Which transport this is.
    fn kind(&self) -> TransportKind;

    /// A region for `spec`, or `None` when this transport does not apply to
    /// it (e.g. `shm` for a sender on another host).
    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, KvTransferError>;
}

/// Where a streamed transport writes the blocks of one transfer.
#[derive(Debug, Clone)]
pub struct Target {
    transfer: Arc<str>,
    engine: EngineHandle,
    slot: u64,
    block_bytes: usize,
    /// Block ids the sender may write (the slot's blocks past the skipped prefix).
    writable: Arc<[u32]>,
    /// Which of `writable` arrived.
    done: Arc<[AtomicBool]>,
    arena: Option<Arc<KvArena>>,
    /// `true` while the transfer is registered; writes hold it read-locked.
    open: Arc<RwLock<bool>>,
}

impl Target {
    /// Block bytes of this transfer's layout.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn position(&self, id: u32, len: usize) -> Result<usize, KvTransferError> {
        let transfer = &self.transfer;
        let i = self.writable.iter().position(|&w| w == id).ok_or_else(|| {
            KvTransferError::NotWritable {
                transfer: transfer.to_string(),
                block: id,
            }
        })?;
        if len != self.block_bytes {
            return Err(KvTransferError::BlockSize {
                transfer: transfer.to_string(),
                block: id,
                len,
                expected: self.block_bytes,
            });
        }
        Ok(i)
    }

    /// Copies one verified block into its destination block: straight into
    /// the engine's KV memory when it has an arena, else through the engine.
    pub async fn write(&self, id: u32, data: &[u8]) -> Result<(), KvTransferError> {
        let i = self.position(id, data.len())?;
        match &self.arena {
            Some(arena) => {
                let open = self.open.read();
                if !*open {
                    return Err(cancelled(&self.transfer));
                }
                // SAFETY: `id` is a reserved block of this transfer's slot
                // (checked above); the engine leaves reserved blocks alone
                // until the slot is committed, which happens only after the
                // transfer is forgotten, and forgetting it waits for this
                // read lock to be released.
                unsafe { arena.write_block(id, data) }?;
            }
            None => {
                self.engine
                    .write_blocks(self.slot, vec![(id, data.to_vec())])
                    .await?
            }
        }
        self.done[i].store(true, Ordering::Release);
        Ok(())
    }

    /// Verifies `block`'s checksum, then [`Target::write`]s it.
    pub async fn write_checked(&self, block: &Block) -> Result<(), KvTransferError> {
        verify(&self.transfer, std::slice::from_ref(block))?;
        self.write(block.id, &block.data).await
    }

    fn written(&self) -> usize {
        self.done
            .iter()
            .filter(|d| d.load(Ordering::Acquire))
            .count()
    }
}

fn cancelled(transfer: &str) -> KvTransferError {
    KvTransferError::UnknownTransfer {
        transfer: transfer.to_string(),
    }
}

/// The decode side's registry of expected transfers, and the transports
/// that write into them.
#[derive(Debug, Default)]
pub struct Receiver {
    expected: Mutex<HashMap<String, Target>>,
    inbound: Vec<Arc<dyn Inbound>>,
}

/// A registered transfer: its regions, and the guard that forgets it (and
/// releases every region) when dropped.
#[derive(Debug)]
pub struct Expectation {
    receiver: Arc<Receiver>,
    target: Target,
    one_sided: Vec<(TransportKind, Arc<dyn OneSided>)>,
}

impl Expectation {
    /// Blocks written so far.
    pub fn written(&self) -> usize {
        self.target.written()
    }

    /// Completes the transfer once the sender reports it done over
    /// `transport`: what a one-sided transport wrote is checked now.
    /// Returns the blocks written in all.
    pub async fn finish(&self, transport: TransportKind) -> Result<usize, KvTransferError> {
        self.check_one_sided(transport, self.target.writable.len())
            .await?;
        Ok(self.written())
    }

    /// Completes a transfer the sender says wrote only the first `n`
    /// writable blocks (a peer's prefix of which it still held that much):
    /// those must all have landed, checked as [`Expectation::finish`] does.
    pub async fn finish_first(
        &self,
        transport: TransportKind,
        n: usize,
    ) -> Result<usize, KvTransferError> {
        let n = n.min(self.target.writable.len());
        self.check_one_sided(transport, n).await?;
        match self.target.done[..n]
            .iter()
            .position(|d| !d.load(Ordering::Acquire))
        {
            Some(i) => Err(KvTransferError::transport(
                transport,
                format!(
                    "block {} of transfer {} did not arrive",
                    self.target.writable[i], self.target.transfer
                ),
            )),
            None => Ok(n),
        }
    }

    /// Checks what a one-sided `transport` wrote into the first `n`
    /// writable blocks, and marks them arrived.
    async fn check_one_sided(
        &self,
        transport: TransportKind,
        n: usize,
    ) -> Result<(), KvTransferError> {
        if let Some((_, one_sided)) = self.one_sided.iter().find(|(k, _)| *k == transport) {
            let ids: Arc<[u32]> = self.target.writable[..n].into();
            // Checksums read every block: large transfers leave the runtime's
            // threads alone.
            if ids.len() >= BLOCKING_COPY_BLOCKS {
                let o = Arc::clone(one_sided);
                tokio::task::spawn_blocking(move || o.complete(&ids))
                    .await
                    .map_err(KvTransferError::failed(
                        transport,
                        "checking a one-sided write",
                    ))??;
            } else {
                one_sided.complete(&ids)?;
            }
            for d in &self.target.done[..n] {
                d.store(true, Ordering::Release);
            }
        }
        Ok(())
    }
}

impl Drop for Expectation {
    fn drop(&mut self) {
        // Waits for a streamed write in progress; none starts afterwards.
        *self.target.open.write() = false;
        self.receiver
            .expected
            .lock()
            .remove(self.target.transfer.as_ref());
        // One-sided registrations revoke their writers as they drop.
        self.one_sided.clear();
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
    /// (later writes are refused) and releases the regions.
    pub fn expect(
        self: &Arc<Self>,
        id: &str,
        engine: EngineHandle,
        slot: u64,
        writable: Vec<u32>,
        same_host: bool,
    ) -> Result<(Expectation, Vec<pb::Region>), KvTransferError> {
        let block_bytes = engine.kv_layout().block_bytes();
        let arena = engine.kv_arena().cloned();
        let writable: Arc<[u32]> = writable.into();
        let target = Target {
            transfer: id.into(),
            engine,
            slot,
            block_bytes,
            done: writable.iter().map(|_| AtomicBool::new(false)).collect(),
            writable,
            arena,
            open: Arc::new(RwLock::new(true)),
        };
        self.expected.lock().insert(id.to_string(), target.clone());
        let mut expectation = Expectation {
            receiver: Arc::clone(self),
            target,
            one_sided: Vec::new(),
        };
        let spec = TransferSpec {
            id,
            writable: &expectation.target.writable,
            arena: expectation.target.arena.as_ref(),
            same_host,
        };
        let mut regions = Vec::with_capacity(self.inbound.len());
        let mut one_sided = Vec::new();
        for inbound in &self.inbound {
            match inbound.register(&spec) {
                Ok(Some(reg)) => {
                    regions.push(reg.region);
                    if let Some(o) = reg.one_sided {
                        one_sided.push((inbound.kind(), o));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(transport = %inbound.kind(), error = %e, "cannot register a KV region; not offering it");
                }
            }
        }
        expectation.one_sided = one_sided;
        Ok((expectation, regions))
    }

    /// Where transfer `id`'s blocks go (streamed transports look it up when
    /// a transfer begins).
    pub fn target(&self, id: &str) -> Result<Target, KvTransferError> {
        self.expected
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| cancelled(id))
    }

    /// Verifies and writes blocks of transfer `id`; returns how many.
    pub async fn write(&self, id: &str, blocks: Vec<Block>) -> Result<usize, KvTransferError> {
        let target = self.target(id)?;
        for b in &blocks {
            target.write_checked(b).await?;
        }
        Ok(blocks.len())
    }
}

/// Refuses the first block whose bytes do not match its checksum.
pub(crate) fn verify(id: &str, blocks: &[Block]) -> Result<(), KvTransferError> {
    match blocks.iter().find(|b| xxh3_64(&b.data) != b.checksum) {
        Some(b) => Err(KvTransferError::Checksum {
            transfer: id.to_string(),
            block: b.id,
        }),
        None => Ok(()),
    }
}

/// Where a decode worker's transports listen.
#[derive(Debug, Clone)]
pub struct ReceiverConfig {
    /// Transports to offer, preferred first (unavailable ones are skipped).
    pub transports: Vec<TransportKind>,
    /// This worker's gRPC endpoint (the `grpc` region; its host is advertised
    /// for `tcp`).
    pub endpoint: String,
    /// Where the `tcp` listener binds; `None`: the gRPC host, port 0.
    pub tcp_listen: Option<std::net::SocketAddr>,
    /// Whether `shm` writes carry checksums the receiver verifies.
    pub shm_checksums: bool,
    /// The worker's TLS and mesh token: the `tcp` listener takes only
    /// connections that open with the token, and is not offered with TLS.
    pub security: Arc<sluice_runtime::Security>,
}

/// Why `tcp` must not carry this worker's blocks (listening on `bind`, for
/// a receiver), if it must not:
/// - with TLS configured, blocks would cross the network in cleartext next
///   to TLS-protected gRPC: `grpc` (over TLS), `shm` or `rdma` carry them;
/// - with no way to tell a member from a stranger (no token, no CA), a
///   listener off loopback would take anyone's writes, unless `--insecure`.
fn tcp_refused(
    security: &sluice_runtime::Security,
    bind: Option<std::net::SocketAddr>,
) -> Option<&'static str> {
    if security.serves_tls() || security.dials_tls() {
        return Some(
            "TLS is configured and tcp carries KV blocks in cleartext; use grpc (TLS), shm or rdma",
        );
    }
    let exposed = bind.is_some_and(|b| !b.ip().is_loopback());
    if exposed && security.mesh_token().is_none() && !security.insecure() {
        return Some(
            "the tcp KV listener is not on loopback and there is no mesh token to tell members from strangers (--mesh-token-file, or --insecure)",
        );
    }
    None
}

/// Starts every transport of `cfg` this machine can run and returns the
/// receiver; listeners and their connections run on `tasks` and stop when
/// `shutdown` is cancelled.
pub async fn start_receiver(
    cfg: &ReceiverConfig,
    grpc_bind: std::net::SocketAddr,
    shutdown: sluice_runtime::Shutdown,
    tasks: &tokio_util::task::TaskTracker,
) -> Result<Arc<Receiver>, KvTransferError> {
    // The listeners need the receiver and the receiver needs the listeners'
    // regions: start listeners on a shared slot filled once built.
    let slot: Arc<std::sync::OnceLock<std::sync::Weak<Receiver>>> = Arc::default();
    let mut inbound: Vec<Arc<dyn Inbound>> = Vec::new();
    for kind in available(&cfg.transports) {
        let built: Result<Arc<dyn Inbound>, KvTransferError> = match kind {
            TransportKind::Grpc => Ok(Arc::new(AddressInbound {
                kind: TransportKind::Grpc,
                address: cfg.endpoint.clone(),
            }) as Arc<dyn Inbound>),
            TransportKind::Tcp => {
                let bind = cfg
                    .tcp_listen
                    .unwrap_or_else(|| std::net::SocketAddr::new(grpc_bind.ip(), 0));
                if let Some(why) = tcp_refused(&cfg.security, Some(bind)) {
                    tracing::warn!(reason = why, "tcp KV transport not offered");
                    continue;
                }
                tcp::listen(
                    bind,
                    &cfg.endpoint,
                    Arc::clone(&slot),
                    Arc::clone(&cfg.security),
                    shutdown.child_token(),
                    tasks,
                )
                .await
                .map(|t| Arc::new(t) as Arc<dyn Inbound>)
            }
            TransportKind::Shm => shm::ShmInbound::start(
                cfg.shm_checksums,
                cfg.security.limits(),
                shutdown.child_token(),
                tasks,
            )
            .map(|i| Arc::new(i) as Arc<dyn Inbound>),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => rdma::RdmaInbound::start(
                std::net::SocketAddr::new(grpc_bind.ip(), 0),
                &cfg.endpoint,
                cfg.security.limits(),
                shutdown.child_token(),
                tasks,
            )
            .await
            .map(|r| Arc::new(r) as Arc<dyn Inbound>),
            // `available` never yields rdma without the feature.
            #[cfg(not(feature = "rdma"))]
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
