//! When a model's requests are held: the hold rules (`--max-active`,
//! default holding by engine slots, `--queue-threshold`), and the wait a
//! newly admitted request is predicted to have (refused when it exceeds the
//! request's TTFT target).

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
        // A rate decayed to almost nothing would make the wait overflow a
        // Duration: anything past the cap reads as the cap.
        let secs = if rate > 0.0 {
            ((ahead as f64 + 1.0) / rate).min(3600.0)
        } else {
            0.0
        };
        retry_after_secs(Duration::from_secs_f64(secs))
    }
}

/// A `Retry-After` for `wait`: whole seconds, rounded up, 1 to 60.
pub(crate) fn retry_after_secs(wait: Duration) -> Duration {
    Duration::from_secs((wait.as_secs_f64().ceil()).clamp(1.0, 60.0) as u64)
}

/// Weight of the newest sample in a model's mean lease and start times.
const LEASE_EWMA: f64 = 0.1;

/// Mean deviations of the time from release to first token that a held
/// request is released ahead of its TTFT target, beyond the mean: the
/// margin TCP's retransmission timer keeps over a round trip (RFC 6298's
/// `SRTT + 4·RTTVAR`). At the mean alone, a request released at the last
/// moment misses its target whenever its start is slower than average.
const START_LEAD_DEVIATIONS: f64 = 4.0;

/// Exponential means of a duration (in seconds; the first sample sets
/// one), over every request of a model and by priority: on an engine that
/// preempts, a low-priority request waits parked as long as higher ones
/// keep coming, so its times say nothing of a higher one's.
#[derive(Debug, Default)]
pub(super) struct Means {
    all: Option<f64>,
    by_priority: BTreeMap<i32, f64>,
}

impl Means {
    pub(super) fn add(&mut self, priority: i32, sample: Duration) {
        let secs = sample.as_secs_f64();
        let add = |m: f64| m + LEASE_EWMA * (secs - m);
        self.all = Some(self.all.map_or(secs, add));
        self.by_priority
            .entry(priority)
            .and_modify(|m| *m = add(*m))
            .or_insert(secs);
    }

    /// The mean for `priority`, else over every request.
    pub(super) fn of(&self, priority: i32) -> Option<f64> {
        self.own(priority).or(self.all)
    }

    /// The mean for `priority` alone.
    fn own(&self, priority: i32) -> Option<f64> {
        self.by_priority.get(&priority).copied()
    }

    pub(super) fn is_known(&self) -> bool {
        self.all.is_some()
    }
}

/// Neither `--queue-threshold` nor `--max-active` nor
/// `--no-default-holding`: hold by engine slots.
pub(super) fn default_holding(cfg: &Args) -> bool {
    cfg.queue_threshold.is_none() && cfg.max_active == 0 && !cfg.no_default_holding
}

/// Whether every decode or aggregated rank serving `model` schedules by
/// priority: its engine admits a higher-priority request ahead of waiting
/// ones and preempts running lower-priority ones (keeping their KV), so
/// lower-priority requests running there do not hold a higher one back.
pub(super) fn preempts(model: &str, load: &HashMap<WorkerRank, WorkerLoad>) -> bool {
    let mut any = false;
    for w in load.values().filter(|w| {
        (model.is_empty() || w.model.is_empty() || w.model == model)
            && w.role != WorkerRole::Prefill
    }) {
        if !w.priority_scheduling {
            return false;
        }
        any = true;
    }
    any
}

/// The slowest step time the model's decode or aggregated ranks report, in
/// seconds (`None`: none measured one yet).
pub(super) fn step_secs(model: &str, load: &HashMap<WorkerRank, WorkerLoad>) -> Option<f64> {
    load.values()
        .filter(|w| {
            (model.is_empty() || w.model.is_empty() || w.model == model)
                && w.role != WorkerRole::Prefill
        })
        .map(|w| w.step_time_us)
        .max()
        .filter(|&us| us > 0)
        .map(|us| f64::from(us) / 1e6)
}

/// The engine slots of `model`: every decode or aggregated rank's
/// `max_num_seqs` less its unplaced requests, summed. `None` when a rank
/// does not report `max_num_seqs` or the model has no such worker (nothing
/// is held).
pub(super) fn capacity(model: &str, load: &HashMap<WorkerRank, WorkerLoad>) -> Option<usize> {
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
    any.then_some(total)
}

