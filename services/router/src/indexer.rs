//! The KV block index: which target (worker, data-parallel rank) holds which
//! block, keyed by the chained sequence hashes of DESIGN.md.
//!
//! Owns the block → targets map, each target's own block set and its event
//! sequence position. Does not own networking (see `workers`) or placement
//! (see `selector`).
//!
//! # Concurrency
//!
//! The map from block hash to the targets holding it is split into
//! [`DEFAULT_SHARDS`] shards, each a `parking_lot::RwLock<HashMap>`. A lookup
//! walks the request's hash chain taking one shard *read* lock per block, one
//! at a time, so lookups never wait on each other and wait on a writer only
//! for the instant it touches that one shard; there is no index-wide lock on
//! the read path. Each target's own state (its block set, next expected
//! sequence number) sits behind its own mutex, which serialises that target's
//! event application and removal; lock order is target mutex → shard lock.
//! A lookup racing an event may see part of the event applied; each block's
//! entry is itself always consistent.
//!
//! Because a sequence hash already encodes its whole prefix, a `Stored`
//! event's `parent` is not needed to place its blocks: the flat map answers
//! "longest run of the chain present on a target" exactly. The parent is
//! only checked to count orphan stores (parent unknown on that target).
//!
//! # Memory
//!
//! A block entry is a 32-byte bucket (hash + target set, the set inline
//! when one target holds the block) plus a control byte, and each target
//! keeps its own 9-byte set entry per block for removal: about 40–80 bytes
//! per (target, block) pair at hashbrown's load factors (measured in
//! `tests/bench/results/router_components.md`; [`KvIndexer::stats`] reports it live).
//!
//! # Invariants
//!
//! - A target id appears in a block's entry iff the hash is in that target's
//!   block set; entries with no targets are removed.
//! - A target's blocks change only through events applied in sequence order
//!   (or a snapshot, which sets the sequence position), or through the
//!   unsequenced calls that the approximate index uses.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use sluice_runtime::discovery::WorkerRank;

/// Number of shards of the block map.
pub const DEFAULT_SHARDS: usize = 64;

/// Compact id of a registered target inside one [`KvIndexer`]. Ids are never
/// reused: a target registered again after removal gets a fresh id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TargetId(u32);

impl TargetId {
    /// The raw id.
    pub fn get(self) -> u32 {
        self.0
    }
}

/// One KV event of one target, as numbered by the worker (gap-free from 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEvent {
    /// Sequence number.
    pub seq: u64,
    /// What happened.
    pub kind: KvEventKind,
}

/// The three kinds of KV event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEventKind {
    /// Blocks entered the prefix cache, in chain order after `parent`.
    Stored {
        /// Sequence hash of the block before the first stored one.
        parent: Option<u64>,
        /// Sequence hashes, in chain order.
        hashes: Vec<u64>,
    },
    /// Blocks left the prefix cache.
    Removed {
        /// Sequence hashes.
        hashes: Vec<u64>,
    },
    /// Blocks still cached moved between the worker's tiers (`tier` 2: out
    /// of KV memory into the second tier; 1: back). The index counts them
    /// cached either way: a second-tier hit costs a copy, not a recompute.
    Moved {
        /// Sequence hashes.
        hashes: Vec<u64>,
        /// The tier they are in now.
        tier: u32,
    },
    /// Every block left the prefix cache.
    Cleared,
}

/// What [`KvIndexer::apply`] did with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The event was the next expected one and is now reflected.
    Applied,
    /// The event was at or before the target's position (a replay); ignored.
    Stale,
}

/// Why the index refused an event or snapshot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IndexError {
    /// The target is not registered (never was, or was removed).
    #[error("target {0:?} is not registered in the index")]
    UnknownTarget(TargetId),
    /// Events were missed: the target needs a snapshot before more events.
    #[error("event gap on target {target:?}: expected seq {expected}, got {got}")]
    Gap {
        /// The target.
        target: TargetId,
        /// The sequence number the index expected.
        expected: u64,
        /// The sequence number it got.
        got: u64,
    },
}

/// Overlap of a request's hash chain with each target holding its first block.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OverlapScores {
    /// `(target, blocks)`, sorted by target: the length of the longest
    /// prefix of the request's chain present on the target. Targets with no
    /// overlap are absent.
    pub scores: Vec<(TargetId, u32)>,
}

impl OverlapScores {
    /// Overlap of one target (0 when absent).
    pub fn get(&self, id: TargetId) -> u32 {
        self.scores
            .binary_search_by_key(&id, |(t, _)| *t)
            .map_or(0, |i| self.scores[i].1)
    }

    /// The largest overlap of any target.
    pub fn max(&self) -> u32 {
        self.scores.iter().map(|(_, n)| *n).max().unwrap_or(0)
    }
}

