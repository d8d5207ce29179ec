//! KV memory a backend computes in and KV transports write into: one
//! mapping holding, per layer, a K slab and a V slab of
//! `[num_blocks, block_size, num_kv_heads, head_dim]` elements.
//!
//! This is the memory a transport *registers* (NIXL's model): a one-sided
//! transport (`shm`, `rdma`) writes a remote prefill's blocks straight into
//! the blocks a decode engine reserved for them, and a streamed one (`tcp`,
//! `grpc`) copies each received block there, without a round trip through
//! the engine thread. Correctness rests on block ownership, not on locks:
//! the engine never reads or writes a reserved block until its slot is
//! committed (after the transfer ended), and a transport writes only the
//! blocks of a transfer that is still registered (see
//! [`KvArena::control`]).
//!
//! Two backings. [`KvBacking::Private`]: an anonymous mapping (pages are
//! committed as they are first touched). [`KvBacking::Shared`]: a memory
//! file with no name (`memfd_create`), reserved in full with
//! `posix_fallocate` — so a full memory limit is a clean error at start-up
//! instead of a `SIGBUS` later — whose descriptor a transport hands to a
//! prefill worker on the same host ([`KvArena::shared_fd`]) to map and write
//! into. Nothing of it is in any directory: however the process ends, even
//! by `kill -9`, the kernel frees the memory once the last mapping of it
//! goes, and no `/dev/shm` size limit applies.
//!
//! Layout (both backings; offsets from the mapping's start):
//!
//! | offset | what |
//! |---|---|
//! | 0 | header: [`MAGIC`], version, num_layers, num_kv_heads, head_dim, block_size, elem_bytes, num_blocks, control offset, data offset (u64 LE each) |
//! | control offset (page 1) | four `u64` control words per block, for one-sided transports |
//! | data offset (page aligned) | slab `2·layer + kv` (kv: 0 = K, 1 = V) at `data + slab·num_blocks·chunk`; block `b`'s part at `+ b·chunk`, `chunk = block_size·num_kv_heads·head_dim·elem_bytes` |
//!
//! A block's serialised form (what [`KvArena::read_block`] and
//! [`KvArena::write_block`] exchange and transfers carry) is its `2·layers`
//! chunks in slab order: layer 0's K, layer 0's V, layer 1's K, …

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd};
use std::sync::atomic::AtomicU64;

use memmap2::{MmapOptions, MmapRaw};

use crate::backend::KvBlockLayout;
use crate::error::EngineError;

/// `SLKVARN1`, little-endian.
pub const MAGIC: u64 = u64::from_le_bytes(*b"SLKVARN1");
/// Version of the layout above.
pub const VERSION: u64 = 1;
/// Bytes of the header the geometry is read from.
pub const HEADER_BYTES: usize = 80;
const PAGE: usize = 4096;
/// Where a shared arena's slabs start past a page boundary.
const SHARED_SKEW: usize = PAGE / 2;
/// Control words per block.
pub const CONTROL_WORDS: usize = 4;

/// Where KV memory lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KvBacking {
    /// Anonymous memory of this process.
    #[default]
    Private,
    /// A memory file other processes on the host can map once handed its
    /// descriptor.
    Shared,
}

/// Where everything of an arena lies: computed from a layout and a block
/// count, or read from a shared arena's header by another process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaGeometry {
    pub layout: KvBlockLayout,
    pub num_blocks: usize,
    pub control_offset: usize,
    pub data_offset: usize,
}