/// Live placements other queue replicas made on `model`'s decode or
/// aggregated ranks that a request of `priority` waits for: every one, or,
/// where the engines preempt, those of at least its priority.
pub(super) fn others_busy(
    model: &str,
    load: &HashMap<WorkerRank, WorkerLoad>,
    priority: i32,
    preempts: bool,
) -> usize {
    load.values()
        .filter(|w| {
            (model.is_empty() || w.model.is_empty() || w.model == model)
                && w.role != WorkerRole::Prefill
        })
        .flat_map(|w| {
            let from = if preempts { priority } else { i32::MIN };
            w.others_by_priority.range(from..).map(|(_, &n)| n as usize)
        })
        .sum()
}

/// Requests other queue replicas hold for `model` at a higher priority
/// than `priority`: they go before it.
pub(super) fn held_above(held: &HeldByModel, model: &str, priority: i32) -> usize {
    held.iter()
        .filter(|(m, _)| model.is_empty() || m.is_empty() || *m == model)
        .flat_map(|(_, by_priority)| {
            by_priority
                .range(priority.saturating_add(1)..)
                .map(|(_, &n)| n as usize)
        })
        .sum()
}

/// A model's engine slots as default holding sees them for a request of
/// one priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Room {
    /// Slots of every decode or aggregated rank (with one queue replica;
    /// with several, their share is what the others leave).
    pub(super) cap: usize,
    /// Slots taken from the request's point of view (see
    /// [`ModelQueue::busy_for`]): this replica's grants, and with several
    /// replicas the others' placements (the router's view).
    pub(super) busy: usize,
    /// Requests of higher priority other replicas hold: free slots go to
    /// them first.
    pub(super) ahead_elsewhere: usize,
}

impl Room {
    /// Of `model` (named `name`) for a request of `priority`; `None` when
    /// the workers' slots are unknown.
    pub(super) fn of(
        name: &str,
        model: &ModelQueue,
        load: &HashMap<WorkerRank, WorkerLoad>,
        held_elsewhere: &HeldByModel,
        replicas: u32,
        priority: i32,
    ) -> Option<Self> {
        let cap = capacity(name, load)?;
        let preempts = preempts(name, load);
        let own = model.busy_for(priority, preempts);
        if replicas <= 1 {
            return Some(Self {
                cap,
                busy: own,
                ahead_elsewhere: 0,
            });
        }
        Some(Self {
            cap,
            busy: own + others_busy(name, load, priority, preempts),
            ahead_elsewhere: held_above(held_elsewhere, name, priority),
        })
    }

    /// Slots free for the request.
    pub(super) fn free(&self) -> usize {
        self.cap.saturating_sub(self.busy)
    }
}

/// What the hold rules read about the workers for one held request.
pub(super) struct LoadCheck<'a> {
    /// Every worker rank's load (the router's view plus this queue's grants).
    pub(super) load: &'a HashMap<WorkerRank, WorkerLoad>,
    /// This queue's granted requests without a first token, by worker rank
    /// and priority.
    pub(super) starting: &'a HashMap<WorkerRank, BTreeMap<i32, u64>>,
    /// The priority of the request to release.
    pub(super) priority: i32,
    /// What the other queue replicas hold unplaced.
    pub(super) held_elsewhere: &'a HeldByModel,
}

