//! The router's own flags (`sluice router`, and `sluice up` which flattens
//! them beside the other services'). Common flags (`--etcd`, `--listen`, …)
//! live in `sluice_runtime::CommonArgs`. Every flag also reads `SLUICE_*`.

use std::time::Duration;

use crate::error::RouterError;
use crate::pool::PoolConfig;
use crate::selector::{CostParams, RouterMode};

/// Router flags.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "router-args")]
#[command(next_help_heading = "Router")]
pub struct Args {
    /// How to choose a worker.
    #[arg(long, env = "SLUICE_ROUTER_MODE", value_enum, default_value_t = RouterMode::Latency)]
    pub router_mode: RouterMode,

    /// 0 = always the lowest cost; > 0 = sample a softmax over normalised costs.
    #[arg(long, env = "SLUICE_ROUTER_TEMPERATURE", default_value_t = 0.0)]
    pub router_temperature: f64,

    /// Weight of prefill blocks in the cost (Dynamo's `overlap_score_weight`).
    #[arg(long, env = "SLUICE_PREFILL_LOAD_SCALE", default_value_t = 1.0)]
    pub prefill_load_scale: f64,

    /// Weight of a candidate's active decode blocks in the cost (1 = Dynamo's cost).
    /// Decode blocks delay a new prompt's prefill far less than queued
    /// prefill does, hence the default below 1.
    #[arg(long, env = "SLUICE_DECODE_LOAD_SCALE", default_value_t = 0.25)]
    pub decode_load_scale: f64,

    /// Extra prefill blocks credited per cached prompt block (0 = Dynamo's cost).
    #[arg(long, env = "SLUICE_OVERLAP_CREDIT", default_value_t = 8.0)]
    pub overlap_credit: f64,

    /// A worker with more than this many times the mean active requests
    /// (plus one) is not chosen, whatever it holds cached; 0 = no bound.
    #[arg(long, env = "SLUICE_BALANCE_BOUND", default_value_t = 2.0)]
    pub balance_bound: f64,

    /// A worker whose queued prefill is more than this many of its engine
    /// steps (`--max-num-batched-tokens`) longer than the shortest queue is
    /// not chosen, whatever it holds cached: the most a cache hit may make
    /// a request wait; 0 = no bound.
    #[arg(long, env = "SLUICE_PREFILL_QUEUE_BOUND", default_value_t = 0.0)]
    pub prefill_queue_bound: f64,

    /// Cost per active request on a worker.
    #[arg(long, env = "SLUICE_ACTIVE_REQUEST_WEIGHT", default_value_t = 0.0)]
    pub active_request_weight: f64,

    /// `approx` mode: seconds a placed prompt is predicted to stay cached.
    #[arg(long, env = "SLUICE_APPROX_TTL_SECS", default_value_t = 120)]
    pub approx_ttl_secs: u64,

    /// Seconds an orphaned placement still counts as load: one whose client
    /// (a queue) went away without releasing it, or one made by a unary
    /// `Route` call, which nobody releases. Placements on a `Place` session
    /// count until their client releases them, however long they run.
    #[arg(long, env = "SLUICE_PLACEMENT_MAX_AGE_SECS", default_value_t = 10)]
    pub placement_max_age_secs: u64,

    /// Fastest load report rate asked of workers, in ms.
    #[arg(long, env = "SLUICE_LOAD_MIN_INTERVAL_MS", default_value_t = 20)]
    pub load_min_interval_ms: u32,

    /// Slowest load report rate asked of workers, in ms.
    #[arg(long, env = "SLUICE_LOAD_MAX_INTERVAL_MS", default_value_t = 1000)]
    pub load_max_interval_ms: u32,

    /// Consecutive failed connections after which a worker leaves the pool
    /// (its blocks forgotten) until it answers again.
    #[arg(long, env = "SLUICE_WORKER_MAX_FAILURES", default_value_t = 3)]
    pub worker_max_failures: u32,

