//! The `shm` transport: same host, one-sided writes into shared memory (the
//! RDMA model without the NIC).
//!
//! A decode worker creates one pool file under `/dev/shm` (the temp dir
//! where there is none) when a prefill worker on its host first needs it,
//! fills it with zeros through `write(2)` — so a full tmpfs is a clean
//! refusal (shm is then not offered) instead of a `SIGBUS` later — and maps it.
//! The file is a header page, a table with one 32-byte entry per slot (tag =
//! XXH3 of the transfer id, checksum, destination block id, state), then the
//! slots, `block_bytes` each. A transfer gets a contiguous run of free slots
//! (its region: the file path, the byte offset and length of the run); the
//! prefill worker maps the file once, copies each block into its slot, then
//! fills the slot's entry and publishes it (`state = 1`, release order). When
//! the `Prefill` response says the blocks are written, the receiver copies
//! each slot out, refusing entries of another transfer, another block or a
//! wrong checksum, and hands the blocks to the engine. Entries are cleared
//! when a run is handed out, so stale bytes of an earlier transfer never pass.
//! The run is freed when the transfer ends, successful or not; the file is
//! removed when the worker stops, and files left by dead processes are
//! removed at start-up.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use memmap2::MmapRaw;
use parking_lot::Mutex;
use sluice_proto::kv::v1 as pb;
use xxhash_rust::xxh3::xxh3_64;

use super::{Block, Inbound, KvSender, Registration, Staged, TransferSpec, TransportKind};
use crate::error::WorkerError;

const MAGIC: u64 = u64::from_le_bytes(*b"SLKVSHM1");
const VERSION: u32 = 1;
const PAGE: usize = 4096;
const ENTRY: usize = 32;
const FILE_PREFIX: &str = "sluice-kv-";
/// Slots start half a page past a page boundary. Block buffers from the
/// allocator usually sit 16 bytes past one (their own mapping), and copying
/// to a destination a few bytes ahead of its source within a page is
/// pathologically slow with `rep movsb` (4K aliasing: 2 GB/s instead of 20+
/// measured here); half a page apart it runs at full speed.
const SLOT_SKEW: usize = PAGE / 2;
/// Mapped pool files a sender keeps open.
const MAX_MAPPED: usize = 16;

/// Where pool files live: `/dev/shm` when present.
pub fn shm_dir() -> PathBuf {
    let dev_shm = Path::new("/dev/shm");
    if dev_shm.is_dir() {
        dev_shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn shm_err(what: &str, e: impl std::fmt::Display) -> WorkerError {
    WorkerError::Transfer(format!("shm {what}: {e}"))
}

/// A mapped pool file and its geometry.
#[derive(Debug)]
struct Mapped {
    map: MmapRaw,
    block_bytes: usize,
    slots: usize,
    table_off: usize,
    data_off: usize,
}

impl Mapped {
    fn ptr(&self, off: usize, len: usize) -> *mut u8 {
        assert!(off + len <= self.map.len(), "shm access within the map");
        // SAFETY: `off + len` lies within the mapping (checked above).
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    fn read_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        // SAFETY: 8 bytes within the mapping; plain bytes, any value is valid.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(off, 8), b.as_mut_ptr(), 8) };
        u64::from_le_bytes(b)
    }

    fn write_u64(&self, off: usize, v: u64) {
        // SAFETY: 8 bytes within the mapping.
        unsafe { std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), self.ptr(off, 8), 8) };
    }

    fn read_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        // SAFETY: 4 bytes within the mapping; plain bytes, any value is valid.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(off, 4), b.as_mut_ptr(), 4) };
        u32::from_le_bytes(b)
    }

    fn write_u32(&self, off: usize, v: u32) {
        // SAFETY: 4 bytes within the mapping.
        unsafe { std::ptr::copy_nonoverlapping(v.to_le_bytes().as_ptr(), self.ptr(off, 4), 4) };
    }

    fn state(&self, slot: usize) -> &AtomicU32 {
        let off = self.table_off + slot * ENTRY + 20;
        // SAFETY: in the mapping, 4-byte aligned (page-aligned map, table at a
        // page boundary, 32-byte entries); the memory lives as long as `self`.
        unsafe { &*(self.ptr(off, 4) as *const AtomicU32) }
    }

    /// Reads and checks the header of a mapped pool file.
    fn open(map: MmapRaw) -> Result<Self, WorkerError> {
        if map.len() < PAGE {
            return Err(shm_err("pool", "file too small"));
        }
        let mut m = Self {
            map,
            block_bytes: 0,
            slots: 0,
            table_off: 0,
            data_off: 0,
        };
        if m.read_u64(0) != MAGIC || m.read_u64(8) as u32 != VERSION {
            return Err(shm_err("pool", "not a Sluice KV pool file"));
        }
        m.block_bytes = m.read_u64(16) as usize;
        m.slots = m.read_u64(24) as usize;
        m.table_off = m.read_u64(32) as usize;
        m.data_off = m.read_u64(40) as usize;
        let need = m
            .slots
            .checked_mul(m.block_bytes)
            .and_then(|d| d.checked_add(m.data_off));
        if m.block_bytes == 0
            || m.table_off < PAGE
            || m.data_off < m.table_off + m.slots * ENTRY
            || need.is_none_or(|n| n > m.map.len())
        {
            return Err(shm_err("pool", "inconsistent header"));
        }
        Ok(m)
    }

    /// The slot run a region names.
    fn run(&self, region: &pb::Region) -> Result<(usize, usize), WorkerError> {
        let (base, len) = (region.base_addr as usize, region.length as usize);
        if base < self.data_off
            || !(base - self.data_off).is_multiple_of(self.block_bytes)
            || !len.is_multiple_of(self.block_bytes)
        {
            return Err(shm_err("region", "not aligned to the pool's slots"));
        }
        let first = (base - self.data_off) / self.block_bytes;
        let n = len / self.block_bytes;
        if first + n > self.slots {
            return Err(shm_err("region", "beyond the pool"));
        }
        Ok((first, n))
    }
}

