//! A run's results: the Markdown table printed at the end, `results.json`
//! and `requests.jsonl` (one record per request) under `--out`.

use std::fmt::Write as _;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use super::BenchError;
use super::client::RequestRecord;
use super::stats::{GroupStats, Summary, TierStats, by_tier};

/// Everything `results.json` holds.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Results {
    /// The flags of the run, for the record.
    pub config: Value,
    /// First send to last answer, seconds.
    pub duration_s: f64,
    pub overall: GroupStats,
    /// Highest priority first.
    pub tiers: Vec<TierStats>,
}

impl Results {
    pub(crate) fn new(config: Value, records: &[RequestRecord], duration_s: f64) -> Self {
        Self {
            config,
            duration_s,
            overall: GroupStats::of(records, duration_s),
            tiers: by_tier(records, duration_s),
        }
    }

    /// The results as Markdown: one row for all requests, one per tier.
    pub(crate) fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "| tier | ok | failed | TTFT ms mean | p50 | p90 | p99 | ITL ms mean | p50 | p90 | p99 | e2e ms mean | p50 | p90 | p99 | req/s | out tok/s | TTFT target met | goodput req/s |"
        );
        let _ = writeln!(s, "|---{}|", "|---:".repeat(18));
        let row = |s: &mut String, name: &str, g: &GroupStats| {
            let _ = write!(s, "| {name} | {} | {} |", g.completed, g.failed);
            for m in [&g.ttft_ms, &g.itl_ms, &g.e2e_ms] {
                match m {
                    Some(m) => {
                        let _ = write!(
                            s,
                            " {} | {} | {} | {} |",
                            fmt(m.mean),
                            fmt(m.p50),
                            fmt(m.p90),
                            fmt(m.p99)
                        );
                    }
                    None => s.push_str(" – | – | – | – |"),
                }
            }
            let _ = writeln!(
                s,
                " {:.2} | {:.1} | {:.1}% | {:.2} |",
                g.request_throughput,
                g.output_token_throughput,
                g.attainment * 100.0,
                g.goodput
            );
        };
        row(&mut s, "all", &self.overall);
        if self.tiers.len() > 1 {
            for t in &self.tiers {
                row(&mut s, &format!("priority {}", t.priority), &t.stats);
            }
        }
        if !self.overall.errors.is_empty() {
            let errors: Vec<String> = self
                .overall
                .errors
                .iter()
                .map(|(k, n)| format!("{k}: {n}"))
                .collect();
            let _ = writeln!(s, "\nfailed requests by kind: {}", errors.join(", "));
        }
        let _ = writeln!(
            s,
            "\n{} requests in {:.1} s; {} input and {} output tokens completed",
            self.overall.requests,
            self.duration_s,
            self.overall.input_tokens,
            self.overall.output_tokens
        );
        s
    }

    /// Writes `results.json`, `requests.jsonl` and `results.md` into `dir`.
    pub(crate) fn write(&self, dir: &Path, records: &[RequestRecord]) -> Result<(), BenchError> {
        std::fs::create_dir_all(dir).map_err(|e| write_err(dir, e))?;
        let json = serde_json::to_string_pretty(self).map_err(|e| BenchError::Encode {
            what: "results.json",
            detail: e.to_string(),
        })?;
        let path = dir.join("results.json");
        std::fs::write(&path, json).map_err(|e| write_err(&path, e))?;
        let mut lines = String::new();
        for r in records {
            let line = serde_json::to_string(r).map_err(|e| BenchError::Encode {
                what: "requests.jsonl",
                detail: e.to_string(),
            })?;
            lines.push_str(&line);
            lines.push('\n');
        }
        let path = dir.join("requests.jsonl");
        std::fs::write(&path, lines).map_err(|e| write_err(&path, e))?;
        let path = dir.join("results.md");
        std::fs::write(&path, self.table()).map_err(|e| write_err(&path, e))?;
        Ok(())
    }
}

fn write_err(path: &Path, source: std::io::Error) -> BenchError {
    BenchError::Write {
        path: path.to_path_buf(),
        source,
    }
}

/// Milliseconds with sensible precision.
pub(crate) fn fmt(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.2}")
    }
}

/// The summaries the plot draws, by tier (highest priority first).
pub(crate) fn ttft_by_tier(results: &Results) -> Vec<(String, Summary)> {
    let groups: Vec<(String, &GroupStats)> = if results.tiers.len() > 1 {
        results
            .tiers
            .iter()
            .map(|t| (format!("p{}", t.priority), &t.stats))
            .collect()
    } else {
        vec![("all".to_string(), &results.overall)]
    };
    groups
        .into_iter()
        .filter_map(|(name, g)| g.ttft_ms.map(|s| (name, s)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::client::RequestError;
    use super::*;

    fn rec(index: usize, priority: i32, ttft: f64, error: bool) -> RequestRecord {
        RequestRecord {
            index,
            priority,
            scheduled_ms: 0.0,
            sent_ms: 0.0,
            ttft_ms: (!error).then_some(ttft),
            e2e_ms: ttft * 2.0,
            input_tokens: 5,
            output_tokens: 3,
            cached_tokens: Some(0),
            queue_wait_ms: Some(1.0),
            ttft_target_ms: Some(15.0),
            tpot_target_ms: None,
            worker_id: Some("w".into()),
            routed_overlap_tokens: None,
            routed_ttft_ms: None,
            error: error.then(|| RequestError {
                kind: "503".into(),
                detail: "busy".into(),
                retry_after: None,
            }),
        }
    }

    #[test]
    fn table_has_overall_and_tier_rows_and_error_kinds() {
        let rs = vec![
            rec(0, 1, 10.0, false),
            rec(1, 0, 20.0, false),
            rec(2, 0, 0.0, true),
        ];
        let r = Results::new(serde_json::json!({}), &rs, 1.0);
        let t = r.table();
        assert!(t.contains("| all | 2 | 1 |"), "{t}");
        assert!(t.contains("| priority 1 | 1 | 0 | 10.0 |"), "{t}");
        assert!(t.contains("503: 1"), "{t}");
        // One of three within its 15 ms target: the 10 ms one.
        assert!(t.contains("| 33.3% | 1.00 |"), "{t}");
        assert_eq!(ttft_by_tier(&r).len(), 2);
        assert_eq!(ttft_by_tier(&r)[0].0, "p1");
    }

    #[test]
    fn write_produces_json_jsonl_and_markdown() {
        let dir = tempfile::tempdir().expect("tempdir");
        let rs = vec![rec(0, 0, 10.0, false), rec(1, 0, 30.0, false)];
        let r = Results::new(serde_json::json!({"mode": "test"}), &rs, 2.0);
        r.write(dir.path(), &rs).expect("writes");
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join("results.json")).expect("json"),
        )
        .expect("parses");
        assert_eq!(v["overall"]["completed"], 2);
        assert_eq!(v["overall"]["ttft_ms"]["mean"], 20.0);
        assert_eq!(v["tiers"][0]["priority"], 0);
        assert_eq!(v["config"]["mode"], "test");
        let lines = std::fs::read_to_string(dir.path().join("requests.jsonl")).expect("jsonl");
        assert_eq!(lines.lines().count(), 2);
        assert!(dir.path().join("results.md").exists());
    }
}
