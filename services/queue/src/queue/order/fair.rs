//! Fair share among the classes of one band: a virtual token counter (VTC,
//! Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).
//!
//! Every class (a tenant, a priority, a tenant and priority: see
//! `--wfq-class`) has a counter of the work it was served, divided by its
//! weight. The next release goes to the backlogged class with the smallest
//! counter (the earliest head request on a tie), FIFO within the class.
//! Work is charged as it becomes known: a request's estimated cost when it
//! is released (its prompt tokens, or 1 when counting requests), a
//! correction when its placement reports the cached prefix, and its output
//! tokens as they are produced. Refunds (a request that leaves before it
//! ran) charge negative work.
//!
//! # Idle classes bank no credit
//!
//! A class that becomes backlogged is lifted to at least the smallest
//! counter among the backlogged classes (or, with none, the band's virtual
//! time: the counter of the last class released from): it competes from
//! the current round on, never with credit saved while it sent nothing.
//! A lifted class wins the tie with the classes at that counter for its
//! first request (it was below them: it is the one served least), so a
//! light tenant's request waits for no release of a backlogged heavy one;
//! otherwise ties go to the earliest head request. A
//! class that has no held and no running request and whose counter is at
//! or below the virtual time is forgotten (the lift would restore it); a
//! band with neither held nor running requests is dropped by its owner.
//!
//! # Bound
//!
//! With unit cost (`wfq` counting requests) this is weighted fair queueing
//! by request: between two releases of a backlogged class of weight `w`,
//! its counter grows by `1/w`, and every other class `j` is released from
//! only while its counter is at most the first's, so at most
//! `⌈w_j/w⌉ + 1` times. The `k`-th held request (0-based) of a class that
//! is backlogged throughout is released within `k·W/w + n` releases of the
//! band, `W` the sum of the weights and `n` the number of classes. With
//! token cost the same holds in tokens, up to one request's cost per class.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use super::TotalF64;

/// One band's classes and their counters.
#[derive(Debug, Clone, Default)]
pub(crate) struct Band {
    classes: HashMap<Arc<str>, Class>,
    /// Backlogged classes by (counter, tie, class): `tie` is the head
    /// request's seq, with [`QUEUED`] set unless the class was lifted.
    ready: BTreeSet<(TotalF64, u64, Arc<str>)>,
    /// The counter of the class last released from, when it was released.
    vtime: f64,
    /// Held requests in all classes.
    pub(crate) len: usize,
    /// Requests released and not yet finished.
    running: usize,
}

/// Set in the tie-break of a class that was not lifted: lifted classes
/// sort first among equal counters.
const QUEUED: u64 = 1 << 63;

#[derive(Debug, Clone)]
struct Class {
    /// Held requests: (seq, cost charged at release).
    fifo: VecDeque<(u64, f64)>,
    weight: f64,
    counter: f64,
    running: usize,
    /// The tie-break of its entry in `ready` while it has one.
    tie: u64,
}

impl Band {
    /// Holds `seq` in `class` (weight `weight` ≥ 1); `cost` is charged when
    /// it is released.
    pub(crate) fn push(&mut self, class: Arc<str>, weight: u32, seq: u64, cost: f64) {
        let floor = self
            .ready
            .first()
            .map_or(self.vtime, |(counter, _, _)| counter.0);
        let vtime = self.vtime;
        let entry = self
            .classes
            .entry(Arc::clone(&class))
            .or_insert_with(|| Class {
                fifo: VecDeque::new(),
                weight: 1.0,
                counter: vtime,
                running: 0,
                tie: 0,
            });
        entry.weight = f64::from(weight.max(1));
        if entry.fifo.is_empty() {
            let lifted = entry.counter < floor;
            entry.counter = entry.counter.max(floor);
            entry.tie = if lifted { seq & !QUEUED } else { seq | QUEUED };
            self.ready
                .insert((TotalF64(entry.counter), entry.tie, class));
        }
        entry.fifo.push_back((seq, cost));
        self.len += 1;
    }

    /// Requests of this band released before one more of `class` (weight
    /// `weight`) held now: its class's backlog, and from every other class
    /// what it releases meanwhile at its weight (at most its backlog).
    pub(crate) fn ahead_of(&self, class: &str, weight: u32) -> usize {
        let own = self.classes.get(class).map_or(0, |c| c.fifo.len());
        let rounds = (own + 1) as f64 / f64::from(weight.max(1));
        let others: usize = self
            .classes
            .iter()
            .filter(|(name, _)| &***name != class)
            .map(|(_, c)| c.fifo.len().min((rounds * c.weight).ceil() as usize))
            .sum();
        own + others
    }