    /// Seconds to wait at start for every known worker's snapshot before
    /// reporting ready.
    #[arg(
        long = "router-sync-timeout-secs",
        env = "SLUICE_ROUTER_SYNC_TIMEOUT_SECS",
        default_value_t = 10
    )]
    pub sync_timeout_secs: u64,
}

impl Default for Args {
    fn default() -> Self {
        Self {
            router_mode: RouterMode::Latency,
            router_temperature: 0.0,
            prefill_load_scale: 1.0,
            decode_load_scale: 0.25,
            overlap_credit: 8.0,
            active_request_weight: 0.0,
            balance_bound: 2.0,
            prefill_queue_bound: 0.0,
            approx_ttl_secs: 120,
            placement_max_age_secs: 10,
            load_min_interval_ms: 20,
            load_max_interval_ms: 1000,
            worker_max_failures: 3,
            sync_timeout_secs: 10,
        }
    }
}

impl Args {
    /// Checks the flags; errors name the flag and what to fix.
    pub fn validate(&self) -> Result<(), RouterError> {
        let finite_non_negative = |flag: &str, v: f64| {
            if v.is_finite() && v >= 0.0 {
                Ok(())
            } else {
                Err(RouterError::Config(format!(
                    "{flag} must be a finite number ≥ 0, got {v}"
                )))
            }
        };
        finite_non_negative("--router-temperature", self.router_temperature)?;
        finite_non_negative("--prefill-load-scale", self.prefill_load_scale)?;
        finite_non_negative("--decode-load-scale", self.decode_load_scale)?;
        finite_non_negative("--overlap-credit", self.overlap_credit)?;
        finite_non_negative("--active-request-weight", self.active_request_weight)?;
        finite_non_negative("--balance-bound", self.balance_bound)?;
        finite_non_negative("--prefill-queue-bound", self.prefill_queue_bound)?;
        if self.approx_ttl_secs == 0 {
            return Err(RouterError::Config(
                "--approx-ttl-secs must be at least 1".into(),
            ));
        }
        if self.placement_max_age_secs == 0 {
            return Err(RouterError::Config(
                "--placement-max-age-secs must be at least 1".into(),
            ));
        }
        if self.load_max_interval_ms == 0 || self.load_min_interval_ms > self.load_max_interval_ms {
            return Err(RouterError::Config(format!(
                "--load-min-interval-ms ({}) must be ≤ --load-max-interval-ms ({}), which must be > 0",
                self.load_min_interval_ms, self.load_max_interval_ms
            )));
        }
        if self.worker_max_failures == 0 {
            return Err(RouterError::Config(
                "--worker-max-failures must be at least 1".into(),
            ));
        }
        Ok(())
    }

    /// The placement settings of every pool.
    pub fn pool_config(&self) -> PoolConfig {
        PoolConfig {
            mode: self.router_mode,
            cost: CostParams {
                prefill_load_scale: self.prefill_load_scale,
                decode_load_scale: self.decode_load_scale,
                overlap_credit: self.overlap_credit,
                active_request_weight: self.active_request_weight,
                balance_bound: self.balance_bound,
                prefill_queue_bound: self.prefill_queue_bound,
                temperature: self.router_temperature,
            },
            approx_ttl: Duration::from_secs(self.approx_ttl_secs),
            placement_max_age: Duration::from_secs(self.placement_max_age_secs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    #[test]
    fn flags_parse_and_defaults_validate() {
        let cli = Cli::try_parse_from([
            "router",
            "--router-mode",
            "round-robin",
            "--router-temperature",
            "0.5",
            "--overlap-credit",
            "1",
        ])
        .expect("parses");
        assert_eq!(cli.args.router_mode, RouterMode::RoundRobin);
        assert_eq!(cli.args.pool_config().cost.temperature, 0.5);
        cli.args.validate().expect("valid");
        Args::default().validate().expect("defaults valid");
    }

    #[test]
    fn negative_temperature_is_rejected_naming_the_flag() {
        let a = Args {
            router_temperature: -1.0,
            ..Args::default()
        };
        let err = a.validate().expect_err("invalid").to_string();
        assert!(err.contains("--router-temperature"), "{err}");
    }
}