/// Size figures of the index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IndexStats {
    /// Registered targets.
    pub targets: usize,
    /// Distinct block hashes indexed.
    pub blocks: usize,
    /// (target, block) pairs indexed; ≥ `blocks`.
    pub entries: usize,
    /// Estimated heap bytes held by the index, from table capacities.
    pub memory_bytes: usize,
    /// `memory_bytes / entries` (0 when empty).
    pub bytes_per_entry: f64,
}

/// A registered target's live block count, readable without index locks.
#[derive(Clone)]
pub struct TargetHandle(Arc<TargetEntry>);

impl TargetHandle {
    /// Blocks the target holds now (0 once removed).
    pub fn blocks(&self) -> usize {
        self.0.blocks.load(Ordering::Relaxed)
    }

    /// Blocks it newly stored lately, halved every 30 s of age: how fast
    /// its cache turns over.
    pub fn recent_stores(&self, now: Instant) -> f64 {
        self.0.state.lock().inflow.at(now)
    }
}

impl std::fmt::Debug for TargetHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TargetHandle({}, {} blocks)",
            self.0.target,
            self.blocks()
        )
    }
}

/// The concurrent block index. See the module docs for the locking scheme.
pub struct KvIndexer {
    shards: Box<[RwLock<BlockMap>]>,
    hasher: MixHasher,
    targets: RwLock<HashMap<TargetId, Arc<TargetEntry>>>,
    ids: RwLock<HashMap<WorkerRank, TargetId>>,
    next_id: AtomicU32,
    blocks: AtomicUsize,
    entries: AtomicUsize,
    orphan_stores: AtomicU64,
}

type BlockMap = HashMap<u64, TargetSet, MixHasher>;

struct TargetEntry {
    target: WorkerRank,
    blocks: AtomicUsize,
    state: Mutex<TargetState>,
}

struct TargetState {
    removed: bool,
    /// The sequence number the next event must carry.
    next_seq: u64,
    /// Set on a gap; cleared by a snapshot.
    needs_snapshot: bool,
    hashes: HashSet<u64, MixHasher>,
    /// Of `hashes`, those the target keeps in its second tier (restored on
    /// a hit at the cost of a copy), from its events and snapshots.
    tier2: HashSet<u64, MixHasher>,
    /// Blocks newly stored lately (see [`Inflow`]).
    inflow: Inflow,
}

/// How fast the blocks a target stored stop counting as recent.
const INFLOW_HALF_LIFE: Duration = Duration::from_secs(30);

/// Blocks stored lately, each counting less as it ages (halved every
/// [`INFLOW_HALF_LIFE`]): how fast the target's cache is turning over.
#[derive(Debug, Default, Clone, Copy)]
struct Inflow {
    value: f64,
    at: Option<Instant>,
}

impl Inflow {
    fn at(&self, now: Instant) -> f64 {
        let Some(at) = self.at else {
            return 0.0;
        };
        let age = now.saturating_duration_since(at).as_secs_f64();
        self.value * 0.5f64.powf(age / INFLOW_HALF_LIFE.as_secs_f64())
    }

    fn add(&mut self, blocks: usize, now: Instant) {
        if blocks > 0 {
            self.value = self.at(now) + blocks as f64;
            self.at = Some(now);
        }
    }
}

impl Default for KvIndexer {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for KvIndexer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndexer")
            .field("shards", &self.shards.len())
            .field("stats", &self.stats())
            .finish()
    }
}

impl KvIndexer {
    /// An empty index with [`DEFAULT_SHARDS`] shards.
    pub fn new() -> Self {
        Self::with_shards(DEFAULT_SHARDS)
    }

    /// An empty index with `shards` shards (rounded up to a power of two, ≥ 1).
    pub fn with_shards(shards: usize) -> Self {
        let n = shards.max(1).next_power_of_two();
        let hasher = MixHasher::random();
        Self {
            shards: (0..n)
                .map(|_| RwLock::new(HashMap::with_hasher(hasher)))
                .collect(),
            hasher,
            targets: RwLock::new(HashMap::new()),
            ids: RwLock::new(HashMap::new()),
            next_id: AtomicU32::new(0),
            blocks: AtomicUsize::new(0),
            entries: AtomicUsize::new(0),
            orphan_stores: AtomicU64::new(0),
        }
    }

    /// Registers `target` (empty, expecting event seq 1) and returns its id;
    /// an already registered target keeps its id and blocks.
    pub fn register(&self, target: WorkerRank) -> TargetId {
        if let Some(id) = self.ids.read().get(&target) {
            return *id;
        }
        let mut ids = self.ids.write();
        if let Some(id) = ids.get(&target) {
            return *id;
        }
        let id = TargetId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let entry = Arc::new(TargetEntry {
            target: target.clone(),
            blocks: AtomicUsize::new(0),
            state: Mutex::new(TargetState {
                removed: false,
                next_seq: 1,
                needs_snapshot: false,
                hashes: HashSet::with_hasher(self.hasher),
                tier2: HashSet::with_hasher(self.hasher),
                inflow: Inflow::default(),
            }),
        });
        self.targets.write().insert(id, entry);
        ids.insert(target, id);
        id
    }