    /// The next request to release.
    pub(crate) fn head(&self) -> Option<u64> {
        let (_, _, name) = self.ready.first()?;
        self.classes.get(name)?.fifo.front().map(|&(seq, _)| seq)
    }

    /// The next request's class.
    pub(crate) fn head_class(&self) -> Option<&str> {
        self.ready.first().map(|(_, _, name)| &**name)
    }

    /// Releases the head: charges its cost and counts it as running until
    /// [`Band::finish`]. Returns it, its class and the cost charged.
    pub(crate) fn pop(&mut self) -> Option<(u64, Arc<str>, f64)> {
        let (counter, _, name) = self.ready.pop_first()?;
        let class = self.classes.get_mut(&name)?;
        let (seq, cost) = class.fifo.pop_front()?;
        self.vtime = self.vtime.max(counter.0);
        class.counter += cost / class.weight;
        class.running += 1;
        if let Some(&(next, _)) = class.fifo.front() {
            class.tie = next | QUEUED;
            self.ready
                .insert((TotalF64(class.counter), class.tie, Arc::clone(&name)));
        }
        self.len -= 1;
        self.running += 1;
        Some((seq, name, cost))
    }

    /// Removes a held request that leaves without being released.
    pub(crate) fn remove(&mut self, class: &str, seq: u64) {
        let Some((name, c)) = self.classes.get_key_value(class) else {
            return;
        };
        let name = Arc::clone(name);
        let Some(i) = c.fifo.iter().position(|&(s, _)| s == seq) else {
            return;
        };
        let counter = TotalF64(c.counter);
        if i == 0 {
            self.ready.remove(&(counter, c.tie, Arc::clone(&name)));
        }
        let Some(c) = self.classes.get_mut(&name) else {
            return;
        };
        c.fifo.remove(i);
        if i == 0
            && let Some(&(next, _)) = c.fifo.front()
        {
            // The next request keeps the lifted class's place in ties.
            c.tie = (next & !QUEUED) | (c.tie & QUEUED);
            self.ready.insert((counter, c.tie, Arc::clone(&name)));
        }
        self.len -= 1;
        self.prune(&name);
    }

    /// Charges `work` (negative: a refund) to `class`'s counter.
    pub(crate) fn charge(&mut self, class: &str, work: f64) {
        let Some((name, c)) = self.classes.get_key_value(class) else {
            return;
        };
        let name = Arc::clone(name);
        let old = c.counter;
        let backlogged = !c.fifo.is_empty();
        let tie = c.tie;
        let counter = old + work / c.weight;
        if backlogged {
            self.ready.remove(&(TotalF64(old), tie, Arc::clone(&name)));
            self.ready
                .insert((TotalF64(counter), tie, Arc::clone(&name)));
        }
        if let Some(c) = self.classes.get_mut(&name) {
            c.counter = counter;
        }
        self.prune(&name);
    }

    /// A released request of `class` ended (or was never granted).
    pub(crate) fn finish(&mut self, class: &str) {
        if let Some(c) = self.classes.get_mut(class) {
            c.running = c.running.saturating_sub(1);
            self.running = self.running.saturating_sub(1);
        }
        self.prune(class);
    }

    /// Forgets `class` when nothing of it is held or running and its
    /// counter carries nothing the lift would not restore.
    fn prune(&mut self, class: &str) {
        let forget = self
            .classes
            .get(class)
            .is_some_and(|c| c.fifo.is_empty() && c.running == 0 && c.counter <= self.vtime);
        if forget {
            self.classes.remove(class);
        }
    }

    /// Every held request in release order, charging the costs known now.
    pub(crate) fn sequence(&self) -> Vec<u64> {
        let mut sim = self.clone();
        std::iter::from_fn(|| sim.pop().map(|(seq, _, _)| seq)).collect()
    }

    /// Nothing held and nothing running: the band can be dropped.
    pub(crate) fn is_idle(&self) -> bool {
        self.len == 0 && self.running == 0
    }

