//! Queue behaviour under contention, with paused time and an in-test placer.

use super::*;
use crate::config::WfqWeights;
use crate::error::Quota;
use prometheus::Registry;
use sluice_proto::queue::v1::QueueReason;
use tokio::task::JoinHandle;

fn config(policy: Policy) -> Args {
    Args {
        router_endpoint: None,
        queue_policy: policy,
        queue_threshold: None,
        max_pending: 1000,
        max_pending_per_tenant: 1000,
        max_active: 0,
        no_default_holding: false,
        ttft_target_secs: 60.0,
        ttft_targets: crate::config::TargetsByPriority::default(),
        tpot_targets: crate::config::TargetsByPriority::default(),
        shed_protect_priority: 0,
        shed_protect_fraction: 0.0,
        wfq_class: WfqClass::Priority,
        wfq_weights: WfqWeights::default(),
        wfq_default_weight: 1,
        wfq_cost: WfqCost::Requests,
        tenant_limits: None,
        refresh_interval_ms: 60_000,
    }
}

fn target(id: &str) -> Target {
    Target {
        rank: WorkerRank::new(id, 0),
        endpoint: format!("http://{id}"),
    }
}

/// Places everything on `w0`, records the order, and answers overlap
/// refreshes from a table.
#[derive(Clone, Default)]
struct TestPlacer {
    placed: Arc<Mutex<Vec<String>>>,
    refreshed: Arc<Mutex<Vec<String>>>,
    fresh_overlap: Arc<Mutex<HashMap<String, u32>>>,
    fail: bool,
    delay: Option<Duration>,
    /// What the placements' leases were told: `started:ID`, `released:ID`.
    lease_events: Arc<Mutex<Vec<String>>>,
    /// Every report of what the queue holds, in order.
    held_reports: Arc<Mutex<Vec<HeldByModel>>>,
}

/// Logs what the queue tells a placement's lease.
#[derive(Debug)]
struct TestLease {
    id: String,
    events: Arc<Mutex<Vec<String>>>,
}

impl PlacementLease for TestLease {
    fn started(&self) {
        self.events.lock().push(format!("started:{}", self.id));
    }
}

impl Drop for TestLease {
    fn drop(&mut self) {
        self.events.lock().push(format!("released:{}", self.id));
    }
}

impl TestPlacer {
    fn placed(&self) -> Vec<String> {
        self.placed.lock().clone()
    }
}

impl Placer for TestPlacer {
    async fn place(&self, entry: &Entry) -> Result<Placed, QueueError> {
        if let Some(delay) = self.delay {
            tokio::time::sleep(delay).await;
        }
        self.placed.lock().push(entry.desc.request_id.clone());
        if self.fail {
            return Err(QueueError::NoWorkers {
                model: entry.desc.model.clone(),
            });
        }
        Ok(Placed {
            placement: Placement {
                worker: target("w0"),
                prefill: None,
                overlap_tokens: entry.overlap_tokens,
                routed_ttft: None,
                routed_within_target: None,
                prefix_source: None,
            },
            lease: Some(Box::new(TestLease {
                id: entry.desc.request_id.clone(),
                events: Arc::clone(&self.lease_events),
            })),
        })
    }

    fn report_held(&self, held: HeldByModel) {
        self.held_reports.lock().push(held);
    }

    async fn overlap(&self, entry: &Entry) -> Result<u32, QueueError> {
        self.refreshed.lock().push(entry.desc.request_id.clone());
        Ok(self
            .fresh_overlap
            .lock()
            .get(&entry.desc.request_id)
            .copied()
            .unwrap_or(entry.overlap_tokens))
    }
}

struct Harness {
    queue: Queue,
    placer: TestPlacer,
    registry: Registry,
    shutdown: CancellationToken,
    dispatcher: JoinHandle<()>,
}

impl Harness {
    fn start(cfg: Args) -> Self {
        Self::with_placer(cfg, TestPlacer::default())
    }

    fn with_placer(cfg: Args, placer: TestPlacer) -> Self {
        let registry = Registry::new();
        let metrics = QueueMetrics::new(&registry).expect("metrics register");
        let queue = Queue::new(cfg, metrics);
        let shutdown = CancellationToken::new();
        let dispatcher = tokio::spawn({
            let queue = queue.clone();
            let placer = placer.clone();
            let shutdown = shutdown.clone();
            async move { queue.run(placer, shutdown).await }
        });
        Self {
            queue,
            placer,
            registry,
            shutdown,
            dispatcher,
        }
    }

    fn admit(&self, entry: Entry) -> Ticket {
        self.queue.admit(entry).expect("admitted")
    }

    fn metric(&self, name: &str) -> f64 {
        self.registry
            .gather()
            .iter()
            .filter(|f| f.name() == name)
            .flat_map(|f| f.get_metric().iter())
            // Each family is one type; the other field reads 0.
            .map(|m| m.get_counter().get_value() + m.get_gauge().get_value())
            .sum()
    }
}

fn entry(id: &str, priority: i32, tier: u32, prompt: u32, arrival: Instant) -> Entry {
    Entry {
        desc: RequestDescription {
            request_id: id.into(),
            model: "m".into(),
            priority,
            strict_priority: tier,
            prompt_tokens: prompt,
            block_size: 16,
            ..RequestDescription::default()
        },
        overlap_tokens: 0,
        arrival,
        deadline: None,
        span: tracing::Span::none(),
    }
}

/// One aggregated worker with a 100-token budget and `active` prefill tokens.
fn load(active: u64) -> LoadView {
    LoadView {
        workers: vec![worker("w0", "m", WorkerRole::Aggregated, active)],
        ..LoadView::default()
    }
}

fn worker(id: &str, model: &str, role: WorkerRole, active: u64) -> WorkerLoad {
    WorkerLoad {
        target: target(id),
        model: model.into(),
        role,
        active_prefill_tokens: active,
        max_num_batched_tokens: 100,
        max_num_seqs: 0,
        unplaced_requests: 0,
        priority_scheduling: false,
        step_time_us: 0,
        others_by_priority: BTreeMap::new(),
    }
}

/// The ticket's grant, which must come within a second of (paused) time:
/// a release that never comes fails the test instead of hanging it.
async fn granted_soon(ticket: &mut Ticket, why: &str) -> Grant {
    tokio::time::timeout(Duration::from_secs(1), ticket.granted())
        .await
        .unwrap_or_else(|_| panic!("no grant: {why}"))
        .unwrap_or_else(|e| panic!("{why}: {e}"))
}

/// The ticket's next event says it is held because every worker is busy.
async fn held_above_threshold(ticket: &mut Ticket) {
    assert!(matches!(
        ticket.next().await.expect("held"),
        TicketEvent::Held(HeldStatus {
            reason: HoldReason::AboveThreshold,
            ..
        })
    ));
}

/// Lets the dispatcher catch up (time is paused and auto-advances).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// The blocker's priority: a class (and `fair` band) of its own.
const BLOCKER: i32 = -100;

/// Admits a blocker that takes the only active slot, then `entries`, then
/// releases the blocker; each request drops its lease as soon as it is
/// granted. Returns the order in which the rest were placed.
async fn release_order(mut cfg: Args, entries: Vec<Entry>) -> Vec<String> {
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut blocker = h.admit(entry("blocker", BLOCKER, 0, 10, Instant::now()));
    blocker.granted().await.expect("blocker granted");
    let waiters: Vec<JoinHandle<Result<Grant, QueueError>>> = entries
        .into_iter()
        .map(|e| {
            let mut ticket = h.admit(e);
            tokio::spawn(async move { ticket.granted().await })
        })
        .collect();
    settle().await;
    assert_eq!(h.placer.placed(), ["blocker"], "all others held");
    drop(blocker);
    for waiter in waiters {
        waiter.await.expect("join").expect("granted");
    }
    let mut placed = h.placer.placed();
    placed.remove(0);
    placed
}

fn at(base: Instant, ms: u64) -> Instant {
    base + Duration::from_millis(ms)
}

#[tokio::test(start_paused = true)]
async fn a_grants_lease_hears_the_start_and_ends_with_the_ticket() {
    let h = Harness::start(config(Policy::Fcfs));
    let mut ticket = h.admit(entry("r1", 0, 0, 10, Instant::now()));
    ticket.started(); // before the grant: nothing to tell
    ticket.granted().await.expect("granted");
    assert!(h.placer.lease_events.lock().is_empty());
    ticket.started();
    assert_eq!(*h.placer.lease_events.lock(), ["started:r1"]);
    drop(ticket);
    assert_eq!(*h.placer.lease_events.lock(), ["started:r1", "released:r1"]);
}

#[tokio::test(start_paused = true)]
async fn a_placement_that_comes_back_for_a_cancelled_request_is_released_at_once() {
    let placer = TestPlacer {
        delay: Some(Duration::from_millis(50)),
        ..TestPlacer::default()
    };
    let h = Harness::with_placer(config(Policy::Fcfs), placer);
    let ticket = h.admit(entry("gone", 0, 0, 10, Instant::now()));
    settle().await;
    drop(ticket); // cancelled while the placement is in flight
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.placer.placed(), ["gone"]);
    assert_eq!(*h.placer.lease_events.lock(), ["released:gone"]);
}

