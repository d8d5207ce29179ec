//! The `rdma` transport on top of the verbs layer.
//!
//! A decode worker registers each engine's KV memory ([`KvArena`]) with its
//! RDMA device once, and offers a region naming its side-channel listener,
//! the memory region's `rkey`/`base_addr` and the arena's block count. A
//! prefill worker dials the side channel once per decode worker: both
//! sides create a reliable-connection queue pair, swap [`QpInfo`]s,
//! connect, and the receiver says it is ready; the connection is kept for
//! later transfers. A transfer is then one chain of one-sided RDMA WRITEs
//! per block part, from the prefill engine's registered KV memory straight
//! into the destination blocks' parts — no CPU on the decode side, no
//! buffers on either. The sender's completions mean the bytes are in the
//! receiver's memory; the `Prefill` response reports it.
//!
//! Unlike `shm`, a write already posted cannot be revoked: a decode worker
//! that gave up on a transfer (timeout) frees its blocks while the NIC may
//! still write them. The prefill worker bounds its send by the descriptor's
//! timeout, which narrows that window without closing it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use sluice_engine::backend::{ArenaGeometry, KvArena};
use sluice_proto::kv::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{
    Connection, Device, MemoryRegion, WriteOp, exchange_as_client, exchange_as_server, rdma_err,
    rdma_failed,
};
use crate::{
    Block, Inbound, KvSender, KvTransferError, OneSided, Registration, TransferSpec, TransportKind,
};

const READY: u8 = 0x52;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// KV arenas registered with a device, each kept alive with its region.
#[derive(Debug, Default)]
struct Registered(Mutex<Vec<(Arc<KvArena>, Arc<MemoryRegion>)>>);

impl Registered {
    fn get(
        &self,
        device: &Device,
        arena: &Arc<KvArena>,
    ) -> Result<Arc<MemoryRegion>, KvTransferError> {
        let mut list = self.0.lock();
        if let Some((_, mr)) = list.iter().find(|(a, _)| Arc::ptr_eq(a, arena)) {
            return Ok(Arc::clone(mr));
        }
        // SAFETY: the arena's mapping does not move and lives as long as
        // the `Arc<KvArena>` kept beside the region here.
        let mr = Arc::new(unsafe { device.register(arena.as_ptr(), arena.len()) }?);
        list.push((Arc::clone(arena), Arc::clone(&mr)));
        Ok(mr)
    }
}

/// The `rdma` side of a decode worker.
#[derive(Debug)]
pub struct RdmaInbound {
    device: Device,
    address: String,
    registered: Registered,
}

impl RdmaInbound {
    /// Opens the device and serves the side channel on `bind` until
    /// `shutdown`, within the edge's connection limits: a peer must finish
    /// its queue-pair exchange by the first-frame deadline.
    pub async fn start(
        bind: SocketAddr,
        endpoint: &str,
        limits: sluice_runtime::security::ConnectionLimits,
        shutdown: sluice_runtime::Shutdown,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Result<Self, KvTransferError> {
        let device = Device::open(None)?;
        let listener = TcpListener::bind(bind)
            .await
            .map_err(|source| KvTransferError::Listen {
                transport: TransportKind::Rdma,
                bind,
                source,
            })?;
        let local = listener
            .local_addr()
            .map_err(rdma_failed("reading the listener's address"))?;
        let address = crate::tcp::advertised(local, endpoint);
        let d = device.clone();
        let connections = tasks.clone();
        let gate = sluice_runtime::edge::ConnectionGate::new("kv-rdma", limits);
        tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    a = gate.accept(&listener) => a,
                };
                let Some((stream, peer, slot)) = accepted else {
                    continue;
                };
                let (d, stop) = (d.clone(), shutdown.clone());
                connections.spawn(async move {
                    let _slot = slot;
                    if let Err(e) = serve_peer(stream, &d, limits.header_read_timeout, stop).await {
                        tracing::warn!(%peer, error = %e, "KV rdma side channel closed");
                    }
                });
            }
        });
        Ok(Self {
            device,
            address,
            registered: Registered::default(),
        })
    }
}

/// One prefill worker's queue pair, held while its side channel is open.
async fn serve_peer(
    mut stream: TcpStream,
    device: &Device,
    first: Duration,
    stop: sluice_runtime::Shutdown,
) -> Result<(), KvTransferError> {
    let (mut conn, local) = Connection::new(device)?;
    let remote = tokio::time::timeout(first, exchange_as_server(&mut stream, &local))
        .await
        .map_err(|_| {
            KvTransferError::transport(
                TransportKind::Rdma,
                format!(
                    "the peer did not finish its queue-pair exchange within {} s (--header-read-timeout)",
                    first.as_secs()
                ),
            )
        })??;
    conn.connect(&remote)?;
    stream
        .write_all(&[READY])
        .await
        .map_err(rdma_failed("ready"))?;
    let mut byte = [0u8; 1];
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = stream.read(&mut byte) => {}
    }
    drop(conn);
    Ok(())
}

/// RDMA writes leave nothing to check on the receiving side: the sender's
/// completions are the proof.
#[derive(Debug)]
struct Posted;

impl OneSided for Posted {
    fn complete(&self, _ids: &[u32]) -> Result<(), KvTransferError> {
        Ok(())
    }
}

