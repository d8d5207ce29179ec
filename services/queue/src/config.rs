//! The queue's command-line configuration: one `clap` struct per concern,
//! passed straight to the domain code (no second internal config).
//!
//! Every flag reads `SLUICE_` + its name in upper snake case.
//! [`Args::validate`] runs right after parsing; its errors name the flag.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::ValueEnum;

use sluice_runtime::config::parse_pairs;

use crate::error::QueueError;
use crate::tenants::TenantLimits;

fn parse_tenant_limits(path: &str) -> Result<TenantLimits, String> {
    TenantLimits::from_path(std::path::Path::new(path))
}

/// Release order among held requests of one strict tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Earliest effective arrival first; priority is an arrival-time bump in
    /// seconds (negatives count as 0), as in Dynamo.
    Fcfs,
    /// Largest (1 + priority) / max(1, uncached prompt tokens) first: short
    /// uncached work first, weighted by priority (negatives count as 0).
    Wspt,
    /// Highest priority first, first come first served within a priority.
    Strict,
    /// Weighted fair queueing across classes (`--wfq-class`) with a
    /// virtual counter per class, charged per request or per token
    /// (`--wfq-cost`), so the lowest class's wait is bounded.
    Wfq,
    /// Strict priority between bands of equal priority; inside a band,
    /// tenants share by weight in work: prompt tokens not cached plus
    /// output tokens, charged as they are produced.
    Fair,
}

impl Policy {
    /// The name used on the command line and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Wspt => "wspt",
            Self::Strict => "strict",
            Self::Wfq => "wfq",
            Self::Fair => "fair",
        }
    }

    /// The wire enum (`StatsResponse.policy`).
    pub fn to_pb(self) -> sluice_proto::queue::v1::QueuePolicy {
        use sluice_proto::queue::v1::QueuePolicy as Pb;
        match self {
            Self::Fcfs => Pb::Fcfs,
            Self::Wspt => Pb::Wspt,
            Self::Strict => Pb::Strict,
            Self::Wfq => Pb::Wfq,
            Self::Fair => Pb::Fair,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a `wfq` class is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WfqClass {
    /// One class per tenant; class key = tenant name ("default" for "").
    Tenant,
    /// One class per priority; class key = the priority, e.g. `-1`, `0`, `3`.
    Priority,
    /// One class per tenant and priority; class key = `tenant/priority`.
    TenantPriority,
}

/// What a release costs a `wfq` class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WfqCost {
    /// One per request: classes share requests.
    Requests,
    /// Prompt tokens not cached plus output tokens, as produced: classes
    /// share work.
    Tokens,
}

/// `--wfq-weights`: `CLASS=WEIGHT,...`; classes not listed weigh
/// `--wfq-default-weight`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WfqWeights(pub HashMap<String, u32>);

impl FromStr for WfqWeights {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let pairs = parse_pairs::<String, u32>(s, '=', "CLASS=WEIGHT")?;
        if let Some((class, _)) = pairs.iter().find(|(_, w)| *w == 0) {
            return Err(format!("weight of {class:?} must be at least 1"));
        }
        Ok(Self(pairs.into_iter().collect()))
    }
}

impl fmt::Display for WfqWeights {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<_> = self.0.iter().collect();
        items.sort();
        for (i, (class, weight)) in items.into_iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{class}={weight}")?;
        }
        Ok(())
    }
}

/// `--ttft-targets` and `--tpot-targets`: `PRIORITY=SECS,...`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TargetsByPriority(pub HashMap<i32, f64>);

impl FromStr for TargetsByPriority {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let pairs = parse_pairs::<i32, f64>(s, '=', "PRIORITY=SECS")?;
        if let Some((priority, secs)) = pairs.iter().find(|(_, s)| !(s.is_finite() && *s > 0.0)) {
            return Err(format!(
                "target of priority {priority} must be a number of seconds > 0, got {secs}"
            ));
        }
        Ok(Self(pairs.into_iter().collect()))
    }
}