impl ArenaGeometry {
    /// The geometry of an arena of `num_blocks` blocks of `layout` whose
    /// slabs start `skew` bytes (less than a page, a multiple of 64) past a
    /// page boundary.
    pub fn new(layout: KvBlockLayout, num_blocks: usize, skew: usize) -> Result<Self, EngineError> {
        if skew >= PAGE || !skew.is_multiple_of(64) {
            return Err(EngineError::InvalidConfig(format!(
                "KV slab skew {skew} must be a multiple of 64 below {PAGE}"
            )));
        }
        if num_blocks == 0 || layout.block_bytes() == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "KV memory needs at least one non-empty block (got {num_blocks} blocks of {} bytes)",
                layout.block_bytes()
            )));
        }
        let control_offset = PAGE;
        let control_bytes = num_blocks * CONTROL_WORDS * 8;
        let data_offset = (control_offset + control_bytes).div_ceil(PAGE) * PAGE + skew;
        let g = Self {
            layout,
            num_blocks,
            control_offset,
            data_offset,
        };
        g.checked_len().ok_or_else(|| {
            EngineError::InvalidConfig(format!(
                "{num_blocks} KV blocks of {} bytes overflow the address space",
                layout.block_bytes()
            ))
        })?;
        Ok(g)
    }

    /// The geometry of an arena of `num_blocks` blocks of `layout` that is
    /// `len` bytes long (what a remote region says), its skew taken from
    /// the length.
    pub fn of_len(layout: KvBlockLayout, num_blocks: usize, len: usize) -> Result<Self, String> {
        let plain = Self::new(layout, num_blocks, 0).map_err(|e| e.to_string())?;
        let skew = len
            .checked_sub(plain.mapping_len())
            .ok_or_else(|| format!("{len} bytes cannot hold {num_blocks} blocks of this layout"))?;
        Self::new(layout, num_blocks, skew).map_err(|_| {
            format!("{len} bytes is not an arena of {num_blocks} blocks of this layout")
        })
    }

    /// How far past a page boundary the slabs start.
    pub fn skew(&self) -> usize {
        self.data_offset % PAGE
    }

    fn checked_len(&self) -> Option<usize> {
        self.num_blocks
            .checked_mul(self.layout.block_bytes())?
            .checked_add(self.data_offset)
    }

    /// Bytes of the whole mapping.
    pub fn mapping_len(&self) -> usize {
        self.data_offset + self.num_blocks * self.layout.block_bytes()
    }

    /// Bytes of one block's part in one slab.
    pub fn chunk_bytes(&self) -> usize {
        self.layout.block_bytes() / self.slabs()
    }

    /// K and V slabs of every layer.
    pub fn slabs(&self) -> usize {
        2 * self.layout.num_layers
    }

    /// Offset of block `block`'s part in slab `slab` (`2·layer + kv`).
    pub fn chunk_offset(&self, slab: usize, block: u32) -> usize {
        debug_assert!(slab < self.slabs() && (block as usize) < self.num_blocks);
        self.data_offset + (slab * self.num_blocks + block as usize) * self.chunk_bytes()
    }

    /// Offset of block `block`'s control words.
    pub fn control_offset_of(&self, block: u32) -> usize {
        self.control_offset + block as usize * CONTROL_WORDS * 8
    }

    /// Refuses a block id outside the arena.
    pub fn check_block(&self, id: u32) -> Result<(), EngineError> {
        if id as usize >= self.num_blocks {
            return Err(EngineError::BlockOutOfRange {
                id,
                num_blocks: self.num_blocks,
            });
        }
        Ok(())
    }

    /// The header's bytes.
    pub fn header(&self) -> [u8; HEADER_BYTES] {
        let l = &self.layout;
        let words = [
            MAGIC,
            VERSION,
            l.num_layers as u64,
            l.num_kv_heads as u64,
            l.head_dim as u64,
            l.block_size as u64,
            l.elem_bytes as u64,
            self.num_blocks as u64,
            self.control_offset as u64,
            self.data_offset as u64,
        ];
        let mut out = [0u8; HEADER_BYTES];
        for (i, w) in words.into_iter().enumerate() {
            out[i * 8..(i + 1) * 8].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// Reads a header (of a mapping `len` bytes long), refusing anything
    /// that is not a consistent arena of this version.
    pub fn from_header(bytes: &[u8], len: usize) -> Result<Self, String> {
        if bytes.len() < HEADER_BYTES {
            return Err("too short for a KV arena header".into());
        }
        let w = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[i * 8..(i + 1) * 8]);
            u64::from_le_bytes(b)
        };
        if w(0) != MAGIC {
            return Err("not a Sluice KV arena (bad magic)".into());
        }
        if w(1) != VERSION {
            return Err(format!(
                "KV arena version {} (this build reads {VERSION})",
                w(1)
            ));
        }
        let layout = KvBlockLayout {
            num_layers: w(2) as usize,
            num_kv_heads: w(3) as usize,
            head_dim: w(4) as usize,
            block_size: w(5) as usize,
            elem_bytes: w(6) as usize,
        };
        let num_blocks = w(7) as usize;
        let expected =
            Self::new(layout, num_blocks, w(9) as usize % PAGE).map_err(|e| e.to_string())?;
        let g = Self {
            layout,
            num_blocks,
            control_offset: w(8) as usize,
            data_offset: w(9) as usize,
        };
        if g != expected || expected.mapping_len() > len {
            return Err("inconsistent KV arena header".into());
        }
        Ok(g)
    }
}