impl Inbound for RdmaInbound {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, KvTransferError> {
        let Some(arena) = spec.arena else {
            return Ok(None);
        };
        let mr = self.registered.get(&self.device, arena)?;
        Ok(Some(Registration {
            region: pb::Region {
                transport: pb::Transport::Rdma as i32,
                address: self.address.clone(),
                rkey: mr.rkey(),
                base_addr: mr.addr(),
                length: arena.len() as u64,
                checksums: false,
                arena_blocks: arena.num_blocks() as u32,
            },
            one_sided: Some(Arc::new(Posted)),
        }))
    }
}

/// A connected queue pair to one decode worker, and its side channel.
#[derive(Debug)]
struct Peer {
    conn: Connection,
    _channel: TcpStream,
}

/// Sends over `rdma`: one kept queue pair per decode worker.
#[derive(Debug)]
pub struct RdmaSender {
    device: Device,
    peers: Mutex<HashMap<String, Arc<Mutex<Peer>>>>,
    registered: Registered,
}

impl RdmaSender {
    /// Opens the device.
    pub fn new() -> Result<Self, KvTransferError> {
        Ok(Self {
            device: Device::open(None)?,
            peers: Mutex::default(),
            registered: Registered::default(),
        })
    }

    async fn peer(&self, address: &str) -> Result<Arc<Mutex<Peer>>, KvTransferError> {
        if let Some(p) = self.peers.lock().get(address) {
            return Ok(Arc::clone(p));
        }
        let mut stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(address))
            .await
            .map_err(|_| rdma_err(format!("side channel to {address} timed out")))?
            .map_err(rdma_failed(format!("side channel to {address}")))?;
        let (mut conn, local) = Connection::new(&self.device)?;
        let remote = exchange_as_client(&mut stream, &local).await?;
        conn.connect(&remote)?;
        let mut ready = [0u8; 1];
        tokio::time::timeout(CONNECT_TIMEOUT, stream.read_exact(&mut ready))
            .await
            .map_err(|_| rdma_err(format!("{address} never said ready")))?
            .map_err(rdma_failed(format!("ready from {address}")))?;
        if ready[0] != READY {
            return Err(rdma_err(format!(
                "{address} answered {:#x}, not ready",
                ready[0]
            )));
        }
        let peer = Arc::new(Mutex::new(Peer {
            conn,
            _channel: stream,
        }));
        self.peers
            .lock()
            .insert(address.to_string(), Arc::clone(&peer));
        Ok(peer)
    }

    /// Posts `ops` to the decode worker at `address` and waits for them; a
    /// failed queue pair is not kept.
    async fn post(&self, address: &str, ops: Vec<WriteOp>) -> Result<(), KvTransferError> {
        let peer = self.peer(address).await?;
        let r = tokio::task::spawn_blocking(move || peer.lock().conn.write(&ops))
            .await
            .map_err(rdma_failed("write task"))?;
        if r.is_err() {
            self.peers.lock().remove(address);
        }
        r
    }
}

/// Where `region`'s arena puts its blocks, for this worker's layout.
fn remote_geometry(region: &pb::Region, src: &KvArena) -> Result<ArenaGeometry, KvTransferError> {
    ArenaGeometry::of_len(
        src.layout(),
        region.arena_blocks as usize,
        region.length as usize,
    )
    .map_err(rdma_failed("region"))
}

#[tonic::async_trait]
impl KvSender for RdmaSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Rdma
    }

    fn needs_checksums(&self, _region: &pb::Region) -> bool {
        false
    }

    async fn write_from(
        &self,
        region: &pb::Region,
        _transfer_id: &str,
        src: &Arc<KvArena>,
        pairs: &[(u32, u32)],
    ) -> Option<Result<u32, KvTransferError>> {
        let ops = (|| {
            let g = remote_geometry(region, src)?;
            let mr = self.registered.get(&self.device, src)?;
            let local = src.geometry();
            let chunk = g.chunk_bytes() as u32;
            let mut ops = Vec::with_capacity(pairs.len() * g.slabs());
            for &(s, d) in pairs {
                local.check_block(s).map_err(rdma_failed("source block"))?;
                g.check_block(d).map_err(rdma_failed("destination block"))?;
                for slab in 0..g.slabs() {
                    ops.push(WriteOp {
                        local_addr: mr.addr() + local.chunk_offset(slab, s) as u64,
                        lkey: mr.lkey(),
                        len: chunk,
                        remote_addr: region.base_addr + g.chunk_offset(slab, d) as u64,
                        rkey: region.rkey,
                    });
                }
            }
            Ok::<_, KvTransferError>(ops)
        })();
        Some(match ops {
            Ok(ops) => self
                .post(&region.address, ops)
                .await
                .map(|()| pairs.len() as u32),
            Err(e) => Err(e),
        })
    }

    /// RDMA writes from registered KV memory only ([`KvSender::write_from`]);
    /// blocks already read out of an engine are refused (the decode worker
    /// then prefills locally).
    async fn write(
        &self,
        _region: &pb::Region,
        _transfer_id: &str,
        _blocks: Vec<Block>,
    ) -> Result<u32, KvTransferError> {
        Err(rdma_err(
            "this worker's engine has no KV memory to register; rdma sends from KV memory only",
        ))
    }
}
