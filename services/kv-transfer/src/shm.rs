//! The `shm` transport: same host, one-sided writes straight into the decode
//! engine's KV memory (the RDMA model without the NIC).
//!
//! A decode worker that offers `shm` keeps its KV memory in a shared file
//! ([`KvArena`] with [`sluice_engine::backend::KvBacking::Shared`], under
//! `/dev/shm`). Its region names that file; the prefill worker maps it once,
//! reads the geometry from its header and copies each block's `2·layers`
//! parts into the destination block's place in the slabs — one copy, from
//! the sender's memory into the engine's, no staging buffer, no round trip
//! through the decode engine's thread.
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
use std::fs::OpenOptions;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use parking_lot::Mutex;
use sluice_engine::backend::{ArenaGeometry, KvArena, arena};
use sluice_proto::kv::v1 as pb;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::{
    Block, Inbound, KvSender, KvTransferError, OneSided, Registration, TransferSpec, TransportKind,
};

/// Mapped arena files a sender keeps open.
const MAX_MAPPED: usize = 16;
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

/// The `shm` side of a decode worker: offers the engine's KV file to
/// senders on this host.
#[derive(Debug, Default)]
pub struct ShmInbound {
    /// Whether senders record checksums and completion verifies them.
    pub checksums: bool,
}

impl Inbound for ShmInbound {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, KvTransferError> {
        if !spec.same_host {
            return Ok(None);
        }
        let Some(arena) = spec.arena.filter(|a| a.path().is_some()) else {
            return Ok(None);
        };
        let tag = tag_of(spec.id);
        for &id in spec.writable {
            let c = arena.control(id)?;
            c[STATE].store(0, Ordering::SeqCst);
            c[CHECKSUM].store(0, Ordering::Relaxed);
            c[TAG].store(tag, Ordering::SeqCst);
        }
        let path = arena.path().map(|p| p.to_string_lossy().into_owned());
        Ok(Some(Registration {
            region: pb::Region {
                transport: pb::Transport::Shm as i32,
                address: path.unwrap_or_default(),
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

/// A mapped arena file and its geometry.
#[derive(Debug)]
struct Mapped {
    map: MmapRaw,
    geometry: ArenaGeometry,
}

// The geometry is read once; the mapping is shared memory written only
// through raw pointers and atomics.

/// Writes into decode engines' KV files on this host; keeps each mapped.
#[derive(Debug, Default)]
pub struct ShmSender {
    mapped: Mutex<HashMap<String, Arc<Mapped>>>,
}

impl ShmSender {
    async fn copy_pairs(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        src: &Arc<KvArena>,
        pairs: &[(u32, u32)],
    ) -> Result<u32, KvTransferError> {
        let m = self.open(&region.address)?;
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

fn is_arena_path(path: &str) -> bool {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("sluice-kv-"))
}

impl ShmSender {
    fn open(&self, path: &str) -> Result<Arc<Mapped>, KvTransferError> {
        if let Some(m) = self.mapped.lock().get(path) {
            return Ok(Arc::clone(m));
        }
        if !is_arena_path(path) {
            return Err(shm_err("open", format!("{path} is not a KV arena file")));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(shm_failed(format!("open {path}")))?;
        let map = MmapRaw::map_raw(&file).map_err(shm_failed(format!("map {path}")))?;
        if map.len() < arena::HEADER_BYTES {
            return Err(shm_err("open", format!("{path} is too short")));
        }
        // SAFETY: the header lies within the mapping; plain bytes.
        let header = unsafe { std::slice::from_raw_parts(map.as_ptr(), arena::HEADER_BYTES) };
        let geometry = ArenaGeometry::from_header(header, map.len())
            .map_err(shm_failed(format!("header of {path}")))?;
        let m = Arc::new(Mapped { map, geometry });
        let mut cache = self.mapped.lock();
        // A mapping keeps a removed file's memory alive: let go of the
        // arenas of decode workers that have gone.
        cache.retain(|p, _| Path::new(p).exists());
        if cache.len() >= MAX_MAPPED {
            cache.clear();
        }
        cache.insert(path.to_string(), Arc::clone(&m));
        Ok(m)
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

    /// Only arena files visible on this host.
    fn accepts(&self, region: &pb::Region) -> bool {
        is_arena_path(&region.address)
            && (self.mapped.lock().contains_key(&region.address)
                || Path::new(&region.address).is_file())
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
        let m = self.open(&region.address)?;
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