/// One backend's KV memory. See the module docs.
#[derive(Debug)]
pub struct KvArena {
    geometry: ArenaGeometry,
    map: MmapRaw,
    /// The memory file of a shared arena.
    shared: Option<File>,
}

impl KvArena {
    /// Zeroed KV memory for `num_blocks` blocks of `layout`.
    pub fn new(
        layout: KvBlockLayout,
        num_blocks: usize,
        backing: &KvBacking,
    ) -> Result<Self, EngineError> {
        // Shared arenas (written by other processes from their own KV
        // memory, whose slabs start on a page boundary) start half a page
        // off: copies between two buffers at the same offset within a page
        // run ~15% slower here (4K aliasing between loads and stores).
        let skew = match backing {
            KvBacking::Private => 0,
            KvBacking::Shared => SHARED_SKEW,
        };
        let geometry = ArenaGeometry::new(layout, num_blocks, skew)?;
        let len = geometry.mapping_len();
        let (map, shared) = match backing {
            KvBacking::Private => {
                let map = MmapOptions::new().len(len).map_anon().map_err(|e| {
                    EngineError::InvalidConfig(format!("cannot map {len} bytes of KV memory: {e}"))
                })?;
                (MmapRaw::from(map), None)
            }
            KvBacking::Shared => {
                let (map, file) = create_shared(len)?;
                (map, Some(file))
            }
        };
        let arena = Self {
            geometry,
            map,
            shared,
        };
        let header = geometry.header();
        // SAFETY: the mapping is at least a page long and nobody else has
        // seen it yet.
        unsafe {
            std::ptr::copy_nonoverlapping(header.as_ptr(), arena.map.as_mut_ptr(), HEADER_BYTES)
        };
        Ok(arena)
    }

    /// Where everything lies.
    pub fn geometry(&self) -> &ArenaGeometry {
        &self.geometry
    }

    /// The block layout.
    pub fn layout(&self) -> KvBlockLayout {
        self.geometry.layout
    }

    /// Blocks this memory holds.
    pub fn num_blocks(&self) -> usize {
        self.geometry.num_blocks
    }

