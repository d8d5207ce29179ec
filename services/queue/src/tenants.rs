//! Tenants' weights and quotas (`--tenant-limits FILE`), and the part of
//! each quota this queue replica enforces.
//!
//! # The file
//!
//! One tenant per line, `TENANT [weight=N] [tpm=N] [concurrency=N]`; blank
//! lines and `#` comments are skipped. `*` sets the limits of every tenant
//! not listed (a listed tenant takes nothing from `*`). `default` is the
//! tenant of requests that name none.
//!
//! ```text
//! # tenant   weight    tokens/minute   requests in flight
//! acme       weight=3  tpm=600000      concurrency=64
//! free                 tpm=20000       concurrency=4
//! *                    tpm=100000
//! ```
//!
//! - `weight`: the tenant's share under `fair` (and `wfq` by tenant),
//!   ahead of the weight its API key carries.
//! - `tpm`: tokens per minute, counting prompt tokens not expected in cache
//!   and output tokens, each when it becomes known (prompt tokens when the
//!   request is admitted, corrected by the placement's cached prefix;
//!   output tokens as the frontend reports them). A token bucket holding
//!   one minute of tokens, refilled continuously: a request is admitted
//!   while the bucket is above zero and may take it below, and the next
//!   request waits until the refill brings it back above zero
//!   (`Retry-After`).
//! - `concurrency`: requests pending or running at once.
//!
//! # Several queue replicas
//!
//! Each replica enforces its share of every limit: the budget is split by
//! the number of queue replicas in discovery. The frontends spread every
//! request over the replicas round-robin, so each replica sees about 1/N of
//! each tenant's traffic, and no replica has to ask another or etcd on the
//! request path (etcd's write latency would be paid per request, and its
//! outage would stop admission). The sum of the shares is the limit, so
//! the limit holds across replicas; when the replica count changes, each
//! replica rescales its buckets at once, and only a replica that starts
//! (or restarts) with a full bucket can let through more: at most its share
//! of one refill interval (one minute) of tokens. Concurrency limits are
//! split as whole requests (replica of rank r of N gets `C / N`, plus one
//! while `r < C mod N`): they hold exactly, but a limit below the number
//! of replicas leaves some replicas refusing the tenant, so set it to at
//! least N. The cost: a tenant whose traffic reaches the replicas unevenly
//! is limited by its busiest replica's share.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use sluice_runtime::{Discovery, DiscoveryEvent};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::{QueueError, Quota};
use crate::queue::Queue;

/// The tenant name of `*` lines.
const ANY: &str = "*";

/// The default tenant's name: requests that name no tenant.
pub const DEFAULT_TENANT: &str = "default";

/// One tenant's weight and limits; `None` = not set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Fair-share weight (≥ 1).
    pub weight: Option<u32>,
    /// Tokens per minute (≥ 1).
    pub tpm: Option<u64>,
    /// Requests pending or running at once (≥ 1).
    pub concurrency: Option<u32>,
}

/// The parsed `--tenant-limits` file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLimits {
    by_tenant: HashMap<String, Limits>,
    any: Option<Limits>,
}

