//! The CPU backend's KV memory: per layer, one K slab and one V slab of
//! shape `[num_blocks, block_size, num_kv_heads, head_dim]` f32.
//!
//! Owns slot addressing (position → block through a block table → slot);
//! the memory and the serialised form of a block (used by KV transfers) are
//! the [`KvArena`]'s. It never decides which block ids are free: the block
//! pool does.
//!
//! Serialised block (see [`crate::backend::KvBlockLayout`]): for each layer
//! in order, the block's K then its V, each `[block_size, num_kv_heads,
//! head_dim]` row-major little-endian f32. Total
//! `2 · num_layers · block_size · num_kv_heads · head_dim · 4` bytes.

use std::marker::PhantomData;
use std::sync::Arc;

use crate::backend::{KvArena, KvBacking, KvBlockLayout};
use crate::error::EngineError;

/// K and V slabs of every layer, in a [`KvArena`].
#[derive(Debug)]
pub(crate) struct PagedKv {
    pub(crate) layout: KvBlockLayout,
    pub(crate) num_blocks: usize,
    pub(crate) arena: Arc<KvArena>,
}

impl PagedKv {
    pub(crate) fn new(
        layout: KvBlockLayout,
        num_blocks: usize,
        backing: &KvBacking,
    ) -> Result<Self, EngineError> {
        Ok(PagedKv {
            layout,
            num_blocks,
            arena: Arc::new(KvArena::new(layout, num_blocks, backing)?),
        })
    }

    /// Layer `l`'s K and V slabs, lent a block at a time.
    pub(crate) fn slabs_mut(&mut self, l: usize) -> (SlabMut<'_>, SlabMut<'_>) {
        let slab = |s: usize| SlabMut {
            base: self.arena.slab_ptr_f32(s),
            num_blocks: self.num_blocks,
            block_elems: self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim,
            _kv: PhantomData,
        };
        (slab(2 * l), slab(2 * l + 1))
    }

    /// Serialises block `id` into `out` (layout in the module docs).
    pub(crate) fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        // SAFETY: called on the engine thread for a block the engine owns
        // (a sequence's, or a finished prefill's it holds for a sender).
        unsafe { self.arena.read_block(id, out) }
    }

    /// Overwrites block `id` from `data` (layout in the module docs).
    pub(crate) fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        // SAFETY: called on the engine thread for a block the engine owns.
        unsafe { self.arena.write_block(id, data) }
    }
}

/// One layer's K or V slab (`[num_blocks, block_size, num_kv_heads,
/// head_dim]` f32), lent one block at a time.
///
/// Transports write the reserved blocks of the same slab while the engine
/// computes (see [`KvArena`]), so no reference ever spans the slab: a
/// borrow covers one block, and the engine borrows only blocks it owns —
/// those of the running sequences, never a reserved one. `&mut PagedKv`
/// keeps every other engine-side view away while this one lives.
#[derive(Debug)]
pub(crate) struct SlabMut<'a> {
    base: *mut f32,
    num_blocks: usize,
    block_elems: usize,
    _kv: PhantomData<&'a mut PagedKv>,
}

impl SlabMut<'_> {
    /// Block `id`, to write. Panics when `id` is not a block of the slab.
    pub(crate) fn block_mut(&mut self, id: u32) -> &mut [f32] {
        let id = id as usize;
        assert!(id < self.num_blocks, "block {id} of {}", self.num_blocks);
        // SAFETY: in the slab (checked); `&mut self` makes it the only
        // engine-side view; the engine owns the block (type docs).
        unsafe {
            std::slice::from_raw_parts_mut(self.base.add(id * self.block_elems), self.block_elems)
        }
    }

    /// A read-only view to share across the attention threads.
    pub(crate) fn view(&self) -> Slab<'_> {
        Slab {
            base: self.base,
            num_blocks: self.num_blocks,
            block_elems: self.block_elems,
            _kv: PhantomData,
        }
    }
}

/// A read-only [`SlabMut`], lent one block at a time.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Slab<'a> {
    base: *const f32,
    num_blocks: usize,
    block_elems: usize,
    _kv: PhantomData<&'a PagedKv>,
}

// SAFETY: a view of memory the engine owns block by block (see
// `SlabMut`); the attention threads only read blocks of running sequences,
// which nothing writes while the view lives.
unsafe impl Send for Slab<'_> {}
// SAFETY: as above.
unsafe impl Sync for Slab<'_> {}

impl<'a> Slab<'a> {
    /// Block `id`. Panics when `id` is not a block of the slab.
    pub(crate) fn block(&self, id: u32) -> &'a [f32] {
        let id = id as usize;
        assert!(id < self.num_blocks, "block {id} of {}", self.num_blocks);
        // SAFETY: in the slab (checked); only reads, of a block nobody
        // writes while the view lives (type docs).
        unsafe {
            std::slice::from_raw_parts(self.base.add(id * self.block_elems), self.block_elems)
        }
    }
}
