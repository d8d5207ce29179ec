//! Percentiles and the per-tier summaries of a run's request records.
//!
//! Percentiles interpolate linearly between closest ranks (numpy's default
//! and aiperf's): for sorted `x` of length `n`, `p` maps to rank
//! `(n − 1)·p/100`. Throughput of a tier is its completed requests (and
//! output tokens) over the whole run's duration, so the tiers add up to the
//! total.

use std::collections::BTreeMap;

use serde::Serialize;

use super::client::RequestRecord;

/// The `p`-th percentile (0..=100) of `sorted` (ascending); `None` if empty.
pub(crate) fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let rank = (n - 1) as f64 * p.clamp(0.0, 100.0) / 100.0;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Mean, percentiles and range of one metric.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Summary {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    /// `None` when there are no values.
    pub(crate) fn of(values: impl IntoIterator<Item = f64>) -> Option<Self> {
        let mut v: Vec<f64> = values.into_iter().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let pct = |p| percentile(&v, p).unwrap_or(f64::NAN);
        Some(Self {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

/// The results of a set of requests (all of them, or one priority tier).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct GroupStats {
    /// Requests in the group.
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    /// Failures by kind: an HTTP status (`"429"`), `timeout`, `connect`, …
    pub errors: BTreeMap<String, usize>,
    pub ttft_ms: Option<Summary>,
    /// Per request: (e2e − TTFT) / (output tokens − 1).
    pub itl_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
    /// The server's `nvext.queue_wait_ms`, where it reports one.
    pub queue_wait_ms: Option<Summary>,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Completed requests per second of the run.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second of the run.
    pub output_token_throughput: f64,
    /// Requests served with their first token within their TTFT target.
    pub within_target: usize,
    /// `within_target` / requests: refusals and late first tokens count
    /// against it.
    pub attainment: f64,
    /// Requests served within their TTFT target per second of the run.
    pub goodput: f64,
}

impl GroupStats {
    pub(crate) fn of<'a>(
        records: impl IntoIterator<Item = &'a RequestRecord>,
        duration_s: f64,
    ) -> Self {
        let records: Vec<&RequestRecord> = records.into_iter().collect();
        let ok: Vec<&RequestRecord> = records
            .iter()
            .copied()
            .filter(|r| r.error.is_none())
            .collect();
        let mut errors = BTreeMap::new();
        for r in &records {
            if let Some(e) = &r.error {
                *errors.entry(e.kind.clone()).or_insert(0) += 1;
            }
        }
        let output_tokens: u64 = ok.iter().map(|r| u64::from(r.output_tokens)).sum();
        let within_target = records.iter().filter(|r| r.within_target()).count();
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        Self {
            requests: records.len(),
            completed: ok.len(),
            failed: records.len() - ok.len(),
            errors,
            ttft_ms: Summary::of(ok.iter().filter_map(|r| r.ttft_ms)),
            itl_ms: Summary::of(ok.iter().filter_map(|r| r.itl_ms())),
            e2e_ms: Summary::of(ok.iter().map(|r| r.e2e_ms)),
            queue_wait_ms: Summary::of(ok.iter().filter_map(|r| r.queue_wait_ms)),
            input_tokens: ok.iter().map(|r| u64::from(r.input_tokens)).sum(),
            output_tokens,
            request_throughput: per_s(ok.len() as f64),
            output_token_throughput: per_s(output_tokens as f64),
            within_target,
            attainment: if records.is_empty() {
                0.0
            } else {
                within_target as f64 / records.len() as f64
            },
            goodput: per_s(within_target as f64),
        }
    }
}

/// One priority tier's results.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct TierStats {
    pub priority: i32,
    #[serde(flatten)]
    pub stats: GroupStats,
}

/// Splits records by the priority they were sent with, highest first.
pub(crate) fn by_tier(records: &[RequestRecord], duration_s: f64) -> Vec<TierStats> {
    let mut tiers: BTreeMap<i32, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        tiers.entry(r.priority).or_default().push(r);
    }
    tiers
        .into_iter()
        .rev()
        .map(|(priority, rs)| TierStats {
            priority,
            stats: GroupStats::of(rs, duration_s),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::client::RequestError;
    use super::*;

    #[test]
    fn percentiles_interpolate_between_closest_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert!((percentile(&v, 90.0).expect("p90") - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 99.0).expect("p99") - 99.01).abs() < 1e-9);
    }

    #[test]
    fn summary_sorts_and_skips_non_finite_values() {
        let s = Summary::of([3.0, 1.0, f64::NAN, 2.0]).expect("values");
        assert_eq!(
            (s.count, s.min, s.max, s.p50, s.mean),
            (3, 1.0, 3.0, 2.0, 2.0)
        );
        assert_eq!(Summary::of([]), None);
    }

    #[test]
    fn a_tpot_target_counts_in_attainment_with_the_ttft_target() {
        // First token at 100 ms (target 200), then 10 more over 1 s: 100 ms each.
        let mut r = rec(0, 100.0, 1_100.0, 11, None);
        assert!(r.within_target(), "no TPOT target: the TTFT's alone");
        r.tpot_target_ms = Some(150.0);
        assert!(r.within_target());
        r.tpot_target_ms = Some(50.0);
        assert!(!r.within_target(), "100 ms a token misses 50");
        // One token: no time per token to miss.
        assert!(rec(0, 100.0, 100.0, 1, None).within_target());
    }

    fn rec(priority: i32, ttft: f64, e2e: f64, out: u32, error: Option<&str>) -> RequestRecord {
        RequestRecord {
            index: 0,
            priority,
            scheduled_ms: 0.0,
            sent_ms: 0.0,
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            input_tokens: 10,
            output_tokens: out,
            cached_tokens: None,
            queue_wait_ms: None,
            ttft_target_ms: Some(200.0),
            tpot_target_ms: None,
            worker_id: None,
            routed_overlap_tokens: None,
            routed_ttft_ms: None,
            error: error.map(|k| RequestError {
                kind: k.into(),
                detail: String::new(),
                retry_after: None,
            }),
        }
    }

    #[test]
    fn tier_split_groups_by_priority_highest_first_and_counts_errors() {
        let rs = vec![
            rec(0, 100.0, 1000.0, 11, None),
            rec(3, 10.0, 110.0, 11, None),
            rec(0, 300.0, 1200.0, 11, None),
            rec(3, 0.0, 0.0, 0, Some("429")),
            rec(1, 0.0, 0.0, 0, Some("timeout")),
        ];
        let tiers = by_tier(&rs, 2.0);
        assert_eq!(
            tiers.iter().map(|t| t.priority).collect::<Vec<_>>(),
            vec![3, 1, 0]
        );
        let p0 = &tiers[2].stats;
        assert_eq!((p0.requests, p0.completed, p0.failed), (2, 2, 0));
        assert_eq!(p0.ttft_ms.expect("ttft").mean, 200.0);
        // ITL: (1000 − 100) / 10 and (1200 − 300) / 10.
        assert_eq!(p0.itl_ms.expect("itl").mean, 90.0);
        assert_eq!(p0.request_throughput, 1.0);
        assert_eq!(p0.output_token_throughput, 11.0);
        assert_eq!(tiers[0].stats.errors.get("429"), Some(&1));
        assert_eq!(tiers[1].stats.completed, 0);
        assert_eq!(tiers[1].stats.ttft_ms, None);
        let all = GroupStats::of(&rs, 2.0);
        assert_eq!((all.completed, all.failed), (3, 2));
        assert_eq!(all.errors.len(), 2);
        // Within the 200 ms target: the 100 ms and 10 ms first tokens, not
        // the 300 ms one nor the refused ones.
        assert_eq!(
            (all.within_target, all.attainment, all.goodput),
            (2, 0.4, 1.0)
        );
        assert_eq!(p0.within_target, 1);
    }
}