    /// The id of a registered target.
    pub fn target_id(&self, target: &WorkerRank) -> Option<TargetId> {
        self.ids.read().get(target).copied()
    }

    /// The target behind an id.
    pub fn target(&self, id: TargetId) -> Option<WorkerRank> {
        self.entry(id).map(|e| e.target.clone())
    }

    /// Forgets a target and all its blocks at once. Returns how many blocks
    /// it held (0 when it was not registered).
    pub fn remove_target(&self, id: TargetId) -> usize {
        let Some(entry) = self.targets.write().remove(&id) else {
            return 0;
        };
        self.ids.write().remove(&entry.target);
        let mut state = entry.state.lock();
        state.removed = true;
        state.tier2.clear();
        let hashes = std::mem::replace(&mut state.hashes, HashSet::with_hasher(self.hasher));
        for h in &hashes {
            self.unlink(*h, id);
        }
        entry.blocks.store(0, Ordering::Relaxed);
        hashes.len()
    }

    /// Applies one event in sequence. An event past the expected sequence is
    /// a gap: it is not applied, and every later event is refused with
    /// [`IndexError::Gap`] until [`KvIndexer::apply_snapshot`].
    pub fn apply(&self, id: TargetId, event: &KvEvent) -> Result<Applied, IndexError> {
        let entry = self.entry(id).ok_or(IndexError::UnknownTarget(id))?;
        let mut state = entry.state.lock();
        if state.removed {
            return Err(IndexError::UnknownTarget(id));
        }
        if state.needs_snapshot || event.seq > state.next_seq {
            state.needs_snapshot = true;
            return Err(IndexError::Gap {
                target: id,
                expected: state.next_seq,
                got: event.seq,
            });
        }
        if event.seq < state.next_seq {
            return Ok(Applied::Stale);
        }
        state.next_seq = event.seq + 1;
        match &event.kind {
            KvEventKind::Stored { parent, hashes } => {
                self.store_locked(&entry, &mut state, id, *parent, hashes);
            }
            KvEventKind::Removed { hashes } => self.remove_locked(&entry, &mut state, id, hashes),
            KvEventKind::Moved { hashes, tier } => {
                for h in hashes {
                    if *tier >= 2 && state.hashes.contains(h) {
                        state.tier2.insert(*h);
                    } else {
                        state.tier2.remove(h);
                    }
                }
            }
            KvEventKind::Cleared => self.clear_locked(&entry, &mut state, id),
        }
        Ok(Applied::Applied)
    }

    /// Replaces a target's blocks with a snapshot current at `seq`, `tier2`
    /// of them in its second tier; the next event expected is `seq + 1`.
    pub fn apply_snapshot(
        &self,
        id: TargetId,
        seq: u64,
        hashes: &[u64],
        tier2: &[u64],
    ) -> Result<(), IndexError> {
        let entry = self.entry(id).ok_or(IndexError::UnknownTarget(id))?;
        let mut state = entry.state.lock();
        if state.removed {
            return Err(IndexError::UnknownTarget(id));
        }
        let mut wanted: HashSet<u64, MixHasher> = HashSet::with_hasher(self.hasher);
        wanted.extend(hashes.iter().copied());
        let gone: Vec<u64> = state
            .hashes
            .iter()
            .filter(|h| !wanted.contains(h))
            .copied()
            .collect();
        self.remove_locked(&entry, &mut state, id, &gone);
        for h in wanted {
            if state.hashes.insert(h) {
                self.link(h, id);
            }
        }
        entry.blocks.store(state.hashes.len(), Ordering::Relaxed);
        state.next_seq = seq + 1;
        state.needs_snapshot = false;
        state.tier2.clear();
        for &h in tier2 {
            if state.hashes.contains(&h) {
                state.tier2.insert(h);
            }
        }
        Ok(())
    }

    /// The sequence number the target's next event must carry, and whether
    /// it is waiting for a snapshot.
    pub fn position(&self, id: TargetId) -> Option<(u64, bool)> {
        let entry = self.entry(id)?;
        let state = entry.state.lock();
        (!state.removed).then_some((state.next_seq, state.needs_snapshot))
    }

    /// Stores blocks without sequence checks (the approximate index).
    pub fn store_unsequenced(&self, id: TargetId, hashes: &[u64]) -> Result<(), IndexError> {
        let entry = self.entry(id).ok_or(IndexError::UnknownTarget(id))?;
        let mut state = entry.state.lock();
        if state.removed {
            return Err(IndexError::UnknownTarget(id));
        }
        self.store_locked(&entry, &mut state, id, None, hashes);
        Ok(())
    }