/// A decode worker's shared-memory pool.
#[derive(Debug)]
struct Pool {
    path: PathBuf,
    mapped: Mapped,
    /// Which slots a transfer holds.
    used: Mutex<Vec<bool>>,
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Pool {
    /// First-fit run of `n` free slots, marked used.
    fn take(&self, n: usize) -> Option<usize> {
        let mut used = self.used.lock();
        let mut start = 0;
        while start + n <= used.len() {
            match used[start..start + n].iter().rposition(|u| *u) {
                Some(busy) => start += busy + 1,
                None => {
                    used[start..start + n].iter_mut().for_each(|u| *u = true);
                    return Some(start);
                }
            }
        }
        None
    }

    fn give_back(&self, first: usize, n: usize) {
        let mut used = self.used.lock();
        used[first..first + n].iter_mut().for_each(|u| *u = false);
    }
}

/// The `shm` side of a decode worker: one pool, runs handed out per
/// transfer. The pool is created when a transfer from this host first needs
/// it, so a worker that never meets a same-host prefill worker holds no
/// shared memory; if creation fails, `shm` is not offered from then on.
#[derive(Debug)]
pub struct ShmInbound {
    dir: PathBuf,
    slots: usize,
    block_bytes: usize,
    pool: OnceLock<Option<Arc<Pool>>>,
}

impl ShmInbound {
    /// A pool of `min(pool_bytes / block_bytes, num_blocks)` slots under
    /// [`shm_dir`], created on first use.
    pub fn lazy(
        pool_bytes: u64,
        block_bytes: usize,
        num_blocks: usize,
    ) -> Result<Self, WorkerError> {
        Self::lazy_in(&shm_dir(), pool_bytes, block_bytes, num_blocks)
    }

    /// [`ShmInbound::lazy`] in `dir`.
    pub fn lazy_in(
        dir: &Path,
        pool_bytes: u64,
        block_bytes: usize,
        num_blocks: usize,
    ) -> Result<Self, WorkerError> {
        if block_bytes == 0 {
            return Err(shm_err("pool", "zero-sized blocks"));
        }
        let slots = ((pool_bytes / block_bytes as u64) as usize).min(num_blocks);
        if slots == 0 {
            return Err(shm_err(
                "pool",
                format!("--kv-shm-pool-mb holds no {block_bytes}-byte block"),
            ));
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            slots,
            block_bytes,
            pool: OnceLock::new(),
        })
    }

    /// [`ShmInbound::lazy_in`], with the pool created now.
    pub fn create_in(
        dir: &Path,
        pool_bytes: u64,
        block_bytes: usize,
        num_blocks: usize,
    ) -> Result<Self, WorkerError> {
        let s = Self::lazy_in(dir, pool_bytes, block_bytes, num_blocks)?;
        let pool = Pool::create(&s.dir, s.slots, s.block_bytes)?;
        let _ = s.pool.set(Some(Arc::new(pool)));
        Ok(s)
    }

