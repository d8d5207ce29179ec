//! The workload: which requests to send and when, from a trace or from the
//! synthetic generator. Everything here is deterministic given its inputs
//! (the synthetic generator and tier assignment take a seed), so two runs
//! with the same flags send the same requests on the same schedule.
//!
//! Synthetic lengths are normal, rounded and clamped to at least 1 token;
//! arrivals are all at t=0 (`--burst`, or no `--rate`) or a Poisson process
//! (`--rate R`: exponential gaps of mean 1/R s). Priority tiers
//! (`--priority-tiers "0:1,1:1,2:1,3:1"`, priority:weight) are split by
//! largest remainder, so counts are exact, then shuffled with the seed.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::BenchError;
use super::trace::{PromptSpec, TraceRow, mix64, row_prompt};

/// One request to send.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Planned {
    /// Position in the workload (0-based).
    pub index: usize,
    /// When to send it, from the start of the run.
    pub at: Duration,
    pub prompt: PromptSpec,
    /// Output tokens asked for (`max_tokens` = `min_tokens`, `ignore_eos`).
    pub output_tokens: u32,
    pub priority: i32,
}

/// Priority tiers with weights: `--priority-tiers "0:1,1:1,2:1,3:1"`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tiers(pub Vec<(i32, f64)>);

impl std::str::FromStr for Tiers {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let tiers = sluice_runtime::config::parse_pairs::<i32, f64>(s, ':', "PRIORITY:WEIGHT")?;
        if let Some((p, _)) = tiers.iter().find(|(_, w)| !w.is_finite() || *w <= 0.0) {
            return Err(format!("weight of priority {p} must be positive"));
        }
        if tiers.is_empty() {
            return Err("no tiers given".into());
        }
        Ok(Self(tiers))
    }
}

impl Tiers {
    /// `n` priorities in the tiers' proportions (largest remainder, so the
    /// counts are exact), shuffled with `seed`.
    pub(crate) fn assign(&self, n: usize, seed: u64) -> Vec<i32> {
        let total: f64 = self.0.iter().map(|(_, w)| w).sum();
        let quotas: Vec<f64> = self.0.iter().map(|(_, w)| w / total * n as f64).collect();
        let mut counts: Vec<usize> = quotas.iter().map(|q| q.floor() as usize).collect();
        let mut left = n - counts.iter().sum::<usize>();
        let mut order: Vec<usize> = (0..self.0.len()).collect();
        // Largest remainder first; ties go to the tier listed first.
        order.sort_by(|&a, &b| {
            let (ra, rb) = (quotas[a] - quotas[a].floor(), quotas[b] - quotas[b].floor());
            rb.total_cmp(&ra).then(a.cmp(&b))
        });
        for &i in order.iter().cycle() {
            if left == 0 {
                break;
            }
            counts[i] += 1;
            left -= 1;
        }
        let mut out: Vec<i32> = self
            .0
            .iter()
            .zip(counts)
            .flat_map(|((p, _), c)| std::iter::repeat_n(*p, c))
            .collect();
        out.shuffle(&mut StdRng::seed_from_u64(seed));
        out
    }
}

/// Synthetic workload parameters.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SyntheticSpec {
    pub requests: usize,
    pub isl_mean: f64,
    pub isl_std: f64,
    pub osl_mean: f64,
    pub osl_std: f64,
    /// Poisson arrivals per second; `None` = everything at t=0.
    pub rate: Option<f64>,
    pub tiers: Option<Tiers>,
    pub seed: u64,
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

fn length(rng: &mut StdRng, mean: f64, std: f64) -> u64 {
    let x = mean + std * normal(rng);
    x.round().max(1.0) as u64
}

/// The synthetic workload.
pub(crate) fn synthetic(spec: &SyntheticSpec) -> Vec<Planned> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let priorities = spec
        .tiers
        .as_ref()
        .map(|t| t.assign(spec.requests, mix64(spec.seed)));
    let mut t = 0.0f64;
    (0..spec.requests)
        .map(|index| {
            if let Some(rate) = spec.rate {
                // Exponential gap; the first request also waits one gap, as a
                // Poisson process started at 0 does.
                let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                t += -u.ln() / rate;
            }
            let isl = length(&mut rng, spec.isl_mean, spec.isl_std);
            let osl = length(&mut rng, spec.osl_mean, spec.osl_std);
            Planned {
                index,
                at: Duration::from_secs_f64(t),
                prompt: PromptSpec {
                    len: isl as usize,
                    hash_ids: Vec::new(),
                    block_tokens: 1,
                    tail_seed: mix64(spec.seed) ^ index as u64,
                },
                output_tokens: osl.min(u64::from(u32::MAX)) as u32,
                priority: priorities.as_ref().map_or(0, |p| p[index]),
            }
        })
        .collect()
}

/// How a trace is replayed.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ReplaySpec {
    pub block_size: u64,
    pub scale: u64,
    /// Multiplies every timestamp (0.5 = twice as fast).
    pub time_scale: f64,
    pub max_requests: Option<usize>,
    pub max_isl: Option<u64>,
    /// Priorities for rows that carry none.
    pub tiers: Option<Tiers>,
    pub seed: u64,
}

