//! The `shm` transport: same host, one-sided writes straight into the decode
//! engine's KV memory (the RDMA model without the NIC).
//!
//! A decode worker that offers `shm` keeps its KV memory in a nameless
//! memory file ([`KvArena`] with [`sluice_engine::backend::KvBacking::Shared`])
//! and listens on an abstract unix socket (no file either: it goes with the
//! process). Its region names the socket and the arena; a prefill worker on
//! the same host connects, is checked to run as the same user (the socket's
//! peer credentials: what a `0600` file used to ensure), receives the
//! arena's descriptor (`SCM_RIGHTS`), maps it once, reads the geometry from
//! its header and copies each block's `2·layers` parts into the destination
//! block's place in the slabs — one copy, from the sender's memory into the
//! engine's, no staging buffer, no round trip through the decode engine's
//! thread. The connection stays open while the sender keeps the mapping:
//! when the decode worker goes (even by `kill -9`) it closes, the sender
//! unmaps, and the kernel frees the memory; nothing is left in `/dev/shm`.
//!
//! Who may write which block is settled through each block's control words
//! in the file (`tag`, `state`, `checksum`):
//!
//! - registering a transfer *arms* its blocks: `state = 0`, `tag` = the
//!   transfer's tag (XXH3 of its id, never 0);
//! - the sender, per block: `state += 1 << 32` (a writer inside), then
//!   reads `tag` — another tag means the transfer was revoked: it leaves
//!   and fails —, copies, stores the block's checksum, sets bit 0
//!   (written), and `state -= 1 << 32`;
//! - the receiver, on completion, accepts a block only with its tag and
//!   the written bit (and, with `--kv-shm-checksums`, bytes matching the
//!   checksum the sender recorded);
//! - forgetting the transfer *revokes* it: `tag = 0`, then it waits until
//!   no writer is inside (bounded) before the blocks can be reused.
//!
//! Both sides use sequentially consistent operations on `state` and `tag`,
//! so either the sender sees the revocation or the receiver sees the sender
//! inside and waits: a write never lands in a block after it is reused.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use parking_lot::Mutex;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use sluice_engine::backend::{ArenaGeometry, KvArena, arena};
use sluice_proto::kv::v1 as pb;
use sluice_runtime::edge::ConnectionGate;
use sluice_runtime::security::ConnectionLimits;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::{
    Block, Inbound, KvSender, KvTransferError, OneSided, Registration, TransferSpec, TransportKind,
};

/// Mapped arenas a sender keeps.
const MAX_MAPPED: usize = 16;
/// The abstract socket names' prefix (`@` marks the abstract namespace).
const SOCKET_PREFIX: &str = "@sluice-kv-";
/// How long a sender waits for a receiver's arena.
const OPEN_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest refusal reason a sender reads.
const MAX_REASON: usize = 4096;
/// How long revoking a transfer waits for a writer still inside a block.
const REVOKE_WAIT: Duration = Duration::from_millis(500);
pub(crate) const WRITING: u64 = 1 << 32;
const WRITTEN: u64 = 1;
/// Control word indices.
pub(crate) const TAG: usize = 0;
pub(crate) const STATE: usize = 1;
const CHECKSUM: usize = 2;

/// A check of `shm` failed while doing `what`.
fn shm_err(what: &str, message: impl std::fmt::Display) -> KvTransferError {
    KvTransferError::transport(TransportKind::Shm, format!("{what}: {message}"))
}

/// `shm` failed while doing `what` on an underlying error (for `map_err`).
fn shm_failed<E: Into<crate::BoxError>>(
    what: impl Into<String>,
) -> impl FnOnce(E) -> KvTransferError {
    KvTransferError::failed(TransportKind::Shm, what)
}

/// A transfer's tag in the control words: never 0 (0 = nobody may write).
fn tag_of(transfer_id: &str) -> u64 {
    xxh3_64(transfer_id.as_bytes()) | 1
}

/// XXH3-64 of block `id`'s serialised form, read from its slab parts.
fn block_checksum(base: *const u8, g: &ArenaGeometry, id: u32) -> u64 {
    let chunk = g.chunk_bytes();
    let mut h = Xxh3::new();
    for slab in 0..g.slabs() {
        // SAFETY: `chunk_offset(slab, id) + chunk` lies within the mapping
        // (`id` checked against the geometry by the callers).
        let part = unsafe { std::slice::from_raw_parts(base.add(g.chunk_offset(slab, id)), chunk) };
        h.update(part);
    }
    h.digest()
}