#[tokio::test(start_paused = true)]
async fn fcfs_priority_bumps_arrival_by_seconds_and_strict_tier_goes_first() {
    let t = Instant::now();
    let order = release_order(
        config(Policy::Fcfs),
        vec![
            entry("a-p0-t0", 0, 0, 10, at(t, 0)),
            entry("b-p2-t1000", 2, 0, 10, at(t, 1000)),
            entry("c-p0-t500", 0, 0, 10, at(t, 500)),
            entry("d-p1-t3500", 1, 0, 10, at(t, 3500)),
            entry("e-tier1-late", 0, 1, 10, at(t, 9000)),
        ],
    )
    .await;
    // Effective arrivals: b −1000, a 0, c 500, d 2500; tier 1 before all.
    assert_eq!(
        order,
        [
            "e-tier1-late",
            "b-p2-t1000",
            "a-p0-t0",
            "c-p0-t500",
            "d-p1-t3500"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn fcfs_negative_priorities_clamp_to_zero() {
    let t = Instant::now();
    let order = release_order(
        config(Policy::Fcfs),
        vec![
            entry("neg-early", -5, 0, 10, at(t, 0)),
            entry("zero-later", 0, 0, 10, at(t, 10)),
            entry("neg-later", -100, 0, 10, at(t, 20)),
        ],
    )
    .await;
    // A negative priority is no penalty: arrival order stands.
    assert_eq!(order, ["neg-early", "zero-later", "neg-later"]);
}

#[tokio::test(start_paused = true)]
async fn wspt_releases_short_uncached_work_first_weighted_by_priority() {
    let t = Instant::now();
    let mut cached = entry("long-but-cached", 0, 0, 1000, at(t, 0));
    cached.overlap_tokens = 950; // 50 uncached → 1/50
    let order = release_order(
        config(Policy::Wspt),
        vec![
            entry("long", 0, 0, 1000, at(t, 0)),   // 1/1000
            entry("short", 0, 0, 100, at(t, 1)),   // 1/100
            entry("long-p9", 9, 0, 400, at(t, 2)), // 10/400
            cached,
            entry("tier2-huge", 0, 2, 100_000, at(t, 3)),
            entry("neg", -3, 0, 10, at(t, 4)), // clamps: 1/10
        ],
    )
    .await;
    assert_eq!(
        order,
        [
            "tier2-huge",
            "neg",
            "long-p9",
            "long-but-cached",
            "short",
            "long"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn strict_releases_highest_priority_first_fcfs_within_and_tiers_over_priorities() {
    let t = Instant::now();
    let order = release_order(
        config(Policy::Strict),
        vec![
            entry("p0-first", 0, 0, 10, at(t, 0)),
            entry("p3", 3, 0, 10, at(t, 1)),
            entry("p0-second", 0, 0, 10, at(t, 2)),
            entry("p9", 9, 0, 10, at(t, 3)),
            entry("tier1-p-5", -5, 1, 10, at(t, 4)),
            entry("p3-second", 3, 0, 10, at(t, 5)),
        ],
    )
    .await;
    assert_eq!(
        order,
        [
            "tier1-p-5",
            "p9",
            "p3",
            "p3-second",
            "p0-first",
            "p0-second"
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn wfq_bounds_the_lowest_class_wait_where_strict_starves_it() {
    let t = Instant::now();
    let mut entries: Vec<Entry> = (0..20)
        .map(|i| entry(&format!("hi-{i}"), 5, 0, 10, at(t, i)))
        .collect();
    entries.extend((0..3).map(|i| entry(&format!("lo-{i}"), 0, 0, 10, at(t, 100 + i))));
    let mut cfg = config(Policy::Wfq);
    cfg.wfq_weights = "5=3".parse().expect("weights");

    let order = release_order(cfg, entries.clone()).await;
    // W = 3 + 1, n = 2: the k-th (0-based) low request goes within k·4 + 2
    // releases.
    for k in 0..3usize {
        let pos = order
            .iter()
            .position(|id| id == &format!("lo-{k}"))
            .expect("released");
        assert!(pos < k * 4 + 2, "lo-{k} released at {pos}: {order:?}");
    }
    assert_eq!(
        &order[..6],
        ["hi-0", "lo-0", "hi-1", "hi-2", "hi-3", "lo-1"]
    );
    let his: Vec<_> = order.iter().filter(|id| id.starts_with("hi")).collect();
    let expected: Vec<String> = (0..20).map(|i| format!("hi-{i}")).collect();
    assert_eq!(
        his,
        expected.iter().collect::<Vec<_>>(),
        "FIFO within a class"
    );

    let strict = release_order(config(Policy::Strict), entries).await;
    let first_lo = strict.iter().position(|id| id == "lo-0").expect("released");
    assert_eq!(
        first_lo, 20,
        "strict priority makes the low class wait for all"
    );
}

#[tokio::test(start_paused = true)]
async fn wfq_strict_tier_still_goes_first() {
    let t = Instant::now();
    let order = release_order(
        config(Policy::Wfq),
        vec![
            entry("a", 0, 0, 10, at(t, 0)),
            entry("b", 1, 0, 10, at(t, 1)),
            entry("tier3", 0, 3, 10, at(t, 2)),
        ],
    )
    .await;
    assert_eq!(order, ["tier3", "a", "b"]);
}

/// A worker that runs `seqs` sequences, `unplaced` of them not the queue's.
fn slots(seqs: u32, unplaced: u32) -> LoadView {
    let mut w = worker("w0", "m", WorkerRole::Aggregated, 0);
    w.max_num_seqs = seqs;
    w.unplaced_requests = unplaced;
    LoadView {
        workers: vec![w],
        ..LoadView::default()
    }
}

#[tokio::test(start_paused = true)]
async fn default_holding_fills_engine_slots_then_holds_and_a_full_queue_sheds_by_priority() {
    let mut cfg = config(Policy::Fcfs);
    cfg.max_pending = 4;
    let h = Harness::start(cfg);
    // Three slots, one taken by a request no router placed: two to grant.
    h.queue.update_load(slots(3, 1));
    let mut running: Vec<Ticket> = (0..2)
        .map(|i| h.admit(entry(&format!("run{i}"), 0, 0, 10, Instant::now())))
        .collect();
    for t in &mut running {
        t.granted().await.expect("a free slot");
    }
    // The engine is full (and does not preempt): the next ones are held.
    let held: Vec<Ticket> = (0..4)
        .map(|i| h.admit(entry(&format!("low{i}"), 0, 0, 10, Instant::now())))
        .collect();
    settle().await;
    assert_eq!(h.placer.placed(), ["run0", "run1"]);
    assert!(
        held.iter()
            .all(|t| t.held().is_some_and(|s| s.reason == HoldReason::AtCapacity)),
        "held at capacity"
    );
    // `--max-pending` full: an equal priority is refused with a retry-after…
    match h.queue.admit(entry("low4", 0, 0, 10, Instant::now())) {
        Err(QueueError::QueueFull {
            limit, retry_after, ..
        }) => {
            assert_eq!(limit, 4);
            assert!((1..=60).contains(&retry_after.as_secs()), "{retry_after:?}");
        }
        other => panic!("{other:?}"),
    }
    // …a higher one displaces the newest lowest-priority held request.
    let mut high = h.admit(entry("high", 3, 0, 10, Instant::now()));
    let mut held = held;
    let mut newest = held.pop().expect("four held");
    match newest.granted().await {
        Err(QueueError::Displaced {
            priority: 0,
            by: 3,
            retry_after,
        }) => {
            assert!(retry_after.as_secs() >= 1);
        }
        other => panic!("{other:?}"),
    }
    // A slot frees: the priority-3 request goes first.
    drop(running.pop());
    high.granted().await.expect("high granted");
    assert_eq!(h.placer.placed(), ["run0", "run1", "high"]);
    assert_eq!(h.queue.stats().pending, 3);
    drop((running, held, high));
}

/// A worker with `seqs` slots whose engine schedules by priority (and so
/// preempts lower priorities) when `preempts`, stepping every `step_us`.
fn engine(seqs: u32, preempts: bool, step_us: u32) -> LoadView {
    let mut w = worker("w0", "m", WorkerRole::Aggregated, 0);
    w.max_num_seqs = seqs;
    w.priority_scheduling = preempts;
    w.step_time_us = step_us;
    LoadView {
        workers: vec![w],
        ..LoadView::default()
    }
}

/// A request expecting `output` tokens.
fn sized(id: &str, priority: i32, output: u32) -> Entry {
    let mut e = entry(id, priority, 0, 10, Instant::now());
    e.desc.expected_output_tokens = output;
    e
}

#[tokio::test(start_paused = true)]
async fn a_request_that_outranks_running_work_on_a_preempting_engine_is_granted_at_once() {
    for preempts in [true, false] {
        let h = Harness::start(config(Policy::Fcfs));
        h.queue.update_load(engine(2, preempts, 0));
        let mut low: Vec<Ticket> = (0..3)
            .map(|i| h.admit(entry(&format!("low{i}"), 0, 0, 10, Instant::now())))
            .collect();
        settle().await;
        assert_eq!(h.placer.placed(), ["low0", "low1"], "two slots");
        // Two priority-3 requests: the engine preempts the priority-0 ones
        // for them, so the queue does not hold them behind those.
        let mut high: Vec<Ticket> = (0..3)
            .map(|i| h.admit(entry(&format!("high{i}"), 3, 0, 10, Instant::now())))
            .collect();
        settle().await;
        if preempts {
            assert_eq!(
                h.placer.placed(),
                ["low0", "low1", "high0", "high1"],
                "granted past priority-0 work; the third waits for a priority-3 slot"
            );
            assert!(high[2].held().is_some());
            assert!(low[2].held().is_some(), "priority 0 still waits");
        } else {
            assert_eq!(
                h.placer.placed(),
                ["low0", "low1"],
                "an engine that does not preempt: held"
            );
        }
        // Every slot's worth of work ends: everything left is granted.
        for t in low.iter_mut().chain(high.iter_mut()).take(2) {
            t.granted().await.expect("granted");
        }
        drop((low, high));
    }
}

#[tokio::test(start_paused = true)]
async fn a_request_is_refused_only_when_its_predicted_wait_exceeds_its_target() {
    let mut cfg = config(Policy::Fcfs);
    cfg.ttft_target_secs = 3.0;
    let h = Harness::start(cfg);
    // Two slots, 10 ms steps: a 100-token request holds a slot for ~1 s,
    // so the queue drains 2 requests a second.
    h.queue.update_load(engine(2, true, 10_000));
    let mut live: Vec<Ticket> = (0..2)
        .map(|i| h.admit(sized(&format!("run{i}"), 0, 100)))
        .collect();
    settle().await;
    // The k-th held request (0-based) waits for k + 1 lease ends: (k + 1)/2
    // seconds. Up to 3 s are admitted: k = 0..=5.
    for k in 0..6 {
        live.push(h.admit(sized(&format!("held{k}"), 0, 100)));
    }
    match h.queue.admit(sized("late", 0, 100)) {
        Err(QueueError::TargetUnmeetable {
            predicted,
            target,
            retry_after,
        }) => {
            assert_eq!(predicted, Duration::from_millis(3500));
            assert_eq!(target, Duration::from_secs(3));
            assert_eq!(retry_after, Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    // Its own longer target is met: admitted.
    let mut patient = sized("patient", 0, 100);
    patient.desc.ttft_target_ms = 10_000;
    live.push(h.admit(patient));
    // A higher priority waits for none of them (the engine preempts).
    let mut high = h.admit(sized("high", 3, 100));
    let grant = granted_soon(&mut high, "preempts").await;
    assert_eq!(grant.predicted_wait, Some(Duration::ZERO));
    assert_eq!(grant.ttft_target, Duration::from_secs(3));
    let refused = |reason: &str| {
        h.registry
            .gather()
            .iter()
            .filter(|f| f.name() == "sluice_queue_priority_rejections_total")
            .flat_map(|f| f.get_metric().iter())
            .filter(|m| m.get_label().iter().any(|l| l.value() == reason))
            .map(|m| m.get_counter().get_value())
            .sum::<f64>()
    };
    assert_eq!(refused("ttft_target_unmeetable"), 1.0);
    drop((live, high));
}

#[tokio::test(start_paused = true)]
async fn a_cold_mesh_predicts_from_capacity_never_from_zero_and_then_from_leases() {
    let mut cfg = config(Policy::Fcfs);
    cfg.ttft_target_secs = 3.0;
    let h = Harness::start(cfg);
    // Nothing is known of the workers' speed: a burst of 50 is admitted
    // (held in order), none refused for a rate of zero.
    h.queue.update_load(engine(2, true, 0));
    let mut live: Vec<Ticket> = (0..50)
        .map(|i| h.admit(sized(&format!("b{i}"), 0, 100)))
        .collect();
    settle().await;
    assert_eq!(h.queue.stats().pending, 48);
    drop(live.split_off(2));
    // The workers report their step time: 2 slots × 1 s per request.
    h.queue.update_load(engine(2, true, 10_000));
    for k in 0..6 {
        live.push(h.admit(sized(&format!("c{k}"), 0, 100)));
    }
    assert!(matches!(
        h.queue.admit(sized("c6", 0, 100)),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    // Leases turn out to last 0.25 s: the mean lease takes over, and four
    // times as many fit in the target.
    drop(live);
    let mut live = Vec::new();
    for round in 0..40 {
        let mut t = h.admit(sized(&format!("r{round}"), 0, 100));
        granted_soon(&mut t, "a free slot").await;
        tokio::time::sleep(Duration::from_millis(250)).await;
        drop(t);
    }
    for i in 0..2 {
        let mut t = h.admit(sized(&format!("run{i}"), 0, 100));
        granted_soon(&mut t, "a free slot").await;
        live.push(t);
    }
    for k in 0..20 {
        live.push(h.admit(sized(&format!("d{k}"), 0, 100)));
    }
    assert_eq!(h.queue.stats().pending, 20, "(20 + 1) × 0.25 / 2 ≤ 3 s");
    drop(live);
}

#[tokio::test(start_paused = true)]
async fn a_high_priority_prediction_counts_only_the_leases_that_free_its_slots() {
    let mut cfg = config(Policy::Strict);
    cfg.ttft_target_secs = 1.0;
    let h = Harness::start(cfg);
    h.queue.update_load(engine(2, true, 0));
    // Priority-0 leases last 10 s (parked behind higher work), priority-3
    // ones 0.2 s.
    for (priority, lease) in [(0, 10_000), (3, 200)] {
        let mut run: Vec<Ticket> = (0..2)
            .map(|i| h.admit(sized(&format!("learn{priority}-{i}"), priority, 100)))
            .collect();
        for t in &mut run {
            granted_soon(t, "a free slot").await;
        }
        tokio::time::sleep(Duration::from_millis(lease)).await;
        drop(run);
    }
    // Both slots run priority 3 (and two priority-0 requests are parked).
    let mut live: Vec<Ticket> = Vec::new();
    for (i, priority) in [0, 0, 3, 3].into_iter().enumerate() {
        let mut t = h.admit(sized(&format!("run{i}"), priority, 100));
        granted_soon(&mut t, "granted").await;
        live.push(t);
    }
    // A priority-3 slot frees every 0.1 s: nine held ones start within
    // 0.9 s. The mean over every lease (9 s) would refuse the first.
    for k in 0..9 {
        live.push(h.admit(sized(&format!("held{k}"), 3, 100)));
    }
    assert_eq!(h.queue.stats().pending, 9);
    let mut late = sized("late", 3, 100);
    late.desc.ttft_target_ms = 500;
    match h.queue.admit(late) {
        Err(QueueError::TargetUnmeetable { predicted, .. }) => {
            let ms = predicted.as_secs_f64() * 1000.0;
            assert!(
                (ms - 1000.0).abs() < 1.0,
                "ten priority-3 lease ends: {ms} ms"
            );
        }
        other => panic!("{other:?}"),
    }
    drop(live);
}

/// A 100-token request of `priority` with its own TTFT target.
fn targeted(id: &str, priority: i32, ttft_target_ms: u32) -> Entry {
    let mut e = sized(id, priority, 100);
    e.desc.ttft_target_ms = ttft_target_ms;
    e
}

/// A request of `priority` granted a free slot produces its first token
/// `start_ms` later: the queue learns a start time.
async fn learn_start(h: &Harness, id: &str, priority: i32, start_ms: u64) {
    let mut t = h.admit(sized(id, priority, 100));
    granted_soon(&mut t, "a free slot").await;
    tokio::time::sleep(Duration::from_millis(start_ms)).await;
    t.started();
    settle().await;
}

#[tokio::test(start_paused = true)]
async fn a_slow_start_of_low_priority_work_does_not_refuse_a_high_priority_request() {
    let h = Harness::start(config(Policy::Strict));
    h.queue.update_load(engine(4, true, 0));
    // Priority-0 requests wait 2 s for their first token (parked behind
    // higher work); priority-3 ones 50 ms.
    for (priority, start) in [(0, 2000), (3, 50)] {
        learn_start(&h, &format!("learn{priority}"), priority, start).await;
    }
    // A priority-3 request with a 1 s target starts in time: admitted.
    let mut t = h.admit(targeted("interactive", 3, 1000));
    granted_soon(&mut t, "admitted and granted").await;
    // A priority-0 one with the same target would start after 2 s.
    assert!(matches!(
        h.queue.admit(targeted("batch", 0, 1000)),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    drop(t);
}

#[tokio::test(start_paused = true)]
async fn a_request_released_at_once_is_refused_on_the_mean_start_not_its_margin() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.update_load(engine(4, true, 0));
    // Starts of 1 and 3 s in turn: a mean of about 2 s, the release lead
    // (four mean deviations more) about 6 s.
    for i in 0..20 {
        learn_start(
            &h,
            &format!("learn{i}"),
            0,
            if i % 2 == 0 { 1000 } else { 3000 },
        )
        .await;
    }
    // Free slots: released at once, so a 4 s target is expected to be met
    // (a slower than average start would miss it, an average one not) ...
    let mut t = h.admit(targeted("expected in time", 0, 4000));
    granted_soon(&mut t, "admitted and granted").await;
    // ... and a 1.5 s one is not.
    assert!(matches!(
        h.queue.admit(targeted("expected late", 0, 1500)),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    drop(t);
}

#[tokio::test(start_paused = true)]
async fn a_start_lead_past_the_target_refuses_only_while_starts_are_measured() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.update_load(engine(4, true, 0));
    // One request took 2 s from release to its first token.
    learn_start(&h, "slow", 0, 2000).await;
    // With a 1 s target, the next is refused: starts take longer.
    let target_1s = |id: &str| targeted(id, 0, 1000);
    assert!(matches!(
        h.queue.admit(target_1s("refused")),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    // Refused requests measure nothing: once no first token came for as
    // long as the lead (2 s), one is let in to measure starts again, and
    // only one ...
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let mut probe = h.admit(target_1s("probe"));
    granted_soon(&mut probe, "let in on its predicted wait").await;
    assert!(matches!(
        h.queue.admit(target_1s("behind the probe")),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    // ... and its start counts: still slow on average, so refused again.
    tokio::time::sleep(Duration::from_millis(50)).await;
    probe.started();
    settle().await;
    assert!(matches!(
        h.queue.admit(target_1s("refused again")),
        Err(QueueError::TargetUnmeetable { .. })
    ));
    drop(probe);
}

#[tokio::test(start_paused = true)]
async fn a_held_request_leaves_when_it_could_no_longer_start_within_its_target() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.update_load(engine(1, false, 0));
    // Requests take 200 ms from release to their first token.
    let mut first = h.admit(entry("first", 0, 0, 10, Instant::now()));
    granted_soon(&mut first, "a free slot").await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    first.started();
    let mut e = entry("held", 0, 0, 10, Instant::now());
    e.desc.ttft_target_ms = 1000;
    let mut held = h.admit(e);
    let started = Instant::now();
    assert!(matches!(
        held.granted().await,
        Err(QueueError::TargetMissed { .. })
    ));
    let left = started.elapsed();
    assert!(
        left >= Duration::from_millis(800) && left < Duration::from_millis(810),
        "left at the target less the start time: {left:?}"
    );
    drop(first);
}

#[tokio::test(start_paused = true)]
async fn a_request_still_held_at_its_target_leaves_with_429_before_any_token() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.update_load(engine(1, false, 0));
    let _running = h.admit(entry("run", 0, 0, 10, Instant::now()));
    let mut e = entry("held", 0, 0, 10, Instant::now());
    e.desc.ttft_target_ms = 500;
    let mut held = h.admit(e);
    let started = Instant::now();
    match held.granted().await {
        Err(QueueError::TargetMissed {
            waited,
            target,
            retry_after,
        }) => {
            assert_eq!(target, Duration::from_millis(500));
            assert!(
                waited >= target && waited < target + Duration::from_millis(10),
                "{waited:?}"
            );
            assert!(retry_after >= Duration::from_secs(1));
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() >= Duration::from_millis(500));
    assert_eq!(h.queue.stats().pending, 0);
    assert_eq!(h.placer.placed(), ["run"], "never placed");
    let status = tonic::Status::from(QueueError::TargetMissed {
        waited: Duration::from_millis(500),
        target: Duration::from_millis(500),
        retry_after: Duration::from_secs(2),
    });
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
}

/// One worker of `seqs` slots (preempting or not) on which other queue
/// replicas run `others` (priority → requests), while they hold `held`.
fn shared(seqs: u32, preempts: bool, others: &[(i32, u32)], held: &[(i32, u32)]) -> LoadView {
    let mut view = engine(seqs, preempts, 0);
    view.workers[0].others_by_priority = others.iter().copied().collect();
    if !held.is_empty() {
        view.held_elsewhere
            .insert("m".into(), held.iter().copied().collect());
    }
    view
}

#[tokio::test(start_paused = true)]
async fn queue_replicas_share_the_slots_the_others_leave() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.set_replicas(Replicas { count: 2, rank: 0 });
    // Five slots, two running the other replica's requests: three are ours.
    h.queue.update_load(shared(5, false, &[(0, 2)], &[]));
    let tickets: Vec<Ticket> = (0..5)
        .map(|i| h.admit(entry(&format!("r{i}"), 0, 0, 10, Instant::now())))
        .collect();
    settle().await;
    assert_eq!(h.placer.placed().len(), 3);
    // The other replica's requests end: ours take their slots.
    h.queue.update_load(shared(5, false, &[], &[]));
    settle().await;
    assert_eq!(h.placer.placed().len(), 5);
    drop(tickets);
}

#[tokio::test(start_paused = true)]
async fn a_replica_leaves_a_free_slot_to_a_higher_priority_held_at_another() {
    for preempts in [false, true] {
        let h = Harness::start(config(Policy::Fcfs));
        h.queue.set_replicas(Replicas { count: 2, rank: 0 });
        // Two slots, one running the other replica's priority-0 request;
        // the other replica holds a priority-3 request.
        h.queue
            .update_load(shared(2, preempts, &[(0, 1)], &[(3, 1)]));
        let mut low = h.admit(entry("low", 0, 0, 10, Instant::now()));
        settle().await;
        assert!(
            h.placer.placed().is_empty(),
            "the free slot is the priority-3 request's"
        );
        assert_eq!(
            low.held().map(|s| s.reason),
            Some(HoldReason::HigherElsewhere)
        );
        // An equal priority to the other's held one is not held back by it.
        let mut high = h.admit(entry("high", 3, 0, 10, Instant::now()));
        granted_soon(&mut high, "nothing higher elsewhere").await;
        drop(high);
        // The other replica placed its request (it runs now, nothing held).
        h.queue
            .update_load(shared(2, preempts, &[(0, 1), (3, 1)], &[]));
        settle().await;
        assert!(h.placer.placed().len() == 1, "both slots taken");
        h.queue.update_load(shared(2, preempts, &[(3, 1)], &[]));
        granted_soon(&mut low, "a slot freed").await;
    }
}

#[tokio::test(start_paused = true)]
async fn a_queue_reports_what_it_holds_when_it_changes() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.set_replicas(Replicas { count: 2, rank: 0 });
    h.queue.update_load(engine(1, false, 0));
    let mut run = h.admit(entry("run", 0, 0, 10, Instant::now()));
    granted_soon(&mut run, "a free slot").await;
    let held: Vec<Ticket> = [3, 0, 0]
        .iter()
        .enumerate()
        .map(|(i, &p)| h.admit(entry(&format!("h{i}"), p, 0, 10, Instant::now())))
        .collect();
    tokio::time::sleep(HELD_REPORT_INTERVAL * 2).await;
    let last = h.placer.held_reports.lock().last().cloned();
    let expected: HeldByModel = [("m".to_owned(), [(0, 2), (3, 1)].into_iter().collect())]
        .into_iter()
        .collect();
    assert_eq!(last, Some(expected));
    drop(held);
    tokio::time::sleep(HELD_REPORT_INTERVAL * 2).await;
    assert_eq!(
        h.placer.held_reports.lock().last().cloned(),
        Some(HeldByModel::new()),
        "nothing held"
    );
}

#[tokio::test(start_paused = true)]
async fn threshold_unset_ignores_prefill_tokens_and_unknown_seq_limits_hold_nothing() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.update_load(load(1_000_000));
    let mut tickets: Vec<Ticket> = (0..30)
        .map(|i| h.admit(entry(&format!("r{i}"), 0, 0, 500, Instant::now())))
        .collect();
    for ticket in &mut tickets {
        let first = ticket.next().await.expect("granted");
        assert!(
            matches!(first, TicketEvent::Granted(_)),
            "no held update: {first:?}"
        );
    }
    assert_eq!(h.placer.placed().len(), 30);
    let stats = h.queue.stats();
    assert_eq!((stats.pending, stats.active), (0, 30));
}

/// A queue holding above 50 of 100 prefill tokens on one worker whose
/// report says `reported` tokens are queued, and three 60-token requests
/// admitted in order.
fn three_at_threshold(reported: u64) -> (Harness, [Ticket; 3]) {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.5);
    let h = Harness::start(cfg);
    h.queue.update_load(load(reported));
    let t = Instant::now();
    let tickets = ["a", "b", "c"].map(|id| {
        let i = id.as_bytes()[0] - b'a';
        h.admit(entry(id, 0, 0, 60, at(t, u64::from(i))))
    });
    (h, tickets)
}

#[tokio::test(start_paused = true)]
async fn threshold_holds_while_every_worker_is_busy_and_releases_one_per_capacity() {
    let (h, [mut a, mut b, mut c]) = three_at_threshold(80);
    for (ticket, position) in [(&mut a, 0), (&mut b, 1), (&mut c, 2)] {
        let event = ticket.next().await.expect("held");
        assert_eq!(
            event,
            TicketEvent::Held(HeldStatus {
                position,
                pending: 3,
                reason: HoldReason::AboveThreshold
            })
        );
    }
    assert!(h.placer.placed().is_empty());

    // Capacity frees: one release, whose 60 uncached tokens make w0 busy again.
    h.queue.update_load(load(0));
    let grant = a.granted().await.expect("a granted");
    assert_eq!(grant.placement.worker, target("w0"));
    settle().await;
    assert_eq!(h.placer.placed(), ["a"]);
    assert_eq!(
        b.next().await.expect("moved up"),
        TicketEvent::Held(HeldStatus {
            position: 0,
            pending: 2,
            reason: HoldReason::AboveThreshold
        })
    );
    h.queue.update_load(load(10));
    b.granted().await.expect("b granted");
    settle().await;
    assert_eq!(h.placer.placed(), ["a", "b"]);
    assert_eq!(h.queue.stats().pending, 1);
}

#[tokio::test(start_paused = true)]
async fn a_first_token_frees_the_worker_for_the_next_release_without_a_load_report() {
    let (h, [mut a, mut b, mut c]) = three_at_threshold(0);
    a.granted().await.expect("a granted");
    settle().await;
    // a's 60 uncached tokens make w0 busy: b and c are held.
    assert_eq!(h.placer.placed(), ["a"]);
    held_above_threshold(&mut b).await;
    // a's first token: its prefill is done, and b goes at once, with the
    // same (stale) load report.
    a.started();
    granted_soon(&mut b, "b released without a new load report").await;
    settle().await;
    assert_eq!(h.placer.placed(), ["a", "b"]);
    // b ends before its first token: its prefill is not coming either.
    drop(b);
    granted_soon(&mut c, "c released once b left").await;
    settle().await;
    assert_eq!(h.placer.placed(), ["a", "b", "c"]);
}

#[tokio::test(start_paused = true)]
async fn one_worker_below_threshold_is_enough_and_prefill_pool_decides_when_present() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.0);
    let h = Harness::start(cfg);
    h.queue.update_load(LoadView {
        workers: vec![
            worker("busy", "m", WorkerRole::Aggregated, 500),
            worker("idle", "m", WorkerRole::Aggregated, 0),
            worker("other-model", "x", WorkerRole::Aggregated, 0),
        ],
        ..LoadView::default()
    });
    let mut a = h.admit(entry("a", 0, 0, 10, Instant::now()));
    a.granted().await.expect("one idle worker suffices");

    // Disaggregated: busy prefill workers hold even with idle decode workers.
    h.queue.update_load(LoadView {
        workers: vec![
            worker("p0", "m", WorkerRole::Prefill, 500),
            worker("d0", "m", WorkerRole::Decode, 0),
        ],
        ..LoadView::default()
    });
    let mut b = h.admit(entry("b", 0, 0, 10, Instant::now()));
    assert!(matches!(
        b.next().await.expect("held"),
        TicketEvent::Held(_)
    ));
}

#[tokio::test(start_paused = true)]
async fn protected_priorities_survive_a_low_priority_flood() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.0);
    cfg.max_pending = 10;
    cfg.shed_protect_priority = 0;
    cfg.shed_protect_fraction = 0.2; // 2 slots reserved
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let mut held = Vec::new();
    let mut shed = 0;
    for i in 0..50 {
        match h
            .queue
            .admit(entry(&format!("low{i}"), 0, 0, 10, Instant::now()))
        {
            Ok(t) => held.push(t),
            Err(QueueError::Shed { reserved, .. }) => {
                assert_eq!(reserved, 2);
                shed += 1;
            }
            Err(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((held.len(), shed), (8, 42));
    for i in 0..2 {
        held.push(h.admit(entry(&format!("high{i}"), 1, 0, 10, Instant::now())));
    }
    // Full: a higher priority displaces the newest of the lowest held.
    let extra = h.admit(entry("high-extra", 5, 0, 10, Instant::now()));
    let mut low7 = held.swap_remove(7);
    match low7.granted().await {
        Err(QueueError::Displaced {
            priority: 0,
            by: 5,
            retry_after,
        }) => {
            assert!(retry_after >= Duration::from_secs(1));
        }
        other => panic!("low7 displaced, got {other:?}"),
    }
    held.push(extra);
    // Nothing held ranks below priority 0: a full queue refuses it.
    let err = h
        .queue
        .admit(entry("low-extra", 0, 0, 10, Instant::now()))
        .expect_err("full");
    assert!(matches!(
        err,
        QueueError::QueueFull {
            pending: 10,
            limit: 10,
            ..
        }
    ));
    let status = tonic::Status::from(err);
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert!(status.metadata().get("retry-after").is_some());
    assert_eq!(h.metric("sluice_queue_rejections_total"), 44.0);
}

#[tokio::test(start_paused = true)]
async fn retry_after_follows_the_drain_rate() {
    let mut cfg = config(Policy::Fcfs);
    cfg.max_active = 1;
    cfg.max_pending = 4;
    let h = Harness::start(cfg);
    // One grant every 500 ms for 20 s: 2 per second.
    for i in 0..40 {
        let mut t = h.admit(entry(&format!("r{i}"), 0, 0, 10, Instant::now()));
        t.granted().await.expect("granted");
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(t);
    }
    let blocker = h.admit(entry("blocker", 0, 0, 10, Instant::now()));
    settle().await;
    let held: Vec<Ticket> = (0..4)
        .map(|i| h.admit(entry(&format!("h{i}"), 0, 0, 10, Instant::now())))
        .collect();
    let err = h
        .queue
        .admit(entry("over", 0, 0, 10, Instant::now()))
        .expect_err("full");
    // 4 held (the granted blocker is not pending) and this one at about
    // 2 per second: 3 s.
    match err {
        QueueError::QueueFull { retry_after, .. } => {
            assert!((2..=4).contains(&retry_after.as_secs()), "{retry_after:?}");
        }
        other => panic!("{other:?}"),
    }
    drop((blocker, held));
}

#[tokio::test(start_paused = true)]
async fn overload_yields_queue_full_and_tenant_full() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.0);
    cfg.max_pending = 3;
    cfg.max_pending_per_tenant = 2;
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let mut tenant_a = entry("a1", 0, 0, 10, Instant::now());
    tenant_a.desc.tenant = "a".into();
    let _a1 = h.admit(tenant_a.clone());
    let named = |id: &str| {
        let mut e = tenant_a.clone();
        e.desc.request_id = id.into();
        e
    };
    let _a2 = h.admit(named("a2"));
    let err = h.queue.admit(named("a3")).expect_err("tenant full");
    assert!(
        matches!(err, QueueError::TenantFull { ref tenant, pending: 2, limit: 2, .. } if tenant == "a")
    );
    let _b1 = h.admit(entry("b1", 0, 0, 10, Instant::now()));
    let err = h
        .queue
        .admit(entry("b2", 0, 0, 10, Instant::now()))
        .expect_err("queue full");
    assert!(matches!(
        err,
        QueueError::QueueFull {
            pending: 3,
            limit: 3,
            ..
        }
    ));
    assert_eq!(
        tonic::Status::from(err).code(),
        tonic::Code::ResourceExhausted
    );
}

#[tokio::test(start_paused = true)]
async fn dropped_lease_frees_its_slot_for_the_next_request() {
    let mut cfg = config(Policy::Fcfs);
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut first = h.admit(entry("first", 0, 0, 10, Instant::now()));
    first.granted().await.expect("first granted");
    let mut second = h.admit(entry("second", 0, 0, 10, Instant::now()));
    assert_eq!(
        second.next().await.expect("held"),
        TicketEvent::Held(HeldStatus {
            position: 0,
            pending: 1,
            reason: HoldReason::ActiveLimit
        })
    );
    assert_eq!(h.metric("sluice_queue_active_leases"), 1.0);
    drop(first);
    second.granted().await.expect("slot freed");
    let stats = h.queue.stats();
    assert_eq!((stats.pending, stats.active), (0, 1));
    drop(second);
    settle().await;
    assert_eq!(h.queue.stats().active, 0);
    assert_eq!(h.metric("sluice_queue_active_leases"), 0.0);
}

#[tokio::test(start_paused = true)]
async fn held_then_cancelled_request_never_reaches_placement() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.5);
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let mut doomed = h.admit(entry("doomed", 9, 0, 10, Instant::now()));
    assert!(matches!(
        doomed.next().await.expect("held"),
        TicketEvent::Held(_)
    ));
    drop(doomed);
    assert_eq!(h.queue.stats().pending, 0);
    assert_eq!(h.metric("sluice_queue_pending_requests"), 0.0);
    assert_eq!(h.metric("sluice_queue_cancellations_total"), 1.0);
    h.queue.update_load(load(0));
    let mut next = h.admit(entry("next", 0, 0, 10, Instant::now()));
    next.granted().await.expect("granted");
    assert_eq!(h.placer.placed(), ["next"]);
}

#[tokio::test(start_paused = true)]
async fn cancel_during_placement_frees_pending_without_leaking_a_lease() {
    let placer = TestPlacer {
        delay: Some(Duration::from_millis(50)),
        ..TestPlacer::default()
    };
    let h = Harness::with_placer(config(Policy::Fcfs), placer);
    let ticket = h.admit(entry("slow", 0, 0, 10, Instant::now()));
    settle().await; // placement in flight
    drop(ticket);
    assert_eq!(h.queue.stats().pending, 0);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stats = h.queue.stats();
    assert_eq!((stats.pending, stats.active), (0, 0));
    assert_eq!(h.metric("sluice_queue_active_leases"), 0.0);
}

#[tokio::test(start_paused = true)]
async fn deadline_passed_while_held_fails_with_deadline_exceeded() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.5);
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let now = Instant::now();
    let mut e = entry("late", 0, 0, 10, now);
    e.deadline = Some(now + Duration::from_millis(250));
    let mut ticket = h.admit(e);
    let err = ticket.granted().await.expect_err("expired");
    match err {
        QueueError::DeadlineExceeded { waited } => assert_eq!(waited, Duration::from_millis(250)),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(h.queue.stats().pending, 0);
    assert_eq!(h.metric("sluice_queue_expiries_total"), 1.0);
    let mut past = entry("already-late", 0, 0, 10, Instant::now());
    past.deadline = Some(Instant::now());
    assert!(matches!(
        h.queue.admit(past),
        Err(QueueError::DeadlineExceeded { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn stale_overlap_is_reread_before_release_and_reorders_wspt() {
    let mut cfg = config(Policy::Wspt);
    cfg.queue_threshold = Some(0.5);
    cfg.refresh_interval_ms = 100;
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let t = Instant::now();
    let mut a = entry("a", 0, 0, 1000, t);
    a.overlap_tokens = 900; // 100 uncached: first
    let mut b = entry("b", 0, 0, 1000, t);
    b.overlap_tokens = 500; // 500 uncached: second
    let mut a = h.admit(a);
    let mut b = h.admit(b);
    settle().await;
    assert_eq!(*h.placer.refreshed.lock(), ["a", "b"], "first estimates");
    // a's cached prefix is evicted while it waits.
    h.placer.fresh_overlap.lock().insert("a".into(), 0);
    tokio::time::sleep(Duration::from_millis(200)).await;
    h.queue.update_load(load(0));
    b.granted().await.expect("b first");
    assert_eq!(*h.placer.refreshed.lock(), ["a", "b", "a", "b"]);
    assert_eq!(h.placer.placed(), ["b"]);
    h.queue.update_load(load(0));
    let grant = a.granted().await.expect("a second");
    assert_eq!(grant.placement.overlap_tokens, 0, "fresh overlap used");
    assert_eq!(h.placer.placed(), ["b", "a"]);
}

#[tokio::test(start_paused = true)]
async fn wspt_reads_a_first_overlap_estimate_for_held_requests() {
    let mut cfg = config(Policy::Wspt);
    cfg.queue_threshold = Some(0.5);
    let placer = TestPlacer::default();
    placer.fresh_overlap.lock().insert("cached".into(), 900);
    let h = Harness::with_placer(cfg, placer);
    h.queue.update_load(load(1000));
    let t = Instant::now();
    let mut cold = h.admit(entry("cold", 0, 0, 500, t));
    let mut cached = h.admit(entry("cached", 0, 0, 1000, t));
    settle().await;
    assert_eq!(
        cached.held().map(|s| s.position),
        Some(0),
        "100 uncached beats 500"
    );
    h.queue.update_load(load(0));
    cached.granted().await.expect("cached first");
    h.queue.update_load(load(0));
    cold.granted().await.expect("cold second");
    assert_eq!(h.placer.placed(), ["cached", "cold"]);
}

#[tokio::test(start_paused = true)]
async fn positions_update_when_an_earlier_request_leaves() {
    let mut cfg = config(Policy::Fcfs);
    cfg.queue_threshold = Some(0.5);
    let h = Harness::start(cfg);
    h.queue.update_load(load(1000));
    let t = Instant::now();
    let a = h.admit(entry("a", 0, 0, 10, at(t, 0)));
    let mut b = h.admit(entry("b", 0, 0, 10, at(t, 1)));
    let c = h.admit(entry("c", 0, 0, 10, at(t, 2)));
    settle().await;
    assert_eq!(b.held().map(|s| s.position), Some(1));
    assert_eq!(c.held().map(|s| s.position), Some(2));
    drop(a);
    settle().await;
    assert_eq!(
        b.held().map(|s| (s.position, s.pending)),
        Some((0, 2)),
        "reaching the head is sent at once"
    );
    assert_eq!(
        c.held().map(|s| (s.position, s.pending)),
        Some((2, 3)),
        "other moves wait for the interval"
    );
    tokio::time::sleep(POSITION_INTERVAL).await;
    assert_eq!(c.held().map(|s| (s.position, s.pending)), Some((1, 2)));
    assert!(matches!(b.next().await, Ok(TicketEvent::Held(_))));
    let stats = h.queue.stats();
    assert_eq!(stats.tiers.len(), 1);
    assert_eq!(stats.tiers[0].pending, 2);
    assert_eq!(stats.tiers[0].pending_tokens, 20);
}

#[tokio::test(start_paused = true)]
async fn placement_failure_reaches_the_ticket_and_frees_the_slot() {
    let placer = TestPlacer {
        fail: true,
        ..TestPlacer::default()
    };
    let h = Harness::with_placer(config(Policy::Fcfs), placer);
    let mut ticket = h.admit(entry("r", 0, 0, 10, Instant::now()));
    let err = ticket.granted().await.expect_err("no workers");
    assert!(matches!(err, QueueError::NoWorkers { .. }));
    let stats = h.queue.stats();
    assert_eq!((stats.pending, stats.active), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn shutdown_fails_held_requests_and_refuses_new_ones_but_keeps_leases() {
    let mut cfg = config(Policy::Fcfs);
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut granted = h.admit(entry("granted", 0, 0, 10, Instant::now()));
    granted.granted().await.expect("granted");
    let mut held = h.admit(entry("held", 0, 0, 10, Instant::now()));
    settle().await;
    h.shutdown.cancel();
    h.dispatcher.await.expect("dispatcher ends");
    assert!(matches!(held.granted().await, Err(QueueError::Draining)));
    assert!(matches!(
        h.queue.admit(entry("new", 0, 0, 10, Instant::now())),
        Err(QueueError::Draining)
    ));
    assert_eq!(h.queue.stats().active, 1);
    drop(granted);
    assert_eq!(h.queue.stats().active, 0);
}

/// Random admits, cancels, deadlines, load changes and lease ends: counts,
/// gauges and ticket states always agree, and nothing leaks.
#[tokio::test(start_paused = true)]
async fn random_traffic_keeps_counts_and_gauges_consistent() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    for policy in [
        Policy::Fcfs,
        Policy::Wspt,
        Policy::Strict,
        Policy::Wfq,
        Policy::Fair,
    ] {
        for seed in 0..3u64 {
            let mut cfg = config(policy);
            cfg.queue_threshold = Some(0.5);
            cfg.max_pending = 40;
            cfg.max_pending_per_tenant = 20;
            cfg.shed_protect_fraction = 0.2;
            cfg.refresh_interval_ms = 50;
            cfg.max_active = if seed == 2 { 5 } else { 0 };
            cfg.wfq_class = WfqClass::TenantPriority;
            cfg.wfq_cost = if seed == 1 {
                WfqCost::Tokens
            } else {
                WfqCost::Requests
            };
            cfg.tenant_limits = Some(
                "t0 weight=3 concurrency=6\nt1 tpm=20000\n"
                    .parse()
                    .expect("limits"),
            );
            let h = Harness::start(cfg);
            let mut rng = StdRng::seed_from_u64(seed);
            let mut tickets: Vec<Ticket> = Vec::new();
            for step in 0..300 {
                match rng.random_range(0..10) {
                    0..=4 => {
                        let now = Instant::now();
                        let mut e = entry(
                            &format!("r{step}"),
                            rng.random_range(-2..4),
                            rng.random_range(0..2),
                            rng.random_range(1..200),
                            now,
                        );
                        e.desc.tenant = format!("t{}", rng.random_range(0..3));
                        e.overlap_tokens = rng.random_range(0..100);
                        if rng.random_bool(0.3) {
                            e.deadline =
                                Some(now + Duration::from_millis(rng.random_range(1..300)));
                        }
                        if let Ok(t) = h.queue.admit(e) {
                            tickets.push(t);
                        }
                    }
                    5 | 6 if !tickets.is_empty() => {
                        let i = rng.random_range(0..tickets.len());
                        let ticket = tickets.swap_remove(i);
                        if rng.random_bool(0.5) {
                            ticket.started();
                        }
                        ticket.progress(rng.random_range(0..300));
                        drop(ticket);
                    }
                    7 | 8 => {
                        let mut view = load(rng.random_range(0..120));
                        view.workers[0].priority_scheduling = rng.random_bool(0.5);
                        h.queue.update_load(view);
                    }
                    _ => tokio::time::sleep(Duration::from_millis(rng.random_range(0..80))).await,
                }
                settle().await;
                let (mut pending, mut active) = (0, 0);
                for t in &tickets {
                    match &*t.rx.borrow() {
                        TicketState::Granted(_) => active += 1,
                        TicketState::Failed(_) => {}
                        TicketState::Held(_) | TicketState::Waiting => pending += 1,
                    }
                }
                let stats = h.queue.stats();
                assert_eq!(
                    (stats.pending, stats.active),
                    (pending, active),
                    "{policy} seed {seed} step {step}"
                );
                assert_eq!(h.metric("sluice_queue_pending_requests"), pending as f64);
                assert_eq!(h.metric("sluice_queue_active_leases"), active as f64);
                assert!(pending <= 40);
            }
            assert!(
                h.metric("sluice_queue_grants_total") > 10.0,
                "traffic flowed"
            );
            assert!(
                h.metric("sluice_queue_rejections_total") > 0.0,
                "limits hit"
            );
            drop(tickets);
            let stats = h.queue.stats();
            assert_eq!((stats.pending, stats.active), (0, 0));
            assert_eq!(h.metric("sluice_queue_pending_tokens"), 0.0);
            let st = h.queue.shared.state.lock();
            assert!(st.slots.is_empty() && st.deadlines.is_empty());
            st.check();
            assert!(
                st.starting_prefill.is_empty(),
                "{policy} seed {seed}: no grant left counted as starting"
            );
            for (name, model) in &st.models {
                assert!(
                    model.order.is_empty(),
                    "{policy} seed {seed}: model {name} holds nothing"
                );
                if let Order::Fair(bands) = &model.order {
                    assert!(bands.is_empty(), "{policy} seed {seed}: bands idle");
                }
                assert!(
                    model.starting.is_empty() && !model.express,
                    "{policy} seed {seed}: nothing left starting"
                );
            }
        }
    }
}

/// Admits `entries` held behind a blocker on a queue with one lease at a
/// time; each granted request reports `output(id)` output tokens and ends.
/// Returns the release order.
async fn serve_one_at_a_time(
    mut cfg: Args,
    entries: Vec<Entry>,
    output: fn(&str) -> u32,
) -> Vec<String> {
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut blocker = h.admit(entry("blocker", BLOCKER, 0, 10, Instant::now()));
    blocker.granted().await.expect("blocker granted");
    let waiters: Vec<JoinHandle<()>> = entries
        .into_iter()
        .map(|e| {
            let tokens = output(&e.desc.request_id);
            let mut ticket = h.admit(e);
            tokio::spawn(async move {
                ticket.granted().await.expect("granted");
                ticket.progress(tokens / 2);
                ticket.progress(tokens);
            })
        })
        .collect();
    settle().await;
    drop(blocker);
    for waiter in waiters {
        waiter.await.expect("join");
    }
    let mut placed = h.placer.placed();
    placed.remove(0);
    placed
}

/// Work (prompt + output tokens) served to each of `tenants` over the
/// releases in `order` while every one of them still had requests held.
fn shares_while_backlogged(order: &[String], tenants: &[&str], work: fn(&str) -> u32) -> Vec<f64> {
    let last = |t: &str| order.iter().rposition(|id| id.starts_with(t)).unwrap_or(0);
    let end = tenants.iter().map(|t| last(t)).min().unwrap_or(0);
    let served: Vec<f64> = tenants
        .iter()
        .map(|t| {
            order[..end]
                .iter()
                .filter(|id| id.starts_with(t))
                .map(|id| f64::from(work(id)))
                .sum()
        })
        .collect();
    let total: f64 = served.iter().sum();
    served.iter().map(|s| s / total).collect()
}

/// heavy: prompts of 800 tokens, 200 output; light: 100 and 100.
fn tenant_entries(heavy: usize, light: usize, priority: i32) -> Vec<Entry> {
    let t = Instant::now();
    let mut entries = Vec::new();
    for i in 0..heavy.max(light) {
        for (tenant, count, prompt) in [("heavy", heavy, 800), ("light", light, 100)] {
            if i < count {
                let mut e = entry(
                    &format!("{tenant}-{i}"),
                    priority,
                    0,
                    prompt,
                    at(t, i as u64),
                );
                e.desc.tenant = tenant.into();
                entries.push(e);
            }
        }
    }
    entries
}

fn output_tokens(id: &str) -> u32 {
    if id.starts_with("heavy") { 200 } else { 100 }
}

fn work_tokens(id: &str) -> u32 {
    if id.starts_with("heavy") { 1000 } else { 200 }
}

#[tokio::test(start_paused = true)]
async fn fair_shares_tokens_between_backlogged_tenants_by_weight() {
    // Equal weights: each tenant gets half the tokens, though heavy's
    // requests are 5x light's (by request count light gets ~5x heavy).
    let order = serve_one_at_a_time(
        config(Policy::Fair),
        tenant_entries(60, 200, 0),
        output_tokens,
    )
    .await;
    let shares = shares_while_backlogged(&order, &["heavy", "light"], work_tokens);
    assert!(
        (shares[0] - 0.5).abs() < 0.05,
        "1:1 shares {shares:?}: {order:?}"
    );

    // Weights 3:1 from --tenant-limits.
    let mut cfg = config(Policy::Fair);
    cfg.tenant_limits = Some("heavy weight=3\n".parse().expect("limits"));
    let order = serve_one_at_a_time(cfg, tenant_entries(150, 200, 0), output_tokens).await;
    let shares = shares_while_backlogged(&order, &["heavy", "light"], work_tokens);
    assert!((shares[0] - 0.75).abs() < 0.05, "3:1 shares {shares:?}");

    // The same weight from the request (the API key file's) works alike.
    let mut entries = tenant_entries(150, 200, 0);
    for e in &mut entries {
        e.desc.tenant_weight = if e.desc.tenant == "heavy" { 3 } else { 1 };
    }
    let order = serve_one_at_a_time(config(Policy::Fair), entries, output_tokens).await;
    let shares = shares_while_backlogged(&order, &["heavy", "light"], work_tokens);
    assert!((shares[0] - 0.75).abs() < 0.05, "3:1 shares {shares:?}");

    // Request-counting wfq by tenant shares requests instead: heavy takes
    // 5x light's tokens.
    let mut cfg = config(Policy::Wfq);
    cfg.wfq_class = WfqClass::Tenant;
    let order = serve_one_at_a_time(cfg, tenant_entries(60, 200, 0), output_tokens).await;
    let shares = shares_while_backlogged(&order, &["heavy", "light"], work_tokens);
    assert!(
        (shares[0] - 5.0 / 6.0).abs() < 0.05,
        "wfq by request {shares:?}"
    );
    // ... and with token cost it is fair in tokens too.
    let mut cfg = config(Policy::Wfq);
    cfg.wfq_class = WfqClass::Tenant;
    cfg.wfq_cost = WfqCost::Tokens;
    let order = serve_one_at_a_time(cfg, tenant_entries(60, 200, 0), output_tokens).await;
    let shares = shares_while_backlogged(&order, &["heavy", "light"], work_tokens);
    assert!((shares[0] - 0.5).abs() < 0.05, "wfq by token {shares:?}");
}

#[tokio::test(start_paused = true)]
async fn fair_keeps_strict_priority_between_bands() {
    let mut entries = tenant_entries(20, 20, 0);
    let t = Instant::now();
    for i in 0..3 {
        let mut e = entry(&format!("vip-{i}"), 1, 0, 800, at(t, 100 + i));
        e.desc.tenant = "vip".into();
        entries.push(e);
    }
    let order = serve_one_at_a_time(config(Policy::Fair), entries, output_tokens).await;
    assert_eq!(&order[..3], ["vip-0", "vip-1", "vip-2"], "{order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_cached_prefix_is_not_charged_and_output_is_charged_as_reported() {
    let mut cfg = config(Policy::Fair);
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut e = entry("a", 0, 0, 1000, Instant::now());
    e.desc.tenant = "t".into();
    e.overlap_tokens = 0;
    let mut a = h.admit(e);
    a.granted().await.expect("granted");
    let counter = |h: &Harness| {
        let st = h.queue.shared.state.lock();
        match &st.models["m"].order {
            Order::Fair(bands) => bands.values().find_map(|b| b.counter("t")),
            Order::Keyed(_) => None,
        }
    };
    // The test placer reports the entry's own overlap (0): all 1000 charged.
    assert_eq!(counter(&h), Some(1000.0));
    a.progress(40);
    a.progress(30); // a running total never goes back
    a.progress(100);
    assert_eq!(counter(&h), Some(1100.0));
    drop(a);
    settle().await;
    // The model stays (what it learned of the workers' speed), its idle
    // band goes.
    assert!(
        h.queue
            .shared
            .state
            .lock()
            .models
            .get("m")
            .is_none_or(|m| matches!(&m.order, Order::Fair(bands) if bands.is_empty())),
        "idle band dropped"
    );
}

/// A priority-0 request of `tenant` with a `prompt`-token prompt, arriving now.
fn tenant_entry(id: &str, tenant: &str, prompt: u32) -> Entry {
    let mut e = entry(id, 0, 0, prompt, Instant::now());
    e.desc.tenant = tenant.into();
    e
}

#[tokio::test(start_paused = true)]
async fn quotas_refuse_with_retry_after_and_refund_what_never_ran() {
    let mut cfg = config(Policy::Fair);
    cfg.max_active = 1;
    cfg.tenant_limits = Some("a tpm=600\nb concurrency=1\n".parse().expect("limits"));
    let h = Harness::start(cfg);
    let mut first = h.admit(tenant_entry("a1", "a", 500));
    first.granted().await.expect("granted");
    first.progress(200); // 600 - 500 - 200 = -100
    let err = h
        .queue
        .admit(tenant_entry("a2", "a", 10))
        .expect_err("over the token quota");
    assert!(
        matches!(
            &err,
            QueueError::QuotaExceeded { quota: Quota::Tokens { per_minute: 600, .. }, retry_after, .. }
                if retry_after.as_secs() == 11
        ),
        "{err:?}"
    );
    assert_eq!(h.metric("sluice_queue_tenant_rejections_total"), 1.0);
    // A held request that leaves before it runs gets its prompt back.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let held = h.admit(tenant_entry("a3", "a", 400)); // held: a1 holds the lease
    settle().await;
    drop(held);
    let again = h.queue.admit(tenant_entry("a4", "a", 10));
    assert!(again.is_ok(), "the held request's 400 tokens were refunded");
    drop(again);
    drop(first);

    let b1 = h.admit(tenant_entry("b1", "b", 1));
    let err = h
        .queue
        .admit(tenant_entry("b2", "b", 1))
        .expect_err("one at a time");
    assert_eq!(err.reason(), QueueReason::QuotaRequests);
    drop(b1);
    assert!(h.queue.admit(tenant_entry("b3", "b", 1)).is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_light_tenant_behind_a_heavy_backlog_is_released_next() {
    let mut cfg = config(Policy::Fair);
    cfg.max_active = 1;
    let h = Harness::start(cfg);
    let mut first = h.admit(tenant_entry("heavy-0", "heavy", 800));
    first.granted().await.expect("granted");
    let heavy: Vec<Ticket> = (1..5)
        .map(|i| h.admit(tenant_entry(&format!("heavy-{i}"), "heavy", 800)))
        .collect();
    settle().await;
    // Light arrives last, behind four held heavy requests: it is lifted
    // to heavy's counter and, the one served least, wins the tie.
    let light = h.admit(tenant_entry("light-0", "light", 100));
    settle().await;
    drop(first);
    settle().await;
    assert_eq!(h.placer.placed(), ["heavy-0", "light-0"]);
    drop(light);
    settle().await;
    assert_eq!(h.placer.placed()[2], "heavy-1", "then heavy again");
    drop(heavy);
}

/// A `fair` queue that holds while its one worker has any prefill queued.
fn fair_with_threshold_zero() -> Harness {
    let mut cfg = config(Policy::Fair);
    cfg.queue_threshold = Some(0.0);
    let h = Harness::start(cfg);
    h.queue.update_load(load(0));
    h
}

#[tokio::test(start_paused = true)]
async fn a_tenant_with_nothing_starting_passes_a_busy_threshold_one_request_at_a_time() {
    let h = fair_with_threshold_zero();
    let mut heavy0 = h.admit(tenant_entry("heavy-0", "heavy", 60));
    let grant = heavy0.granted().await.expect("heavy-0 granted");
    assert!(!grant.express, "w0 was idle: an ordinary release");
    // heavy-0's prompt makes w0 busy: heavy's next waits for its first token.
    let mut heavy1 = h.admit(tenant_entry("heavy-1", "heavy", 60));
    held_above_threshold(&mut heavy1).await;
    // light has nothing starting: its request goes past the busy worker
    // at once, to be in the engine's next step...
    let mut light0 = h.admit(tenant_entry("light-0", "light", 60));
    let grant = granted_soon(&mut light0, "light-0 released while w0 is busy").await;
    assert!(grant.express, "the grant says it passed the threshold");
    // ...but one at a time: light's second request waits like everyone.
    let light1 = h.admit(tenant_entry("light-1", "light", 60));
    settle().await;
    assert_eq!(h.placer.placed(), ["heavy-0", "light-0"]);
    // light-0's first token: heavy-1 is next in fair order, and heavy still
    // has heavy-0 starting, so nothing passes the threshold.
    light0.started();
    settle().await;
    assert_eq!(h.placer.placed(), ["heavy-0", "light-0"]);
    // heavy-0's first token frees w0: heavy-1 goes as usual.
    heavy0.started();
    let grant = granted_soon(&mut heavy1, "heavy-1 released once w0 is free").await;
    assert!(!grant.express);
    // heavy-1 makes w0 busy again, and light has nothing starting any
    // more: light-1 passes as light-0 did.
    let mut light1 = light1;
    let grant = granted_soon(&mut light1, "light-1 released while w0 is busy").await;
    assert!(grant.express);
    settle().await;
    assert_eq!(
        h.placer.placed(),
        ["heavy-0", "light-0", "heavy-1", "light-1"]
    );
    assert_eq!(h.metric("sluice_queue_express_grants_total"), 2.0);
}

#[tokio::test(start_paused = true)]
async fn one_request_per_model_passes_a_busy_threshold_at_a_time() {
    let h = fair_with_threshold_zero();
    let mut heavy0 = h.admit(tenant_entry("heavy-0", "heavy", 60));
    heavy0.granted().await.expect("heavy-0 granted");
    let mut light0 = h.admit(tenant_entry("light-0", "light", 60));
    granted_soon(&mut light0, "light-0 released while w0 is busy").await;
    // A third tenant with nothing starting is next, but light-0 is past
    // the threshold without its first token: it waits.
    let mut other0 = h.admit(tenant_entry("other-0", "other", 60));
    held_above_threshold(&mut other0).await;
    settle().await;
    assert_eq!(h.placer.placed(), ["heavy-0", "light-0"]);
    // light-0's first token: the next one may pass.
    light0.started();
    granted_soon(&mut other0, "other-0 released once light-0 started").await;
    assert_eq!(h.placer.placed(), ["heavy-0", "light-0", "other-0"]);
}

/// A `strict` queue with threshold 0.25 (25 of the worker's 100-token
/// budget) over one worker whose engine may or may not schedule by
/// priority, with `low-0` (priority 0, 60 prompt tokens) granted on the
/// idle worker: its prefill is queued there, above the threshold.
async fn low_prefill_queued(priority_scheduling: bool) -> (Harness, Ticket) {
    let mut cfg = config(Policy::Strict);
    cfg.queue_threshold = Some(0.25);
    let h = Harness::start(cfg);
    let mut view = load(0);
    view.workers[0].priority_scheduling = priority_scheduling;
    h.queue.update_load(view);
    let mut low0 = h.admit(entry("low-0", 0, 0, 60, Instant::now()));
    low0.granted()
        .await
        .expect("low-0 granted: the worker was idle");
    (h, low0)
}

#[tokio::test(start_paused = true)]
async fn lower_priority_prefill_does_not_hold_a_request_on_a_priority_scheduled_worker() {
    let t0 = Instant::now();
    let (h, low0) = low_prefill_queued(true).await;
    // low-0's 60 prompt tokens are queued on w0: a request of the same
    // priority waits for them, as the threshold says...
    let mut low1 = h.admit(entry("low-1", 0, 0, 60, t0));
    held_above_threshold(&mut low1).await;
    // ...but the worker's engine runs a higher priority first: low-0's
    // prefill is not ahead of it, so it is not held for it.
    let mut high0 = h.admit(entry("high-0", 3, 0, 60, t0));
    granted_soon(&mut high0, "high-0 released past lower-priority prefill").await;
    // Another of the same high priority waits for high-0's prefill.
    let mut high1 = h.admit(entry("high-1", 3, 0, 60, t0));
    held_above_threshold(&mut high1).await;
    settle().await;
    assert_eq!(h.placer.placed(), ["low-0", "high-0"]);
    // high-0's first token: only lower-priority prefill is left on w0.
    high0.started();
    granted_soon(&mut high1, "high-1 released once high-0 started").await;
    // low-0 and high-1 start: everything is computed, low-1 goes.
    low0.started();
    high1.started();
    granted_soon(&mut low1, "low-1 released once w0's prefill is done").await;
}

#[tokio::test(start_paused = true)]
async fn lower_priority_prefill_holds_a_request_on_a_fcfs_worker() {
    let t0 = Instant::now();
    let (h, low0) = low_prefill_queued(false).await;
    // The engine serves in arrival order: low-0's prefill is ahead of
    // anything sent now, whatever its priority.
    let mut high0 = h.admit(entry("high-0", 3, 0, 60, t0));
    held_above_threshold(&mut high0).await;
    low0.started();
    high0
        .granted()
        .await
        .expect("high-0 granted once low-0 started");
}

/// The other replica's priority-3 request on the only slot is not
/// preempted for a priority-0 one: this replica holds it.
#[tokio::test(start_paused = true)]
async fn a_replica_counts_the_others_higher_priority_placements() {
    let h = Harness::start(config(Policy::Fcfs));
    h.queue.set_replicas(Replicas { count: 2, rank: 1 });
    h.queue.update_load(shared(1, true, &[(3, 1)], &[]));
    let low = h.admit(entry("low", 0, 0, 10, Instant::now()));
    settle().await;
    assert!(h.placer.placed().is_empty());
    drop(low);
}

/// A grant rate decayed to almost nothing (the last grant long ago) gives
/// the longest Retry-After, not a wait that overflows a Duration (the gRPC
/// fuzz test found the panic).
#[test]
fn a_drain_rate_decayed_to_nothing_gives_the_longest_retry_after() {
    let start = Instant::now();
    let mut rate = DrainRate::default();
    rate.grant(start);
    let later = start + Duration::from_secs(3000);
    assert_eq!(rate.retry_after(1_000_000, later), Duration::from_secs(60));
}

#[test]
fn a_held_request_leaves_for_its_start_ahead_of_slower_than_average_starts() {
    use std::time::Duration;
    let mut model = hold::ModelQueue::new(Policy::Fcfs);
    assert_eq!(
        model.start_lead(1),
        Duration::ZERO,
        "nothing known: no lead"
    );
    // Starts of 50 and 150 ms in turn: a mean of about 100 ms. Released at
    // the mean alone, half of them would miss their target.
    for i in 0..40 {
        let ms = if i % 2 == 0 { 50 } else { 150 };
        model.started_after(1, Duration::from_millis(ms), Instant::now());
    }
    let lead = model.start_lead(1);
    assert!(
        lead >= Duration::from_millis(150),
        "the lead covers the slower starts: {lead:?}"
    );
    assert!(
        lead <= Duration::from_millis(400),
        "and not much more: {lead:?}"
    );
    // Steady starts leave little margin beyond them.
    let mut steady = hold::ModelQueue::new(Policy::Fcfs);
    for _ in 0..40 {
        steady.started_after(2, Duration::from_millis(100), Instant::now());
    }
    let lead = steady.start_lead(2);
    assert_eq!(lead, Duration::from_millis(100));
}
