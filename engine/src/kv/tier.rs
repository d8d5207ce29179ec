//! The second KV tier: full blocks evicted from the engine's KV memory,
//! kept by sequence hash in a larger, slower store up to a byte budget, and
//! moved back into KV memory on a prefix hit instead of being computed
//! again.
//!
//! Eviction considers reuse, not only recency: an entry ranks by how often
//! its block was reused (prefix hits in either tier, capped), then by when
//! it arrived; the lowest rank goes first. A block that conversations came
//! back to outlives any number of blocks used once, however recent: one
//! long one-off prompt does not flush the prefixes that pay.
//!
//! The bytes live in fixed-size slots of one memory file with no name
//! (`memfd_create`), as many as the budget holds: the store is bounded by
//! construction, its pages are committed as slots are first written and
//! reused after (no allocation or page fault per demoted block), and the
//! kernel frees it with the process, `kill -9` included. A taken block's
//! slot stays reserved until the engine thread has copied it out
//! ([`TierStore::release`]). A timing backend (the mocker) keeps no bytes:
//! an entry holds only its rank, and the budget counts the modelled block
//! size.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;

use memmap2::MmapRaw;

use crate::error::EngineError;

/// Reuse counts above this rank the same.
const MAX_REUSE_RANK: u32 = 7;

#[derive(Debug)]
struct Entry {
    /// The slot holding the block's bytes (`None` on a timing backend).
    slot: Option<u32>,
    reuse: u32,
    stamp: u64,
}

/// A block taken back out of the store.
#[derive(Debug)]
pub struct Restored {
    /// The slot with its bytes, reserved until [`TierStore::release`].
    pub slot: Option<u32>,
    pub reuse: u32,
}

/// Fixed-size block slots in one anonymous memory file.
#[derive(Debug)]
struct Slots {
    map: MmapRaw,
    _file: File,
    block_bytes: usize,
    free: Vec<u32>,
}

impl Slots {
    fn new(count: usize, block_bytes: usize) -> Result<Self, EngineError> {
        let err = |what: String| EngineError::InvalidConfig(format!("second KV tier: {what}"));
        let len = count
            .checked_mul(block_bytes)
            .ok_or_else(|| err(format!("{count} blocks of {block_bytes} bytes overflow")))?;
        // Sized, not reserved: pages are committed as slots are written.
        let (map, file) =
            crate::backend::arena::memory_file(c"sluice-kv-tier", len, false).map_err(err)?;
        Ok(Slots {
            map,
            _file: file,
            block_bytes,
            // Popped from the end: slot 0 first.
            free: (0..count as u32).rev().collect(),
        })
    }

    fn slice(&self, slot: u32) -> &[u8] {
        let at = slot as usize * self.block_bytes;
        assert!(
            at + self.block_bytes <= self.map.len(),
            "tier slot {slot} out of range"
        );
        // SAFETY: in range (checked); the mapping lives as long as `self`,
        // and `&self` excludes `slice_mut` on it.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), self.block_bytes) }
    }

    fn slice_mut(&mut self, slot: u32) -> &mut [u8] {
        let at = slot as usize * self.block_bytes;
        assert!(
            at + self.block_bytes <= self.map.len(),
            "tier slot {slot} out of range"
        );
        // SAFETY: as `slice`, and `&mut self` makes it exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), self.block_bytes) }
    }
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
    /// The bytes, when the store keeps them.
    slots: Option<Slots>,
}

impl TierStore {
    /// A store of at most `budget_bytes` that keeps no bytes (a timing
    /// backend's), each block counting `block_bytes`.
    pub fn new(budget_bytes: u64, block_bytes: u64) -> Self {
        Self {
            budget_bytes,
            block_bytes: block_bytes.max(1),
            entries: HashMap::new(),
            order: BTreeMap::new(),
            next_stamp: 0,
            slots: None,
        }
    }