/// The control words of block `id` in a mapping with geometry `g`.
///
/// # Safety
/// `base` is the start of a live mapping of at least `g.len()` bytes that
/// outlives the returned reference; `id < g.num_blocks`.
unsafe fn control<'a>(base: *mut u8, g: &ArenaGeometry, id: u32) -> &'a [AtomicU64; 4] {
    // SAFETY: per the contract; the control area is 8-byte aligned.
    unsafe { &*(base.add(g.control_offset_of(id)) as *const [AtomicU64; 4]) }
}

/// The `shm` side of a decode worker: hands the engine's KV memory to
/// senders on this host over its socket.
#[derive(Debug)]
pub struct ShmInbound {
    /// Whether senders record checksums and completion verifies them.
    checksums: bool,
    /// The socket's name, `@sluice-kv-<pid>-<random>`.
    name: String,
    /// The arenas registered transfers named, by the id regions carry.
    arenas: Arc<Mutex<HashMap<u64, Weak<KvArena>>>>,
}

impl ShmInbound {
    /// Listens on a new abstract socket and hands arenas to same-user
    /// peers there until `shutdown`, within `limits` (connections held,
    /// the request due by the first-frame deadline).
    pub fn start(
        checksums: bool,
        limits: ConnectionLimits,
        shutdown: sluice_runtime::Shutdown,
        tasks: &tokio_util::task::TaskTracker,
    ) -> Result<Self, KvTransferError> {
        let name = format!(
            "{SOCKET_PREFIX}{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let listener = UnixAddr::from_abstract_name(&name.as_bytes()[1..])
            .and_then(|addr| UnixListener::bind_addr(&addr))
            .and_then(|l| {
                l.set_nonblocking(true)?;
                tokio::net::UnixListener::from_std(l)
            })
            .map_err(shm_failed(format!("listen on {name}")))?;
        let arenas: Arc<Mutex<HashMap<u64, Weak<KvArena>>>> = Arc::default();
        let gate = Arc::new(ConnectionGate::new("kv-shm", limits));
        let (served, connections) = (Arc::clone(&arenas), tasks.clone());
        tasks.spawn(async move {
            loop {
                let accepted = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    a = listener.accept() => a,
                };
                let stream = match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        gate.refuse("a local process", &format!("KV shm accept failed: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let Some(slot) = gate.slot("a local process") else {
                    continue;
                };
                let (served, gate, stop) =
                    (Arc::clone(&served), Arc::clone(&gate), shutdown.clone());
                connections.spawn(async move {
                    let _slot = slot;
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        () = hand_over(stream, &served, &gate, limits.header_read_timeout) => {}
                    }
                });
            }
        });
        tracing::info!(socket = %name, "KV shm socket bound");
        Ok(Self {
            checksums,
            name,
            arenas,
        })
    }
}

/// Serves one peer: checks it runs as this process's user, reads which
/// arena it wants (by `first`), sends that arena's descriptor, then holds
/// the connection until the peer closes it (it keeps the mapping that
/// long; our end closing tells it we are gone).
async fn hand_over(
    mut stream: tokio::net::UnixStream,
    arenas: &Mutex<HashMap<u64, Weak<KvArena>>>,
    gate: &ConnectionGate,
    first: Duration,
) {
    let refuse = |why: String| async {
        gate.refuse(
            "a local process",
            &format!("KV shm connection refused: {why}"),
        );
        why
    };
    let outcome: Result<(), String> = async {
        let uid = rustix::net::sockopt::socket_peercred(&stream)
            .map_err(|e| format!("no peer credentials: {e}"))?
            .uid;
        if uid != rustix::process::geteuid() {
            return Err(format!(
                "peer runs as uid {}, this worker as {}",
                uid.as_raw(),
                rustix::process::geteuid().as_raw()
            ));
        }
        let mut id = [0u8; 8];
        match tokio::time::timeout(first, stream.read_exact(&mut id)).await {
            Err(_) => {
                return Err(format!(
                    "no request within {} s (--header-read-timeout)",
                    first.as_secs()
                ));
            }
            // A probe (`accepts`) or a peer that changed its mind.
            Ok(Err(_)) => return Ok(()),
            Ok(Ok(_)) => {}
        }
        let id = u64::from_le_bytes(id);
        let arena = arenas.lock().get(&id).and_then(Weak::upgrade);
        let arena = arena.ok_or_else(|| format!("no KV arena {id:x} here"))?;
        let fd = arena
            .shared_fd()
            .ok_or_else(|| "the arena is not shared".to_string())?;
        stream
            .async_io(Interest::WRITABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut control = SendAncillaryBuffer::new(&mut space);
                let fds = [fd];
                control.push(SendAncillaryMessage::ScmRights(&fds));
                rustix::net::sendmsg(
                    &stream,
                    &[IoSlice::new(&[0])],
                    &mut control,
                    SendFlags::empty(),
                )
                .map_err(std::io::Error::from)
            })
            .await
            .map_err(|e| format!("sending the arena: {e}"))?;
        drop(arena);
        // Held until the peer lets go of the mapping (or goes).
        let mut byte = [0u8; 1];
        while matches!(stream.read(&mut byte).await, Ok(n) if n > 0) {}
        Ok(())
    }
    .await;
    if let Err(why) = outcome {
        let why = refuse(why).await;
        let mut answer = vec![1u8];
        answer.extend(why.as_bytes());
        let _ = stream.write_all(&answer).await;
        let _ = stream.shutdown().await;
    }
}

