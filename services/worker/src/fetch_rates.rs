//! The rates this worker's prefix fetches arrived at: one over every
//! fetch, and one per peer fetched from, which is what the transport
//! between that pair moves at (shm on one host, RDMA or tcp across). The
//! load report carries both; the router prices a fetch by the pair's.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

/// Weight of the newest fetch in a rate.
const EWMA: f64 = 0.2;
/// Peers whose rate is kept: the ones fetched from most lately.
const MAX_PEERS: usize = 64;

/// Fetch rates, overall and by peer (bytes per second), under one lock
/// (a fetch folds into both).
#[derive(Debug, Default)]
pub struct FetchRates(Mutex<Rates>);

#[derive(Debug, Default)]
struct Rates {
    /// Over every fetch; before any, what the worker expects (0: it does
    /// not fetch).
    overall: f64,
    /// Peer worker id → (rate, when last measured in fetches counted).
    rates: HashMap<String, (f64, u64)>,
    fetches: u64,
}

impl FetchRates {
    /// What a fetch is expected to move at before one was measured.
    pub fn expect(&self, bytes_per_sec: u64) {
        self.0.lock().overall = bytes_per_sec as f64;
    }

    /// The rate over every fetch.
    pub fn overall(&self) -> u64 {
        self.0.lock().overall as u64
    }

    /// The rate of fetches from `peer`, or the overall one before any.
    pub fn from_peer(&self, peer: &str) -> u64 {
        let r = self.0.lock();
        r.rates.get(peer).map_or(r.overall, |&(rate, _)| rate) as u64
    }

    /// Every peer's rate, for the load report.
    pub fn by_peer(&self) -> HashMap<String, u64> {
        self.0
            .lock()
            .rates
            .iter()
            .map(|(id, &(rate, _))| (id.clone(), rate as u64))
            .collect()
    }

    /// Folds one fetch of `bytes` from `peer` that took `took` into its
    /// peer's rate and the overall one. The peer fetched from longest ago
    /// makes room beyond [`MAX_PEERS`].
    pub fn measured(&self, peer: &str, bytes: u64, took: Duration) {
        let sample = bytes as f64 / took.as_secs_f64().max(1e-6);
        let fold = |old: f64| {
            if old > 0.0 {
                old + EWMA * (sample - old)
            } else {
                sample
            }
        };
        let mut r = self.0.lock();
        r.overall = fold(r.overall);
        r.fetches += 1;
        let now = r.fetches;
        if !r.rates.contains_key(peer)
            && r.rates.len() >= MAX_PEERS
            && let Some(oldest) = r
                .rates
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(id, _)| id.clone())
        {
            r.rates.remove(&oldest);
        }
        let entry = r.rates.entry(peer.to_owned()).or_insert((0.0, now));
        *entry = (fold(entry.0), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each pair keeps its own rate; a peer never fetched from is
    /// expected at the overall one.
    #[test]
    fn each_peer_has_its_own_rate_and_the_rest_the_overall_one() {
        let r = FetchRates::default();
        r.expect(1_000);
        assert_eq!(r.from_peer("a"), 1_000);
        // 10 GB/s from a (shm), 1 GB/s from b (tcp).
        r.measured("a", 10_000_000, Duration::from_millis(1));
        r.measured("b", 1_000_000, Duration::from_millis(1));
        assert_eq!(r.from_peer("a"), 10_000_000_000);
        assert_eq!(r.from_peer("b"), 1_000_000_000);
        assert_eq!(r.by_peer().len(), 2);
        let overall = r.overall();
        assert!(
            overall > 1_000_000_000 && overall < 10_000_000_000,
            "{overall}"
        );
        assert_eq!(r.from_peer("c"), overall);
        // A second sample moves a's rate by the EWMA's weight.
        r.measured("a", 5_000_000, Duration::from_millis(1));
        assert_eq!(r.from_peer("a"), 9_000_000_000);
    }

    #[test]
    fn the_peer_fetched_from_longest_ago_makes_room() {
        let r = FetchRates::default();
        for i in 0..MAX_PEERS {
            r.measured(&format!("p{i}"), 1_000, Duration::from_millis(1));
        }
        r.measured("p0", 1_000, Duration::from_millis(1));
        r.measured("new", 1_000, Duration::from_millis(1));
        let peers = r.by_peer();
        assert_eq!(peers.len(), MAX_PEERS);
        assert!(peers.contains_key("p0") && peers.contains_key("new"));
        assert!(!peers.contains_key("p1"), "p1 was the least recent");
    }
}
