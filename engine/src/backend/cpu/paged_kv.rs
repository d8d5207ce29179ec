//! The CPU backend's KV memory: per layer, one K slab and one V slab of
//! shape `[num_blocks, block_size, num_kv_heads, head_dim]` f32.
//!
//! Owns slot addressing (position → block through a block table → slot) and
//! the serialised form of one block used by KV transfers. It never decides
//! which block ids are free: the block pool does.
//!
//! Serialised block (see [`crate::backend::KvBlockLayout`]): for each layer
//! in order, the block's K then its V, each `[block_size, num_kv_heads,
//! head_dim]` row-major little-endian f32. Total
//! `2 · num_layers · block_size · num_kv_heads · head_dim · 4` bytes.

use crate::backend::KvBlockLayout;
use crate::error::EngineError;

/// Offset in a slab of the token at `pos`, for a sequence's `block_table`.
#[inline]
pub(crate) fn slot_offset(layout: &KvBlockLayout, block_table: &[u32], pos: usize) -> usize {
    let bs = layout.block_size;
    (block_table[pos / bs] as usize * bs + pos % bs) * layout.num_kv_heads * layout.head_dim
}

/// K and V slabs of every layer.
#[derive(Debug)]
pub(crate) struct PagedKv {
    pub(crate) layout: KvBlockLayout,
    pub(crate) num_blocks: usize,
    /// `k[layer]` is `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub(crate) k: Vec<Vec<f32>>,
    pub(crate) v: Vec<Vec<f32>>,
}

impl PagedKv {
    pub(crate) fn new(layout: KvBlockLayout, num_blocks: usize) -> Self {
        let per_layer = num_blocks * layout.block_size * layout.num_kv_heads * layout.head_dim;
        PagedKv {
            layout,
            num_blocks,
            k: (0..layout.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
            v: (0..layout.num_layers)
                .map(|_| vec![0.0; per_layer])
                .collect(),
        }
    }

    /// f32 elements of one token's K (or V) across all kv heads.
    fn token_elems(&self) -> usize {
        self.layout.num_kv_heads * self.layout.head_dim
    }

    /// f32 elements of one block's K (or V) in one layer.
    fn block_elems(&self) -> usize {
        self.layout.block_size * self.token_elems()
    }

    fn check_block(&self, id: u32, data_len: usize) -> Result<std::ops::Range<usize>, EngineError> {
        if id as usize >= self.num_blocks {
            return Err(EngineError::BlockOutOfRange {
                id,
                num_blocks: self.num_blocks,
            });
        }
        let expected = self.layout.block_bytes();
        if data_len != expected {
            return Err(EngineError::BlockSize {
                expected,
                actual: data_len,
            });
        }
        let n = self.block_elems();
        let start = id as usize * n;
        Ok(start..start + n)
    }

    /// Serialises block `id` into `out` (layout in the module docs).
    pub(crate) fn read_block(&self, id: u32, out: &mut [u8]) -> Result<(), EngineError> {
        let range = self.check_block(id, out.len())?;
        let parts = self
            .k
            .iter()
            .zip(&self.v)
            .flat_map(|(k, v)| [&k[range.clone()], &v[range.clone()]]);
        let mut bytes = out.chunks_exact_mut(4);
        for part in parts {
            for (x, b) in part.iter().zip(&mut bytes) {
                b.copy_from_slice(&x.to_le_bytes());
            }
        }
        Ok(())
    }

    /// Overwrites block `id` from `data` (layout in the module docs).
    pub(crate) fn write_block(&mut self, id: u32, data: &[u8]) -> Result<(), EngineError> {
        let range = self.check_block(id, data.len())?;
        let mut bytes = data.chunks_exact(4);
        for (k, v) in self.k.iter_mut().zip(self.v.iter_mut()) {
            for part in [&mut k[range.clone()], &mut v[range.clone()]] {
                for (x, b) in part.iter_mut().zip(&mut bytes) {
                    *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvBlockLayout {
        KvBlockLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 3,
            elem_bytes: 4,
        }
    }

    #[test]
    fn block_round_trips_and_leaves_other_blocks_alone() {
        let mut kv = PagedKv::new(layout(), 4);
        let bytes = layout().block_bytes();
        let data: Vec<u8> = (0..bytes / 4)
            .flat_map(|i| (i as f32).to_le_bytes())
            .collect();
        kv.write_block(2, &data).expect("write");
        let mut back = vec![0u8; bytes];
        kv.read_block(2, &mut back).expect("read");
        assert_eq!(back, data);
        kv.read_block(1, &mut back).expect("read");
        assert!(back.iter().all(|b| *b == 0));
        // Layer 0's K comes first, then layer 0's V: element 24 is V's first.
        let n = 3 * 2 * 4;
        assert_eq!(kv.k[0][2 * n], 0.0);
        assert_eq!(kv.v[0][2 * n], n as f32);
        assert_eq!(kv.k[1][2 * n], (2 * n) as f32);
    }

    #[test]
    fn out_of_range_block_and_wrong_size_are_refused() {
        let mut kv = PagedKv::new(layout(), 4);
        let mut buf = vec![0u8; layout().block_bytes()];
        assert!(matches!(
            kv.read_block(4, &mut buf),
            Err(EngineError::BlockOutOfRange {
                id: 4,
                num_blocks: 4
            })
        ));
        assert!(matches!(
            kv.write_block(0, &buf[1..]),
            Err(EngineError::BlockSize { .. })
        ));
    }

    #[test]
    fn slot_offset_follows_the_block_table() {
        let table = [3, 0];
        assert_eq!(slot_offset(&layout(), &table, 0), 3 * 3 * 8);
        assert_eq!(slot_offset(&layout(), &table, 4), 8);
    }
}
