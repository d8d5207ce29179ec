//! The block pool: reference-counted physical blocks, per-sequence block
//! tables, the prefix cache (sequence hash → block) and LRU eviction of free
//! cached blocks.
//!
//! A free block is either *uncached* (no hash; handed out first) or *cached*
//! (keeps its hash and contents until evicted, least recently freed first).
//! Allocation never fails part-way: it either extends a table completely or
//! changes nothing.
//!
//! With a second tier ([`TierStore`]), an evicted block's hash moves there
//! instead of being forgotten, and a prefix that runs on into the second
//! tier is restored: the blocks are allocated again, registered under their
//! hashes, and count as hits. The bytes move on the engine thread, which
//! replays [`KvCache::take_tier_ops`] in order right after each call that
//! can evict or restore, before anything else touches the blocks.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::events::{KvEvent, KvEventLog};
use super::tier::TierStore;
use crate::error::EngineError;

/// Identifies a sequence inside one engine.
pub type SeqId = u64;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    hash: Option<u64>,
    /// Key in the LRU map while free and cached.
    lru_stamp: Option<u64>,
    /// Prefix hits on its hash so far (what the second tier ranks by).
    reuse: u32,
}

/// A move of block bytes between KV memory and the second tier, for the
/// engine thread to replay in order.
#[derive(Debug)]
pub enum TierOp {
    /// Copy block `block`'s bytes into the second tier under `hash` (it was
    /// evicted and is about to be reused).
    Demote { hash: u64, block: u32, reuse: u32 },
    /// Write a block's bytes, taken out of the second tier, into block
    /// `block`: the tier's `slot` (`None` on a timing backend, which keeps
    /// no bytes), released once copied.
    Restore { block: u32, slot: Option<u32> },
}

#[derive(Debug, Default)]
struct SeqBlocks {
    ids: Vec<u32>,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    num_cached: usize,
}

/// Block pool, block tables and prefix cache of one engine.
#[derive(Debug)]
pub struct KvCache {
    block_size: usize,
    enable_prefix_caching: bool,
    blocks: Vec<Block>,
    free_uncached: Vec<u32>,
    /// Free cached blocks by the order they were freed (oldest evicted first).
    lru: BTreeMap<u64, u32>,
    next_stamp: u64,
    by_hash: HashMap<u64, u32>,
    tables: HashMap<SeqId, SeqBlocks>,
    events: Arc<KvEventLog>,
    /// The second tier, if any.
    tier: Option<TierStore>,
    /// Byte moves not yet replayed by the engine thread.
    tier_ops: Vec<TierOp>,
    /// Blocks restored from the second tier so far.
    tier_restored: u64,
}

