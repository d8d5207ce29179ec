//! The KV event stream: every block the prefix cache stores or evicts, numbered
//! gap-free from 1, kept in a bounded replay ring, fanned out to live
//! subscribers, and mirrored into the set of cached hashes so a snapshot is
//! always consistent with the sequence number it reports.
//!
//! Shared between the engine thread (which publishes) and any number of
//! subscribers on other threads; one mutex guards the ring, the mirror and
//! the broadcast sender, so `subscribe` never misses or repeats an event.

use std::collections::{HashMap, HashSet, VecDeque};

use parking_lot::Mutex;
use tokio::sync::broadcast;

/// A change to the set of cached blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks newly cached, in chain order. `parent_hash` is the sequence hash
    /// of the block before the first one (absent when the chain starts at a
    /// prompt's first block).
    Stored {
        parent_hash: Option<u64>,
        block_hashes: Vec<u64>,
    },
    /// Blocks evicted from the cache.
    Removed { block_hashes: Vec<u64> },
    /// Blocks still cached that moved between tiers: to the second tier
    /// (`tier` 2: evicted from KV memory, restored on a hit at the cost of
    /// a copy) or back into KV memory (`tier` 1).
    Moved { block_hashes: Vec<u64>, tier: u32 },
    /// Every cached block is gone.
    Cleared,
}

/// A [`KvEvent`] with its gap-free sequence number (the first event is 1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvEventRecord {
    pub seq: u64,
    pub event: KvEvent,
}

/// What `subscribe` hands back: the events after `from_seq` still in the
/// ring, then every later event on `live`, with no gap and no repeat.
///
/// `live` is a broadcast receiver as deep as the ring: a subscriber that
/// falls that far behind gets `RecvError::Lagged` and must resync from a
/// snapshot.
#[derive(Debug)]
pub struct KvSubscription {
    pub backlog: Vec<KvEventRecord>,
    pub live: broadcast::Receiver<KvEventRecord>,
}

/// The requested events are no longer in the ring (or `from_seq` is ahead
/// of the stream): take a [`KvSnapshot`] and subscribe from its `seq`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("KV events after {from_seq} are gone (ring holds {oldest}..={last}); take a snapshot")]
pub struct SnapshotRequired {
    pub from_seq: u64,
    /// Oldest sequence number still in the ring (`last + 1` when empty).
    pub oldest: u64,
    /// Latest sequence number published.
    pub last: u64,
}

/// Every cached block hash as of event `seq` (inclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSnapshot {
    pub seq: u64,
    /// Cached sequence hashes, in the order they were stored.
    pub block_hashes: Vec<u64>,
    /// Of `block_hashes`, those in the second tier (a hit restores them at
    /// the cost of a copy), in the same order.
    pub tier2_hashes: Vec<u64>,
}

/// The event log of one engine (one data-parallel rank).
#[derive(Debug)]
pub struct KvEventLog {
    inner: Mutex<LogInner>,
}

#[derive(Debug)]
struct LogInner {
    last_seq: u64,
    capacity: usize,
    ring: VecDeque<KvEventRecord>,
    tx: broadcast::Sender<KvEventRecord>,
    /// Cached hash → order it was stored in (for a stable snapshot order).
    cached: HashMap<u64, u64>,
    /// Of `cached`, the hashes in the second tier.
    tier2: HashSet<u64>,
    next_order: u64,
}