impl fmt::Display for TargetsByPriority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut items: Vec<_> = self.0.iter().collect();
        items.sort_by_key(|(p, _)| std::cmp::Reverse(**p));
        for (i, (priority, secs)) in items.into_iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{priority}={secs}")?;
        }
        Ok(())
    }
}

/// The queue service's own flags (the common ones are the runtime's
/// `CommonArgs`): placement source, policy and limits.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "queue-args")]
#[command(next_help_heading = "Queue")]
pub struct Args {
    /// Router to place requests with (`host:port` or URL). Unset: every
    /// router instance found in discovery, in turn.
    #[arg(long, env = "SLUICE_ROUTER_ENDPOINT")]
    pub router_endpoint: Option<String>,

    /// Release order among held requests of one strict tier. `strict` (the
    /// default): highest priority first, first come first served within a
    /// priority, so a higher priority is never held behind a lower one.
    #[arg(long, env = "SLUICE_QUEUE_POLICY", value_enum, default_value_t = Policy::Strict)]
    pub queue_policy: Policy,

    /// Hold requests while every eligible worker has more than
    /// F × max_num_batched_tokens active prefill tokens ahead of the request
    /// (on a worker whose engine schedules by priority, lower-priority
    /// prefill granted by this queue is not ahead). Unset (and no
    /// `--max-active`): default holding, by the workers' `max_num_seqs`.
    #[arg(long, env = "SLUICE_QUEUE_THRESHOLD", allow_negative_numbers = true)]
    pub queue_threshold: Option<f64>,

    /// Requests pending (held or being placed) across the queue; beyond it
    /// admission fails with RESOURCE_EXHAUSTED.
    #[arg(long, env = "SLUICE_MAX_PENDING", default_value_t = 4096)]
    pub max_pending: usize,

    /// Requests pending per tenant.
    #[arg(long, env = "SLUICE_MAX_PENDING_PER_TENANT", default_value_t = 4096)]
    pub max_pending_per_tenant: usize,

    /// Granted leases per model at once; further requests are held until a
    /// lease ends. 0 = default holding (by the workers' `max_num_seqs`, or
    /// `--queue-threshold` when set).
    #[arg(long, env = "SLUICE_MAX_ACTIVE", default_value_t = 0)]
    pub max_active: usize,

    /// Turn default holding off: with neither `--queue-threshold` nor
    /// `--max-active`, every request is placed at once and waits, if it
    /// must, in an engine's own queue (only `--max-pending` bounds the
    /// queue).
    #[arg(long, env = "SLUICE_NO_DEFAULT_HOLDING")]
    pub no_default_holding: bool,

    /// The time to first token a request may wait for when it names no
    /// target of its own (`nvext.agent_hints.ttft_target_ms`), in seconds.
    /// A request whose predicted wait in the queue exceeds its target is
    /// refused at once (429, `Retry-After`); one still held when its target
    /// passes is released with the same answer. `--ttft-targets` sets it
    /// per priority.
    #[arg(long, env = "SLUICE_TTFT_TARGET_SECS", default_value_t = 60.0)]
    pub ttft_target_secs: f64,