    /// The memory file other processes map, for a shared arena.
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        self.shared.as_ref().map(File::as_fd)
    }

    /// Start of the mapping (to register it with an RDMA device).
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Bytes of the mapping.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Never: an arena holds at least one block.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The control words of block `id`: a one-sided transport's per-block
    /// protocol state (which transfer may write it, whether it was written,
    /// who is writing now). Atomics, so safe to share with other processes.
    pub fn control(&self, id: u32) -> Result<&[AtomicU64; CONTROL_WORDS], EngineError> {
        self.geometry.check_block(id)?;
        let off = self.geometry.control_offset_of(id);
        // SAFETY: in the mapping (the control area covers every block),
        // 8-byte aligned (page-aligned map and area, 16-byte entries); plain
        // integers, any bit pattern is valid; lives as long as `self`.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const [AtomicU64; CONTROL_WORDS]) })
    }

    /// Start of slab `slab` (`2·layer + kv`) as f32 elements: a raw
    /// pointer, because transports write reserved blocks of the same slab
    /// while the engine computes in others, so no reference may span it.
    /// Only for `elem_bytes == 4` layouts; 4-byte aligned (page-aligned
    /// data, chunk sizes multiples of 4).
    pub(crate) fn slab_ptr_f32(&self, slab: usize) -> *mut f32 {
        debug_assert_eq!(self.geometry.layout.elem_bytes, 4);
        // SAFETY (of the offset): the slab lies in the mapping.
        unsafe {
            self.map
                .as_mut_ptr()
                .add(self.geometry.chunk_offset(slab, 0))
                .cast::<f32>()
        }
    }

    /// Block `id`'s parts in slab order (its serialised form, piecewise),
    /// each `chunk_bytes()` long.
    ///
    /// # Safety
    /// Nobody may write block `id` while the slices live (a KV sender
    /// reading the blocks of a finished prefill the engine holds for it).
    pub unsafe fn block_parts(
        &self,
        id: u32,
    ) -> Result<impl Iterator<Item = &[u8]> + Clone + '_, EngineError> {
        self.geometry.check_block(id)?;
        let g = self.geometry;
        let base = self.map.as_ptr();
        Ok((0..g.slabs()).map(move |slab| {
            // SAFETY: `id` is within the arena (checked above), `slab` below
            // the slab count: the part lies in the mapping; no writer
            // meanwhile (the caller's).
            unsafe {
                std::slice::from_raw_parts(base.add(g.chunk_offset(slab, id)), g.chunk_bytes())
            }
        }))
    }

    fn check_len(&self, len: usize) -> Result<(), EngineError> {
        let expected = self.geometry.layout.block_bytes();
        if len != expected {
            return Err(EngineError::BlockSize {
                expected,
                actual: len,
            });
        }
        Ok(())
    }

    /// Serialises block `id` into `out` (`block_bytes()` long).
    ///
    /// # Safety
    /// As for [`KvArena::block_parts`]: nobody may write block `id`
    /// meanwhile (the caller owns it, or the transfer writing it is done).
    pub unsafe fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.geometry.check_block(id)?;
        self.check_len(out.len())?;
        let chunk = self.geometry.chunk_bytes();
        for (slab, dst) in out.chunks_exact_mut(chunk).enumerate() {
            let off = self.geometry.chunk_offset(slab, id);
            // SAFETY: `off + chunk` lies in the mapping; `dst` is a distinct
            // buffer of `chunk` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), dst.as_mut_ptr(), chunk)
            };
        }
        Ok(())
    }

    /// Overwrites block `id` from its serialised form `data`.
    ///
    /// # Safety
    /// Nobody else may read or write block `id` meanwhile: the caller owns
    /// it (the engine for its sequences' blocks; a transport for the
    /// reserved blocks of a transfer that is still registered).
    pub unsafe fn write_block(&self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        self.geometry.check_block(id)?;
        self.check_len(data.len())?;
        let chunk = self.geometry.chunk_bytes();
        for (slab, src) in data.chunks_exact(chunk).enumerate() {
            let off = self.geometry.chunk_offset(slab, id);
            // SAFETY: `off + chunk` lies in the mapping; exclusivity is the
            // caller's; `src` is not in the mapping's block (distinct memory).
            unsafe {
                std::ptr::copy_nonoverlapping(src.as_ptr(), self.map.as_mut_ptr().add(off), chunk)
            };
        }
        Ok(())
    }
}

/// Creates, reserves and maps a shared arena's memory file of `len` bytes.
fn create_shared(len: usize) -> Result<(MmapRaw, File), EngineError> {
    memory_file(c"sluice-kv", len, true)
        .map_err(|what| EngineError::InvalidConfig(format!("shared KV memory: {what}")))
}

/// Creates and maps a memory file with no name (`memfd_create`, shown as
/// `/memfd:NAME`) of `len` bytes, reserved in full when `reserve` (else
/// its pages are committed as first written). Errors say which step failed.
pub(crate) fn memory_file(
    name: &std::ffi::CStr,
    len: usize,
    reserve: bool,
) -> Result<(MmapRaw, File), String> {
    // SAFETY: a NUL-terminated name and valid flags; the descriptor
    // returned (if any) is new and owned by nobody else.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just created and nothing else owns it.
    let file = unsafe { File::from_raw_fd(fd) };
    if reserve {
        // SAFETY: plain syscall on an open file descriptor.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            return Err(format!(
                "reserve {} MiB: {}",
                len >> 20,
                std::io::Error::from_raw_os_error(rc)
            ));
        }
    } else {
        file.set_len(len as u64)
            .map_err(|e| format!("size {} MiB: {e}", len >> 20))?;
    }
    let map = MmapRaw::map_raw(&file).map_err(|e| format!("map: {e}"))?;
    Ok((map, file))
}

