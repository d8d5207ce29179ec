//! One target's load as the router sees it: the placements it counts on that
//! worker (every live request placed there, by any router replica, from
//! the moment of placement until the request ends) plus the requests the
//! worker itself reports as unplaced (no router placed them).
//!
//! A placement's figures are the router's estimate at placement time: its
//! prompt tokens not cached on the worker count as prefill work until the
//! request produces its first token; its prompt blocks count as decode
//! blocks until it ends, a block shared by several live requests (one
//! conversation's turns, one system prompt) once. The worker's report adds
//! only the requests it received without `placed`, estimated the same way,
//! so no request is ever counted twice and none lingers after it ends.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

/// The figures of one worker load report the router uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Sequences running (placed or not).
    pub running: u32,
    /// Sequences waiting for admission (placed or not).
    pub waiting: u32,
    /// KV blocks in use by active sequences.
    pub active_blocks: u64,
    /// KV blocks in the worker's pool.
    pub total_blocks: u64,
    /// Prompt tokens admitted but not yet computed.
    pub pending_prefill_tokens: u64,
    /// The worker's `max_num_seqs`.
    pub max_num_seqs: u32,
    /// The worker's `max_num_batched_tokens`.
    pub max_num_batched_tokens: u32,
    /// Requests no router placed.
    pub unplaced_requests: u32,
    /// Their prompt tokens not cached, until their first token.
    pub unplaced_prefill_tokens: u64,
    /// Their prompt blocks.
    pub unplaced_blocks: u64,
    /// The engine orders waiting requests by priority.
    pub priority_scheduling: bool,
    /// Prompts with more than this many tokens to prefill go one at a time
    /// there, and shorter ones pass them (0 = no such rule).
    pub long_prefill_token_threshold: u32,
    /// The engine's recent mean step time in microseconds (0 = none yet).
    pub step_time_us: u32,
    /// The engine's recent mean cost of a prompt token in ns beyond the
    /// decode step it rides with, if any (0 = none yet).
    pub prefill_ns_per_token: u32,
    /// Its fixed part per step with prompt tokens, in µs.
    pub prefill_step_us: u32,
    /// Prefill first there: the steps in a row a prompt step may leave the
    /// decode rows out (0: every prompt step decodes), the steps in a row
    /// that have, and the running requests with prompt tokens left (see
    /// `latency::PrefillFirst`).
    pub prefill_first_steps: u32,
    pub stalled_in_a_row: u32,
    pub prefilling: u32,
    /// A decode step's fixed part in µs, and its part per sequence in ns
    /// (both 0: none measured).
    pub decode_base_us: u32,
    pub decode_ns_per_seq: u32,
    /// Bytes per second a prefix fetched from a peer arrives at there (0:
    /// it does not fetch).
    pub kv_fetch_bytes_per_sec: u64,
    /// Bytes per second a block restored from its second tier moves at (0:
    /// none).
    pub kv_tier_bytes_per_sec: u64,
}

/// A target's effective load: placements plus the unplaced report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectiveLoad {
    /// Prefill tokens placed (or admitted unplaced) not yet computed.
    pub active_prefill_tokens: u64,
    /// The part of them in placements longer than the report's
    /// `long_prefill_token_threshold` (none without one).
    pub long_prefill_tokens: u64,
    /// Decode blocks of live requests.
    pub active_decode_blocks: u64,
    /// Live requests.
    pub active_requests: u32,
    /// Live placements among them.
    pub placements: u32,
    /// Prompt tokens the worker still has to compute by its last report,
    /// plus those placed since (`None` before a report): a prompt being
    /// prefilled in chunks counts only what is left of it, where
    /// `active_prefill_tokens` counts all of it until its first token.
    pub reported_prefill_tokens: Option<u64>,
    /// The tightest TPOT target of the live placements there, in ms.
    pub tightest_tpot_ms: Option<u32>,
    /// The last report, if any.
    pub report: LoadReport,
    /// When it arrived.
    pub reported_at: Option<Instant>,
}

/// What one placement adds to its target while it lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Prompt tokens not cached on the target.
    pub(crate) prefill_tokens: u64,
    /// Chained hashes of the prompt's full blocks.
    pub(crate) hashes: std::sync::Arc<[u64]>,
    /// Every prompt block, the partial last one included.
    pub(crate) blocks: u64,
    /// The request's TPOT target in ms (0 = none).
    pub(crate) tpot_target_ms: u32,
}

impl Shape {
    /// Blocks beyond the hashed ones (the partial last block): never shared.
    fn unshared_blocks(&self) -> u64 {
        self.blocks.saturating_sub(self.hashes.len() as u64)
    }
}