    /// Removes blocks without sequence checks (the approximate index).
    pub fn remove_unsequenced(&self, id: TargetId, hashes: &[u64]) -> Result<(), IndexError> {
        let entry = self.entry(id).ok_or(IndexError::UnknownTarget(id))?;
        let mut state = entry.state.lock();
        if state.removed {
            return Err(IndexError::UnknownTarget(id));
        }
        self.remove_locked(&entry, &mut state, id, hashes);
        Ok(())
    }

    /// For each target holding the request's first block, the length of the
    /// longest prefix of `hashes` it holds. O(blocks × holders per block),
    /// taking one shard read lock at a time; stops as soon as no target
    /// still matches.
    pub fn find_matches(&self, hashes: &[u64]) -> OverlapScores {
        let mut scores = Vec::new();
        let Some((&first, rest)) = hashes.split_first() else {
            return OverlapScores { scores };
        };
        // Targets still matching, sorted by id.
        let mut active: Vec<TargetId> = match self.shard(first).read().get(&first) {
            Some(set) => set.as_slice().iter().map(|&i| TargetId(i)).collect(),
            None => return OverlapScores { scores },
        };
        for (i, h) in rest.iter().enumerate() {
            let depth = i as u32 + 1;
            {
                let shard = self.shard(*h).read();
                match shard.get(h) {
                    None => {
                        scores.extend(active.drain(..).map(|t| (t, depth)));
                    }
                    Some(set) => {
                        let holders = set.as_slice();
                        let mut j = 0;
                        active.retain(|t| {
                            while j < holders.len() && holders[j] < t.0 {
                                j += 1;
                            }
                            let held = j < holders.len() && holders[j] == t.0;
                            if !held {
                                scores.push((*t, depth));
                            }
                            held
                        });
                    }
                }
            }
            if active.is_empty() {
                break;
            }
        }
        let full = hashes.len() as u32;
        scores.extend(active.into_iter().map(|t| (t, full)));
        scores.sort_unstable_by_key(|(t, _)| *t);
        OverlapScores { scores }
    }

    /// A handle reading the target's block count without any index lock.
    pub fn handle(&self, id: TargetId) -> Option<TargetHandle> {
        self.entry(id).map(TargetHandle)
    }

    /// Blocks held by one target (0 when unknown). Lock-free after the
    /// registry lookup.
    pub fn target_blocks(&self, id: TargetId) -> usize {
        self.entry(id)
            .map_or(0, |e| e.blocks.load(Ordering::Relaxed))
    }

    /// A target's block hashes, sorted (for tests, debugging and resync checks).
    pub fn target_hashes(&self, id: TargetId) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .entry(id)
            .map(|e| e.state.lock().hashes.iter().copied().collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    }

    /// Distinct block hashes indexed.
    pub fn block_count(&self) -> usize {
        self.blocks.load(Ordering::Relaxed)
    }

    /// (target, block) pairs indexed.
    pub fn entry_count(&self) -> usize {
        self.entries.load(Ordering::Relaxed)
    }

    /// `Stored` events whose parent was not on the target.
    pub fn orphan_stores(&self) -> u64 {
        self.orphan_stores.load(Ordering::Relaxed)
    }

    /// Size figures, including an estimate of heap memory from table
    /// capacities (hashbrown: key + value + 1 control byte per bucket).
    pub fn stats(&self) -> IndexStats {
        let mut memory = 0usize;
        let map_bucket = std::mem::size_of::<(u64, TargetSet)>() + 1;
        for shard in self.shards.iter() {
            let shard = shard.read();
            memory += shard.capacity() * map_bucket;
            memory += shard.values().map(TargetSet::heap_bytes).sum::<usize>();
        }
        let set_bucket = std::mem::size_of::<u64>() + 1;
        let targets = self.targets.read();
        for entry in targets.values() {
            memory += entry.state.lock().hashes.capacity() * set_bucket;
        }
        let entries = self.entry_count();
        IndexStats {
            targets: targets.len(),
            blocks: self.block_count(),
            entries,
            memory_bytes: memory,
            bytes_per_entry: if entries == 0 {
                0.0
            } else {
                memory as f64 / entries as f64
            },
        }
    }

    /// How many of `hashes` (a prefix the target holds) it keeps in its
    /// second tier.
    pub fn tier2_blocks(&self, id: TargetId, hashes: &[u64]) -> u32 {
        let Some(entry) = self.entry(id) else {
            return 0;
        };
        let state = entry.state.lock();
        if state.tier2.is_empty() {
            return 0;
        }
        hashes.iter().filter(|h| state.tier2.contains(h)).count() as u32
    }