impl TenantLimits {
    /// Reads and parses `path`; the error names the line.
    pub fn from_path(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        text.parse().map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The limits of `tenant` ("" is the default tenant).
    pub fn get(&self, tenant: &str) -> Option<&Limits> {
        let tenant = if tenant.is_empty() {
            DEFAULT_TENANT
        } else {
            tenant
        };
        self.by_tenant.get(tenant).or(self.any.as_ref())
    }

    /// Whether any tenant has a quota.
    pub fn has_quotas(&self) -> bool {
        self.by_tenant
            .values()
            .chain(self.any.as_ref())
            .any(|l| l.tpm.is_some() || l.concurrency.is_some())
    }
}

impl std::str::FromStr for TenantLimits {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let mut out = Self::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default().trim();
            if line.is_empty() {
                continue;
            }
            let at = |reason: String| format!("line {}: {reason}", n + 1);
            let mut fields = line.split_whitespace();
            let Some(tenant) = fields.next() else {
                continue;
            };
            let mut limits = Limits::default();
            for field in fields {
                let (key, value) = field.split_once('=').ok_or_else(|| {
                    at(format!(
                        "{field:?} is not KEY=VALUE (keys: weight, tpm, concurrency)"
                    ))
                })?;
                let number = value
                    .parse::<u64>()
                    .ok()
                    .filter(|&v| v >= 1)
                    .ok_or_else(|| at(format!("{key}={value:?} must be an integer ≥ 1")))?;
                let small = || {
                    u32::try_from(number).map_err(|_| {
                        at(format!("{key}={value} is too large (at most {})", u32::MAX))
                    })
                };
                match key {
                    "weight" => limits.weight = Some(small()?),
                    "tpm" => limits.tpm = Some(number),
                    "concurrency" => limits.concurrency = Some(small()?),
                    other => {
                        return Err(at(format!(
                            "unknown key {other:?} (keys: weight, tpm, concurrency)"
                        )));
                    }
                }
            }
            if tenant == ANY {
                if out.any.replace(limits).is_some() {
                    return Err(at("`*` is listed twice".into()));
                }
            } else if out.by_tenant.insert(tenant.to_owned(), limits).is_some() {
                return Err(at(format!("tenant {tenant:?} is listed twice")));
            }
        }
        Ok(out)
    }
}

impl fmt::Display for TenantLimits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quotas = self
            .by_tenant
            .values()
            .filter(|l| l.tpm.is_some() || l.concurrency.is_some())
            .count();
        write!(f, "{} tenants ({quotas} with quotas)", self.by_tenant.len())?;
        if self.any.is_some() {
            f.write_str(" and `*`")?;
        }
        Ok(())
    }
}

/// This replica's place among the queue replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replicas {
    /// Queue replicas in discovery, this one included (≥ 1).
    pub count: u32,
    /// This replica's 0-based rank by instance id.
    pub rank: u32,
}

impl Default for Replicas {
    fn default() -> Self {
        Self { count: 1, rank: 0 }
    }
}

impl Replicas {
    fn tokens(self, tpm: u64) -> f64 {
        tpm as f64 / f64::from(self.count.max(1))
    }

    fn requests(self, limit: u32) -> u32 {
        let n = self.count.max(1);
        limit / n + u32::from(self.rank % n < limit % n)
    }
}

/// Follows the queue replicas in discovery and tells `queue` how many
/// there are and its rank among them (`me` is this replica's instance id,
/// counted even before its registration shows), until `stop`.
pub(crate) async fn follow_replicas(
    queue: Queue,
    discovery: Arc<dyn Discovery>,
    me: String,
    stop: CancellationToken,
) {
    let watch = match discovery.watch(crate::COMPONENT).await {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(error = %e, "cannot follow the queue replicas; quotas are enforced as if this replica were alone");
            return;
        }
    };
    let mut ids = BTreeSet::from([me.clone()]);
    let mut last = None;
    let on = |event| {
        match event {
            DiscoveryEvent::Put(instance) => {
                ids.insert(instance.id);
            }
            DiscoveryEvent::Delete { id, .. } if id != me => {
                ids.remove(&id);
            }
            DiscoveryEvent::Delete { .. } => {}
        }
        let replicas = Replicas {
            count: u32::try_from(ids.len()).unwrap_or(u32::MAX),
            rank: u32::try_from(ids.iter().position(|id| *id == me).unwrap_or(0)).unwrap_or(0),
        };
        if last != Some(replicas) {
            tracing::info!(
                replicas = replicas.count,
                rank = replicas.rank,
                "queue replicas changed; tenant quotas are split accordingly"
            );
            queue.set_replicas(replicas);
            last = Some(replicas);
        }
    };
    watch.follow(&stop, on).await;
}