/// Last report and live placements of one target.
#[derive(Debug, Default)]
pub(crate) struct TargetLoad {
    report: LoadReport,
    reported_at: Option<Instant>,
    placements: u32,
    /// Placements not yet started by their prefill tokens: how many of
    /// each size (a long prefill is told from a short one by the report).
    unstarted: BTreeMap<u64, u32>,
    /// Live placements per block hash: a block counts once however many
    /// placements share it.
    block_refs: HashMap<u64, u32>,
    unshared_blocks: u64,
    /// Prefill tokens of the placements made since the last report (the
    /// report does not count them yet).
    placed_since_report: u64,
    /// Live placements' TPOT targets (ms → placements), 0 left out.
    tpot_targets: BTreeMap<u32, u32>,
    /// The worker's fetch rate from each peer it fetched from lately
    /// (bytes per second, by peer worker id), from its last report.
    fetch_rates_by_peer: HashMap<String, u64>,
}

impl TargetLoad {
    /// Counts a placement from now on (`started`: its prefill is done).
    pub(crate) fn add(&mut self, shape: &Shape, started: bool) {
        self.placements += 1;
        if !started {
            *self.unstarted.entry(shape.prefill_tokens).or_insert(0) += 1;
            self.placed_since_report += shape.prefill_tokens;
        }
        if shape.tpot_target_ms > 0 {
            *self.tpot_targets.entry(shape.tpot_target_ms).or_insert(0) += 1;
        }
        for &h in shape.hashes.iter() {
            *self.block_refs.entry(h).or_insert(0) += 1;
        }
        self.unshared_blocks += shape.unshared_blocks();
    }

    /// The placement produced its first token: its prefill work is done.
    pub(crate) fn start(&mut self, shape: &Shape) {
        if let Some(n) = self.unstarted.get_mut(&shape.prefill_tokens) {
            *n -= 1;
            if *n == 0 {
                self.unstarted.remove(&shape.prefill_tokens);
            }
        }
    }