    /// Default TTFT targets by priority, `PRIORITY=SECS,...` (e.g.
    /// `3=5,0=120`); priorities not listed take `--ttft-target-secs`.
    #[arg(
        long,
        env = "SLUICE_TTFT_TARGETS",
        default_value_t = TargetsByPriority::default(),
        allow_hyphen_values = true
    )]
    pub ttft_targets: TargetsByPriority,

    /// Default TPOT targets by priority, `PRIORITY=SECS,...` (e.g.
    /// `3=0.05`): the time per output token a request of that priority
    /// asks for when it names none (`nvext.agent_hints.tpot_target_ms`).
    /// The router keeps such a request off workers whose decode batch would
    /// be slower. Priorities not listed have none.
    #[arg(
        long,
        env = "SLUICE_TPOT_TARGETS",
        default_value_t = TargetsByPriority::default(),
        allow_hyphen_values = true
    )]
    pub tpot_targets: TargetsByPriority,

    /// Requests with priority above this keep the reserved share of pending
    /// capacity (`--shed-protect-fraction`).
    #[arg(
        long,
        env = "SLUICE_SHED_PROTECT_PRIORITY",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub shed_protect_priority: i32,

    /// Share of `--max-pending` that requests at or below
    /// `--shed-protect-priority` cannot take. 0 disables shedding.
    #[arg(long, env = "SLUICE_SHED_PROTECT_FRACTION", default_value_t = 0.2)]
    pub shed_protect_fraction: f64,

    /// What a `wfq` class is made of.
    #[arg(long, env = "SLUICE_WFQ_CLASS", value_enum, default_value_t = WfqClass::Priority)]
    pub wfq_class: WfqClass,

    /// `wfq` weights, `CLASS=WEIGHT,...` (e.g. `3=8,0=2,-1=1` by priority or
    /// `gold=4,free=1` by tenant). A class releases up to WEIGHT requests per
    /// round.
    #[arg(
        long,
        env = "SLUICE_WFQ_WEIGHTS",
        default_value_t = WfqWeights::default(),
        allow_hyphen_values = true
    )]
    pub wfq_weights: WfqWeights,

    /// Weight of `wfq` classes not named in `--wfq-weights`.
    #[arg(long, env = "SLUICE_WFQ_DEFAULT_WEIGHT", default_value_t = 1)]
    pub wfq_default_weight: u32,

    /// What a release costs a `wfq` class (`fair` always counts tokens).
    #[arg(long, env = "SLUICE_WFQ_COST", value_enum, default_value_t = WfqCost::Requests)]
    pub wfq_cost: WfqCost,

    /// Tenants' weights and quotas: lines of `TENANT [weight=N] [tpm=N]
    /// [concurrency=N]`, `*` for every tenant not listed. Over a quota a
    /// request is refused with RESOURCE_EXHAUSTED and a retry-after. With
    /// several queue replicas each enforces 1/N of every limit.
    #[arg(long, env = "SLUICE_TENANT_LIMITS", value_name = "FILE", value_parser = parse_tenant_limits)]
    pub tenant_limits: Option<TenantLimits>,

    /// A request held longer than this has its prefix overlap re-read from
    /// the router before it is released, in milliseconds.
    #[arg(long, env = "SLUICE_REFRESH_INTERVAL_MS", default_value_t = 500)]
    pub refresh_interval_ms: u64,
}