impl LoadCheck<'_> {
    /// The prefill queued on `key` ahead of the request: all of it, less
    /// this queue's lower-priority grants when the worker's engine
    /// schedules by priority (they wait behind the request there).
    fn prefill_ahead(&self, key: &WorkerRank, w: &WorkerLoad) -> u64 {
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
        let room = Room::of(
            model_name,
            model,
            load,
            check.held_elsewhere,
            replicas,
            check.priority,
        )?;
        if room.free() == 0 {
            return Some(HoldReason::AtCapacity);
        }
        return (room.ahead_elsewhere >= room.free()).then_some(HoldReason::HigherElsewhere);
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
    /// Requests being placed or granted (`placing` + `active`), by
    /// priority.
    pub(super) running: BTreeMap<i32, usize>,
    /// Mean time from grant to the lease's end.
    pub(super) lease_secs: Means,
    /// Mean time from release to the first token, and its mean deviation.
    pub(super) start_secs: Means,
    pub(super) start_dev_secs: Means,
    /// When the last first token came, by priority and of any: how fresh
    /// the start times are.
    pub(super) last_started: BTreeMap<i32, Instant>,
    pub(super) last_started_any: Option<Instant>,
    /// When a trial request was last admitted past stale start times, by
    /// priority ([`ModelQueue::admission_lead`]).
    tried: BTreeMap<i32, Instant>,
    /// Requests held or being placed, by priority: what this replica
    /// reports to the others as unplaced (a released request stays in it
    /// until the router has counted its placement, so no view shows it as
    /// neither held nor placed).
    pub(super) held_by_priority: BTreeMap<i32, u32>,
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
            running: BTreeMap::new(),
            lease_secs: Means::default(),
            start_secs: Means::default(),
            start_dev_secs: Means::default(),
            last_started: BTreeMap::new(),
            last_started_any: None,
            tried: BTreeMap::new(),
            held_by_priority: BTreeMap::new(),
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

    /// A request of `priority` was admitted (`delta` 1), or left before
    /// its release or its placement came back (-1).
    pub(super) fn count_held(&mut self, priority: i32, delta: i32) {
        let n = self.held_by_priority.entry(priority).or_default();
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            self.held_by_priority.remove(&priority);
        }
    }

    /// A request of `priority` is being placed (`delta` 1) or its
    /// placement or lease ended (`delta` -1).
    pub(super) fn run(&mut self, priority: i32, delta: isize) {
        let n = self.running.entry(priority).or_default();
        *n = n.saturating_add_signed(delta);
        if *n == 0 {
            self.running.remove(&priority);
        }
    }

    /// Slots taken from a request of `priority`'s point of view: every
    /// request placed or granted, or, where the engines preempt
    /// (`preempts`), those of at least its priority (the engine makes room
    /// by preempting the others).
    pub(super) fn busy_for(&self, priority: i32, preempts: bool) -> usize {
        if preempts {
            self.running.range(priority..).map(|(_, n)| n).sum()
        } else {
            self.active + self.placing
        }
    }

    /// A request of `priority` released `took` before `now` produced its
    /// first token: it joins the mean start times.
    pub(super) fn started_after(&mut self, priority: i32, took: Duration, now: Instant) {
        self.last_started.insert(priority, now);
        self.last_started_any = Some(now);
        // The deviation from its priority's mean before this sample (none
        // before the first: one start alone is all that is known).
        let secs = took.as_secs_f64();
        let dev = self
            .start_secs
            .own(priority)
            .map_or(0.0, |mean| (secs - mean).abs());
        self.start_dev_secs
            .add(priority, Duration::from_secs_f64(dev));
        self.start_secs.add(priority, took);
    }

    /// How long before its TTFT target a held request of `priority` must
    /// be released to start in time: the mean time from release to first
    /// token of its priority (a parked priority-0 request's says nothing
    /// of a priority-3 one's) and `START_LEAD_DEVIATIONS` of its mean
    /// deviations.
    pub(super) fn start_lead(&self, priority: i32) -> Duration {
        let mean = self.start_secs.of(priority).unwrap_or(0.0);
        let dev = self.start_dev_secs.of(priority).unwrap_or(0.0);
        Duration::from_secs_f64((mean + START_LEAD_DEVIATIONS * dev).clamp(0.0, 3600.0))
    }

    /// The start a new request of `priority` is refused by at `now` (its
    /// predicted wait plus this past its target): for one that will be
    /// held, [`Self::start_lead`], which times its release; for one
    /// released at once (`held` false), the mean start alone: it is refused
    /// when expected to miss, not when a slower than average start would.
    ///
    /// Only while the start times are fresh. Only requests let in measure
    /// starts, so a lead past the target would refuse every request of the
    /// priority for good. Once no first token came for as long as the
    /// lead (whatever slowed the last starts has had the time they took to
    /// clear), one request is let in on its predicted wait alone, as a
    /// circuit breaker's half-open state lets one trial call through; the
    /// lead holds again for a lead's time after it ([`Self::tried`]), or
    /// until its first token says how fast starts are now. Returns the
    /// start and whether the request is that trial.
    pub(super) fn admission_lead(
        &self,
        priority: i32,
        held: bool,
        now: Instant,
    ) -> (Duration, bool) {
        let full = self.start_lead(priority);
        let lead = if held {
            full
        } else {
            Duration::from_secs_f64(
                self.start_secs
                    .of(priority)
                    .unwrap_or(0.0)
                    .clamp(0.0, 3600.0),
            )
        };
        let started = if self.start_secs.own(priority).is_some() {
            self.last_started.get(&priority).copied()
        } else {
            self.last_started_any
        };
        let Some(started) = started else {
            return (lead, false);
        };
        let fresh = started.max(self.tried.get(&priority).copied().unwrap_or(started));
        if now.saturating_duration_since(fresh) <= full {
            return (lead, false);
        }
        (Duration::ZERO, true)
    }

    /// A trial request of `priority` ([`Self::admission_lead`]) was
    /// admitted at `now`.
    pub(super) fn tried(&mut self, priority: i32, now: Instant) {
        self.tried.insert(priority, now);
    }

    /// A lease of `priority` granted `held` ago ended: it joins the mean
    /// lease durations.
    pub(super) fn lease_ended(&mut self, priority: i32, held: Duration) {
        self.lease_secs.add(priority, held);
    }

    /// The mean lease of the grants whose ends free a slot for a request
    /// of `priority`: where the engines preempt (`preempts`), those of at
    /// least its priority, else all. Slots of that band end at
    /// `Σ running_q / lease_q`; the mean is its inverse per slot (the
    /// running-weighted harmonic mean). With nothing of the band running,
    /// the band's slowest mean, else the mean over every lease.
    pub(super) fn lease_for(&self, priority: i32, preempts: bool) -> Option<f64> {
        let from = if preempts { priority } else { i32::MIN };
        let (mut slots, mut ends_per_sec) = (0.0, 0.0);
        for (q, &n) in self.running.range(from..) {
            if let Some(&lease) = self.lease_secs.by_priority.get(q)
                && lease > 0.0
            {
                slots += n as f64;
                ends_per_sec += n as f64 / lease;
            }
        }
        if ends_per_sec > 0.0 {
            return Some(slots / ends_per_sec);
        }
        self.lease_secs
            .by_priority
            .range(from..)
            .map(|(_, &l)| l)
            .reduce(f64::max)
            .or(self.lease_secs.all)
    }

    pub(super) fn is_idle(&self) -> bool {
        self.order.is_empty() && self.placing == 0 && self.refreshing == 0 && self.active == 0
    }
}