/// One tenant's use of its quotas on this replica.
#[derive(Debug, Clone)]
struct Usage {
    /// Tokens left in this replica's bucket (may be negative: a debt).
    level: f64,
    /// When `level` was last refilled.
    at: Instant,
    /// Requests pending or running.
    in_flight: u32,
}

/// How often tenants with nothing in flight and a refilled bucket are
/// forgotten (a tenant that left in debt is otherwise kept until it
/// returns).
const SWEEP: Duration = Duration::from_secs(60);

/// The quotas this replica enforces and what each tenant has used.
#[derive(Debug, Default)]
pub(crate) struct Quotas {
    limits: TenantLimits,
    replicas: Replicas,
    usage: HashMap<String, Usage>,
    swept: Option<Instant>,
}

impl Quotas {
    pub(crate) fn new(limits: TenantLimits) -> Self {
        Self {
            limits,
            replicas: Replicas::default(),
            usage: HashMap::new(),
            swept: None,
        }
    }

    /// Forgets, at most once per [`SWEEP`], every tenant with nothing in
    /// flight whose bucket has refilled: its record says nothing a fresh
    /// one would not.
    fn sweep(&mut self, now: Instant) {
        let due = self
            .swept
            .is_none_or(|at| now.saturating_duration_since(at) >= SWEEP);
        if !due {
            return;
        }
        self.swept = Some(now);
        let (limits, replicas) = (&self.limits, self.replicas);
        self.usage.retain(|tenant, usage| {
            if usage.in_flight > 0 {
                return true;
            }
            match limits.get(tenant).and_then(|l| l.tpm) {
                Some(tpm) => {
                    let capacity = replicas.tokens(tpm);
                    refill(usage, capacity, now);
                    usage.level < capacity
                }
                None => false,
            }
        });
    }

    /// The tenant's fair-share weight from the file, if it sets one.
    pub(crate) fn weight(&self, tenant: &str) -> Option<u32> {
        self.limits.get(tenant).and_then(|l| l.weight)
    }

    /// A new replica count: every bucket is rescaled to the new share.
    pub(crate) fn set_replicas(&mut self, replicas: Replicas) {
        let replicas = Replicas {
            count: replicas.count.max(1),
            rank: replicas.rank,
        };
        let scale = f64::from(self.replicas.count) / f64::from(replicas.count);
        for usage in self.usage.values_mut() {
            usage.level *= scale;
        }
        self.replicas = replicas;
    }

    /// Admits one request of `tenant` with `prompt_tokens` (charged now, as
    /// if none were cached), or refuses it naming the quota and when to
    /// retry.
    pub(crate) fn admit(
        &mut self,
        tenant: &str,
        prompt_tokens: u32,
        now: Instant,
    ) -> Result<(), QueueError> {
        self.sweep(now);
        let Some(&limits) = self.limits.get(tenant) else {
            return Ok(());
        };
        if limits.tpm.is_none() && limits.concurrency.is_none() {
            return Ok(());
        }
        let replicas = self.replicas;
        let usage = self.usage.entry(tenant.to_owned()).or_insert(Usage {
            level: limits.tpm.map_or(0.0, |t| replicas.tokens(t)),
            at: now,
            in_flight: 0,
        });
        if let Some(limit) = limits.concurrency {
            let share = replicas.requests(limit);
            if usage.in_flight >= share {
                return Err(QueueError::QuotaExceeded {
                    tenant: tenant.to_owned(),
                    quota: Quota::Requests {
                        limit,
                        share,
                        replicas: replicas.count,
                    },
                    retry_after: Duration::from_secs(1),
                });
            }
        }
        if let Some(tpm) = limits.tpm {
            let capacity = replicas.tokens(tpm);
            refill(usage, capacity, now);
            if usage.level <= 0.0 {
                // Whole seconds until the refill lifts the bucket above 0.
                let rate = capacity / 60.0;
                let secs = ((-usage.level + 1.0) / rate).ceil().clamp(1.0, 3600.0);
                return Err(QueueError::QuotaExceeded {
                    tenant: tenant.to_owned(),
                    quota: Quota::Tokens {
                        per_minute: tpm,
                        share: capacity.round() as u64,
                        replicas: replicas.count,
                    },
                    retry_after: Duration::from_secs(secs as u64),
                });
            }
            usage.level -= f64::from(prompt_tokens);
        }
        usage.in_flight += 1;
        Ok(())
    }

