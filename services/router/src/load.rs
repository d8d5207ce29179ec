//! One target's load as the router sees it: the worker's last load report
//! plus the router's own placements that report does not yet cover.
//!
//! A placement counts as active load from the moment it is made until a load
//! report received at least `cover` after it arrives (by then the worker has
//! the request and counts it itself), or until it is older than `max_age`
//! (a worker that never reports must not pin load forever). This is what
//! keeps a burst of identical prompts from all landing on one idle worker
//! before its first report. The pending list is bounded.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Pending placements kept per target at most; the oldest go first.
pub(crate) const MAX_PENDING: usize = 4096;

/// The figures of one worker load report the router uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Sequences running.
    pub running: u32,
    /// Sequences waiting for admission.
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
}

/// A target's effective load: report plus uncovered placements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EffectiveLoad {
    /// Prefill tokens admitted or placed but not yet computed.
    pub active_prefill_tokens: u64,
    /// Decode blocks in use or placed.
    pub active_decode_blocks: u64,
    /// Running + waiting + placed requests.
    pub active_requests: u32,
    /// Placements not yet covered by a report.
    pub pending_placements: u32,
    /// The last report, if any.
    pub report: LoadReport,
}

#[derive(Debug, Clone, Copy)]
struct Placement {
    at: Instant,
    prefill_tokens: u64,
    blocks: u64,
}

/// Last report and uncovered placements of one target.
#[derive(Debug, Default)]
pub(crate) struct TargetLoad {
    report: LoadReport,
    reported_at: Option<Instant>,
    pending: VecDeque<Placement>,
    /// Sums over `pending`, kept in step so reading the load is O(1).
    pending_tokens: u64,
    pending_blocks: u64,
}

impl TargetLoad {
    /// Records a placement made at `now`.
    pub(crate) fn place(&mut self, now: Instant, prefill_tokens: u64, blocks: u64) {
        if self.pending.len() >= MAX_PENDING {
            self.pop();
        }
        self.pending_tokens += prefill_tokens;
        self.pending_blocks += blocks;
        self.pending.push_back(Placement {
            at: now,
            prefill_tokens,
            blocks,
        });
    }

    /// Records a worker report received at `now`; it covers placements made
    /// at least `cover` earlier.
    pub(crate) fn report(&mut self, report: LoadReport, now: Instant, cover: Duration) {
        self.report = report;
        self.reported_at = Some(now);
        while self.pending.front().is_some_and(|p| p.at + cover <= now) {
            self.pop();
        }
    }

    /// Drops placements older than `max_age`.
    pub(crate) fn expire(&mut self, now: Instant, max_age: Duration) {
        while self.pending.front().is_some_and(|p| p.at + max_age <= now) {
            self.pop();
        }
    }

    fn pop(&mut self) {
        if let Some(p) = self.pending.pop_front() {
            self.pending_tokens -= p.prefill_tokens;
            self.pending_blocks -= p.blocks;
        }
    }

    /// When the last report arrived.
    pub(crate) fn reported_at(&self) -> Option<Instant> {
        self.reported_at
    }

    /// The report plus uncovered placements.
    pub(crate) fn effective(&self) -> EffectiveLoad {
        let (tokens, blocks) = (self.pending_tokens, self.pending_blocks);
        let pending = self.pending.len() as u32;
        EffectiveLoad {
            active_prefill_tokens: self.report.pending_prefill_tokens + tokens,
            active_decode_blocks: self.report.active_blocks + blocks,
            active_requests: self.report.running + self.report.waiting + pending,
            pending_placements: pending,
            report: self.report,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const COVER: Duration = Duration::from_millis(50);

    #[test]
    fn placements_add_to_the_reported_load() {
        let t0 = Instant::now();
        let mut l = TargetLoad::default();
        l.report(
            LoadReport {
                running: 2,
                active_blocks: 10,
                pending_prefill_tokens: 100,
                ..Default::default()
            },
            t0,
            COVER,
        );
        l.place(t0, 64, 4);
        let e = l.effective();
        assert_eq!(e.active_prefill_tokens, 164);
        assert_eq!(e.active_decode_blocks, 14);
        assert_eq!(e.active_requests, 3);
        assert_eq!(e.pending_placements, 1);
    }

    #[test]
    fn a_report_covers_only_placements_older_than_the_cover_delay() {
        let t0 = Instant::now();
        let mut l = TargetLoad::default();
        l.place(t0, 64, 4);
        l.place(t0 + Duration::from_millis(40), 64, 4);
        l.report(LoadReport::default(), t0 + Duration::from_millis(60), COVER);
        assert_eq!(l.effective().pending_placements, 1);
        l.report(
            LoadReport::default(),
            t0 + Duration::from_millis(100),
            COVER,
        );
        assert_eq!(l.effective().pending_placements, 0);
    }

    #[test]
    fn placements_expire_without_reports() {
        let t0 = Instant::now();
        let mut l = TargetLoad::default();
        l.place(t0, 64, 4);
        l.expire(t0 + Duration::from_secs(1), Duration::from_secs(5));
        assert_eq!(l.effective().pending_placements, 1);
        l.expire(t0 + Duration::from_secs(5), Duration::from_secs(5));
        assert_eq!(l.effective().pending_placements, 0);
    }

    #[test]
    fn pending_list_is_bounded() {
        let t0 = Instant::now();
        let mut l = TargetLoad::default();
        for _ in 0..MAX_PENDING + 10 {
            l.place(t0, 1, 1);
        }
        let e = l.effective();
        assert_eq!(e.pending_placements as usize, MAX_PENDING);
        assert_eq!(e.active_prefill_tokens as usize, MAX_PENDING);
    }
}