impl State {
    /// The wait predicted for `entry` if it were admitted now, under
    /// default holding: the requests that must start before it (held ahead
    /// of it in release order) beyond the slots free for it, each waiting
    /// for a lease to end, at the mean lease of the grants whose ends free
    /// a slot for it ([`ModelQueue::lease_for`]) spread over the slots. Before any lease ended the duration comes from the
    /// workers' step time and the request's expected output (its `osl`
    /// hint, else `max_tokens`). `None`: no prediction (holding is off, the
    /// workers' slots are unknown, or nothing is known of their speed).
    pub(super) fn predict_wait(
        &self,
        cfg: &Args,
        epoch: Instant,
        entry: &Entry,
    ) -> Option<Duration> {
        if !default_holding(cfg) {
            return None;
        }
        let name = &entry.desc.model;
        let idle = ModelQueue::new(cfg.queue_policy);
        let model = self.models.get(name).unwrap_or(&idle);
        let room = Room::of(
            name,
            model,
            &self.load,
            &self.held_elsewhere,
            self.replicas,
            entry.desc.priority,
        )?;
        let (cap, free) = (room.cap, room.free());
        let weight = self
            .quotas
            .weight(&entry.desc.tenant)
            .unwrap_or(entry.desc.tenant_weight);
        let ahead = model.order.ahead_of(cfg, epoch, entry, weight) + room.ahead_elsewhere;
        if ahead < free {
            return Some(Duration::ZERO);
        }
        let lease = model
            .lease_for(entry.desc.priority, preempts(name, &self.load))
            .or_else(|| {
                let step = step_secs(name, &self.load)?;
                let output = entry.desc.expected_output_tokens;
                (output > 0).then(|| step * f64::from(output))
            })?;
        let ends_needed = (ahead + 1 - free) as f64;
        let secs = ends_needed * lease / cap.max(1) as f64;
        Some(Duration::from_secs_f64(secs.min(86_400.0)))
    }
}
