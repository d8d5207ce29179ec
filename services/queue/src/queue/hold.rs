//! When a model's requests are held: the hold rules (`--max-active`,
//! default holding by engine slots, `--queue-threshold`), the backlog
//! bound for bursts and for standing overload, and the rates they use.

use super::*;

/// Time constant of [`DrainRate`], in seconds.
pub(super) const DRAIN_TAU: f64 = 5.0;

/// Events (grants, or arrivals) per second over the last few seconds: a
/// count of events decayed with time constant [`DRAIN_TAU`], divided by it.
#[derive(Debug, Default)]
pub(super) struct DrainRate {
    count: f64,
    at: Option<Instant>,
}

impl DrainRate {
    pub(super) fn decayed(&self, now: Instant) -> f64 {
        self.at.map_or(0.0, |at| {
            let dt = now.saturating_duration_since(at).as_secs_f64();
            self.count * (-dt / DRAIN_TAU).exp()
        })
    }

    pub(super) fn grant(&mut self, now: Instant) {
        self.count = self.decayed(now) + 1.0;
        self.at = Some(now);
    }

    /// Events per second at `now`.
    pub(super) fn per_sec(&self, now: Instant) -> f64 {
        self.decayed(now) / DRAIN_TAU
    }

    /// Whole seconds until `ahead` requests and this one drain at the
    /// current rate: 1 to 60, 1 when nothing was granted yet.
    pub(super) fn retry_after(&self, ahead: usize, now: Instant) -> Duration {
        let rate = self.per_sec(now);
        let secs = if rate > 0.0 {
            ((ahead as f64 + 1.0) / rate).ceil()
        } else {
            1.0
        };
        Duration::from_secs(secs.clamp(1.0, 60.0) as u64)
    }
}

/// Held requests a model may keep under default holding beyond its free
/// engine slots, whatever the grant rate.
pub(super) const BACKLOG_FLOOR: usize = 4;

/// Arrivals outpace grants when they come this many times faster.
pub(super) const OVERLOAD_MARGIN: f64 = 1.1;

/// A priority's decayed arrival count below which it is forgotten.
pub(super) const FORGOTTEN: f64 = 0.01;

/// Neither `--queue-threshold` nor `--max-active` nor
/// `--no-default-holding`: hold by engine slots.
pub(super) fn default_holding(cfg: &Args) -> bool {
    cfg.queue_threshold.is_none() && cfg.max_active == 0 && !cfg.no_default_holding
}

/// The engine slots this replica may fill for `model`: every decode or
/// aggregated rank's `max_num_seqs` less its unplaced requests, summed,
/// split evenly across `replicas` (rounded up). `None` when a rank does not
/// report `max_num_seqs` or the model has no such worker (nothing is held).
pub(super) fn capacity(
    model: &str,
    load: &HashMap<(String, u32), WorkerLoad>,
    replicas: u32,
) -> Option<usize> {
    let mut total = 0usize;
    let mut any = false;
    for w in load.values().filter(|w| {
        (model.is_empty() || w.model.is_empty() || w.model == model)
            && w.role != WorkerRole::Prefill
    }) {
        if w.max_num_seqs == 0 {
            return None;
        }
        any = true;
        total += w.max_num_seqs.saturating_sub(w.unplaced_requests) as usize;
    }
    let replicas = replicas.max(1) as usize;
    any.then(|| total.div_ceil(replicas))
}

/// What the hold rules read about the workers for one held request.
pub(super) struct LoadCheck<'a> {
    /// Every worker rank's load (the router's view plus this queue's grants).
    pub(super) load: &'a HashMap<(String, u32), WorkerLoad>,
    /// This queue's granted requests without a first token, by worker rank
    /// and priority.
    pub(super) starting: &'a HashMap<(String, u32), BTreeMap<i32, u64>>,
    /// The priority of the request to release.
    pub(super) priority: i32,
}

impl LoadCheck<'_> {
    /// The prefill queued on `key` ahead of the request: all of it, less
    /// this queue's lower-priority grants when the worker's engine
    /// schedules by priority (they wait behind the request there).
    fn prefill_ahead(&self, key: &(String, u32), w: &WorkerLoad) -> u64 {
        let behind = if w.priority_scheduling {
            self.starting
                .get(key)
                .map_or(0, |m| m.range(..self.priority).map(|(_, t)| t).sum())
        } else {
            0
        };
        w.active_prefill_tokens.saturating_sub(behind)
    }
}

