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

use std::sync::Arc;

use crate::backend::{KvArena, KvBacking, KvBlockLayout};
use crate::error::EngineError;

/// Offset in a slab of the token at `pos`, for a sequence's `block_table`.
#[inline]
pub(crate) fn slot_offset(layout: &KvBlockLayout, block_table: &[u32], pos: usize) -> usize {
    let bs = layout.block_size;
    (block_table[pos / bs] as usize * bs + pos % bs) * layout.num_kv_heads * layout.head_dim
}

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

    /// Layer `l`'s K and V slabs.
    ///
    /// The engine thread is the only one that computes: it touches the
    /// blocks of running sequences only, and transports write only reserved
    /// blocks (see [`KvArena`]), so these views never see a write they race.
    pub(crate) fn slabs_mut(&mut self, l: usize) -> (&mut [f32], &mut [f32]) {
        // SAFETY: f32 layout (the CPU backend's); two distinct slabs; `&mut
        // self` keeps other views of this backend away; concurrent transport
        // writes touch only reserved blocks this step does not read.
        unsafe { (self.arena.slab_f32(2 * l), self.arena.slab_f32(2 * l + 1)) }
    }

    /// Serialises block `id` into `out` (layout in the module docs).
    pub(crate) fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        self.arena.read_block(id, out)
    }

    /// Overwrites block `id` from `data` (layout in the module docs).
    pub(crate) fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        // SAFETY: called on the engine thread for a block the engine owns.
        unsafe { self.arena.write_block(id, data) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvBlockLayout {
        crate::backend::arena::tiny_layout()
    }

    #[test]
    fn slot_offset_follows_the_block_table() {
        let table = [3, 0];
        assert_eq!(slot_offset(&layout(), &table, 0), 3 * 3 * 8);
        assert_eq!(slot_offset(&layout(), &table, 4), 8);
    }
}