impl Inbound for ShmInbound {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, KvTransferError> {
        if !spec.same_host {
            return Ok(None);
        }
        let Some(arena) = spec.arena.filter(|a| a.shared_fd().is_some()) else {
            return Ok(None);
        };
        // The allocation's address: unique among live arenas (a `Weak`
        // keeps it from being reused while listed).
        let arena_id = Arc::as_ptr(arena) as usize as u64;
        {
            let mut arenas = self.arenas.lock();
            if !arenas.contains_key(&arena_id) {
                arenas.retain(|_, a| a.strong_count() > 0);
                arenas.insert(arena_id, Arc::downgrade(arena));
            }
        }
        let tag = tag_of(spec.id);
        for &id in spec.writable {
            let c = arena.control(id)?;
            c[STATE].store(0, Ordering::SeqCst);
            c[CHECKSUM].store(0, Ordering::Relaxed);
            c[TAG].store(tag, Ordering::SeqCst);
        }
        Ok(Some(Registration {
            region: pb::Region {
                transport: pb::Transport::Shm as i32,
                address: format!("{}/{arena_id:x}", self.name),
                rkey: 0,
                base_addr: 0,
                length: arena.len() as u64,
                checksums: self.checksums,
                arena_blocks: arena.num_blocks() as u32,
            },
            one_sided: Some(Arc::new(Armed {
                arena: Arc::clone(arena),
                ids: spec.writable.to_vec(),
                tag,
                verify: self.checksums,
                transfer: spec.id.to_string(),
            })),
        }))
    }
}

/// One transfer's armed blocks; revoked when dropped.
#[derive(Debug)]
struct Armed {
    arena: Arc<KvArena>,
    ids: Vec<u32>,
    tag: u64,
    verify: bool,
    transfer: String,
}