/// A small layout for unit tests: 2 layers, 2 KV heads, head_dim 4, 3-token blocks, f32.
#[cfg(test)]
pub(crate) fn tiny_layout() -> KvBlockLayout {
    KvBlockLayout {
        num_layers: 2,
        num_kv_heads: 2,
        head_dim: 4,
        block_size: 3,
        elem_bytes: 4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvBlockLayout {
        tiny_layout()
    }

    fn pattern(seed: u32) -> Vec<u8> {
        (0..layout().block_bytes() / 4)
            .flat_map(|i| (i as f32 + seed as f32 * 1000.0).to_le_bytes())
            .collect()
    }

    #[test]
    fn blocks_round_trip_and_leave_others_alone() {
        for backing in [KvBacking::Private, KvBacking::Shared] {
            let a = KvArena::new(layout(), 4, &backing).expect("arena");
            let data = pattern(1);
            // SAFETY: the test owns every block.
            unsafe { a.write_block(2, &data) }.expect("write");
            let mut back = vec![0u8; data.len()];
            // SAFETY: this test is the only user of the arena.
            unsafe { a.read_block(2, &mut back) }.expect("read");
            assert_eq!(back, data);
            // SAFETY: as above.
            unsafe { a.read_block(1, &mut back) }.expect("read");
            assert!(back.iter().all(|b| *b == 0));
            // Slab order: layer 0 K (slab 0), layer 0 V (slab 1), …; within a
            // slab, block 2's part follows blocks 0 and 1.
            let n = 3 * 2 * 4;
            // SAFETY: in the mapping; no other view exists.
            unsafe {
                assert_eq!(*a.slab_ptr_f32(0).add(2 * n), 1000.0);
                assert_eq!(*a.slab_ptr_f32(1).add(2 * n), 1000.0 + n as f32);
                assert_eq!(*a.slab_ptr_f32(2).add(2 * n), 1000.0 + (2 * n) as f32);
            }
        }
    }

    #[test]
    fn out_of_range_and_wrong_size_are_refused() {
        let a = KvArena::new(layout(), 4, &KvBacking::Private).expect("arena");
        let mut buf = vec![0u8; layout().block_bytes()];
        assert!(matches!(
            // SAFETY: this test is the only user of the arena.
            unsafe { a.read_block(4, &mut buf) },
            Err(EngineError::BlockOutOfRange {
                id: 4,
                num_blocks: 4
            })
        ));
        // SAFETY: the test owns every block.
        let short = unsafe { a.write_block(0, &buf[1..]) };
        assert!(matches!(short, Err(EngineError::BlockSize { .. })));
        assert!(a.control(4).is_err());
    }

    #[test]
    fn a_shared_arena_is_a_nameless_file_another_mapping_sees_and_reads_the_geometry_of() {
        let a = KvArena::new(layout(), 5, &KvBacking::Shared).expect("arena");
        let fd = a.shared_fd().expect("shared");
        // In no directory: the descriptor names an anonymous memory file.
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).expect("link");
        assert!(
            link.to_string_lossy().starts_with("/memfd:sluice-kv"),
            "{}",
            link.display()
        );
        // Another process maps what it was handed (here: a duplicate).
        let file = File::from(fd.try_clone_to_owned().expect("dup"));
        let other = MmapRaw::map_raw(&file).expect("map");
        // SAFETY: reading the header bytes of a live mapping.
        let header = unsafe { std::slice::from_raw_parts(other.as_ptr(), HEADER_BYTES) };
        let g = ArenaGeometry::from_header(header, other.len()).expect("geometry");
        assert_eq!(&g, a.geometry());
        // A write through the other mapping lands in the arena's block 3.
        let data = pattern(7);
        for (slab, chunk) in data.chunks_exact(g.chunk_bytes()).enumerate() {
            // SAFETY: within the other mapping.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    other.as_mut_ptr().add(g.chunk_offset(slab, 3)),
                    chunk.len(),
                )
            };
        }
        let mut back = vec![0u8; data.len()];
        // SAFETY: this test is the only user of the arena.
        unsafe { a.read_block(3, &mut back) }.expect("read");
        assert_eq!(back, data);
    }

    #[test]
    fn a_corrupt_header_is_refused() {
        let g = ArenaGeometry::new(layout(), 5, 2048).expect("geometry");
        assert_eq!(g.skew(), 2048);
        assert_eq!(ArenaGeometry::of_len(layout(), 5, g.mapping_len()), Ok(g));
        assert!(ArenaGeometry::of_len(layout(), 5, g.mapping_len() + 4096).is_err());
        let mut h = g.header();
        assert!(
            ArenaGeometry::from_header(&h, g.mapping_len() - 1).is_err(),
            "mapping too short"
        );
        h[0] ^= 1;
        assert!(
            ArenaGeometry::from_header(&h, g.mapping_len())
                .expect_err("bad magic")
                .contains("magic")
        );
        let mut h = g.header();
        h[9 * 8] ^= 8;
        assert!(ArenaGeometry::from_header(&h, g.mapping_len()).is_err());
    }
}