    fn pool(&self) -> Option<&Arc<Pool>> {
        self.pool
            .get_or_init(|| match Pool::create(&self.dir, self.slots, self.block_bytes) {
                Ok(p) => Some(Arc::new(p)),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot create the KV shm pool; not offering shm");
                    None
                }
            })
            .as_ref()
    }

    /// The pool file, once created.
    pub fn path(&self) -> Option<&Path> {
        self.pool.get()?.as_ref().map(|p| p.path.as_path())
    }

    /// Slots not held by a transfer.
    pub fn free_slots(&self) -> usize {
        match self.pool.get() {
            Some(Some(p)) => p.used.lock().iter().filter(|u| !**u).count(),
            _ => self.slots,
        }
    }
}

impl Pool {
    /// Creates, reserves and maps a pool file of `slots` slots in `dir`.
    fn create(dir: &Path, slots: usize, block_bytes: usize) -> Result<Self, WorkerError> {
        remove_stale(dir);
        let table_off = PAGE;
        let data_off = (table_off + slots * ENTRY).div_ceil(PAGE) * PAGE + SLOT_SKEW;
        let len = data_off + slots * block_bytes;
        let path = dir.join(format!(
            "{FILE_PREFIX}{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| shm_err(&format!("create {}", path.display()), e))?;
        // From here on the file is removed on every exit path.
        let cleanup = RemoveOnDrop(path.clone());
        fill_zeros(&mut file, len)
            .map_err(|e| shm_err(&format!("reserve {len} bytes in {}", path.display()), e))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| shm_err("map", e))?;
        let mapped = Mapped {
            map,
            block_bytes,
            slots,
            table_off,
            data_off,
        };
        for (i, v) in [
            MAGIC,
            u64::from(VERSION),
            block_bytes as u64,
            slots as u64,
            table_off as u64,
            data_off as u64,
        ]
        .into_iter()
        .enumerate()
        {
            mapped.write_u64(i * 8, v);
        }
        std::mem::forget(cleanup);
        tracing::info!(path = %path.display(), slots, block_bytes, "KV shm pool ready");
        Ok(Pool {
            path,
            mapped,
            used: Mutex::new(vec![false; slots]),
        })
    }
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn fill_zeros(file: &mut File, len: usize) -> std::io::Result<()> {
    let zeros = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let n = left.min(zeros.len());
        file.write_all(&zeros[..n])?;
        left -= n;
    }
    file.flush()
}

/// Removes pool files whose creating process is gone (Linux: no `/proc/<pid>`).
fn remove_stale(dir: &Path) {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(FILE_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!(path = %entry.path().display(), "removing a KV shm pool left by a dead process");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

impl Inbound for ShmInbound {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    fn register(&self, spec: &TransferSpec<'_>) -> Result<Option<Registration>, WorkerError> {
        if !spec.same_host {
            return Ok(None);
        }
        let Some(pool) = self.pool() else {
            return Ok(None);
        };
        let m = &pool.mapped;
        if spec.block_bytes != m.block_bytes {
            return Err(shm_err(
                "register",
                format!(
                    "{}-byte blocks in a pool of {}-byte slots",
                    spec.block_bytes, m.block_bytes
                ),
            ));
        }
        let n = spec.blocks;
        let Some(first) = pool.take(n) else {
            tracing::debug!(blocks = n, "KV shm pool has no free run; not offering shm");
            return Ok(None);
        };
        for slot in first..first + n {
            m.state(slot).store(0, Ordering::Relaxed);
            m.write_u64(m.table_off + slot * ENTRY, 0);
        }
        Ok(Some(Registration {
            region: pb::Region {
                transport: pb::Transport::Shm as i32,
                address: pool.path.to_string_lossy().into_owned(),
                rkey: 0,
                base_addr: (m.data_off + first * m.block_bytes) as u64,
                length: (n * m.block_bytes) as u64,
            },
            staged: Some(Arc::new(ShmRun {
                pool: Arc::clone(pool),
                first,
                n,
                tag: xxh3_64(spec.id.as_bytes()),
                transfer: spec.id.to_string(),
            })),
        }))
    }
}

/// One transfer's run of slots; freed when dropped.
#[derive(Debug)]
struct ShmRun {
    pool: Arc<Pool>,
    first: usize,
    n: usize,
    tag: u64,
    transfer: String,
}

impl Drop for ShmRun {
    fn drop(&mut self) {
        self.pool.give_back(self.first, self.n);
    }
}

impl Staged for ShmRun {
    fn collect(&self, first: usize, ids: &[u32]) -> Result<Vec<Block>, WorkerError> {
        let m = &self.pool.mapped;
        if first + ids.len() > self.n {
            return Err(shm_err(
                "collect",
                format!(
                    "blocks {first}..{} of a run of {}",
                    first + ids.len(),
                    self.n
                ),
            ));
        }
        let mut out = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let slot = self.first + first + i;
            let entry = m.table_off + slot * ENTRY;
            if m.state(slot).load(Ordering::Acquire) != 1 {
                return Err(shm_err("collect", format!("block {id} was not written")));
            }
            let tag = m.read_u64(entry);
            let checksum = m.read_u64(entry + 8);
            let written_id = m.read_u32(entry + 16);
            if tag != self.tag || written_id != id {
                return Err(shm_err(
                    "collect",
                    format!("slot {slot} holds another transfer's block (wanted block {id})"),
                ));
            }
            let mut data = Vec::with_capacity(m.block_bytes);
            // SAFETY: the slot lies within the mapping (the run was checked
            // against the pool at registration); `data` has the capacity and
            // is set to the length just written. The bytes are copied before
            // they are checked, so a concurrent writer cannot change what is
            // verified.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    m.ptr(m.data_off + slot * m.block_bytes, m.block_bytes),
                    data.as_mut_ptr(),
                    m.block_bytes,
                );
                data.set_len(m.block_bytes);
            }
            let block = Block { id, checksum, data };
            super::verify(&self.transfer, std::slice::from_ref(&block))?;
            out.push(block);
        }
        Ok(out)
    }
}