impl OneSided for Armed {
    fn complete(&self, ids: &[u32]) -> Result<(), KvTransferError> {
        let g = self.arena.geometry();
        for &id in ids {
            let c = self.arena.control(id)?;
            let state = c[STATE].load(Ordering::Acquire);
            if c[TAG].load(Ordering::Acquire) != self.tag || state & WRITTEN == 0 {
                return Err(shm_err(
                    "complete",
                    format!("block {id} of transfer {} was not written", self.transfer),
                ));
            }
            if state >= WRITING {
                return Err(shm_err(
                    "complete",
                    format!(
                        "block {id} of transfer {} is still being written",
                        self.transfer
                    ),
                ));
            }
            if self.verify
                && block_checksum(self.arena.as_ptr(), g, id) != c[CHECKSUM].load(Ordering::Relaxed)
            {
                return Err(KvTransferError::Checksum {
                    transfer: self.transfer.to_string(),
                    block: id,
                });
            }
        }
        Ok(())
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        let Ok(controls) = self
            .ids
            .iter()
            .map(|&id| self.arena.control(id))
            .collect::<Result<Vec<_>, _>>()
        else {
            return;
        };
        for c in &controls {
            let _ = c[TAG].compare_exchange(self.tag, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        // The blocks may be reused once this returns, so a writer still
        // inside one must leave first. Usually none is: no wait at all.
        let writing =
            |c: &&[AtomicU64; arena::CONTROL_WORDS]| c[STATE].load(Ordering::SeqCst) >= WRITING;
        if !controls.iter().any(writing) {
            return;
        }
        let wait = || {
            let deadline = Instant::now() + REVOKE_WAIT;
            for (c, id) in controls.iter().zip(&self.ids) {
                while writing(c) {
                    if Instant::now() > deadline {
                        // A sender that died mid-copy leaves its mark for
                        // ever; one still alive this long after is stuck
                        // all the same.
                        tracing::warn!(transfer = %self.transfer, block = id, "a KV shm writer is still inside a revoked block");
                        return;
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
            }
        };
        // Off the async runtime's worker: `block_in_place` hands this
        // thread's other tasks to another worker while it waits.
        match tokio::runtime::Handle::try_current() {
            Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(wait)
            }
            _ => wait(),
        }
    }
}

/// A receiver's arena, mapped, and the connection it came on.
#[derive(Debug)]
struct Mapped {
    map: MmapRaw,
    geometry: ArenaGeometry,
    /// Open while the receiver is (non-blocking; nothing is ever sent).
    receiver: UnixStream,
}

impl Mapped {
    /// Whether the receiver still runs: its end of the connection is open.
    fn receiver_alive(&self) -> bool {
        let mut byte = [0u8; 1];
        match (&self.receiver).read(&mut byte) {
            Ok(0) => false,
            Ok(_) => true,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }
}

// The geometry is read once; the mapping is shared memory written only
// through raw pointers and atomics.

/// Writes into decode engines' KV memory on this host; keeps each mapped
/// while its receiver runs.
#[derive(Debug, Default)]
pub struct ShmSender {
    mapped: Mutex<HashMap<String, Arc<Mapped>>>,
}

/// A region address's socket name (with its `@`) and arena id.
fn parse_address(address: &str) -> Option<(&str, u64)> {
    let (name, id) = address.split_once('/')?;
    let id = u64::from_str_radix(id, 16).ok()?;
    (name.starts_with(SOCKET_PREFIX) && name.len() > SOCKET_PREFIX.len()).then_some((name, id))
}

/// Connects to the receiver's socket `name` (blocking: a unix connect
/// completes or fails at once).
fn connect(name: &str) -> std::io::Result<UnixStream> {
    let addr = UnixAddr::from_abstract_name(&name.as_bytes()[1..])?;
    UnixStream::connect_addr(&addr)
}

/// Reads the receiver's answer to an arena request: the descriptor, or the
/// reason it refused.
async fn receive_arena(stream: &mut tokio::net::UnixStream) -> Result<OwnedFd, String> {
    let (status, fd) = loop {
        stream.readable().await.map_err(|e| e.to_string())?;
        let mut byte = [0u8; 1];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = stream.try_io(Interest::READABLE, || {
            rustix::net::recvmsg(
                &*stream,
                &mut [IoSliceMut::new(&mut byte)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )
            .map_err(std::io::Error::from)
        });
        match got {
            Ok(msg) if msg.bytes == 0 => return Err("the receiver closed the connection".into()),
            Ok(_) => {
                let mut fd = None;
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(mut fds) = m {
                        fd = fd.or_else(|| fds.next());
                    }
                }
                break (byte[0], fd);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e.to_string()),
        }
    };
    match (status, fd) {
        (0, Some(fd)) => Ok(fd),
        (0, None) => Err("the receiver sent no descriptor".into()),
        _ => {
            let mut reason = Vec::new();
            let _ = (&mut *stream)
                .take(MAX_REASON as u64)
                .read_to_end(&mut reason)
                .await;
            Err(String::from_utf8_lossy(&reason).into_owned())
        }
    }
}

impl ShmSender {
    /// Arenas mapped now.
    #[cfg(test)]
    pub(crate) fn mapped(&self) -> usize {
        self.mapped.lock().len()
    }

    /// The receiver's arena at `address`, mapped (once).
    async fn open(&self, address: &str) -> Result<Arc<Mapped>, KvTransferError> {
        {
            let mut cache = self.mapped.lock();
            match cache.get(address) {
                Some(m) if m.receiver_alive() => return Ok(Arc::clone(m)),
                Some(_) => drop(cache.remove(address)),
                None => {}
            }
        }
        let (name, id) = parse_address(address)
            .ok_or_else(|| shm_err("open", format!("{address} is not a KV arena address")))?;
        let stream = connect(name)
            .and_then(|s| {
                s.set_nonblocking(true)?;
                tokio::net::UnixStream::from_std(s)
            })
            .map_err(shm_failed(format!("connect to {name}")))?;
        let opened = tokio::time::timeout(OPEN_TIMEOUT, async move {
            let mut stream = stream;
            stream
                .write_all(&id.to_le_bytes())
                .await
                .map_err(|e| e.to_string())?;
            let fd = receive_arena(&mut stream).await?;
            Ok::<_, String>((fd, stream))
        })
        .await
        .map_err(|_| {
            shm_err(
                "open",
                format!(
                    "{address} did not answer within {} s",
                    OPEN_TIMEOUT.as_secs()
                ),
            )
        })?
        .map_err(|why| shm_err("open", format!("{address}: {why}")))?;
        let (fd, stream) = opened;
        let file = std::fs::File::from(fd);
        let map = MmapRaw::map_raw(&file).map_err(shm_failed(format!("map {address}")))?;
        if map.len() < arena::HEADER_BYTES {
            return Err(shm_err("open", format!("{address} is too short")));
        }
        // SAFETY: the header lies within the mapping; plain bytes.
        let header = unsafe { std::slice::from_raw_parts(map.as_ptr(), arena::HEADER_BYTES) };
        let geometry = ArenaGeometry::from_header(header, map.len())
            .map_err(shm_failed(format!("header of {address}")))?;
        let receiver = stream
            .into_std()
            .map_err(shm_failed(format!("keeping the connection to {name}")))?;
        let m = Arc::new(Mapped {
            map,
            geometry,
            receiver,
        });
        let mut cache = self.mapped.lock();
        // A mapping keeps a gone receiver's memory alive: let go of the
        // arenas of decode workers that have gone.
        cache.retain(|_, m| m.receiver_alive());
        if cache.len() >= MAX_MAPPED {
            cache.clear();
        }
        cache.insert(address.to_string(), Arc::clone(&m));
        Ok(m)
    }
}

impl ShmSender {
    async fn copy_pairs(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        src: &Arc<KvArena>,
        pairs: &[(u32, u32)],
    ) -> Result<u32, KvTransferError> {
        let m = self.open(&region.address).await?;
        let g = m.geometry;
        if src.layout() != g.layout {
            return Err(shm_err(
                "write",
                format!(
                    "KV layout mismatch: receiver has {:?}, this worker has {:?}",
                    g.layout,
                    src.layout()
                ),
            ));
        }
        if let Some((_, d)) = pairs.iter().find(|(_, d)| *d as usize >= g.num_blocks) {
            return Err(shm_err(
                "write",
                format!("block {d} is outside an arena of {} blocks", g.num_blocks),
            ));
        }
        let checksums = region.checksums;
        // Large copies leave the runtime's threads alone.
        if pairs.len() >= crate::BLOCKING_COPY_BLOCKS {
            let (id, src, pairs) = (transfer_id.to_string(), Arc::clone(src), pairs.to_vec());
            tokio::task::spawn_blocking(move || write_pairs(&m, &id, &src, &pairs, checksums))
                .await
                .map_err(shm_failed("write task"))?
        } else {
            write_pairs(&m, transfer_id, src, pairs, checksums)
        }
    }
}

/// Writes one block of transfer `transfer_id` (tag `tag`) into destination
/// block `dst` from `parts`, its parts in slab order.
fn write_one<'a>(
    m: &Mapped,
    transfer_id: &str,
    tag: u64,
    dst: u32,
    checksum: u64,
    parts: impl Iterator<Item = &'a [u8]>,
) -> Result<(), KvTransferError> {
    let g = &m.geometry;
    let base = m.map.as_mut_ptr();
    let chunk = g.chunk_bytes();
    // SAFETY: `dst` was checked against the geometry by the caller; the
    // mapping lives in `m`.
    let c = unsafe { control(base, g, dst) };
    c[STATE].fetch_add(WRITING, Ordering::SeqCst);
    let result = if c[TAG].load(Ordering::SeqCst) != tag {
        Err(shm_err(
            "write",
            format!(
                "transfer {transfer_id} no longer expects block {dst} (cancelled or timed out)"
            ),
        ))
    } else {
        let mut written = 0;
        for (slab, src) in parts.take(g.slabs()).enumerate() {
            if src.len() != chunk {
                break;
            }
            // SAFETY: the part lies within the mapping (id checked, slab below
            // the slab count, one chunk long); the receiver armed this block
            // for this transfer and cannot reuse it while we are inside (see
            // the module docs).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    base.add(g.chunk_offset(slab, dst)),
                    chunk,
                )
            };
            written += 1;
        }
        if written == g.slabs() {
            c[CHECKSUM].store(checksum, Ordering::Relaxed);
            c[STATE].fetch_or(WRITTEN, Ordering::Release);
            Ok(())
        } else {
            Err(shm_err(
                "write",
                format!("block {dst}: its parts do not match the arena's layout"),
            ))
        }
    };
    c[STATE].fetch_sub(WRITING, Ordering::SeqCst);
    result
}

/// Writes `blocks` of `transfer_id` into the mapped arena.
fn write_blocks(m: &Mapped, transfer_id: &str, blocks: &[Block]) -> Result<u32, KvTransferError> {
    let tag = tag_of(transfer_id);
    let chunk = m.geometry.chunk_bytes();
    for b in blocks {
        write_one(
            m,
            transfer_id,
            tag,
            b.id,
            b.checksum,
            b.data.chunks_exact(chunk),
        )?;
    }
    Ok(blocks.len() as u32)
}

/// Copies `(source, destination)` block pairs from the sender engine's KV
/// memory `src` straight into the mapped arena, checksumming each block's
/// parts just before its copy when `checksums` (they are in cache then).
fn write_pairs(
    m: &Mapped,
    transfer_id: &str,
    src: &KvArena,
    pairs: &[(u32, u32)],
    checksums: bool,
) -> Result<u32, KvTransferError> {
    let tag = tag_of(transfer_id);
    for &(s, d) in pairs {
        // SAFETY: the source blocks belong to a finished prefill the sender
        // engine holds for this transfer: nobody writes them meanwhile.
        let parts = unsafe { src.block_parts(s) }.map_err(shm_failed("source"))?;
        let checksum = if checksums {
            let mut h = Xxh3::new();
            parts.clone().for_each(|p| h.update(p));
            h.digest()
        } else {
            0
        };
        write_one(m, transfer_id, tag, d, checksum, parts)?;
    }
    Ok(pairs.len() as u32)
}

#[tonic::async_trait]
impl KvSender for ShmSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn needs_checksums(&self, region: &pb::Region) -> bool {
        region.checksums
    }

