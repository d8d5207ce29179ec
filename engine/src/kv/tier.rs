//! The second KV tier: full blocks evicted from the engine's KV memory,
//! kept by sequence hash in a larger, slower store (host memory) up to a
//! byte budget, and moved back into KV memory on a prefix hit instead of
//! being computed again.
//!
//! Eviction considers reuse, not only recency: an entry ranks by how often
//! its block was reused (prefix hits in either tier, capped), then by when
//! it arrived; the lowest rank goes first. A block that conversations came
//! back to outlives any number of blocks used once, however recent: one
//! long one-off prompt does not flush the prefixes that pay.
//!
//! A timing backend (the mocker) keeps no bytes: an entry holds only its
//! rank, and the budget counts the modelled block size.

use std::collections::{BTreeMap, HashMap};

/// Reuse counts above this rank the same.
const MAX_REUSE_RANK: u32 = 7;

#[derive(Debug)]
struct Entry {
    /// The block's serialised bytes (`None` on a timing backend).
    data: Option<Box<[u8]>>,
    reuse: u32,
    stamp: u64,
}

/// A block taken back out of the store.
#[derive(Debug)]
pub struct Restored {
    pub data: Option<Box<[u8]>>,
    pub reuse: u32,
}

/// Blocks evicted from KV memory, by sequence hash.
#[derive(Debug)]
pub struct TierStore {
    budget_bytes: u64,
    /// Bytes one entry counts for.
    block_bytes: u64,
    entries: HashMap<u64, Entry>,
    /// (reuse rank, stamp) → hash: the first is evicted first.
    order: BTreeMap<(u32, u64), u64>,
    next_stamp: u64,
}

impl TierStore {
    /// A store of at most `budget_bytes`, each block counting `block_bytes`.
    pub fn new(budget_bytes: u64, block_bytes: u64) -> Self {
        Self {
            budget_bytes,
            block_bytes: block_bytes.max(1),
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
        }
    }

    /// Blocks the budget holds.
    pub fn capacity(&self) -> usize {
        usize::try_from(self.budget_bytes / self.block_bytes).unwrap_or(usize::MAX)
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether it holds `hash`.
    pub fn contains(&self, hash: u64) -> bool {
        self.entries.contains_key(&hash)
    }

    /// Keeps `hash`'s block (reused `reuse` times so far); returns the
    /// hashes dropped to make room (the new one itself when it ranks
    /// below everything the full store holds, or the budget holds none).
    pub fn insert(&mut self, hash: u64, data: Option<Box<[u8]>>, reuse: u32) -> Vec<u64> {
        let mut dropped = Vec::new();
        if self.capacity() == 0 {
            dropped.push(hash);
            return dropped;
        }
        if let Some(old) = self.entries.remove(&hash) {
            self.order
                .remove(&(old.reuse.min(MAX_REUSE_RANK), old.stamp));
        }
        let rank = reuse.min(MAX_REUSE_RANK);
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        while self.entries.len() >= self.capacity() {
            let Some((&(lowest, _), _)) = self.order.first_key_value() else {
                break;
            };
            if lowest > rank {
                // Everything held was reused more: the newcomer goes.
                dropped.push(hash);
                return dropped;
            }
            if let Some((_, victim)) = self.order.pop_first() {
                self.entries.remove(&victim);
                dropped.push(victim);
            }
        }
        self.order.insert((rank, stamp), hash);
        self.entries.insert(hash, Entry { data, reuse, stamp });
        dropped
    }

    /// Takes `hash`'s block out (to move it back into KV memory).
    pub fn take(&mut self, hash: u64) -> Option<Restored> {
        let e = self.entries.remove(&hash)?;
        self.order.remove(&(e.reuse.min(MAX_REUSE_RANK), e.stamp));
        Some(Restored {
            data: e.data,
            reuse: e.reuse,
        })
    }

    /// Drops everything; the hashes dropped.
    pub fn clear(&mut self) -> Vec<u64> {
        self.order.clear();
        self.entries.drain().map(|(h, _)| h).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_bounds_it_and_the_least_reused_oldest_goes_first() {
        // Three blocks of 10 bytes.
        let mut t = TierStore::new(30, 10);
        assert!(t.insert(1, None, 0).is_empty());
        assert!(t.insert(2, None, 3).is_empty());
        assert!(t.insert(3, None, 0).is_empty());
        // Full: the oldest block never reused goes, not the reused one.
        assert_eq!(t.insert(4, None, 0), vec![1]);
        assert_eq!(t.insert(5, None, 1), vec![3]);
        assert!(t.contains(2) && t.contains(4) && t.contains(5));
        // A newcomer reused less than everything held is not kept.
        let mut reused = TierStore::new(20, 10);
        reused.insert(1, None, 2);
        reused.insert(2, None, 2);
        assert_eq!(reused.insert(3, None, 0), vec![3]);
        assert_eq!(reused.len(), 2);
    }

    #[test]
    fn a_taken_block_comes_back_with_its_bytes_and_reuse() {
        let mut t = TierStore::new(100, 10);
        t.insert(7, Some(vec![1, 2, 3].into()), 2);
        let r = t.take(7).expect("held");
        assert_eq!((r.data.as_deref(), r.reuse), (Some(&[1u8, 2, 3][..]), 2));
        assert!(t.take(7).is_none());
        assert!(t.is_empty());
        // No budget: nothing is kept.
        assert_eq!(TierStore::new(5, 10).insert(1, None, 0), vec![1]);
    }
}