    /// A store of at most `budget_bytes` keeping blocks of `block_bytes`
    /// each in its memory file.
    pub fn with_bytes(budget_bytes: u64, block_bytes: u64) -> Result<Self, EngineError> {
        let mut store = Self::new(budget_bytes, block_bytes);
        let block = usize::try_from(store.block_bytes).map_err(|_| {
            EngineError::InvalidConfig(format!("second KV tier: {block_bytes}-byte blocks"))
        })?;
        store.slots = Some(Slots::new(store.capacity(), block)?);
        Ok(store)
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

    /// Keeps `hash`'s block (reused `reuse` times so far), its bytes
    /// written into its slot by `fill` when the store keeps bytes; returns
    /// the hashes dropped to make room (the new one itself when it ranks
    /// below everything the full store holds, the budget holds none, every
    /// slot is reserved by a taken block not released yet, or `fill`
    /// fails).
    pub fn insert<E>(
        &mut self,
        hash: u64,
        reuse: u32,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> (Vec<u64>, Result<(), E>) {
        let mut dropped = Vec::new();
        if self.capacity() == 0 {
            dropped.push(hash);
            return (dropped, Ok(()));
        }
        if let Some(old) = self.entries.remove(&hash) {
            self.forget(&old);
        }
        let rank = reuse.min(MAX_REUSE_RANK);
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        // Room for one more: under the budget, and a free slot (taken
        // blocks' slots are reserved until released).
        while self.entries.len() >= self.capacity()
            || self.slots.as_ref().is_some_and(|s| s.free.is_empty())
        {
            let Some((&(lowest, _), _)) = self.order.first_key_value() else {
                break;
            };
            if lowest > rank {
                // Everything held was reused more: the newcomer goes.
                dropped.push(hash);
                return (dropped, Ok(()));
            }
            if let Some((_, victim)) = self.order.pop_first()
                && let Some(e) = self.entries.remove(&victim)
            {
                self.free_slot(e.slot);
                dropped.push(victim);
            }
        }
        let slot = match self.slots.as_mut() {
            None => None,
            Some(slots) => {
                let Some(slot) = slots.free.pop() else {
                    dropped.push(hash);
                    return (dropped, Ok(()));
                };
                if let Err(e) = fill(slots.slice_mut(slot)) {
                    slots.free.push(slot);
                    dropped.push(hash);
                    return (dropped, Err(e));
                }
                Some(slot)
            }
        };
        self.order.insert((rank, stamp), hash);
        self.entries.insert(hash, Entry { slot, reuse, stamp });
        (dropped, Ok(()))
    }

    /// Takes `hash`'s block out (to move it back into KV memory); its slot
    /// stays reserved until [`TierStore::release`].
    pub fn take(&mut self, hash: u64) -> Option<Restored> {
        let e = self.entries.remove(&hash)?;
        self.unrank(&e);
        Some(Restored {
            slot: e.slot,
            reuse: e.reuse,
        })
    }

    /// The bytes in a slot [`TierStore::take`] returned.
    pub fn bytes(&self, slot: u32) -> Option<&[u8]> {
        self.slots.as_ref().map(|s| s.slice(slot))
    }

    /// Frees a slot [`TierStore::take`] returned, once its bytes are copied.
    pub fn release(&mut self, slot: u32) {
        debug_assert!(
            self.slots.as_ref().is_none_or(|s| !s.free.contains(&slot)),
            "tier slot {slot} released twice"
        );
        self.free_slot(Some(slot));
    }

    /// Drops everything held (slots of taken blocks stay reserved); the
    /// hashes dropped.
    pub fn clear(&mut self) -> Vec<u64> {
        self.order.clear();
        std::mem::take(&mut self.entries)
            .into_iter()
            .map(|(h, e)| {
                self.free_slot(e.slot);
                h
            })
            .collect()
    }

    /// An entry leaves: its rank and its slot.
    fn forget(&mut self, e: &Entry) {
        self.unrank(e);
        self.free_slot(e.slot);
    }

    fn unrank(&mut self, e: &Entry) {
        self.order.remove(&(e.reuse.min(MAX_REUSE_RANK), e.stamp));
    }

    /// Hands `slot` (an entry's, or a taken block's) out again.
    fn free_slot(&mut self, slot: Option<u32>) {
        if let (Some(slots), Some(slot)) = (self.slots.as_mut(), slot) {
            slots.free.push(slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keep(t: &mut TierStore, hash: u64, reuse: u32) -> Vec<u64> {
        let (dropped, filled) = t.insert(hash, reuse, |_| Ok::<(), ()>(()));
        assert!(filled.is_ok());
        dropped
    }

    #[test]
    fn the_budget_bounds_it_and_the_least_reused_oldest_goes_first() {
        // Three blocks of 10 bytes.
        let mut t = TierStore::new(30, 10);
        assert!(keep(&mut t, 1, 0).is_empty());
        assert!(keep(&mut t, 2, 3).is_empty());
        assert!(keep(&mut t, 3, 0).is_empty());
        // Full: the oldest block never reused goes, not the reused one.
        assert_eq!(keep(&mut t, 4, 0), vec![1]);
        assert_eq!(keep(&mut t, 5, 1), vec![3]);
        assert!(t.contains(2) && t.contains(4) && t.contains(5));
        // A newcomer reused less than everything held is not kept.
        let mut reused = TierStore::new(20, 10);
        keep(&mut reused, 1, 2);
        keep(&mut reused, 2, 2);
        assert_eq!(keep(&mut reused, 3, 0), vec![3]);
        assert_eq!(reused.len(), 2);
    }

    #[test]
    fn a_taken_block_comes_back_with_its_bytes_and_reuse() {
        let mut t = TierStore::with_bytes(40, 10).expect("store");
        let (dropped, ok) = t.insert(7, 2, |slot| {
            slot.copy_from_slice(&[7; 10]);
            Ok::<(), ()>(())
        });
        assert!(dropped.is_empty() && ok.is_ok());
        let r = t.take(7).expect("held");
        assert_eq!(r.reuse, 2);
        let slot = r.slot.expect("a slot");
        assert_eq!(t.bytes(slot), Some(&[7u8; 10][..]));
        assert!(t.take(7).is_none());
        assert!(t.is_empty());
        t.release(slot);
        // No budget: nothing is kept.
        assert_eq!(keep(&mut TierStore::new(5, 10), 1, 0), vec![1]);
    }

    #[test]
    fn the_bytes_live_in_a_memory_file_with_no_name() {
        let t = TierStore::with_bytes(4 << 20, 1 << 20).expect("store");
        let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
        assert!(
            maps.lines().any(|l| l.contains("/memfd:sluice-kv-tier")),
            "no memfd mapping"
        );
        drop(t);
    }

    #[test]
    fn slots_are_bounded_reused_and_held_until_released() {
        // Two slots.
        let mut t = TierStore::with_bytes(20, 10).expect("store");
        for h in 1..=2 {
            let (dropped, filled) = t.insert(h, 0, |s| {
                s.fill(h as u8);
                Ok::<(), ()>(())
            });
            assert!(dropped.is_empty() && filled.is_ok());
        }
        // Taken but not released: its slot is not handed out again, so a
        // newcomer evicts the other block for its slot.
        let taken = t.take(1).expect("held").slot.expect("slot");
        let (dropped, filled) = t.insert(3, 0, |s| {
            s.fill(3);
            Ok::<(), ()>(())
        });
        assert_eq!((dropped, filled), (vec![2], Ok(())));
        assert_eq!(t.bytes(taken), Some(&[1u8; 10][..]), "not overwritten");
        t.release(taken);
        // A fill that fails keeps nothing and frees its slot.
        let (dropped, err) = t.insert(5, 0, |_| Err("read failed"));
        assert_eq!((dropped, err), (vec![5], Err("read failed")));
        assert!(!t.contains(5) && t.contains(3));
        assert_eq!(keep(&mut t, 6, 0), Vec::<u64>::new());
        // Full again: the oldest goes.
        assert_eq!(keep(&mut t, 7, 0), vec![3]);
    }
}