/// The trace's workload: rows in timestamp order (stable), the first
/// `max_requests` of them, sent at `timestamp × time_scale` after the
/// earliest row.
pub(crate) fn replay(rows: &[TraceRow], spec: &ReplaySpec) -> Result<Vec<Planned>, BenchError> {
    if !spec.time_scale.is_finite() || spec.time_scale < 0.0 {
        return Err(BenchError::Flag {
            flag: "--time-scale",
            reason: format!("must be a non-negative number, got {}", spec.time_scale),
        });
    }
    if spec.scale == 0 || !spec.block_size.is_multiple_of(spec.scale) {
        return Err(BenchError::Flag {
            flag: "--trace-scale",
            reason: format!(
                "must divide --trace-block-size {} (got {})",
                spec.block_size, spec.scale
            ),
        });
    }
    let mut rows: Vec<&TraceRow> = rows.iter().collect();
    rows.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    if let Some(n) = spec.max_requests {
        rows.truncate(n);
    }
    let start = rows.first().map_or(0.0, |r| r.timestamp_ms);
    let fill = spec
        .tiers
        .as_ref()
        .map(|t| t.assign(rows.len(), mix64(spec.seed)));
    Ok(rows
        .iter()
        .enumerate()
        .map(|(index, row)| Planned {
            index,
            at: Duration::from_secs_f64((row.timestamp_ms - start) * spec.time_scale / 1000.0),
            prompt: row_prompt(row, spec.block_size, spec.scale, spec.max_isl),
            output_tokens: row.output_length.min(u64::from(u32::MAX)) as u32,
            priority: row
                .priority
                .or_else(|| fill.as_ref().map(|f| f[index]))
                .unwrap_or(0),
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::super::trace::parse_trace;
    use super::*;

    fn spec() -> SyntheticSpec {
        SyntheticSpec {
            requests: 400,
            isl_mean: 100.0,
            isl_std: 20.0,
            osl_mean: 50.0,
            osl_std: 0.0,
            rate: Some(10.0),
            tiers: Some("0:1,1:1,2:1,3:1".parse().expect("tiers")),
            seed: 7,
        }
    }

    #[test]
    fn synthetic_is_deterministic_for_a_seed_and_changes_with_it() {
        let a = synthetic(&spec());
        assert_eq!(a, synthetic(&spec()));
        let b = synthetic(&SyntheticSpec { seed: 8, ..spec() });
        assert_ne!(a, b);
        assert_eq!(
            a[3].prompt.tokens(1000),
            synthetic(&spec())[3].prompt.tokens(1000)
        );
    }

    #[test]
    fn synthetic_lengths_and_poisson_rate_are_plausible() {
        let w = synthetic(&SyntheticSpec {
            requests: 4000,
            ..spec()
        });
        let mean_isl = w.iter().map(|p| p.prompt.len as f64).sum::<f64>() / 4000.0;
        assert!((mean_isl - 100.0).abs() < 2.0, "{mean_isl}");
        assert!(w.iter().all(|p| p.output_tokens == 50 && p.prompt.len >= 1));
        // 4000 arrivals at 10/s take about 400 s, in increasing order.
        let last = w.last().expect("requests").at.as_secs_f64();
        assert!((360.0..440.0).contains(&last), "{last}");
        assert!(w.windows(2).all(|p| p[0].at <= p[1].at));
    }

    #[test]
    fn burst_sends_everything_at_zero() {
        let w = synthetic(&SyntheticSpec {
            rate: None,
            ..spec()
        });
        assert!(w.iter().all(|p| p.at == Duration::ZERO));
    }

    #[test]
    fn tiers_parse_and_reject_bad_input() {
        let t: Tiers = "0:1, 3:2,-1:0.5".parse().expect("tiers");
        assert_eq!(t.0, vec![(0, 1.0), (3, 2.0), (-1, 0.5)]);
        assert!("0".parse::<Tiers>().is_err());
        assert!("0:0".parse::<Tiers>().is_err());
        assert!("0:1,0:2".parse::<Tiers>().is_err());
        assert!("x:1".parse::<Tiers>().is_err());
        assert!("".parse::<Tiers>().is_err());
    }

    #[test]
    fn tier_split_is_exact_by_weight_and_mixed() {
        let t: Tiers = "0:1,1:1,2:1,3:1".parse().expect("tiers");
        let p = t.assign(1005, 1);
        let count = |x| p.iter().filter(|&&q| q == x).count();
        assert_eq!(
            (count(0), count(1), count(2), count(3)),
            (252, 251, 251, 251)
        );
        // Shuffled: the first quarter is not one tier.
        assert!(p[..250].iter().any(|&q| q != p[0]));
        let w: Tiers = "5:3,1:1".parse().expect("tiers");
        let p = w.assign(8, 1);
        assert_eq!(p.iter().filter(|&&q| q == 5).count(), 6);
        assert_eq!(t.assign(10, 3), t.assign(10, 3));
    }

    #[test]
    fn replay_orders_scales_and_fills_priorities() {
        let rows = parse_trace(
            "{\"timestamp\": 2000, \"input_length\": 1024, \"output_length\": 5, \"hash_ids\": [1, 2], \"priority\": 9}\n\
             {\"timestamp\": 1000, \"input_length\": 100, \"output_length\": 4, \"hash_ids\": [1]}\n\
             {\"timestamp\": 3000, \"input_length\": 100, \"output_length\": 4}\n",
            512,
        )
        .expect("parses");
        let spec = ReplaySpec {
            block_size: 512,
            scale: 8,
            time_scale: 0.5,
            max_requests: Some(2),
            max_isl: None,
            tiers: Some("3:1".parse().expect("tiers")),
            seed: 1,
        };
        let w = replay(&rows, &spec).expect("replays");
        assert_eq!(w.len(), 2);
        assert_eq!(w[0].at, Duration::ZERO);
        assert_eq!(w[1].at, Duration::from_millis(500));
        assert_eq!((w[0].priority, w[1].priority), (3, 9));
        assert_eq!(w[1].prompt.len, 128);
        assert_eq!(w[1].prompt.block_tokens, 64);
        let bad = ReplaySpec { scale: 3, ..spec };
        assert!(replay(&rows, &bad).is_err());
    }
}