    /// The placement ended (`started`: its prefill was already taken off).
    pub(crate) fn remove(&mut self, shape: &Shape, started: bool) {
        self.placements = self.placements.saturating_sub(1);
        if !started {
            self.start(shape);
        }
        for h in shape.hashes.iter() {
            if let Some(n) = self.block_refs.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    self.block_refs.remove(h);
                }
            }
        }
        self.unshared_blocks = self.unshared_blocks.saturating_sub(shape.unshared_blocks());
        if let Some(n) = self.tpot_targets.get_mut(&shape.tpot_target_ms) {
            *n -= 1;
            if *n == 0 {
                self.tpot_targets.remove(&shape.tpot_target_ms);
            }
        }
    }

    /// Records a worker report received at `now`.
    pub(crate) fn report(&mut self, report: LoadReport, now: Instant) {
        self.report = report;
        self.reported_at = Some(now);
        self.placed_since_report = 0;
    }

    /// Keeps the worker's per-peer fetch rates from its last report.
    pub(crate) fn report_fetch_rates(&mut self, by_peer: HashMap<String, u64>) {
        self.fetch_rates_by_peer = by_peer;
    }

    /// Bytes per second a prefix fetched from `peer` is expected to arrive
    /// at here: the pair's measured rate, else the worker's overall one.
    pub(crate) fn fetch_rate_from(&self, peer: &str) -> u64 {
        self.fetch_rates_by_peer
            .get(peer)
            .copied()
            .unwrap_or(self.report.kv_fetch_bytes_per_sec)
    }

    /// When the last report arrived.
    pub(crate) fn reported_at(&self) -> Option<Instant> {
        self.reported_at
    }

    /// Placements plus the unplaced part of the report.
    pub(crate) fn effective(&self) -> EffectiveLoad {
        let r = &self.report;
        let tokens = |(&size, &n): (&u64, &u32)| size * u64::from(n);
        let prefill_tokens: u64 = self.unstarted.iter().map(tokens).sum();
        // Unplaced requests' sizes are not known one by one: they count as
        // short (the whole of them delays every prompt).
        let long_prefill_tokens = match r.long_prefill_token_threshold {
            0 => 0,
            t => self.unstarted.range(u64::from(t) + 1..).map(tokens).sum(),
        };
        EffectiveLoad {
            active_prefill_tokens: prefill_tokens + r.unplaced_prefill_tokens,
            long_prefill_tokens,
            active_decode_blocks: self.block_refs.len() as u64
                + self.unshared_blocks
                + r.unplaced_blocks,
            active_requests: self.placements + r.unplaced_requests,
            placements: self.placements,
            reported_prefill_tokens: self
                .reported_at
                .map(|_| r.pending_prefill_tokens + self.placed_since_report),
            tightest_tpot_ms: self.tpot_targets.keys().next().copied(),
            report: self.report,
            reported_at: self.reported_at,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(prefill_tokens: u64, hashes: &[u64], blocks: u64) -> Shape {
        Shape {
            prefill_tokens,
            hashes: hashes.into(),
            blocks,
            tpot_target_ms: 0,
        }
    }

    #[test]
    fn the_tightest_live_tpot_target_is_kept_until_its_placement_ends() {
        let mut l = TargetLoad::default();
        let tight = Shape {
            tpot_target_ms: 40,
            ..shape(10, &[1], 1)
        };
        let loose = Shape {
            tpot_target_ms: 200,
            ..shape(10, &[2], 1)
        };
        l.add(&shape(10, &[3], 1), false);
        assert_eq!(l.effective().tightest_tpot_ms, None, "no target: no cap");
        l.add(&loose, false);
        l.add(&tight, false);
        assert_eq!(l.effective().tightest_tpot_ms, Some(40));
        l.remove(&tight, false);
        assert_eq!(l.effective().tightest_tpot_ms, Some(200));
        l.remove(&loose, true);
        assert_eq!(l.effective().tightest_tpot_ms, None);
    }

    #[test]
    fn a_placement_counts_until_it_is_removed_and_its_prefill_until_it_starts() {
        let mut l = TargetLoad::default();
        let s = shape(100, &[1, 2, 3], 4);
        l.add(&s, false);
        let e = l.effective();
        assert_eq!(
            (
                e.active_prefill_tokens,
                e.active_decode_blocks,
                e.active_requests
            ),
            (100, 4, 1)
        );
        l.start(&s);
        assert_eq!(l.effective().active_prefill_tokens, 0);
        assert_eq!(l.effective().active_decode_blocks, 4);
        l.remove(&s, true);
        assert_eq!(l.effective(), EffectiveLoad::default());
    }

    #[test]
    fn the_reported_prefill_is_what_the_worker_has_left_plus_what_was_placed_since() {
        let mut l = TargetLoad::default();
        l.add(&shape(4_000, &[1], 63), false);
        assert_eq!(l.effective().reported_prefill_tokens, None, "no report yet");
        // Half of the prompt is computed: the worker has 2,000 left.
        let report = LoadReport {
            pending_prefill_tokens: 2_000,
            ..Default::default()
        };
        l.report(report, Instant::now());
        l.add(&shape(300, &[2], 5), false);
        let e = l.effective();
        assert_eq!(e.active_prefill_tokens, 4_300);
        assert_eq!(e.reported_prefill_tokens, Some(2_300));
    }

    #[test]
    fn blocks_shared_by_live_placements_count_once() {
        let mut l = TargetLoad::default();
        let turn1 = shape(64, &[1, 2, 3], 4);
        let turn2 = shape(16, &[1, 2, 3, 4, 5], 6);
        l.add(&turn1, false);
        l.add(&turn2, false);
        // Hashes 1..=5 once, plus one partial block each.
        assert_eq!(l.effective().active_decode_blocks, 7);
        assert_eq!(l.effective().active_prefill_tokens, 80);
        l.remove(&turn1, false);
        assert_eq!(l.effective().active_decode_blocks, 6);
        assert_eq!(l.effective().active_prefill_tokens, 16);
    }

    #[test]
    fn placements_longer_than_the_reported_threshold_count_as_long_prefill_until_they_start() {
        let mut l = TargetLoad::default();
        let long = shape(5_000, &[1], 80);
        let short = shape(200, &[2], 4);
        let other_long = shape(3_000, &[3], 50);
        l.add(&long, false);
        l.add(&short, false);
        l.add(&other_long, false);
        // No report yet (or an engine without the rule): nothing is long.
        assert_eq!(l.effective().long_prefill_tokens, 0);
        l.report(
            LoadReport {
                long_prefill_token_threshold: 256,
                unplaced_prefill_tokens: 1_000,
                ..Default::default()
            },
            Instant::now(),
        );
        let e = l.effective();
        assert_eq!(e.active_prefill_tokens, 9_200);
        assert_eq!(e.long_prefill_tokens, 8_000);
        l.start(&long);
        assert_eq!(l.effective().long_prefill_tokens, 3_000);
        l.remove(&other_long, false);
        l.remove(&short, false);
        let e = l.effective();
        assert_eq!((e.active_prefill_tokens, e.long_prefill_tokens), (1_000, 0));
    }

    #[test]
    fn the_report_adds_only_its_unplaced_requests() {
        let mut l = TargetLoad::default();
        l.add(&shape(10, &[7], 1), false);
        l.report(
            LoadReport {
                running: 3,
                active_blocks: 50,
                pending_prefill_tokens: 40,
                unplaced_requests: 2,
                unplaced_prefill_tokens: 30,
                unplaced_blocks: 20,
                ..Default::default()
            },
            Instant::now(),
        );
        let e = l.effective();
        assert_eq!(e.active_requests, 3);
        assert_eq!(e.active_prefill_tokens, 40);
        assert_eq!(e.active_decode_blocks, 21);
        assert_eq!(e.placements, 1);
    }
}