/// Writes into pool files on this host; keeps each file mapped.
#[derive(Debug, Default)]
pub struct ShmSender {
    mapped: Mutex<HashMap<String, Arc<Mapped>>>,
}

impl ShmSender {
    fn open(&self, path: &str) -> Result<Arc<Mapped>, WorkerError> {
        if let Some(m) = self.mapped.lock().get(path) {
            return Ok(Arc::clone(m));
        }
        if !is_pool_path(path) {
            return Err(shm_err("open", format!("{path} is not a KV pool file")));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| shm_err(&format!("open {path}"), e))?;
        let map = memmap2::MmapOptions::new()
            .populate()
            .map_raw(&file)
            .map_err(|e| shm_err("map", e))?;
        let m = Arc::new(Mapped::open(map)?);
        let mut cache = self.mapped.lock();
        if cache.len() >= MAX_MAPPED {
            cache.clear();
        }
        cache.insert(path.to_string(), Arc::clone(&m));
        Ok(m)
    }
}

fn is_pool_path(path: &str) -> bool {
    Path::new(path)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(FILE_PREFIX))
}

#[tonic::async_trait]
impl KvSender for ShmSender {
    fn kind(&self) -> TransportKind {
        TransportKind::Shm
    }

    /// Only pool files visible on this host.
    fn accepts(&self, region: &pb::Region) -> bool {
        is_pool_path(&region.address)
            && (self.mapped.lock().contains_key(&region.address)
                || Path::new(&region.address).is_file())
    }

    async fn write(
        &self,
        region: &pb::Region,
        transfer_id: &str,
        blocks: Vec<Block>,
    ) -> Result<u32, WorkerError> {
        let m = self.open(&region.address)?;
        let (first, n) = m.run(region)?;
        if blocks.len() > n {
            return Err(shm_err(
                "write",
                format!("{} blocks for a run of {n}", blocks.len()),
            ));
        }
        if let Some(b) = blocks.iter().find(|b| b.data.len() != m.block_bytes) {
            return Err(shm_err(
                "write",
                format!(
                    "block {} has {} bytes, the pool's slots {}",
                    b.id,
                    b.data.len(),
                    m.block_bytes
                ),
            ));
        }
        let tag = xxh3_64(transfer_id.as_bytes());
        // Large copies leave the runtime's threads alone.
        let m2 = Arc::clone(&m);
        let write = move || {
            for (i, b) in blocks.iter().enumerate() {
                let slot = first + i;
                // SAFETY: the run is within the pool (checked by `run`), each
                // block is exactly one slot long (checked above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        b.data.as_ptr(),
                        m2.ptr(m2.data_off + slot * m2.block_bytes, m2.block_bytes),
                        m2.block_bytes,
                    );
                }
                let entry = m2.table_off + slot * ENTRY;
                m2.write_u64(entry, tag);
                m2.write_u64(entry + 8, b.checksum);
                m2.write_u32(entry + 16, b.id);
                m2.state(slot).store(1, Ordering::Release);
            }
            blocks.len() as u32
        };
        if n >= super::BLOCKING_COPY_BLOCKS {
            tokio::task::spawn_blocking(write)
                .await
                .map_err(|e| shm_err("write task", e))
        } else {
            Ok(write())
        }
    }
}