pub(super) fn hold_reason(
    cfg: &Args,
    model: &ModelQueue,
    model_name: &str,
    check: &LoadCheck<'_>,
    replicas: u32,
) -> Option<HoldReason> {
    let load = check.load;
    if cfg.max_active > 0 && model.active + model.placing >= cfg.max_active {
        return Some(HoldReason::ActiveLimit);
    }
    if default_holding(cfg) {
        let cap = capacity(model_name, load, replicas)?;
        return (model.active + model.placing >= cap).then_some(HoldReason::AtCapacity);
    }
    let threshold = cfg.queue_threshold?;
    if all_busy(model_name, check, threshold) {
        return Some(HoldReason::AboveThreshold);
    }
    // Serial under a threshold: the next release waits for this one's load.
    (model.placing > 0).then_some(HoldReason::PlacementInFlight)
}

/// Dynamo's rule: busy when every eligible worker is above the threshold,
/// counting the prefill queued ahead of the request
/// ([`LoadCheck::prefill_ahead`]).
pub(super) fn all_busy(model: &str, check: &LoadCheck<'_>, threshold: f64) -> bool {
    let load = check.load;
    let serves = |w: &&WorkerLoad| model.is_empty() || w.model.is_empty() || w.model == model;
    let has_prefill = load
        .values()
        .filter(serves)
        .any(|w| w.role == WorkerRole::Prefill);
    let mut eligible = load
        .iter()
        .filter(|(_, w)| serves(w))
        .filter(|(_, w)| (w.role == WorkerRole::Prefill) == has_prefill)
        .peekable();
    if eligible.peek().is_none() {
        return false;
    }
    eligible.all(|(key, w)| {
        w.max_num_batched_tokens > 0
            && check.prefill_ahead(key, w) as f64 > threshold * f64::from(w.max_num_batched_tokens)
    })
}

#[derive(Debug)]
pub(super) struct ModelQueue {
    pub(super) order: Order,
    pub(super) placing: usize,
    pub(super) refreshing: usize,
    pub(super) active: usize,
    pub(super) hold: Option<HoldReason>,
    /// When positions were last sent in full, and with which reason.
    pub(super) published: Option<(Instant, HoldReason)>,
    /// How fast this model's grants drain its backlog.
    pub(super) drained: DrainRate,
    /// How fast requests for this model arrive, refused ones included, by
    /// priority (their sum is the model's arrival rate).
    pub(super) arrived_by_priority: BTreeMap<i32, DrainRate>,
    /// Since when requests have arrived faster than grants drain them
    /// (`None`: they have not).
    pub(super) overloaded_since: Option<Instant>,
    /// Under `wfq`/`fair`: released requests without a first token yet, by
    /// class.
    pub(super) starting: HashMap<Arc<str>, usize>,
    /// One of those was released past a busy threshold.
    pub(super) express: bool,
}

impl ModelQueue {
    pub(super) fn new(policy: Policy) -> Self {
        Self {
            order: match policy {
                Policy::Wfq | Policy::Fair => Order::Fair(BTreeMap::new()),
                Policy::Fcfs | Policy::Wspt | Policy::Strict => Order::Keyed(BTreeMap::new()),
            },
            placing: 0,
            refreshing: 0,
            active: 0,
            hold: None,
            published: None,
            drained: DrainRate::default(),
            arrived_by_priority: BTreeMap::new(),
            overloaded_since: None,
            starting: HashMap::new(),
            express: false,
        }
    }

    /// Whether the head may be released although the threshold holds
    /// (`reason`): under `wfq`/`fair`, when its class has no released
    /// request still waiting for its first token, and no other request
    /// went past the threshold since the last first token. A tenant
    /// coming back from idle then reaches the engine while the busy
    /// tenant's prefill runs, and is in the engine's next step, instead of
    /// waiting here for that prefill to end and then for the step the
    /// engine starts meanwhile. The threshold is exceeded by at most one
    /// request per model.
    pub(super) fn express_head(&self, reason: HoldReason) -> bool {
        matches!(
            reason,
            HoldReason::AboveThreshold | HoldReason::PlacementInFlight
        ) && !self.express
            && self
                .order
                .head_class()
                .is_some_and(|class| !self.starting.contains_key(class))
    }