    /// `class`'s counter (work served ÷ weight), if it is known.
    #[cfg(test)]
    pub(crate) fn counter(&self, class: &str) -> Option<f64> {
        self.classes.get(class).map(|c| c.counter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn band_of(classes: &[(&str, u32, &[f64])]) -> Band {
        let mut band = Band::default();
        let mut seq = 0;
        for &(name, weight, costs) in classes {
            for &cost in costs {
                band.push(Arc::from(name), weight, seq, cost);
                seq += 1;
            }
        }
        band
    }

    #[test]
    fn unit_costs_release_in_proportion_to_weight() {
        // a: seqs 0..6 (weight 2), b: 6..9 (weight 1)
        let band = band_of(&[("a", 2, &[1.0; 6]), ("b", 1, &[1.0; 3])]);
        assert_eq!(band.sequence(), [0, 6, 1, 2, 7, 3, 4, 8, 5]);
    }

    #[test]
    fn token_costs_share_tokens_not_requests() {
        // big: 8 requests of 800 tokens; small: 8 of 100. Equal weights:
        // small gets about 8 requests per big one while both are held.
        let band = band_of(&[("big", 1, &[800.0; 8]), ("small", 1, &[100.0; 8])]);
        let order = band.sequence();
        let first_big_again = order.iter().skip(1).position(|&s| s < 8).map(|p| p + 1);
        assert_eq!(order[0], 0, "the earliest head goes first on a tie");
        assert_eq!(first_big_again, Some(9), "{order:?}");
    }

    #[test]
    fn an_idle_class_is_lifted_to_the_current_round_and_banks_nothing() {
        let mut band = band_of(&[("busy", 1, &[1.0; 10])]);
        for _ in 0..5 {
            let (_, class, _) = band.pop().expect("held");
            band.finish(&class);
        }
        let busy = band.counter("busy").expect("busy");
        assert_eq!(busy, 5.0);
        // A newcomer starts level with the busy class, not at 0, and wins
        // the tie (it was served least), once.
        band.push(Arc::from("new"), 1, 100, 1.0);
        band.push(Arc::from("new"), 1, 101, 1.0);
        assert_eq!(band.counter("new"), Some(5.0));
        let next: Vec<u64> = band.sequence().into_iter().take(5).collect();
        assert_eq!(next, [100, 5, 6, 101, 7], "one turn each, then the rest");
    }

    #[test]
    fn charges_and_refunds_move_a_class_and_removal_is_not_a_release() {
        let mut band = band_of(&[("a", 1, &[10.0, 10.0]), ("b", 1, &[10.0, 10.0])]);
        let (seq, class, cost) = band.pop().expect("a first");
        assert_eq!((seq, &*class, cost), (0, "a", 10.0));
        // `a` produced 50 output tokens: b goes twice before a again.
        band.charge("a", 50.0);
        assert_eq!(band.sequence(), [2, 3, 1]);
        band.remove("b", 2);
        assert_eq!(band.sequence(), [3, 1]);
        // Refunded (it never ran) and finished: a is level again.
        band.charge("a", -60.0);
        band.finish("a");
        assert_eq!(band.head(), Some(1));
        assert_eq!(band.len, 2);
        while let Some((_, class, _)) = band.pop() {
            band.finish(&class);
        }
        assert!(band.is_idle());
    }

    proptest::proptest! {
        #[test]
        fn unit_cost_releases_every_request_within_its_bound(
            classes in proptest::collection::vec((1u32..5, 0usize..30), 1..6)
        ) {
            let mut band = Band::default();
            let mut members = Vec::new();
            let mut seq = 0u64;
            for (class, &(weight, count)) in classes.iter().enumerate() {
                for k in 0..count {
                    band.push(Arc::from(format!("c{class}")), weight, seq, 1.0);
                    members.push((weight as usize, k, seq));
                    seq += 1;
                }
            }
            let backlogged: Vec<usize> = classes
                .iter()
                .filter(|(_, n)| *n > 0)
                .map(|&(w, _)| w as usize)
                .collect();
            let total: usize = backlogged.iter().sum();
            let order = band.sequence();
            proptest::prop_assert_eq!(order.len(), members.len());
            proptest::prop_assert_eq!(band.len, members.len());
            for (weight, k, seq) in members {
                let pos = order.iter().position(|&s| s == seq).expect("released once");
                // Bound from the module docs: k·W/w + n.
                let bound = k * total / weight + backlogged.len();
                proptest::prop_assert!(pos < bound.max(1), "{} at {} (bound {})", seq, pos, bound);
            }
            let mut popped = Vec::new();
            while let Some((s, class, _)) = band.pop() {
                popped.push(s);
                band.finish(&class);
            }
            proptest::prop_assert_eq!(popped, order, "sequence() predicts pop()");
            proptest::prop_assert!(band.is_idle());
        }
    }
}