impl KvCache {
    /// A pool of `num_blocks` blocks of `block_size` tokens publishing to `events`.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        enable_prefix_caching: bool,
        events: Arc<KvEventLog>,
    ) -> Self {
        let num_blocks = u32::try_from(num_blocks).map_or(u32::MAX, |n| n) as usize;
        Self {
            block_size: block_size.max(1),
            enable_prefix_caching,
            blocks: vec![Block::default(); num_blocks],
            // Reversed so that block 0 is handed out first.
            free_uncached: (0..num_blocks as u32).rev().collect(),
            lru: BTreeMap::new(),
            next_stamp: 0,
            by_hash: HashMap::new(),
            tables: HashMap::new(),
            events,
            tier: None,
            tier_ops: Vec::new(),
            tier_restored: 0,
        }
    }

    /// Blocks the second tier holds, and blocks restored from it so far.
    pub fn tier_figures(&self) -> (usize, u64) {
        (
            self.tier.as_ref().map_or(0, TierStore::len),
            self.tier_restored,
        )
    }

    /// Adds a second tier (see the module docs).
    pub fn with_tier(mut self, tier: TierStore) -> Self {
        self.tier = Some(tier);
        self
    }

    /// The second tier, if any.
    pub fn tier(&self) -> Option<&TierStore> {
        self.tier.as_ref()
    }

    /// The second tier, for the engine thread's replay of [`TierOp`]s.
    pub fn tier_mut(&mut self) -> Option<&mut TierStore> {
        self.tier.as_mut()
    }

    /// The byte moves since the last call, in the order they must happen.
    pub fn take_tier_ops(&mut self) -> Vec<TierOp> {
        std::mem::take(&mut self.tier_ops)
    }

    /// Publishes that the second tier dropped `hashes` (they are gone from
    /// this engine).
    pub fn tier_dropped(&self, hashes: Vec<u64>) {
        if !hashes.is_empty() {
            self.events.publish(KvEvent::Removed {
                block_hashes: hashes,
            });
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that an allocation may take (uncached plus evictable cached).
    pub fn num_free(&self) -> usize {
        self.free_uncached.len() + self.lru.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free()
    }

    /// Fraction of blocks in use, 0..=1.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            0.0
        } else {
            self.num_used() as f64 / self.blocks.len() as f64
        }
    }

    /// Blocks currently cached under a hash (in use or free).
    pub fn num_cached_blocks(&self) -> usize {
        self.by_hash.len()
    }

    /// The event log this pool publishes to.
    pub fn events(&self) -> &Arc<KvEventLog> {
        &self.events
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// How many leading `hashes` are cached (without taking them).
    pub fn cached_prefix_len(&self, hashes: &[u64]) -> usize {
        if !self.enable_prefix_caching {
            return 0;
        }
        let in_memory = self.in_memory_prefix_len(hashes);
        in_memory + self.tier_prefix_len(&hashes[in_memory..])
    }

    /// How many leading `hashes` the second tier holds.
    fn tier_prefix_len(&self, hashes: &[u64]) -> usize {
        self.tier
            .as_ref()
            .map_or(0, |t| hashes.iter().take_while(|h| t.contains(**h)).count())
    }

    /// How many leading `hashes` KV memory holds (the second tier aside).
    fn in_memory_prefix_len(&self, hashes: &[u64]) -> usize {
        if !self.enable_prefix_caching {
            return 0;
        }
        hashes
            .iter()
            .take_while(|h| self.by_hash.contains_key(h))
            .count()
    }

    /// Whether `seq` holds a block table (possibly empty).
    pub fn has_table(&self, seq: SeqId) -> bool {
        self.tables.contains_key(&seq)
    }

    /// The physical blocks of `seq`, in position order (empty if none).
    pub fn block_table(&self, seq: SeqId) -> &[u32] {
        self.tables.get(&seq).map_or(&[], |t| t.ids.as_slice())
    }

    /// Blocks of `seq` no other sequence references: what freeing it gives
    /// back to the pool.
    pub fn exclusive_blocks(&self, seq: SeqId) -> usize {
        self.block_table(seq)
            .iter()
            .filter(|&&id| self.blocks[id as usize].ref_count == 1)
            .count()
    }

    /// Leading blocks of `seq` held in the prefix cache (registered by it or
    /// taken from it): what survives of its work when it is freed, until
    /// evicted. 0 without prefix caching.
    pub fn cached_blocks_of(&self, seq: SeqId) -> usize {
        self.tables.get(&seq).map_or(0, |t| t.num_cached)
    }

    /// Extra blocks `seq` needs so its table covers `num_tokens` tokens.
    pub fn blocks_needed(&self, seq: SeqId, num_tokens: usize) -> usize {
        self.blocks_for(num_tokens)
            .saturating_sub(self.block_table(seq).len())
    }

    /// Starts `seq`'s table with the longest cached prefix of `hashes`, taking
    /// a reference on each hit block. Returns the number of hit blocks.
    /// `seq` must not hold a table yet.
    pub fn acquire_prefix(&mut self, seq: SeqId, hashes: &[u64]) -> usize {
        let in_memory = self.in_memory_prefix_len(hashes);
        let mut ids = Vec::with_capacity(in_memory);
        for h in &hashes[..in_memory] {
            let id = self.by_hash[h];
            self.take_ref(id);
            self.blocks[id as usize].reuse += 1;
            ids.push(id);
        }
        let table = self.tables.entry(seq).or_default();
        debug_assert!(
            table.ids.is_empty(),
            "acquire_prefix on a sequence with blocks"
        );
        table.ids = ids;
        table.num_cached = in_memory;
        in_memory + self.restore(seq, &hashes[in_memory..])
    }

    /// Moves the leading `hashes` the second tier holds back into KV memory
    /// for `seq` (whose table ends where they start), as far as free blocks
    /// allow; the blocks restored.
    fn restore(&mut self, seq: SeqId, hashes: &[u64]) -> usize {
        let n = self.tier_prefix_len(hashes).min(self.num_free());
        if n == 0 {
            return 0;
        }
        let start = self.block_table(seq).len();
        let tokens = (start + n) * self.block_size;
        if self.allocate(seq, tokens).is_err() {
            return 0;
        }
        let Some(table) = self.tables.get_mut(&seq) else {
            return 0;
        };
        let mut restored = Vec::with_capacity(n);
        for (i, &h) in hashes[..n].iter().enumerate() {
            let id = table.ids[start + i];
            let (slot, reuse) = self
                .tier
                .as_mut()
                .and_then(|t| t.take(h))
                .map_or((None, 0), |r| (r.slot, r.reuse));
            let block = &mut self.blocks[id as usize];
            block.hash = Some(h);
            block.reuse = reuse + 1;
            self.by_hash.insert(h, id);
            self.tier_ops.push(TierOp::Restore { block: id, slot });
            restored.push(h);
        }
        table.num_cached = start + n;
        self.tier_restored += n as u64;
        self.events.publish(KvEvent::Moved {
            block_hashes: restored,
            tier: 1,
        });
        n
    }

    /// Extends `seq`'s table to cover `num_tokens` tokens, evicting free cached
    /// blocks (least recently freed first) if uncached ones run out. On
    /// failure nothing changes.
    pub fn allocate(&mut self, seq: SeqId, num_tokens: usize) -> Result<(), EngineError> {
        let needed = self.blocks_needed(seq, num_tokens);
        if needed > self.num_free() {
            return Err(EngineError::OutOfBlocks {
                needed,
                free: self.num_free(),
            });
        }
        let mut new_ids = Vec::with_capacity(needed);
        let mut evicted = Vec::new();
        let mut demoted = Vec::new();
        for _ in 0..needed {
            let id = match self.free_uncached.pop() {
                Some(id) => id,
                None => {
                    let (_, id) = self.lru.pop_first().expect("num_free counted this block");
                    let block = &mut self.blocks[id as usize];
                    block.lru_stamp = None;
                    let reuse = std::mem::take(&mut block.reuse);
                    if let Some(h) = block.hash.take() {
                        self.by_hash.remove(&h);
                        if self.tier.is_some() {
                            self.tier_ops.push(TierOp::Demote {
                                hash: h,
                                block: id,
                                reuse,
                            });
                            demoted.push(h);
                        } else {
                            evicted.push(h);
                        }
                    }
                    id
                }
            };
            self.blocks[id as usize].ref_count = 1;
            new_ids.push(id);
        }
        if !evicted.is_empty() {
            self.events.publish(KvEvent::Removed {
                block_hashes: evicted,
            });
        }
        if !demoted.is_empty() {
            self.events.publish(KvEvent::Moved {
                block_hashes: demoted,
                tier: 2,
            });
        }
        self.tables.entry(seq).or_default().ids.extend(new_ids);
        Ok(())
    }

    /// Registers `seq`'s full blocks among the first `num_computed_tokens`
    /// tokens under `hashes` (the sequence hashes of its tokens), publishing a
    /// `Stored` event per contiguous run of newly cached blocks. A hash
    /// already cached by another block leaves this block uncached.
    pub fn cache_full_blocks(&mut self, seq: SeqId, hashes: &[u64], num_computed_tokens: usize) {
        if !self.enable_prefix_caching {
            return;
        }
        let Some(table) = self.tables.get_mut(&seq) else {
            return;
        };
        let full = (num_computed_tokens / self.block_size)
            .min(hashes.len())
            .min(table.ids.len());
        if full <= table.num_cached {
            return;
        }
        let mut runs: Vec<(Option<u64>, Vec<u64>)> = Vec::new();
        let mut run_open = false;
        for i in table.num_cached..full {
            let h = hashes[i];
            let id = table.ids[i];
            let block = &mut self.blocks[id as usize];
            if block.hash.is_some() || self.by_hash.contains_key(&h) {
                run_open = false;
                continue;
            }
            block.hash = Some(h);
            self.by_hash.insert(h, id);
            // Computed again while the second tier still held it: one copy,
            // in KV memory (the event below says it is cached, as it was).
            if let Some(t) = self.tier.as_mut() {
                t.take(h);
            }
            if run_open && let Some(run) = runs.last_mut() {
                run.1.push(h);
            } else {
                let parent = if i == 0 { None } else { Some(hashes[i - 1]) };
                runs.push((parent, vec![h]));
                run_open = true;
            }
        }
        table.num_cached = full;
        for (parent_hash, block_hashes) in runs {
            self.events.publish(KvEvent::Stored {
                parent_hash,
                block_hashes,
            });
        }
    }

    /// Releases every block of `seq` (tail first, so a sequence's last blocks
    /// are evicted before its first) and forgets its table.
    pub fn free(&mut self, seq: SeqId) {
        let Some(table) = self.tables.remove(&seq) else {
            return;
        };
        for &id in table.ids.iter().rev() {
            self.release_ref(id);
        }
    }

    /// Drops every hash from the cache (in-use blocks stay allocated but are
    /// no longer shared) and publishes `Cleared`.
    pub fn clear_prefix_cache(&mut self) {
        for (_, id) in std::mem::take(&mut self.lru) {
            let block = &mut self.blocks[id as usize];
            block.lru_stamp = None;
            block.hash = None;
            self.free_uncached.push(id);
        }
        for (_, id) in self.by_hash.drain() {
            self.blocks[id as usize].hash = None;
        }
        for table in self.tables.values_mut() {
            table.num_cached = 0;
        }
        if let Some(t) = self.tier.as_mut() {
            t.clear();
        }
        self.tier_ops.clear();
        self.events.publish(KvEvent::Cleared);
    }

    /// Checks the pool's invariants; returns a description of the first
    /// violation. Cheap enough for tests, not for every step.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.blocks.len()];
        for (seq, t) in &self.tables {
            for &id in &t.ids {
                *refs
                    .get_mut(id as usize)
                    .ok_or(format!("seq {seq}: block {id} out of range"))? += 1;
            }
        }
        let mut free = 0;
        for (id, (b, &r)) in self.blocks.iter().zip(&refs).enumerate() {
            if b.ref_count != r {
                return Err(format!(
                    "block {id}: ref_count {} but {r} tables hold it",
                    b.ref_count
                ));
            }
            if r == 0 {
                free += 1;
                let in_lru = b
                    .lru_stamp
                    .is_some_and(|s| self.lru.get(&s) == Some(&(id as u32)));
                let in_uncached = self.free_uncached.contains(&(id as u32));
                if in_lru == in_uncached {
                    return Err(format!(
                        "free block {id}: in lru {in_lru}, in uncached {in_uncached}"
                    ));
                }
                if in_lru != b.hash.is_some() {
                    return Err(format!("free block {id}: cached list disagrees with hash"));
                }
            } else if b.lru_stamp.is_some() {
                return Err(format!("used block {id} is in the LRU"));
            }
            if let Some(h) = b.hash
                && self.by_hash.get(&h) != Some(&(id as u32))
            {
                return Err(format!("block {id}: hash {h:#x} not indexed to it"));
            }
        }
        if free != self.num_free() {
            return Err(format!(
                "{free} blocks unreferenced, free lists hold {}",
                self.num_free()
            ));
        }
        if self.num_free() + self.num_used() != self.blocks.len() {
            return Err("free + used != capacity".into());
        }
        if self.by_hash.len() != self.blocks.iter().filter(|b| b.hash.is_some()).count() {
            return Err("hash index and block hashes disagree".into());
        }
        Ok(())
    }

    fn take_ref(&mut self, id: u32) {
        let block = &mut self.blocks[id as usize];
        if block.ref_count == 0
            && let Some(stamp) = block.lru_stamp.take()
        {
            self.lru.remove(&stamp);
        }
        block.ref_count += 1;
    }

    fn release_ref(&mut self, id: u32) {
        let block = &mut self.blocks[id as usize];
        debug_assert!(block.ref_count > 0, "double free of block {id}");
        if block.ref_count == 0 {
            return;
        }
        block.ref_count -= 1;
        if block.ref_count == 0 {
            if block.hash.is_some() {
                let stamp = self.next_stamp;
                self.next_stamp += 1;
                block.lru_stamp = Some(stamp);
                self.lru.insert(stamp, id);
            } else {
                self.free_uncached.push(id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::KvEvent;
    use sluice_tokens::sequence_block_hashes;

    fn cache(n: usize) -> KvCache {
        KvCache::new(n, 4, true, Arc::new(KvEventLog::new(64)))
    }

    fn events(c: &KvCache) -> Vec<KvEvent> {
        c.events()
            .subscribe(0)
            .expect("ring holds all")
            .backlog
            .into_iter()
            .map(|r| r.event)
            .collect()
    }

    #[test]
    fn allocate_and_free_keep_free_plus_used_equal_capacity() {
        let mut c = cache(8);
        c.allocate(1, 9).expect("3 blocks fit");
        assert_eq!((c.num_used(), c.num_free()), (3, 5));
        c.allocate(1, 12).expect("no new block needed");
        assert_eq!(c.block_table(1).len(), 3);
        c.free(1);
        assert_eq!(c.num_free(), 8);
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn allocation_failure_changes_nothing() {
        let mut c = cache(2);
        c.allocate(1, 4).expect("fits");
        let err = c.allocate(2, 12).expect_err("needs 3 of 1");
        assert!(matches!(
            err,
            EngineError::OutOfBlocks { needed: 3, free: 1 }
        ));
        assert!(!c.has_table(2));
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn freed_full_blocks_serve_a_repeated_prefix() {
        let mut c = cache(8);
        let tokens: Vec<u32> = (0..10).collect();
        let hashes = sequence_block_hashes(&tokens, 4);
        c.allocate(1, 10).expect("fits");
        c.cache_full_blocks(1, &hashes, 10);
        let first = c.block_table(1).to_vec();
        c.free(1);
        assert_eq!(c.acquire_prefix(2, &hashes), 2);
        assert_eq!(c.block_table(2), &first[..2]);
        c.check_invariants().expect("invariants");
        assert_eq!(
            events(&c),
            vec![KvEvent::Stored {
                parent_hash: None,
                block_hashes: hashes.clone()
            }]
        );
    }

    #[test]
    fn exclusive_and_cached_blocks_say_what_freeing_gives_back_and_keeps() {
        let mut c = cache(8);
        let hashes = sequence_block_hashes(&(0..10).collect::<Vec<u32>>(), 4);
        c.allocate(1, 10).expect("fits");
        c.cache_full_blocks(1, &hashes, 10);
        assert_eq!((c.exclusive_blocks(1), c.cached_blocks_of(1)), (3, 2));
        assert_eq!(c.acquire_prefix(2, &hashes), 2);
        assert_eq!(c.exclusive_blocks(1), 1, "two are shared with seq 2");
        assert_eq!((c.exclusive_blocks(2), c.cached_blocks_of(2)), (0, 2));
        c.free(1);
        assert_eq!(c.exclusive_blocks(2), 2);
        c.free(2);
        assert_eq!((c.exclusive_blocks(2), c.cached_blocks_of(2)), (0, 0));
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn shared_prefix_is_referenced_not_copied() {
        let mut c = cache(8);
        let hashes = sequence_block_hashes(&(0..8).collect::<Vec<u32>>(), 4);
        c.allocate(1, 8).expect("fits");
        c.cache_full_blocks(1, &hashes, 8);
        assert_eq!(c.acquire_prefix(2, &hashes), 2);
        assert_eq!(c.num_used(), 2);
        c.free(1);
        assert_eq!(c.num_used(), 2, "seq 2 still holds both");
        c.free(2);
        assert_eq!(c.num_used(), 0);
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn eviction_takes_uncached_first_then_least_recently_freed() {
        let mut c = cache(4);
        let a = sequence_block_hashes(&[1, 1, 1, 1], 4);
        let b = sequence_block_hashes(&[2, 2, 2, 2], 4);
        c.allocate(1, 4).expect("fits");
        c.cache_full_blocks(1, &a, 4);
        c.allocate(2, 4).expect("fits");
        c.cache_full_blocks(2, &b, 4);
        c.free(1);
        c.free(2);
        c.allocate(3, 8).expect("two uncached blocks");
        assert_eq!(
            c.num_cached_blocks(),
            2,
            "cached blocks survive while uncached remain"
        );
        c.allocate(3, 12).expect("evicts a");
        assert_eq!(c.cached_prefix_len(&a), 0);
        assert_eq!(c.cached_prefix_len(&b), 1);
        assert_eq!(
            events(&c).last(),
            Some(&KvEvent::Removed {
                block_hashes: a.clone()
            })
        );
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn an_evicted_block_moves_to_the_second_tier_and_a_hit_restores_it() {
        // Two blocks in memory, two in the second tier.
        let mut c = cache(2).with_tier(TierStore::with_bytes(2 * 64, 64).expect("store"));
        let a = sequence_block_hashes(&[1, 1, 1, 1, 2, 2, 2, 2], 4);
        c.allocate(1, 8).expect("fits");
        c.cache_full_blocks(1, &a, 8);
        c.free(1);
        // Another prompt takes both blocks: `a` moves to the second tier.
        c.allocate(2, 8).expect("evicts a");
        let ops = c.take_tier_ops();
        assert!(
            matches!(
                ops.as_slice(),
                [TierOp::Demote { .. }, TierOp::Demote { .. }]
            ),
            "{ops:?}"
        );
        assert!(matches!(
            events(&c).last(),
            Some(KvEvent::Moved { tier: 2, .. })
        ));
        // The engine thread keeps the bytes it was asked to.
        for op in ops {
            if let TierOp::Demote { hash, reuse, .. } = op {
                let (dropped, filled) = c.tier_mut().expect("tier").insert(hash, reuse, |slot| {
                    slot.fill(hash as u8);
                    Ok::<(), ()>(())
                });
                assert!(dropped.is_empty() && filled.is_ok());
            }
        }
        // Still a hit, and where memory is free it comes back.
        assert_eq!(c.cached_prefix_len(&a), 2);
        c.free(2);
        assert_eq!(
            c.acquire_prefix(3, &a),
            2,
            "restored, hits as cached blocks"
        );
        let ops = c.take_tier_ops();
        let slots: Vec<u32> = ops
            .iter()
            .filter_map(|op| match op {
                TierOp::Restore { slot: Some(s), .. } => Some(*s),
                _ => None,
            })
            .collect();
        let tier = c.tier_mut().expect("tier");
        let restored: Vec<u8> = slots
            .iter()
            .map(|&s| tier.bytes(s).expect("bytes")[0])
            .collect();
        assert_eq!(restored, vec![a[0] as u8, a[1] as u8], "{ops:?}");
        slots.into_iter().for_each(|s| tier.release(s));
        assert!(matches!(
            events(&c).last(),
            Some(KvEvent::Moved { tier: 1, .. })
        ));
        assert!(c.tier().expect("tier").is_empty(), "moved, not copied");
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn a_block_the_second_tier_cannot_keep_is_removed() {
        let mut c = cache(1).with_tier(TierStore::new(0, 64));
        let a = sequence_block_hashes(&[1, 1, 1, 1], 4);
        c.allocate(1, 4).expect("fits");
        c.cache_full_blocks(1, &a, 4);
        c.free(1);
        c.allocate(2, 4).expect("evicts a");
        for op in c.take_tier_ops() {
            if let TierOp::Demote { hash, reuse, .. } = op {
                let (dropped, _) = c
                    .tier_mut()
                    .expect("tier")
                    .insert(hash, reuse, |_| Ok::<(), ()>(()));
                c.tier_dropped(dropped);
            }
        }
        assert_eq!(
            events(&c).last(),
            Some(&KvEvent::Removed {
                block_hashes: a.clone()
            })
        );
        assert_eq!(c.cached_prefix_len(&a), 0);
    }

    #[test]
    fn stored_event_chains_to_parent_for_decoded_blocks() {
        let mut c = cache(8);
        let tokens: Vec<u32> = (0..8).collect();
        let hashes = sequence_block_hashes(&tokens, 4);
        c.allocate(1, 5).expect("fits");
        c.cache_full_blocks(1, &hashes[..1], 5);
        c.allocate(1, 8).expect("fits");
        c.cache_full_blocks(1, &hashes, 8);
        assert_eq!(
            events(&c),
            vec![
                KvEvent::Stored {
                    parent_hash: None,
                    block_hashes: vec![hashes[0]]
                },
                KvEvent::Stored {
                    parent_hash: Some(hashes[0]),
                    block_hashes: vec![hashes[1]]
                },
            ]
        );
    }

    #[test]
    fn duplicate_hash_is_not_cached_twice() {
        let mut c = cache(8);
        let hashes = sequence_block_hashes(&[7, 7, 7, 7], 4);
        c.allocate(1, 4).expect("fits");
        c.allocate(2, 4).expect("fits");
        c.cache_full_blocks(1, &hashes, 4);
        c.cache_full_blocks(2, &hashes, 4);
        assert_eq!(c.num_cached_blocks(), 1);
        assert_eq!(events(&c).len(), 1);
        c.free(1);
        c.free(2);
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn clear_prefix_cache_forgets_hashes_and_publishes_cleared() {
        let mut c = cache(4);
        let hashes = sequence_block_hashes(&[1, 2, 3, 4], 4);
        c.allocate(1, 4).expect("fits");
        c.cache_full_blocks(1, &hashes, 4);
        c.free(1);
        c.clear_prefix_cache();
        assert_eq!(c.cached_prefix_len(&hashes), 0);
        assert_eq!(events(&c).last(), Some(&KvEvent::Cleared));
        assert!(c.events().snapshot().block_hashes.is_empty());
        c.check_invariants().expect("invariants");
    }

    #[test]
    fn disabled_prefix_caching_never_hits_or_publishes() {
        let mut c = KvCache::new(4, 4, false, Arc::new(KvEventLog::new(8)));
        let hashes = sequence_block_hashes(&[1, 2, 3, 4], 4);
        c.allocate(1, 4).expect("fits");
        c.cache_full_blocks(1, &hashes, 4);
        c.free(1);
        assert_eq!(c.acquire_prefix(2, &hashes), 0);
        assert!(events(&c).is_empty());
    }
}