    /// A released request reached its first token or ended: it no longer
    /// counts as starting in `class` (its `wfq`/`fair` class, if any) nor,
    /// if it was, as the request past the threshold.
    pub(super) fn first_token(&mut self, class: Option<&str>, express: bool) {
        if express {
            self.express = false;
        }
        if let Some(class) = class
            && let Some(n) = self.starting.get_mut(class)
        {
            *n -= 1;
            if *n == 0 {
                self.starting.remove(class);
            }
        }
    }

    /// Notes whether arrivals outpace grants (by [`OVERLOAD_MARGIN`]) while
    /// requests are held, then counts this arrival, admitted or not.
    /// Overload starts only with a backlog, and ends only when arrivals
    /// fall behind grants, not when a few grants at once empty the backlog
    /// for a moment.
    pub(super) fn arrival(&mut self, priority: i32, now: Instant) {
        let arriving: f64 = self
            .arrived_by_priority
            .values()
            .map(|rate| rate.per_sec(now))
            .sum();
        let over = arriving > self.drained.per_sec(now) * OVERLOAD_MARGIN;
        if !over {
            self.overloaded_since = None;
        } else if !self.order.is_empty() {
            self.overloaded_since.get_or_insert(now);
        }
        self.arrived_by_priority
            .retain(|_, rate| rate.decayed(now) >= FORGOTTEN);
        self.arrived_by_priority
            .entry(priority)
            .or_default()
            .grant(now);
    }

    /// The lowest priority admitted under standing overload: priorities,
    /// from the highest down, while their arrivals together fit in what
    /// grants drain; the first that does not fit still competes for the
    /// short backlog, those below it are refused at once. `None`: every
    /// priority fits.
    pub(super) fn admitted_from(&self, now: Instant) -> Option<i32> {
        let drain = self.drained.per_sec(now);
        let mut offered = 0.0;
        for (&priority, rate) in self.arrived_by_priority.iter().rev() {
            offered += rate.per_sec(now);
            if offered > drain {
                return Some(priority);
            }
        }
        None
    }

    /// Overload is standing, not a burst: requests have arrived faster than
    /// they drain for longer than `--backlog-secs`, the wait a burst may
    /// cost.
    pub(super) fn standing(&self, cfg: &Args, now: Instant) -> bool {
        self.overloaded_since.is_some_and(|since| {
            now.saturating_duration_since(since).as_secs_f64() >= cfg.backlog_secs
        })
    }

    pub(super) fn is_idle(&self) -> bool {
        self.order.is_empty() && self.placing == 0 && self.refreshing == 0 && self.active == 0
    }
}

impl State {
    /// Default holding only (no `--queue-threshold`, no `--max-active`, no
    /// `--no-default-holding`): the most requests `model` may hold, the
    /// free engine slots plus what drains in `--backlog-secs` at the
    /// model's grant rate, at least one request per engine slot and
    /// [`BACKLOG_FLOOR`]; under standing overload, what drains in
    /// `--standing-backlog-secs` (at least one). `None`: unbounded here
    /// (only `--max-pending`), as when the workers' capacity is unknown
    /// (nothing is held then).
    pub(super) fn backlog_limit(
        &self,
        cfg: &Args,
        name: &str,
        model: &ModelQueue,
        now: Instant,
    ) -> Option<usize> {
        if !default_holding(cfg) {
            return None;
        }
        let slots = capacity(name, &self.load, self.replicas)?;
        let room = slots.saturating_sub(model.active + model.placing);
        let rate = model.drained.per_sec(now);
        if model.standing(cfg, now) {
            // Sustained overload: hold only what drains in
            // `--standing-backlog-secs`, so what is served starts soon and
            // the rest hears at once when to come back.
            let drains = (rate * cfg.standing_backlog_secs).ceil() as usize;
            return Some(room + drains.max(1));
        }
        let drains = (rate * cfg.backlog_secs).ceil() as usize;
        // A burst into an idle mesh (no grant rate yet) may wait for one
        // more round of every slot before anything is refused.
        Some(room + drains.max(slots).max(BACKLOG_FLOOR))
    }
}