impl KvEventLog {
    /// A log whose replay ring holds the last `capacity` events (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        let (tx, _) = broadcast::channel(capacity);
        Self {
            inner: Mutex::new(LogInner {
                last_seq: 0,
                capacity,
                ring: VecDeque::with_capacity(capacity.min(4096)),
                tx,
                cached: HashMap::new(),
                tier2: HashSet::new(),
                next_order: 0,
            }),
        }
    }

    /// Numbers and publishes one event; returns its sequence number.
    pub(crate) fn publish(&self, event: KvEvent) -> u64 {
        let mut g = self.inner.lock();
        match &event {
            KvEvent::Stored { block_hashes, .. } => {
                for &h in block_hashes {
                    let order = g.next_order;
                    g.next_order += 1;
                    g.cached.insert(h, order);
                    g.tier2.remove(&h);
                }
            }
            KvEvent::Removed { block_hashes } => {
                for h in block_hashes {
                    g.cached.remove(h);
                    g.tier2.remove(h);
                }
            }
            // Still cached, in the tier named.
            KvEvent::Moved { block_hashes, tier } => {
                for h in block_hashes {
                    if *tier >= 2 && g.cached.contains_key(h) {
                        g.tier2.insert(*h);
                    } else {
                        g.tier2.remove(h);
                    }
                }
            }
            KvEvent::Cleared => {
                g.cached.clear();
                g.tier2.clear();
            }
        }
        g.last_seq += 1;
        let record = KvEventRecord {
            seq: g.last_seq,
            event,
        };
        if g.ring.len() == g.capacity {
            g.ring.pop_front();
        }
        g.ring.push_back(record.clone());
        // No receiver is not an error: nobody is subscribed yet.
        let _ = g.tx.send(record);
        g.last_seq
    }

    /// Events with `seq > from_seq`: the backlog from the ring plus a live
    /// receiver, or [`SnapshotRequired`] when the ring no longer holds
    /// `from_seq + 1` or `from_seq` is ahead of the stream (the engine
    /// restarted). `from_seq = 0` means "from the first event ever".
    pub fn subscribe(&self, from_seq: u64) -> Result<KvSubscription, SnapshotRequired> {
        let g = self.inner.lock();
        let oldest = g.ring.front().map_or(g.last_seq + 1, |r| r.seq);
        if from_seq > g.last_seq || from_seq + 1 < oldest {
            return Err(SnapshotRequired {
                from_seq,
                oldest,
                last: g.last_seq,
            });
        }
        let backlog = g
            .ring
            .iter()
            .filter(|r| r.seq > from_seq)
            .cloned()
            .collect();
        Ok(KvSubscription {
            backlog,
            live: g.tx.subscribe(),
        })
    }

    /// Every cached hash, consistent with the returned sequence number.
    pub fn snapshot(&self) -> KvSnapshot {
        let g = self.inner.lock();
        let mut hashes: Vec<(u64, u64)> = g.cached.iter().map(|(&h, &o)| (o, h)).collect();
        hashes.sort_unstable();
        let block_hashes: Vec<u64> = hashes.into_iter().map(|(_, h)| h).collect();
        let tier2_hashes = block_hashes
            .iter()
            .copied()
            .filter(|h| g.tier2.contains(h))
            .collect();
        KvSnapshot {
            seq: g.last_seq,
            block_hashes,
            tier2_hashes,
        }
    }

    /// How many leading `hashes` are cached, as of the latest event (for a
    /// worker deciding local or remote prefill without asking the engine).
    pub fn cached_prefix_len(&self, hashes: &[u64]) -> usize {
        let g = self.inner.lock();
        hashes
            .iter()
            .take_while(|h| g.cached.contains_key(h))
            .count()
    }

    /// Sequence number of the latest event (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.inner.lock().last_seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(h: &[u64]) -> KvEvent {
        KvEvent::Stored {
            parent_hash: None,
            block_hashes: h.to_vec(),
        }
    }

    #[test]
    fn events_are_numbered_gap_free_from_one() {
        let log = KvEventLog::new(8);
        assert_eq!(log.publish(stored(&[1])), 1);
        assert_eq!(
            log.publish(KvEvent::Removed {
                block_hashes: vec![1]
            }),
            2
        );
        assert_eq!(log.publish(KvEvent::Cleared), 3);
        assert_eq!(log.last_seq(), 3);
    }

    #[test]
    fn subscribe_replays_backlog_then_live_without_gap() {
        let log = KvEventLog::new(8);
        log.publish(stored(&[1]));
        log.publish(stored(&[2]));
        let mut sub = log.subscribe(1).expect("in ring");
        assert_eq!(
            sub.backlog.iter().map(|r| r.seq).collect::<Vec<_>>(),
            vec![2]
        );
        log.publish(stored(&[3]));
        assert_eq!(sub.live.try_recv().expect("live event").seq, 3);
    }

    #[test]
    fn subscribe_older_than_ring_requires_snapshot() {
        let log = KvEventLog::new(2);
        for h in 0..5 {
            log.publish(stored(&[h]));
        }
        let err = log.subscribe(1).expect_err("events 2.. partly gone");
        assert_eq!(
            err,
            SnapshotRequired {
                from_seq: 1,
                oldest: 4,
                last: 5
            }
        );
        assert!(log.subscribe(3).is_ok());
        assert!(log.subscribe(0).is_err());
    }

    #[test]
    fn subscribe_ahead_of_stream_requires_snapshot() {
        let log = KvEventLog::new(4);
        log.publish(stored(&[1]));
        assert!(log.subscribe(7).is_err());
        assert!(log.subscribe(1).expect("caught up").backlog.is_empty());
    }

    #[test]
    fn snapshot_mirrors_events() {
        let log = KvEventLog::new(4);
        log.publish(stored(&[10, 11]));
        log.publish(stored(&[12]));
        log.publish(KvEvent::Removed {
            block_hashes: vec![11],
        });
        assert_eq!(
            log.snapshot(),
            KvSnapshot {
                seq: 3,
                block_hashes: vec![10, 12],
                tier2_hashes: vec![],
            }
        );
        // A block demoted to the second tier is still cached, and the
        // snapshot says where; one restored or stored again is back in
        // memory.
        let moved = |h: &[u64], tier| KvEvent::Moved {
            block_hashes: h.to_vec(),
            tier,
        };
        log.publish(moved(&[10, 12], 2));
        log.publish(moved(&[10], 1));
        assert_eq!(
            log.snapshot(),
            KvSnapshot {
                seq: 5,
                block_hashes: vec![10, 12],
                tier2_hashes: vec![12],
            }
        );
        log.publish(KvEvent::Cleared);
        assert_eq!(
            log.snapshot(),
            KvSnapshot {
                seq: 6,
                block_hashes: vec![],
                tier2_hashes: vec![],
            }
        );
    }
}