impl Args {
    /// Checks the values clap cannot; the error names the flag.
    pub fn validate(&self) -> Result<(), QueueError> {
        let err = |flag, reason: String| Err(QueueError::InvalidFlag { flag, reason });
        if let Some(t) = self.queue_threshold
            && !(t.is_finite() && t >= 0.0)
        {
            return err(
                "--queue-threshold",
                format!("{t} must be a finite number ≥ 0 (leave unset to hold nothing)"),
            );
        }
        if !(self.ttft_target_secs.is_finite() && self.ttft_target_secs > 0.0) {
            return err(
                "--ttft-target-secs",
                format!("{} must be a finite number > 0", self.ttft_target_secs),
            );
        }
        if self.max_pending == 0 {
            return err("--max-pending", "must be at least 1".into());
        }
        if self.max_pending_per_tenant == 0 {
            return err("--max-pending-per-tenant", "must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.shed_protect_fraction) {
            return err(
                "--shed-protect-fraction",
                format!("{} must be in [0, 1)", self.shed_protect_fraction),
            );
        }
        if self.wfq_default_weight == 0 {
            return err("--wfq-default-weight", "must be at least 1".into());
        }
        if self.refresh_interval_ms == 0 {
            return err("--refresh-interval-ms", "must be at least 1".into());
        }
        Ok(())
    }

    /// Slots of `max_pending` that only protected priorities may take.
    pub fn reserved_slots(&self) -> usize {
        // The epsilon keeps 0.1 × 30 at 3, not 4.
        let reserved =
            (self.shed_protect_fraction * self.max_pending as f64 - 1e-9).ceil() as usize;
        reserved.min(self.max_pending.saturating_sub(1))
    }

    /// The TPOT target in milliseconds of a request of `priority` that
    /// names `requested_ms` (0 = none): its own, else `--tpot-targets`' for
    /// its priority, else none (0).
    pub fn tpot_target_ms(&self, priority: i32, requested_ms: u32) -> u32 {
        if requested_ms > 0 {
            return requested_ms;
        }
        self.tpot_targets.0.get(&priority).map_or(0, |secs| {
            (secs * 1e3).round().clamp(1.0, f64::from(u32::MAX)) as u32
        })
    }

    /// The TTFT target of a request of `priority` that names `requested_ms`
    /// (0 = none): its own, else `--ttft-targets`' for its priority, else
    /// `--ttft-target-secs`.
    pub fn ttft_target(&self, priority: i32, requested_ms: u32) -> Duration {
        if requested_ms > 0 {
            return Duration::from_millis(u64::from(requested_ms));
        }
        let secs = self
            .ttft_targets
            .0
            .get(&priority)
            .copied()
            .unwrap_or(self.ttft_target_secs);
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// `refresh_interval_ms` as a duration.
    pub fn refresh_interval(&self) -> Duration {
        Duration::from_millis(self.refresh_interval_ms)
    }

    /// One line with the policy, threshold and limits, for the start-up log.
    pub fn summary(&self) -> String {
        let threshold = match (self.queue_threshold, self.max_active) {
            (Some(t), _) => format!("{t}"),
            (None, 0) if self.no_default_holding => "unset (nothing held)".into(),
            (None, 0) => "unset (default holding: workers' max_num_seqs)".into(),
            (None, _) => "unset".into(),
        };
        let max_active = match self.max_active {
            0 => "unlimited".to_owned(),
            n => n.to_string(),
        };
        let router = self.router_endpoint.as_deref().unwrap_or("discovery");
        let mut line = format!(
            "router={router} policy={} threshold={threshold} ttft_target_secs={} ttft_targets={} max_pending={} max_pending_per_tenant={} max_active={max_active} shed_protect_priority={} shed_protect_fraction={} (reserved {} slots) refresh_interval_ms={}",
            self.queue_policy,
            self.ttft_target_secs,
            self.ttft_targets,
            self.max_pending,
            self.max_pending_per_tenant,
            self.shed_protect_priority,
            self.shed_protect_fraction,
            self.reserved_slots(),
            self.refresh_interval_ms,
        );
        if self.queue_policy == Policy::Wfq {
            line.push_str(&format!(
                " wfq_class={} wfq_cost={} wfq_weights={} wfq_default_weight={}",
                self.wfq_class
                    .to_possible_value()
                    .map_or_else(String::new, |v| v.get_name().to_owned()),
                self.wfq_cost
                    .to_possible_value()
                    .map_or_else(String::new, |v| v.get_name().to_owned()),
                self.wfq_weights,
                self.wfq_default_weight
            ));
        }
        if self.queue_policy == Policy::Fair {
            line.push_str(&format!(
                " wfq_weights={} wfq_default_weight={}",
                self.wfq_weights, self.wfq_default_weight
            ));
        }
        if let Some(limits) = &self.tenant_limits {
            line.push_str(&format!(" tenant_limits={limits}"));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        queue: Args,
    }

    fn parse(args: &[&str]) -> Args {
        let mut argv = vec!["queue"];
        argv.extend_from_slice(args);
        Cli::try_parse_from(argv).expect("arguments parse").queue
    }

    #[test]
    fn defaults_validate_and_hold_nothing() {
        let cfg = parse(&[]);
        assert_eq!(
            cfg.queue_policy,
            Policy::Strict,
            "priority first by default"
        );
        assert_eq!(cfg.queue_threshold, None);
        assert!(cfg.validate().is_ok());
        assert_eq!(cfg.reserved_slots(), 820);
        assert_eq!(cfg.ttft_target(0, 0), Duration::from_secs(60));
    }

    #[test]
    fn tpot_targets_by_priority_and_per_request_and_none_by_default() {
        assert_eq!(parse(&[]).tpot_target_ms(3, 0), 0, "no default target");
        let cfg = parse(&["--tpot-targets", "3=0.05"]);
        assert_eq!(cfg.tpot_target_ms(3, 0), 50);
        assert_eq!(cfg.tpot_target_ms(0, 0), 0);
        assert_eq!(cfg.tpot_target_ms(0, 200), 200, "the request's own");
    }

    #[test]
    fn ttft_targets_by_priority_and_per_request() {
        let cfg = parse(&["--ttft-targets", "3=5, -1=120", "--ttft-target-secs", "30"]);
        assert_eq!(cfg.ttft_target(3, 0), Duration::from_secs(5));
        assert_eq!(cfg.ttft_target(-1, 0), Duration::from_secs(120));
        assert_eq!(cfg.ttft_target(0, 0), Duration::from_secs(30));
        assert_eq!(cfg.ttft_target(3, 250), Duration::from_millis(250));
        assert_eq!(cfg.ttft_targets.to_string(), "3=5,-1=120");
        assert!("3=0".parse::<TargetsByPriority>().is_err());
        assert!("x=1".parse::<TargetsByPriority>().is_err());
        assert!(parse(&["--ttft-target-secs", "0"]).validate().is_err());
        // Past any Duration: no target, not a panic.
        let huge = parse(&["--ttft-target-secs", "1e300"]);
        assert_eq!(huge.ttft_target(0, 0), Duration::MAX);
    }

    #[test]
    fn wfq_weights_parse_and_reject_zero() {
        let cfg = parse(&["--queue-policy", "wfq", "--wfq-weights", "3=8, 0=2,-1=1"]);
        assert_eq!(cfg.wfq_weights.0.get("-1"), Some(&1));
        assert_eq!(cfg.wfq_weights.0.get("3"), Some(&8));
        let cfg = parse(&["--wfq-weights", "-1=4"]);
        assert_eq!(
            cfg.wfq_weights.0.get("-1"),
            Some(&4),
            "a negative class parses"
        );
        assert!("a=0".parse::<WfqWeights>().is_err());
        assert!("a".parse::<WfqWeights>().is_err());
    }

    #[test]
    fn validate_names_the_flag() {
        let cases: [(&[&str], &str); 3] = [
            (
                &["--shed-protect-fraction", "1.5"],
                "--shed-protect-fraction",
            ),
            (&["--queue-threshold", "-1"], "--queue-threshold"),
            (&["--max-pending", "0"], "--max-pending"),
        ];
        for (args, expected) in cases {
            let err = parse(args).validate().expect_err(expected);
            assert!(
                matches!(err, QueueError::InvalidFlag { flag, .. } if flag == expected),
                "{err:?}"
            );
            assert!(err.to_string().starts_with(expected));
        }
    }

    #[test]
    fn fair_policy_cost_and_tenant_limits_parse() {
        let dir = std::env::temp_dir().join(format!("sluice-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("limits");
        std::fs::write(&file, "acme weight=3 tpm=1000\n").expect("write");
        let path = file.to_str().expect("utf-8 path");
        let cfg = parse(&["--queue-policy", "fair", "--tenant-limits", path]);
        assert_eq!(cfg.queue_policy, Policy::Fair);
        let limits = cfg.tenant_limits.as_ref().expect("parsed");
        assert_eq!(limits.get("acme").and_then(|l| l.weight), Some(3));
        assert!(
            cfg.summary()
                .contains("tenant_limits=1 tenants (1 with quotas)")
        );
        assert_eq!(parse(&["--wfq-cost", "tokens"]).wfq_cost, WfqCost::Tokens);

        std::fs::write(&file, "acme tpm=x\n").expect("write");
        let mut argv = vec!["queue", "--tenant-limits", path];
        let err = Cli::try_parse_from(argv.drain(..)).err().expect("refused");
        assert!(err.to_string().contains("line 1: tpm=\"x\""), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn negative_protect_priority_parses() {
        let cfg = parse(&["--shed-protect-priority", "-2"]);
        assert_eq!(cfg.shed_protect_priority, -2);
    }
}