    /// Charges `tokens` of work (negative: a refund) to `tenant`'s bucket.
    pub(crate) fn charge(&mut self, tenant: &str, tokens: f64, now: Instant) {
        let Some(tpm) = self.limits.get(tenant).and_then(|l| l.tpm) else {
            return;
        };
        let capacity = self.replicas.tokens(tpm);
        if let Some(usage) = self.usage.get_mut(tenant) {
            refill(usage, capacity, now);
            usage.level = (usage.level - tokens).min(capacity);
        }
    }

    /// One of `tenant`'s admitted requests left (ended, refused or
    /// cancelled). A tenant with nothing in flight and a full bucket is
    /// forgotten.
    pub(crate) fn release(&mut self, tenant: &str, now: Instant) {
        let capacity = self
            .limits
            .get(tenant)
            .and_then(|l| l.tpm)
            .map(|t| self.replicas.tokens(t));
        let Some(usage) = self.usage.get_mut(tenant) else {
            return;
        };
        usage.in_flight = usage.in_flight.saturating_sub(1);
        let full = match capacity {
            Some(c) => {
                refill(usage, c, now);
                usage.level >= c
            }
            None => true,
        };
        if usage.in_flight == 0 && full {
            self.usage.remove(tenant);
        }
    }

    /// Tenants with usage on record (tests: nothing leaks).
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.usage.len()
    }
}

