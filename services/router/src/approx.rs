//! The approximate index of `approx` mode: each target's cache predicted from
//! the router's own placements, each block forgotten `ttl` after the last
//! placement that sent it there.
//!
//! Owns a private [`KvIndexer`] fed with unsequenced stores and removals and
//! the expiry queue. Used when workers publish no KV events.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::indexer::{KvIndexer, OverlapScores, TargetHandle, TargetId};
use sluice_runtime::discovery::WorkerRank;

/// Blocks predicted per target from placements, expiring after a TTL.
#[derive(Debug)]
pub(crate) struct ApproxIndex {
    index: KvIndexer,
    ttl: Duration,
    expiry: Mutex<Expiry>,
}

#[derive(Debug, Default)]
struct Expiry {
    /// (target, hash) → when it expires (the latest placement wins).
    deadline: HashMap<(TargetId, u64), Instant>,
    /// Placements in time order: (expires, target, hashes).
    queue: VecDeque<(Instant, TargetId, Vec<u64>)>,
}

impl ApproxIndex {
    pub(crate) fn new(ttl: Duration) -> Self {
        Self {
            index: KvIndexer::new(),
            ttl,
            expiry: Mutex::new(Expiry::default()),
        }
    }

    pub(crate) fn register(&self, target: WorkerRank) -> (TargetId, Option<TargetHandle>) {
        let id = self.index.register(target);
        (id, self.index.handle(id))
    }

    pub(crate) fn remove_target(&self, id: TargetId) {
        self.index.remove_target(id);
        self.expiry.lock().deadline.retain(|(t, _), _| *t != id);
    }

    /// Predicts that `id` now caches `hashes`, until `now + ttl`.
    pub(crate) fn record(&self, id: TargetId, hashes: &[u64], now: Instant) {
        if hashes.is_empty() {
            return;
        }
        let expires = now + self.ttl;
        let mut expiry = self.expiry.lock();
        for h in hashes {
            expiry.deadline.insert((id, *h), expires);
        }
        expiry.queue.push_back((expires, id, hashes.to_vec()));
        // A removed target makes this fail; its blocks are already gone.
        let _ = self.index.store_unsequenced(id, hashes);
    }

    /// Forgets every prediction whose TTL has passed.
    pub(crate) fn expire(&self, now: Instant) {
        let mut expiry = self.expiry.lock();
        while expiry.queue.front().is_some_and(|(at, _, _)| *at <= now) {
            let Some((_, id, hashes)) = expiry.queue.pop_front() else {
                break;
            };
            let gone: Vec<u64> = hashes
                .into_iter()
                .filter(|h| match expiry.deadline.get(&(id, *h)) {
                    Some(at) if *at <= now => {
                        expiry.deadline.remove(&(id, *h));
                        true
                    }
                    _ => false,
                })
                .collect();
            let _ = self.index.remove_unsequenced(id, &gone);
        }
    }

    pub(crate) fn find_matches(&self, hashes: &[u64]) -> OverlapScores {
        self.index.find_matches(hashes)
    }

    pub(crate) fn index(&self) -> &KvIndexer {
        &self.index
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_expire_after_the_ttl_of_the_last_placement() {
        let t0 = Instant::now();
        let a = ApproxIndex::new(Duration::from_secs(10));
        let (id, _) = a.register(WorkerRank::new("w", 0));
        a.record(id, &[1, 2, 3], t0);
        a.record(id, &[1, 2], t0 + Duration::from_secs(5));
        assert_eq!(a.find_matches(&[1, 2, 3]).get(id), 3);
        a.expire(t0 + Duration::from_secs(10));
        assert_eq!(a.find_matches(&[1, 2, 3]).get(id), 2);
        a.expire(t0 + Duration::from_secs(15));
        assert_eq!(a.find_matches(&[1, 2, 3]).get(id), 0);
        assert_eq!(a.index().block_count(), 0);
    }
}