    /// Only arenas whose receiver's socket is reachable from here (same
    /// host, same network namespace).
    fn accepts(&self, region: &pb::Region) -> bool {
        parse_address(&region.address).is_some_and(|(name, _)| {
            self.mapped
                .lock()
                .get(&region.address)
                .is_some_and(|m| m.receiver_alive())
                || connect(name).is_ok()
        })
    }

    async fn write_from(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        src: &Arc<KvArena>,
        pairs: &[(u32, u32)],
    ) -> Option<Result<u32, KvTransferError>> {
        Some(self.copy_pairs(region, transfer_id, src, pairs).await)
    }

    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, KvTransferError> {
        let m = self.open(&region.address).await?;
        let g = m.geometry;
        if let Some(b) = blocks
            .iter()
            .find(|b| b.id as usize >= g.num_blocks || b.data.len() != g.layout.block_bytes())
        {
            return Err(shm_err(
                "write",
                format!(
                    "block {} ({} bytes) does not fit an arena of {} blocks of {} bytes",
                    b.id,
                    b.data.len(),
                    g.num_blocks,
                    g.layout.block_bytes()
                ),
            ));
        }
        // Large copies leave the runtime's threads alone; the blocks are
        // freed after the answer is out (unmapping hundreds of buffers
        // takes as long as copying them).
        if blocks.len() >= crate::BLOCKING_COPY_BLOCKS {
            let id = transfer_id.to_string();
            let (tx, rx) = tokio::sync::oneshot::channel();
            tokio::task::spawn_blocking(move || {
                let _ = tx.send(write_blocks(&m, &id, &blocks));
                drop(blocks);
            });
            rx.await.map_err(shm_failed("write task"))?
        } else {
            write_blocks(&m, transfer_id, &blocks)
        }
    }
}