    fn entry(&self, id: TargetId) -> Option<Arc<TargetEntry>> {
        self.targets.read().get(&id).cloned()
    }

    fn shard(&self, hash: u64) -> &RwLock<BlockMap> {
        // Bits 32.. pick the shard; the map itself uses the mixed hash, so
        // shard choice and bucket choice are independent.
        let idx = (hash >> 32) as usize & (self.shards.len() - 1);
        &self.shards[idx]
    }

    fn store_locked(
        &self,
        entry: &TargetEntry,
        state: &mut TargetState,
        id: TargetId,
        parent: Option<u64>,
        hashes: &[u64],
    ) {
        if let Some(p) = parent
            && !state.hashes.contains(&p)
        {
            self.orphan_stores.fetch_add(1, Ordering::Relaxed);
        }
        let mut new = 0;
        for &h in hashes {
            if state.hashes.insert(h) {
                self.link(h, id);
                new += 1;
            }
        }
        state.inflow.add(new, Instant::now());
        entry.blocks.store(state.hashes.len(), Ordering::Relaxed);
    }

    fn remove_locked(
        &self,
        entry: &TargetEntry,
        state: &mut TargetState,
        id: TargetId,
        hashes: &[u64],
    ) {
        for h in hashes {
            state.tier2.remove(h);
            if state.hashes.remove(h) {
                self.unlink(*h, id);
            }
        }
        entry.blocks.store(state.hashes.len(), Ordering::Relaxed);
    }

    fn clear_locked(&self, entry: &TargetEntry, state: &mut TargetState, id: TargetId) {
        let hashes = std::mem::replace(&mut state.hashes, HashSet::with_hasher(self.hasher));
        for h in hashes {
            self.unlink(h, id);
        }
        entry.blocks.store(0, Ordering::Relaxed);
    }