/// Adds the tokens refilled since `usage.at` (one `capacity` per minute).
fn refill(usage: &mut Usage, capacity: f64, now: Instant) {
    let elapsed = now.saturating_duration_since(usage.at).as_secs_f64();
    usage.level = (usage.level + elapsed * capacity / 60.0).min(capacity);
    usage.at = now;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(text: &str) -> TenantLimits {
        text.parse().expect("parses")
    }

    #[test]
    fn the_file_names_tenants_keys_and_a_default() {
        let l = limits(
            "# comment\nacme weight=3 tpm=600000 concurrency=64\n\nfree tpm=20000 # inline\n* concurrency=8\n",
        );
        assert_eq!(
            l.get("acme"),
            Some(&Limits {
                weight: Some(3),
                tpm: Some(600_000),
                concurrency: Some(64)
            })
        );
        assert_eq!(
            l.get("free").and_then(|x| x.concurrency),
            None,
            "no inheritance"
        );
        assert_eq!(l.get("other").and_then(|x| x.concurrency), Some(8));
        assert!(l.has_quotas());
        assert!(!limits("acme weight=2").has_quotas());
        let with_default = limits("default tpm=5");
        assert_eq!(with_default.get("").and_then(|x| x.tpm), Some(5));
    }

    #[test]
    fn malformed_lines_are_refused_naming_the_line() {
        let err = |text: &str| text.parse::<TenantLimits>().expect_err(text);
        assert!(err("a tpm").starts_with("line 1: \"tpm\" is not KEY=VALUE"));
        assert!(err("a\nb tpm=0").starts_with("line 2: tpm=\"0\" must be"));
        assert!(err("a rpm=3").contains("unknown key \"rpm\""));
        assert!(err("a weight=99999999999").contains("too large"));
        assert!(err("a\na").contains("listed twice"));
        assert!(err("*\n* tpm=1").contains("`*` is listed twice"));
    }

    #[test]
    fn shares_split_the_budget_by_replica_count_and_rank() {
        let r = |count, rank| Replicas { count, rank };
        assert_eq!(r(2, 0).tokens(60_000), 30_000.0);
        let concurrency: Vec<u32> = (0..3).map(|rank| r(3, rank).requests(7)).collect();
        assert_eq!(concurrency, [3, 2, 2]);
        assert_eq!(concurrency.iter().sum::<u32>(), 7, "the shares add up");
        assert_eq!(r(4, 3).requests(2), 0, "a limit below N leaves some out");
    }

    #[tokio::test(start_paused = true)]
    async fn tokens_per_minute_refuse_with_a_retry_after_from_the_refill() {
        let mut q = Quotas::new(limits("a tpm=600"));
        let now = Instant::now();
        q.admit("a", 500, now).expect("first fits");
        q.admit("a", 500, now)
            .expect("above zero: admitted into debt");
        q.charge("a", 100.0, now); // output tokens: level 600 - 1100 = -500
        let err = q.admit("a", 1, now).expect_err("in debt");
        // 10 tokens/s: 501 tokens take 51 s.
        assert!(
            matches!(&err, QueueError::QuotaExceeded { quota: Quota::Tokens { per_minute: 600, .. }, retry_after, .. } if retry_after.as_secs() == 51),
            "{err:?}"
        );
        assert!(err.to_string().contains("tokens per minute"), "{err}");
        let later = now + Duration::from_secs(51);
        q.admit("a", 1, later).expect("refilled");
        q.admit("b", 10_000, now).expect("b has no quota");
        assert_eq!(q.tracked(), 1);
        q.release("a", later);
        q.release("a", later);
        q.release("a", later);
        assert_eq!(q.tracked(), 1, "left in debt: kept");
        q.admit("b", 1, later + SWEEP * 2).expect("no quota");
        assert_eq!(q.tracked(), 0, "refilled and idle: swept");
    }

    #[tokio::test(start_paused = true)]
    async fn concurrency_counts_requests_in_flight_until_released() {
        let mut q = Quotas::new(limits("a concurrency=2"));
        let now = Instant::now();
        q.admit("a", 1, now).expect("1");
        q.admit("a", 1, now).expect("2");
        let err = q.admit("a", 1, now).expect_err("3");
        assert!(
            matches!(
                &err,
                QueueError::QuotaExceeded {
                    quota: Quota::Requests { limit: 2, .. },
                    ..
                }
            ),
            "{err:?}"
        );
        q.release("a", now);
        q.admit("a", 1, now).expect("a slot freed");
        q.release("a", now);
        q.release("a", now);
        assert_eq!(q.tracked(), 0, "nothing in flight and no bucket: forgotten");
    }

    #[tokio::test(start_paused = true)]
    async fn two_replicas_each_enforce_half_and_rescale_when_one_leaves() {
        let mut q = Quotas::new(limits("a tpm=1200 concurrency=3"));
        q.set_replicas(Replicas { count: 2, rank: 0 });
        let now = Instant::now();
        q.admit("a", 600, now).expect("half the budget: 600");
        let err = q
            .admit("a", 1, now)
            .expect_err("this replica's share is spent");
        assert!(err.to_string().contains("share 600 of 2 replicas"), "{err}");
        q.release("a", now);
        q.charge("a", -600.0, now);
        // Rank 0 of 2 gets 2 of 3 concurrent requests (rank 1 gets 1).
        q.admit("a", 1, now).expect("refunded");
        q.admit("a", 1, now).expect("second of 2");
        let err = q.admit("a", 1, now).expect_err("concurrency share 2");
        assert!(err.to_string().contains("share 2 of 2 replicas"), "{err}");
        q.set_replicas(Replicas { count: 1, rank: 0 });
        q.admit("a", 1, now).expect("alone: the whole limit");
    }
}