    fn link(&self, hash: u64, id: TargetId) {
        let mut shard = self.shard(hash).write();
        match shard.get_mut(&hash) {
            Some(set) => {
                if set.insert(id.0) {
                    self.entries.fetch_add(1, Ordering::Relaxed);
                }
            }
            None => {
                shard.insert(hash, TargetSet::One(id.0));
                self.entries.fetch_add(1, Ordering::Relaxed);
                self.blocks.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn unlink(&self, hash: u64, id: TargetId) {
        let mut shard = self.shard(hash).write();
        let Some(set) = shard.get_mut(&hash) else {
            return;
        };
        if set.remove(id.0) {
            self.entries.fetch_sub(1, Ordering::Relaxed);
        }
        if set.is_empty() {
            shard.remove(&hash);
            self.blocks.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The targets holding one block: sorted ids, inline when there is one.
#[derive(Debug, Clone)]
enum TargetSet {
    One(u32),
    Many(Vec<u32>),
}

impl TargetSet {
    fn as_slice(&self) -> &[u32] {
        match self {
            TargetSet::One(id) => std::slice::from_ref(id),
            TargetSet::Many(v) => v,
        }
    }

    /// Inserts `id`; false if already present.
    fn insert(&mut self, id: u32) -> bool {
        match self {
            TargetSet::One(cur) if *cur == id => false,
            TargetSet::One(cur) => {
                let (a, b) = if *cur < id { (*cur, id) } else { (id, *cur) };
                *self = TargetSet::Many(vec![a, b]);
                true
            }
            TargetSet::Many(v) => match v.binary_search(&id) {
                Ok(_) => false,
                Err(pos) => {
                    v.insert(pos, id);
                    true
                }
            },
        }
    }

    /// Removes `id`; false if absent.
    fn remove(&mut self, id: u32) -> bool {
        match self {
            TargetSet::One(cur) if *cur == id => {
                *self = TargetSet::Many(Vec::new());
                true
            }
            TargetSet::One(_) => false,
            TargetSet::Many(v) => match v.binary_search(&id) {
                Ok(pos) => {
                    v.remove(pos);
                    if v.len() == 1 {
                        *self = TargetSet::One(v[0]);
                    }
                    true
                }
                Err(_) => false,
            },
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, TargetSet::Many(v) if v.is_empty())
    }

    fn heap_bytes(&self) -> usize {
        match self {
            TargetSet::One(_) => 0,
            TargetSet::Many(v) => v.capacity() * std::mem::size_of::<u32>(),
        }
    }
}

/// Hasher for keys that are already hashes: one keyed multiply-fold, so the
/// map's bucket and control bits come from all 64 bits of the key and an
/// outsider cannot line keys up into one bucket chain without the key.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MixHasher {
    key: u64,
}

impl MixHasher {
    fn random() -> Self {
        Self {
            key: rand::random::<u64>() | 1,
        }
    }
}

impl BuildHasher for MixHasher {
    type Hasher = MixState;
    fn build_hasher(&self) -> MixState {
        MixState {
            key: self.key,
            state: 0,
        }
    }
}

pub(crate) struct MixState {
    key: u64,
    state: u64,
}

impl Hasher for MixState {
    fn finish(&self) -> u64 {
        self.state
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u64(&mut self, v: u64) {
        let m = u128::from(v ^ self.state ^ self.key) * u128::from(0x9E37_79B9_7F4A_7C15_u64);
        self.state = (m as u64) ^ ((m >> 64) as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use sluice_tokens::sequence_block_hashes;

    fn stored(seq: u64, parent: Option<u64>, hashes: &[u64]) -> KvEvent {
        KvEvent {
            seq,
            kind: KvEventKind::Stored {
                parent,
                hashes: hashes.to_vec(),
            },
        }
    }

    fn removed(seq: u64, hashes: &[u64]) -> KvEvent {
        KvEvent {
            seq,
            kind: KvEventKind::Removed {
                hashes: hashes.to_vec(),
            },
        }
    }

    fn prompt(seed: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| seed * 100_000 + i).collect()
    }

    #[test]
    fn recent_stores_count_new_blocks_only_and_halve_every_half_life() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let h = sequence_block_hashes(&prompt(1, 8 * 16), 16);
        idx.apply(a, &stored(1, None, &h[..6])).expect("apply");
        // Stored again with two more: only the two are new.
        idx.apply(a, &stored(2, None, &h)).expect("apply");
        let handle = idx.handle(a).expect("handle");
        let now = Instant::now();
        let fresh = handle.recent_stores(now);
        assert!((7.99..=8.0).contains(&fresh), "{fresh}");
        let later = handle.recent_stores(now + INFLOW_HALF_LIFE);
        assert!((3.99..=4.0).contains(&later), "{later}");
        let mut inflow = Inflow::default();
        assert_eq!(inflow.at(now), 0.0);
        inflow.add(10, now);
        inflow.add(0, now + INFLOW_HALF_LIFE);
        inflow.add(5, now + INFLOW_HALF_LIFE * 2);
        assert!((inflow.at(now + INFLOW_HALF_LIFE * 2) - 7.5).abs() < 1e-9);
    }

    #[test]
    fn overlap_is_longest_present_prefix_per_target() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let b = idx.register(WorkerRank::new("b", 0));
        let h = sequence_block_hashes(&prompt(1, 64), 16); // 4 blocks
        idx.apply(a, &stored(1, None, &h)).expect("apply");
        idx.apply(b, &stored(1, None, &h[..2])).expect("apply");
        let m = idx.find_matches(&h);
        assert_eq!(m.get(a), 4);
        assert_eq!(m.get(b), 2);
        assert_eq!(m.max(), 4);
    }

    #[test]
    fn a_missing_middle_block_ends_the_run() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let h = sequence_block_hashes(&prompt(2, 80), 16);
        idx.apply(a, &stored(1, None, &h)).expect("apply");
        idx.apply(a, &removed(2, &h[2..3])).expect("apply");
        assert_eq!(idx.find_matches(&h).get(a), 2);
    }

    #[test]
    fn different_prompts_do_not_match() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let h1 = sequence_block_hashes(&prompt(3, 64), 16);
        let h2 = sequence_block_hashes(&prompt(4, 64), 16);
        idx.apply(a, &stored(1, None, &h1)).expect("apply");
        assert!(idx.find_matches(&h2).scores.is_empty());
        assert!(idx.find_matches(&[]).scores.is_empty());
    }

    #[test]
    fn removing_a_target_forgets_all_its_blocks_at_once() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let b = idx.register(WorkerRank::new("b", 1));
        let h = sequence_block_hashes(&prompt(5, 160), 16);
        idx.apply(a, &stored(1, None, &h)).expect("apply");
        idx.apply(b, &stored(1, None, &h[..5])).expect("apply");
        assert_eq!(idx.entry_count(), 15);
        assert_eq!(idx.remove_target(a), 10);
        let m = idx.find_matches(&h);
        assert_eq!(m.get(a), 0);
        assert_eq!(m.get(b), 5);
        assert_eq!(idx.block_count(), 5);
        assert_eq!(idx.entry_count(), 5);
        assert_eq!(
            idx.apply(a, &stored(2, None, &h)),
            Err(IndexError::UnknownTarget(a))
        );
        // Registered again: a fresh, empty target.
        let a2 = idx.register(WorkerRank::new("a", 0));
        assert_ne!(a, a2);
        assert_eq!(idx.target_blocks(a2), 0);
    }

    #[test]
    fn cleared_empties_only_that_target() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let b = idx.register(WorkerRank::new("b", 0));
        let h = sequence_block_hashes(&prompt(6, 48), 16);
        idx.apply(a, &stored(1, None, &h)).expect("apply");
        idx.apply(b, &stored(1, None, &h)).expect("apply");
        idx.apply(
            a,
            &KvEvent {
                seq: 2,
                kind: KvEventKind::Cleared,
            },
        )
        .expect("apply");
        assert_eq!(idx.target_blocks(a), 0);
        assert_eq!(idx.find_matches(&h).get(b), 3);
        assert_eq!(idx.block_count(), 3);
    }

    #[test]
    fn replayed_events_are_stale_and_ignored() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let h = sequence_block_hashes(&prompt(7, 48), 16);
        assert_eq!(idx.apply(a, &stored(1, None, &h)), Ok(Applied::Applied));
        assert_eq!(idx.apply(a, &removed(1, &h)), Ok(Applied::Stale));
        assert_eq!(idx.target_blocks(a), 3);
    }

    #[test]
    fn a_gap_needs_a_snapshot_which_restores_the_same_index() {
        // Reference: every event applied.
        let events: Vec<KvEvent> = {
            let h1 = sequence_block_hashes(&prompt(8, 64), 16);
            let h2 = sequence_block_hashes(&prompt(9, 64), 16);
            vec![
                stored(1, None, &h1),
                stored(2, None, &h2[..2]),
                stored(3, Some(h2[1]), &h2[2..]),
                removed(4, &h1[3..]),
                removed(5, &h2[1..2]),
            ]
        };
        let full = KvIndexer::new();
        let t = full.register(WorkerRank::new("w", 0));
        for e in &events {
            full.apply(t, e).expect("apply");
        }

        // Subscriber that misses event 3.
        let idx = KvIndexer::new();
        let w = idx.register(WorkerRank::new("w", 0));
        idx.apply(w, &events[0]).expect("apply");
        idx.apply(w, &events[1]).expect("apply");
        assert_eq!(
            idx.apply(w, &events[3]),
            Err(IndexError::Gap {
                target: w,
                expected: 3,
                got: 4
            })
        );
        // Still refused until a snapshot.
        assert!(matches!(
            idx.apply(w, &events[4]),
            Err(IndexError::Gap { .. })
        ));
        assert_eq!(idx.position(w), Some((3, true)));

        // The worker's snapshot at seq 4, then event 5 in sequence.
        let mut snap = full_at(&events[..4]);
        snap.reverse();
        idx.apply_snapshot(w, 4, &snap, &[]).expect("snapshot");
        assert_eq!(idx.position(w), Some((5, false)));
        idx.apply(w, &events[4]).expect("apply after resync");
        assert_eq!(idx.target_hashes(w), full.target_hashes(t));
        assert_eq!(idx.block_count(), full.block_count());
    }

    /// A snapshot says which blocks are in the worker's second tier, as
    /// its `Moved` events did: a resync keeps pricing them as copies.
    #[test]
    fn a_snapshot_keeps_the_second_tier_its_events_named() {
        let h = sequence_block_hashes(&prompt(8, 64), 16);
        let events = KvIndexer::new();
        let t = events.register(WorkerRank::new("w", 0));
        events.apply(t, &stored(1, None, &h)).expect("apply");
        let moved = KvEvent {
            seq: 2,
            kind: KvEventKind::Moved {
                hashes: h[2..].to_vec(),
                tier: 2,
            },
        };
        events.apply(t, &moved).expect("apply");
        assert_eq!(events.tier2_blocks(t, &h), 2);

        let resynced = KvIndexer::new();
        let w = resynced.register(WorkerRank::new("w", 0));
        // A hash the snapshot does not hold is no second-tier block.
        let tier2 = [h[2], h[3], 42];
        resynced.apply_snapshot(w, 2, &h, &tier2).expect("snapshot");
        assert_eq!(resynced.tier2_blocks(w, &h), 2);
        assert_eq!(resynced.target_hashes(w), events.target_hashes(t));
    }

    fn full_at(events: &[KvEvent]) -> Vec<u64> {
        let idx = KvIndexer::new();
        let t = idx.register(WorkerRank::new("ref", 0));
        for e in events {
            idx.apply(t, e).expect("apply");
        }
        idx.target_hashes(t)
    }

    #[test]
    fn first_event_after_one_is_a_gap_on_a_new_target() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        assert!(matches!(
            idx.apply(a, &stored(7, None, &[1])),
            Err(IndexError::Gap {
                expected: 1,
                got: 7,
                ..
            })
        ));
    }

    #[test]
    fn orphan_stores_are_counted_but_indexed() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        idx.apply(a, &stored(1, Some(42), &[7, 8])).expect("apply");
        assert_eq!(idx.orphan_stores(), 1);
        assert_eq!(idx.target_blocks(a), 2);
    }

    #[test]
    fn many_holders_intersect_in_id_order() {
        let idx = KvIndexer::new();
        let h = sequence_block_hashes(&prompt(10, 16 * 8), 16);
        let ids: Vec<TargetId> = (0..20)
            .map(|i| idx.register(WorkerRank::new(format!("w{i}"), 0)))
            .collect();
        for (i, id) in ids.iter().enumerate() {
            let n = i % 9;
            idx.apply(*id, &stored(1, None, &h[..n])).expect("apply");
        }
        let m = idx.find_matches(&h);
        for (i, id) in ids.iter().enumerate() {
            assert_eq!(m.get(*id) as usize, i % 9, "target {i}");
        }
    }

    #[test]
    fn stats_report_memory_per_entry() {
        let idx = KvIndexer::new();
        let a = idx.register(WorkerRank::new("a", 0));
        let hashes: Vec<u64> = (0..10_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        idx.apply(a, &stored(1, None, &hashes)).expect("apply");
        let s = idx.stats();
        assert_eq!(s.blocks, 10_000);
        assert_eq!(s.entries, 10_000);
        assert_eq!(s.targets, 1);
        // 32-byte bucket + 9-byte set bucket at load factors 0.44..0.875.
        assert!(
            s.bytes_per_entry > 40.0 && s.bytes_per_entry < 100.0,
            "{s:?}"
        );
        assert_eq!(std::mem::size_of::<(u64, TargetSet)>(), 32);
    }

    #[test]
    fn concurrent_events_and_lookups_agree_at_the_end() {
        let idx = Arc::new(KvIndexer::with_shards(8));
        let chains: Vec<Vec<u64>> = (0..8)
            .map(|p| sequence_block_hashes(&prompt(100 + p, 16 * 32), 16))
            .collect();
        let chains = Arc::new(chains);
        let writers: Vec<_> = (0..4)
            .map(|w| {
                let idx = Arc::clone(&idx);
                let chains = Arc::clone(&chains);
                std::thread::spawn(move || {
                    let id = idx.register(WorkerRank::new(format!("w{w}"), 0));
                    let mut seq = 0;
                    for round in 0..50 {
                        for c in chains.iter() {
                            seq += 1;
                            idx.apply(id, &stored(seq, None, c)).expect("apply");
                            seq += 1;
                            let cut = (round + w) % c.len();
                            idx.apply(id, &removed(seq, &c[cut..])).expect("apply");
                        }
                    }
                    id
                })
            })
            .collect();
        let reader = {
            let idx = Arc::clone(&idx);
            let chains = Arc::clone(&chains);
            std::thread::spawn(move || {
                for _ in 0..2000 {
                    for c in chains.iter() {
                        let m = idx.find_matches(c);
                        assert!(m.max() as usize <= c.len());
                    }
                }
            })
        };
        let ids: Vec<TargetId> = writers
            .into_iter()
            .map(|h| h.join().expect("writer"))
            .collect();
        reader.join().expect("reader");
        for (w, id) in ids.iter().enumerate() {
            let cut = (49 + w) % 32;
            for c in chains.iter() {
                assert_eq!(idx.find_matches(c).get(*id) as usize, cut);
            }
        }
        let expected: usize = ids.iter().map(|id| idx.target_blocks(*id)).sum();
        assert_eq!(idx.entry_count(), expected);
    }

    proptest! {
        #[test]
        fn find_matches_equals_naive_scan(
            ops in proptest::collection::vec((0usize..4, 0usize..6, 0usize..10, any::<bool>()), 1..60),
            query in 0usize..6,
        ) {
            let chains: Vec<Vec<u64>> = (0..6)
                .map(|p| sequence_block_hashes(&prompt(200 + p as u32 % 3, 16 * (4 + p)), 16))
                .collect();
            let idx = KvIndexer::with_shards(4);
            let ids: Vec<TargetId> = (0..4).map(|t| idx.register(WorkerRank::new(format!("t{t}"), 0))).collect();
            let mut naive: Vec<HashSet<u64>> = vec![HashSet::new(); 4];
            let mut seqs = [0u64; 4];
            for (t, c, n, store) in ops {
                let n = n.min(chains[c].len());
                seqs[t] += 1;
                let ev = if store { stored(seqs[t], None, &chains[c][..n]) } else { removed(seqs[t], &chains[c][..n]) };
                idx.apply(ids[t], &ev).expect("apply");
                for h in &chains[c][..n] {
                    if store { naive[t].insert(*h); } else { naive[t].remove(h); }
                }
            }
            let q = &chains[query];
            let m = idx.find_matches(q);
            for t in 0..4 {
                let expect = q.iter().take_while(|h| naive[t].contains(h)).count() as u32;
                prop_assert_eq!(m.get(ids[t]), expect);
            }
            let distinct: HashSet<u64> = naive.iter().flatten().copied().collect();
            prop_assert_eq!(idx.block_count(), distinct.len());
        }
    }
}
